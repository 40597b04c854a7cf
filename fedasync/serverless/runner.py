"""Peers as processes, on one machine or many, against one store.

``run_ledger`` / ``run_gossip`` (``fedasync ledger run`` / ``fedasync gossip run``) create the
run in the store (status ``starting``), start ``spawn`` peer processes here (each ``python -m
fedasync ledger|gossip peer ... --peer-id i``, for ``i < spawn``, the store URL in its environment
as ``FEDASYNC_STORE``, not on its command line; the other peers of the run join from elsewhere
with the same command), start the run once all ``N`` peers have registered as
ready, and monitor it: they evaluate models as they appear and stop the run (``runs.status``)
at the target accuracy, the time budget (``server.max_wall_time``) or ``--max-steps``. At the
end they stop every process they started, by PID, in ``finally`` (wait, SIGTERM, SIGKILL).
The run directory, its config, logs and keys are private (0700/0600).

``ledger_peer_loop`` / ``gossip_peer_loop`` (``fedasync ledger|gossip peer``) are one peer. A peer
stops when the run is no longer ``running``, at the run's ``max_steps``, at its time budget, or
when its privacy budget is exhausted; it leaves its counts in ``serverless_peers``.

Times are wall-clock seconds since the run started (every peer ready). ``--emulate-speeds``
makes each peer sleep ``task_duration x clock.time_scale`` per task (its speed profile), so
stragglers show in wall-clock time.
"""

from __future__ import annotations

import logging
import time
from pathlib import Path
from typing import Callable

from fedasync.config import Config
from fedasync.serverless.common import (
    EvalGrid,
    PeerPrivacy,
    PeerTask,
    ServerlessError,
    cap_for_peers,
    check_serverless,
)
from fedasync.private import private_dir, write_private
from fedasync.serverless.processes import STORE_ENV, spawn, stop_processes
from fedasync.serverless.report import gossip_summary, ledger_summary, record_eval, record_gossip_metric
from fedasync.serverless.runs import (
    close_peer,
    open_store,
    peers as peer_rows,
    ready_count,
    register_peer,
    run_info,
    run_status,
    set_starting,
    start_run,
    started_at,
    stop_run,
    wait_for_start,
)
from fedasync.store import Store

log = logging.getLogger("fedasync.serverless")

Progress = Callable[[dict], None]
POLL_S = 0.2
WARMUP_TASK = 2**31 - 1  # a task id no real task uses (the warm-up result is thrown away)


def _key(path: Path):
    """Load the Ed25519 key at ``path``, or create it (and its ``.pub``) there."""
    from fedasync.signing import generate_key, load_private_key, save_keypair

    if path.exists():
        return load_private_key(path)
    name = path.name[:-4] if path.name.endswith(".key") else path.name
    private_dir(path.parent)
    key = generate_key()
    save_keypair(key, path.parent, name)
    return key


def peer_config(store: Store, run_id: int, given: Config | None) -> Config:
    """The run's own config (the store is the source of truth); a given CONFIG must agree."""
    import yaml

    from fedasync.config import config_from_dict

    info = run_info(store, run_id)
    cfg = config_from_dict(yaml.safe_load(info.config_yaml))
    if given is not None:
        a, b = cfg.model_dump(mode="json"), given.model_dump(mode="json")
        b, _ = cap_for_peers(b, a["data"]["num_clients"])
        for sec in ("seed", "data", "model", "train", "server", "clock", "privacy", "gossip"):
            if a[sec] != b[sec]:
                if isinstance(a[sec], dict):
                    key = next(k for k in a[sec] if a[sec][k] != b[sec].get(k))
                    sec = f"{sec}.{key}"
                raise ServerlessError(f"CONFIG: {sec} differs from the config run {run_id} was started with "
                                      "(omit CONFIG to use the run's own)")
    return cfg


def _check_peer_id(info, peer_id: int) -> None:
    if not 0 <= peer_id < info.num_peers:
        raise ServerlessError(f"--peer-id: {peer_id} is outside 0-{info.num_peers - 1} (run {info.run_id} has "
                              f"{info.num_peers} peers)")


