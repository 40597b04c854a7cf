"""Synchronous FedAvg with backup workers (Chen et al. 2017) and the server optimizer (FedAvgM,
Hsu et al. 2019). Pure numpy.

A round dispatches ``m + b`` tasks from version ``v``; the first ``m`` updates with
``base_version == v`` are averaged, ``examples``: ``a = sum n_i x_i / sum n_i``, ``uniform``:
``a = mean(x_i)``; later ones are rejected by :meth:`FedAvg.check` with ``"round_closed"``. When a
round closes the server cancels its ``b`` remaining tasks, so that all ``m + b`` workers restart
together on the new model (:func:`fedasync.server.control.cancel_dropped`).

The new model: with ``server_lr == 1`` and ``server_momentum == 0`` (the defaults) it is ``a``
itself (plain FedAvg, the same bits as before the optimizer existed); otherwise the round's
averaged delta ``d = a - x`` goes through :func:`~fedasync.server.strategy_base.server_step`:
``v <- beta v + d``, ``x <- x + server_lr v`` (FedAvgM; ``v`` is strategy state, saved in
:meth:`FedAvg.state_dict` and so kept across a resume).
"""

from __future__ import annotations

from typing import Any

import numpy as np

from fedasync.server.params import Params, _cast_like, _check_like, _copy, _f64
from fedasync.server.strategy_base import (WEIGHTINGS, Strategy, Update, check_server_opt, load_velocity,
                                           no_examples, server_step, velocity_state)


class FedAvg(Strategy):
    """Synchronous FedAvg(M): the first ``m`` updates of the current round, ``b`` backups dropped."""

    name = "fedavg"
    synchronous = True
    # a discarded round is open again (its backups and new tasks refill it); its velocity step undone
    _UNDO = ("_last", "_closed", "_velocity")

    def __init__(self, clients_per_round: int, backup_workers: int = 0, weighting: str = "examples",
                 server_lr: float = 1.0, server_momentum: float = 0.0) -> None:
        super().__init__()
        if clients_per_round < 1 or backup_workers < 0:
            raise ValueError(f"fedavg needs m >= 1 and b >= 0 (m={clients_per_round}, b={backup_workers})")
        if weighting not in WEIGHTINGS:
            raise ValueError(f"fedavg weighting must be one of {WEIGHTINGS}, got {weighting!r}")
        check_server_opt("fedavg", server_lr, server_momentum)
        self.clients_per_round = int(clients_per_round)
        self.backup_workers = int(backup_workers)
        self.weighting = weighting
        self.server_lr = float(server_lr)
        self.server_momentum = float(server_momentum)
        self._buffer: list[dict[str, Any]] = []
        self._closed: int | None = None  # the version of the last aggregated round
        self._velocity: dict[str, np.ndarray] | None = None  # FedAvgM's v (float64), None while 0

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
        avg = {k: v / denom for k, v in total.items()}
        if self.server_lr == 1.0 and self.server_momentum == 0.0:
            return _cast_like(avg, model)
        x = _f64(model)
        new, self._velocity = server_step(x, {k: avg[k] - x[k] for k in x}, self.server_lr,
                                          self.server_momentum, self._velocity)
        return _cast_like(new, model)

    def pending(self) -> list[int]:
        return [e["task_id"] for e in self._buffer]

    def state_dict(self) -> dict[str, Any]:
        d = super().state_dict()
        d["buffer"] = [dict(e, params=_copy(e["params"])) for e in self._buffer]
        d["closed"] = self._closed
        d.update(velocity_state(self._velocity))
        return d

    def load_state_dict(self, d: dict[str, Any]) -> None:
        super().load_state_dict(d)
        self._buffer = [dict(e, params=_copy(e["params"])) for e in d.get("buffer", [])]
        self._closed = d.get("closed")
        self._velocity = load_velocity(d)
