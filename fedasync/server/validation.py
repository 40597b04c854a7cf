"""Checks on every incoming update, before it can touch the model.

Each check returns a short, stable reason string that is recorded with the rejected update:

``missing_params``, ``missing_key``, ``extra_key``, ``bad_shape``, ``bad_dtype``,
``non_finite``, ``norm_exceeded``, ``stale``, ``bad_signature``, ``unknown_client``, ``replay``.

Pure: imports neither Flower nor the database.
"""

from __future__ import annotations

from typing import Any, Callable

import numpy as np

from fedasync.config import ServerConfig

Params = dict[str, np.ndarray]

# (reply, live task, run_id) -> reason or None; set by deployments that sign updates
SignatureCheck = Callable[[Any, Any, int], str | None]


class UpdateValidator:
    def __init__(self, reference: Params, cfg: ServerConfig, signature_check: SignatureCheck | None = None):
        self.spec = {k: (v.shape, v.dtype) for k, v in reference.items()}
        self.cfg = cfg
        self.signature_check = signature_check

    def check_params(self, params: Params | None, base: Params | None = None) -> str | None:
        if params is None:
            return "missing_params"
        for k in self.spec:
            if k not in params:
                return "missing_key"
        for k in params:
            if k not in self.spec:
                return "extra_key"
        for k, (shape, dtype) in self.spec.items():
            a = params[k]
            if not isinstance(a, np.ndarray) or a.shape != shape:
                return "bad_shape"
            if a.dtype != dtype:
                return "bad_dtype"
            if not np.all(np.isfinite(a)):
                return "non_finite"
        if self.cfg.max_update_norm is not None and base is not None:
            sq = sum(float(np.sum((params[k].astype(np.float64) - base[k].astype(np.float64)) ** 2))
                     for k in self.spec)
            if sq ** 0.5 > self.cfg.max_update_norm:
                return "norm_exceeded"
        return None

    def check(self, reply: Any, live: Any, staleness: int, run_id: int = 0,
              base: Params | None = None) -> str | None:
        if self.signature_check is not None:
            reason = self.signature_check(reply, live, run_id)
            if reason:
                return reason
        reason = self.check_params(reply.params, base)
        if reason:
            return reason
        if self.cfg.max_staleness is not None and staleness > self.cfg.max_staleness:
            return "stale"
        return None
