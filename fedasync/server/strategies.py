"""Aggregation rules: what the new global model is. Pure array math.

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
- ``fedavg`` (synchronous, optional backup workers, Chen et al. 2017): a round dispatches
  ``m + b`` tasks from version ``v``; the first ``m`` updates with ``base_version == v``
  are aggregated, ``examples``: ``x <- sum n_i x_i / sum n_i``, ``uniform``: ``mean(x_i)``;
  later ones are rejected by :meth:`Strategy.check` with ``"round_closed"``. When a round closes
  the server cancels its ``b`` remaining tasks, so that all ``m + b`` workers restart together
  on the new model (:func:`fedasync.server.control.cancel_dropped`).

Arithmetic is float64; results are cast back to each array's dtype. Inputs are never mutated;
every returned model is a new dict of new arrays. One can overflow to inf (a huge finite update
times ``server_lr > 1``, or central-DP noise): the server then calls :meth:`Strategy.discard`.
"""

from __future__ import annotations

import secrets
from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Any, Callable, Sequence

import numpy as np

from fedasync.config import CentralDPConfig, ServerConfig
from fedasync.server import robust
from fedasync.server.params import Params, Params64, _cast_like, _check_like, _copy, _f64, mean_step, params_norm, params_sha256, params_sub  # noqa: F401
from fedasync.server.staleness import StalenessFn, make_staleness

WEIGHTINGS = ("uniform", "examples")


# -- updates and the strategy interface ---------------------------------------------


@dataclass
class Update:
    """One client reply, as the strategy sees it."""

    task_id: int
    client_id: int
    params: Params  # the client's new weights x_i
    base_params: Params  # the global model the client started from (x at base_version)
    base_version: int
    staleness: int  # v_now - base_version, computed by the caller
    num_examples: int


def no_examples(weighting: str, update: Update) -> str | None:
    """``no_examples`` when ``examples`` weighting would give ``update`` no weight (it reports no
    ``num_examples``): such an update cannot move the model, and a round or buffer of them only
    would have no weights to normalise; it is rejected with that reason instead."""
    return "no_examples" if weighting == "examples" and update.num_examples <= 0 else None


class Strategy(ABC):
    """An aggregation rule. Subclasses keep only the buffer they need between calls."""

    name: str = ""
    synchronous: bool = False
    _UNDO: tuple[str, ...] = ("_last",)  # what discard() puts back (fedavg: the closed round too)

    def __init__(self) -> None:
        self._last: list[int] = []

    @abstractmethod
    def weight(self, update: Update) -> float:
        """The weight recorded for this update (its share in the aggregation)."""

    def check(self, update: Update, version: int) -> str | None:
        """A reason to reject ``update`` at server ``version``, or ``None`` to accept it."""
        return None

    @abstractmethod
    def add(self, model: Params, update: Update, version: int) -> Params | None:
        """Take one accepted update; the new global model if it triggers an aggregation."""

    def pending(self) -> list[int]:
        """Task ids buffered and not yet aggregated."""
        return []

    def last_aggregated(self) -> list[int]:
        """Task ids that produced the most recently returned model."""
        return list(self._last)

    def undo_state(self) -> dict[str, Any]:
        """Before :meth:`add`: what an aggregation changes besides emptying its buffer (small)."""
        return {k: getattr(self, k) for k in self._UNDO}

    def discard(self, before: dict[str, Any]) -> None:
        """Forget the model the last :meth:`add` returned (the server found it non-finite): its
        updates left the buffer with it (the server rejects them); the rest is put back as
        ``before`` (:meth:`undo_state`). A central-DP release made stays counted (its noise was drawn)."""
        self.__dict__.update(before)

    def state_dict(self) -> dict[str, Any]:
        return {"strategy": self.name, "last_aggregated": list(self._last)}

    def load_state_dict(self, d: dict[str, Any]) -> None:
        if d.get("strategy") != self.name:
            raise ValueError(f"state is for strategy {d.get('strategy')!r}, not {self.name!r}")
        self._last = [int(t) for t in d.get("last_aggregated", [])]


# -- central DP ---------------------------------------------------------------------


