"""What one model-sized parameter blob costs SQLite, as the loop writes them (issue 9, loop overhead).

The loop writes a FedBuff reply's parameters while they wait in the buffer and a model version's
parameters when it is made, and later sets them to NULL (aggregated, or released by retention).
This writes ``--blobs`` blobs of ``--params`` float32 values in WAL mode with
``synchronous=NORMAL`` (the store's settings), one transaction each, nulls every ten (as a FedBuff
aggregation does), and reports milliseconds per blob for several page sizes and autocheckpoint
intervals, and, last, what the store does now (``fedasync/store/blobs.py``): the blob in a file
beside the database (``BlobFiles.put``), a short marker in the row, the file deleted after the
commit that nulls the row, to ``results/sqlite_blobs.json``.

    python benchmarks/sqlite_blobs.py [--params 1663370] [--blobs 60] [--out benchmarks/results]
"""

from __future__ import annotations

import argparse
import os
import sqlite3
import tempfile
import time
from pathlib import Path

import numpy as np

SETTINGS = [  # (page size, wal_autocheckpoint pages); the first is the store's
    (4096, 1000), (4096, 16384), (16384, 1000), (65536, 1000),
]


def ms_per_blob(path: Path, blob: bytes, n: int, page: int, checkpoint: int) -> float:
    con = sqlite3.connect(path, isolation_level=None)
    for pragma in (f"page_size={page}", "journal_mode=WAL", "synchronous=NORMAL", f"wal_autocheckpoint={checkpoint}"):
        con.execute(f"PRAGMA {pragma}")
    con.execute("CREATE TABLE u (id INTEGER PRIMARY KEY, p BLOB)")
    t0 = time.perf_counter()
    for i in range(n):
        con.execute("BEGIN")
        con.execute("INSERT INTO u VALUES (?, ?)", (i, blob))
        if i % 10 == 9:
            con.execute("UPDATE u SET p = NULL WHERE id > ?", (i - 10,))
        con.execute("COMMIT")
    dt = time.perf_counter() - t0
    con.close()
    return 1000 * dt / n


def ms_per_blob_file(path: Path, blob: bytes, n: int) -> float:
    """The store's way: file written before the commit that names it, deleted after the one that
    forgets it (4 KiB pages: the rows are small)."""
    from fedasync.store.blobs import BlobFiles

    files = BlobFiles.for_sqlite(str(path))
    con = sqlite3.connect(path, isolation_level=None)
    for pragma in ("journal_mode=WAL", "synchronous=NORMAL"):
        con.execute(f"PRAGMA {pragma}")
    con.execute("CREATE TABLE u (id INTEGER PRIMARY KEY, p BLOB)")
    t0 = time.perf_counter()
    for i in range(n):
        marker = files.put(f"u{i}", [blob])
        con.execute("BEGIN")
        con.execute("INSERT INTO u VALUES (?, ?)", (i, marker))
        if i % 10 == 9:
            con.execute("UPDATE u SET p = NULL WHERE id > ?", (i - 10,))
        con.execute("COMMIT")
        if i % 10 == 9:
            files.delete(f"u{j}" for j in range(i - 9, i + 1))
    dt = time.perf_counter() - t0
    con.close()
    return 1000 * dt / n


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--params", type=int, default=1_663_370, help="float32 values per blob (fedavg_cnn: 1,663,370)")
    ap.add_argument("--blobs", type=int, default=60)
    ap.add_argument("--out", type=Path, default=Path("benchmarks/results"))
    args = ap.parse_args()
    blob = np.random.default_rng(0).standard_normal(args.params).astype(np.float32).tobytes()
    rows = []
    for page, checkpoint in SETTINGS:
        with tempfile.TemporaryDirectory(prefix="fedasync-sqlite-") as d:
            ms = ms_per_blob(Path(d) / "b.db", blob, args.blobs, page, checkpoint)
        rows.append({"page_size": page, "wal_autocheckpoint": checkpoint, "ms_per_blob": round(ms, 1)})
        print(f"page {page:6d}  autocheckpoint {checkpoint:6d}: {ms:6.1f} ms per {len(blob) / 2**20:.2f} MiB blob")
    with tempfile.TemporaryDirectory(prefix="fedasync-sqlite-") as d:
        ms = ms_per_blob_file(Path(d) / "b.db", blob, args.blobs)
    rows.append({"page_size": 4096, "file_beside_db": True, "ms_per_blob": round(ms, 1)})
    print(f"file beside the database (the store):    {ms:6.1f} ms per {len(blob) / 2**20:.2f} MiB blob")
    args.out.mkdir(parents=True, exist_ok=True)
    out = {"params": args.params, "blob_mb": round(len(blob) / 2**20, 2), "blobs": args.blobs,
           "load_average": [round(x, 2) for x in os.getloadavg()], "cpus": os.cpu_count(), "runs": rows}
    from provenance import provenance, write_result  # benchmarks/: on sys.path when run as a script
    write_result(args.out / "sqlite_blobs.json", {"provenance": provenance(), **out})
    print(f"wrote {args.out / 'sqlite_blobs.json'}")


if __name__ == "__main__":
    main()
