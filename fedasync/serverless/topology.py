"""Gossip topologies: who may average with whom. Pure (numpy only; no Flower, no database).

``neighbours(name, n, seed, degree)`` returns, for every peer ``0..n-1``, the sorted list of
peers it may pick when it averages. Averaging changes both models, so every edge is used in
both directions and the graphs are **undirected** (``j in nb[i]`` iff ``i in nb[j]``):

- ``ring``: ``i - 1`` and ``i + 1`` (mod ``n``).
- ``torus``: a ``r x c`` grid with wrap-around, ``r`` the largest divisor of ``n`` with
  ``r <= sqrt(n)`` (``n`` prime gives ``1 x n``, i.e. a ring); up, down, left, right.
- ``exponential``: ``i +- 2^k`` (mod ``n``) for ``k = 0 .. floor(log2(n - 1))`` (the
  exponential graph of SGP / Ying et al. 2021, made undirected).
- ``complete``: every other peer.
- ``random-k``: every peer draws ``degree`` distinct others from
  ``np.random.default_rng([seed, 0x72616e64, attempt, i])`` and the union is made undirected;
  if that graph is disconnected, ``attempt`` is increased (up to 100 draws, else ``ValueError``).

Every topology of ``n >= 2`` peers is connected. ``mixing_matrix`` and ``spectral_gap`` give the
doubly-stochastic matrix of one pairwise averaging step chosen uniformly (peer ``i`` uniformly,
then a neighbour uniformly), a standard way to compare how fast topologies mix.
"""

from __future__ import annotations

import math

import numpy as np

TOPOLOGIES = ("ring", "torus", "exponential", "complete", "random-k")
_RANDOM_STREAM = 0x72616E64  # "rand"


def _check(name: str, n: int) -> None:
    if name not in TOPOLOGIES:
        raise ValueError(f"unknown topology {name!r}; known: {', '.join(TOPOLOGIES)}")
    if isinstance(n, bool) or not isinstance(n, (int, np.integer)) or n < 2:
        raise ValueError(f"a gossip topology needs at least 2 peers, got {n!r}")


def torus_shape(n: int) -> tuple[int, int]:
    """``(rows, cols)`` with ``rows * cols == n`` and ``rows`` the largest divisor ``<= sqrt(n)``."""
    r = math.isqrt(n)
    while n % r:
        r -= 1
    return r, n // r


def _symmetric(out: list[set[int]]) -> list[list[int]]:
    n = len(out)
    und = [set(s) for s in out]
    for i in range(n):
        for j in out[i]:
            und[j].add(i)
    for i in range(n):
        und[i].discard(i)
    return [sorted(s) for s in und]


def is_connected(nb: list[list[int]]) -> bool:
    n = len(nb)
    if n == 0:
        return True
    seen, stack = {0}, [0]
    while stack:
        i = stack.pop()
        for j in nb[i]:
            if j not in seen:
                seen.add(j)
                stack.append(j)
    return len(seen) == n


def _random_k(n: int, degree: int, seed: int) -> list[list[int]]:
    if not 1 <= degree <= n - 1:
        raise ValueError(f"random-k: degree must be in 1..{n - 1} for {n} peers, got {degree}")
    for attempt in range(100):
        out = []
        for i in range(n):
            rng = np.random.default_rng([seed, _RANDOM_STREAM, attempt, i])
            others = [j for j in range(n) if j != i]
            out.append({int(others[k]) for k in rng.choice(len(others), size=degree, replace=False)})
        nb = _symmetric(out)
        if is_connected(nb):
            return nb
    raise ValueError(f"random-k: no connected graph of {n} peers with degree {degree} in 100 draws; "
                     f"use a larger degree")


def neighbours(name: str, n: int, seed: int = 0, degree: int = 2) -> list[list[int]]:
    """For each peer ``0..n-1`` the sorted list of its neighbours (undirected, no self loops)."""
    _check(name, n)
    n = int(n)
    if name == "ring":
        return _symmetric([{(i - 1) % n, (i + 1) % n} for i in range(n)])
    if name == "torus":
        r, c = torus_shape(n)
        out = []
        for i in range(n):
            y, x = divmod(i, c)
            out.append({((y - 1) % r) * c + x, ((y + 1) % r) * c + x, y * c + (x - 1) % c, y * c + (x + 1) % c})
        return _symmetric(out)
    if name == "exponential":
        ks = range(int(math.floor(math.log2(n - 1))) + 1)
        return _symmetric([{(i + 2**k) % n for k in ks} | {(i - 2**k) % n for k in ks} for i in range(n)])
    if name == "complete":
        return [[j for j in range(n) if j != i] for i in range(n)]
    return _random_k(n, int(degree), int(seed))


def mixing_matrix(nb: list[list[int]]) -> np.ndarray:
    """Expected averaging matrix of one step: peer ``i`` uniformly, a neighbour ``j`` uniformly,
    ``x_i, x_j <- (x_i + x_j) / 2``. Symmetric and doubly stochastic."""
    n = len(nb)
    w = np.zeros((n, n))
    for i in range(n):
        for j in nb[i]:
            p = 1.0 / (n * len(nb[i]))
            e = np.zeros(n)
            e[i], e[j] = 1.0, -1.0
            w += p * 0.5 * np.outer(e, e)
    return np.eye(n) - w


def spectral_gap(nb: list[list[int]]) -> float:
    """``1 - lambda_2`` of :func:`mixing_matrix` (larger: faster consensus)."""
    ev = np.sort(np.linalg.eigvalsh(mixing_matrix(nb)))[::-1]
    return float(1.0 - ev[1])