class CentralDP:
    """Client-level central DP for buffered aggregation (the Gaussian mechanism).

    ``privatize`` clips each delta to global L2 norm ``clip``, multiplies it by its weight
    (the staleness weight, ``<= 1``, so the sensitivity stays ``clip``), sums, and adds
    ``N(0, (noise_multiplier * clip)^2)`` to every coordinate, drawn in key order.
    ``releases`` counts the noisy sums released (for the accountant).

    Where the noise comes from: by default (``reproducible=False``) a numpy ``PCG64`` generator
    seeded with 128 bits of OS entropy (:func:`secrets.randbits`) when this object is made;
    ``reproducible=True`` (``privacy.reproducible_noise``) derives release ``r``'s noise from
    ``(seed, r)``.  No generator state is ever persisted (:meth:`state_dict` holds only the
    release count): a stored state would let anyone who reads the database regenerate the
    noise and subtract it from the stored model versions.  So a resumed run draws fresh
    entropy (secret noise), or re-derives each release's noise from the seed and the release
    index (reproducible noise: a resumed run ends with the same model as one never stopped).
    PCG64 is not a cryptographically secure generator; see the README's privacy section.
    """

    def __init__(self, clip: float, noise_multiplier: float, seed: int = 0, reproducible: bool = False) -> None:
        if clip <= 0:
            raise ValueError(f"central DP clip must be > 0, got {clip}")
        if noise_multiplier < 0:
            raise ValueError(f"central DP noise_multiplier must be >= 0, got {noise_multiplier}")
        self.clip = float(clip)
        self.noise_multiplier = float(noise_multiplier)
        self.seed = int(seed)
        self.reproducible = bool(reproducible)
        self._secret = None if self.reproducible else np.random.default_rng(secrets.randbits(128))
        self.releases = 0

    @property
    def noise_std(self) -> float:
        return self.noise_multiplier * self.clip

    def noise_rng(self) -> np.random.Generator:
        """The generator for the next release (see the class docstring)."""
        if self._secret is not None:
            return self._secret
        return np.random.default_rng(np.random.SeedSequence([self.seed % 2**64, 0xCE17, self.releases]))

    def clip_delta(self, delta: Params) -> Params64:
        """``delta * min(1, clip / ||delta||)`` in float64."""
        norm = params_norm(delta)
        factor = 1.0 if norm <= self.clip else self.clip / norm
        return {k: np.asarray(v, np.float64) * factor for k, v in delta.items()}

    def privatize(
        self,
        deltas: Sequence[Params],
        rng: np.random.Generator | None = None,
        *,
        weights: Sequence[float] | None = None,
    ) -> Params64:
        """The noisy sum ``sum_i w_i clip(delta_i) + N(0, std^2 I)`` (float64)."""
        if not deltas:
            raise ValueError("privatize: no deltas")
        rng = self.noise_rng() if rng is None else rng
        weights = [1.0] * len(deltas) if weights is None else list(weights)
        if len(weights) != len(deltas):
            raise ValueError("privatize: one weight per delta")
        total = {k: np.zeros(np.shape(v), np.float64) for k, v in deltas[0].items()}
        for d, w in zip(deltas, weights):
            _check_like(total, d, "central DP delta")
            for k, v in self.clip_delta(d).items():
                total[k] += w * v
        std = self.noise_std
        for k in total:
            total[k] = total[k] + rng.normal(0.0, std, size=total[k].shape)
        self.releases += 1
        return total

    def state_dict(self) -> dict[str, Any]:
        """The release count only: never the generator (see the class docstring)."""
        return {"releases": self.releases, "reproducible": self.reproducible}

    def load_state_dict(self, d: dict[str, Any]) -> None:
        self.releases = int(d["releases"])  # a state from before 0.x may carry "bit_generator": ignored


