"""Staleness weight functions ``S(s)``.

An update trained from global version ``base_version`` and arriving when the
server is at version ``v_now`` has staleness ``s = v_now - base_version``
(an integer, ``s >= 0``). The strategies scale its contribution by ``S(s)``.

The definitions, with ``a >= 0`` and ``b >= 0`` from ``server.staleness`` in YAML:

- ``constant``:    ``S(s) = 1``
- ``polynomial``:  ``S(s) = (1 + s) ** (-a)``
- ``hinge``:       ``S(s) = 1`` if ``s <= b``, else ``1 / (a * (s - b) + 1)``   (Xie et al. 2019)
- ``exponential``: ``S(s) = exp(-a * s)``
- ``adaptive``:    ``S(s) = min(1, C / (s + 1))`` with ``C = server.concurrency`` (``a``, ``b`` unused):
  the delay-adaptive step size of Mishchenko, Bach, Even and Woodworth, "Asynchronous SGD beats
  minibatch SGD under arbitrary delays" (NeurIPS 2022), and Koloskova, Stich and Jaggi, "Sharper
  convergence guarantees for asynchronous SGD ..." (NeurIPS 2022): an update is taken at full
  weight while its delay ``tau = s + 1`` is within the number of tasks in flight, and at ``C / tau``
  beyond.

Every function gives ``S(0) = 1`` and ``0 < S(s) <= 1``, and is non-increasing in ``s``; in
floating point ``S(s)`` can be exactly 0 for a huge ``a * s`` (``exponential`` beyond ``a * s``
of about 745, ``polynomial`` for a huge ``a``).
No normalisation is applied. A negative (or non-integer) ``s`` raises ``ValueError``.

Pure: imports neither Flower nor the database.
"""

from __future__ import annotations

import math
from numbers import Integral, Real
from typing import Callable

from fedasync.config import StalenessConfig

StalenessFn = Callable[[int], float]


def _check_s(s: int) -> int:
    if isinstance(s, bool) or not isinstance(s, Real):
        raise ValueError(f"staleness must be an integer >= 0, got {s!r}")
    if not isinstance(s, Integral):
        if not float(s).is_integer():
            raise ValueError(f"staleness must be an integer >= 0, got {s!r}")
    s = int(s)
    if s < 0:
        raise ValueError(f"staleness must be >= 0, got {s}")
    return s


def constant(s: int, a: float = 0.5, b: float = 4.0) -> float:
    """``S(s) = 1``."""
    _check_s(s)
    return 1.0


def polynomial(s: int, a: float = 0.5, b: float = 4.0) -> float:
    """``S(s) = (1 + s) ** (-a)``."""
    s = _check_s(s)
    return float((1.0 + s) ** (-a))


def hinge(s: int, a: float = 0.5, b: float = 4.0) -> float:
    """``S(s) = 1`` if ``s <= b`` else ``1 / (a * (s - b) + 1)``."""
    s = _check_s(s)
    if s <= b:
        return 1.0
    return float(1.0 / (a * (s - b) + 1.0))


def exponential(s: int, a: float = 0.5, b: float = 4.0) -> float:
    """``S(s) = exp(-a * s)``."""
    s = _check_s(s)
    return float(math.exp(-a * s))


def adaptive(s: int, a: float = 0.5, b: float = 4.0, concurrency: int = 1) -> float:
    """``S(s) = min(1, C / (s + 1))``, ``C = concurrency`` (``a`` and ``b`` are not used)."""
    s = _check_s(s)
    return float(min(1.0, concurrency / (s + 1.0)))


#: name (as written in YAML) -> ``f(s, a, b)``
STALENESS: dict[str, Callable[..., float]] = {
    "constant": constant,
    "polynomial": polynomial,
    "hinge": hinge,
    "exponential": exponential,
    "adaptive": adaptive,
}

#: functions that need ``concurrency`` (``server.concurrency``) besides ``a`` and ``b``
NEEDS_CONCURRENCY = frozenset({"adaptive"})


class _Bound:
    """``S`` with its parameters bound: a callable ``s -> float`` with a readable repr."""

    def __init__(self, name: str, a: float, b: float, concurrency: int | None = None) -> None:
        self.name, self.a, self.b = name, float(a), float(b)
        self.concurrency = concurrency
        self._fn = STALENESS[name]

    def __call__(self, s: int) -> float:
        if self.name in NEEDS_CONCURRENCY:
            return self._fn(s, self.a, self.b, concurrency=self.concurrency)
        return self._fn(s, self.a, self.b)

    def __repr__(self) -> str:
        if self.name in NEEDS_CONCURRENCY:
            return f"staleness({self.name}, C={self.concurrency})"
        return f"staleness({self.name}, a={self.a:g}, b={self.b:g})"


def make_staleness_fn(name: str, a: float = 0.5, b: float = 4.0, concurrency: int | None = None) -> StalenessFn:
    """The staleness function ``name`` with parameters ``a``, ``b`` (and, for ``adaptive``, the
    server's ``concurrency``) bound."""
    if name not in STALENESS:
        raise ValueError(f"unknown staleness function {name!r}; known: {', '.join(STALENESS)}")
    if not a >= 0 or not b >= 0 or math.isinf(a):  # NaN fails both comparisons; b = inf: never discounted
        raise ValueError(f"staleness parameters must be >= 0, a finite (a={a}, b={b})")
    if name in NEEDS_CONCURRENCY:
        if concurrency is None or isinstance(concurrency, bool) or int(concurrency) != concurrency \
                or concurrency < 1:
            raise ValueError(f"staleness function {name} needs concurrency, an integer >= 1 (got {concurrency!r})")
        concurrency = int(concurrency)
    return _Bound(name, a, b, concurrency)


def make_staleness(cfg: StalenessConfig | str, concurrency: int | None = None, **kwargs: float) -> StalenessFn:
    """From a :class:`StalenessConfig` (or a name plus ``a=``/``b=`` keywords). ``concurrency``
    (``server.concurrency``) is needed by ``adaptive`` and ignored by the others."""
    if isinstance(cfg, str):
        return make_staleness_fn(cfg, concurrency=concurrency, **kwargs)
    return make_staleness_fn(cfg.fn, a=cfg.a, b=cfg.b, concurrency=concurrency)
