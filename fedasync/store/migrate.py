"""Schema management with Alembic.

The schema of a fedasync store is versioned by the Alembic revisions in
``fedasync/store/migrations/versions/``. :func:`upgrade` brings a database to the newest
revision; ``Store(url)`` calls it on open, so a user never runs Alembic by hand. It is safe to
call from several processes at once: PostgreSQL takes a transaction-level advisory lock,
a SQLite file is locked with ``flock`` on ``<db>.migrate.lock``.

A database created before the schema was versioned (``Base.metadata.create_all`` by fedasync
0.1.0 and the commits up to the migrations) has the tables but no ``alembic_version``. Its
schema is compared with the revisions' (:func:`_adopt_unversioned`): the known differences of
those versions are repaired (``updates.pending_params`` added; ``node_id`` BIGINT made text),
it is stamped at the baseline, or at ``0003`` when a ledger/gossip command had already created
the server-less tables, then upgraded. Any other difference is an error that names it, and
nothing is changed.

The same migrations can be run with the Alembic CLI::

    FEDASYNC_DB_URL=postgresql+psycopg://... alembic -c fedasync/store/alembic.ini upgrade head

How to add a table or column: see ``fedasync/store/README.md``.
"""

from __future__ import annotations

import contextlib
import fcntl
import functools
import importlib
import logging
from pathlib import Path
from typing import Iterator

from alembic import command
from alembic.config import Config
from alembic.operations import Operations
from alembic.runtime.migration import MigrationContext
from alembic.script import ScriptDirectory
from alembic.util import CommandError
from sqlalchemy import Boolean, Column, Float, Integer, LargeBinary, MetaData, String, create_engine, inspect, text
from sqlalchemy.engine import Connection, Engine

log = logging.getLogger("fedasync")

SCRIPT_LOCATION = Path(__file__).resolve().parent / "migrations"
BASELINE = "0001"
#: the revision that creates the server-less tables, which fedasync's ledger and gossip commands
#: made with create_all before the schema was versioned
SERVERLESS = "0003"
#: how the unversioned schemas (fedasync 0.1.0 at f9ab1b8 up to 55c69a7~1) differ from revision
#: 0001: columns 0001 has that they lack, and columns whose type changed (uint64 node ids
#: overflowed BIGINT; text since 74dbad9)
LEGACY_MISSING = {("updates", "pending_params"): LargeBinary}
LEGACY_RETYPED = {("clients", "node_id"): String(24), ("dispatches", "node_id"): String(24)}

#: modules whose ORM classes share ``schema.Base`` (imported so that their tables are in the
#: metadata that ``alembic revision --autogenerate`` and the tests compare against)
SCHEMA_MODULES = ("fedasync.store.schema", "fedasync.store.serverless_schema")


def target_metadata() -> MetaData:
    """``schema.Base.metadata`` with every module in :data:`SCHEMA_MODULES` imported."""
    for name in SCHEMA_MODULES:
        try:
            importlib.import_module(name)
        except ModuleNotFoundError as e:
            if e.name != name:
                raise
    from fedasync.store.schema import Base

    return Base.metadata


def alembic_config(url: str | None = None) -> Config:
    """An Alembic config pointing at the packaged migrations (no .ini file needed)."""
    cfg = Config()
    cfg.set_main_option("script_location", str(SCRIPT_LOCATION))
    cfg.set_main_option("path_separator", "os")
    if url:
        cfg.set_main_option("sqlalchemy.url", url.replace("%", "%%"))
    return cfg


@functools.lru_cache(maxsize=1)
def head() -> str:
    """The newest revision id."""
    heads = ScriptDirectory.from_config(alembic_config()).get_heads()
    if len(heads) != 1:
        raise RuntimeError(f"fedasync migrations have {len(heads)} heads ({', '.join(heads)}): merge them")
    return heads[0]


def current(conn: Connection) -> str | None:
    """The revision the database at ``conn`` is at (None: not versioned)."""
    return MigrationContext.configure(conn).get_current_revision()


