"""A server-less run in the store: its rows, its status, the start barrier and the peer registry.

A ledger or gossip run is a ``runs`` row (``mode`` = ``ledger`` | ``gossip``), one ``clients`` row
per peer, and a ``serverless_runs`` row with what every peer must agree on (settings JSON).
Peers register in ``serverless_peers`` when ready; the runner starts the run when all have.
"""

from __future__ import annotations

import json
import os
import time
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Iterator

from sqlalchemy import func, select, update
from sqlalchemy.orm import Session

from fedasync.config import Config
from fedasync.private import mask_url
from fedasync.server.clock import make_profiles
from fedasync.serverless.common import ServerlessError
from fedasync.store import Store
from fedasync.store import schema as S
from fedasync.store import serverless_schema as SS


@contextmanager
def write_transaction(store: Store) -> Iterator[Session]:
    """A read-modify-write transaction that cannot interleave with another writer's.

    SQLite: ``BEGIN IMMEDIATE`` takes the database's write lock before the first read (a
    deferred transaction that reads, then writes, can fail with ``SQLITE_BUSY`` under WAL).
    PostgreSQL: an ordinary transaction; the caller locks its rows with ``SELECT ... FOR UPDATE``.
    """
    with store.session() as s:
        if store.engine.dialect.name == "sqlite":
            s.connection().exec_driver_sql("BEGIN IMMEDIATE")
        yield s


def create_run(store: Store, cfg: Config, kind: str, strategy: str, settings: dict, clock: str,
               topology: str | None = None) -> int:
    """A ``runs`` row (mode = ``kind``), one ``clients`` row per peer, and the run's settings."""
    run_id = store.create_run(cfg.name, strategy, cfg.seed, cfg.to_yaml(), kind)
    profiles = make_profiles(cfg.data.num_clients, cfg.clock, cfg.seed)
    store.register_clients(run_id, [{"client_id": p.client_id, "profile": p.__dict__} for p in profiles])
    with store.session() as s:
        s.add(SS.ServerlessRun(run_id=run_id, kind=kind, num_peers=cfg.data.num_clients, topology=topology,
                               settings_json=json.dumps(settings, sort_keys=True), clock=clock))
    return run_id


@dataclass
class RunInfo:
    run_id: int
    kind: str
    num_peers: int
    topology: str | None
    settings: dict
    clock: str
    status: str
    config_yaml: str


def run_info(store: Store, run_id: int) -> RunInfo:
    with store.session() as s:
        row = s.get(SS.ServerlessRun, run_id)
        run = s.get(S.Run, run_id)
        if row is None or run is None:
            raise ServerlessError(f"--run-id: no ledger or gossip run {run_id} in {mask_url(store.url)}")
        return RunInfo(run_id, row.kind, row.num_peers, row.topology, json.loads(row.settings_json), row.clock,
                       run.status, run.config_yaml)


def run_summary(store: Store, run_id: int) -> tuple[str, dict | None]:
    """The run's status and the summary it recorded when it stopped (None: none, or not JSON)."""
    with store.session() as s:
        row = s.execute(select(S.Run.status, S.Run.summary_json).where(S.Run.id == run_id)).first()
    if row is None:
        raise ServerlessError(f"--run-id: no run {run_id} in {mask_url(store.url)}")
    try:
        summary = json.loads(row.summary_json) if row.summary_json else None
    except ValueError:
        summary = None
    return str(row.status), summary if isinstance(summary, dict) else None


def find_run(store: Store, kind: str, run_id: int | None = None, running_only: bool = False) -> int:
    """``run_id`` checked to be a ``kind`` run (still starting or running if ``running_only``: a
    peer joins nothing else), or the newest such ``kind`` run."""
    with store.session() as s:
        if run_id is not None:
            row = s.get(SS.ServerlessRun, run_id)
            if row is None:
                ids = sorted(s.scalars(select(SS.ServerlessRun.run_id).where(SS.ServerlessRun.kind == kind)))
                raise ServerlessError(f"--run-id: no {kind} run {run_id} in {mask_url(store.url)} ({kind} runs: "
                                      f"{', '.join(map(str, ids)) or 'none'})")
            if row.kind != kind:
                raise ServerlessError(f"--run-id: run {run_id} in {mask_url(store.url)} is a {row.kind} run, not a {kind} run")
            status = s.scalar(select(S.Run.status).where(S.Run.id == run_id))
            if running_only and status not in ("starting", "running"):
                raise ServerlessError(f"--run-id: {kind} run {run_id} is {status}: a peer joins only a starting "
                                      "or running run")
            return run_id
        q = select(SS.ServerlessRun.run_id).join(S.Run, S.Run.id == SS.ServerlessRun.run_id).where(
            SS.ServerlessRun.kind == kind)
        if running_only:
            q = q.where(S.Run.status.in_(("starting", "running")))
        rid = s.scalars(q.order_by(SS.ServerlessRun.run_id.desc()).limit(1)).first()
    if rid is None:
        what = f"starting or running {kind} run" if running_only else f"{kind} run"
        raise ServerlessError(f"no {what} in {mask_url(store.url)}")
    return int(rid)


