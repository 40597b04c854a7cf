"""The asynchronous server loop: dispatch, take replies, validate, aggregate, record, evaluate.

The loop talks to clients through a :class:`Transport` (Flower's Grid in ``server/app.py``;
:class:`LocalTransport` below runs the same client code in-process, for tests and quick looks)
and to the database through :class:`fedasync.store.Store`. It imports no Flower.

Semantics (see docs in README "How the asynchronous loop works"):

* State: the global model ``x`` and its version ``v``. Each dispatch records ``base_version``;
  a reply's staleness is ``s = v_now - base_version``.
* Up to ``concurrency`` tasks are live (synchronous FedAvg: one round of ``m + b``).
* **Virtual clock** (simulation): the duration of every task is drawn at dispatch from its
  client's speed profile, so every task has a virtual finish time. Replies are taken in order
  of virtual finish time; replies that finish at the same virtual instant are all taken (in
  task-id order) before the server dispatches again. The result is a pure function of the
  config and seed, however the engine schedules the real work.
* **Wall clock** (deployment): replies are taken in arrival order. A transport may offer
  ``refresh()`` (called every step: node discovery) and the server an ``available_clients``
  callable (clients that have a node now); while no client is available the server waits up to
  ``deploy.node_discovery_timeout`` seconds.
* **Failures never stop the run**: a task that errors, cannot be pushed or exceeds
  ``server.task_timeout`` is recorded (``failed`` / ``timeout``) and its slot goes to another
  client; a reply after the timeout follows ``server.late_policy`` (``reject``: recorded as
  ``late``; ``accept``: taken, with its staleness). A reply that matches no open task is
  rejected as ``replay`` and recorded in the ``replays`` table.
* **Crash safety**: every batch of dispatches is committed with the loop state (scheduler
  stream, clock) and every reply with the version it produced (``Store.record_reply``). On
  resume the tasks that were in flight (or cancelled by a stop) are sent again: under the
  virtual clock exactly as they were (same task id, client, base version, seed and virtual
  times), so a resumed simulation ends with the same model as one never interrupted; under the
  wall clock their clients get the first new tasks. SIGINT/SIGTERM stop after the reply being
  handled and mark the run ``stopped`` (a second signal stops at once); in deployment a run
  whose store status is set to ``stopping`` (``fedasync server``'s Ctrl-C) stops the same way.
* Each taken reply is validated, handed to the strategy and recorded in one transaction with
  the model version it produced. Evaluation runs every ``eval_every`` versions and at the end.
"""

from __future__ import annotations

import json
import logging
import math
import signal
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Protocol

import numpy as np

from fedasync.config import Config
from fedasync.server.clock import VirtualClock, WallClock, make_profiles, task_duration
from fedasync.server.scheduler import make_scheduler
from fedasync.server.strategies import Update, make_strategy, params_sha256
from fedasync.server.validation import UpdateValidator
from fedasync.store import Store, dumps_state, loads_state

log = logging.getLogger("fedasync")

Params = dict[str, np.ndarray]


# -- what crosses the transport ------------------------------------------------------


@dataclass
class TaskMsg:
    task_id: int
    client_id: int
    node_id: int | None
    params: Params
    config: dict[str, Any]


@dataclass
class Reply:
    task_id: int
    params: Params | None = None
    metrics: dict[str, Any] = field(default_factory=dict)
    error: str | None = None  # the task failed (transport or client exception)
    refused: str | None = None  # the client declined (e.g. privacy_budget_exhausted)
    signature: bytes | None = None
    arrival_wall: float = field(default_factory=time.time)


class Transport(Protocol):
    """``poll`` returns replies for (some of) ``message_ids``; anything else it returns is treated
    as a stray reply (rejected ``replay``). Optional: ``refresh()``, called each wall-clock step."""

    def node_ids(self) -> list[int]: ...
    def send(self, tasks: list[TaskMsg]) -> list[str | None]: ...  # message ids (None: not sent)
    def poll(self, message_ids: list[str]) -> list[tuple[str, Reply]]: ...


