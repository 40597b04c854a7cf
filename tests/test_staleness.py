"""Staleness functions pinned to exact values (the definitions the docs quote)."""

import math

import pytest

from fedasync.config import StalenessConfig
from fedasync.server.staleness import STALENESS, make_staleness, make_staleness_fn


def test_registry_names():
    assert set(STALENESS) == {"constant", "polynomial", "hinge", "exponential", "adaptive"}


@pytest.mark.parametrize(
    "name,a,b,s,expected",
    [
        ("constant", 0.5, 4.0, 0, 1.0),
        ("constant", 0.5, 4.0, 100, 1.0),
        ("polynomial", 0.5, 4.0, 0, 1.0),
        ("polynomial", 0.5, 4.0, 3, 0.5),
        ("polynomial", 0.5, 4.0, 8, 1 / 3),
        ("polynomial", 1.0, 4.0, 1, 0.5),
        ("polynomial", 2.0, 4.0, 3, 1 / 16),
        ("hinge", 0.5, 4.0, 0, 1.0),
        ("hinge", 0.5, 4.0, 4, 1.0),
        ("hinge", 0.5, 4.0, 6, 0.5),
        ("hinge", 0.5, 4.0, 10, 0.25),
        ("hinge", 1.0, 0.0, 1, 0.5),
        ("exponential", 0.5, 4.0, 0, 1.0),
        ("exponential", 0.5, 4.0, 2, math.exp(-1.0)),
        ("exponential", math.log(2), 4.0, 3, 0.125),
    ],
)
def test_exact_values(name, a, b, s, expected):
    f = make_staleness_fn(name, a=a, b=b)
    assert f(s) == pytest.approx(expected, rel=1e-15, abs=0)
    assert isinstance(f(s), float)


@pytest.mark.parametrize("name", sorted(STALENESS))
def test_fresh_is_one_and_non_increasing(name):
    f = make_staleness_fn(name, a=0.7, b=2.0, concurrency=4)
    assert f(0) == 1.0
    vals = [f(s) for s in range(30)]
    assert all(0 < v <= 1 for v in vals)
    assert all(x >= y for x, y in zip(vals, vals[1:]))


@pytest.mark.parametrize("name", sorted(STALENESS))
def test_negative_or_fractional_staleness_raises(name):
    f = make_staleness_fn(name, concurrency=4)
    with pytest.raises(ValueError):
        f(-1)
    with pytest.raises(ValueError):
        f(1.5)


def test_from_config_and_name_forms():
    f = make_staleness(StalenessConfig(fn="hinge", a=0.5, b=4.0))
    assert f(10) == 0.25
    g = make_staleness("polynomial", a=0.5)
    assert g(3) == 0.5
    assert make_staleness(StalenessConfig())(3) == 0.5  # default: polynomial a=0.5


def test_unknown_name_and_bad_params():
    with pytest.raises(ValueError, match="unknown staleness"):
        make_staleness_fn("linear")
    with pytest.raises(ValueError):
        make_staleness_fn("polynomial", a=-1.0)


@pytest.mark.parametrize("c, s, expected", [
    (1, 0, 1.0), (1, 1, 0.5), (1, 3, 0.25),
    (4, 0, 1.0), (4, 3, 1.0), (4, 4, 0.8), (4, 7, 0.5), (4, 15, 0.25),
    (20, 19, 1.0), (20, 39, 0.5),
])
def test_adaptive_exact(c, s, expected):
    """min(1, C / tau), tau = s + 1: full weight while the delay is within the tasks in flight."""
    f = make_staleness_fn("adaptive", concurrency=c)
    assert f(s) == pytest.approx(expected, rel=1e-15, abs=0)
    # a and b do not matter
    assert make_staleness_fn("adaptive", a=3.0, b=9.0, concurrency=c)(s) == f(s)


def test_adaptive_needs_concurrency_and_takes_it_from_config():
    with pytest.raises(ValueError, match="needs concurrency"):
        make_staleness_fn("adaptive")
    with pytest.raises(ValueError, match="needs concurrency"):
        make_staleness_fn("adaptive", concurrency=0)
    with pytest.raises(ValueError, match="needs concurrency"):
        make_staleness(StalenessConfig(fn="adaptive"))
    f = make_staleness(StalenessConfig(fn="adaptive"), concurrency=20)
    assert f(39) == 0.5 and "C=20" in repr(f)
    # the others ignore it
    assert make_staleness(StalenessConfig(), concurrency=20)(3) == 0.5


def test_strategies_bind_server_concurrency():
    from fedasync.config import ServerConfig
    from fedasync.server.strategies import make_strategy

    for strategy in ("fedasync", "fedbuff"):
        s = make_strategy(ServerConfig(strategy=strategy, concurrency=5, staleness=StalenessConfig(fn="adaptive")),
                          "uniform")
        assert s.staleness_fn(4) == 1.0 and s.staleness_fn(9) == 0.5