def run_status(store: Store, run_id: int) -> str:
    with store.session() as s:
        return str(s.scalar(select(S.Run.status).where(S.Run.id == run_id)))


def stop_run(store: Store, run_id: int, status: str, reason: str | None, summary: dict | None = None) -> None:
    store.set_run_status(run_id, status, reason, summary)


# -- the start barrier and the peer registry ----------------------------------------------------
#
# A runner creates the run, sets it "starting", and starts it ("running", ``started_wall``) once
# every peer has registered as ready: peer processes take seconds to import torch and build
# their data, and times are counted from the start, not from the first peer that happened to
# be ready.


def set_starting(store: Store, run_id: int) -> None:
    with store.session() as s:
        s.execute(update(S.Run).where(S.Run.id == run_id).values(status="starting", finished_wall=None))


def start_run(store: Store, run_id: int, at: float | None = None) -> float:
    """Mark the run running from ``at`` (default now); returns that time."""
    t0 = time.time() if at is None else float(at)
    with store.session() as s:
        s.execute(update(S.Run).where(S.Run.id == run_id).values(status="running", finished_wall=None))
        s.execute(update(SS.ServerlessRun).where(SS.ServerlessRun.run_id == run_id).values(started_wall=t0))
    return t0


def started_at(store: Store, run_id: int) -> float | None:
    with store.session() as s:
        return s.scalar(select(SS.ServerlessRun.started_wall).where(SS.ServerlessRun.run_id == run_id))


def register_peer(store: Store, run_id: int, peer_id: int, public_key: str | None = None) -> None:
    """This peer is ready (a restarted peer re-registers)."""
    import socket

    with store.session() as s:
        row = s.get(SS.ServerlessPeer, (run_id, peer_id))
        if row is None:
            row = SS.ServerlessPeer(run_id=run_id, peer_id=peer_id)
            s.add(row)
        row.public_key, row.host, row.pid = public_key, socket.gethostname()[:200], os.getpid()
        row.ready_wall, row.finished_wall, row.stop_reason = time.time(), None, None


def close_peer(store: Store, run_id: int, peer_id: int, reason: str | None, peer_stats: dict) -> None:
    with store.session() as s:
        s.execute(update(SS.ServerlessPeer).where(SS.ServerlessPeer.run_id == run_id,
                                                  SS.ServerlessPeer.peer_id == peer_id)
                  .values(finished_wall=time.time(), stop_reason=reason, stats_json=json.dumps(peer_stats)))


def peers(store: Store, run_id: int) -> list[dict]:
    with store.session() as s:
        rows = list(s.scalars(select(SS.ServerlessPeer).where(SS.ServerlessPeer.run_id == run_id)
                              .order_by(SS.ServerlessPeer.peer_id)))
    return [{"peer": r.peer_id, "host": r.host, "pid": r.pid, "public_key": r.public_key, "ready_wall": r.ready_wall,
             "finished_wall": r.finished_wall, "stop_reason": r.stop_reason,
             "stats": json.loads(r.stats_json) if r.stats_json else None} for r in rows]


def ready_count(store: Store, run_id: int) -> int:
    with store.session() as s:
        return int(s.scalar(select(func.count()).select_from(SS.ServerlessPeer)
                            .where(SS.ServerlessPeer.run_id == run_id)))


def wait_for_start(store: Store, run_id: int, poll_s: float = 0.1) -> str:
    """Block while the run is ``starting``; its status then (``running`` or why not)."""
    while True:
        st = run_status(store, run_id)
        if st != "starting":
            return st
        time.sleep(poll_s)


def open_store(url: str, must_exist: bool = False) -> Store:
    """The store at ``url`` (``--store``); ServerlessError with one line if it cannot be opened."""
    from fedasync.store.opening import StoreOpenError
    from fedasync.store.opening import open_store as _open

    try:
        return _open(url, "--store", must_exist=must_exist)
    except StoreOpenError as e:
        raise ServerlessError(str(e)) from None
