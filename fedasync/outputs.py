"""What a run writes to its directory: summary.json, history.csv, metrics.jsonl, accuracy.png,
participation.png, config.yaml (and what ``tracking.backends`` asks for: :mod:`fedasync.tracking`);
and for ``--compare``: comparison.json and comparison.png.

A run directory is 0700 and every file written here 0600 (:mod:`fedasync.private`):
``config.yaml`` holds the store URL, password included. The store URL in ``summary.json`` and
``comparison.json`` is shown with its password masked."""

from __future__ import annotations

import csv
import json
import math
import re
import time
from pathlib import Path
from typing import Any

from fedasync.config import Config
from fedasync.private import PRIVATE_DIR, mask_url, open_private, private_dir, write_private


def file_in_the_way(out: Path) -> Path | None:
    """The file at ``out`` or at a directory above it (``mkdir`` would fail on it), or None."""
    for p in (out, *out.parents):
        if p.exists():
            return None if p.is_dir() else p
    return None


def not_a_directory(opt: str, out: Path, p: Path) -> str:
    """The one line naming ``opt`` for :func:`file_in_the_way`'s ``p``."""
    return f"{opt}: {p} is not a directory" if p == out else f"{opt}: {out}: {p} is not a directory"


def out_dir_problem(out: Path | None, resume: int | None) -> str | None:
    """Why ``--out`` cannot take a run (one line naming ``--out``: a file at it or above it, or,
    for a new run (no ``resume``), a directory that is not empty), or None."""
    if out is None:
        return None
    try:
        p = file_in_the_way(out)
        if p is not None:
            return not_a_directory("--out", out, p)
        if resume is None and out.exists() and any(out.iterdir()):
            return f"--out: {out} exists and is not empty"
    except OSError as e:  # no permission to look
        return f"--out: {out}: {e.strerror or e}"
    return None


def make_run_dir(out: Path | None, name: str) -> Path:
    """``out`` created 0700 (or a new ``runs/<name>-<time>``); ValueError naming ``--out`` when it
    cannot be (a file on the way, no permission)."""
    try:
        if out is None:
            out = new_run_dir(Path("runs"), name)
        return private_dir(out)
    except OSError as e:
        where = out if out is not None else "runs (the default)"
        raise ValueError(f"--out: {where}: cannot create the directory ({e.strerror or e})") from None


def remove_if_empty(out: Path) -> bool:
    """Remove ``out`` and the directories below it if none of them holds a file; whether it did."""
    try:
        if any(not p.is_dir() for p in out.rglob("*")):
            return False
        for d in sorted(out.rglob("*"), key=lambda p: len(p.parts), reverse=True):  # deepest first
            d.rmdir()
        out.rmdir()
        return True
    except OSError:  # gone already, or no permission: leave it
        return False


def new_run_dir(root: Path, name: str) -> Path:
    """A new directory ``root/<name>-<time>[-n]``, 0700."""
    stamp = time.strftime("%Y%m%d-%H%M%S")
    out = root / f"{name}-{stamp}"
    n = 1
    while out.exists():
        n += 1
        out = root / f"{name}-{stamp}-{n}"
    out.mkdir(mode=PRIVATE_DIR, parents=True)
    return private_dir(out)


def plot_metric(summary: dict) -> str:
    """The metric a run's plot shows: the target's, else ``accuracy`` when the task reports it,
    else the first metric of its evaluations."""
    if summary.get("target"):
        return summary["target"]["metric"]
    names = metric_names(summary.get("history") or [])
    return "accuracy" if "accuracy" in names or not names else names[0]


def plot_file(summary: dict) -> str:
    """``accuracy.png`` (the plot of :func:`plot_metric`), or ``<metric>.png`` for another metric."""
    return f"{re.sub(r'[^A-Za-z0-9_.-]+', '_', plot_metric(summary))}.png"


def metric_names(history: list[dict]) -> list[str]:
    """Every metric of the evaluations, in the order first seen (history.csv's columns after
    ``version`` and ``virtual_time_s``)."""
    names: dict[str, None] = {}
    for row in history:
        names.update((k, None) for k in row if k not in ("version", "virtual_time_s"))
    return list(names)


