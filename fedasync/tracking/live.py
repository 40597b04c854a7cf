"""Live tracking: a server run's records reach ``metrics.jsonl`` and every tracker while it runs,
so ``tensorboard --logdir`` or the MLflow UI shows the run growing.

:class:`LiveTracking` wraps the run's progress callback. The loop reports ``evaluations`` (the
length of its history) with every progress event; when new history rows are there, the tracker
reads the store's update and dispatch rows it has not read yet (by id, never the whole table) and
turns each row into its record (:class:`fedasync.tracking.records.RecordBuilder`), then sends it to
the trackers (TensorBoard flushed at once) and ``metrics.jsonl``.

A row is logged once the store holds everything its record counts: the row's virtual time is
before the clock of the loop's previous step (the loop commits a step's writes when the step ends,
and a step's first writes are the dispatches sent at the previous step's time), and every update
received by then is settled, aggregated or rejected (a buffered update can still be rejected by a
robust filter). Its line in ``metrics.jsonl`` is written when the next row is logged, or at the
end, since the last record also carries the summary's figures (:func:`fedasync.tracking.track_run`
calls :meth:`LiveTracking.finish`). So the files at the end are the ones the end-of-run writer
makes: ``metrics.jsonl`` byte for byte, the same tags, steps and values in TensorBoard and MLflow.

A resumed run (``resume=True``) appends: ``metrics.jsonl``'s lines so far are the steps logged
already, which the tracker counts again but does not log twice; TensorBoard gets a new event file
in the same folder, MLflow continues the run of the same name.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable

if TYPE_CHECKING:
    from fedasync.config import Config
    from fedasync.tracking.records import Record

log = logging.getLogger("fedasync")

#: run directory (resolved) -> its live tracker, until :func:`fedasync.tracking.track_run` finishes it
LIVE: dict[Path, LiveTracking] = {}


def live_for(run_dir: Path) -> LiveTracking | None:
    """The live tracker of the run in ``run_dir`` (taken out of :data:`LIVE`), or None."""
    return LIVE.pop(Path(run_dir).resolve(), None)


class LiveTracking:
    """The progress callback of one server run that also logs its records as they are made.
    ``inner``: the callback it wraps (a progress bar); ``source()``: the run's server (its
    ``history``, ``store`` and ``run_id``) once it exists; ``root``/``label``: as for
    :func:`fedasync.tracking.make_trackers`."""

    def __init__(self, run_dir: Path, cfg: Config, inner: Callable[[dict], None] | None = None,
                 source: Callable[[], Any] | None = None, root: Path | None = None, label: str | None = None,
                 resume: bool = False):
        self.run_dir, self.cfg, self.inner, self.source = Path(run_dir), cfg, inner, source
        self.root, self.label, self.resume = root, label, resume
        self.srv: Any = None
        self.builder: Any = None
        self.made = 0       # history rows made into records
        self.skip = 0       # of them, logged by the run's first part (a resumed run)
        self.pending: Record | None = None  # logged to the trackers, its line not yet written
        self.last_up = self.last_dis = 0    # the highest ids read from the store
        self.unsettled: dict[int, Any] = {}  # id -> an accepted update not yet aggregated
        self.f: Any = None
        self.fan: Any = None
        self.failed = False
        # the clock at the last progress event and at the one before it that showed an earlier time
        self.now = self.before = float("-inf")
        LIVE[self.run_dir.resolve()] = self

    # -- the progress callback ------------------------------------------------------------
    def __call__(self, ev: dict) -> None:
        if self.inner is not None:
            self.inner(ev)
        if self.failed or ev.get("evaluations") is None:
            return
        try:
            if self.srv is None and self.source is not None:
                self.srv = self.source()
            now = round(float(ev["virtual_time_s"]), 6)
            if now > self.now:  # a new step: the one before has committed its writes
                self.before, self.now = self.now, now
            if self.srv is None or int(ev["evaluations"]) <= self.made:
                return
            self._advance(self.before)
        except Exception as e:  # noqa: BLE001 - the run goes on; the end-of-run writer makes the files
            log.warning("tracking: live tracking stopped: %s: %s", type(e).__name__, (str(e).splitlines() or [""])[0])
            self.failed = True
            self._close()

    def _start(self) -> None:
        from fedasync.private import open_private
        from fedasync.tracking.backends import _Fanout, flat_params, make_trackers
        from fedasync.tracking.records import RecordBuilder

        cfg = self.cfg
        self.builder = RecordBuilder(cfg.data.num_clients, local_dp=cfg.privacy.local_dp.enabled,
                                     per_client=cfg.tracking.per_client)
        path = self.run_dir / "metrics.jsonl"
        if self.resume and path.is_file():
            with open(path, "rb") as f:
                self.skip = sum(1 for _ in f)
        self.f = open_private(path, "a" if self.resume else "w")
        self.fan = _Fanout((lambda: make_trackers(cfg, self.run_dir, self.root, self.label, resume=self.resume))
                           if cfg.tracking.backends else list)
        if self.fan.live:
            self.fan("log_params", flat_params(cfg))

    def _read(self, final: bool = False) -> None:
        """The store's rows added since the last read, and the buffered updates settled since."""
        from sqlalchemy import select

        from fedasync.store import schema as S

        srv = self.srv
        with srv.store.session() as s:
            ups = list(s.scalars(select(S.Update).where(S.Update.run_id == srv.run_id, S.Update.id > self.last_up)
                                 .order_by(S.Update.id)))
            dis = list(s.scalars(select(S.Dispatch).where(S.Dispatch.run_id == srv.run_id,
                                                          S.Dispatch.id > self.last_dis).order_by(S.Dispatch.id)))
            if self.unsettled:
                ups += list(s.scalars(select(S.Update).where(S.Update.id.in_(list(self.unsettled)))))
        self.unsettled = {}
        settled = []
        for u in ups:
            self.last_up = max(self.last_up, u.id)
            if not final and u.accepted and u.applied_in_version is None:
                self.unsettled[u.id] = u  # a buffered update: a filter may still reject it
            else:
                settled.append(u)
        if dis:
            self.last_dis = dis[-1].id
        self.builder.add(settled, dis)

    def _advance(self, until: float) -> None:
        """Log the history rows before virtual time ``until`` whose updates are all settled."""
        history = self.srv.history
        ready = self.made
        while ready < len(history) and float(history[ready]["virtual_time_s"]) < until:
            ready += 1
        if ready == self.made:
            return
        if self.builder is None:
            self._start()
        self._read()
        if self.unsettled:  # the rows after the first unsettled update wait for it
            first = min(round(float(u.received_virtual), 6) for u in self.unsettled.values())
            while ready > self.made and float(history[ready - 1]["virtual_time_s"]) >= first:
                ready -= 1
        for row in history[self.made:ready]:
            self._log(self.builder.record(row))
        self.made = ready
        self.f.flush()
        if self.fan.live:
            self.fan("flush")

    def _log(self, r: Record) -> None:
        if self.made < self.skip:  # logged by the run's first part
            self.made += 1
            return
        self.made += 1
        from fedasync.tracking.backends import _line

        if self.pending is not None:
            self.f.write(_line(self.pending))
        self.pending = r
        self.fan("log_step", r.step, r.time, _scalars(r.scalars), r.histograms)

    # -- the end ----------------------------------------------------------------------------
    def finish(self, summary: dict, last: Callable[[dict], None], model: Callable[[], Path | None]) -> bool:
        """Log what is left of the run ``summary`` describes (``last(scalars)`` adds the summary's
        figures to the last record; ``model()``: the final model's file), write the last line and
        close the trackers. False (nothing done) when live tracking stopped on an error: the
        end-of-run writer makes the files instead."""
        if self.failed:
            return False
        try:
            if self.srv is None and self.source is not None:
                self.srv = self.source()
            history = summary["history"]
            if self.builder is None:
                self._start()
            if self.srv is not None:
                self._read(final=True)
            for row in history[self.made:]:
                self._log(self.builder.record(row))
            self.made = len(history)
            if self.pending is not None:
                before = dict(self.pending.scalars)
                last(self.pending.scalars)
                extra = {k: v for k, v in self.pending.scalars.items() if k not in before}
                from fedasync.tracking.backends import _line

                self.f.write(_line(self.pending))
                if extra and self.fan.live:
                    self.fan("log_step", self.pending.step, self.pending.time, _scalars(extra), {})
            self.f.close()
            self.f = None
            if self.fan.live:
                path = model()
                if path is not None:
                    self.fan("log_model", path)
                self.fan("close")
            return True
        except Exception as e:  # noqa: BLE001
            log.warning("tracking: live tracking failed at the end: %s: %s", type(e).__name__,
                        (str(e).splitlines() or [""])[0])
            self._close()
            return False

    def _close(self) -> None:
        LIVE.pop(self.run_dir.resolve(), None)
        if self.f is not None:
            self.f.close()
            self.f = None
        if self.fan is not None and self.fan.live:
            self.fan("close")
            self.fan.live = []

    def abandon(self) -> None:
        """The run failed before its end: close the file and the trackers as they stand."""
        if self.pending is not None and self.f is not None:
            from fedasync.tracking.backends import _line

            self.f.write(_line(self.pending))
            self.pending = None
        self._close()


def abandon_live(run_dirs: Any) -> None:
    """Close the live trackers still open for ``run_dirs`` (their runs failed before their end)."""
    for d in run_dirs:
        t = live_for(d)
        if t is not None:
            t.abandon()


def _scalars(scalars: dict) -> dict:
    """What a tracker gets of a record's scalars: not ``step``/``virtual_time_s``, no None."""
    return {k: v for k, v in scalars.items() if k not in ("step", "virtual_time_s") and v is not None}