def _launch(store: Store, run_id: int, n_peers: int, argvs: list[list[str]], logs: Path,
            start_timeout_s: float, procs: list, store_url: str) -> float:
    """Start the local peer processes (appended to ``procs``), wait until all ``n_peers`` are
    ready, start the run; its start time. Each process gets ``store_url`` in its environment
    (``STORE_ENV``), never on its command line, where ``ps`` shows it to every user."""
    for i, argv in enumerate(argvs):
        procs.append(spawn(argv, logs / f"peer-{i}.log", env={STORE_ENV: store_url}))
    deadline = time.monotonic() + start_timeout_s
    while True:
        ready = ready_count(store, run_id)
        if ready >= n_peers:
            return start_run(store, run_id)
        dead = [i for i, p in enumerate(procs) if p.poll() is not None]
        if dead:
            raise ServerlessError(f"peer process(es) {dead} exited before the run started "
                                  f"(see {logs / f'peer-{dead[0]}.log'})")
        if time.monotonic() > deadline:
            raise ServerlessError(f"only {ready} of {n_peers} peers were ready after {start_timeout_s:.0f} s "
                                  f"(peers {len(argvs)}-{n_peers - 1} must join with `peer --run-id {run_id}`)")
        time.sleep(POLL_S)


def _peer_stats(store: Store, run_id: int) -> dict:
    rows = peer_rows(store, run_id)
    return {str(r["peer"]): dict(r["stats"] or {}, stop_reason=r["stop_reason"], host=r["host"]) for r in rows}


def _local_peers(cfg: Config, peers: int, spawn_peers: int | None) -> int:
    """How many of the ``peers`` this runner starts (``--spawn``), after checking both."""
    if peers != cfg.data.num_clients:
        raise ServerlessError(f"--peers {peers}: the config has data.num_clients {cfg.data.num_clients}")
    n_local = peers if spawn_peers is None else spawn_peers
    if not 0 <= n_local <= peers:
        raise ServerlessError(f"--spawn: must be in 0..{peers}, got {n_local}")
    return n_local


def _peer_setup(store: Store, run_id: int, peer_id: int, given: Config | None):
    """What every peer needs: the run's config and settings, its task, its privacy accountant."""
    cfg = peer_config(store, run_id, given)
    info = run_info(store, run_id)
    _check_peer_id(info, peer_id)
    task = PeerTask(cfg)
    privacy = PeerPrivacy(cfg, store, run_id) if cfg.privacy.local_dp.enabled else None
    return cfg, info, task, privacy


# -- the ledger ---------------------------------------------------------------------------------


def ledger_peer_loop(store: Store, run_id: int, peer_id: int, key_path: Path, given: Config | None = None,
                     emulate: bool = False) -> dict:
    """One ledger peer until the run stops; its counts."""
    from fedasync.serverless.flchain import ChainView, key_hex
    from fedasync.serverless.ledger_peer import LedgerPeer, membership_error
    from fedasync.signing import public_raw

    key = _key(key_path)
    why = membership_error(ChainView(store, run_id), peer_id, key_hex(key))
    if why:  # before loading anything
        raise ServerlessError(f"{why}; its public key is {key_path.with_suffix('.pub')}")
    cfg, info, task, privacy = _peer_setup(store, run_id, peer_id, given)
    peer = LedgerPeer(store, run_id, peer_id, key, task, privacy, emulate=emulate)
    task.train(peer_id, task.init, WARMUP_TASK)  # torch's first step costs seconds: not after the start
    register_peer(store, run_id, peer_id, public_raw(key).hex())
    max_wall = info.settings.get("max_wall_time")
    step, reason = 0, None
    try:
        status = wait_for_start(store, run_id)
        t0 = started_at(store, run_id) or time.time()
        while True:
            if status != "running" or run_status(store, run_id) != "running":
                reason = "run_stopped"
                break
            if peer.done():
                reason = "max_steps"
                break
            if not peer.is_member():
                reason = "removed_from_run"
                break
            if max_wall is not None and time.time() - t0 >= max_wall:
                reason = "max_wall_time"
                break
            work = peer.start_task(step * info.num_peers + peer_id)
            if work.refused:
                store.mark_exhausted(run_id, peer_id, work.refused)
                reason = work.refused
                break
            if run_status(store, run_id) != "running" or peer.done():
                reason = "run_stopped"
                break
            peer.append_update(work)
            peer.try_aggregate()
            step += 1
    finally:
        stats = {"updates": peer.updates, "aggregates": peer.aggregates, "conflicts": peer.conflicts}
        close_peer(store, run_id, peer_id, reason or "failed", stats)
    return dict(stats, peer=peer_id, stop_reason=reason)


