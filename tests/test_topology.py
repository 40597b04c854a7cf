"""Gossip topologies: pure neighbour sets."""

import numpy as np
import pytest

from fedasync.serverless.topology import (
    TOPOLOGIES,
    is_connected,
    mixing_matrix,
    neighbours,
    spectral_gap,
    torus_shape,
)


@pytest.mark.parametrize("name", TOPOLOGIES)
@pytest.mark.parametrize("n", [2, 3, 5, 8, 12, 16, 17])
def test_every_topology_is_undirected_loop_free_and_connected(name, n):
    nb = neighbours(name, n, seed=3, degree=min(2, n - 1))
    assert len(nb) == n
    for i, row in enumerate(nb):
        assert row == sorted(set(row)), "sorted, no duplicates"
        assert i not in row and row, "no self loop, at least one neighbour"
        assert all(0 <= j < n for j in row)
        for j in row:
            assert i in nb[j], f"{name}: edge {i}-{j} is one-way"
    assert is_connected(nb)


def test_ring_torus_exponential_complete_have_the_documented_neighbours():
    assert neighbours("ring", 16)[0] == [1, 15]
    assert neighbours("ring", 16)[7] == [6, 8]
    assert torus_shape(16) == (4, 4) and torus_shape(12) == (3, 4) and torus_shape(7) == (1, 7)
    # 4 x 4 torus: up, down, left, right with wrap-around
    assert neighbours("torus", 16)[0] == [1, 3, 4, 12]
    assert neighbours("torus", 16)[5] == [1, 4, 6, 9]
    # exponential: i +- 2^k, k = 0..floor(log2(n-1)) = 0..3 for n = 16
    assert neighbours("exponential", 16)[0] == [1, 2, 4, 8, 12, 14, 15]
    assert neighbours("exponential", 16)[3] == sorted({4, 5, 7, 11, 2, 1, 15})
    assert neighbours("complete", 5)[2] == [0, 1, 3, 4]


def test_random_k_is_seeded_and_has_at_least_k_neighbours():
    a = neighbours("random-k", 20, seed=1, degree=3)
    assert a == neighbours("random-k", 20, seed=1, degree=3)
    assert a != neighbours("random-k", 20, seed=2, degree=3)
    assert min(len(r) for r in a) >= 3
    # k out-neighbours each, made undirected: 20 * 3 draws give between 30 and 60 edges
    edges = sum(len(r) for r in a) // 2
    assert 30 <= edges <= 60


def test_bad_topologies_fail_clearly():
    with pytest.raises(ValueError, match="unknown topology 'star'"):
        neighbours("star", 4)
    with pytest.raises(ValueError, match="at least 2 peers"):
        neighbours("ring", 1)
    with pytest.raises(ValueError, match="degree must be in 1..3"):
        neighbours("random-k", 4, degree=4)


def test_mixing_matrix_is_doubly_stochastic_and_gaps_order_the_topologies():
    for name in TOPOLOGIES:
        w = mixing_matrix(neighbours(name, 16, degree=3))
        assert np.allclose(w, w.T)
        assert np.allclose(w.sum(axis=0), 1) and np.allclose(w.sum(axis=1), 1)
    gap = {name: spectral_gap(neighbours(name, 16)) for name in ("ring", "torus", "exponential", "complete")}
    assert gap["complete"] > gap["exponential"] > gap["torus"] > gap["ring"] > 0