class LocalTransport:
    """Runs the client code in this process, at send time. No Flower, no Ray."""

    def __init__(self, handler: Callable[[Params, dict], dict] | None = None):
        if handler is None:
            from fedasync.clients.runner import handle_train

            handler = handle_train
        self.handler = handler
        self._ready: dict[str, Reply] = {}
        self._n = 0

    def node_ids(self) -> list[int]:
        return [0]

    def send(self, tasks: list[TaskMsg]) -> list[str | None]:
        ids = []
        for t in tasks:
            self._n += 1
            mid = f"local-{self._n}"
            try:
                self._ready[mid] = reply_from_content(t.task_id, self.handler(t.params, t.config))
            except Exception as e:  # a client exception comes back as an error reply
                self._ready[mid] = Reply(task_id=t.task_id, error=f"{type(e).__name__}: {e}")
            ids.append(mid)
        return ids

    def poll(self, message_ids: list[str]) -> list[tuple[str, Reply]]:
        return [(m, self._ready.pop(m)) for m in message_ids if m in self._ready]


def reply_from_content(task_id: int, content: dict) -> Reply:
    """Turn a client handler's result dict into a Reply."""
    return Reply(
        task_id=task_id,
        params=content.get("params"),
        metrics=dict(content.get("metrics", {})),
        refused=content.get("refused"),
        signature=content.get("signature"),
    )


# -- the loop ------------------------------------------------------------------------


@dataclass
class Live:
    task_id: int
    client_id: int
    base_version: int
    sent_t: float
    finish_t: float | None  # virtual finish time (None under the wall clock)
    deadline: float | None
    message_id: str | None
    timed_out: bool = False


def client_setup_json(cfg: Config) -> str:
    """What a client needs to build its data, model and trainer (sent with every task)."""
    return json.dumps({
        "seed": cfg.seed,
        "data": cfg.data.model_dump(mode="json"),
        "model": cfg.model.model_dump(mode="json"),
        "train": cfg.train.model_dump(mode="json"),
        "privacy": cfg.privacy.model_dump(mode="json"),
    }, sort_keys=True)


def task_seed(seed: int, task_id: int) -> int:
    return int(np.random.SeedSequence([seed, task_id]).generate_state(1)[0])


def percentile(xs: list[float], q: float) -> float | None:
    return float(np.percentile(xs, q)) if xs else None