def remote_peer_keys(directory: Path | None, first: int, peers: int) -> dict[int, object]:
    """``peer-<i>.pub`` (PEM or raw) for the peers ``first..peers-1`` that join from elsewhere."""
    from fedasync.signing import load_public_key

    if directory is None:
        return {}
    if not directory.is_dir():
        raise ServerlessError(f"--peer-keys: {directory} is not a directory")
    found = {i: directory / f"peer-{i}.pub" for i in range(first, peers)}
    return {i: load_public_key(p) for i, p in found.items() if p.exists()}


def run_ledger(cfg: Config, store_url: str, peers: int, out: Path, max_steps: int | None = None,
               emulate: bool = False, progress: Progress | None = None, spawn_peers: int | None = None,
               peer_grace_s: float = 30.0, start_timeout_s: float = 600.0, peer_keys: Path | None = None) -> dict:
    """``fedasync ledger run``: a new chain, peer processes, a monitor; the summary.

    The genesis block pins the members: the local peers' keys (``<out>/keys/peer-<i>.key``,
    created here) and the ``peer-<i>.pub`` found in ``peer_keys`` for the others; a peer with no
    key there must be admitted (``fedasync ledger member add``, signed by ``<out>/keys/genesis.key``)
    before it joins."""
    from fedasync.serverless.flchain import ChainView, Rule, create_ledger

    check_serverless(cfg, "ledger")
    n_local = _local_peers(cfg, peers, spawn_peers)
    remote = remote_peer_keys(peer_keys, n_local, peers)
    progress = progress or (lambda ev: None)
    store = open_store(store_url)
    max_aggr = max_steps if max_steps is not None else cfg.server.max_versions
    private_dir(out)
    keys = out / "keys"
    members = {i: _key(keys / f"peer-{i}.key") for i in range(n_local)}
    members.update(remote)
    task = PeerTask(cfg)
    t_wall0 = time.time()
    run_id = create_ledger(store, cfg, Rule.from_config(cfg, max_aggr), _key(keys / "genesis.key"), "wall",
                           t_wall0, members=members, init=task.init,
                           settings={"max_steps": max_aggr, "max_wall_time": cfg.server.max_wall_time,
                                     "emulate": emulate})
    set_starting(store, run_id)
    write_private(out / "config.yaml", cfg.to_yaml())
    view = ChainView(store, run_id)
    view.refresh()
    seen_models = 0
    procs: list = []
    reason = None
    status = "finished"
    t0 = t_wall0
    last: list = [None]  # (model index, loss, accuracy)

    def evaluate_index(index: int, at: float) -> dict:
        height = view.models[index]
        if last[0] is None or last[0][0] != index:
            loss, acc = task.evaluate(view.params(height))
            record_eval(store, run_id, height, index, loss, acc)
            last[0] = (index, loss, acc)
        _, loss, acc = last[0]
        return {"version": index, "height": height, "time_s": round(at, 3), "virtual_time_s": None,
                "wall_time_s": round(at, 3), "accuracy": acc, "loss": loss}

    def created(index: int) -> float:
        return max(0.0, view.blocks[view.models[index]].created - t0)

    def evaluate(at: float) -> dict:  # the grid: the last model block created by ``at``
        index = max((i for i in range(len(view.models)) if created(i) <= at), default=0)
        return evaluate_index(index, at)

    grid = EvalGrid(cfg, evaluate)
    history = grid.history

    argvs = [["ledger", "peer", "--peer-id", str(i), "--run-id", str(run_id),
              "--key", str(keys / f"peer-{i}.key")] + (["--emulate-speeds"] if emulate else [])
             for i in range(n_local)]
    codes: list = []
    try:
        t0 = _launch(store, run_id, peers, argvs, out / "logs", start_timeout_s, procs, store_url)
        grid.start()
        while True:
            now = time.time() - t0
            view.refresh()
            if grid.every_s is None:  # every eval_every model indices, at the time its block was made
                for idx in range(seen_models + 1, len(view.models)):
                    if idx % grid.every == 0:
                        grid.record(created(idx), evaluate_index(idx, created(idx)))
            else:
                grid.until(now, inclusive=True)
            seen_models = len(view.models) - 1
            progress({"version": view.num_aggregates, "height": view.height, "time_s": now,
                      "accuracy": history[-1]["accuracy"] if history else None, "max_steps": max_aggr,
                      "max_time": cfg.server.max_wall_time})
            if grid.time_to_target is not None:
                reason = "target_accuracy"
                break
            if max_aggr is not None and view.num_aggregates >= max_aggr:
                reason = "max_steps"
                break
            if cfg.server.max_wall_time is not None and time.time() - t0 >= cfg.server.max_wall_time:
                reason = "max_wall_time"
                break
            rows = peer_rows(store, run_id)
            if rows and all(r["finished_wall"] is not None for r in rows) and len(rows) >= peers:
                view.refresh()
                done = max_aggr is not None and view.num_aggregates >= max_aggr
                reason = "max_steps" if done else "peers_stopped"
                break
            time.sleep(POLL_S)
    except KeyboardInterrupt:
        reason, status = "interrupted", "stopped"
    except BaseException:
        reason, status = "failed", "failed"
        raise
    finally:
        stop_run(store, run_id, status, reason)  # peers see the run stop and exit
        codes = stop_processes(procs, grace_s=peer_grace_s)
    view.refresh()
    grid.finish(time.time() - t0, view.num_aggregates)  # the grid up to now, then the final model
    privacy = PeerPrivacy(cfg, store, run_id) if cfg.privacy.local_dp.enabled else None
    pstats = _peer_stats(store, run_id)
    summary = ledger_summary(cfg, store, run_id, view, history, grid.time_to_target, reason, "wall",
                             time.time() - t0, time.time() - t_wall0, privacy=privacy,
                             conflicts=sum(int(p.get("conflicts", 0)) for p in pstats.values()),
                             extra={**grid.summary(), "peers": pstats, "peer_exit_codes": codes,
                                    "emulate_speeds": emulate, "peer_logs": str(out / "logs")})
    stop_run(store, run_id, status, reason, summary)
    return summary


