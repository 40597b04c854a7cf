"""The README's goals block (see report.py): each headline goal of issue 34, the figure its result
file gives, and whether the goal is met. The goals are the issue's; every figure is read from the
files the other blocks publish, so a goal flips to "missed" when a rerun moves its figure."""

from __future__ import annotations

from pathlib import Path
from typing import Callable

from report_blocks import fmt, load, mnist_grid_file
from report_blocks_wall import WALL_GRID, _own_run, wall_label, wall_seeds

#: issue 34's goals: the least ratio that meets each
QUICKSTART_GOAL = 4.5  # FedBuff vs FedAvg at defaults, quickstart, median of 3 seeds, on the grid
MNIST_TUNED_GOAL = 3.0  # tuned FedBuff vs tuned FedAvg(M) to 97 % on MNIST
WALL_GOAL = 4.0  # FedBuff at defaults vs Flower's FedAvg given a tuned server learning rate, wall clock


def judge(ratio: float | None, goal: float) -> str:
    """``**met**`` or ``**missed**`` for a ratio against its goal (no ratio: the target was not reached)."""
    return f"goal ≥ {goal:g}×: **{'met' if ratio is not None and ratio >= goal else 'missed'}**"


def _tuned_row(d: dict, kind: str, strategy: str) -> dict | None:
    return next((r for r in d["report"] if r["comparison"] == kind and r["strategy"] == strategy), None)


def _quickstart(results: Path) -> str:
    name = "quickstart_tuning.json"
    if not (results / name).is_file():
        return f"quickstart at defaults: not measured on the evaluation grid yet ({judge(None, QUICKSTART_GOAL)})"
    d = load(results, name)
    fb = _tuned_row(d, "defaults", "fedbuff")
    seeds = len(d["protocol"]["report_seeds"])
    return (f"quickstart, FedBuff vs FedAvg at defaults (median of {seeds} seeds, FedBuff {fb['reached']} reached): "
            f"{fmt(fb['ratio_vs_fedavg'], 2)}× ({judge(fb['ratio_vs_fedavg'], QUICKSTART_GOAL)}; `{name}`)")


def _mnist(results: Path) -> str:
    name = mnist_grid_file(results)
    fb = _tuned_row(load(results, name), "tuned", "fedbuff") if name else None
    if fb is None:
        return f"MNIST, tuned FedBuff vs tuned FedAvgM to 97 %: not measured yet ({judge(None, MNIST_TUNED_GOAL)})"
    return (f"MNIST, tuned FedBuff vs tuned FedAvgM to 97 %: {fmt(fb['ratio_vs_fedavg'], 2)}× "
            f"({judge(fb['ratio_vs_fedavg'], MNIST_TUNED_GOAL)}; `{name}`)")


def _wall(results: Path) -> str:
    if not (results / WALL_GRID).is_file():
        return f"wall clock at defaults vs Flower: not measured on the evaluation grid yet ({judge(None, WALL_GOAL)})"
    w = load(results, WALL_GRID)
    s = wall_seeds(results)  # against the strongest Flower run the file holds, on every seed measured
    if s is None:
        return (f"wall clock at defaults vs Flower given a tuned server learning rate: not run (`{WALL_GRID}` has "
                f"no Flower FedAvgM run; {judge(None, WALL_GOAL)})")
    n = len(s["rows"])
    out = (f"wall clock, FedBuff at defaults vs {wall_label(s['flower'])} (Flower given a tuned server learning rate "
           f"and momentum): {fmt(s['ratio'], 2)}× ({judge(s['ratio'], WALL_GOAL)}")
    if n > 1:
        out += f"; median of {n} seeds, {fmt(s['lo'], 2)}–{fmt(s['hi'], 2)}× seed by seed"
    if "flower-fedavg" in w["runs"]:
        plain = w["speedup_vs"]["flower-fedavg"].get(_own_run(w))
        out += f"; against Flower's plain FedAvg {fmt(plain, 2)}×" + (f" on seed {s['rows'][0]['seed']}" if n > 1 else "")
    files = ", ".join(f"`{r['file']}`" for r in s["rows"])
    return out + f"; {files}, one run each)"


def readme_goals(results: Path) -> str:
    """The issue's three headline goals against the published figures."""
    items = [_quickstart(results), _mnist(results), _wall(results)]
    return ("Against the goals set for these results (seeds not used for tuning, the figures above):\n\n"
            + "".join(f"- {s[0].upper()}{s[1:]}.\n" for s in items))


GENERATORS: dict[str, Callable[[Path], str]] = {"readme-goals": readme_goals}
