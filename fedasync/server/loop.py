"""The asynchronous server loop: dispatch, take replies, validate, aggregate, record, evaluate.

It talks to clients through a ``Transport`` (Flower's Grid in ``server/app.py``; ``LocalTransport``
runs clients in-process), to the database through ``Store``; it imports no Flower. Its parts (the
task's evaluator and initial model, client sizes, profiles, strategy, policies, privacy tracker)
come from :func:`fedasync.assembly.assemble`: it neither loads data nor builds models. Around it:
``transport.py``, ``resume.py`` (crash safety), ``records.py``, ``control.py``, ``summary.py``.

Semantics (see docs in README "How the asynchronous loop works"):

* State: the global model ``x``, its version ``v``; a reply's staleness is ``v - base_version``.
* Up to ``concurrency`` tasks are live (synchronous FedAvg: one round of ``m + b``).
* **Virtual clock** (simulation): the duration of every task is drawn at dispatch from its
  client's speed profile; replies are taken in order of virtual finish time, those at the same
  instant all (in task-id order) before the server dispatches again. The result is a pure
  function of the config and seed, however the engine schedules the real work.
* **Wall clock** (deployment): replies are taken in arrival order; ``transport.refresh()`` runs
  every step (node discovery) and, while ``available_clients`` (clients with a node) is empty,
  the server waits up to ``deploy.node_discovery_timeout`` seconds.
* **Failures never stop the run**: a task that errors, cannot be pushed or exceeds
  ``server.task_timeout`` is recorded (``failed`` / ``timeout``), its slot goes to another client;
  a reply after the timeout follows ``server.late_policy`` (``reject``: recorded ``late``;
  ``accept``: taken, with its staleness); one that matches no open task is a ``replay``.
* **Crash safety** (``resume.py``): every batch of dispatches and every task's end (reply,
  failure, timeout, refusal) is committed with the loop state, a reply with the version it
  produced (``Store.record_reply``). On resume the tasks in
  flight (or cancelled by a stop) are sent again, under the virtual clock exactly as they were
  (a resumed simulation ends with the model of one never interrupted), under the wall clock
  to the first new tasks' clients. SIGINT/SIGTERM stop after the reply being handled (a second
  at once); in deployment, so does a store status of ``stopping`` (``fedasync server``'s Ctrl-C).
* Each taken reply is validated, handed to the strategy and recorded in one transaction with
  the model version it produced. Evaluation (``evaluation.py``): on a grid of times
  (``server.eval_every_s``; or every ``eval_every`` versions) and at the end; its metrics are the
  task's (every one in the history and the store); ``server.target`` (any metric, ``max`` or
  ``min``; ``target_accuracy`` its alias) held ``server.target_hold`` evaluations in a row sets the
  time to target.
* **Liveness** (``progress.py``): a new version that is not finite is never committed (the updates
  that made it are rejected ``non_finite_model``); ``server.max_rejected_in_a_row`` rejected
  replies in a row stop the run (``no_progress``).
"""

from __future__ import annotations

import contextlib
import logging
import time
from typing import Any, Callable

import numpy as np

from fedasync.assembly import RunParts, assemble
from fedasync.config import Config
from fedasync.server import progress, resume
from fedasync.server.clock import VirtualClock, WallClock, task_duration
from fedasync.server.control import ROUND_CLOSED, StopControl, cancel_dropped, no_task_reason
from fedasync.server.evaluation import Evaluations
from fedasync.server.records import Digests, replay_row, update_row
from fedasync.server.idle import IdleClients
from fedasync.server.params import Tail, one_blas_thread
from fedasync.server.progress import Liveness
from fedasync.server.retention import Retention
from fedasync.server.strategies import Update, params_sha256
from fedasync.server.summary import build_summary, progress_event
from fedasync.server.transport import Live, Reply, TaskMsg, Transport, task_seed
from fedasync.server.validation import UpdateValidator
from fedasync.signing import num_examples_of
from fedasync.store import Store

log = logging.getLogger("fedasync")

Params = dict[str, np.ndarray]


