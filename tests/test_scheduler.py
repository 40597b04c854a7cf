import pytest

from fedasync.server.scheduler import SCHEDULERS, UniformScheduler, make_scheduler


def draws(s, n=50, idle=(0, 2, 3, 7, 9)):
    return [s.choose(list(idle)) for _ in range(n)]


def test_deterministic_for_seed():
    assert draws(UniformScheduler(3)) == draws(UniformScheduler(3))
    assert draws(UniformScheduler(3)) != draws(UniformScheduler(4))


def test_choices_are_idle_and_roughly_uniform():
    s = make_scheduler("uniform", seed=0)
    out = draws(s, n=3000, idle=(4, 5, 6))
    assert set(out) == {4, 5, 6}
    assert all(800 < out.count(c) < 1200 for c in (4, 5, 6))
    assert s.choose([11]) == 11


def test_empty_raises():
    with pytest.raises(ValueError):
        UniformScheduler(0).choose([])


def test_state_round_trip_continues_sequence():
    a = UniformScheduler(5)
    draws(a, 17)
    state = a.state_dict()
    expected = draws(a, 30)
    b = UniformScheduler(999)
    b.load_state_dict(state)
    assert draws(b, 30) == expected


def test_registry():
    assert SCHEDULERS == {"uniform": UniformScheduler}
    with pytest.raises(ValueError):
        make_scheduler("round_robin", 0)
