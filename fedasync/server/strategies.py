"""Aggregation rules: what the new global model is. Pure array math.

This module holds fedasync, fedbuff and the registry (:func:`make_strategy`); the interface and the
server optimizer are in :mod:`fedasync.server.strategy_base`, fedavg in :mod:`fedasync.server.fedavg`,
central DP in :mod:`fedasync.server.central_dp` (all importable from here as before).

A strategy takes one accepted update at a time (:meth:`Strategy.add`) and returns
the new global model when that update triggers an aggregation, else ``None``.
*When* to dispatch and *when* replies are taken is the server loop's business
(``server/app.py``); the caller computes ``staleness = v_now - base_version`` and,
after a returned model, increments the version.

Rules (``S`` is the staleness function, see :mod:`fedasync.server.staleness`):

- ``fedasync`` (Xie et al. 2019): ``x <- (1 - a_s) x + a_s x_i`` with ``a_s = alpha * S(s)``;
  computed as ``x + a_s (x_i - x)``. Every update produces a new model. The paper's client
  minimises ``f(x) + rho/2 ||x - x_tau||^2`` (``x_tau``: the model it was sent); fedasync's
  clients do so with ``train.prox_rho = rho`` (default 0: plain local SGD on ``f``), see
  :func:`fedasync.task.train.local_train`; under local DP the term is data-independent, added
  after Opacus' clipping and noise, and costs no privacy.
- ``fedbuff`` (Nguyen et al. 2022): buffer ``S(s_i) * D_i`` with ``D_i = x_i - x_base_i``;
  after ``K`` updates, ``uniform``: ``x <- x + eta * sum_i S_i D_i / K``;
  ``examples``: ``x <- x + eta * sum_i n_i S_i D_i / sum_i n_i``. Exactly ``K`` per aggregation.
  With client-level central DP (:class:`CentralDP`) each ``D_i`` is first clipped to
  L2 norm ``clip``, then weighted by ``S_i``, summed, Gaussian noise added, divided by ``K``;
  and a release holds **at most one term per client** (see :class:`FedBuff`).
  With a robust aggregator (``server.robust.aggregator``: median, trimmed_mean, centered_clip;
  :func:`fedasync.server.robust.aggregate`) the mean of ``u_i = (K w_i / D) D_i`` (``w_i``, ``D``
  the weights and denominator above, so that ``mean(u_i)`` is the step) is replaced by the
  robust estimate: ``x <- x + eta * agg(u_1..u_K)``. ``mean`` keeps the arithmetic above.
  With ``server.server_momentum`` ``beta > 0`` the step ``d`` (whichever of the above) goes through
  the server optimizer: ``v <- beta v + d``, ``x <- x + eta v`` (as FedAvgM;
  :func:`~fedasync.server.strategy_base.server_step`); ``beta = 0``: the arithmetic above.
- ``fedavg`` (synchronous, optional backup workers, Chen et al. 2017; FedAvgM with
  ``server_lr``/``server_momentum``): :mod:`fedasync.server.fedavg`.

Arithmetic is float64; results are cast back to each array's dtype. Inputs are never mutated;
every returned model is a new dict of new arrays. One can overflow to inf (a huge finite update
times ``server_lr > 1``, or central-DP noise): the server then calls :meth:`Strategy.discard`, which
also puts the server optimizer's velocity back.
"""

from __future__ import annotations

from typing import Any, Callable

import numpy as np

from fedasync.config import CentralDPConfig, ServerConfig
from fedasync.server import robust
from fedasync.server.central_dp import CentralDP
from fedasync.server.fedavg import FedAvg
from fedasync.server.params import Params, Params64, _cast_like, _check_like, _copy, _f64, mean_step, params_norm, params_sha256, params_sub  # noqa: F401
from fedasync.server.staleness import StalenessFn, make_staleness
from fedasync.server.strategy_base import (WEIGHTINGS, Strategy, Update, check_server_opt, load_velocity,  # noqa: F401
                                           no_examples, server_step, velocity_state)

__all__ = ["STRATEGIES", "WEIGHTINGS", "CentralDP", "FedAsync", "FedAvg", "FedBuff", "Strategy", "Update",
           "make_strategy", "no_examples", "params_norm", "params_sha256", "params_sub"]

