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
* **Wall clock** (deployment): replies are taken in arrival order.
* Each taken reply is validated, handed to the strategy and recorded in one transaction with
  the model version it produced. Evaluation runs every ``eval_every`` versions and at the end.
"""

from __future__ import annotations

import json
import logging
import math
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
    ):
        from fedasync.task.data import load_test
        from fedasync.task.models import build_model, init_params
        from fedasync.task.data import load_federated

        self.cfg = cfg
        self.transport = transport
        self.store = store
        self.virtual = clock == "virtual"
        self.clock = VirtualClock() if self.virtual else WallClock()
        self.progress = progress or (lambda ev: None)
        self.mode = mode
        self.node_for_client = node_for_client
        fed = load_federated(cfg.data, cfg.seed)
        self.x_test, self.y_test = load_test(cfg.data, cfg.seed)
        self.eval_model = build_model(cfg.model, fed.input_shape, fed.num_classes)
        self.num_examples = [len(p[1]) for p in fed.partitions]
        self.profiles = make_profiles(cfg.data.num_clients, cfg.clock, cfg.seed)
        central = cfg.privacy.central_dp if cfg.privacy.central_dp.enabled else None
        self.strategy = make_strategy(cfg.server, cfg.weighting, cfg.seed, central_dp=central)
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
        self.validator = validator or UpdateValidator(self.params, cfg.server)
        self.base_cache: dict[int, Params] = {self.version: self.params}
        self.setup_json = client_setup_json(cfg)

    # -- resumable state -------------------------------------------------------------
    def _loop_state(self) -> str:
        return dumps_state({
            "strategy": self.strategy.state_dict(),
            "scheduler": self.scheduler.state_dict(),
            "virtual_time": self.clock.now,
            "exhausted": sorted(self.exhausted),
            "time_to_target": self.time_to_target,
        })

    def _resume(self, run_id: int) -> None:
        run = self.store.get_run(run_id)
        self.run_id = run_id
        self.version, self.params = self.store.load_version(run_id)
        if self.version != run.current_version:
            raise RuntimeError(f"run {run_id}: latest stored parameters are v{self.version}, "
                               f"run is at v{run.current_version}")
        self.next_task = run.next_task_id
        state = loads_state(run.loop_state)
        if state:
            self.strategy.load_state_dict(state["strategy"])
            self.scheduler.load_state_dict(state["scheduler"])
            self.exhausted = set(state["exhausted"])
            self.time_to_target = state["time_to_target"]
            if self.virtual:
                self.clock.advance_to(state["virtual_time"])
        # tasks in flight when the server died will never be taken: close them, dispatch anew
        lost = self.store.mark_in_flight(run_id, "lost")
        for row in self.store.clients(run_id):
            if row.exhausted:
                self.exhausted.add(row.client_id)
        counts = self.store.counts(run_id)
        self.received = counts["updates"]
        self.accepted = counts["accepted"]
        for u in self.store.updates(run_id):
            if u.accepted:
                self.staleness.append(u.staleness)
            elif u.reason:
                self.rejections[u.reason] = self.rejections.get(u.reason, 0) + 1
        for v in self.store.versions(run_id):
            if v.accuracy is not None:
                self.history.append({"version": v.version, "virtual_time_s": v.created_virtual,
                                     "accuracy": v.accuracy, "loss": v.loss})
        self.store.set_run_status(run_id, "running")
        log.info("resumed run %d at version %d (%d in-flight tasks re-dispatched)", run_id, self.version, lost)

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
        idle = [c for c in range(self.cfg.data.num_clients) if c not in busy and c not in self.exhausted]
        chosen = []
        for _ in range(min(n, len(idle))):
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
            conf = {
                "task_id": tid, "client_id": c, "run_id": self.run_id, "base_version": self.version,
                "seed": task_seed(self.cfg.seed, tid),
                "sleep_s": dur * self.cfg.clock.time_scale if self.cfg.clock.emulate else 0.0,
                "setup": self.setup_json,
            }
            conf.update(self.client_config(c))
            tasks.append(TaskMsg(tid, c, self.node_for_client(c) if self.node_for_client else None,
                                 self.params, conf))
            timeout = self.cfg.server.task_timeout
            lives.append(Live(tid, c, self.version, now, now + dur if self.virtual else None,
                              now + timeout if timeout else None, None))
        ids = self.transport.send(tasks)
        for task, lv, mid in zip(tasks, lives, ids):
            self.store.record_dispatch(self.run_id, lv.task_id, lv.client_id, lv.base_version, lv.sent_t,
                                       lv.finish_t, task.node_id, mid)
            if mid is None:  # push refused: the slot goes to another client next time round
                self.failed += 1
                self.store.set_dispatch_status(self.run_id, lv.task_id, "failed", "push failed")
                continue
            lv.message_id = mid
            self.live[lv.task_id] = lv
            self.by_message[mid] = lv.task_id
        self.base_cache[self.version] = self.params

    def _steps(self, client_id: int) -> int:
        from fedasync.task.train import steps_for

        return steps_for(self.cfg.train, self.num_examples[client_id])

    # -- taking replies ----------------------------------------------------------------
    def _poll(self) -> None:
        ids = [t.message_id for t in self.live.values() if t.task_id not in self.arrived]
        if not ids:
            return
        for mid, reply in self.transport.poll(ids):
            tid = self.by_message.pop(mid, None)
            if tid is None:
                continue  # a reply for a task we no longer track
            reply.task_id = tid
            self.arrived[tid] = reply

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
        m = reply.metrics
        num_examples = int(m.get("num_examples", 0))
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
            "params_sha256": params_sha256(reply.params) if reply.params is not None and reason not in (
                "missing_params",) else None,
            "accepted": reason is None, "reason": reason, "received_virtual": self.clock.now,
        }
        privacy, client_state = self._privacy_rows(t, m)
        self.store.record_reply(self.run_id, t.task_id, row, "replied", new_version, self._loop_state(),
                                self.clock.now, privacy=privacy, client_state=client_state)
        if new_version is not None:
            self._prune_cache()
            if self.version % self.cfg.server.eval_every == 0:
                self._evaluate()
        self._emit()

    def _privacy_rows(self, t: Live, m: dict) -> tuple[dict | None, dict | None]:
        """Hook for DP clients: a privacy_spend row and the client's new accountant state."""
        return None, None

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
            "epsilon_max": getattr(self, "epsilon_max", None), "exhausted": len(self.exhausted),
        })

    def _should_stop(self) -> str | None:
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

    # -- main --------------------------------------------------------------------------
    def run(self) -> dict:
        if not self.history:
            self._evaluate()
        self._emit()
        try:
            while True:
                reason = self._should_stop()
                if reason:
                    self.stop_reason = reason
                    break
                self._fill()
                if not self.live:
                    self.stop_reason = "no_client_can_train"
                    log.warning("stopping: every client has exhausted its privacy budget or is unavailable")
                    break
                if self.virtual:
                    self._step_virtual()
                    if self.stop_reason:
                        break
                else:
                    self._step_wall()
        except KeyboardInterrupt:
            self.stop_reason = "interrupted"
            return self._finish("stopped")
        return self._finish("finished")

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
        }


def _num(x: Any) -> float | None:
    if x is None:
        return None
    try:
        f = float(x)
    except (TypeError, ValueError):
        return None
    return f if math.isfinite(f) else None
