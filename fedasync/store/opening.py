"""Opening a store from a user's URL, with one-line errors instead of tracebacks.

Every command that takes a store (``store.url`` in a config, ``--store`` on the command line)
goes through :func:`probe_store` before it writes anything, and through :func:`open_store`
to open it. Both raise :class:`StoreOpenError`, whose message is one line naming the key the
URL came from and what is wrong: a malformed URL, a missing driver, a server that does not
answer, a file that is not an SQLite database, a directory that does not exist.

:func:`probe_store` writes nothing: an SQLite file that does not exist yet is not created
(only its directory is checked), a server is only connected to.
"""

from __future__ import annotations

import sqlite3
from pathlib import Path

from sqlalchemy import create_engine, text
from sqlalchemy.engine import make_url
from sqlalchemy.exc import ArgumentError, DBAPIError, NoSuchModuleError, SQLAlchemyError

from fedasync.private import mask_url, private_sqlite
from fedasync.store.store import Store

#: seconds a probe waits for a database server to answer
CONNECT_TIMEOUT_S = 10


class StoreOpenError(ValueError):
    """A store that cannot be opened: one line, naming the key (``store.url``, ``--store``)."""


def first_line(exc: BaseException) -> str:
    """The driver's own message, first line, without SQLAlchemy's background links."""
    inner = getattr(exc, "orig", None) or exc
    text_ = str(inner).strip()
    for line in text_.splitlines():
        if line.strip():
            return line.strip().rstrip(".")
    return type(inner).__name__


def shown(url: str) -> str:
    """The URL with its password hidden (:func:`fedasync.private.mask_url`)."""
    return mask_url(url)


def _sqlite_path(url) -> Path | None:
    db = url.database
    if not db or db == ":memory:" or db.startswith("file:"):
        return None
    return Path(db)


def probe_store(url: str, key: str, must_exist: bool = False) -> None:
    """Check that the store at ``url`` can be opened, writing nothing; StoreOpenError if not.

    ``must_exist``: an SQLite file that does not exist is an error (commands that read a run)."""
    try:
        u = make_url(url)
    except ArgumentError:
        raise StoreOpenError(f"{key}: {url!r} is not a database URL (e.g. sqlite:///run/fedasync.db or "
                             "postgresql+psycopg://user@host/db)") from None
    if u.get_backend_name() == "sqlite":
        path = _sqlite_path(u)
        if path is None:
            return
        if path.is_dir():
            raise StoreOpenError(f"{key}: {path} is a directory, not an SQLite database")
        if not path.exists():
            if must_exist:
                raise StoreOpenError(f"{key}: no database at {path}")
            if not path.parent.is_dir():
                raise StoreOpenError(f"{key}: cannot create {path}: directory {path.parent} does not exist")
            return
        try:
            con = sqlite3.connect(f"{path.resolve().as_uri()}?mode=ro", uri=True)
            try:
                con.execute("PRAGMA schema_version").fetchone()
            finally:
                con.close()
        except sqlite3.Error as e:
            raise StoreOpenError(f"{key}: {path} is not an SQLite database ({first_line(e)})") from None
        return
    try:
        args = {"connect_timeout": CONNECT_TIMEOUT_S} if u.get_backend_name() == "postgresql" else {}
        engine = create_engine(u, connect_args=args)
    except NoSuchModuleError:
        raise StoreOpenError(f"{key}: unknown database kind {u.drivername!r} in {shown(url)}") from None
    except ImportError as e:
        raise StoreOpenError(f"{key}: the driver for {u.drivername!r} is not installed ({first_line(e)})") from None
    except (ArgumentError, SQLAlchemyError) as e:
        raise StoreOpenError(f"{key}: {shown(url)}: {first_line(e)}") from None
    try:
        with engine.connect() as conn:
            conn.execute(text("SELECT 1"))
    except DBAPIError as e:
        raise StoreOpenError(f"{key}: cannot connect to {shown(url)}: {first_line(e)}") from None
    except SQLAlchemyError as e:
        raise StoreOpenError(f"{key}: {shown(url)}: {first_line(e)}") from None
    finally:
        engine.dispose()


def open_store(url: str, key: str, create: bool = True, must_exist: bool = False) -> Store:
    """:func:`probe_store`, then ``Store(url)`` (which brings the schema up to date);
    StoreOpenError with one line if either fails. A new SQLite file is created 0600."""
    probe_store(url, key, must_exist=must_exist)
    try:
        if create:
            private_sqlite(url)
        return Store(url, create=create)
    except (SQLAlchemyError, OSError) as e:
        raise StoreOpenError(f"{key}: cannot open {shown(url)}: {first_line(e)}") from None
    except Exception as e:  # alembic: a database at a revision this fedasync does not know, ...
        if type(e).__module__.startswith("alembic"):
            raise StoreOpenError(f"{key}: cannot open {shown(url)}: {first_line(e)}") from None
        raise
