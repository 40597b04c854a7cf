"""What the server evaluates, when, and the time to target (the loop's evaluation bookkeeping).

**The grid** (``server.eval_every_s``, virtual seconds; wall seconds since the run started in
deployment): before the clock moves past a grid time ``g = k * eval_every_s``, the model current at
``g`` (the last version committed at a time ``<= g``; with ``server.average_last``, the mean of the
last versions) is evaluated and recorded at ``virtual_time_s = g`` with its version: one history row
per grid time, every strategy evaluated at the same times. A version unchanged since the previous
grid time is not evaluated again: its metrics are reused (FedAvg between rounds), and the row is
still recorded. Version 0 at time 0; at the end, the final model at the final time if its version
has no row yet. ``eval_every_s: null``: every ``server.eval_every`` versions instead, at the time
the version was made.

**Time to target** (:func:`time_to_target`): the time of the first evaluation from which the target
holds for ``server.target_hold`` evaluations in a row; ``server.stop_at_target`` stops the run once
it has held that long. The loop, a resume and the benchmarks (``benchmarks/mnist.py``, both sides of
``benchmarks/wall_clock_vs_flower.py``) compute it with this function.

Resume: the evaluations are rows of the store (``evaluations``), committed with the step that made
them; the grid position (:func:`next_grid_index`) and the time to target are derived from them, so a
resumed run records the same rows as one never interrupted. Imports neither flwr nor sqlalchemy.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any, Iterable, NamedTuple

if TYPE_CHECKING:
    from fedasync.server.loop import AsyncServer


class Goal(NamedTuple):
    """A target as :func:`time_to_target` reads it (``server.target``'s fields)."""

    metric: str
    value: float
    mode: str = "max"


def accuracy_goal(value: float) -> Goal:
    """``accuracy >= value`` (``server.target_accuracy``; the benchmarks' thresholds)."""
    return Goal("accuracy", float(value), "max")


def at_target(target: Any, row: dict) -> bool:
    """Whether history row ``row`` reaches ``target`` (>= value for ``mode: max``, <= for ``min``);
    a row without the metric, or with a value that is not finite, does not."""
    v = row.get(target.metric)
    if v is None or not math.isfinite(v):
        return False
    return v >= target.value if target.mode == "max" else v <= target.value


def time_to_target(history: Iterable[dict], target: Any, hold: int = 1) -> float | None:
    """The ``virtual_time_s`` of the first row of ``history`` from which ``target`` (anything with
    ``metric``, ``value``, ``mode``) holds at that row and the next ``hold - 1`` rows; None if it never
    holds that long. ``history``: rows in the order they were recorded."""
    if hold < 1:
        raise ValueError(f"hold must be >= 1, got {hold}")
    start, n = None, 0
    for row in history:
        if at_target(target, row):
            start, n = (row["virtual_time_s"], 1) if n == 0 else (start, n + 1)
            if n >= hold:
                return start
        else:
            n = 0
    return None


def grid_value(times: list[float], values: list, grid: Iterable[float]) -> list:
    """The step function of ``values`` (recorded at increasing ``times``) read at each ``grid``
    time: the last value recorded at a time ``<= g`` (None before the first)."""
    out, i = [], -1
    for g in grid:
        while i + 1 < len(times) and times[i + 1] <= g:
            i += 1
        out.append(values[i] if i >= 0 else None)
    return out


def next_grid_index(times: Iterable[float], every_s: float) -> int:
    """The index of the first grid time after every recorded time (``times``; 0 when there is none):
    every grid time up to the last row was recorded when the clock passed it, or at the end. A
    time rounded to 6 decimals, as history rows hold it, counts as its grid time."""
    last = max(times, default=None)
    return 0 if last is None else math.floor(last / every_s + 1e-6) + 1


def walk_grid(next_k: int, every_s: float, t: float, inclusive: bool, record: Any, stop: Any) -> tuple[int, float | None]:
    """Record (``record(g)``) every grid time ``g = k * every_s`` from ``k = next_k`` up to ``t``
    (``inclusive``: ``g == t`` too), stopping after a ``g`` at which ``stop()`` holds. Returns the
    next grid index and the grid time it stopped at (None: it reached ``t``). The server's loop and
    the server-less runs walk their grids with it."""
    while True:
        g = next_k * every_s
        if g > t or (g == t and not inclusive):
            return next_k, None
        record(g)
        next_k += 1
        if stop():
            return next_k, g


class Evaluations:
    """The loop's evaluations: it appends to ``srv.history``, records each row in the store and
    sets ``srv.time_to_target``."""

    def __init__(self, srv: AsyncServer) -> None:
        s = srv.cfg.server
        self.srv = srv
        self.every_s: float | None = s.eval_every_s
        self.every = s.eval_every
        self.hold = s.target_hold
        self.stop_at_target = s.stop_at_target
        self.next_k = 0  # the grid: the index of the next grid time to record
        self._last: tuple[int, dict] | None = None  # (version, metrics): reused while the version stands

    # -- recording ---------------------------------------------------------------------
    def _metrics(self) -> dict:
        srv = self.srv
        if self._last is None or self._last[0] != srv.version:  # the task's metrics (TargetError: no target metric)
            self._last = (srv.version, srv.evaluator(srv.tail.mean()))
        return dict(self._last[1])

    def record(self, at: float) -> None:
        """Evaluate the current model (or reuse its version's metrics) and record it at time ``at``."""
        srv = self.srv
        metrics = self._metrics()
        srv.history.append({"version": srv.version, "virtual_time_s": round(at, 6), **metrics})
        srv.store.record_eval(srv.run_id, srv.version, metrics.get("accuracy"), metrics.get("loss"),
                              metrics=metrics, virtual_time=at)
        if srv.target is not None and srv.time_to_target is None and len(srv.history) >= self.hold:
            srv.time_to_target = time_to_target(srv.history[-self.hold:], srv.target, self.hold)

    def _version_evaluated(self) -> bool:
        h = self.srv.history
        return bool(h) and h[-1]["version"] == self.srv.version

    def _stop(self) -> bool:
        return self.stop_at_target and self.srv.time_to_target is not None

    # -- when ----------------------------------------------------------------------------
    def start(self) -> None:
        """At the start of :meth:`AsyncServer.run`: version 0 at time 0 (a resumed run: what a kill
        left unevaluated under ``eval_every``)."""
        srv = self.srv
        if self.every_s is not None:
            if self.next_k == 0:
                self.record(0.0)
                self.next_k = 1
        elif srv.version % self.every == 0 and not self._version_evaluated():
            self.record(srv.clock.now)

    def on_version(self) -> None:
        """After a version is committed: ``eval_every`` versions (the grid waits for the clock)."""
        if self.every_s is None and self.srv.version % self.every == 0:
            self.record(self.srv.clock.now)

    def until(self, t: float, inclusive: bool) -> float | None:
        """The grid: record every grid time before ``t`` (``inclusive``: up to ``t``) not recorded
        yet. Returns the grid time at which it stopped because the target has held long enough
        (``server.stop_at_target``), else None."""
        if self.every_s is None:
            return None
        self.next_k, stopped = walk_grid(self.next_k, self.every_s, t, inclusive, self.record, self._stop)
        return stopped

    def finish(self) -> None:
        """At the end: the grid up to now, then the final model at the final time if its version
        has no row yet."""
        now = self.srv.clock.now
        self.until(now, inclusive=True)
        if not self._version_evaluated():
            self.record(now)

    def restore(self, times: list[float]) -> None:
        """After a resume rebuilt ``srv.history`` (``times``: the stored rows' exact times): the grid
        position and the time to target, derived from the rows."""
        srv = self.srv
        if self.every_s is not None:
            self.next_k = next_grid_index(times, self.every_s)
        srv.time_to_target = None if srv.target is None else time_to_target(srv.history, srv.target, self.hold)