class FedAsync(Strategy):
    """``x <- (1 - a_s) x + a_s x_i``, ``a_s = alpha * S(s)``; a new model per update."""

    name = "fedasync"

    def __init__(self, alpha: float, staleness_fn: StalenessFn) -> None:
        super().__init__()
        if not 0 < alpha <= 1:
            raise ValueError(f"fedasync alpha must be in (0, 1], got {alpha}")
        self.alpha = float(alpha)
        self.staleness_fn = staleness_fn

    def weight(self, update: Update) -> float:
        return self.alpha * self.staleness_fn(update.staleness)

    def add(self, model: Params, update: Update, version: int) -> Params:
        _check_like(model, update.params, "update")
        a_s = self.weight(update)
        x = _f64(model)
        xi = _f64(update.params)
        new = {k: x[k] + a_s * (xi[k] - x[k]) for k in x}
        self._last = [update.task_id]
        return _cast_like(new, model)


def _delta(e: dict[str, Any]) -> Params64:
    """A buffered update's float64 delta (kept as its params and base until needed)."""
    if "delta" in e:
        return e["delta"]
    return {k: np.subtract(e["params"][k], e["base"][k], dtype=np.float64) for k in e["params"]}


def _delta_source(e: dict[str, Any]) -> Any:
    """What :func:`~fedasync.server.params.mean_step` reads for a buffered entry."""
    return e["delta"] if "delta" in e else (e["params"], e["base"])


def _entry_state(e: dict[str, Any]) -> dict[str, Any]:
    """A buffered entry as state: its delta, not the arrays it refers to."""
    out = {k: v for k, v in e.items() if k not in ("params", "base", "delta")}
    out["delta"] = _copy(_delta(e))
    return out


