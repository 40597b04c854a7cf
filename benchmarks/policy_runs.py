"""Shared by benchmarks/scheduling.py and benchmarks/robustness.py: run a grid of quickstart
variants (in-process, LocalTransport, virtual clock) over seeds, record each run as soon as it
ends, and take medians over seeds.

Each run is ``load_config(quickstart, overrides + seed)`` with ``store.save_parameters: false``
and its store in a temporary directory (the benchmarks need the summary, not the store).
A results file that already holds a (label, seed) is not run again, so an interrupted benchmark
continues where it stopped.
"""

from __future__ import annotations

import json
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Callable

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def run_one(overrides: list[str], seed: int) -> dict:
    """One quickstart run; the summary (without its history) plus the accuracy curve."""
    import torch

    from fedasync.config import load_config
    from fedasync.server.loop import AsyncServer
    from fedasync.server.transport import LocalTransport
    from fedasync.store import Store, default_sqlite_url

    torch.set_num_threads(1)
    cfg = load_config(None, [*overrides, f"seed={seed}", "store.save_parameters=false"])
    shm = Path("/dev/shm") if Path("/dev/shm").is_dir() else None
    with tempfile.TemporaryDirectory(dir=shm) as d:
        store = Store(default_sqlite_url(Path(d)))
        t0 = time.perf_counter()
        try:
            s = AsyncServer(cfg, LocalTransport(), store, clock="virtual").run()
        finally:
            store.close()
    s["bench_wall_s"] = round(time.perf_counter() - t0, 2)
    s["curve"] = [[h["virtual_time_s"], round(h["accuracy"], 4)] for h in s.pop("history")]
    return s


def dumps(data: dict) -> str:
    """The results file: one line per run (its curve is long), the other keys one per line."""
    def value(k: str, v: Any) -> str:
        if k == "runs":
            return "[\n" + ",\n".join("  " + json.dumps(r, separators=(",", ":")) for r in v) + "\n ]"
        return json.dumps(v)
    return "{\n" + ",\n".join(f" {json.dumps(k)}: {value(k, v)}" for k, v in data.items()) + "\n}\n"


def median(xs: list[float | None]) -> float | None:
    """Median over seeds; ``None`` (e.g. never reached the target) counts as +infinity, so the
    median is ``None`` when most seeds missed."""
    vals = sorted((float("inf") if x is None else float(x)) for x in xs)
    if not vals:
        return None
    m = statistics.median(vals)
    return None if m == float("inf") else m


def run_grid(grid: list[tuple[str, list[str]]], seeds: list[int], path: Path,
             extract: Callable[[dict], dict[str, Any]], meta: dict[str, Any],
             goals: Callable[[dict], dict] | None = None, plan: list[tuple[str, int]] | None = None) -> dict:
    """Run every (label, overrides) × seed not yet in ``path`` (seed-major, or in the order of
    ``plan``'s (label, seed) pairs); rewrite ``path`` after each run."""
    data = json.loads(path.read_text()) if path.is_file() else {}
    data.setdefault("runs", [])
    data.update(meta)
    done = {(r["label"], r["seed"]) for r in data["runs"]}
    cells = dict(grid)
    if plan is None:  # seed-major: every cell gets seed 0 first, so a cut-short benchmark still covers the grid
        plan = [(label, seed) for seed in seeds for label, _ in grid]
    for label, seed in plan:
        overrides = cells[label]
        if (label, seed) in done:
            continue
        t0 = time.time()
        s = run_one(overrides, seed)
        if s["stop_reason"] == "interrupted":  # SIGINT/SIGTERM: the run is cut short, not a result
            raise SystemExit(f"{label} seed {seed}: interrupted, not recorded")
        row = {"label": label, "seed": seed, "overrides": overrides, **extract(s),
               "wall_s": round(time.time() - t0, 1)}
        data["runs"].append(row)
        _summarise(data, grid, goals)
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(".tmp")
        tmp.write_text(dumps(data))
        tmp.replace(path)
        print(f"{label} seed {seed}: " + ", ".join(f"{k}={v}" for k, v in row.items()
                                                   if isinstance(v, (int, float)) and k != "seed"), flush=True)
    if data["runs"]:  # also when nothing was run: the medians (and goals) of every run the file holds
        _summarise(data, grid, goals)
    return data


