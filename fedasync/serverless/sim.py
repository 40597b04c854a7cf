"""The deterministic in-process mode: the same peer objects, driven by the virtual clock.

Peer ``i`` is client ``i`` of the same scenario ``fedasync simulate`` runs: partition ``i``,
speed profile ``i`` (:func:`fedasync.server.clock.make_profiles`), and every task of ``steps``
local steps lasts :func:`fedasync.server.clock.task_duration` virtual seconds. Events (a peer's
task finishing) are taken in order of virtual finish time, ties in task-id order, so a run is a
pure function of config and seed, however fast the machine. Everything goes through the store
exactly as with peer processes (blocks, model rows, events).

Ledger
    The driver mirrors :class:`fedasync.server.loop.AsyncServer` with every client always busy:
    peers that are idle at the same instant start in the order the server's uniform scheduler
    (same seed) would dispatch them, and task ids count up from 0 in start order (the training
    seed of task ``t`` is ``task_seed(seed, t)``, as for a server task). A peer starts by reading
    the head model block and training on it; when its task finishes it appends its update block
    and, if K updates are pending, the aggregate block. With ``data.num_clients = N = server.concurrency``
    this is the same computation as the FedBuff server, so the ledger's final model has the
    same sha256 as ``fedasync simulate --backend local`` (pinned in the tests).

Gossip
    Every peer starts its first step at time 0 and its next step as soon as one finishes
    (task id ``step * N + peer``). A step trains at its start (from the peer's row at that
    instant) and averages at its finish.
"""

from __future__ import annotations

import heapq
import time
from dataclasses import dataclass
from typing import Callable

from fedasync.config import Config
from fedasync.server.clock import VirtualClock
from fedasync.server.scheduler import make_scheduler
from fedasync.serverless.common import EvalGrid, PeerPrivacy, PeerTask, check_serverless
from fedasync.serverless.report import gossip_summary, ledger_summary, record_eval, record_gossip_metric
from fedasync.serverless.runs import run_info, stop_run
from fedasync.store import Store

Progress = Callable[[dict], None]


def _privacy(cfg: Config, store: Store, run_id: int):
    return PeerPrivacy(cfg, store, run_id) if cfg.privacy.local_dp.enabled else None


def _grid_until(grid: EvalGrid, clock: VirtualClock, t: float, limit: float | None) -> str | None:
    """Before the clock moves to the next event at ``t``: record the grid times it passes (up to
    ``server.max_virtual_time``), and the stop reason, with the clock moved there, when the target
    has held (``target_accuracy``) or ``t`` is past the limit (``max_virtual_time``); else None. The
    server's loop does the same (``AsyncServer._step_virtual``)."""
    over = limit is not None and t > limit
    at_target = grid.until(limit if over else t, inclusive=over)
    if at_target is not None:
        clock.advance_to(at_target)
        return "target_accuracy"
    if over:
        clock.advance_to(limit)
        return "max_virtual_time"
    return None


# -- ledger ------------------------------------------------------------------------------------


@dataclass
class _Live:
    peer: int
    finish: float
    work: object


def simulate_ledger(cfg: Config, store: Store, max_steps: int | None = None, progress: Progress | None = None,
                    stop_at_target: bool = True) -> dict:
    """Run the ledger with ``data.num_clients`` peers on the virtual clock; the summary."""
    from fedasync.serverless.flchain import Rule, create_ledger, simulation_key
    from fedasync.serverless.ledger_peer import LedgerPeer

    check_serverless(cfg, "ledger")
    t_wall0 = time.time()
    n = cfg.data.num_clients
    max_aggr = max_steps if max_steps is not None else cfg.server.max_versions
    rule = Rule.from_config(cfg, max_aggregates=max_aggr)
    task = PeerTask(cfg)
    keys = [simulation_key(cfg.seed, f"peer-{i}") for i in range(n)]
    run_id = create_ledger(store, cfg, rule, simulation_key(cfg.seed, "genesis"), clock="virtual", created=0.0,
                           members=dict(enumerate(keys)), settings={"max_steps": max_aggr},
                           nonce=f"simulation-seed-{cfg.seed}", init=task.init)
    privacy = _privacy(cfg, store, run_id)
    peers = [LedgerPeer(store, run_id, i, keys[i], task, privacy) for i in range(n)]
    progress = progress or (lambda ev: None)
    sched = make_scheduler("uniform", cfg.seed)
    clock = VirtualClock()
    live: dict[int, _Live] = {}
    idle = list(range(n))
    exhausted: set[int] = set()
    next_task = 0
    stop_reason = None
    limit = cfg.server.max_virtual_time
    view = peers[0].view
    last: list = [None]  # (model index, loss, accuracy): reused while the head model stands

    def evaluate(at: float) -> dict:
        index, height = view.num_aggregates, view.models[-1]
        if last[0] is None or last[0][0] != index:
            loss, acc = task.evaluate(view.params(height))
            record_eval(store, run_id, height, index, loss, acc)
            last[0] = (index, loss, acc)
        _, loss, acc = last[0]
        return {"version": index, "height": height, "time_s": round(at, 6), "virtual_time_s": round(at, 6),
                "wall_time_s": round(time.time() - t_wall0, 3), "accuracy": acc, "loss": loss}

    grid = EvalGrid(cfg, evaluate, stop_at_target=stop_at_target)
    history = grid.history
    grid.start()
    while True:
        if max_aggr is not None and view.num_aggregates >= max_aggr:
            stop_reason = "max_steps"
            break
        if grid.reached():
            stop_reason = "target_accuracy"
            break
        cand = sorted(c for c in idle if c not in exhausted)
        idle = []
        while cand:  # the order the server's scheduler would dispatch them in
            c = sched.choose(cand)
            cand.remove(c)
            work = peers[c].start_task(next_task)
            live[next_task] = _Live(c, clock.now + task.duration(c, next_task), work)
            next_task += 1
        if not live:
            stop_reason = "no_peer_can_train"
            break
        tmin = min(lv.finish for lv in live.values())
        stop_reason = _grid_until(grid, clock, tmin, limit)
        if stop_reason is not None:
            break
        clock.advance_to(tmin)
        for tid in sorted(t for t, lv in live.items() if lv.finish == tmin):
            lv = live.pop(tid)
            p = peers[lv.peer]
            if lv.work.refused:
                exhausted.add(lv.peer)
                store.mark_exhausted(run_id, lv.peer, lv.work.refused)
                continue
            p.append_update(lv.work, created=clock.now)
            h = p.try_aggregate(created=clock.now)
            view.refresh()
            if h is not None:
                grid.on_index(view.model_index[h], clock.now)
            idle.append(lv.peer)
        view.refresh()
        progress({"version": view.num_aggregates, "height": view.height, "time_s": clock.now,
                  "accuracy": history[-1]["accuracy"] if history else None, "max_steps": max_aggr,
                  "max_time": limit})
    view.refresh()
    grid.finish(clock.now, view.num_aggregates)
    summary = ledger_summary(cfg, store, run_id, view, history, grid.time_to_target, stop_reason, "virtual",
                             clock.now, time.time() - t_wall0, conflicts=sum(p.conflicts for p in peers),
                             privacy=privacy, extra=grid.summary())
    stop_run(store, run_id, "finished", stop_reason, summary)
    return summary


