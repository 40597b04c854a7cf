"""What the ledger and gossip peers share: config for N peers, runs in the store, local training
through the client's own code path, write transactions, evaluation, outputs, peer processes.

A peer trains exactly as a fedasync client does: :func:`fedasync.clients.runner.handle_train`
with the task config the server would send (``setup`` JSON, per-task seed, ``sleep_s`` for
``--emulate-speeds``, and the ``privacy`` section from
:class:`fedasync.privacy.tracker.PrivacyTracker` when local DP is on). Peer ``i`` is client
``i``: it holds partition ``i`` of ``data.num_clients = N`` and speed profile ``i`` of
:func:`fedasync.server.clock.make_profiles`.
"""

from __future__ import annotations

import json
import logging
import math
import os
import signal
import subprocess
import sys
import time
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator

import numpy as np
from sqlalchemy import select, update
from sqlalchemy.orm import Session

from fedasync.config import Config, ConfigError, config_from_dict
from fedasync.server.clock import make_profiles, task_duration
from fedasync.store import Store
from fedasync.store import schema as S
from fedasync.store import serverless_schema as SS

log = logging.getLogger("fedasync.serverless")

Params = dict[str, np.ndarray]


class ServerlessError(ValueError):
    """A bad input or state for a ledger/gossip command (one line)."""


# -- config ---------------------------------------------------------------------------------------


def config_for_peers(cfg: Config, peers: int | None, kind: str = "ledger") -> Config:
    """``cfg`` with ``data.num_clients = peers`` (each peer holds one partition).

    ``server.concurrency`` (meaningless without a server) is capped at ``peers`` so the
    config stays valid; so is ``server.buffer_size`` for gossip (it only sets the default
    measurement interval there); for the ledger it is K and is checked as usual.
    """
    if peers is None or peers == cfg.data.num_clients:
        return cfg
    if peers < 1:
        raise ServerlessError(f"--peers: must be >= 1, got {peers}")
    raw = cfg.model_dump(mode="json")
    raw["data"]["num_clients"] = int(peers)
    raw["server"]["concurrency"] = min(int(raw["server"]["concurrency"]), int(peers))
    if kind == "gossip":
        raw["server"]["buffer_size"] = min(int(raw["server"]["buffer_size"]), int(peers))
    try:
        return config_from_dict(raw)
    except ConfigError as e:
        raise ServerlessError(f"--peers {peers}: {e}") from None


def check_serverless(cfg: Config, kind: str) -> None:
    """What a server-less run cannot do (there is no aggregator to hold state or noise)."""
    if cfg.privacy.central_dp.enabled:
        raise ServerlessError(f"privacy.central_dp: a {kind} run has no aggregator to add central noise; "
                              "use privacy.local_dp")
    if kind == "ledger":
        if cfg.server.max_staleness is not None:
            raise ServerlessError("server.max_staleness: not supported by the ledger (every update block "
                                  "is aggregated or stays pending)")


def task_seed(seed: int, task_id: int) -> int:
    from fedasync.server.transport import task_seed as _ts

    return _ts(seed, task_id)


# -- the learning task ----------------------------------------------------------------------------


class PeerTask:
    """Data, initial model, speed profiles and evaluation for the peers of one config."""

    def __init__(self, cfg: Config):
        from fedasync.server.transport import client_setup_json
        from fedasync.task.data import load_federated
        from fedasync.task.models import build_model, init_params
        from fedasync.task.train import steps_for

        self.cfg = cfg
        self.fed = load_federated(cfg.data, cfg.seed)
        self.setup_json = client_setup_json(cfg)
        self.init = init_params(cfg.model, self.fed.input_shape, self.fed.num_classes, cfg.seed)
        self.model_bytes = int(sum(a.nbytes for a in self.init.values()))
        self.profiles = make_profiles(cfg.data.num_clients, cfg.clock, cfg.seed)
        self.steps = [steps_for(cfg.train, len(y)) for _, y in self.fed.partitions]
        self._eval_model = build_model(cfg.model, self.fed.input_shape, self.fed.num_classes)

    @property
    def num_peers(self) -> int:
        return self.cfg.data.num_clients

    def duration(self, peer: int, task_id: int) -> float:
        """Virtual seconds of one task of ``peer`` (download + local steps + upload)."""
        return task_duration(self.profiles[peer], self.steps[peer], self.model_bytes, self.cfg.clock,
                             self.cfg.seed, task_id)

    def train(self, peer: int, params: Params, task_id: int, emulate: bool = False,
              privacy: dict | None = None) -> dict[str, Any]:
        """The client code path: ``handle_train`` with the config a server would send."""
        from fedasync.clients.runner import handle_train

        conf = {
            "task_id": task_id, "client_id": peer, "seed": task_seed(self.cfg.seed, task_id),
            "sleep_s": self.duration(peer, task_id) * self.cfg.clock.time_scale if emulate else 0.0,
            "setup": self.setup_json,
        }
        if privacy is not None:
            conf["privacy"] = privacy
        return handle_train(params, conf)

    def evaluate(self, params: Params) -> tuple[float, float]:
        """(loss, accuracy) on the held-out test set."""
        from fedasync.task.models import set_params
        from fedasync.task.train import evaluate

        set_params(self._eval_model, params)
        return evaluate(self._eval_model, self.fed.x_test, self.fed.y_test)


