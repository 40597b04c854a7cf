"""Crash safety and resume: what the loop commits so that a stopped or killed run can go on.

Every batch of dispatches is committed with :func:`loop_state` (a reference to the strategy's
snapshot, scheduler stream, clock, exhausted clients) and every reply with the version it produced
(``Store.record_reply``). :func:`restore` rebuilds a server from the store: model, strategy
(plus the updates buffered since its snapshot), scheduler, clock, counters, history; the tasks
that were in flight (or cancelled by a stop, or lost) are sent again, under the virtual clock
exactly as they were (:func:`resend_tasks`), under the wall clock by giving their clients the
first new tasks. :func:`check_resume_config` says whether a config may continue a stored run.
"""

from __future__ import annotations

import itertools
import json
import logging
from typing import TYPE_CHECKING, Any

from fedasync.config import Config
from fedasync.server.clock import WallClock
from fedasync.server.control import ROUND_CLOSED, backups_spend
from fedasync.server.params import Tail
from fedasync.server.progress import NON_FINITE_MODEL
from fedasync.server.retention import Retention
from fedasync.server.strategies import Update
from fedasync.server.transport import Live, TaskMsg
from fedasync.store import LoopState, dumps_state, loads_state

if TYPE_CHECKING:
    from fedasync.server.loop import AsyncServer

log = logging.getLogger("fedasync")

#: dispatch statuses whose task is sent again on resume (``cancelled``: by a stop)
RESEND = ("in_flight", "cancelled", "lost")


#: the schedulers' per-client dicts ``{client: value}`` (attribute and state key alike: pairs
#: ``[[client, value], ...]``); their other state keys are small and go whole into every loop state
PER_CLIENT = ("dispatches", "dur_sum", "dur_n", "remaining", "affordable")
SCHEDULER_TIMES = ("first", "last")  # staleness_aware's (time, version) points, beside name and stream


def strategy_snapshot(srv: AsyncServer) -> tuple[int, str | None]:
    """The id of the strategy's snapshot that a loop state refers to, and the snapshot's text when
    it must be written (to ``runs.strategy_state``, in the loop state's transaction), else None.

    The snapshot is the strategy's state with no update buffered (``Strategy.settled_state``), taken
    only when that changed since the last snapshot: it changes only in ``add`` when it aggregates (a
    new version) and in ``discard`` (a non-finite model, counted in ``srv.rejections``), so the pair
    (version, non-finite rejections) tells, with no ``state_dict`` and no encoding, whether the
    snapshot is current. The updates buffered are stored with their parameters
    (``updates.pending_params``) and re-added on resume. fedbuff's settled state is told at any time:
    its snapshot is taken at the aggregation itself, even when central DP's held updates refill the
    buffer straight after it; a strategy that cannot tell it while updates are buffered (None) is
    snapshotted when its buffer is next empty. So a reply that only buffers, a batch of dispatches and
    a rejection write a reference of a few bytes, not FedAvgM's velocity."""
    # the last snapshot: its id, its key, whether it is in the store (restore sets it; a new run starts here)
    ref = srv.__dict__.setdefault("_strategy_ref", {"id": -1, "key": None, "stored": False})
    if ref["key"] != (key := (srv.version, srv.rejections.get(NON_FINITE_MODEL, 0))) \
            and (state := srv.strategy.settled_state()) is not None:
        srv._strategy_snapshot = state
        ref.update(key=key, stored=False)
    if ref["stored"]:
        return ref["id"], None
    ref.update(id=ref["id"] + 1, stored=True)
    return ref["id"], dumps_state({"id": ref["id"], "state": srv._strategy_snapshot})