# -- gossip -------------------------------------------------------------------------------------


def gossip_peer_loop(store: Store, run_id: int, peer_id: int, given: Config | None = None,
                     emulate: bool = False) -> dict:
    """One gossip peer until the run stops; its counts."""
    from fedasync.serverless.gossip import GossipPeer

    cfg, info, task, privacy = _peer_setup(store, run_id, peer_id, given)
    peer = GossipPeer(store, run_id, peer_id, task, info.settings["neighbours"][peer_id], cfg.seed, privacy,
                      emulate=emulate, step_order=info.settings.get("step_order", cfg.gossip.step_order))
    peer.resume()
    task.train(peer_id, task.init, WARMUP_TASK)  # warm up torch before the start
    register_peer(store, run_id, peer_id)
    max_steps = info.settings.get("max_steps")
    max_wall = info.settings.get("max_wall_time")
    reason = None
    first = peer.steps_done
    try:
        status = wait_for_start(store, run_id)
        t0 = started_at(store, run_id) or time.time()
        while True:
            if status != "running" or run_status(store, run_id) != "running":
                reason = "run_stopped"
                break
            if max_steps is not None and peer.steps_done >= max_steps:
                reason = "max_steps"
                break
            if max_wall is not None and time.time() - t0 >= max_wall:
                reason = "max_wall_time"
                break
            st = peer.start_step(peer.steps_done)
            if st.refused:
                peer.mark_exhausted(st.refused)
                reason = st.refused
                break
            if run_status(store, run_id) != "running":
                reason = "run_stopped"
                break
            peer.finish_step(st, virtual_time=time.time() - t0)
    finally:
        stats = {"steps": peer.steps_done, "steps_this_process": peer.steps_done - first}
        close_peer(store, run_id, peer_id, reason or "failed", stats)
    return dict(stats, peer=peer_id, stop_reason=reason)


