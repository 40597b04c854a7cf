"""Gossip: decentralized asynchronous SGD over the store (AD-PSGD; with local DP: A(DP)²SGD).

Every peer ``i`` owns one row of ``gossip_models`` (its model ``x_i``; all rows start from the
same initial model). A peer loops:

1. read its row: ``x̂_i`` (and the row's version);
2. train locally from ``x̂_i`` with the client's own code (``local_steps`` of SGD, or DP-SGD
   through Opacus with its persistent accountant): ``Δ_i = x_i' - x̂_i``;
3. pick a neighbour ``j`` uniformly from the topology (``np.random.default_rng([seed,
   0x676f7373, i, step])``);
4. in **one transaction**, lock rows ``i`` and ``j`` in ``id`` order (``SELECT ... FOR UPDATE``
   on PostgreSQL; ``BEGIN IMMEDIATE`` takes SQLite's write lock), update both rows as
   ``gossip.step_order`` says, and record the event (``gossip_events``) in the same transaction.
   ``x_i`` is the row as it is *now* (another peer may have averaged with ``i`` while it
   trained): the update computed at the stale read ``x̂_i`` is applied to the current model.

``gossip.step_order`` (:data:`STEP_ORDERS`, :func:`gossip_step`):

- ``paper`` (default): **AD-PSGD** (Lian et al. 2018, Algorithm 1) and A(DP)²SGD: average first,
  then apply the update to ``x_i`` only::

       x_j  <-  (x_i + x_j) / 2
       x_i  <-  (x_i + x_j) / 2 + Δ_i

- ``symmetric``: apply the update, then average, both rows the same::

       x_i, x_j  <-  ((x_i + Δ_i) + x_j) / 2

Both keep the network mean: the sum of all models grows by exactly ``Δ_i`` per step (up to
rounding), so the average model moves like SGD with step ``Δ_i / N``. They differ in where
``Δ_i`` lands (all on ``x_i``, or half on each) and so in consensus. Arithmetic is float64,
cast back to float32.

Reported over time (``gossip_metrics``, ``summary.json``): the accuracy of the average model
``x̄ = mean_i x_i``, the min and max peer accuracy, and the **consensus distance**
``(1/N) Σ_i ||x_i - x̄||²`` (squared L2 over all parameters).
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import numpy as np
from sqlalchemy import select, update

from fedasync.config import Config
from fedasync.server.strategies import params_sha256
from fedasync.serverless.common import PeerTask, finite, write_privacy
from fedasync.serverless.runs import create_run, write_transaction
from fedasync.serverless.topology import neighbours
from fedasync.store import Store, decode_params, encode_params
from fedasync.store import schema as S
from fedasync.store import serverless_schema as SS

Params = dict[str, np.ndarray]
_NEIGHBOUR_STREAM = 0x676F7373  # "goss"
STEP_ORDERS = ("paper", "symmetric")


# -- parameter math ----------------------------------------------------------------------------


def _f64(p: Params) -> dict[str, np.ndarray]:
    return {k: np.asarray(v, np.float64) for k, v in p.items()}


def delta_of(new: Params, old: Params) -> dict[str, np.ndarray]:
    """``new - old`` in float64."""
    return {k: np.asarray(new[k], np.float64) - np.asarray(old[k], np.float64) for k in old}


def average_with_delta(own: Params, delta: dict[str, np.ndarray], other: Params) -> Params:
    """``((own + delta) + other) / 2`` in float64, cast to ``own``'s dtypes."""
    out = {}
    for k, v in own.items():
        a = np.asarray(v, np.float64) + delta[k]
        out[k] = ((a + np.asarray(other[k], np.float64)) / 2.0).astype(np.asarray(v).dtype)
    return out


def gossip_step(own: Params, delta: dict[str, np.ndarray], other: Params,
                order: str = "paper") -> tuple[Params, Params]:
    """The new ``(x_i, x_j)`` of one step from the current rows (float64, cast to their dtypes).

    ``paper`` (AD-PSGD): ``x_j = (x_i + x_j) / 2``, ``x_i = (x_i + x_j) / 2 + Δ_i``;
    ``symmetric``: both ``((x_i + Δ_i) + x_j) / 2``."""
    if order == "symmetric":
        avg = average_with_delta(own, delta, other)
        return avg, avg
    if order != "paper":
        raise ValueError(f"gossip.step_order: {order!r} is not one of {', '.join(STEP_ORDERS)}")
    new_i, new_j = {}, {}
    for k, v in own.items():
        dtype = np.asarray(v).dtype
        mid = (np.asarray(v, np.float64) + np.asarray(other[k], np.float64)) / 2.0
        new_j[k] = mid.astype(np.asarray(other[k]).dtype)
        new_i[k] = (mid + delta[k]).astype(dtype)
    return new_i, new_j


