import time

import pytest

from fedasync.config import ClockConfig
from fedasync.server.clock import ClientProfile, VirtualClock, WallClock, make_profiles, task_duration


def test_profiles_deterministic_for_seed():
    cfg = ClockConfig()
    a, b = make_profiles(20, cfg, seed=1), make_profiles(20, cfg, seed=1)
    assert a == b
    assert a != make_profiles(20, cfg, seed=2)
    assert [p.client_id for p in a] == list(range(20))
    assert len({p.speed for p in a}) == 20  # sigma > 0: heterogeneous


def test_sigma_zero_all_equal_and_exact_duration():
    cfg = ClockConfig(sigma=0.0, jitter=0.0, bandwidth_sigma=0.0, bandwidth_mbps=20.0, latency_s=0.05, step_time=0.05)
    profiles = make_profiles(10, cfg, seed=7)
    assert {(p.speed, p.bandwidth_bps, p.latency_s) for p in profiles} == {(1.0, 20e6, 0.05)}
    durations = {task_duration(p, 10, 1_000_000, cfg, seed=7, task_id=t) for p in profiles for t in range(5)}
    assert len(durations) == 1
    # 2*0.05 + 2*1e6*8/20e6 + 10*0.05/1 = 0.1 + 0.8 + 0.5
    assert durations.pop() == pytest.approx(1.4, rel=1e-12)


def test_duration_pure_function_of_args():
    cfg = ClockConfig(jitter=0.3)
    p = make_profiles(3, cfg, seed=0)[1]
    d = task_duration(p, 20, 50_000, cfg, seed=0, task_id=12)
    assert d == task_duration(p, 20, 50_000, cfg, seed=0, task_id=12)
    assert d != task_duration(p, 20, 50_000, cfg, seed=0, task_id=13)
    assert d != task_duration(p, 20, 50_000, cfg, seed=1, task_id=12)
    assert d > 2 * p.latency_s


def test_slower_client_takes_longer():
    cfg = ClockConfig(jitter=0.0)
    fast = ClientProfile(0, speed=2.0, bandwidth_bps=1e7, latency_s=0.0)
    slow = ClientProfile(0, speed=0.5, bandwidth_bps=1e7, latency_s=0.0)
    assert task_duration(slow, 10, 0, cfg, 0, 0) == pytest.approx(4 * task_duration(fast, 10, 0, cfg, 0, 0))


def test_virtual_clock():
    c = VirtualClock()
    assert c.now == 0.0
    c.advance_to(2.5)
    c.advance_to(2.5)
    assert c.now == 2.5
    with pytest.raises(ValueError):
        c.advance_to(1.0)
    d = VirtualClock()
    d.load_state_dict(c.state_dict())
    assert d.now == 2.5


def test_wall_clock():
    c = WallClock()
    t0 = c.now
    assert 0.0 <= t0 < 1.0
    time.sleep(0.01)
    assert c.now > t0
    assert WallClock(offset=100.0).now >= 100.0