def loop_state(srv: AsyncServer) -> LoopState:
    """Small, resumable state. The strategy's state is written only when it changed
    (:func:`strategy_snapshot`, ``runs.strategy_state``, in the same transaction); each loop
    state holds its id. Likewise the scheduler's per-client state (it grows with the clients
    seen: 10,000 clients' JSON took ~45 ms, twice per update) is written whole only once the clients touched since the
    last snapshot outnumber the square root of its entries (``runs.scheduler_state``, in the same
    transaction); in between, each loop state holds the touched clients' entries."""
    strategy_id, strategy_text = strategy_snapshot(srv)
    sched, touched = srv.scheduler, srv.policy.touched
    dicts = {k: getattr(sched, k) for k in PER_CLIENT if isinstance(getattr(sched, k, None), dict)}
    snap, text = srv._scheduler_snap, None
    if snap is None or len(touched) ** 2 > max(64, sum(map(len, dicts.values()))):
        snap = srv._scheduler_snap = {"id": 0 if snap is None else snap["id"] + 1,
                                      "lens": {k: len(d) for k, d in dicts.items()}}
        text = dumps_state({"id": snap["id"], "state": sched.state_dict()})
        touched.clear()
    changes: dict[str, list] = {}
    for k, d in dicts.items():  # the entries of the clients touched since, new ones in insertion order
        new = list(itertools.islice(d.items(), snap["lens"][k], None))
        fresh = {c for c, _ in new}
        changes[k] = [[c, d[c]] for c in sorted(touched) if c in d and c not in fresh] + [[c, v] for c, v in new]
    scheduler = {"scheduler": sched.name, "bit_generator": sched.rng.bit_generator.state,
                 **{k: getattr(sched, k) for k in SCHEDULER_TIMES if hasattr(sched, k)},
                 "snapshot": snap["id"], "changes": changes}
    out = LoopState(dumps_state({
        "strategy_snapshot": strategy_id,
        "scheduler": scheduler,
        "policy": srv.policy.state_dict(),
        "virtual_time": srv.clock.now,
        "exhausted": sorted(srv.exhausted),
        "time_to_target": srv.time_to_target,  # (a resume derives it, and the grid position, from the evaluations)
        "liveness": srv.liveness.state_dict(),  # progress.py: the replies since one was accepted
    }))
    out.scheduler_state, out.strategy_state = text, strategy_text
    return out


def strategy_state(state: dict, snapshot: str | None) -> tuple[dict, int | None]:
    """The strategy's ``state_dict`` a loop state stands for, and its snapshot id: embedded (a store
    written before ``runs.strategy_state``: id None) or ``snapshot`` (that column)."""
    if "strategy_snapshot" not in state:
        return state["strategy"], None
    snap = loads_state(snapshot)
    if not snap or snap["id"] != state["strategy_snapshot"]:
        raise RuntimeError(f"the strategy's state snapshot is {None if not snap else snap['id']}, the loop state "
                           f"refers to {state['strategy_snapshot']}: the store is inconsistent")
    return snap["state"], snap["id"]


def scheduler_state(saved: dict, snapshot: str | None) -> dict:
    """The scheduler's ``state_dict`` from a loop state's ``scheduler`` part: whole (a store written
    before ``runs.scheduler_state``), or ``snapshot`` (that column) with the changes since."""
    if "snapshot" not in saved:
        return saved
    snap = loads_state(snapshot)
    if not snap or snap["id"] != saved["snapshot"]:
        raise RuntimeError(f"the scheduler's state snapshot is {None if not snap else snap['id']}, the loop state "
                           f"refers to {saved['snapshot']}: the store is inconsistent")
    state = dict(snap["state"])
    state.update({k: v for k, v in saved.items() if k not in ("snapshot", "changes")})
    for k, pairs in saved["changes"].items():
        d = {int(c): v for c, v in state[k]}
        d.update((int(c), v) for c, v in pairs)  # a known client keeps its place; new ones append, in order
        state[k] = [[c, v] for c, v in d.items()]
    return state


