"""The quickstart comparison, in-process, over several seeds: the README's headline table.

    python benchmarks/quickstart.py                 # seeds 1,2,3 to 300 virtual s -> results/quickstart_comparison.json
    python benchmarks/quickstart.py --repro         # seed 1 to 40 virtual s -> results/quickstart_repro.json

Each seed runs the packaged quickstart (``fedasync/examples/quickstart.yaml``) under ``fedavg``,
``fedbuff``, ``fedasync`` and ``fedavg:backup_workers=4`` with :func:`fedasync.compare` on the
``local`` backend (the virtual clock makes a run a pure function of config and seed, so Flower's
engine gives the same figures), ``seed`` and ``server.max_virtual_time`` set, every other key at
its default. The file holds, per seed and strategy, the figures the table shows (versions,
updates, rejected, time to the target, ratio vs the first strategy, final and best accuracy,
staleness, model sha256), and per strategy their median and min-max over the seeds, with the
provenance header (:mod:`provenance`). The full run also copies the first seed's accuracy plot to
``results/quickstart_comparison.png``.

``tests/test_quickstart_repro.py`` reruns :func:`run` with :data:`REPRO` and compares every
figure with ``results/quickstart_repro.json``: a change that moves a figure updates the file
(``python benchmarks/quickstart.py --repro``) in the same commit.
"""

from __future__ import annotations

import argparse
import shutil
import statistics
import sys
import tempfile
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
if str(HERE) not in sys.path:
    sys.path.insert(0, str(HERE))

from provenance import provenance, write_result  # noqa: E402

STRATEGIES = ["fedavg", "fedbuff", "fedasync", "fedavg:backup_workers=4"]
FULL = {"seeds": [1, 2, 3], "horizon": 300.0}
REPRO = {"seeds": [1], "horizon": 40.0}
RESULTS = HERE / "results"
FIGURES = ["versions", "updates", "rejected", "time_to_target_s", "ratio", "final_accuracy",
           "best_accuracy", "staleness_mean", "staleness_p95"]


def _figures(summary: dict, ratio: float | None) -> dict[str, Any]:
    """The table's figures of one run's summary (``ratio``: the first strategy's time / this one's)."""
    return {
        "versions": summary["versions"],
        "updates": summary["updates_received"],
        "rejected": summary["updates_rejected"],
        "time_to_target_s": summary["time_to_target_s"],
        "ratio": ratio,
        "final_accuracy": summary["final_accuracy"],
        "best_accuracy": summary["best_accuracy"],
        "staleness_mean": summary["staleness"]["mean"],
        "staleness_p95": summary["staleness"]["p95"],
        "model_sha256": summary["model_sha256"],
    }


def run_seed(seed: int, horizon: float, out: Path, strategies: list[str] = STRATEGIES) -> dict[str, dict]:
    """One seed of the comparison into ``out``: ``{label: figures}`` (see :func:`_figures`)."""
    import fedasync

    r = fedasync.compare(None, ",".join(strategies), out=out,
                         set={"seed": seed, "server.max_virtual_time": horizon, "simulation.backend": "local"})
    ratios = r["comparison"]["time_to_target_ratio"]
    return {label: _figures(res.summary, ratios[label]) for label, res in r["results"].items()}


def _spread(values: list) -> dict[str, Any]:
    """Median, min and max of ``values``, over those that are not None (None when all are);
    ``missed``: how many were None (a run that never reached the target)."""
    got = [v for v in values if v is not None]
    if not got:
        return {"median": None, "min": None, "max": None, "missed": len(values)}
    return {"median": statistics.median(got), "min": min(got), "max": max(got), "missed": len(values) - len(got)}


def run(seeds: list[int], horizon: float, plot: Path | None = None, jobs: int = 1) -> dict[str, Any]:
    """Every seed of the comparison (runs in a temporary folder; ``jobs`` seeds at a time, each in
    its own process when > 1: the figures do not depend on it); the result file's content less
    its provenance. ``plot``: where to copy the first seed's accuracy plot."""
    with tempfile.TemporaryDirectory(prefix="fedasync-quickstart-") as tmp:
        outs = [Path(tmp) / f"seed{seed}" for seed in seeds]
        if jobs > 1:
            from concurrent.futures import ProcessPoolExecutor

            with ProcessPoolExecutor(min(jobs, len(seeds))) as pool:
                got = list(pool.map(run_seed, seeds, [horizon] * len(seeds), outs))
        else:
            got = [run_seed(seed, horizon, out) for seed, out in zip(seeds, outs)]
        per_seed = {str(seed): figures for seed, figures in zip(seeds, got)}
        if plot is not None:
            shutil.copyfile(outs[0] / "comparison.png", plot)
    labels = list(next(iter(per_seed.values())))
    summary = {label: {f: _spread([per_seed[s][label][f] for s in per_seed]) for f in FIGURES} for label in labels}
    return {"config": "fedasync/examples/quickstart.yaml", "strategies": STRATEGIES, "seeds": seeds,
            "horizon_s": horizon, "backend": "local", "target": "accuracy >= 0.90",
            "per_seed": per_seed, "summary": summary}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--seeds", default=None, help="comma-separated seeds (default 1,2,3; --repro: 1)")
    p.add_argument("--horizon", type=float, default=None, help="server.max_virtual_time (default 300; --repro: 40)")
    p.add_argument("--repro", action="store_true", help="the reduced run tests/test_quickstart_repro.py pins")
    p.add_argument("--jobs", type=int, default=1, help="seeds run at a time, one process each (default 1)")
    p.add_argument("--out", type=Path, default=None, help="result file (default results/quickstart_comparison.json "
                   "or, with --repro, results/quickstart_repro.json)")
    a = p.parse_args(argv)
    base = REPRO if a.repro else FULL
    try:
        seeds = [int(s) for s in a.seeds.split(",")] if a.seeds else base["seeds"]
    except ValueError:
        p.error(f"--seeds: expected comma-separated integers, got {a.seeds!r}")
    horizon = a.horizon if a.horizon is not None else base["horizon"]
    if horizon <= 0:
        p.error(f"--horizon: must be > 0, got {horizon}")
    if a.jobs < 1:
        p.error(f"--jobs: must be >= 1, got {a.jobs}")
    out = a.out or RESULTS / ("quickstart_repro.json" if a.repro else "quickstart_comparison.json")
    plot = None if a.repro or a.out else RESULTS / "quickstart_comparison.png"
    prov = provenance(sys.argv if argv is None else ["benchmarks/quickstart.py", *argv])
    payload = {"provenance": prov, **run(seeds, horizon, plot, a.jobs)}
    write_result(out, payload)
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
