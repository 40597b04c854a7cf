"""Big parameter blobs as files beside a SQLite database.

SQLite writes a 6.65 MB blob (``fedavg_cnn``'s parameters) in ~52 ms on this kind of machine
with 4 KiB pages; a file, written and later deleted, takes ~3.6 ms
(``benchmarks/sqlite_blobs.py``). SQLite's own advice is the same ("Internal Versus External
BLOBs in SQLite": past ~100 KB, files are faster). So the :class:`~fedasync.store.Store` of a
SQLite **file** keeps every parameter blob of at least :data:`EXTERNAL_MIN_BYTES` in
``<database>-params/`` and only a short marker in the row; small models (the MLP's 36 KB) stay
in the row, and PostgreSQL keeps everything in the database. A blob's file is written before
the transaction that names it commits and deleted only after the transaction that forgets it
commits, so a committed row always finds its file;
a crash between the two leaves an unnamed file, which :meth:`BlobFiles.sweep` removes on resume.
Files are not fsynced, like the database itself (``synchronous=NORMAL``): a killed process loses
nothing, a power cut may.

The deleted files of FedBuff's buffered updates (read only by the server that owns the run, on
resume) are kept as spares (``.spare/``, at most :data:`SPARE_FILES` and :data:`SPARE_BYTES` per
process) and the next blob is written over one in place: a new 6.65 MB file costs the kernel
its page-cache pages (allocated, then freed by the unlink), an overwrite does not (about 2.2 ms
against 0.9 ms here). A version's file, which a reader outside the server may have open, is
unlinked (the reader keeps what it opened). A spare is claimed by renaming it, so two
processes never write the same one; :meth:`BlobFiles.close` deletes this process's spares, and
a resume's :meth:`BlobFiles.sweep` those a killed process left.
"""

from __future__ import annotations

import os
import weakref
from pathlib import Path
from typing import Iterable

#: the smallest packed parameter blob that goes to a file (smaller ones stay in the row)
EXTERNAL_MIN_BYTES = 256 * 1024
#: deleted blob files kept per process to be written over (see the module's docstring)
SPARE_FILES = 16
SPARE_BYTES = 128 << 20

_MARK = b"FAX1"


def is_marker(blob: bytes | None) -> bool:
    return blob is not None and blob[:4] == _MARK


class BlobFiles:
    """The ``<database>-params/`` directory of one SQLite database."""

    def __init__(self, directory: Path):
        self.dir = Path(directory)
        self.spare_dir = self.dir / ".spare"
        self._spares: list[tuple[Path, int]] = []  # (path, size) of this process's spare files
        self._spare_bytes = 0
        self._n = 0
        weakref.finalize(self, _unlink_spares, self._spares)  # at exit too: no spare outlives its process

    @classmethod
    def for_sqlite(cls, database: str | None) -> BlobFiles | None:
        """The blob directory of a SQLite database path; None for an in-memory database."""
        if not database or database == ":memory:" or database.startswith("file::memory:"):
            return None
        return cls(Path(database).parent / (Path(database).name + "-params"))

    def put(self, key: str, parts: Iterable) -> bytes:
        """Write ``parts`` (bytes-like, in order) as ``key`` (atomically: a reader sees all of it or
        none) and return the marker to store in the row instead."""
        tmp = self.dir / f"{key}.tmp"
        if self._claim_spare(tmp):  # written over in place, then cut to this blob's length
            with open(tmp, "r+b") as f:
                f.writelines(parts)
                f.truncate()
        else:
            self.dir.mkdir(parents=True, exist_ok=True)
            with open(tmp, "wb") as f:
                f.writelines(parts)
        os.replace(tmp, self.dir / key)
        return _MARK + key.encode()

    def _claim_spare(self, tmp: Path) -> bool:
        while self._spares:
            path, size = self._spares.pop()
            self._spare_bytes -= size
            try:
                os.replace(path, tmp)
                return True
            except FileNotFoundError:  # swept by a resume meanwhile
                continue
        return False

    def get(self, marker: bytes) -> bytes:
        path = self.dir / marker[4:].decode()
        try:
            return path.read_bytes()
        except FileNotFoundError:
            raise FileNotFoundError(f"the store names parameters in {path}, which is missing (was the database "
                                    f"copied without its {self.dir.name}/ directory?)") from None

    def delete(self, keys: Iterable[str], spare: bool = False) -> None:
        """Delete the files of ``keys``; with ``spare``, keep them (while there is room) for
        :meth:`put` to write over: only for files no reader outside this process may have open
        (written over in place, such a reader would see the new blob's bytes)."""
        if not self.dir.is_dir():  # nothing ever went to a file (a small model): no unlink per key
            return
        for k in keys:
            path = self.dir / k
            if not (spare and self._keep_spare(path)):
                path.unlink(missing_ok=True)

    def _keep_spare(self, path: Path) -> bool:
        """Move ``path`` to this process's spares; False when there is no room (or it fails)."""
        if len(self._spares) >= SPARE_FILES:
            return False
        try:
            size = path.stat().st_size
            if self._spare_bytes + size > SPARE_BYTES:
                return False
            self.spare_dir.mkdir(exist_ok=True)
            self._n += 1
            spare = self.spare_dir / f"{os.getpid()}-{self._n}"
            os.replace(path, spare)
        except OSError:  # gone already, or the spare directory just removed by another process
            return False
        self._spares.append((spare, size))
        self._spare_bytes += size
        return True

    def close(self) -> None:
        """Delete this process's spare files, and their directory once empty (a later :meth:`put`
        writes a new file)."""
        _unlink_spares(self._spares)
        self._spare_bytes = 0
        try:
            self.spare_dir.rmdir()
        except OSError:  # absent, or another process's spares are in it
            pass

    def sweep(self, prefix: str, named: set[bytes]) -> int:
        """Delete the files of ``prefix`` that no row names (``named``: the markers the rows hold):
        left by a crash between a file and its transaction. Returns how many were deleted."""
        if not self.dir.is_dir():
            return 0
        keep = {m[4:].decode() for m in named if is_marker(m)}
        gone = [p for p in self.dir.iterdir() if p.name.startswith(prefix) and p.name not in keep]
        for p in gone:
            p.unlink(missing_ok=True)
        mine = {p for p, _ in self._spares}
        if self.spare_dir.is_dir():  # spares a killed process left (a live one's may go too: it then writes anew)
            for p in self.spare_dir.iterdir():
                if p not in mine:
                    p.unlink(missing_ok=True)
        return len(gone)


def _unlink_spares(spares: list[tuple[Path, int]]) -> None:
    for path, _ in spares:
        path.unlink(missing_ok=True)
    spares.clear()
