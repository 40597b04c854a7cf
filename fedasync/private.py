"""Private files and URLs shown without their password.

A run directory holds what must not be world-readable: ``config.yaml`` and the server's job
file (the store URL, password included), the store (every update; under central DP, clients'
raw updates), summaries and status files. Everything fedasync writes there is created private,
whatever the process's umask: directories 0700 (:func:`private_dir`), files 0600
(:func:`write_private`, :func:`open_private`), a new SQLite store likewise
(:func:`private_sqlite`; SQLite gives its ``-wal``, ``-shm`` and ``-journal`` files the database
file's mode). What other code creates while a run goes on (the store's parameter blobs, plots,
the SuperLink's files) is covered by :func:`private_umask`, which the run's entry points hold.

:func:`mask_url` is the one way a store URL is shown (summaries, status files, printed lines,
errors): SQLAlchemy's own rendering with the password as ``***``.
"""

from __future__ import annotations

import os
from contextlib import contextmanager
from pathlib import Path
from typing import IO, Iterator

PRIVATE_DIR = 0o700
PRIVATE_FILE = 0o600


def mask_url(url: str | None) -> str | None:
    """``url`` with its password shown as ``***`` (SQLAlchemy's ``render_as_string(hide_password=True)``);
    a URL SQLAlchemy cannot parse is returned as it is (it names no password SQLAlchemy would use)."""
    if url is None:
        return None
    from sqlalchemy.engine import make_url

    try:
        return make_url(url).render_as_string(hide_password=True)
    except Exception:
        return url


def private_dir(path: str | Path) -> Path:
    """``path`` created (with its missing parents) and made 0700; the directories above it keep
    the mode ``mkdir -p`` gives them."""
    p = Path(path)
    p.mkdir(mode=PRIVATE_DIR, parents=True, exist_ok=True)
    os.chmod(p, PRIVATE_DIR)
    return p


def open_private(path: str | Path, mode: str = "w", **kwargs) -> IO:
    """``open(path, mode)`` (``w``/``wb``/``a``/``ab``...) of a file that is 0600, created so or
    made so if it existed."""
    flags = os.O_WRONLY | os.O_CREAT | (os.O_APPEND if "a" in mode else os.O_TRUNC)
    fd = os.open(path, flags, PRIVATE_FILE)
    try:
        os.fchmod(fd, PRIVATE_FILE)
        return os.fdopen(fd, mode, **kwargs)
    except BaseException:
        os.close(fd)
        raise


def write_private(path: str | Path, data: str | bytes) -> Path:
    """Write ``data`` to ``path`` as a 0600 file (replacing what it held)."""
    with open_private(path, "wb") as f:
        f.write(data.encode() if isinstance(data, str) else data)
    return Path(path)


@contextmanager
def private_umask() -> Iterator[None]:
    """While it is held, files and directories this process (and the processes it starts) create
    are 0600/0700 at most: umask 077. The umask is the process's: set around a whole run by its
    entry point, never by code that runs beside other work."""
    old = os.umask(0o077)
    try:
        yield
    finally:
        os.umask(old)


def private_sqlite(url: str | None) -> None:
    """For a SQLite file that does not exist yet: create it empty as 0600 (SQLite takes an empty
    file as a new database and gives its ``-wal``/``-shm``/``-journal`` files the same mode). An
    existing file, another database kind, an in-memory database or a URL that does not parse:
    nothing is done. (The store's ``<database>-params/`` blob files are made by the store while
    the run's :func:`private_umask` is held.)"""
    if not url or not url.startswith("sqlite"):
        return
    from sqlalchemy.engine import make_url

    try:
        db = make_url(url).database
    except Exception:
        return
    if not db or db == ":memory:" or db.startswith("file:"):
        return
    path = Path(db)
    if not path.parent.is_dir():
        return  # SQLite's own error says what is wrong
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, PRIVATE_FILE)
    except FileExistsError:
        return
    os.close(fd)
