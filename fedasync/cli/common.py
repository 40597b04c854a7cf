"""Helpers shared by the CLI commands: one-line errors, config loading, progress bars, the
summary table."""

from __future__ import annotations

import logging
import os
import sys
from contextlib import contextmanager
from typing import Iterator

import typer
from rich.console import Console
from rich.markup import escape
from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from fedasync.config import Config, ConfigError, load_config

console = Console(stderr=False)
err_console = Console(stderr=True)


def fail(message: str, code: int = 2) -> "typer.Exit":
    """Print one line to stderr and exit with ``code`` (2: bad input).  ``message`` is plain text:
    brackets in it (``x[train]``, ``[/x]``) are printed as they are, never read as rich markup."""
    err_console.print(f"[red]error:[/red] {escape(str(message))}", highlight=False, soft_wrap=True)
    raise typer.Exit(code)


TRACK_HELP = ("Send the run's metrics to tensorboard, mlflow or both (tensorboard,mlflow): tracking.backends; "
              "metrics.jsonl is always written.")


def track_or_exit(track: str | None, set_: list[str]) -> list[str]:
    """``set_`` with ``--track a,b`` as ``tracking.backends=[a,b]``; an unknown name: one line, exit 2."""
    from fedasync.tracking import TrackingError, parse_track

    try:
        return [*set_, *parse_track(track)]
    except TrackingError as e:
        fail(str(e))


def tracking_or_exit(cfg: Config) -> None:
    """Exit 2 with one line naming the extra when a tracker of ``tracking.backends`` is not installed."""
    from fedasync.tracking import TrackingError, check_backends

    try:
        check_backends(cfg.tracking.backends)
    except TrackingError as e:
        fail(str(e))


def load_or_exit(path: str | None, overrides: list[str] | None) -> Config:
    try:
        return load_config(path, overrides or [])
    except ConfigError as e:
        fail(str(e))


def deployable_or_exit(cfg: Config) -> None:
    """Exit 2 with one line when ``cfg`` must not run as a deployment (``privacy.reproducible_noise``)."""
    from fedasync.privacy import check_deployable

    try:
        check_deployable(cfg)
    except ConfigError as e:
        fail(str(e))


def check_store_or_exit(url: str | None, key: str, must_exist: bool = False) -> None:
    """Exit 2 with one line naming ``key`` when the store at ``url`` cannot be opened (writes nothing)."""
    from fedasync.store.opening import StoreOpenError, probe_store

    if url is None:
        return
    try:
        probe_store(url, key, must_exist=must_exist)
    except StoreOpenError as e:
        fail(str(e))


def store_or_exit(url: str, key: str, must_exist: bool = False):
    """The store at ``url``; exit 2 with one line naming ``key`` when it cannot be opened."""
    from fedasync.store.opening import StoreOpenError, open_store

    try:
        return open_store(url, key, must_exist=must_exist)
    except StoreOpenError as e:
        fail(str(e))


def data_or_exit(cfg: Config) -> None:
    """Exit 2 with one line naming the key when the config's data or model cannot be built
    (:func:`fedasync.task.check.check_data`); call it before anything is written."""
    from fedasync.task.check import check_data

    try:
        check_data(cfg)
    except ConfigError as e:
        fail(str(e))


def quiet_flower(verbose: bool) -> None:
    """Flower and Ray are chatty; keep their warnings unless --verbose asks for everything."""
    level = logging.INFO if verbose else logging.ERROR
    flwr_log = logging.getLogger("flwr")
    flwr_log.setLevel(level)
    if not verbose:
        # run_simulation resets the logger's level (and warns that it is deprecated): a filter stays
        flwr_log.addFilter(lambda record: record.levelno >= logging.ERROR)
        flwr_log.propagate = False
    os.environ.setdefault("RAY_DEDUP_LOGS", "1")
    os.environ.setdefault("RAY_ACCEL_ENV_VAR_OVERRIDE_ON_ZERO", "0")
    logging.basicConfig(level=logging.WARNING if not verbose else logging.INFO,
                        format="%(levelname)s %(name)s: %(message)s", stream=sys.stderr)


