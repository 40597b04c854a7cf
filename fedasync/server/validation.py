"""Checks on every incoming update, before it can touch the model.

Each check returns a short, stable reason string that is recorded with the rejected update:

``missing_params``, ``missing_key``, ``extra_key``, ``bad_shape``, ``bad_dtype``,
``non_finite``, ``norm_exceeded``, ``stale``, ``bad_signature``, ``unknown_client``, ``replay``,
``late``, ``bad_num_examples``.

:meth:`UpdateValidator.check` runs, in this order (the first failing check names the reason):

1. ``unknown_client``: signing is on and no public key is registered for the task's client, or
   the reply names a client (``metrics["client_id"]``, set by a deployed ClientApp from its
   node config) other than the one the task was sent to.
2. ``missing_params``: the reply carries no parameters.
   ``bad_num_examples``: its ``num_examples`` is not a whole number in 0..2^31-1 (absent: 0).
3. ``bad_signature``: signing is on and the reply's signature is missing or is not the
   registered key's Ed25519 signature over ``(run key, run id, task id, base version, sha256 of
   the parameters, num_examples, sha256 of the metrics)`` (:func:`fedasync.signing.update_message`;
   the run key is the verifying server's own run's random identifier, so a reply signed in another
   deployment or run is rejected),
   checked against the reply's metrics as the server uses them: the weight
   :func:`fedasync.signing.num_examples_of` and the metrics the privacy accountant records.
   With signing on, a reply rejected ``unknown_client`` or ``bad_signature`` loses its metrics
   (``reply.metrics = {}``): they are nobody's word, so its row records none and a DP run charges
   its client the task the server planned.
4. ``missing_key`` / ``extra_key`` / ``bad_shape`` / ``bad_dtype`` / ``non_finite``: the
   parameters must have exactly the global model's keys, shapes and dtypes, all values finite.
5. ``norm_exceeded``: ``||x_i - x_base||_2 > server.max_update_norm`` (when set).
6. ``stale``: ``staleness > server.max_staleness`` (when set).

Two reasons are decided by the server loop, which knows which tasks are open:
``replay`` (a reply for a task that is not open: already closed, or never dispatched; recorded
in the ``replays`` table) and ``late`` (a reply after its task's ``server.task_timeout`` under
``server.late_policy: reject``).

Pure: imports neither Flower nor the database.
"""

from __future__ import annotations

from typing import Any, Callable, Mapping

import numpy as np

from fedasync.config import ServerConfig

Params = dict[str, np.ndarray]

# (reply, live task, run_id) -> reason or None: an extra check a deployment may add
SignatureCheck = Callable[[Any, Any, int], str | None]

REASONS = (
    "missing_params", "missing_key", "extra_key", "bad_shape", "bad_dtype", "non_finite",
    "norm_exceeded", "stale", "bad_signature", "unknown_client", "replay", "late", "bad_num_examples",
)

#: the largest ``num_examples`` a reply may report (the store's integer column)
MAX_EXAMPLES = 2**31 - 1


def bad_num_examples(metrics: Any) -> bool:
    """Whether a reply reports a ``num_examples`` that is not a whole number in 0..MAX_EXAMPLES
    (absent is fine: the weight is then 0)."""
    x = metrics.get("num_examples") if isinstance(metrics, Mapping) else None
    if x is None:
        return False
    try:
        return isinstance(x, bool) or not (0 <= x <= MAX_EXAMPLES and int(x) == x)
    except (TypeError, ValueError, OverflowError):
        return True


def all_finite(a: np.ndarray) -> bool:
    """Whether every element of ``a`` is finite.  For floats, one dot product first: a NaN or an
    infinity makes the sum of squares non-finite, and it needs no temporary (``np.isfinite(a)``
    allocates a boolean array as large as the model, per update); only when that sum is not
    finite (a NaN, an infinity, or finite values whose squares overflow) are the elements checked."""
    if a.dtype.kind != "f":
        return bool(np.all(np.isfinite(a))) if a.dtype.kind == "c" else True
    flat = a.reshape(-1)
    with np.errstate(over="ignore", invalid="ignore"):
        if np.isfinite(np.dot(flat, flat)):
            return True
    return bool(np.all(np.isfinite(a)))