class AsyncServer:
    """One run of the asynchronous (or synchronous-baseline) server."""

    def __init__(
        self, cfg: Config, transport: Transport, store: Store, clock: str = "virtual",
        progress: Callable[[dict], None] | None = None,
        client_config: Callable[[int], dict] | None = None,
        mode: str = "simulation",
        resume_run_id: int | None = None,
        validator: UpdateValidator | None = None,
        node_for_client: Callable[[int], int | None] | None = None,
        available_clients: Callable[[], set[int]] | None = None,
        public_keys: dict[int, Any] | None = None,
        parts: RunParts | None = None,
    ):
        """``parts``: what :func:`fedasync.assembly.assemble` built for ``cfg`` (None: it is called
        here); the constructor neither loads data nor builds models. ``public_keys`` (client id ->
        Ed25519 public key) turns signature checks on; ``available_clients`` (deployment) names the
        clients that have a node now."""
        if parts is None:
            parts = assemble(cfg, mode=mode, resume=resume_run_id is not None)
        self.cfg = cfg
        self.parts = parts
        self.transport = transport
        self.store = store
        store.retry_for_s = cfg.store.retry_for_s  # the database away: how long each write waits (store/retry.py)
        self.virtual = clock == "virtual"
        self.clock = VirtualClock() if self.virtual else WallClock()
        self.progress = progress or (lambda ev: None)
        self.mode = mode
        self.node_for_client = node_for_client
        self.available_clients = available_clients
        self.evaluator = parts.evaluator  # params -> the task's metrics
        self.target = cfg.server.goal()  # server.target (or target_accuracy): a metric, a value, max|min
        self.num_examples = parts.num_examples
        self.profiles = parts.profiles
        self.strategy = parts.strategy
        self.policy = parts.policy  # server.scheduler, delay_compensation, robust; attack
        self.scheduler = self.policy.scheduler
        self.client_config = client_config or (lambda cid: {})
        self.live: dict[int, Live] = {}
        self.idle = IdleClients(cfg.data.num_clients)
        self.arrived: dict[int, Reply] = {}
        self.by_message: dict[str, int] = {}
        self.exhausted: set[int] = set()
        self.history: list[dict] = []
        self.staleness: list[int] = []
        self.rejections: dict[str, int] = {}
        self.received = self.accepted = self.failed = 0
        self.time_to_target: float | None = None
        self.stop_reason: str | None = None
        self.t_wall0 = time.time()
        self.replays = 0
        self.liveness = Liveness()  # the replies since the last accepted update (progress.py)
        self.closed: dict[str, tuple[int, int]] = {}  # message id -> (task id, client id) once handled
        self.cancelled: dict[str, Live] = {}  # wall clock: message id -> a backup task its round dropped
        self._resend: list[Any] = []  # virtual-clock resume: dispatch rows to send again as they were
        self._priority: list[int] = []  # wall-clock resume: clients whose tasks were lost go first
        self._no_client_since: float | None = None
        self.digests = Digests()  # the sha256 of each reply, for its row

        self._strategy_snapshot = self.strategy.state_dict()
        self._scheduler_snap: dict | None = None  # resume.loop_state's last scheduler snapshot (id, sizes)
        self.evals = Evaluations(self)  # when the model is evaluated; the history; the time to target
        if resume_run_id is None:
            self.params = parts.initial_params()
            self.version = 0
            self.next_task = 0
            self.run_id = store.create_run(cfg.name, cfg.server.strategy, cfg.seed, cfg.to_yaml(), mode)
            store.register_clients(self.run_id, [
                {"client_id": p.client_id, "profile": p.__dict__} for p in self.profiles
            ])
            store.add_initial_version(self.run_id, self.params, params_sha256(self.params))
            self.retention = Retention(cfg.store.checkpoint_every, cfg.store.save_parameters, held=[0],
                                       keep_last=cfg.server.average_last)
            self.tail = Tail(cfg.server.average_last, [self.params])
        else:
            resume.restore(self, resume_run_id)
        self.run_key = store.get_run(self.run_id).run_key  # random, per run: what signed updates cover
        self.model_bytes = int(sum(a.nbytes for a in self.params.values()))
        self.validator = validator or UpdateValidator(self.params, cfg.server, public_keys=public_keys)
        self.base_cache: dict[int, Params] = {self.version: self.params}
        self.setup_json = parts.setup_json
        self.privacy = None if parts.make_privacy is None else \
            parts.make_privacy(store, self.run_id, self.strategy, resume_run_id is not None)
        self.policy.observe_budgets(self.privacy, range(cfg.data.num_clients))
        self.stop = StopControl(None if self.virtual else
                                lambda: self.store.get_run(self.run_id).status == "stopping")

    # -- main --------------------------------------------------------------------------
    def run(self) -> dict:
        try:
            with self.stop.signals(), one_blas_thread():
                return self._run()
        finally:
            self.digests.close()
            self.store.drop_spare_files()

    def _run(self) -> dict:
        if self._resend:
            self._send_and_record(*resume.resend_tasks(self), loop_state=None)
            cancel_dropped(self)  # backups of a closed round resent for their DP spend (resume.restore)
        self.evals.start()  # v0, or a resumed run killed between a version and its evaluation
        self._emit()
        try:
            if self.virtual and self.live and self._next_events()[0] <= self.clock.now:
                self._step_virtual()  # resumed in the middle of a batch of replies due at one instant
            while True:
                with self.store.batch() if self.virtual else contextlib.nullcontext():  # a step: one transaction
                    reason = self._should_stop()
                    if reason:
                        self.stop_reason = reason
                        break
                    self._fill()
                    if not self.live:
                        if progress.wait_for_clients(self):
                            continue
                        self.stop_reason = no_task_reason(self)
                        break
                    self._no_client_since = None
                    if self.virtual:
                        self._step_virtual()
                        if self.stop_reason:
                            break
                    else:
                        self._step_wall()
        except KeyboardInterrupt:
            self.stop_reason = "interrupted"
            resume.stopped_abruptly(self)  # the loop may be ahead of the store: back to what it holds
            return self._finish("stopped")
        return self._finish("stopped" if self.stop_reason == "interrupted" else "finished")

    def _step_virtual(self) -> None:
        tmin, due = self._next_events()
        limit = self.cfg.server.max_virtual_time
        over = limit is not None and tmin > limit
        at_target = self.evals.until(limit if over else tmin, inclusive=over)  # the grid times passed
        if at_target is not None:  # server.stop_at_target: held long enough at grid time at_target
            self.clock.advance_to(at_target)
            return
        if over:
            self.clock.advance_to(limit)
            self.stop_reason = "max_virtual_time"
            return
        self._wait_for([t.task_id for kind, t in due if kind == "reply"])
        self.clock.advance_to(tmin)
        for kind, t in due:
            if t.task_id not in self.live:  # a backup cancelled by the round an earlier reply of this instant closed
                continue
            if kind == "timeout":
                self._handle_timeout(t)
            else:
                self._handle(t, self.arrived[t.task_id])

    def _step_wall(self) -> None:
        if self.evals.until(self.clock.now, inclusive=True) is not None:
            return  # server.stop_at_target: _should_stop ends the run
        self._refresh()
        self._poll()
        now = self.clock.now
        for t in list(self.live.values()):
            if t.deadline is not None and not t.timed_out and now >= t.deadline:
                self._handle_timeout(t)
        ready = sorted((r.arrival_wall, tid) for tid, r in self.arrived.items() if tid in self.live)
        if not ready:
            time.sleep(self.cfg.server.poll_interval)
            return
        for _, tid in ready:
            if tid not in self.live:  # cancelled by the round an earlier reply of this batch closed
                continue
            self._handle(self.live[tid], self.arrived[tid])
            if self._should_stop():
                return

    def _finish(self, status: str) -> dict:
        self.evals.finish()
        self.store.mark_in_flight(self.run_id, "cancelled", drop_params=self.retention.release_for(self))
        summary = self.summary()
        self.store.set_run_status(self.run_id, status, self.stop_reason, summary)
        return summary

    def summary(self) -> dict:
        return build_summary(self)

    # -- dispatch ----------------------------------------------------------------------
    def _slots(self) -> int:
        live = [t for t in self.live.values() if not t.timed_out]
        if self.strategy.synchronous:
            this_round = [t for t in live if t.base_version == self.version]
            return self.strategy.round_size - len(self.strategy.pending()) - len(this_round)
        return self.cfg.server.concurrency - len(live)

    def _fill(self) -> None:
        n = self._slots()
        if n <= 0:
            return
        busy = {t.client_id for t in self.live.values()}
        avail = self.available_clients() if self.available_clients is not None else None
        idle = self.policy.eligible(self.idle(busy, self.exhausted, avail))
        chosen = []
        for c in list(self._priority):
            if len(chosen) < n and c in idle:
                chosen.append(c)
                idle.remove(c)
                self._priority.remove(c)
        chosen += self.policy.choose(idle, n - len(chosen))
        if not chosen:
            return
        self.policy.forget_closed(self.live)  # before the new tasks: what it remembers of closed ones goes
        tasks, lives = [], []
        now = self.clock.now
        for c in chosen:
            tid = self.next_task
            self.next_task += 1
            steps = self._steps(c)
            dur = task_duration(self.profiles[c], steps, self.model_bytes, self.cfg.clock, self.cfg.seed, tid)
            conf = self._task_config(tid, c, self.version, dur)
            tasks.append(TaskMsg(tid, c, self.node_for_client(c) if self.node_for_client else None,
                                 self.policy.task_params(c, self.version, self.params, tid), conf))
            self.policy.on_dispatch(c, now, self.version)
            timeout = self.cfg.server.task_timeout
            lives.append(Live(tid, c, self.version, now, now + dur if self.virtual else None,
                              now + timeout if timeout else None, None))
        self.base_cache[self.version] = self.params
        self._send_and_record(tasks, lives, loop_state=resume.loop_state(self))

    def _task_config(self, tid: int, c: int, base_version: int, dur: float) -> dict[str, Any]:
        conf = {
            "task_id": tid, "client_id": c, "run_id": self.run_id, "run_key": self.run_key,
            "base_version": base_version,
            "seed": task_seed(self.cfg.seed, tid),
            "sleep_s": dur * self.cfg.clock.time_scale if self.cfg.clock.emulate else 0.0,
            "setup": self.setup_json,
        }
        if self.mode == "deployment":  # the ClientApp trains its own data and echoes who it is; its
            conf.update(deployment=True, task_timeout=self.cfg.server.task_timeout)  # trainer's deadline
        if self.privacy is not None:
            conf["privacy"] = self.privacy.client_config(c)
        conf.update(self.policy.task_config(c))  # a simulated attacker's orders
        conf.update(self.client_config(c))
        return conf

    def _send_and_record(self, tasks: list[TaskMsg], lives: list[Live], loop_state: str | None) -> None:
        """Push ``tasks``, then commit every dispatch row, the next task id and the loop state (with
        the scheduler's stream after choosing them) in one transaction."""
        try:
            ids = list(self.transport.send(tasks))
        except Exception as e:  # a transport error fails these tasks, not the run
            log.warning("pushing %d task(s) failed: %s: %s", len(tasks), type(e).__name__, e)
            ids = []
        if len(ids) != len(tasks):
            ids = [None] * len(tasks)
        rows = []
        for task, lv, mid in zip(tasks, lives, ids):
            row = {"task_id": lv.task_id, "client_id": lv.client_id, "base_version": lv.base_version,
                   "sent_virtual": lv.sent_t, "finish_virtual": lv.finish_t, "node_id": task.node_id,
                   "message_id": mid, "status": "timeout" if lv.timed_out else "in_flight"}
            if mid is None:  # push refused: the slot goes to another client next time round
                self.failed += 1
                row.update(status="failed", error="push failed")
            else:
                lv.message_id = mid
                self.live[lv.task_id] = lv
                self.by_message[mid] = lv.task_id
            rows.append(row)
        self.store.record_dispatches(self.run_id, rows, self.next_task, loop_state=loop_state,
                                     virtual_time=self.clock.now if loop_state is not None else None)

    def _steps(self, client_id: int) -> int:
        from fedasync.task.train import steps_for

        return steps_for(self.cfg.train, self.num_examples[client_id])

    # -- taking replies ----------------------------------------------------------------
    def _poll(self) -> None:
        ids = [t.message_id for t in self.live.values() if t.task_id not in self.arrived] + list(self.cancelled)
        if not ids:
            return
        try:
            polled = self.transport.poll(ids)
        except Exception as e:  # a transport error is retried at the next poll
            if self.virtual:
                raise
            log.warning("pulling replies failed: %s: %s", type(e).__name__, e)
            return
        for mid, reply in polled:
            tid = self.by_message.pop(mid, None)
            if mid in self.cancelled:
                self.take_cancelled(self.cancelled.pop(mid), reply)
                continue
            if tid is None or tid not in self.live or tid in self.arrived:
                self._stray(mid, reply)
                continue
            reply.task_id = tid
            self.arrived[tid] = reply

    def _stray(self, mid: str, reply: Reply) -> None:
        """A reply that matches no open task: a replay of a closed task's reply, or a reply for a
        task never dispatched. Rejected as ``replay``, recorded in ``replays``; nothing else changes."""
        if reply.error is not None:
            log.debug("error reply for message %s, which no open task waits for: %s", mid, reply.error)
            return
        row = replay_row(mid, reply, self.closed, self.clock.now)
        self.replays += 1
        self.rejections["replay"] = self.rejections.get("replay", 0) + 1
        self.store.record_replay(self.run_id, row)
        log.warning("rejected a reply (message %s, task %s): replay, the task is not open", mid, row["task_id"])

    def _wait_for(self, task_ids: list[int]) -> None:
        while any(t not in self.arrived for t in task_ids):
            self._poll()
            if any(t not in self.arrived for t in task_ids):
                time.sleep(self.cfg.server.poll_interval)

    def _next_events(self) -> tuple[float, list[tuple[str, Live]]]:
        """Virtual clock: the earliest event time and every event at it (timeouts, finishes)."""
        events: list[tuple[float, int, str, Live]] = []
        for t in self.live.values():
            if t.deadline is not None and not t.timed_out and t.deadline < t.finish_t:
                events.append((t.deadline, t.task_id, "timeout", t))
            else:
                events.append((t.finish_t, t.task_id, "reply", t))
        tmin = min(e[0] for e in events)
        due = sorted((e for e in events if e[0] == tmin), key=lambda e: (e[1], e[2]))
        return tmin, [(kind, t) for _, _, kind, t in due]

    def _handle_timeout(self, t: Live) -> None:
        t.timed_out = True
        self.failed += 1
        self.policy.on_failure(t.client_id, self.clock.now - t.sent_t)  # the scheduler: no reply
        self.store.set_dispatch_status(self.run_id, t.task_id, "timeout", "task_timeout",
                                       loop_state=resume.loop_state(self))

    def _handle(self, t: Live, reply: Reply) -> None:
        """Close task ``t`` with ``reply``: a failure, a refusal, or an update to take."""
        del self.live[t.task_id]
        self.arrived.pop(t.task_id, None)
        if t.message_id is not None:
            self.closed[t.message_id] = (t.task_id, t.client_id)
        if reply.error is not None:
            self.failed += 1
            self.policy.on_failure(t.client_id, self.clock.now - t.sent_t)
            self.store.set_dispatch_status(self.run_id, t.task_id, "failed", reply.error,  # the scheduler's state too
                                           loop_state=resume.loop_state(self))
            log.warning("task %d (client %d) failed: %s", t.task_id, t.client_id, reply.error)
        elif reply.refused is not None:
            self.exhausted.add(t.client_id)
            self.store.mark_exhausted(self.run_id, t.client_id, reply.refused)
            self.store.set_dispatch_status(self.run_id, t.task_id, "refused", reply.refused,
                                           loop_state=resume.loop_state(self))
        else:
            self._take(t, reply)
            self._emit()

    def take_cancelled(self, t: Live, reply: Reply) -> None:
        """A cancelled backup's late reply: recorded, rejected as ``round_closed``, holds no slot."""
        self.closed[t.message_id] = (t.task_id, t.client_id)
        if reply.error is None:
            self._take(t, reply, dispatch_status="cancelled")

    def _take(self, t: Live, reply: Reply, dispatch_status: str | None = None) -> None:
        """Validate an update, hand it to the strategy, and record it with the version it made."""
        self.received += 1
        digest = self.digests.of(reply, self.validator.signing)
        s = self.version - t.base_version
        if not isinstance(reply.metrics, dict):  # a malformed reply must not stop the run
            reply.metrics = {}
        num_examples = num_examples_of(reply.metrics)  # the weight the signature covers
        base = self.base_cache.get(t.base_version)  # None: a cancelled backup's late reply
        reason = self.validator.check(reply, t, s, run_id=self.run_id, base=base, run_key=self.run_key) \
            if base else ROUND_CLOSED
        if reason is None and self.privacy is not None:  # a DP reply's accounting, checked before anything changes
            reason = self.privacy.check_reply(t.client_id, reply.metrics)
        if reason is None and t.timed_out and self.cfg.server.late_policy == "reject":
            reason = "late"
        upd = None
        if reason is None:
            upd = Update(task_id=t.task_id, client_id=t.client_id, params=reply.params, base_params=base,
                         base_version=t.base_version, staleness=s, num_examples=num_examples)
            reason = self.strategy.check(upd, self.version)
            if reason is None:  # server.robust filter, then server.delay_compensation (may replace upd.params)
                reason = self.policy.judge(upd, self.params, self.version)
        new_version, weight, earlier = None, None, {}
        if reason is None:
            weight = float(self.strategy.weight(upd))
            new, reason, earlier = progress.aggregate(self, upd)  # a non-finite model: rejected, undone
        if reason is None:
            self.accepted += 1
            self.staleness.append(s)
            if new is not None:
                new_version = self._new_version(new)
        else:
            weight = None
            self.rejections[reason] = self.rejections.get(reason, 0) + 1
        progress.taken(self, reason)
        row = update_row(t, reply, version_at_arrival=self.version - (1 if new_version else 0), staleness=s,
                         weight=weight, num_examples=num_examples, reason=reason, now=self.clock.now,
                         pending=reason is None and t.task_id in self.strategy.pending(), params_sha256=digest())
        if row["pending_params"] is not None:  # what the buffer holds (filtered / compensated), for a resume
            row["pending_params"] = upd.params
        kept = self.policy.take_remembered()  # kardam: the update it now remembers, kept for a resume
        row["filter_params"], forget = kept if kept and self.cfg.store.save_parameters else (None, None)
        privacy, client_state = (None, None) if self.privacy is None else \
            self.privacy.on_reply(t.client_id, t.task_id, reply.metrics)  # DP: privacy_spend row, accountant
        self.policy.on_reply(t.client_id, self.clock.now - t.sent_t, s, self.privacy)
        status = dispatch_status or ("late" if t.timed_out else "replied")
        if row["pending_params"] is not None:
            self.retention.buffered(t.task_id, t.base_version)
        self.store.record_reply(self.run_id, t.task_id, row, status,
                                new_version, resume.loop_state(self),
                                self.clock.now, privacy=privacy, client_state=client_state,
                                drop_params=self.retention.release_for(self), forget_filter_params=forget,
                                rejected=earlier)
        if new_version is not None:
            self.retention.stored(self.version)  # (retention keeps nothing without save_parameters)
            cancel_dropped(self)
            self._prune_cache()
            self.evals.on_version()

    def _new_version(self, new: Params) -> dict:
        """Make ``new`` the global model; the ``model_versions`` row to record."""
        parent = self.version
        self.version += 1
        self.params = new
        self.tail.append(new)
        return {
            "version": self.version, "parent": parent, "sha256": params_sha256(new),
            "params": new if self.cfg.store.save_parameters else None,
            "task_ids": self.strategy.last_aggregated(),
        }

    def _prune_cache(self) -> None:
        keep = {t.base_version for t in self.live.values()} | {self.version}
        for v in list(self.base_cache):
            if v not in keep:
                del self.base_cache[v]

    # -- progress ----------------------------------------------------------------------
    def _emit(self) -> None:
        self.progress(progress_event(self))

    # -- stopping and waiting ------------------------------------------------------------
    def _should_stop(self) -> str | None:
        if self.stop.requested():
            return "interrupted"
        s = self.cfg.server
        if s.max_versions is not None and self.version >= s.max_versions:
            return "max_versions"
        if progress.stalled(self):
            return progress.NO_PROGRESS
        if s.stop_at_target and self.time_to_target is not None:
            return "target_accuracy" if s.target_accuracy is not None else "target"
        if s.max_wall_time is not None and time.time() - self.t_wall0 >= s.max_wall_time:
            return "max_wall_time"
        if not self.virtual and s.max_virtual_time is not None and self.clock.now >= s.max_virtual_time:
            return "max_virtual_time"
        return None

    def _refresh(self) -> None:
        refresh = getattr(self.transport, "refresh", None)
        if refresh is not None:
            try:
                refresh()
            except Exception as e:
                log.warning("node discovery failed: %s: %s", type(e).__name__, e)