class PeerPrivacy:
    """A peer's DP accountant, persisted in the store like a client's (``clients`` row,
    ``privacy_spend`` rows) and enforced by the client code (``private_task`` refuses a task
    that would exceed the budget). A thin use of :class:`fedasync.privacy.tracker.PrivacyTracker`."""

    def __init__(self, cfg: Config, store: Store, run_id: int):
        from fedasync.privacy.tracker import PrivacyTracker

        # resumed=True: every process reads the accountant histories the store already holds
        self.tracker = PrivacyTracker(cfg, store, run_id, strategy=None, resumed=True)

    def task_config(self, peer: int) -> dict:
        return self.tracker.client_config(peer)

    def rows(self, peer: int, task_id: int, metrics: dict) -> tuple[list[dict], dict | None]:
        priv, state = self.tracker.on_reply(peer, task_id, metrics)
        rows = [] if priv is None else ([priv] if isinstance(priv, dict) else list(priv))
        return rows, state

    def epsilon(self, peer: int) -> float:
        return float(self.tracker.eps.get(peer, 0.0))

    def summary(self) -> dict:
        return self.tracker.summary()


def write_privacy(s: Session, run_id: int, peer: int, task_id: int, rows: list[dict], state: dict | None) -> None:
    """Inside a transaction: the peer's privacy spend rows and its new accountant state."""
    for row in rows:
        s.add(S.PrivacySpend(run_id=run_id, task_id=task_id, recorded_wall=time.time(), **row))
    if state:
        s.execute(update(S.Client).where(S.Client.run_id == run_id, S.Client.client_id == peer).values(**state))


# -- the store ------------------------------------------------------------------------------------


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
            raise ServerlessError(f"--run-id: no ledger or gossip run {run_id} in {store.url}")
        return RunInfo(run_id, row.kind, row.num_peers, row.topology, json.loads(row.settings_json), row.clock,
                       run.status, run.config_yaml)


def find_run(store: Store, kind: str, run_id: int | None = None, running_only: bool = False) -> int:
    """``run_id`` checked to be a ``kind`` run, or the newest ``kind`` run (still running if asked)."""
    with store.session() as s:
        if run_id is not None:
            row = s.get(SS.ServerlessRun, run_id)
            if row is None or row.kind != kind:
                raise ServerlessError(f"--run-id: run {run_id} in {store.url} is not a {kind} run")
            return run_id
        q = select(SS.ServerlessRun.run_id).join(S.Run, S.Run.id == SS.ServerlessRun.run_id).where(
            SS.ServerlessRun.kind == kind)
        if running_only:
            q = q.where(S.Run.status.in_(("starting", "running")))
        rid = s.scalars(q.order_by(SS.ServerlessRun.run_id.desc()).limit(1)).first()
    if rid is None:
        what = f"starting or running {kind} run" if running_only else f"{kind} run"
        raise ServerlessError(f"no {what} in {store.url}")
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
    from sqlalchemy import func

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
    if must_exist and url.startswith("sqlite:///") and not os.path.exists(url[len("sqlite:///"):]):
        raise ServerlessError(f"--store: no database at {url}")
    try:
        return Store(url)
    except Exception as e:  # a bad URL, an unreachable server
        raise ServerlessError(f"--store {url}: cannot open ({type(e).__name__}: {str(e).splitlines()[0]})") from None


