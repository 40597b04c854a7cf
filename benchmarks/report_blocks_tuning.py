"""The generated block of docs/howto/tuning.md (see report.py): what the tuning protocol cost, read
from its result files (each run's wall seconds and commit), so the page's cost figures move with
every rerun instead of being typed."""

from __future__ import annotations

from pathlib import Path
from typing import Callable

from report_blocks import fmt, load

#: the protocol's result files whose cost the page gives, in the page's order
TUNING_FILES = ("quickstart_tuning.json", "mnist_tuning.json")


def _runs(d: dict) -> dict[str, list[dict]]:
    """The runs of a tuning file by phase: every variant's tuning runs, every report run."""
    tuning = [r for vs in d["variants"].values() for v in vs for r in v["runs"]]
    report = [r for rs in d["report_runs"].values() for r in rs]
    return {"tuning": tuning, "report": report}


def cost_row(name: str, d: dict) -> str:
    p, prov = d["protocol"], d["provenance"]
    phases = _runs(d)
    runs = [r for rs in phases.values() for r in rs]
    commit = prov["commit"]
    ran_here = [r for r in runs if r.get("commit") == commit]
    run_min = {k: sum(r["wall_s"] for r in rs) / 60 for k, rs in phases.items()}
    longest = max(r["wall_s"] for r in runs) / 60
    return (f"| `{name}` | {', '.join(p['strategies'])} | {p['budget']} | {len(phases['tuning'])} + "
            f"{len(phases['report'])} | {fmt(run_min['tuning'], 0)} + {fmt(run_min['report'], 0)} | "
            f"{fmt(longest, 0)} | {len(ran_here)} of {len(runs)} |")


def tuning_cost(results: Path) -> str:
    rows = ["| file | strategies | budget | runs: tuning + report | run minutes (one thread each): tuning + report "
            "| longest run, minutes | runs made at the file's commit |",
            "|---|---|---:|---:|---:|---:|---:|"]
    for name in TUNING_FILES:
        if (results / name).is_file():
            rows.append(cost_row(name, load(results, name)))
    note = ("Run minutes are the runs' wall times summed (one torch thread each, `--jobs` at a time on the "
            "file's machine, at times beside other jobs): what the protocol cost there, more than its CPU time "
            "on a loaded machine. Runs made at an earlier commit came from the run cache (`cache.commits`).")
    return "\n".join(rows) + "\n\n" + note + "\n"


GENERATORS: dict[str, Callable[[Path], str]] = {"tuning-cost": tuning_cost}