class RunProgress:
    """A rich progress bar over versions (or virtual time) with accuracy and privacy spent."""

    def __init__(self, progress: Progress, label: str, cfg: Config):
        self.p = progress
        s = cfg.server
        if s.max_versions:
            self.by, total = "version", s.max_versions
        elif s.max_virtual_time:
            self.by, total = "time", s.max_virtual_time
        else:
            self.by, total = "version", None
        self.task = progress.add_task(label, total=total, info="")
        goal = s.goal()
        self.metric = goal.metric if goal is not None else None  # shown when the task has no accuracy

    def __call__(self, ev: dict) -> None:
        done = ev["version"] if self.by == "version" else ev["virtual_time_s"]
        acc = ev.get("accuracy")
        info = f"v{ev['version']}  t={ev['virtual_time_s']:.1f}s  upd={ev['updates']}"
        if acc is not None:
            info += f"  acc={acc:.3f}"
        else:  # a task without accuracy: its target's metric, else its first
            m = ev.get("metrics") or {}
            name = self.metric if self.metric in m else next(iter(m), None)
            value = m.get(name)
            if value is not None:
                info += f"  {name}={value:.4g}"
        if ev.get("epsilon_max") is not None:
            info += f"  ε_max={ev['epsilon_max']:.2f}  exhausted={ev.get('exhausted', 0)}"
        self.p.update(self.task, completed=done, info=info)


@contextmanager
def progress_bars() -> Iterator[Progress]:
    with Progress(
        TextColumn("[bold]{task.description}"), BarColumn(), TextColumn("{task.fields[info]}"),
        TimeElapsedColumn(), console=console, transient=False,
    ) as p:
        yield p


def summary_table(rows: dict[str, dict], title: str) -> Table:
    """One column per run, one row per figure: readable in 80 columns for a handful of runs."""
    t = Table(title=escape(title))  # the title holds the config's name: plain text, not markup
    t.add_column("")
    for label in rows:
        t.add_column(escape(label), justify="right")

    def fmt(x, spec: str) -> str:
        return "-" if x is None else format(x, spec)

    figures = [
        ("versions", lambda s: str(s["versions"])),
        ("updates received", lambda s: str(s["updates_received"])),
        ("updates rejected", lambda s: str(s["updates_rejected"])),
        ("virtual time (s)", lambda s: fmt(s["virtual_time_s"], ".1f")),
        ("wall time (s)", lambda s: fmt(s["wall_time_s"], ".1f")),
        ("final accuracy", lambda s: fmt(s["final_accuracy"], ".4f")),
        ("best accuracy", lambda s: fmt(s["best_accuracy"], ".4f")),
        ("time to target (virtual s)", lambda s: fmt(s["time_to_target_s"], ".1f")),
        ("staleness mean / p95", lambda s: "-" if s["staleness"]["mean"] is None
         else f"{s['staleness']['mean']:.2f} / {s['staleness']['p95']:.0f}"),
        ("Jain's index (dispatches)", lambda s: fmt((s.get("participation") or {}).get("jain"), ".3f")),
        ("rejected by filter", lambda s: "-" if not s.get("robust") or s["robust"]["filter"] == "none"
         else str(sum(s["robust"]["rejected"].values()))),
        ("stopped by", lambda s: str(s.get("stop_reason") or "-")),
    ]
    others: dict[str, None] = {}  # a task's metrics beyond accuracy and loss: a row each, after best accuracy
    for s in rows.values():
        others.update((k, None) for k in s.get("final_metrics") or {} if k not in ("accuracy", "loss"))
    at = 7
    for k in others:
        figures.insert(at, (f"final {k}", lambda s, k=k: fmt((s.get("final_metrics") or {}).get(k), ".4g")))
        at += 1
    goal = next((s.get("target") for s in rows.values() if s.get("target")), None)
    if goal and goal["metric"] != "accuracy":
        sign = ">=" if goal["mode"] == "max" else "<="
        figures[at] = (f"time to {goal['metric']} {sign} {goal['value']:g} (virtual s)", figures[at][1])
    for name, get in figures:
        t.add_row(name, *[get(s) for s in rows.values()])
    return t