# -- outputs --------------------------------------------------------------------------------------


def stats(xs: list[float]) -> dict:
    return {
        "mean": float(np.mean(xs)) if xs else None,
        "p50": float(np.percentile(xs, 50)) if xs else None,
        "p95": float(np.percentile(xs, 95)) if xs else None,
        "max": float(max(xs)) if xs else None,
    }


def write_outputs(out: Path, cfg: Config, summary: dict, columns: list[str], extra_plot: str | None = None) -> dict:
    """summary.json, history.csv (``columns``), accuracy.png (and ``extra_plot`` vs time), config.yaml."""
    import csv

    from fedasync.outputs import _plot

    out.mkdir(parents=True, exist_ok=True)
    paths = {"summary": out / "summary.json", "history": out / "history.csv", "plot": out / "accuracy.png",
             "config": out / "config.yaml"}
    paths["summary"].write_text(json.dumps(summary, indent=2) + "\n")
    with paths["history"].open("w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=columns, extrasaction="ignore")
        w.writeheader()
        for row in summary["history"]:
            w.writerow(row)
    clock = "virtual" if summary.get("clock") == "virtual" else "wall-clock"
    x = "time_s"
    hist = [dict(h, virtual_time_s=h[x]) for h in summary["history"]]  # _plot's x axis
    _plot({summary["strategy"]: hist}, paths["plot"], cfg.server.target_accuracy,
          f"{cfg.name}: {summary['strategy']} ({clock} time)")
    if extra_plot:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        fig, ax = plt.subplots(figsize=(7, 4.2), dpi=110)
        ax.plot([h[x] for h in summary["history"]], [h[extra_plot] for h in summary["history"]], lw=1.6)
        ax.set_xlabel(f"{clock} time (s)")
        ax.set_ylabel(extra_plot.replace("_", " "))
        ax.set_yscale("symlog", linthresh=1e-4)
        ax.grid(alpha=0.3)
        ax.set_title(f"{cfg.name}: {summary['strategy']}")
        fig.tight_layout()
        paths["extra"] = out / f"{extra_plot}.png"
        fig.savefig(paths["extra"])
        plt.close(fig)
    paths["config"].write_text(cfg.to_yaml())
    return paths


def finite(x: Any) -> float | None:
    try:
        f = float(x)
    except (TypeError, ValueError):
        return None
    return f if math.isfinite(f) else None


# -- peer processes -------------------------------------------------------------------------------


def spawn(argv: list[str], log_path: Path) -> subprocess.Popen:
    """Start ``python -m fedasync <argv>`` in its own process group, output to ``log_path``."""
    log_path.parent.mkdir(parents=True, exist_ok=True)
    f = open(log_path, "ab")
    env = dict(os.environ)
    env.setdefault("OMP_NUM_THREADS", "1")
    env.setdefault("MKL_NUM_THREADS", "1")
    try:
        return subprocess.Popen([sys.executable, "-m", "fedasync", *argv], stdout=f, stderr=subprocess.STDOUT,
                                stdin=subprocess.DEVNULL, env=env, start_new_session=True)
    finally:
        f.close()


def stop_processes(procs: list[subprocess.Popen], grace_s: float = 20.0) -> list[int | None]:
    """Wait up to ``grace_s`` for every process to exit, then SIGTERM, then SIGKILL, by PID.

    Returns the exit codes. Only the processes in ``procs`` (which this runner started) and
    their own process groups are signalled.
    """
    deadline = time.monotonic() + grace_s
    for p in procs:
        left = deadline - time.monotonic()
        if p.poll() is None and left > 0:
            try:
                p.wait(timeout=left)
            except subprocess.TimeoutExpired:
                pass
    for sig, wait_s in ((signal.SIGTERM, 5.0), (signal.SIGKILL, 5.0)):
        alive = [p for p in procs if p.poll() is None]
        if not alive:
            break
        for p in alive:
            try:
                os.killpg(p.pid, sig)  # the group this runner created for it (start_new_session)
            except (ProcessLookupError, PermissionError):
                try:
                    p.send_signal(sig)
                except ProcessLookupError:
                    pass
        end = time.monotonic() + wait_s
        for p in alive:
            try:
                p.wait(timeout=max(0.0, end - time.monotonic()))
            except subprocess.TimeoutExpired:
                pass
    return [p.poll() for p in procs]
