"""Model parameters as ``{name: ndarray}``: difference, norm, digest, float64 round trips. Pure numpy."""

from __future__ import annotations

import hashlib
import json
from collections import deque
from typing import Iterable

import numpy as np
from threadpoolctl import threadpool_limits

Params = dict[str, np.ndarray]
Params64 = dict[str, np.ndarray]  # the same keys, float64 arrays


def one_blas_thread() -> threadpool_limits:
    """A context in which numpy's BLAS (OpenBLAS) runs on one thread. The server's vector
    products (the finiteness check, the robust filters' norms and dot products) gain nothing from
    more: they are bound by memory, not arithmetic. But OpenBLAS's extra threads keep spinning after
    each call, taking cores from the clients the same process or machine trains (a kardam run of
    ``examples/mnist.yaml`` spent 21 s more CPU for it), and the thread count changes how a sum is
    split, so a filter's score would depend on the machine's core count."""
    return threadpool_limits(limits=1, user_api="blas")


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


def params_mean(ps: list[Params]) -> Params:
    """The mean of ``ps`` per array (float64 inside, summed in list order; cast back to the first's
    dtypes, integers rounded)."""
    if not ps:
        raise ValueError("params_mean: no parameters")
    for p in ps[1:]:
        _check_like(ps[0], p)
    return _cast_like({k: sum(np.asarray(p[k], np.float64) for p in ps) / len(ps) for k in ps[0]}, ps[0])


class Tail:
    """The last ``n`` versions' parameters and the model made of them (``server.average_last``)."""

    def __init__(self, n: int, versions: Iterable[Params] = ()) -> None:
        self.versions: deque[Params] = deque(versions, maxlen=n)

    def append(self, p: Params) -> None:
        self.versions.append(p)

    def mean(self) -> Params:
        """The latest itself when ``n`` is 1, else the mean of those held (fewer at the start)."""
        return self.versions[-1] if len(self.versions) == 1 else params_mean(list(self.versions))


def params_norm(p: Params) -> float:
    """Global L2 norm over all arrays, in float64."""
    return float(np.sqrt(sum(float(np.sum(np.square(np.asarray(v, np.float64)))) for v in p.values())))


def params_sha256(p: Params) -> str:
    """SHA-256 hex digest over (key, dtype, shape, raw C-order bytes) of each array, in key order."""
    h = hashlib.sha256()
    for k, v in p.items():
        arr = np.ascontiguousarray(v)
        header = json.dumps([str(k), arr.dtype.str, list(arr.shape)]).encode()
        h.update(len(header).to_bytes(8, "little"))
        h.update(header)
        h.update(arr.nbytes.to_bytes(8, "little"))
        h.update(arr.reshape(-1).view(np.uint8))  # the raw bytes, without a copy
    return h.hexdigest()


#: elements per block of :func:`mean_step` (its float64 work arrays stay in the CPU cache)
_BLOCK = 1 << 15


def mean_step(model: Params, deltas: list, coef: list[float], denom: float, lr: float) -> Params:
    """``model + lr * (sum_i coef_i * delta_i) / denom`` in float64, cast back to ``model``'s dtypes.
    Each of ``deltas`` is a float64 delta (``{name: array}``) or a pair ``(params, base)`` whose
    delta ``float64(params) - float64(base)`` is made here, block by block. The result has
    the plain expression's float operations in the same order (so the same bits), done block by
    block so that the running sum stays in cache while every buffered update is added to it (a
    big model's aggregation is bound by memory traffic, not arithmetic). Within a block each
    distinct base is cast to float64 once (buffered updates share a few bases), and a weight of
    exactly 1 skips its multiplication (``x * 1.0`` is ``x``)."""
    out: Params = {}
    for k, ref in model.items():
        ref = np.asarray(ref)
        flat_x = ref.reshape(-1)
        srcs = [(np.asarray(d[0][k]).reshape(-1), np.asarray(d[1][k]).reshape(-1)) if isinstance(d, tuple)
                else np.asarray(d[k]).reshape(-1) for d in deltas]
        res = np.empty(ref.shape, dtype=ref.dtype).reshape(-1)
        n = flat_x.size
        m = min(n, _BLOCK)
        t, tmp = np.empty(m), np.empty(m)
        # id of each distinct base's flat array -> (the array, its float64 block)
        bases = {id(s[1]): (s[1], np.empty(m)) for s in srcs if isinstance(s, tuple)}
        for lo in range(0, n, _BLOCK):
            hi = min(n, lo + _BLOCK)
            sl, tb, wb = slice(lo, hi), t[:hi - lo], tmp[:hi - lo]
            tb.fill(0.0)
            for base, block in bases.values():
                block[:hi - lo] = base[sl]
            for c, src in zip(coef, srcs):
                if isinstance(src, tuple):
                    bb = bases[id(src[1])][1][:hi - lo]
                    wb[...] = src[0][sl]
                    np.subtract(wb, bb, out=wb)
                    if c != 1.0:
                        np.multiply(wb, c, out=wb)
                    tb += wb
                elif c != 1.0:
                    np.multiply(src[sl], c, out=wb)
                    tb += wb
                else:
                    tb += src[sl]
            np.divide(tb, denom, out=tb)
            np.multiply(lr, tb, out=tb)
            np.add(flat_x[sl], tb, out=tb, dtype=np.float64)
            if np.issubdtype(ref.dtype, np.integer):
                np.rint(tb, out=tb)
            res[sl] = tb
        out[k] = res.reshape(ref.shape)
    return out
