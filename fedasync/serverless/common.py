"""What the ledger and gossip peers share: the config for N peers, and the learning task (local
training through the client's own code path, evaluation, the DP accountant).

A peer trains exactly as a fedasync client does: :func:`fedasync.clients.runner.handle_train`
with the task config the server would send (``setup`` JSON, per-task seed, ``sleep_s`` for
``--emulate-speeds``, and the ``privacy`` section from
:class:`fedasync.privacy.tracker.PrivacyTracker` when local DP is on). Peer ``i`` is client
``i``: it holds partition ``i`` of ``data.num_clients = N`` and speed profile ``i`` of
:func:`fedasync.server.clock.make_profiles`.
"""

from __future__ import annotations

import logging
import math
import time
from typing import Any, Callable

import numpy as np
from sqlalchemy import update
from sqlalchemy.orm import Session

from fedasync.config import Config, ConfigError, ServerConfig, config_from_dict
from fedasync.server.clock import make_profiles, task_duration
from fedasync.server.evaluation import time_to_target, walk_grid
from fedasync.store import Store
from fedasync.store import schema as S

log = logging.getLogger("fedasync.serverless")

Params = dict[str, np.ndarray]


class ServerlessError(ValueError):
    """A bad input or state for a ledger/gossip command (one line)."""


# -- config ---------------------------------------------------------------------------------------


CAPPED = ("concurrency", "buffer_size")  # server keys that cannot exceed the number of peers


def cap_for_peers(raw: dict[str, Any], peers: int | None) -> tuple[dict[str, Any], str | None]:
    """A raw (not yet validated) config for N peers, and one line saying what was capped.

    ``data.num_clients = N`` (``peers``, or the config's own ``data.num_clients``: each peer holds
    one partition). ``server.concurrency`` (meaningless without a server) and
    ``server.buffer_size`` (the ledger's K; for gossip, the default measurement interval) are
    capped at N, so ``--peers 4`` works with a config written for 100 clients. The line is
    None when nothing changed.
    """
    if peers is not None and (isinstance(peers, bool) or not isinstance(peers, int) or peers < 1):
        raise ServerlessError(f"--peers: must be >= 1, got {peers}")
    data, srv = raw.get("data"), raw.get("server")
    if peers is not None:
        if data is None:
            data = raw["data"] = {}
        if isinstance(data, dict):
            data["num_clients"] = peers
    n = peers if peers is not None else (data.get("num_clients", 100) if isinstance(data, dict) else None)
    if not isinstance(n, int) or isinstance(n, bool) or n < 1:
        return raw, None  # validation names the bad key
    if srv is None:
        srv = raw["server"] = {}
    if not isinstance(srv, dict):
        return raw, None
    capped = []
    for key in CAPPED:
        value = srv.get(key, ServerConfig.model_fields[key].default)
        if isinstance(value, int) and not isinstance(value, bool) and value > n:
            srv[key] = n
            capped.append(f"server.{key} {value} -> {n}")
    if not capped:
        return raw, None
    return raw, f"{n} peers: capped {', '.join(capped)}"


def config_for_peers(cfg: Config, peers: int | None) -> Config:
    """``cfg`` for ``peers`` peers (:func:`cap_for_peers`), validated."""
    if peers is None or peers == cfg.data.num_clients:
        return cfg
    raw, _ = cap_for_peers(cfg.model_dump(mode="json"), peers)
    try:
        return config_from_dict(raw)
    except ConfigError as e:
        raise ServerlessError(f"--peers {peers}: {e}") from None


def check_serverless(cfg: Config, kind: str) -> None:
    """What a server-less run cannot do (there is no aggregator to hold state or noise)."""
    if cfg.privacy.central_dp.enabled:
        raise ServerlessError(f"privacy.central_dp: a {kind} run has no aggregator to add central noise; "
                              "use privacy.local_dp")
    goal = cfg.server.goal()
    if goal is not None and goal.metric not in PEER_METRICS:
        raise ServerlessError(f"server.target.metric: a {kind} run measures {' and '.join(PEER_METRICS)}, "
                              f"not {goal.metric!r}")
    if kind == "ledger":
        if cfg.server.max_staleness is not None:
            raise ServerlessError("server.max_staleness: not supported by the ledger (every update block "
                                  "is aggregated or stays pending)")