class FedBuff(Strategy):
    """Buffer ``S(s_i) * (x_i - x_base_i)``; every ``K`` updates step the model by their mean.

    With central DP each release must hold **at most one clipped term per client**, or the sensitivity
    ``clip`` claimed per client is wrong (a fast client can finish, be sent a new task and finish again
    before the buffer fills). fedbuff **holds back** a client's second update: an update whose client
    already has one in the buffer waits (``held``) and enters the buffer, in arrival order, right after the
    next release; a third update of a client that already has one buffered and one held is rejected
    (``check``: ``client_backlog``). So every release is exactly ``K`` clipped deltas of ``K`` distinct
    clients, and the fixed divisor ``K`` is the number of terms, as without DP; the accounting (one Gaussian
    release per aggregation, sensitivity ``clip`` per client, ``q = K / num_clients``) is unchanged.

    Why not sum a client's buffered deltas and clip the sum (the other choice): it is equally private, but a
    release would then mix one-term and many-term clients under one divisor ``K`` (a repeated client's work
    shrinks to one clipped term while still counting ``K`` updates), and the fast clients asynchronous
    arrival favours would be folded in silently. Holding back keeps FedBuff's rule ("the mean of ``K``
    updates") and makes the fairness cost visible: a held update waits one release (it keeps the staleness
    weight it had on arrival), a backlogged one is recorded as rejected. A held update counts in
    :meth:`pending` (the loop stores its parameters and re-adds it on resume, in arrival order, which
    rebuilds the same buffer and held list, on top of :meth:`settled_state`, the state after the last
    release). Without central DP nothing is held.
    """

    name = "fedbuff"
    BACKLOG = "client_backlog"
    _UNDO = ("_last", "_velocity")

    def __init__(
        self,
        buffer_size: int,
        server_lr: float,
        staleness_fn: StalenessFn,
        weighting: str = "uniform",
        central_dp: CentralDP | None = None,
        aggregator: str = "mean",
        aggregator_params: dict[str, Any] | None = None,
        server_momentum: float = 0.0,
    ) -> None:
        super().__init__()
        check_server_opt("fedbuff", server_lr, server_momentum)
        if buffer_size < 1:
            raise ValueError(f"fedbuff buffer_size must be >= 1, got {buffer_size}")
        if aggregator not in robust.AGGREGATORS:
            raise ValueError(f"fedbuff aggregator must be one of {robust.AGGREGATORS}, got {aggregator!r}")
        if central_dp is not None and aggregator != "mean":
            raise ValueError(f"fedbuff with central DP needs aggregator 'mean' (got {aggregator!r})")
        if weighting not in WEIGHTINGS:
            raise ValueError(f"fedbuff weighting must be one of {WEIGHTINGS}, got {weighting!r}")
        if central_dp is not None and weighting != "uniform":
            raise ValueError("fedbuff with central DP needs weighting 'uniform' (sensitivity is per client)")
        self.buffer_size = int(buffer_size)
        self.server_lr = float(server_lr)
        self.server_momentum = float(server_momentum)
        self._velocity: Params64 | None = None  # the server optimizer's v (float64), None while beta = 0
        self.staleness_fn = staleness_fn
        self.weighting = weighting
        self.central_dp = central_dp
        self.aggregator = aggregator
        self.aggregator_params = dict(aggregator_params or {})
        self._buffer: list[dict[str, Any]] = []
        self._held: list[dict[str, Any]] = []  # central DP: second updates waiting for the next release

    def weight(self, update: Update) -> float:
        return self.staleness_fn(update.staleness)

    def _buffered(self, client_id: int) -> bool:
        return any(e["client_id"] == client_id for e in self._buffer)

    def check(self, update: Update, version: int) -> str | None:
        if self.central_dp is not None and any(e["client_id"] == update.client_id for e in self._held):
            return self.BACKLOG
        return no_examples(self.weighting, update)

    def add(self, model: Params, update: Update, version: int) -> Params | None:
        if update.base_params is None:
            raise ValueError("fedbuff needs the update's base_params")
        _check_like(model, update.params, "update")
        _check_like(update.params, update.base_params, "update base")
        entry = {
            "task_id": int(update.task_id),
            "client_id": int(update.client_id),
            # the delta float64(params) - float64(base) is made when it is used (_delta): a big
            # model's float64 copy per buffered update costs more than the update's own work
            "params": update.params, "base": update.base_params,
            "weight": self.weight(update),
            "num_examples": int(update.num_examples),
        }
        if self.central_dp is not None and self._buffered(entry["client_id"]):
            if self.check(update, version) is not None:
                raise ValueError(f"fedbuff: update of task {update.task_id} rejected ({self.BACKLOG}); "
                                 "call check first")
            self._held.append(entry)
            return None
        self._buffer.append(entry)
        if len(self._buffer) < self.buffer_size:
            return None
        new = self._aggregate(model)
        # the held updates are of clients in the release just made, at most one each: all enter
        # the (now empty) buffer, and fewer than K of them (the last client had none buffered)
        self._buffer, self._held = self._held, []
        return new

    def _aggregate(self, model: Params) -> Params:
        buf, self._buffer = self._buffer, []
        if self.aggregator != "mean":
            return self._aggregate_robust(model, _f64(model), buf)
        if self.central_dp is not None:
            x = _f64(model)
            total = self.central_dp.privatize([_delta(e) for e in buf], weights=[e["weight"] for e in buf])
            self._last = [e["task_id"] for e in buf]
            return self._step(model, x, {k: total[k] / float(len(buf)) for k in x})
        uniform = self.weighting == "uniform"
        coef = [e["weight"] if uniform else e["num_examples"] * e["weight"] for e in buf]
        denom = float(len(buf)) if uniform else float(sum(e["num_examples"] for e in buf))
        if not uniform and denom <= 0:
            raise ValueError("fedbuff examples weighting: the buffered updates have 0 examples")
        self._last = [e["task_id"] for e in buf]
        if self.server_momentum == 0.0:  # x + eta * step in one blocked pass (mean_step)
            return mean_step(model, [_delta_source(e) for e in buf], coef, denom, self.server_lr)
        zero = {k: np.zeros(np.shape(v), np.float64) for k, v in model.items()}  # 0 + 1 * step: the step itself
        return self._step(model, _f64(model), mean_step(zero, [_delta_source(e) for e in buf], coef, denom, 1.0))

    def _aggregate_robust(self, model: Params, x: Params64, buf: list[dict[str, Any]]) -> Params:
        k = float(len(buf))
        if self.weighting == "uniform":
            coef = [e["weight"] for e in buf]  # K * S_i / K
        else:
            denom = float(sum(e["num_examples"] for e in buf))
            if denom <= 0:
                raise ValueError("fedbuff examples weighting: the buffered updates have 0 examples")
            coef = [k * e["num_examples"] * e["weight"] / denom for e in buf]
        u = [c * robust.flat({key: d[key] for key in x}) for c, d in zip(coef, map(_delta, buf))]  # x's key order
        step = robust.unflat(robust.aggregate(u, self.aggregator, **self.aggregator_params), x)
        self._last = [e["task_id"] for e in buf]
        return self._step(model, x, step)

    def _step(self, model: Params, x: Params64, step: Params64) -> Params:
        """``x`` moved by the server optimizer along ``step`` (``x + eta * step`` when ``beta = 0``)."""
        new, self._velocity = server_step(x, step, self.server_lr, self.server_momentum, self._velocity)
        return _cast_like(new, model)

    def pending(self) -> list[int]:
        return [e["task_id"] for e in self._buffer] + [e["task_id"] for e in self._held]

    def state_dict(self) -> dict[str, Any]:
        return self._state(self._buffer, self._held)

    def settled_state(self) -> dict[str, Any]:
        """The state with the buffer and held list empty. Buffering and holding change nothing else
        (an aggregation does: the release count, the velocity, the last aggregated), and re-adding the
        pending updates in arrival order rebuilds the buffer and held list, so this is told at any time:
        with central DP, right after a release whose held updates refilled the buffer (it may then stay
        non-empty for the rest of the run)."""
        return self._state([], [])

    def _state(self, buffer: list[dict[str, Any]], held: list[dict[str, Any]]) -> dict[str, Any]:
        d = super().state_dict()
        d["buffer"] = [_entry_state(e) for e in buffer]
        if held:
            d["held"] = [_entry_state(e) for e in held]
        d["central_dp"] = self.central_dp.state_dict() if self.central_dp is not None else None
        d.update(velocity_state(self._velocity))
        return d

    def load_state_dict(self, d: dict[str, Any]) -> None:
        super().load_state_dict(d)

        def entries(key: str) -> list[dict[str, Any]]:
            return [dict(e, delta={k: np.array(v, dtype=np.float64, copy=True) for k, v in e["delta"].items()})
                    for e in d.get(key, [])]

        self._buffer = entries("buffer")
        self._held = entries("held")
        self._velocity = load_velocity(d)
        if d.get("central_dp") is not None:
            if self.central_dp is None:
                raise ValueError("state has central DP but this fedbuff has none")
            self.central_dp.load_state_dict(d["central_dp"])