def mean_params(models: list[Params]) -> Params:
    """The average model (float64 sum, cast to the first model's dtypes)."""
    first = models[0]
    acc = {k: np.zeros(np.shape(v), np.float64) for k, v in first.items()}
    for m in models:
        for k in acc:
            acc[k] += np.asarray(m[k], np.float64)
    return {k: (acc[k] / len(models)).astype(np.asarray(first[k]).dtype) for k in first}


def consensus_distance(models: list[Params]) -> float:
    """``(1/N) Σ_i ||x_i - x̄||²`` over all parameters (float64, ``x̄`` unrounded)."""
    n = len(models)
    total = 0.0
    for k in models[0]:
        stack = np.stack([np.asarray(m[k], np.float64) for m in models])
        total += float(np.sum((stack - stack.mean(axis=0)) ** 2))
    return total / n


# -- the run -----------------------------------------------------------------------------------


def create_gossip(store: Store, cfg: Config, topology: str, degree: int, clock: str, settings: dict,
                  init: Params) -> int:
    """A gossip run: its rows, and one model row per peer (ids ascending with peer ids)."""
    nb = neighbours(topology, cfg.data.num_clients, cfg.seed, degree)
    settings = dict(settings, topology=topology, degree=degree, neighbours=nb, step_order=cfg.gossip.step_order)
    run_id = create_run(store, cfg, "gossip", f"gossip-{topology}", settings, clock, topology=topology)
    blob, sha, now = encode_params(init), params_sha256(init), time.time()
    with store.session() as s:
        for i in range(cfg.data.num_clients):
            s.add(SS.GossipModel(run_id=run_id, peer_id=i, version=0, steps=0, params=blob, sha256=sha,
                                 updated_virtual=0.0, updated_wall=now, exhausted=False))
            s.flush()  # one INSERT at a time: row ids follow peer ids
    return run_id


def snapshot(store: Store, run_id: int) -> tuple[list[Params], list[dict]]:
    """Every peer's model, read in one statement (a consistent snapshot), in peer order."""
    with store.session() as s:
        rows = list(s.execute(select(SS.GossipModel.peer_id, SS.GossipModel.params, SS.GossipModel.version,
                                     SS.GossipModel.steps, SS.GossipModel.exhausted, SS.GossipModel.epsilon)
                              .where(SS.GossipModel.run_id == run_id).order_by(SS.GossipModel.peer_id)))
    models = [decode_params(r.params) for r in rows]
    info = [{"peer": r.peer_id, "version": r.version, "steps": r.steps, "exhausted": r.exhausted,
             "epsilon": r.epsilon} for r in rows]
    return models, info


def event_count(store: Store, run_id: int) -> int:
    from sqlalchemy import func

    with store.session() as s:
        return int(s.scalar(select(func.count()).select_from(SS.GossipEvent).where(SS.GossipEvent.run_id == run_id)))


@dataclass
class Metrics:
    events: int
    time_s: float
    accuracy: float
    loss: float
    min_accuracy: float
    max_accuracy: float
    consensus_distance: float
    average: Params

    def row(self) -> dict:
        return {"events": self.events, "time_s": round(self.time_s, 6), "accuracy": self.accuracy,
                "loss": self.loss, "min_accuracy": self.min_accuracy, "max_accuracy": self.max_accuracy,
                "consensus_distance": self.consensus_distance}


def measure(store: Store, run_id: int, task: PeerTask, events: int, time_s: float) -> Metrics:
    """Evaluate the average model and every peer on the test set; record it in gossip_metrics."""
    models, _ = snapshot(store, run_id)
    avg = mean_params(models)
    loss, acc = task.evaluate(avg)
    accs = [task.evaluate(m)[1] for m in models]
    m = Metrics(events, time_s, acc, loss, min(accs), max(accs), consensus_distance(models), avg)
    with store.session() as s:
        s.add(SS.GossipMetric(run_id=run_id, events=events, time_s=time_s, accuracy=acc, loss=loss,
                              min_accuracy=m.min_accuracy, max_accuracy=m.max_accuracy,
                              consensus_distance=m.consensus_distance, recorded_wall=time.time()))
    return m


# -- a peer ------------------------------------------------------------------------------------


@dataclass
class Step:
    """A peer's trained step, not yet averaged."""

    step: int
    task_id: int
    base_version: int
    delta: dict | None
    metrics: dict
    refused: str | None = None