# -- when a run evaluates ---------------------------------------------------------------------------


PEER_METRICS = ("accuracy", "loss")  # what a ledger or gossip evaluation measures (server.target may name them)


class EvalGrid:
    """When a ledger or gossip run evaluates, its history, and the time to target: the server's rule
    (:mod:`fedasync.server.evaluation`).

    **The grid** (``server.eval_every_s``; virtual seconds with ``--virtual``, else wall seconds since
    the run started): one history row per grid time ``g = k * eval_every_s``, for the model current at
    ``g``; ``evaluate(at)`` makes the row (the caller reuses its metrics while the model has not
    changed). **Every** ``every`` **model indices** instead when ``server.eval_every_s`` is null, or when
    ``every`` is given (gossip's ``--eval-every``, as ``server.eval_every`` given alone). **Time to
    target**: :func:`fedasync.server.evaluation.time_to_target` on the rows (their ``time_s``), with
    ``server.target_hold``; ``server.target`` or ``target_accuracy`` (accuracy or loss)."""

    def __init__(self, cfg: Config, evaluate: Callable[[float], dict], every: int | None = None,
                 stop_at_target: bool = True) -> None:
        s = cfg.server
        self.every_s: float | None = s.eval_every_s if every is None else None
        self.every = s.eval_every if every is None else every
        self.hold = s.target_hold
        self.goal = s.goal()
        self.stop_at_target = stop_at_target
        self.evaluate = evaluate
        self.history: list[dict] = []
        self.next_k = 0  # the index of the next grid time to record
        self.time_to_target: float | None = None

    def record(self, at: float, row: dict | None = None) -> None:
        """The row of the model current now at time ``at`` (or ``row``, made by the caller); the
        time to target once it has held."""
        self.history.append(self.evaluate(at) if row is None else row)
        if self.goal is not None and self.time_to_target is None and len(self.history) >= self.hold:
            rows = [dict(r, virtual_time_s=r["time_s"]) for r in self.history[-self.hold:]]
            self.time_to_target = time_to_target(rows, self.goal, self.hold)

    def reached(self) -> bool:
        """Whether the run stops here: at the target, held ``target_hold`` rows (and stopping asked)."""
        return self.stop_at_target and self.time_to_target is not None

    def start(self) -> None:
        """The initial model at time 0 (grid time 0)."""
        self.record(0.0)
        self.next_k = 1

    def on_index(self, index: int, now: float) -> None:
        """After model ``index`` was made at ``now``: the every-``every``-indices cadence (the grid
        waits for the clock)."""
        if self.every_s is None and index % self.every == 0:
            self.record(now)

    def until(self, t: float, inclusive: bool) -> float | None:
        """Record every grid time before ``t`` (``inclusive``: up to ``t``) not recorded yet; the grid
        time at which the run stops at the target (:meth:`reached`), else None."""
        if self.every_s is None:
            return None
        self.next_k, stopped = walk_grid(self.next_k, self.every_s, t, inclusive, self.record, self.reached)
        return stopped

    def finish(self, now: float, version: int) -> None:
        """At the end: the grid up to ``now`` (unless stopped at the target), then the final model
        (``version``) at ``now`` if it has no row yet."""
        if not self.reached():
            self.until(now, inclusive=True)
        if not self.history or self.history[-1]["version"] != version:
            self.record(now)

    def summary(self) -> dict:
        """The summary's keys, as the server's: the target, ``target_hold``, ``eval_every_s``
        (None: every ``eval_every`` indices)."""
        return {"target": None if self.goal is None else self.goal.model_dump(), "target_hold": self.hold,
                "eval_every_s": self.every_s, "eval_every": None if self.every_s is not None else self.every,
                "time_to_target_s": None if self.time_to_target is None else round(self.time_to_target, 6)}


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
        self.setup_json = client_setup_json(cfg, self.fed)
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


def finite(x: Any) -> float | None:
    try:
        f = float(x)
    except (TypeError, ValueError):
        return None
    return f if math.isfinite(f) else None