class AsyncServer:
    """One run of the asynchronous (or synchronous-baseline) server."""

    def __init__(
        self,
        cfg: Config,
        transport: Transport,
        store: Store,
        clock: str = "virtual",
        progress: Callable[[dict], None] | None = None,
        client_config: Callable[[int], dict] | None = None,
        mode: str = "simulation",
        resume_run_id: int | None = None,
        validator: UpdateValidator | None = None,
        node_for_client: Callable[[int], int | None] | None = None,
        available_clients: Callable[[], set[int]] | None = None,
        public_keys: dict[int, Any] | None = None,
    ):
        """``public_keys`` (client id -> Ed25519 public key) turns signature checks on;
        ``available_clients`` (deployment) names the clients that have a node now."""
        from fedasync.task.data import load_federated, load_test
        from fedasync.task.models import build_model, init_params

        self.cfg = cfg
        self.transport = transport
        self.store = store
        self.virtual = clock == "virtual"
        self.clock = VirtualClock() if self.virtual else WallClock()
        self.progress = progress or (lambda ev: None)
        self.mode = mode
        self.node_for_client = node_for_client
        self.available_clients = available_clients
        fed = load_federated(cfg.data, cfg.seed)
        self.x_test, self.y_test = load_test(cfg.data, cfg.seed)
        self.eval_model = build_model(cfg.model, fed.input_shape, fed.num_classes)
        self.num_examples = [len(p[1]) for p in fed.partitions]
        self.profiles = make_profiles(cfg.data.num_clients, cfg.clock, cfg.seed)
        central = cfg.privacy.central_dp if cfg.privacy.central_dp.enabled else None
        self.strategy = make_strategy(cfg.server, cfg.weighting, cfg.seed, central_dp=central,
                                      reproducible_noise=cfg.privacy.reproducible_noise)
        self.scheduler = make_scheduler("uniform", cfg.seed)
        self.client_config = client_config or (lambda cid: {})
        self.live: dict[int, Live] = {}
        self.arrived: dict[int, Reply] = {}
        self.by_message: dict[str, int] = {}
        self.exhausted: set[int] = set()
        self.history: list[dict] = []
        self.staleness: list[int] = []
        self.rejections: dict[str, int] = {}
        self.received = 0
        self.accepted = 0
        self.failed = 0
        self.time_to_target: float | None = None
        self.stop_reason: str | None = None
        self.t_wall0 = time.time()
        self.replays = 0
        self.closed: dict[str, tuple[int, int]] = {}  # message id -> (task id, client id) once handled
        self._resend: list[Any] = []  # virtual-clock resume: dispatch rows to send again as they were
        self._priority: list[int] = []  # wall-clock resume: clients whose tasks were lost go first
        self._stop_signal: int | None = None
        self._last_stop_check = 0.0
        self._stop_asked = False
        self._no_client_since: float | None = None

        self._strategy_snapshot = self.strategy.state_dict()
        if resume_run_id is None:
            self.params = init_params(cfg.model, fed.input_shape, fed.num_classes, cfg.seed)
            self.version = 0
            self.next_task = 0
            self.run_id = store.create_run(cfg.name, cfg.server.strategy, cfg.seed, cfg.to_yaml(), mode)
            store.register_clients(self.run_id, [
                {"client_id": p.client_id, "profile": p.__dict__} for p in self.profiles
            ])
            store.add_initial_version(self.run_id, self.params, params_sha256(self.params))
        else:
            self._resume(resume_run_id)
        self.model_bytes = int(sum(a.nbytes for a in self.params.values()))
        self.validator = validator or UpdateValidator(self.params, cfg.server, public_keys=public_keys)
        self.base_cache: dict[int, Params] = {self.version: self.params}
        self.setup_json = client_setup_json(cfg)
        self.privacy = None
        if cfg.privacy.local_dp.enabled or cfg.privacy.central_dp.enabled:
            from fedasync.privacy.tracker import PrivacyTracker

            self.privacy = PrivacyTracker(cfg, store, self.run_id, self.strategy,
                                          resumed=resume_run_id is not None)

    # -- resumable state -------------------------------------------------------------
    def _loop_state(self) -> str:
        """Small, resumable state. The strategy is snapshotted only when its buffer is empty
        (after an aggregation); the updates buffered since are stored with their parameters
        (``updates.pending_params``) and re-added on resume, so no reply re-writes the buffer."""
        if not self.strategy.pending():
            self._strategy_snapshot = self.strategy.state_dict()
        return dumps_state({
            "strategy": self._strategy_snapshot,
            "scheduler": self.scheduler.state_dict(),
            "virtual_time": self.clock.now,
            "exhausted": sorted(self.exhausted),
            "time_to_target": self.time_to_target,
        })

    def _resume(self, run_id: int) -> None:
        run = self.store.get_run(run_id)
        self.run_id = run_id
        if run.mode != self.mode:
            raise RuntimeError(f"run {run_id} is a {run.mode} run; it cannot be resumed in {self.mode}")
        if run.status == "running":
            log.warning("run %d is marked running: resuming it (its server is assumed dead)", run_id)
        try:
            self.version, self.params = self.store.load_version(run_id)
        except KeyError:
            self.version = -1
        if self.version != run.current_version:
            raise RuntimeError(f"run {run_id} cannot be resumed: the parameters of its current version "
                               f"v{run.current_version} were not stored (store.save_parameters: false)")
        self.next_task = run.next_task_id
        state = loads_state(run.loop_state)
        if state:
            self.strategy.load_state_dict(state["strategy"])
            self._strategy_snapshot = state["strategy"]
            self.scheduler.load_state_dict(state["scheduler"])
            self.exhausted = set(state["exhausted"])
            self.time_to_target = state["time_to_target"]
            if self.virtual:
                self.clock.advance_to(state["virtual_time"])
            else:
                self.clock = WallClock(offset=state["virtual_time"])
        # re-add the accepted updates that were still buffered (none produced a version yet)
        for u, params in self.store.pending_updates(run_id):
            _, base = self.store.load_version(run_id, u.base_version)
            self.strategy.add(self.params, Update(
                task_id=u.task_id, client_id=u.client_id, params=params, base_params=base,
                base_version=u.base_version, staleness=u.staleness, num_examples=u.num_examples or 0,
            ), self.version)
        # tasks in flight when the server stopped or died (see the module docstring)
        replied = {u.task_id for u in self.store.updates(run_id)}
        pending = [d for d in self.store.dispatches(run_id)
                   if d.status in ("in_flight", "cancelled", "lost")
                   or (d.status == "timeout" and d.task_id not in replied)]
        lost = len(pending)
        if self.virtual:
            self._resend = pending
        else:
            for d in pending:
                self.store.set_dispatch_status(run_id, d.task_id, "lost", "server restarted")
                if d.client_id not in self._priority:
                    self._priority.append(d.client_id)
        for row in self.store.clients(run_id):
            if row.exhausted:
                self.exhausted.add(row.client_id)
        self._sync_counts()
        for v in self.store.versions(run_id):
            if v.accuracy is not None:
                self.history.append({"version": v.version, "virtual_time_s": round(v.created_virtual, 6),
                                     "accuracy": v.accuracy, "loss": v.loss})
        self.store.set_run_status(run_id, "running")
        log.info("resumed run %d at version %d (%d in-flight tasks re-dispatched)", run_id, self.version, lost)

    def _sync_counts(self) -> None:
        """Counters from the store (on resume, and after an abrupt stop)."""
        counts = self.store.counts(self.run_id)
        self.received = counts["updates"]
        self.accepted = counts["accepted"]
        self.staleness, self.rejections = [], {}
        for u in self.store.updates(self.run_id):
            if u.accepted:
                self.staleness.append(u.staleness)
            elif u.reason:
                self.rejections[u.reason] = self.rejections.get(u.reason, 0) + 1
        replays = self.store.replays(self.run_id)
        self.replays = len(replays)
        for r in replays:
            self.rejections[r.reason] = self.rejections.get(r.reason, 0) + 1
        st = self.store.dispatch_status_counts(self.run_id)
        self.failed = sum(st.get(k, 0) for k in ("failed", "timeout", "late"))

    def _resend_tasks(self) -> None:
        """Virtual clock, on resume: send the tasks that were in flight again, exactly as they were."""
        tasks, lives = [], []
        timeout = self.cfg.server.task_timeout
        for d in self._resend:
            if d.base_version not in self.base_cache:
                self.base_cache[d.base_version] = self.store.load_version(self.run_id, d.base_version)[1]
            dur = (d.finish_virtual - d.sent_virtual) if d.finish_virtual is not None else 0.0
            conf = self._task_config(d.task_id, d.client_id, d.base_version, dur)
            tasks.append(TaskMsg(d.task_id, d.client_id, self.node_for_client(d.client_id) if self.node_for_client
                                 else None, self.base_cache[d.base_version], conf))
            lives.append(Live(d.task_id, d.client_id, d.base_version, d.sent_virtual, d.finish_virtual,
                              d.sent_virtual + timeout if timeout else None, None, timed_out=d.status == "timeout"))
        self._resend = []
        self._send_and_record(tasks, lives, loop_state=None)

    # -- dispatch ----------------------------------------------------------------------
    def _busy(self) -> set[int]:
        return {t.client_id for t in self.live.values()}

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
        busy = self._busy()
        avail = self.available_clients() if self.available_clients is not None else None
        idle = [c for c in range(self.cfg.data.num_clients)
                if c not in busy and c not in self.exhausted and (avail is None or c in avail)]
        chosen = []
        for c in list(self._priority):
            if len(chosen) < n and c in idle:
                chosen.append(c)
                idle.remove(c)
                self._priority.remove(c)
        for _ in range(min(n - len(chosen), len(idle))):
            c = self.scheduler.choose(idle)
            idle.remove(c)
            chosen.append(c)
        if not chosen:
            return
        tasks, lives = [], []
        now = self.clock.now
        for c in chosen:
            tid = self.next_task
            self.next_task += 1
            steps = self._steps(c)
            dur = task_duration(self.profiles[c], steps, self.model_bytes, self.cfg.clock, self.cfg.seed, tid)
            conf = self._task_config(tid, c, self.version, dur)
            tasks.append(TaskMsg(tid, c, self.node_for_client(c) if self.node_for_client else None,
                                 self.params, conf))
            timeout = self.cfg.server.task_timeout
            lives.append(Live(tid, c, self.version, now, now + dur if self.virtual else None,
                              now + timeout if timeout else None, None))
        self.base_cache[self.version] = self.params
        self._send_and_record(tasks, lives, loop_state=self._loop_state())

    def _task_config(self, tid: int, c: int, base_version: int, dur: float) -> dict[str, Any]:
        conf = {
            "task_id": tid, "client_id": c, "run_id": self.run_id, "base_version": base_version,
            "seed": task_seed(self.cfg.seed, tid),
            "sleep_s": dur * self.cfg.clock.time_scale if self.cfg.clock.emulate else 0.0,
            "setup": self.setup_json,
        }
        if self.mode == "deployment":
            conf["deployment"] = True  # the ClientApp trains its own data and echoes who it is
        if self.privacy is not None:
            conf["privacy"] = self.privacy.client_config(c)
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
        ids = [t.message_id for t in self.live.values() if t.task_id not in self.arrived]
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
        m = reply.metrics if isinstance(reply.metrics, dict) else {}
        tid, client = self.closed.get(mid, (None, None))
        if tid is None:
            tid = _int(m.get("task_id")) if m.get("task_id") is not None else (reply.task_id if reply.task_id >= 0
                                                                                else None)
        if client is None:
            client = _int(m.get("client_id"))
        self.replays += 1
        self.rejections["replay"] = self.rejections.get("replay", 0) + 1
        self.store.record_replay(self.run_id, {
            "task_id": tid, "client_id": client, "message_id": None if mid is None else str(mid)[:100],
            "reason": "replay", "params_sha256": _safe_sha(reply.params), "received_virtual": self.clock.now,
        })
        log.warning("rejected a reply (message %s, task %s): replay, the task is not open", mid, tid)

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
        self.store.set_dispatch_status(self.run_id, t.task_id, "timeout", "task_timeout",
                                       loop_state=self._loop_state())

    def _handle(self, t: Live, reply: Reply) -> None:
        del self.live[t.task_id]
        self.arrived.pop(t.task_id, None)
        if t.message_id is not None:
            self.closed[t.message_id] = (t.task_id, t.client_id)
        if reply.error is not None:
            self.failed += 1
            self.store.set_dispatch_status(self.run_id, t.task_id, "failed", reply.error)
            log.warning("task %d (client %d) failed: %s", t.task_id, t.client_id, reply.error)
            return
        if reply.refused is not None:
            self.exhausted.add(t.client_id)
            self.store.mark_exhausted(self.run_id, t.client_id, reply.refused)
            self.store.set_dispatch_status(self.run_id, t.task_id, "refused", reply.refused,
                                           loop_state=self._loop_state())
            return
        self.received += 1
        s = self.version - t.base_version
        if not isinstance(reply.metrics, dict):  # a malformed reply must not stop the run
            reply.metrics = {}
        m = reply.metrics
        num_examples = max(0, _int(m.get("num_examples", 0)) or 0)
        reason = self.validator.check(reply, t, s, run_id=self.run_id, base=self.base_cache[t.base_version])
        if reason is None and t.timed_out and self.cfg.server.late_policy == "reject":
            reason = "late"
        upd = None
        if reason is None:
            upd = Update(task_id=t.task_id, client_id=t.client_id, params=reply.params,
                         base_params=self.base_cache[t.base_version], base_version=t.base_version,
                         staleness=s, num_examples=num_examples)
            reason = self.strategy.check(upd, self.version)
        new_version = None
        weight = None
        if reason is None:
            weight = float(self.strategy.weight(upd))
            new = self.strategy.add(self.params, upd, self.version)
            self.accepted += 1
            self.staleness.append(s)
            if new is not None:
                parent = self.version
                self.version += 1
                self.params = new
                new_version = {
                    "version": self.version, "parent": parent, "sha256": params_sha256(new),
                    "params": new if self.cfg.store.save_parameters else None,
                    "task_ids": self.strategy.last_aggregated(),
                }
        else:
            self.rejections[reason] = self.rejections.get(reason, 0) + 1
        row = {
            "client_id": t.client_id, "base_version": t.base_version,
            "version_at_arrival": self.version - (1 if new_version else 0), "staleness": s, "weight": weight,
            "num_examples": num_examples, "loss": _num(m.get("loss")), "epsilon": _num(m.get("epsilon")),
            "params_sha256": _safe_sha(reply.params),
            "accepted": reason is None, "reason": reason, "received_virtual": self.clock.now,
            "pending_params": reply.params if reason is None and t.task_id in self.strategy.pending() else None,
        }
        privacy, client_state = self._privacy_rows(t, m)
        self.store.record_reply(self.run_id, t.task_id, row, "late" if t.timed_out else "replied",
                                new_version, self._loop_state(),
                                self.clock.now, privacy=privacy, client_state=client_state)
        if new_version is not None:
            self._prune_cache()
            if self.version % self.cfg.server.eval_every == 0:
                self._evaluate()
        self._emit()

    def _privacy_rows(self, t: Live, m: dict) -> tuple[dict | None, dict | None]:
        """A privacy_spend row and the client's new accountant state (DP clients only)."""
        if self.privacy is None:
            return None, None
        return self.privacy.on_reply(t.client_id, t.task_id, m)

    def _prune_cache(self) -> None:
        keep = {t.base_version for t in self.live.values()} | {self.version}
        for v in list(self.base_cache):
            if v not in keep:
                del self.base_cache[v]

    # -- evaluation and progress -------------------------------------------------------
    def _evaluate(self) -> None:
        from fedasync.task.models import set_params
        from fedasync.task.train import evaluate

        set_params(self.eval_model, self.params)
        loss, acc = evaluate(self.eval_model, self.x_test, self.y_test)
        if self.history and self.history[-1]["version"] == self.version:
            return
        self.history.append({"version": self.version, "virtual_time_s": round(self.clock.now, 6),
                             "accuracy": acc, "loss": loss})
        self.store.record_eval(self.run_id, self.version, acc, loss)
        target = self.cfg.server.target_accuracy
        if target is not None and self.time_to_target is None and acc >= target:
            self.time_to_target = self.clock.now

    def _emit(self) -> None:
        last = self.history[-1] if self.history else {}
        self.progress({
            "version": self.version, "virtual_time_s": self.clock.now, "accuracy": last.get("accuracy"),
            "updates": self.received, "accepted": self.accepted, "live": len(self.live),
            "max_versions": self.cfg.server.max_versions, "max_virtual_time": self.cfg.server.max_virtual_time,
            "epsilon_max": self.privacy.epsilon_max if self.privacy is not None else None,
            "exhausted": len(self.exhausted),
        })

    def _should_stop(self) -> str | None:
        if self._stop_signal is not None or self._stop_requested():
            return "interrupted"
        s = self.cfg.server
        if s.max_versions is not None and self.version >= s.max_versions:
            return "max_versions"
        if s.stop_at_target and self.time_to_target is not None:
            return "target_accuracy"
        if s.max_wall_time is not None and time.time() - self.t_wall0 >= s.max_wall_time:
            return "max_wall_time"
        if not self.virtual and s.max_virtual_time is not None and self.clock.now >= s.max_virtual_time:
            return "max_virtual_time"
        return None

    def _stop_requested(self) -> bool:
        """Deployment: ``fedasync server`` asks a ServerApp in another process to stop by setting
        the run's status to ``stopping`` (checked at most once a second)."""
        if self._stop_asked:
            return True
        if self.virtual or time.monotonic() - self._last_stop_check < 1.0:
            return False
        self._last_stop_check = time.monotonic()
        try:
            self._stop_asked = self.store.get_run(self.run_id).status == "stopping"
        except Exception:  # the store being briefly unreachable is not a stop request
            return False
        return self._stop_asked

    def _install_signal_handlers(self) -> Callable[[], None]:
        """SIGINT/SIGTERM: stop after the reply being handled; a second one stops at once."""
        if threading.current_thread() is not threading.main_thread():
            return lambda: None

        def handler(signum, frame):
            if self._stop_signal is not None:
                raise KeyboardInterrupt
            self._stop_signal = signum
            log.warning("%s: stopping after the reply being handled (again to stop at once)",
                        signal.Signals(signum).name)

        prev = {}
        for sig in (signal.SIGINT, signal.SIGTERM):
            try:
                prev[sig] = signal.signal(sig, handler)
            except (ValueError, OSError):
                pass

        def restore() -> None:
            for sig, h in prev.items():
                signal.signal(sig, h)

        return restore

    def _wait_for_clients(self) -> bool:
        """Wall clock: nothing could be dispatched. Wait (discovering nodes) while some client that
        is not exhausted may still appear; False once ``deploy.node_discovery_timeout`` has passed."""
        if self.virtual or self.available_clients is None:
            return False
        if len(self.exhausted) >= self.cfg.data.num_clients:
            return False
        now = time.monotonic()
        if self._no_client_since is None:
            self._no_client_since = now
            log.info("waiting for clients (nodes) to connect")
        if now - self._no_client_since > self.cfg.deploy.node_discovery_timeout:
            return False
        self._refresh()
        time.sleep(max(self.cfg.server.poll_interval, 0.2))
        return True

    def _refresh(self) -> None:
        refresh = getattr(self.transport, "refresh", None)
        if refresh is not None:
            try:
                refresh()
            except Exception as e:
                log.warning("node discovery failed: %s: %s", type(e).__name__, e)

    # -- main --------------------------------------------------------------------------
    def run(self) -> dict:
        restore = self._install_signal_handlers()
        try:
            return self._run()
        finally:
            restore()

    def _run(self) -> dict:
        if self._resend:
            self._resend_tasks()
        if self.version % self.cfg.server.eval_every == 0 and (
                not self.history or self.history[-1]["version"] != self.version):
            self._evaluate()  # v0, or a resumed run killed between a version and its evaluation
        self._emit()
        try:
            if self.virtual and self.live and self._next_events()[0] <= self.clock.now:
                self._step_virtual()  # resumed in the middle of a batch of replies due at one instant
            while True:
                reason = self._should_stop()
                if reason:
                    self.stop_reason = reason
                    break
                self._fill()
                if not self.live:
                    if self._wait_for_clients():
                        continue
                    n, k = self.cfg.data.num_clients, len(self.exhausted)
                    if self.available_clients is not None and k < n:
                        self.stop_reason = "no_client_available"
                        log.warning("stopping (no_client_available): no client could be given a task within "
                                    "deploy.node_discovery_timeout (%d of %d exhausted their privacy budget)", k, n)
                        break
                    self.stop_reason = "no_client_can_train"
                    if k == n:
                        log.warning("stopping (no_client_can_train): all %d clients have exhausted their privacy "
                                    "budget (privacy_budget_exhausted); see `fedasync privacy report`", n)
                    else:
                        log.warning("stopping (no_client_can_train): no client could be given a task "
                                    "(%d of %d exhausted their privacy budget, the others are unavailable)", k, n)
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
            self._sync_counts()  # an abrupt stop may leave counters ahead of the store
            return self._finish("stopped")
        return self._finish("stopped" if self.stop_reason == "interrupted" else "finished")

    def _step_virtual(self) -> None:
        tmin, due = self._next_events()
        limit = self.cfg.server.max_virtual_time
        if limit is not None and tmin > limit:
            self.clock.advance_to(limit)
            self.stop_reason = "max_virtual_time"
            return
        self._wait_for([t.task_id for kind, t in due if kind == "reply"])
        self.clock.advance_to(tmin)
        for kind, t in due:
            if kind == "timeout":
                self._handle_timeout(t)
            else:
                self._handle(t, self.arrived[t.task_id])

    def _step_wall(self) -> None:
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
            self._handle(self.live[tid], self.arrived[tid])
            if self._should_stop():
                return

    def _finish(self, status: str) -> dict:
        if not self.history or self.history[-1]["version"] != self.version:
            self._evaluate()
        self.store.mark_in_flight(self.run_id, "cancelled")
        summary = self.summary()
        self.store.set_run_status(self.run_id, status, self.stop_reason, summary)
        return summary

    def summary(self) -> dict:
        accs = [h["accuracy"] for h in self.history]
        st = self.staleness
        return {
            "run_id": self.run_id,
            "name": self.cfg.name,
            "strategy": self.cfg.server.strategy,
            "seed": self.cfg.seed,
            "num_clients": self.cfg.data.num_clients,
            "concurrency": self.cfg.server.concurrency,
            "backup_workers": self.cfg.server.backup_workers if self.cfg.server.strategy == "fedavg" else None,
            "versions": self.version,
            "updates_received": self.received,
            "updates_accepted": self.accepted,
            "updates_rejected": self.received - self.accepted,
            "rejections": dict(sorted(self.rejections.items())),
            "tasks_failed": self.failed,
            "replays_rejected": self.replays,
            "virtual_time_s": round(self.clock.now, 6),
            "wall_time_s": round(time.time() - self.t_wall0, 3),
            "final_accuracy": accs[-1] if accs else None,
            "best_accuracy": max(accs) if accs else None,
            "target_accuracy": self.cfg.server.target_accuracy,
            "time_to_target_s": None if self.time_to_target is None else round(self.time_to_target, 6),
            "staleness": {
                "mean": float(np.mean(st)) if st else None,
                "p50": percentile(st, 50), "p95": percentile(st, 95),
                "max": int(max(st)) if st else None,
            },
            "model_sha256": params_sha256(self.params),
            "store_url": self.store.url,
            "stop_reason": self.stop_reason,
            "history": self.history,
            **({"privacy": self.privacy.summary()} if self.privacy is not None else {}),
        }