# -- the registry -------------------------------------------------------------------


def _fedasync(cfg: ServerConfig, weighting: str, central_dp: CentralDP | None) -> Strategy:
    return FedAsync(alpha=cfg.alpha, staleness_fn=make_staleness(cfg.staleness, concurrency=cfg.concurrency))


def _fedbuff(cfg: ServerConfig, weighting: str, central_dp: CentralDP | None) -> Strategy:
    return FedBuff(
        buffer_size=cfg.buffer_size,
        server_lr=cfg.server_lr,
        staleness_fn=make_staleness(cfg.staleness, concurrency=cfg.concurrency),
        weighting=weighting,
        central_dp=central_dp,
        aggregator=cfg.robust.aggregator,
        aggregator_params=robust.aggregator_params(cfg.robust),
        server_momentum=cfg.server_momentum,
    )


def _fedavg(cfg: ServerConfig, weighting: str, central_dp: CentralDP | None) -> Strategy:
    return FedAvg(
        clients_per_round=cfg.clients_per_round or cfg.concurrency,
        backup_workers=cfg.backup_workers,
        weighting=weighting,
        server_lr=cfg.server_lr,
        server_momentum=cfg.server_momentum,
    )


#: name (``server.strategy`` in YAML) -> builder ``(cfg, weighting, central_dp) -> Strategy``
STRATEGIES: dict[str, Callable[[ServerConfig, str, CentralDP | None], Strategy]] = {
    "fedasync": _fedasync,
    "fedbuff": _fedbuff,
    "fedavg": _fedavg,
}


def make_strategy(
    cfg: ServerConfig,
    weighting: str,
    seed: int = 0,
    central_dp: CentralDPConfig | CentralDP | None = None,
    reproducible_noise: bool = False,
) -> Strategy:
    """The strategy ``cfg.strategy``. ``weighting`` is already resolved ("uniform"/"examples").

    ``central_dp``: a :class:`CentralDPConfig` (used when ``enabled``; its noise comes from OS
    entropy, or from ``seed`` with ``reproducible_noise``) or a ready :class:`CentralDP`.
    """
    if cfg.strategy not in STRATEGIES:
        raise ValueError(f"unknown strategy {cfg.strategy!r}; known: {', '.join(STRATEGIES)}")
    if weighting not in WEIGHTINGS:
        raise ValueError(f"weighting must be one of {WEIGHTINGS} (resolve 'auto' first), got {weighting!r}")
    dp: CentralDP | None
    if isinstance(central_dp, CentralDPConfig):
        dp = (CentralDP(central_dp.clip, central_dp.noise_multiplier, seed, reproducible=reproducible_noise)
              if central_dp.enabled else None)
    else:
        dp = central_dp
    if cfg.strategy != "fedbuff" and dp is not None:
        raise ValueError("central DP is supported with server.strategy fedbuff only")
    if cfg.strategy != "fedbuff" and cfg.robust.aggregator != "mean":
        raise ValueError("server.robust.aggregator: a robust aggregator needs server.strategy fedbuff")
    return STRATEGIES[cfg.strategy](cfg, weighting, dp)