def restore(srv: AsyncServer, run_id: int) -> None:
    """Load run ``run_id`` into ``srv`` (built for the same config) and mark it running."""
    store = srv.store
    run = store.get_run(run_id)
    srv.run_id = run_id
    if run.mode != srv.mode:
        raise RuntimeError(f"run {run_id} is a {run.mode} run; it cannot be resumed in {srv.mode}")
    if run.status == "running":
        log.warning("run %d is marked running: resuming it (its server is assumed dead)", run_id)
    swept = store.sweep_params(run_id)
    if swept:
        log.info("run %d: deleted %d parameter file(s) that no committed row names (left by the crash)",
                 run_id, swept)
    try:
        srv.version, srv.params = store.load_version(run_id)
    except KeyError:
        srv.version = -1
    if srv.version != run.current_version:
        raise RuntimeError(f"run {run_id} cannot be resumed: the parameters of its current version "
                           f"v{run.current_version} were not stored (store.save_parameters: false)")
    srv.next_task = run.next_task_id
    state = loads_state(run.loop_state)
    snapshot_id = None
    if state:
        srv._strategy_snapshot, snapshot_id = strategy_state(state, run.strategy_state)
        srv.strategy.load_state_dict(srv._strategy_snapshot)
        srv.scheduler.load_state_dict(scheduler_state(state["scheduler"], run.scheduler_state))
        srv.policy.load_state_dict(state.get("policy"), lambda v: store.load_version(run_id, v)[1])
        srv.exhausted = set(state["exhausted"])
        if srv.virtual:
            srv.clock.advance_to(state["virtual_time"])
        else:
            srv.clock = WallClock(offset=state["virtual_time"])
    # kardam: each client's last judged update (its previous pseudo-gradient, recomputed)
    srv.policy.restore_filter(store.filter_updates(run_id), lambda v: store.load_version(run_id, v)[1])
    srv.retention = Retention(srv.cfg.store.checkpoint_every, srv.cfg.store.save_parameters,
                              held=store.versions_with_parameters(run_id), keep_last=srv.cfg.server.average_last)
    _load_tail(srv)
    # re-add the accepted updates that were still buffered (none produced a version yet)
    for u, params in store.pending_updates(run_id):
        srv.retention.buffered(u.task_id, u.base_version)
        _, base = store.load_version(run_id, u.base_version)
        srv.strategy.add(srv.params, Update(
            task_id=u.task_id, client_id=u.client_id, params=params, base_params=base,
            base_version=u.base_version, staleness=u.staleness, num_examples=u.num_examples or 0,
        ), srv.version)
    # tasks in flight when the server stopped or died (see the module docstring)
    replied = {u.task_id for u in store.updates(run_id)}
    pending = [d for d in store.dispatches(run_id)
               if (d.status in RESEND and d.error != ROUND_CLOSED)
               or (d.status == "timeout" and d.task_id not in replied)]
    if srv.strategy.synchronous and not backups_spend(srv):
        # killed between a round's close and the cancelling of its backups (under local DP they are
        # resent, and cancel_dropped takes their replies for their spend, as the run would have)
        for d in [d for d in pending if d.base_version != srv.version]:
            store.set_dispatch_status(run_id, d.task_id, "cancelled", ROUND_CLOSED)
            pending.remove(d)
    if srv.virtual:
        srv._resend = pending
    else:
        for d in pending:
            store.set_dispatch_status(run_id, d.task_id, "lost", "server restarted")
            if d.client_id not in srv._priority:
                srv._priority.append(d.client_id)
    for row in store.clients(run_id):
        if row.exhausted:
            srv.exhausted.add(row.client_id)
    sync_counts(srv)
    # the snapshot loaded is the strategy's state at this version (plus the updates re-added): not
    # written again until it changes; one embedded in the loop state (an older store) is written
    # to runs.strategy_state by the next loop state
    srv._strategy_ref = {"id": -1 if snapshot_id is None else snapshot_id,
                         "key": (srv.version, srv.rejections.get(NON_FINITE_MODEL, 0)),
                         "stored": snapshot_id is not None}
    srv.liveness.load_state_dict((state or {}).get("liveness"), srv.received)  # (written before: None)
    times = _load_history(srv)
    srv.evals.restore(times)  # the grid position and the time to target, from the stored evaluations
    store.set_run_status(run_id, "running")
    log.info("resumed run %d at version %d (%d in-flight tasks re-dispatched)", run_id, srv.version, len(pending))


def _load_history(srv: AsyncServer) -> list[float]:
    """``srv.history`` from the store's ``evaluations`` (a run made before 0008: one row per evaluated
    version of ``model_versions``, before 0007 from its accuracy and loss); the rows' exact times."""
    rows = srv.store.evaluations(srv.run_id)
    if rows:
        found = [(e.version, e.virtual_time, e.metrics, e.accuracy, e.loss) for e in rows]
    else:
        found = [(v.version, v.created_virtual, v.metrics, v.accuracy, v.loss) for v in srv.store.versions(srv.run_id)]
    srv.history, times = [], []
    for version, t, text, acc, loss in found:
        metrics = json.loads(text) if text else ({"accuracy": acc, "loss": loss} if acc is not None else None)
        if metrics:
            srv.history.append({"version": version, "virtual_time_s": round(t, 6), **metrics})
            times.append(t)
    return times