def _int(x: Any) -> int | None:
    try:
        return int(x)
    except (TypeError, ValueError, OverflowError):
        return None


def _safe_sha(params: Any) -> str | None:
    """sha256 of a reply's parameters, or None when there are none or they cannot be hashed."""
    if params is None:
        return None
    try:
        return params_sha256(params)
    except Exception:
        return None


def check_resume_config(stored_yaml: str, cfg: Config) -> str | None:
    """Why ``cfg`` cannot continue a run made with ``stored_yaml`` (None: it can). Everything that
    defines the experiment must match; stop limits, evaluation, failure policy, polling, the store
    and deployment settings may change."""
    import yaml

    may_change = {("server", k) for k in ("max_versions", "max_virtual_time", "max_wall_time",
                                           "target_accuracy", "stop_at_target", "task_timeout", "late_policy",
                                           "poll_interval", "eval_every")} | {("store",), ("deploy",), ("name",),
                                                                               ("simulation",)}
    old = yaml.safe_load(stored_yaml) or {}
    new = cfg.model_dump(mode="json")

    def walk(a: Any, b: Any, path: tuple) -> str | None:
        if any(path[: len(m)] == m for m in may_change):
            return None
        if isinstance(a, dict) and isinstance(b, dict):
            for k in sorted(set(a) | set(b)):
                r = walk(a.get(k), b.get(k), path + (k,))
                if r:
                    return r
            return None
        if a != b:
            return f"{'.'.join(path)} is {b!r}, the run was made with {a!r}"
        return None

    return walk(old, new, ())


def _num(x: Any) -> float | None:
    if x is None:
        return None
    try:
        f = float(x)
    except (TypeError, ValueError):
        return None
    return f if math.isfinite(f) else None