# -- gossip ------------------------------------------------------------------------------------


def simulate_gossip(cfg: Config, store: Store, topology: str = "ring", degree: int = 2,
                    max_steps: int | None = None, eval_every: int | None = None,
                    progress: Progress | None = None, stop_at_target: bool = True) -> dict:
    """Run gossip with ``data.num_clients`` peers on the virtual clock; the summary.

    ``max_steps``: averaging steps per peer. Measured (the average model, every peer, the consensus
    distance) on the ``server.eval_every_s`` grid, as the server evaluates; ``eval_every`` given, or
    ``server.eval_every_s`` null: every ``eval_every`` averaging events instead (default
    ``server.eval_every * server.buffer_size``: as many local trainings as the server runs between
    evaluations)."""
    from fedasync.serverless.gossip import GossipPeer, create_gossip, measure

    check_serverless(cfg, "gossip")
    t_wall0 = time.time()
    n = cfg.data.num_clients
    every = eval_every
    task = PeerTask(cfg)
    eval_every = eval_every or cfg.server.eval_every * cfg.server.buffer_size
    progress = progress or (lambda ev: None)
    clock = VirtualClock()
    heap: list[tuple[float, int]] = []
    works: dict[int, object] = {}
    events = 0
    stop_reason = None
    limit = cfg.server.max_virtual_time
    exhausted: set[int] = set()
    last = None

    def evaluate(at: float) -> dict:
        nonlocal last
        if last is None or last.events != events:
            last = measure(store, run_id, task, events, at)
        else:  # the same models: the same measurement, recorded at this time
            record_gossip_metric(store, run_id, last, at)
        return dict(last.row(), time_s=round(at, 6), version=events, virtual_time_s=round(at, 6),
                    wall_time_s=round(time.time() - t_wall0, 3))

    grid = EvalGrid(cfg, evaluate, every=every, stop_at_target=stop_at_target)
    if grid.every_s is None:
        grid.every = eval_every
    run_id = create_gossip(store, cfg, topology, degree, "virtual",
                           {"max_steps": max_steps, "eval_every": grid.every if grid.every_s is None else None,
                            "eval_every_s": grid.every_s}, task.init)
    nb = run_info(store, run_id).settings["neighbours"]
    privacy = _privacy(cfg, store, run_id)
    peers = [GossipPeer(store, run_id, i, task, nb[i], cfg.seed, privacy, step_order=cfg.gossip.step_order)
             for i in range(n)]
    history = grid.history

    def start(i: int) -> None:
        p = peers[i]
        st = p.start_step(p.steps_done)
        works[i] = st
        heapq.heappush(heap, (clock.now + task.duration(i, st.task_id), i))

    grid.start()
    for i in range(n):
        if max_steps is None or max_steps > 0:
            start(i)
    while True:
        if grid.reached():
            stop_reason = "target_accuracy"
            break
        if not heap:
            stop_reason = "max_steps" if not exhausted else "no_peer_can_train"
            break
        t, i = heap[0]
        stop_reason = _grid_until(grid, clock, t, limit)
        if stop_reason is not None:
            break
        heapq.heappop(heap)
        clock.advance_to(t)
        st = works.pop(i)
        if st.refused:
            exhausted.add(i)
            peers[i].mark_exhausted(st.refused)
            continue
        peers[i].finish_step(st, virtual_time=clock.now)
        events += 1
        grid.on_index(events, clock.now)
        if max_steps is None or peers[i].steps_done < max_steps:
            start(i)
        progress({"version": events, "time_s": clock.now, "accuracy": history[-1]["accuracy"],
                  "consensus_distance": history[-1]["consensus_distance"], "max_time": limit,
                  "max_steps": None if max_steps is None else max_steps * n})
    grid.finish(clock.now, events)
    summary = gossip_summary(cfg, store, run_id, topology, degree, history, grid.time_to_target, stop_reason,
                             "virtual", clock.now, time.time() - t_wall0, last, privacy, extra=grid.summary())
    stop_run(store, run_id, "finished", stop_reason, summary)
    return summary