def _summarise(data: dict, grid: list[tuple[str, list[str]]], goals: Callable[[dict], dict] | None) -> None:
    """``data``'s medians over every run it holds (:func:`grid_medians`) and, with ``goals``, the goals."""
    data["medians"] = grid_medians(data["runs"], grid)
    if goals is not None:
        data["goals"] = goals(data["medians"])


def grid_medians(runs: list[dict], grid: list[tuple[str, list[str]]]) -> dict[str, dict]:
    """:func:`medians` of ``runs`` in the grid's order, then the file's other labels sorted."""
    order = [g[0] for g in grid]
    return medians(runs, order + sorted({r["label"] for r in runs} - set(order)))


def medians(runs: list[dict], order: list[str]) -> dict[str, dict]:
    out: dict[str, dict] = {}
    for label in order:
        rows = [r for r in runs if r["label"] == label]
        if not rows:
            continue
        keys = [k for k, v in rows[0].items() if isinstance(v, (int, float)) or v is None]
        m = {k: median([r.get(k) for r in rows]) for k in keys if k not in ("seed", "wall_s")}
        m["seeds"] = sorted(r["seed"] for r in rows)
        out[label] = m
    return out


def fmt(x: Any, spec: str = ".3f") -> str:
    return "-" if x is None else format(x, spec)


def grid_main(argv: list[str] | None, *, script: str, description: str, cells: list[tuple[str, list[str]]],
              scenario: str, extract: Callable[[dict], dict[str, Any]], goals: Callable[[dict], dict],
              table: Callable[[dict], str], priority: list[tuple[int, list[str]]] | None = None,
              default_seeds: str = "0,1,2", meta: dict[str, Any] | None = None) -> int:
    """The command line both grid benchmarks share: ``--seeds``, ``--only``, ``--quick``,
    ``--horizon``, ``--out``, ``--table`` (and ``--priority`` where a plan is given). ``cells``
    are (label, overrides) without the horizon; results go to ``results/<script>.json``."""
    import argparse

    ap = argparse.ArgumentParser(description=description)
    ap.add_argument("--seeds", default=default_seeds)
    ap.add_argument("--only", default=None, help="comma-separated labels of the grid to run")
    ap.add_argument("--quick", action="store_true", help="seed 0, max_virtual_time 20 (a smoke run)")
    ap.add_argument("--horizon", type=float, default=150.0, help="server.max_virtual_time (default: the quickstart's 150)")
    ap.add_argument("--out", default=None)
    ap.add_argument("--table", action="store_true", help="print the table of an existing results file")
    if priority is not None:
        ap.add_argument("--priority", action="store_true", help="only what the goals need, most needed first")
    args = ap.parse_args(argv)
    name = f"{script}-quick.json" if args.quick else f"{script}.json"
    path = Path(args.out) if args.out else ROOT / "benchmarks" / "results" / name
    if args.table:
        print(table(json.loads(path.read_text())))
        return 0
    seeds = [0] if args.quick else [int(s) for s in args.seeds.split(",")]
    only = set(args.only.split(",")) if args.only else None
    horizon = 20.0 if args.quick else args.horizon
    extra = [f"server.max_virtual_time={horizon:g}"]
    grid = [(lbl, extra + o) for lbl, o in cells if only is None or lbl in only]
    plan = ([(lbl, seed) for seed, labels in priority for lbl in labels]
            if priority is not None and args.priority else None)
    from provenance import provenance  # benchmarks/: on sys.path when run as a script

    data = run_grid(grid, seeds, path, extract, meta={
        "provenance": provenance([f"benchmarks/{script}.py", *(argv if argv is not None else sys.argv[1:])]),
        **(meta or {}), "seeds": seeds,
        "scenario": f"{scenario}, max_virtual_time={horizon:g}",
        "command": " ".join([f"python benchmarks/{script}.py", *(argv if argv is not None else sys.argv[1:])])},
        goals=goals, plan=plan)
    data["goals"] = goals(data.get("medians", {}))
    path.write_text(dumps(data))
    print(table(data))
    print(json.dumps(data["goals"], indent=1))
    return 0