def _load_tail(srv: AsyncServer) -> None:
    """``server.average_last``: the versions whose mean the server evaluates (retention kept them)."""
    n, store, run_id = srv.cfg.server.average_last, srv.store, srv.run_id
    srv.tail = Tail(n, [store.load_version(run_id, v)[1] for v in range(max(0, srv.version - n + 1), srv.version)])
    srv.tail.append(srv.params)


def stopped_abruptly(srv: AsyncServer) -> None:
    """After an abrupt stop (a second Ctrl-C) the loop may be ahead of the store: a version made in
    memory whose reply was never recorded. The run ends with what the store holds: its counts, and
    its current version (retention then keeps that version's parameters for a resume, and the
    evaluation and the summary speak of it)."""
    sync_counts(srv)
    stored = srv.store.get_run(srv.run_id).current_version
    if stored != srv.version and srv.cfg.store.save_parameters:
        srv.version, srv.params = srv.store.load_version(srv.run_id)
        srv.history = [h for h in srv.history if h["version"] <= srv.version]
        srv.evals.restore([h["virtual_time_s"] for h in srv.history])
        _load_tail(srv)


def sync_counts(srv: AsyncServer) -> None:
    """Counters from the store (on resume, and after an abrupt stop)."""
    store, run_id = srv.store, srv.run_id
    counts = store.counts(run_id)
    srv.received = counts["updates"]
    srv.accepted = counts["accepted"]
    srv.staleness, srv.rejections = [], {}
    for u in store.updates(run_id):
        if u.accepted:
            srv.staleness.append(u.staleness)
        elif u.reason:
            srv.rejections[u.reason] = srv.rejections.get(u.reason, 0) + 1
    replays = store.replays(run_id)
    srv.replays = len(replays)
    for r in replays:
        srv.rejections[r.reason] = srv.rejections.get(r.reason, 0) + 1
    st = store.dispatch_status_counts(run_id)
    srv.failed = sum(st.get(k, 0) for k in ("failed", "timeout", "late"))


def resend_tasks(srv: AsyncServer) -> tuple[list[TaskMsg], list[Live]]:
    """Virtual clock, on resume: the tasks that were in flight, exactly as they were."""
    tasks, lives = [], []
    timeout = srv.cfg.server.task_timeout
    for d in srv._resend:
        if d.base_version not in srv.base_cache:
            srv.base_cache[d.base_version] = srv.store.load_version(srv.run_id, d.base_version)[1]
        dur = (d.finish_virtual - d.sent_virtual) if d.finish_virtual is not None else 0.0
        conf = srv._task_config(d.task_id, d.client_id, d.base_version, dur)
        params = srv.policy.sent_params(d.task_id, srv.base_cache[d.base_version],
                                        lambda v: srv.store.load_version(srv.run_id, v)[1])
        tasks.append(TaskMsg(d.task_id, d.client_id, srv.node_for_client(d.client_id) if srv.node_for_client
                             else None, params, conf))
        lives.append(Live(d.task_id, d.client_id, d.base_version, d.sent_virtual, d.finish_virtual,
                          d.sent_virtual + timeout if timeout else None, None, timed_out=d.status == "timeout"))
    srv._resend = []
    return tasks, lives


def check_resume_config(stored_yaml: str, cfg: Config) -> str | None:
    """Why ``cfg`` cannot continue a run made with ``stored_yaml`` (None: it can). Everything that
    defines the experiment must match; stop limits, evaluation, failure policy, polling, the store
    and deployment settings may change."""
    import yaml

    may_change = {("server", k) for k in ("max_versions", "max_virtual_time", "max_wall_time",
                                           "target_accuracy", "target", "stop_at_target", "task_timeout", "late_policy",
                                           "poll_interval", "eval_every", "eval_every_s", "target_hold",
                                           "max_rejected_in_a_row")} | {("store",), ("deploy",), ("name",), ("tracking",),
                                                                               ("simulation",)}
    from fedasync.config import ConfigError, config_from_dict

    old = yaml.safe_load(stored_yaml) or {}
    try:  # keys added since the run was made take their defaults, as they did then
        old = config_from_dict(old).model_dump(mode="json")
    except ConfigError:
        pass
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
