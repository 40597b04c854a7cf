"""Simulated Byzantine clients (the ``attack:`` section): who attacks, and what they send.

Simulation only. A deployed server refuses a config with an ``attack`` section
(:func:`fedasync.config.check_no_attack`), and nothing on a deployed client's path imports this
module. Everything here is a pure function of its arguments (numpy, plus the config's client-set
parser), so an attacked run is still a pure function of config + seed.

Who: :func:`attackers` — ``attack.clients`` ("0-19") as given, or ``round(attack.fraction * N)``
clients (at least one) drawn without replacement by a Generator seeded with ``(seed, salt)``.

What (``attack.kind``; ``Δ = x_client - x_base`` is the honest update the attacker computed):

- ``sign_flip``: sends ``x_base - factor * Δ`` (:func:`sign_flip`);
- ``scale``: sends ``x_base + factor * Δ`` (:func:`scale`);
- ``gaussian``: sends ``x_base + n`` with ``n`` Gaussian noise rescaled to ``||n|| = factor * ||Δ||``,
  drawn from a Generator seeded with ``(seed, task_id, salt)`` (:func:`gaussian`);
- ``label_flip``: trains honestly on labels ``y -> C - 1 - y`` (:func:`flip_labels`), applied to
  the client's data before local training;
- ``stale`` (a delay attack): every update is computed on a model ``lag`` versions old while
  claiming the current one. Only the server can simulate it: when it dispatches to an attacker it
  sends the parameters of version ``stale_version(v, lag)`` and records ``base_version = v`` (the
  current version, the one the update will be judged against). The reply then carries
  ``x_old + local progress``, and the server sees ``Δ = (x_old - x_now) + progress``: it pulls
  the model back toward an old one.

``factor`` defaults to 10. The transformed parameters keep the honest update's keys, shapes and
dtypes and stay finite for finite inputs (float64 inside, cast back), so they pass the
validation battery: they are the hard case for the robust filters.
"""

from __future__ import annotations

from typing import Any

import numpy as np

Params = dict[str, np.ndarray]

KINDS = ("sign_flip", "scale", "gaussian", "label_flip", "stale")
#: kinds that transform the reply's parameters (the others change the data or the dispatch)
REPLY_KINDS = ("sign_flip", "scale", "gaussian")

_ATTACKER_SALT = 0xA77AC
_NOISE_SALT = 0x6A055


def attackers(cfg: Any, num_clients: int, seed: int) -> frozenset[int]:
    """The malicious client ids for ``cfg`` (a :class:`fedasync.config.AttackConfig`, or ``None``:
    nobody). A pure function of ``(cfg, num_clients, seed)``."""
    if cfg is None:
        return frozenset()
    if cfg.clients is not None:
        from fedasync.config import parse_client_set

        return frozenset(parse_client_set(cfg.clients, num_clients, key="attack.clients"))
    k = max(1, int(round(float(cfg.fraction) * num_clients)))
    k = min(k, num_clients)
    rng = np.random.default_rng(np.random.SeedSequence([int(seed), _ATTACKER_SALT]))
    return frozenset(int(c) for c in rng.choice(num_clients, size=k, replace=False))


def _check(base: Params, client: Params) -> None:
    if base.keys() != client.keys():
        raise ValueError("attack: the update and its base model have different keys")
    for k in base:
        if np.shape(base[k]) != np.shape(client[k]):
            raise ValueError(f"attack: shape of {k!r} differs: {np.shape(base[k])} vs {np.shape(client[k])}")


def _cast_like(p64: Params, like: Params) -> Params:
    out: Params = {}
    for k, ref in like.items():
        dtype = np.asarray(ref).dtype
        v = p64[k]
        if np.issubdtype(dtype, np.integer):
            v = np.rint(v)
        out[k] = np.array(v, dtype=dtype, copy=True)
    return out


def _deltas(base: Params, client: Params) -> tuple[Params, Params]:
    _check(base, client)
    xb = {k: np.asarray(base[k], np.float64) for k in client}
    return xb, {k: np.asarray(client[k], np.float64) - xb[k] for k in client}


def sign_flip(base: Params, client: Params, factor: float = 10.0) -> Params:
    """``x_base - factor * (x_client - x_base)``."""
    xb, d = _deltas(base, client)
    return _cast_like({k: xb[k] - factor * d[k] for k in d}, client)


def scale(base: Params, client: Params, factor: float = 10.0) -> Params:
    """``x_base + factor * (x_client - x_base)``."""
    xb, d = _deltas(base, client)
    return _cast_like({k: xb[k] + factor * d[k] for k in d}, client)


def gaussian(base: Params, client: Params, factor: float = 10.0, seed: int = 0, task_id: int = 0) -> Params:
    """``x_base + n``, ``n`` standard normal (drawn in key order from ``(seed, task_id, salt)``)
    rescaled to ``||n|| = factor * ||x_client - x_base||``."""
    xb, d = _deltas(base, client)
    rng = np.random.default_rng(np.random.SeedSequence([int(seed), int(task_id), _NOISE_SALT]))
    noise = {k: rng.standard_normal(np.shape(d[k])) for k in d}
    target = factor * float(np.sqrt(sum(float(np.sum(v * v)) for v in d.values())))
    have = float(np.sqrt(sum(float(np.sum(v * v)) for v in noise.values())))
    c = target / have if have > 0 else 0.0
    return _cast_like({k: xb[k] + c * noise[k] for k in d}, client)


def flip_labels(y: np.ndarray, num_classes: int) -> np.ndarray:
    """``C - 1 - y`` (a new array, same dtype)."""
    y = np.asarray(y)
    if num_classes < 1:
        raise ValueError(f"flip_labels: num_classes must be >= 1, got {num_classes}")
    if y.size and (y.min() < 0 or y.max() >= num_classes):
        raise ValueError(f"flip_labels: labels outside 0-{num_classes - 1}")
    return (num_classes - 1 - y).astype(y.dtype, copy=False).copy()


def stale_version(version: int, lag: int) -> int:
    """The version whose parameters a ``stale`` attacker is sent at global ``version``."""
    return max(0, int(version) - int(lag))


def apply_to_reply(kind: str, base: Params, client: Params, factor: float = 10.0, seed: int = 0,
                   task_id: int = 0) -> Params:
    """The parameters an attacker of ``kind`` sends instead of its honest ``client`` parameters
    (``kind`` in :data:`REPLY_KINDS`; ``label_flip`` and ``stale`` act before training, and
    return ``client`` unchanged here)."""
    if kind == "sign_flip":
        return sign_flip(base, client, factor)
    if kind == "scale":
        return scale(base, client, factor)
    if kind == "gaussian":
        return gaussian(base, client, factor, seed=seed, task_id=task_id)
    if kind in ("label_flip", "stale"):
        return client
    raise ValueError(f"unknown attack kind {kind!r}; known: {', '.join(KINDS)}")