def _plot(series: dict[str, list[dict]], path: Path, target: Any, title: str, metric: str = "accuracy") -> None:
    """``metric`` against virtual time for each run of ``series``; ``target``: a value, or a
    ``server.target`` dict (its value), drawn as a line."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.2), dpi=110)
    for label, hist in series.items():
        pts = [(h["virtual_time_s"], h[metric]) for h in hist if h.get(metric) is not None]
        ax.plot([t for t, _ in pts], [v for _, v in pts], label=label, lw=1.6)
    value = target.get("value") if isinstance(target, dict) else target
    if value is not None:
        ax.axhline(value, color="grey", ls="--", lw=1, label=f"target {value:.4g}")
    ax.set_xlabel("virtual time (s)")
    ax.set_ylabel("test accuracy" if metric == "accuracy" else metric)
    ax.set_title(title)
    ax.grid(alpha=0.3)
    ax.legend(loc="lower right" if not isinstance(target, dict) or target.get("mode") != "min" else "upper right")
    fig.tight_layout()
    with open_private(path, "wb") as f:
        fig.savefig(f, format="png")
    plt.close(fig)


def plot_participation(part: dict, path: Path, title: str) -> None:
    """Histogram of dispatches per client (summary.json's ``participation``), Jain's index in the title."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    counts = part["counts"]
    fig, ax = plt.subplots(figsize=(7, 4.2), dpi=110)
    hi = max(counts) if counts else 0
    ax.hist(counts, bins=range(0, hi + 2), align="left", rwidth=0.85)
    ax.set_xlabel("dispatches per client")
    ax.set_ylabel("clients")
    ax.set_title(f"{title}: Jain's index {part['jain']:.3f}, never scheduled {part['never']:.0%}")
    ax.grid(alpha=0.3)
    fig.tight_layout()
    with open_private(path, "wb") as f:
        fig.savefig(f, format="png")
    plt.close(fig)


def strict_json(obj: Any) -> Any:
    """``obj`` with every non-finite float (an ε of ∞: a client that trained without noise) as
    None, so that ``json.dumps`` writes strict JSON (Python's ``Infinity`` is no JSON value: jq,
    JavaScript and PostgreSQL refuse it)."""
    if isinstance(obj, float):
        return obj if math.isfinite(obj) else None
    if isinstance(obj, dict):
        return {k: strict_json(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [strict_json(v) for v in obj]
    return obj


def masked_summary(summary: dict) -> dict:
    """``summary`` as it is written or shown: its ``store_url`` with the password masked."""
    return {**summary, "store_url": mask_url(summary["store_url"])} if summary.get("store_url") else summary


def write_run_outputs(out: Path, cfg: Config, summary: dict, root: Path | None = None,
                      label: str | None = None) -> dict[str, Path]:
    """The run's files in ``out`` (created 0700), each 0600; ``summary.json``'s store URL masked;
    ``metrics.jsonl`` and the trackers of ``tracking.backends`` (:func:`fedasync.tracking.track_run`;
    ``root``: the folder of ``--compare``'s shared MLflow store, ``label``: the run's name there)."""
    private_dir(out)
    paths = {
        "summary": out / "summary.json",
        "history": out / "history.csv",
        "plot": out / plot_file(summary),
        "config": out / "config.yaml",
    }
    text = json.dumps(strict_json(masked_summary(summary)), indent=2, allow_nan=False) + "\n"
    write_private(paths["summary"], text)
    with open_private(paths["history"], "w", newline="") as f:  # one column per metric of the task
        w = csv.DictWriter(f, fieldnames=["version", "virtual_time_s", *metric_names(summary["history"])])
        w.writeheader()
        for row in summary["history"]:
            w.writerow(row)
    _plot({summary["strategy"]: summary["history"]}, paths["plot"], summary.get("target"),
          f"{cfg.name}: {summary['strategy']}", metric=plot_metric(summary))
    if summary.get("participation"):
        paths["participation"] = out / "participation.png"
        plot_participation(summary["participation"], paths["participation"],
                           f"{summary['strategy']}, {summary['participation'].get('scheduler', '')}")
    write_private(paths["config"], cfg.to_yaml())  # the whole config, store URL included: 0600
    from fedasync.tracking import track_run

    track_run(out, cfg, summary, root=root, label=label)
    paths["metrics"] = out / "metrics.jsonl"
    return paths


def comparison(summaries: dict[str, dict]) -> dict:
    """``time_to_target_ratio[name] = first strategy's time / this one's`` (None if either missed);
    the target is the runs' ``server.target`` (any metric)."""
    names = list(summaries)
    first = summaries[names[0]]["time_to_target_s"]
    ratio = {}
    for n in names:
        t = summaries[n]["time_to_target_s"]
        ratio[n] = None if (first is None or t is None or t == 0) else first / t
    return {"strategies": summaries, "time_to_target_ratio": ratio}


def write_comparison(out: Path, summaries: dict[str, dict], target: Any = None) -> dict[str, Path]:
    """comparison.json and comparison.png (the plotted metric: :func:`plot_metric` of the first run;
    ``target``: a value or a ``server.target`` dict, default the first run's target)."""
    data = comparison({n: masked_summary(s) for n, s in summaries.items()})
    paths = {"comparison": out / "comparison.json", "plot": out / "comparison.png"}
    write_private(paths["comparison"], json.dumps(strict_json(data), indent=2, allow_nan=False) + "\n")
    first = next(iter(summaries.values()))
    metric = plot_metric(first)
    _plot({n: s["history"] for n, s in summaries.items()}, paths["plot"], target or first.get("target"),
          f"{metric} vs virtual time, same scenario", metric=metric)
    return paths