@contextlib.contextmanager
def _sqlite_file_lock(engine: Engine) -> Iterator[None]:
    db = engine.url.database
    if engine.dialect.name != "sqlite" or not db or db == ":memory:" or db.startswith("file:"):
        yield
        return
    lock_path = Path(db).with_name(Path(db).name + ".migrate.lock")
    lock_path.parent.mkdir(parents=True, exist_ok=True)
    with open(lock_path, "a") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def _create_uncovered(conn: Connection) -> None:
    """Tables of the ORM classes imported so far that no migration has created yet (a module
    whose revision is still to be written) are created with ``create_all``, with a warning, so
    that work in progress keeps running; ``tests/test_store.py`` fails until the revision exists."""
    from fedasync.store.schema import Base

    have = set(inspect(conn).get_table_names())
    missing = [t for name, t in Base.metadata.tables.items() if name not in have]
    if missing:
        log.warning("store: no migration creates table(s) %s; created them with create_all. Add an Alembic "
                    "revision (see fedasync/store/README.md)", ", ".join(sorted(t.name for t in missing)))
        Base.metadata.create_all(conn, tables=missing)


def _kind(col: dict) -> tuple:
    """A reflected column, as compared across SQLite and PostgreSQL: type family, string length,
    nullability."""
    t = col["type"]
    family = next((name for cls, name in ((Boolean, "boolean"), (Integer, "integer"), (Float, "float"),
                                          (LargeBinary, "binary"), (String, "string")) if isinstance(t, cls)), repr(t))
    return family, getattr(t, "length", None) if family == "string" else None, bool(col["nullable"])


def _columns(insp, table: str) -> dict[str, tuple]:
    return {c["name"]: _kind(c) for c in insp.get_columns(table)}


@functools.lru_cache(maxsize=1)
def _revision_schemas() -> tuple[tuple[str, dict[str, dict[str, tuple]]], ...]:
    """(revision, {table: {column: _kind}}) after each revision, oldest first: the revisions run on
    an in-memory SQLite database (the migrations are the one definition of each revision's schema)."""
    scripts = ScriptDirectory.from_config(alembic_config())
    out = []
    engine = create_engine("sqlite://")
    try:
        with engine.begin() as conn:
            cfg = alembic_config()
            cfg.attributes["connection"] = conn
            for script in reversed(list(scripts.walk_revisions())):
                command.upgrade(cfg, script.revision)
                insp = inspect(conn)
                out.append((script.revision, {t: _columns(insp, t) for t in insp.get_table_names()
                                              if t != "alembic_version"}))
    finally:
        engine.dispose()
    return tuple(out)


def _has_fedasync_tables(conn: Connection) -> bool:
    have = set(inspect(conn).get_table_names())
    return bool(have) and bool(have & set(dict(_revision_schemas())[head()]))


def _shown(kind: tuple) -> str:
    family, length, nullable = kind
    return f"{family}{'' if length is None else f'({length})'}{'' if nullable else ' not null'}"


