"""FedBuff's server settings on the MNIST scenario: virtual seconds to 97 % per variant.

SUPERSEDED by ``benchmarks/tune.py`` (issue 34): this sweep tunes FedBuff alone, on the same seed
and test subset it reports on. ``tune.py`` gives every strategy the same budget, scores on a
validation split (``data.val_fraction``) with tuning seeds and reports on test with other seeds
(``docs/howto/tuning.md``). This script is kept only to regenerate its own old file and says so
when run.

Each variant is ``benchmarks/mnist.py --runs fedbuff_lr1_uniform --horizon H --set
server.stop_at_target=true`` (FedBuff as ``examples/mnist.yaml`` sets it) with the variant's own
``--set`` overrides (server keys only: the clients, data and clock stay the scenario's, as for
FedAvg), run as separate processes, ``--jobs`` at a time, one torch thread each. The table is
what chose the ``fedbuff`` row's settings in ``mnist.py``; the accuracy is the server's
evaluation subset (1,000 of the test images), the only accuracy the runs see, so the choice is
tuned on it: the README says so.

    python benchmarks/mnist_sweep.py                     # all variants, 2 at a time (~40 min here)
    python benchmarks/mnist_sweep.py --only lr1.5,fastest_lr1.5
    python benchmarks/mnist_sweep.py --table             # the markdown table of the results json

Writes ``benchmarks/results/mnist_fedbuff_sweep.json`` (one row per variant, with its history).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

#: name -> server overrides on top of mnist.yaml's FedBuff (server_lr 1.0, uniform, K = 10)
VARIANTS: dict[str, list[str]] = {
    "default": [],
    "lr1.5": ["server.server_lr=1.5"],
    "lr2": ["server.server_lr=2.0"],
    "lr3": ["server.server_lr=3.0"],
    "K5": ["server.buffer_size=5"],
    "K5_lr1.5": ["server.buffer_size=5", "server.server_lr=1.5"],
    "K5_lr2": ["server.buffer_size=5", "server.server_lr=2.0"],
    "examples_weighting": ["server.weighting=examples"],
    "staleness_aware_lr1.5": ["server.scheduler.name=staleness_aware", "server.server_lr=1.5"],
    "fastest_lr1": ["server.scheduler.name=fastest"],
    "fastest_lr1.5": ["server.scheduler.name=fastest", "server.server_lr=1.5"],
    "fastest_lr1.75": ["server.scheduler.name=fastest", "server.server_lr=1.75"],
    "fastest_lr2": ["server.scheduler.name=fastest", "server.server_lr=2.0"],
    "fastest_lr1.5_K5": ["server.scheduler.name=fastest", "server.server_lr=1.5", "server.buffer_size=5"],
    "fastest_lr1.5_beta2": ["server.scheduler.name=fastest", "server.server_lr=1.5", "server.scheduler.beta=2"],
    "fastest_lr1.5_explore0.3": ["server.scheduler.name=fastest", "server.server_lr=1.5",
                                 "server.scheduler.explore=0.3"],
    "fastest_lr1.5_constant": ["server.scheduler.name=fastest", "server.server_lr=1.5",
                               "server.staleness.fn=constant"],
    "fastest_lr1.5_c30": ["server.scheduler.name=fastest", "server.server_lr=1.5", "server.concurrency=30"],
    "fastest_lr1.5_c40": ["server.scheduler.name=fastest", "server.server_lr=1.5", "server.concurrency=40"],
    "fastest_lr1.5_c40_K20": ["server.scheduler.name=fastest", "server.server_lr=1.5", "server.concurrency=40",
                              "server.buffer_size=20"],
    "fastest_lr1.5_c25": ["server.scheduler.name=fastest", "server.server_lr=1.5", "server.concurrency=25"],
    "fastest_lr1.5_c35": ["server.scheduler.name=fastest", "server.server_lr=1.5", "server.concurrency=35"],
    "fastest_lr2_c30": ["server.scheduler.name=fastest", "server.server_lr=2.0", "server.concurrency=30"],
}


def run_variant(name: str, horizon: float, tmp: Path) -> dict:
    out = tmp / f"{name}.json"
    cmd = [sys.executable, str(ROOT / "benchmarks" / "mnist.py"), "--runs", "fedbuff_lr1_uniform",
           "--horizon", str(horizon), "--set", "server.stop_at_target=true", "--out", str(out)]
    for s in VARIANTS[name]:
        cmd += ["--set", s]
    env = dict(os.environ, OMP_NUM_THREADS="1", MKL_NUM_THREADS="1")
    t0 = time.perf_counter()
    subprocess.run(cmd, check=True, env=env, stdout=subprocess.DEVNULL)
    row = json.loads(out.read_text())["rows"][0]
    print(f"[sweep] {name}: t97 {row['time_to_97_s']} ({time.perf_counter() - t0:.0f} s wall)", flush=True)
    return {"variant": name, "overrides": VARIANTS[name], **{k: row[k] for k in (
        "time_to_97_s", "time_to_90_s", "updates", "versions", "final_accuracy", "final_accuracy_full_test",
        "wall_s", "history")}}


def _fmt(t: float | None) -> str:
    return "-" if t is None else f"{t:.1f}"


def table(report: dict) -> str:
    fedavg = report.get("fedavg_time_to_97_s")
    lines = ["| variant | server overrides | to 90 % (virtual s) | to 97 % (virtual s) | vs FedAvg to 97 % | updates |",
             "|---|---|---:|---:|---:|---:|"]
    for r in sorted(report["rows"], key=lambda r: r["time_to_97_s"] or float("inf")):
        t97 = r["time_to_97_s"]
        ratio = f"{fedavg / t97:.2f}×" if fedavg and t97 else "-"
        lines.append(f"| {r['variant']} | {' '.join(r['overrides']) or '(mnist.yaml)'} | {_fmt(r['time_to_90_s'])} | "
                     f"{_fmt(t97)} | {ratio} | {r['updates']} |")
    return "\n".join(lines)


def fedavg_time_to_97(path: Path) -> float | None:
    """The fedavg row's virtual seconds to 97 % in a ``benchmarks/mnist.py`` results file."""
    rows = json.loads(path.read_text()).get("rows", [])
    return next((r.get("time_to_97_s") for r in rows if r.get("run") == "fedavg"), None)