# -- the strategies -----------------------------------------------------------------


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
    rebuilds the same buffer and held list). Without central DP nothing is held.
    """

    name = "fedbuff"
    BACKLOG = "client_backlog"

    def __init__(
        self,
        buffer_size: int,
        server_lr: float,
        staleness_fn: StalenessFn,
        weighting: str = "uniform",
        central_dp: CentralDP | None = None,
        aggregator: str = "mean",
        aggregator_params: dict[str, Any] | None = None,
    ) -> None:
        super().__init__()
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
            new = {k: x[k] + self.server_lr * (total[k] / float(len(buf))) for k in x}
            self._last = [e["task_id"] for e in buf]
            return _cast_like(new, model)
        uniform = self.weighting == "uniform"
        coef = [e["weight"] if uniform else e["num_examples"] * e["weight"] for e in buf]
        denom = float(len(buf)) if uniform else float(sum(e["num_examples"] for e in buf))
        if not uniform and denom <= 0:
            raise ValueError("fedbuff examples weighting: the buffered updates have 0 examples")
        self._last = [e["task_id"] for e in buf]
        return mean_step(model, [_delta_source(e) for e in buf], coef, denom, self.server_lr)

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
        new = {key: x[key] + self.server_lr * step[key] for key in x}
        self._last = [e["task_id"] for e in buf]
        return _cast_like(new, model)

    def pending(self) -> list[int]:
        return [e["task_id"] for e in self._buffer] + [e["task_id"] for e in self._held]

    def state_dict(self) -> dict[str, Any]:
        d = super().state_dict()
        d["buffer"] = [_entry_state(e) for e in self._buffer]
        if self._held:
            d["held"] = [_entry_state(e) for e in self._held]
        d["central_dp"] = self.central_dp.state_dict() if self.central_dp is not None else None
        return d

    def load_state_dict(self, d: dict[str, Any]) -> None:
        super().load_state_dict(d)

        def entries(key: str) -> list[dict[str, Any]]:
            return [dict(e, delta={k: np.array(v, dtype=np.float64, copy=True) for k, v in e["delta"].items()})
                    for e in d.get(key, [])]

        self._buffer = entries("buffer")
        self._held = entries("held")
        if d.get("central_dp") is not None:
            if self.central_dp is None:
                raise ValueError("state has central DP but this fedbuff has none")
            self.central_dp.load_state_dict(d["central_dp"])


class FedAvg(Strategy):
    """Synchronous FedAvg: the first ``m`` updates of the current round, ``b`` backups dropped."""

    name = "fedavg"
    synchronous = True
    _UNDO = ("_last", "_closed")  # a discarded round is open again: its backups and new tasks refill it

    def __init__(self, clients_per_round: int, backup_workers: int = 0, weighting: str = "examples") -> None:
        super().__init__()
        if clients_per_round < 1 or backup_workers < 0:
            raise ValueError(f"fedavg needs m >= 1 and b >= 0 (m={clients_per_round}, b={backup_workers})")
        if weighting not in WEIGHTINGS:
            raise ValueError(f"fedavg weighting must be one of {WEIGHTINGS}, got {weighting!r}")
        self.clients_per_round = int(clients_per_round)
        self.backup_workers = int(backup_workers)
        self.weighting = weighting
        self._buffer: list[dict[str, Any]] = []
        self._closed: int | None = None  # the version of the last aggregated round

    @property
    def round_size(self) -> int:
        """Tasks to dispatch per round: ``m + b``."""
        return self.clients_per_round + self.backup_workers

    def weight(self, update: Update) -> float:
        return float(update.num_examples) if self.weighting == "examples" else 1.0

    def check(self, update: Update, version: int) -> str | None:
        if update.base_version != version or (self._closed is not None and version <= self._closed):
            return "round_closed"
        return no_examples(self.weighting, update)

    def add(self, model: Params, update: Update, version: int) -> Params | None:
        reason = self.check(update, version)
        if reason is not None:
            raise ValueError(f"fedavg: update of task {update.task_id} rejected ({reason}); call check first")
        _check_like(model, update.params, "update")
        self._buffer.append(
            {
                "task_id": int(update.task_id),
                "client_id": int(update.client_id),
                "params": _copy(update.params),
                "weight": self.weight(update),
                "base_version": int(update.base_version),
            }
        )
        if len(self._buffer) < self.clients_per_round:
            return None
        buf, self._buffer = self._buffer, []
        denom = float(sum(e["weight"] for e in buf))
        if denom <= 0:
            raise ValueError("fedavg examples weighting: the round's updates have 0 examples")
        total = {k: np.zeros(np.shape(v), np.float64) for k, v in model.items()}
        for e in buf:
            for k in total:
                total[k] += e["weight"] * np.asarray(e["params"][k], np.float64)
        self._last = [e["task_id"] for e in buf]
        self._closed = version
        return _cast_like({k: v / denom for k, v in total.items()}, model)

    def pending(self) -> list[int]:
        return [e["task_id"] for e in self._buffer]

    def state_dict(self) -> dict[str, Any]:
        d = super().state_dict()
        d["buffer"] = [dict(e, params=_copy(e["params"])) for e in self._buffer]
        d["closed"] = self._closed
        return d

    def load_state_dict(self, d: dict[str, Any]) -> None:
        super().load_state_dict(d)
        self._buffer = [dict(e, params=_copy(e["params"])) for e in d.get("buffer", [])]
        self._closed = d.get("closed")


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
    )


def _fedavg(cfg: ServerConfig, weighting: str, central_dp: CentralDP | None) -> Strategy:
    return FedAvg(
        clients_per_round=cfg.clients_per_round or cfg.concurrency,
        backup_workers=cfg.backup_workers,
        weighting=weighting,
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
