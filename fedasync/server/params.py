"""Model parameters as ``{name: ndarray}``: difference, norm, digest, float64 round trips. Pure numpy."""

from __future__ import annotations

import hashlib
import json

import numpy as np

Params = dict[str, np.ndarray]
Params64 = dict[str, np.ndarray]  # the same keys, float64 arrays


def _check_like(a: Params, b: Params, what: str = "parameters") -> None:
    if a.keys() != b.keys():
        missing = sorted(set(a) ^ set(b))
        raise ValueError(f"{what}: keys differ ({', '.join(missing[:5])})")
    for k in a:
        if np.shape(a[k]) != np.shape(b[k]):
            raise ValueError(f"{what}: shape of {k!r} differs: {np.shape(a[k])} vs {np.shape(b[k])}")


def _f64(p: Params) -> Params64:
    return {k: np.asarray(v, dtype=np.float64) for k, v in p.items()}


def _cast_like(p64: Params64, like: Params) -> Params:
    """New arrays with the keys (in ``like``'s order) and dtypes of ``like``."""
    out: Params = {}
    for k, ref in like.items():
        dtype = np.asarray(ref).dtype
        v = p64[k]
        if np.issubdtype(dtype, np.integer):
            v = np.rint(v)
        out[k] = np.array(v, dtype=dtype, copy=True)
    return out


def _copy(p: Params) -> Params:
    return {k: np.array(v, copy=True) for k, v in p.items()}


def params_sub(a: Params, b: Params) -> Params:
    """``a - b`` per array (float64 inside, cast back to ``a``'s dtypes)."""
    _check_like(a, b)
    return _cast_like({k: np.asarray(a[k], np.float64) - np.asarray(b[k], np.float64) for k in a}, a)


def params_norm(p: Params) -> float:
    """Global L2 norm over all arrays, in float64."""
    return float(np.sqrt(sum(float(np.sum(np.square(np.asarray(v, np.float64)))) for v in p.values())))


def params_sha256(p: Params) -> str:
    """SHA-256 hex digest over (key, dtype, shape, raw C-order bytes) of each array, in key order."""
    h = hashlib.sha256()
    for k, v in p.items():
        arr = np.ascontiguousarray(v)
        header = json.dumps([str(k), arr.dtype.str, list(arr.shape)]).encode()
        data = arr.tobytes()
        h.update(len(header).to_bytes(8, "little"))
        h.update(header)
        h.update(len(data).to_bytes(8, "little"))
        h.update(data)
    return h.hexdigest()
