"""Big parameter blobs as files beside a SQLite database.

SQLite writes a 6.65 MB blob (``fedavg_cnn``'s parameters) in ~52 ms on this kind of machine
with 4 KiB pages; a file, written and later deleted, takes ~3.6 ms
(``benchmarks/sqlite_blobs.py``). SQLite's own advice is the same ("Internal Versus External
BLOBs in SQLite": past ~100 KB, files are faster). So the :class:`~fedasync.store.Store` of a
SQLite **file** keeps every parameter blob of at least :data:`EXTERNAL_MIN_BYTES` in
``<database>-params/`` and only a short marker in the row; small models (the MLP's 36 KB) stay in the row, and PostgreSQL keeps everything in the
database. A blob's file is written before the transaction that names it commits and deleted
only after the transaction that forgets it commits, so a committed row always finds its file;
a crash between the two leaves an unnamed file, which :meth:`BlobFiles.sweep` removes on resume.
Files are not fsynced, like the database itself (``synchronous=NORMAL``): a killed process loses
nothing, a power cut may.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Iterable

#: the smallest packed parameter blob that goes to a file (smaller ones stay in the row)
EXTERNAL_MIN_BYTES = 256 * 1024

_MARK = b"FAX1"


def is_marker(blob: bytes | None) -> bool:
    return blob is not None and blob[:4] == _MARK


class BlobFiles:
    """The ``<database>-params/`` directory of one SQLite database."""

    def __init__(self, directory: Path):
        self.dir = Path(directory)

    @classmethod
    def for_sqlite(cls, database: str | None) -> BlobFiles | None:
        """The blob directory of a SQLite database path; None for an in-memory database."""
        if not database or database == ":memory:" or database.startswith("file::memory:"):
            return None
        return cls(Path(database).parent / (Path(database).name + "-params"))

    def put(self, key: str, parts: Iterable) -> bytes:
        """Write ``parts`` (bytes-like, in order) as ``key`` (atomically: a reader sees all of it or
        none) and return the marker to store in the row instead."""
        self.dir.mkdir(parents=True, exist_ok=True)
        tmp = self.dir / f"{key}.tmp"
        with open(tmp, "wb") as f:
            f.writelines(parts)
        os.replace(tmp, self.dir / key)
        return _MARK + key.encode()

    def get(self, marker: bytes) -> bytes:
        path = self.dir / marker[4:].decode()
        try:
            return path.read_bytes()
        except FileNotFoundError:
            raise FileNotFoundError(f"the store names parameters in {path}, which is missing (was the database "
                                    f"copied without its {self.dir.name}/ directory?)") from None

    def delete(self, keys: Iterable[str]) -> None:
        if not self.dir.is_dir():  # nothing ever went to a file (a small model): no unlink per key
            return
        for k in keys:
            (self.dir / k).unlink(missing_ok=True)

    def sweep(self, prefix: str, named: set[bytes]) -> int:
        """Delete the files of ``prefix`` that no row names (``named``: the markers the rows hold):
        left by a crash between a file and its transaction. Returns how many were deleted."""
        if not self.dir.is_dir():
            return 0
        keep = {m[4:].decode() for m in named if is_marker(m)}
        gone = [p for p in self.dir.iterdir() if p.name.startswith(prefix) and p.name not in keep]
        for p in gone:
            p.unlink(missing_ok=True)
        return len(gone)
