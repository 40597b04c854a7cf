"""Delay compensation: correct a stale update for the model's drift before the strategy sees it.

DC-ASGD (S. Zheng, Q. Meng, T. Wang, W. Chen, N. Yu, Z.-M. Ma, T.-Y. Liu, "Asynchronous
stochastic gradient descent with delay compensation", ICML 2017) approximates the gradient at the
current model from the stale one with a first-order Taylor term whose Hessian is replaced by the
cheap diagonal ``lambda * g ⊙ g``. Applied to an update's pseudo-gradient:

- ``g = x_base - x_client`` (what the client moved, as a descent step; ``x_base`` is the model the
  client trained from, ``x_now`` the server's model when the update arrives),
- ``g~ = g + lambda * g ⊙ g ⊙ (x_now - x_base)``,
- the compensated client model is ``x_base - g~``.

``server.delay_compensation: {method: dc_asgd, lambda: 0.04}``. The paper's ``lambda`` multiplies
the square of a one-step gradient; here the square is of the pseudo-gradient, about ``lr *
local_steps`` (``eta H``) times that gradient, so this ``lambda`` is the paper's divided by ``eta
H``: the default 0.04 is the paper's ``lambda_0`` for CIFAR-10 as a number, and ``eta H`` times
weaker as a correction (2x at the quickstart's ``eta H = 0.5``; give ``0.04 / (lr * local_steps)``
for the paper's strength). The adaptive variant's ``lambda_t`` is not implemented. The
server loop replaces the update's parameters by :func:`dc_asgd`'s result before the strategy sees
it, for ``fedasync`` and ``fedbuff``; with ``x_now == x_base`` (a fresh update) nothing changes.

Arithmetic is float64 and the result is cast to ``x_client``'s dtypes. With ``lambda = 0`` the
result equals ``x_client`` bit for bit whenever ``x_base - x_client`` is exact in float64, which
holds for float32 parameters (two float32 values differ by a float64 without rounding unless
their exponents are more than 28 apart).

Pure: numpy only.
"""

from __future__ import annotations

from typing import Callable

import numpy as np

Params = dict[str, np.ndarray]
Compensator = Callable[[Params, Params, Params], Params]

METHODS = ("none", "dc_asgd")


def _check(a: Params, b: Params, what: str) -> None:
    if a.keys() != b.keys():
        raise ValueError(f"dc_asgd: {what} has different keys")
    for k in a:
        if np.shape(a[k]) != np.shape(b[k]):
            raise ValueError(f"dc_asgd: {what}: shape of {k!r} differs: {np.shape(a[k])} vs {np.shape(b[k])}")


def dc_asgd(x_now: Params, x_base: Params, x_client: Params, lam: float) -> Params:
    """The compensated client model ``x_base - (g + lam * g*g*(x_now - x_base))``, ``g = x_base - x_client``.

    New arrays, in ``x_client``'s key order and dtypes; inputs are not mutated.
    """
    if not 0 <= lam < np.inf:
        raise ValueError(f"dc_asgd: lambda must be finite and >= 0, got {lam}")
    _check(x_client, x_base, "the update's base model")
    _check(x_client, x_now, "the current model")
    out: Params = {}
    for k, ref in x_client.items():
        xb = np.asarray(x_base[k], np.float64)
        g = xb - np.asarray(ref, np.float64)
        drift = np.asarray(x_now[k], np.float64) - xb
        g_t = g + lam * g * g * drift
        v = xb - g_t
        dtype = np.asarray(ref).dtype
        if np.issubdtype(dtype, np.integer):
            v = np.rint(v)
        out[k] = np.array(v, dtype=dtype, copy=True)
    return out


def make_delay_compensation(cfg) -> Compensator | None:
    """From ``server.delay_compensation`` (a :class:`fedasync.config.DelayCompensationConfig`):
    ``None`` for ``none``, else ``f(x_now, x_base, x_client) -> compensated x_client``."""
    if cfg.method == "none":
        return None
    if cfg.method == "dc_asgd":
        lam = float(cfg.lambda_)

        def compensate(x_now: Params, x_base: Params, x_client: Params) -> Params:
            return dc_asgd(x_now, x_base, x_client, lam)

        compensate.__name__ = f"dc_asgd(lambda={lam:g})"
        return compensate
    raise ValueError(f"unknown delay compensation {cfg.method!r}; known: {', '.join(METHODS)}")