class GossipPeer:
    """One peer. Driven by a process loop (:func:`fedasync.serverless.runner.gossip_peer_loop`) or
    by the virtual-clock simulator (:mod:`fedasync.serverless.sim`)."""

    def __init__(self, store: Store, run_id: int, peer_id: int, task: PeerTask, nb: list[int], seed: int,
                 privacy=None, emulate: bool = False, step_order: str = "paper"):
        if not nb:
            raise ValueError(f"peer {peer_id} has no neighbours")
        if step_order not in STEP_ORDERS:
            raise ValueError(f"gossip.step_order: {step_order!r} is not one of {', '.join(STEP_ORDERS)}")
        self.step_order = step_order
        self.store = store
        self.run_id = run_id
        self.peer_id = peer_id
        self.task = task
        self.nb = list(nb)
        self.seed = seed
        self.privacy = privacy
        self.emulate = emulate
        self.steps_done = 0

    def read_own(self) -> tuple[int, Params]:
        with self.store.session() as s:
            row = s.execute(select(SS.GossipModel.version, SS.GossipModel.params)
                            .where(SS.GossipModel.run_id == self.run_id, SS.GossipModel.peer_id == self.peer_id)).one()
        return int(row.version), decode_params(row.params)

    def resume(self) -> int:
        """Continue from the steps this peer's row says it has done (a restarted process)."""
        with self.store.session() as s:
            self.steps_done = int(s.scalar(select(SS.GossipModel.steps).where(
                SS.GossipModel.run_id == self.run_id, SS.GossipModel.peer_id == self.peer_id)))
        return self.steps_done

    def neighbour(self, step: int) -> int:
        rng = np.random.default_rng([self.seed, _NEIGHBOUR_STREAM, self.peer_id, step])
        return self.nb[int(rng.integers(len(self.nb)))]

    def task_id(self, step: int) -> int:
        return step * self.task.num_peers + self.peer_id

    def start_step(self, step: int) -> Step:
        """Read the own model and train from it (the client's code path)."""
        version, params = self.read_own()
        tid = self.task_id(step)
        pconf = self.privacy.task_config(self.peer_id) if self.privacy is not None else None
        reply = self.task.train(self.peer_id, params, tid, emulate=self.emulate, privacy=pconf)
        if reply.get("refused"):
            return Step(step, tid, version, None, dict(reply.get("metrics", {})), reply["refused"])
        return Step(step, tid, version, delta_of(reply["params"], params), dict(reply["metrics"]))

    def finish_step(self, st: Step, virtual_time: float = 0.0) -> dict:
        """Apply the step and average with a neighbour, atomically; the recorded event."""
        j = self.neighbour(st.step)
        i = self.peer_id
        rows_priv, state = ([], None)
        if self.privacy is not None:
            rows_priv, state = self.privacy.rows(i, st.task_id, st.metrics)
        with write_transaction(self.store) as s:
            # lock both rows in id order (no deadlock: every peer locks in the same order)
            rows = list(s.scalars(select(SS.GossipModel)
                                  .where(SS.GossipModel.run_id == self.run_id, SS.GossipModel.peer_id.in_([i, j]))
                                  .order_by(SS.GossipModel.id).with_for_update()))
            by_peer = {r.peer_id: r for r in rows}
            me, other = by_peer[i], by_peer[j]
            new_i, new_j = gossip_step(decode_params(me.params), st.delta, decode_params(other.params),
                                       self.step_order)
            now = time.time()
            for r, new in ((me, new_i), (other, new_j)):
                r.params, r.sha256, r.version = encode_params(new), params_sha256(new), r.version + 1
                r.updated_virtual, r.updated_wall = float(virtual_time), now
            sha = me.sha256
            me.steps = st.step + 1
            eps = finite(st.metrics.get("epsilon"))
            if eps is not None:
                me.epsilon = eps
            ev = {"peer_id": i, "neighbour_id": j, "step": st.step, "peer_version": me.version,
                  "neighbour_version": other.version, "base_version": st.base_version, "sha256": sha,
                  "loss": finite(st.metrics.get("loss")), "epsilon": eps, "virtual_time": float(virtual_time),
                  "wall_time": now}
            s.add(SS.GossipEvent(run_id=self.run_id, **ev))
            if rows_priv or state:
                write_privacy(s, self.run_id, i, st.task_id, rows_priv, state)
        self.steps_done = st.step + 1
        return ev

    def mark_exhausted(self, reason: str) -> None:
        """This peer's privacy budget is spent: it trains no more (others still average with it)."""
        with self.store.session() as s:
            s.execute(update(SS.GossipModel).where(SS.GossipModel.run_id == self.run_id,
                                                    SS.GossipModel.peer_id == self.peer_id)
                      .values(exhausted=True, exhausted_reason=reason))
            s.execute(update(S.Client).where(S.Client.run_id == self.run_id, S.Client.client_id == self.peer_id)
                      .values(exhausted=True, exhausted_reason=reason))