def run_gossip(cfg: Config, store_url: str, peers: int, out: Path, topology: str = "ring", degree: int = 2,
               max_steps: int | None = None, eval_every: int | None = None, emulate: bool = False,
               progress: Progress | None = None, spawn_peers: int | None = None, peer_grace_s: float = 30.0,
               start_timeout_s: float = 600.0) -> dict:
    """``fedasync gossip run``: a new run, peer processes, a monitor; the summary."""
    from fedasync.serverless.gossip import create_gossip, event_count, measure

    check_serverless(cfg, "gossip")
    n_local = _local_peers(cfg, peers, spawn_peers)
    progress = progress or (lambda ev: None)
    store = open_store(store_url)
    every = eval_every or cfg.server.eval_every * cfg.server.buffer_size
    on_grid = eval_every is None and cfg.server.eval_every_s is not None
    private_dir(out)
    task = PeerTask(cfg)
    t_wall0 = time.time()
    run_id = create_gossip(store, cfg, topology, degree, "wall",
                           {"max_steps": max_steps, "eval_every": None if on_grid else every,
                            "eval_every_s": cfg.server.eval_every_s if on_grid else None, "max_wall_time": cfg.server.max_wall_time,
                            "emulate": emulate}, task.init)
    set_starting(store, run_id)
    write_private(out / "config.yaml", cfg.to_yaml())
    last = None
    procs: list = []
    reason = None
    status = "finished"
    t0 = t_wall0
    n = 0  # averaging events when last polled

    def evaluate(at: float) -> dict:  # the models as they are now (the events counted at the poll)
        nonlocal last
        if last is None or last.events != n:
            last = measure(store, run_id, task, n, at)
        else:
            record_gossip_metric(store, run_id, last, at)
        return dict(last.row(), time_s=round(at, 3), version=n, virtual_time_s=None, wall_time_s=round(at, 3))

    grid = EvalGrid(cfg, evaluate, every=eval_every)
    if grid.every_s is None:
        grid.every = every
    history = grid.history

    argvs = [["gossip", "peer", "--peer-id", str(i), "--run-id", str(run_id)]
             + (["--emulate-speeds"] if emulate else []) for i in range(n_local)]
    codes: list = []
    try:
        t0 = _launch(store, run_id, peers, argvs, out / "logs", start_timeout_s, procs, store_url)
        grid.start()
        next_eval = grid.every
        while True:
            n = event_count(store, run_id)
            now = time.time() - t0
            if grid.every_s is not None:
                grid.until(now, inclusive=True)
            elif n >= next_eval:  # every eval_every events, measured when the poll sees them
                grid.record(now)
                next_eval = (n // grid.every + 1) * grid.every
            progress({"version": n, "time_s": time.time() - t0, "accuracy": history[-1]["accuracy"],
                      "consensus_distance": history[-1]["consensus_distance"], "max_time": cfg.server.max_wall_time,
                      "max_steps": None if max_steps is None else max_steps * peers})
            if grid.time_to_target is not None:
                reason = "target_accuracy"
                break
            if cfg.server.max_wall_time is not None and time.time() - t0 >= cfg.server.max_wall_time:
                reason = "max_wall_time"
                break
            rows = peer_rows(store, run_id)
            if rows and len(rows) >= peers and all(r["finished_wall"] is not None for r in rows):
                reason = "max_steps" if all(r["stop_reason"] == "max_steps" for r in rows) else "peers_stopped"
                break
            time.sleep(POLL_S)
    except KeyboardInterrupt:
        reason, status = "interrupted", "stopped"
    except BaseException:
        reason, status = "failed", "failed"
        raise
    finally:
        stop_run(store, run_id, status, reason)
        codes = stop_processes(procs, grace_s=peer_grace_s)
    n = event_count(store, run_id)
    grid.finish(time.time() - t0, n)  # the grid up to now, then the final models
    privacy = PeerPrivacy(cfg, store, run_id) if cfg.privacy.local_dp.enabled else None
    summary = gossip_summary(cfg, store, run_id, topology, degree, history, grid.time_to_target, reason, "wall",
                             time.time() - t0, time.time() - t_wall0, last, privacy,
                             extra={**grid.summary(), "peers": _peer_stats(store, run_id), "peer_exit_codes": codes,
                                    "emulate_speeds": emulate, "peer_logs": str(out / "logs")})
    stop_run(store, run_id, status, reason, summary)
    return summary