FEDAVG_RESULTS = ROOT / "benchmarks" / "results" / "mnist-h1800.json"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--only", default=None, help=f"comma-separated, from {', '.join(VARIANTS)}")
    ap.add_argument("--horizon", type=float, default=480.0, help="virtual seconds (each run stops at 97 %%)")
    ap.add_argument("--jobs", type=int, default=2)
    ap.add_argument("--fedavg-t97", type=float, default=None,
                    help="FedAvg's virtual s to 97 %% for the ratio column (default: the fedavg row of "
                         "results/mnist-h1800.json, written by benchmarks/mnist.py)")
    ap.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results" / "mnist_fedbuff_sweep.json")
    ap.add_argument("--table", action="store_true")
    args = ap.parse_args()
    print("mnist_sweep: superseded by benchmarks/tune.py (tunes on the test subset it reports on; see "
          "docs/howto/tuning.md)", file=sys.stderr)
    if args.table:
        print(table(json.loads(args.out.read_text())))
        return 0
    names = list(VARIANTS) if args.only is None else [n.strip() for n in args.only.split(",") if n.strip()]
    bad = [n for n in names if n not in VARIANTS]
    if bad:
        ap.error(f"--only: unknown {bad}")
    fedavg_t97 = args.fedavg_t97
    if fedavg_t97 is None:
        fedavg_t97 = fedavg_time_to_97(FEDAVG_RESULTS) if FEDAVG_RESULTS.is_file() else None
        if fedavg_t97 is None:
            ap.error(f"--fedavg-t97: no fedavg row reaching 97 % in {FEDAVG_RESULTS}; run "
                     "benchmarks/mnist.py --horizon 1800 --out that file, or give the figure")
    with tempfile.TemporaryDirectory() as d, ThreadPoolExecutor(max(1, args.jobs)) as pool:
        rows = list(pool.map(lambda n: run_variant(n, args.horizon, Path(d)), names))
    report = {"command": "python " + " ".join(sys.argv), "horizon": args.horizon,
              "fedavg_time_to_97_s": fedavg_t97, "rows": rows}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=1) + "\n")
    print(table(report))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
