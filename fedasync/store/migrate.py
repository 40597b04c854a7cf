"""Schema management with Alembic.

The schema of a fedasync store is versioned by the Alembic revisions in
``fedasync/store/migrations/versions/``. :func:`upgrade` brings a database to the newest
revision; ``Store(url)`` calls it on open, so a user never runs Alembic by hand. It is safe to
call from several processes at once: PostgreSQL takes a transaction-level advisory lock,
a SQLite file is locked with ``flock`` on ``<db>.migrate.lock``.

A database created before the schema was versioned (``Base.metadata.create_all`` by fedasync
0.1.0) has the tables but no ``alembic_version``: it is stamped at the baseline revision
first, then upgraded.

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
from alembic.runtime.migration import MigrationContext
from alembic.script import ScriptDirectory
from sqlalchemy import MetaData, inspect, text
from sqlalchemy.engine import Connection, Engine

log = logging.getLogger("fedasync")

SCRIPT_LOCATION = Path(__file__).resolve().parent / "migrations"
BASELINE = "0001"

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
        if current(conn) is None and inspect(conn).has_table("runs"):
            command.stamp(cfg, BASELINE)  # created by create_all before migrations existed
        command.upgrade(cfg, revision)
        if revision == "head":
            _create_uncovered(conn)


def downgrade(engine: Engine, revision: str) -> None:
    """Take the database at ``engine`` back to ``revision`` (``"base"``: drop everything)."""
    with _sqlite_file_lock(engine), engine.begin() as conn:
        cfg = alembic_config()
        cfg.attributes["connection"] = conn
        command.downgrade(cfg, revision)
