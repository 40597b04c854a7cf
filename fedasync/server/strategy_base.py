"""What every aggregation rule shares: :class:`Update`, the :class:`Strategy` interface and the
server optimizer (a server learning rate with heavy-ball momentum, FedAvgM). Pure numpy.

The rules themselves are in :mod:`fedasync.server.strategies` (fedasync, fedbuff, the registry)
and :mod:`fedasync.server.fedavg`; client-level central DP in :mod:`fedasync.server.central_dp`.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Any

import numpy as np

from fedasync.server.params import Params, Params64

WEIGHTINGS = ("uniform", "examples")


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


def check_server_opt(name: str, server_lr: float, server_momentum: float) -> None:
    """ValueError unless ``server_lr > 0`` and ``0 <= server_momentum < 1``."""
    if not server_lr > 0:
        raise ValueError(f"{name} server_lr must be > 0, got {server_lr}")
    if not 0 <= server_momentum < 1:
        raise ValueError(f"{name} server_momentum must be in [0, 1), got {server_momentum}")


def server_step(x: Params64, d: Params64, lr: float, beta: float,
                velocity: Params64 | None) -> tuple[Params64, Params64 | None]:
    """The server optimizer (FedAvgM, Hsu et al. 2019) on the aggregated step ``d``:
    ``v <- beta * v + d``, ``x <- x + lr * v`` (``v`` starts at 0), in float64. Returns the new
    ``x`` and ``v``. With ``beta == 0`` no velocity is kept (``None``) and the new model is
    ``x + lr * d``, the same float operations as without an optimizer."""
    if beta == 0.0:
        return {k: x[k] + lr * d[k] for k in x}, None
    v = {k: np.array(d[k], np.float64, copy=True) for k in x} if velocity is None else \
        {k: beta * velocity[k] + d[k] for k in x}
    return {k: x[k] + lr * v[k] for k in x}, v


def velocity_state(v: Params64 | None) -> dict[str, Any]:
    """``{"velocity": copy}`` for a strategy's state (empty when there is none)."""
    return {} if v is None else {"velocity": {k: np.array(a, np.float64, copy=True) for k, a in v.items()}}


def load_velocity(d: dict[str, Any]) -> Params64 | None:
    v = d.get("velocity")
    return None if v is None else {k: np.array(a, np.float64, copy=True) for k, a in v.items()}


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

    def settled_state(self) -> dict[str, Any] | None:
        """The :meth:`state_dict` of this strategy with no update buffered: what a resume loads before
        it re-adds the :meth:`pending` updates (the loop stores them with their parameters), in the order
        they arrived. None when that state cannot be told now (here: while updates are buffered; a
        strategy whose buffered updates leave the rest of its state as it was overrides this)."""
        return None if self.pending() else self.state_dict()

    def load_state_dict(self, d: dict[str, Any]) -> None:
        if d.get("strategy") != self.name:
            raise ValueError(f"state is for strategy {d.get('strategy')!r}, not {self.name!r}")
        self._last = [int(t) for t in d.get("last_aggregated", [])]