class UpdateValidator:
    """Validates replies against the global model's structure and, when ``public_keys`` is
    given, against each client's registered Ed25519 key (``{client_id: public key}``; a key is an
    ``Ed25519PublicKey``, PEM bytes or 32 raw bytes)."""

    def __init__(self, reference: Params, cfg: ServerConfig, signature_check: SignatureCheck | None = None,
                 public_keys: Mapping[int, Any] | None = None):
        self.spec = {k: (v.shape, v.dtype) for k, v in reference.items()}
        self.cfg = cfg
        self.signature_check = signature_check
        self.public_keys = None
        if public_keys is not None:
            from fedasync.signing import load_public_key

            self.public_keys = {int(c): (k if hasattr(k, "verify") else load_public_key(k))
                                for c, k in public_keys.items()}

    @property
    def signing(self) -> bool:
        return self.public_keys is not None

    def check_params(self, params: Params | None, base: Params | None = None) -> str | None:
        if params is None:
            return "missing_params"
        if not isinstance(params, Mapping):
            return "bad_shape"
        for k in self.spec:
            if k not in params:
                return "missing_key"
        for k in params:
            if k not in self.spec:
                return "extra_key"
        for k, (shape, dtype) in self.spec.items():
            a = params[k]
            # a subclass is refused too: np.matrix, a masked array and the like redefine the
            # arithmetic the checks and the strategies do (np.matrix's dot is a matrix product)
            if type(a) is not np.ndarray or a.shape != shape:
                return "bad_shape"
            if a.dtype != dtype:
                return "bad_dtype"
            if not all_finite(a):
                return "non_finite"
        if self.cfg.max_update_norm is not None and base is not None:
            sq = sum(float(np.sum((params[k].astype(np.float64) - base[k].astype(np.float64)) ** 2))
                     for k in self.spec)
            if sq ** 0.5 > self.cfg.max_update_norm:
                return "norm_exceeded"
        return None

    def check_identity(self, reply: Any, live: Any) -> str | None:
        claimed = (getattr(reply, "metrics", None) or {}).get("client_id")
        if claimed is not None:
            try:  # a whole number naming the task's client (inf, NaN, 0.5, a list: unknown_client)
                n = int(claimed)
                if isinstance(claimed, bool) or (not isinstance(claimed, str) and n != claimed) \
                        or n != int(live.client_id):
                    return "unknown_client"
            except (TypeError, ValueError, OverflowError):
                return "unknown_client"
        if self.public_keys is not None and int(live.client_id) not in self.public_keys:
            return "unknown_client"
        return None

    def check_signature(self, reply: Any, live: Any, run_id: int, run_key: str | None = None) -> str | None:
        if self.public_keys is None:
            return None
        from fedasync.server.strategies import params_sha256
        from fedasync.signing import verify_update

        try:
            sha = params_sha256(reply.params)
        except Exception:  # arrays that cannot even be hashed cannot carry a valid signature
            return "bad_signature"
        if hasattr(reply, "params_sha256"):
            reply.params_sha256 = sha  # the update's row records it: not hashed twice
        ok = verify_update(self.public_keys[int(live.client_id)], reply.signature, run_id, live.task_id,
                           live.base_version, sha, getattr(reply, "metrics", None), run_key=run_key)
        return None if ok else "bad_signature"

    def check(self, reply: Any, live: Any, staleness: int, run_id: int = 0,
              base: Params | None = None, run_key: str | None = None) -> str | None:
        """The reason to reject ``reply`` to task ``live`` (None: valid). ``run_key`` is the run's
        random identifier that signatures must cover (with signing on, None rejects every reply)."""
        reason = self.check_identity(reply, live)
        if reason:
            return self._unauthenticated(reply, reason)
        if reply.params is None:
            return "missing_params"
        if bad_num_examples(getattr(reply, "metrics", None)):
            return "bad_num_examples"
        reason = self.check_signature(reply, live, run_id, run_key)
        if reason:
            return self._unauthenticated(reply, reason)
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

    def _unauthenticated(self, reply: Any, reason: str) -> str:
        """With signing on, a reply that is not its task's client's (``unknown_client``,
        ``bad_signature``) has its metrics dropped: the loop records them (its row, and under local DP
        the client's privacy spend, then charged the planned task), and they are nobody's word (a
        forged 0 steps erased the task's spend, a forged 10**9 exhausted the client's budget)."""
        if self.signing and hasattr(reply, "metrics"):
            reply.metrics = {}
        return reason