def _adopt_unversioned(conn: Connection, cfg: Config) -> None:
    """Stamp a database that has fedasync's tables but no ``alembic_version`` at the revision its
    schema really is, after repairing what the unversioned versions are known to lack
    (:data:`LEGACY_MISSING`, :data:`LEGACY_RETYPED`). The core tables must be those of revision
    0001; the server-less tables, all absent or all present as revision 0003 makes them; no table
    of another revision may exist. Anything else raises CommandError naming every difference,
    before anything is changed."""
    schemas = dict(_revision_schemas())
    order = list(schemas)
    created_by = {}
    for rev in order:
        for t in schemas[rev]:
            created_by.setdefault(t, rev)
    core = schemas[BASELINE]
    serverless = {t: schemas[SERVERLESS][t] for t in schemas[SERVERLESS] if created_by[t] == SERVERLESS}
    insp = inspect(conn)
    have = set(insp.get_table_names())
    problems: list[str] = []
    adds: list[tuple[str, str]] = []
    retypes: list[tuple[str, str]] = []

    def compare(table: str, expected: dict[str, tuple], repair: bool) -> None:
        actual = _columns(insp, table)
        for col, kind in expected.items():
            if col not in actual:
                if repair and (table, col) in LEGACY_MISSING:
                    adds.append((table, col))
                else:
                    problems.append(f"column {table}.{col} is missing")
            elif actual[col] != kind:
                if repair and (table, col) in LEGACY_RETYPED and actual[col][0] == "integer":
                    retypes.append((table, col))
                else:
                    problems.append(f"column {table}.{col} is {_shown(actual[col])}, expected {_shown(kind)}")
        problems.extend(f"column {table}.{col} is not one fedasync made" for col in actual if col not in expected)

    for table in core:
        if table in have:
            compare(table, core[table], True)
        else:
            problems.append(f"table {table} is missing")
    present = sorted(have & set(serverless))
    if present and len(present) < len(serverless):
        problems.append(f"server-less tables {', '.join(sorted(set(serverless) - have))} are missing "
                        f"(have {', '.join(present)})")
    for table in present:
        compare(table, serverless[table], False)
    for table in sorted(have & set(created_by)):
        if table not in core and table not in serverless:
            problems.append(f"table {table} exists (revision {created_by[table]} creates it)")
    if problems:
        raise CommandError(
            f"store: {conn.engine.url.render_as_string(hide_password=True)} has fedasync tables but no "
            f"alembic_version, and its schema is not one that fedasync made before its schema was "
            f"versioned: {'; '.join(problems)}. Nothing was changed")
    log.warning("store: %s was made before the schema was versioned; %sstamped at revision %s",
                conn.engine.url.render_as_string(hide_password=True),
                "".join(f"{t}.{c} added, " for t, c in adds) + "".join(f"{t}.{c} made text, " for t, c in retypes),
                SERVERLESS if present else BASELINE)
    ops = Operations(MigrationContext.configure(conn))
    for table, col in adds:
        with ops.batch_alter_table(table) as batch:
            batch.add_column(Column(col, LEGACY_MISSING[(table, col)](), nullable=True))
    for table, col in retypes:
        with ops.batch_alter_table(table) as batch:
            batch.alter_column(col, type_=LEGACY_RETYPED[(table, col)], existing_type=Integer(),
                               existing_nullable=True, postgresql_using=f"{col}::text")
    command.stamp(cfg, BASELINE)
    if present:  # a ledger/gossip command had made revision 0003's tables: the revisions between
        command.upgrade(cfg, order[order.index(SERVERLESS) - 1])
        command.stamp(cfg, SERVERLESS)


def upgrade(engine: Engine, revision: str = "head") -> None:
    """Bring the database at ``engine`` to ``revision`` (default: the newest)."""
    if revision == "head":
        with engine.connect() as conn:
            if current(conn) == head():
                _create_uncovered(conn)
                conn.commit()
                return
    with _sqlite_file_lock(engine), engine.begin() as conn:
        if conn.dialect.name == "postgresql":
            conn.execute(text("SELECT pg_advisory_xact_lock(hashtext('fedasync-migrate'))"))
        cfg = alembic_config()
        cfg.attributes["connection"] = conn
        if current(conn) is None and _has_fedasync_tables(conn):
            _adopt_unversioned(conn, cfg)  # created by create_all before migrations existed
        command.upgrade(cfg, revision)
        if revision == "head":
            _create_uncovered(conn)


def downgrade(engine: Engine, revision: str) -> None:
    """Take the database at ``engine`` back to ``revision`` (``"base"``: drop everything)."""
    with _sqlite_file_lock(engine), engine.begin() as conn:
        cfg = alembic_config()
        cfg.attributes["connection"] = conn
        command.downgrade(cfg, revision)
