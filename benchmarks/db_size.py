"""How big the quickstart's SQLite store is, and where its pages go (docs/howto/store.md's table).

Runs the documented commands in-process (``fedasync.simulate``, local backend: the store is the
same whatever the engine) and measures each run's ``fedasync.db``:

- ``fedasync_retention``: ``fedasync simulate --set server.strategy=fedasync`` (retention at its
  default, ``store.checkpoint_every: 100``), the command docs/howto/store.md shows;
- ``fedasync_every_version``: the same with ``store.checkpoint_every=1`` (every version keeps its
  parameters: the table's "before" row);
- ``fedbuff_retention``: the quickstart as shipped (FedBuff: buffered updates keep their
  parameters in ``updates.pending_params`` until aggregated).

For each: the file's bytes (``db_bytes``, ``db_mb``; after a WAL checkpoint, so the WAL is in the
file), ``page_size``, ``page_count``, ``freelist_count``, per table ``pages``/``payload_bytes``/
``unused_bytes`` (SQLite's ``dbstat``, when the library has it), the versions, how many keep
parameters and their bytes (``kept_parameter_bytes``), and the run's ``model_sha256`` (the store's
layout never changes a model). Writes benchmarks/results/db_size.json.

    python benchmarks/db_size.py                         # all three (~2 min a run on one core)
    python benchmarks/db_size.py --only fedasync_retention
"""

from __future__ import annotations

import argparse
import sqlite3
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))
from provenance import provenance, write_result  # noqa: E402

RUNS = {
    "fedasync_retention": {"server.strategy": "fedasync"},
    "fedasync_every_version": {"server.strategy": "fedasync", "store.checkpoint_every": 1},
    "fedbuff_retention": {},
}
COMMANDS = {
    "fedasync_retention": "fedasync simulate --set server.strategy=fedasync --out runs/qs-fedasync",
    "fedasync_every_version": "fedasync simulate --set server.strategy=fedasync --set store.checkpoint_every=1",
    "fedbuff_retention": "fedasync simulate",
}


def measure(db: Path) -> dict:
    """Page statistics of the SQLite file ``db`` (its WAL checkpointed into it first)."""
    con = sqlite3.connect(db)
    try:
        con.execute("PRAGMA wal_checkpoint(TRUNCATE)")
        one = lambda q: con.execute(q).fetchone()[0]  # noqa: E731
        out = {"db_bytes": db.stat().st_size, "page_size": one("PRAGMA page_size"),
               "page_count": one("PRAGMA page_count"), "freelist_count": one("PRAGMA freelist_count")}
        out["db_mb"] = round(out["db_bytes"] / 1e6, 2)
        try:
            rows = con.execute("SELECT name, count(*), sum(payload), sum(unused) FROM dbstat GROUP BY name "
                               "ORDER BY count(*) DESC").fetchall()
            out["tables"] = {n: {"pages": p, "payload_bytes": pl, "unused_bytes": u} for n, p, pl, u in rows if p > 1}
        except sqlite3.OperationalError:  # a library built without SQLITE_ENABLE_DBSTAT_VTAB
            out["tables"] = None
        out["versions"] = one("SELECT count(*) FROM model_versions")
        out["versions_with_parameters"] = one("SELECT count(*) FROM model_versions WHERE parameters IS NOT NULL")
        out["kept_parameter_bytes"] = one("SELECT coalesce(sum(length(parameters)), 0) FROM model_versions")
        out["updates"] = one("SELECT count(*) FROM updates")
    finally:
        con.close()
    files = db.parent / f"{db.name}-params"
    out["parameter_file_bytes"] = sum(f.stat().st_size for f in files.rglob("*") if f.is_file()) \
        if files.is_dir() else 0
    return out


def run(name: str) -> dict:
    import fedasync

    with tempfile.TemporaryDirectory() as d:
        t0 = time.perf_counter()
        r = fedasync.simulate(None, set=RUNS[name], out=Path(d) / name)
        wall = time.perf_counter() - t0
        row = {"command": COMMANDS[name], "set": RUNS[name], **measure(Path(d) / name / "fedasync.db"),
               "model_sha256": r.summary.get("model_sha256"), "wall_s": round(wall, 1)}
    print(f"{name}: {row['db_mb']} MB, {row['page_count']} pages ({row['freelist_count']} free), "
          f"{row['versions']} versions, {row['versions_with_parameters']} with parameters", flush=True)
    return row


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--only", default=None, help="comma-separated names: " + ", ".join(RUNS))
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "db_size.json"))
    args = ap.parse_args(argv)
    names = args.only.split(",") if args.only else list(RUNS)
    bad = [n for n in names if n not in RUNS]
    if bad:
        print(f"error: --only: unknown run {bad[0]!r} (one of {', '.join(RUNS)})", file=sys.stderr)
        return 2
    import torch

    torch.set_num_threads(1)
    runs = {n: run(n) for n in names}
    write_result(args.out, {"provenance": provenance(sys.argv if argv is None else ["benchmarks/db_size.py", *argv]),
                            "runs": runs})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
