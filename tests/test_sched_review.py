"""Review of the pure algorithm modules (scheduler, clock, delay, staleness, idle): one test per bug."""

import json
import math

import numpy as np
import pytest

from fedasync.config import ClockConfig, ConfigError, load_config
from fedasync.server.clock import VirtualClock, make_profiles, task_duration
from fedasync.server.delay import dc_asgd
from fedasync.server.scheduler import StalenessAwareScheduler, make_scheduler
from fedasync.server.staleness import make_staleness_fn


def _staleness_aware_with_history():
    """Clients first reply in the order 2, 0, 1: summing their durations in that order or in
    client-id order gives results one ulp apart ((0.3 + 0.5) + 0.4 != (0.5 + 0.4) + 0.3)."""
    s = StalenessAwareScheduler(seed=1, balance=0.0)
    s.on_dispatch(0, 0.0, 0)
    s.on_dispatch(1, 3.0, 3)  # one version per second
    for c, d in [(2, 0.3), (0, 0.5), (1, 0.4)]:
        s.on_reply(c, d, 0)
    return s


def test_staleness_aware_state_round_trip_keeps_the_choices():
    """A resumed run must be bit-identical: the mean over all observed durations (the expected
    staleness of an untried client) summed the per-client sums in insertion order, but the state
    saved them sorted by client id, so after a resume it was a different float and the argmin
    (client 1's 0.4 against an untried client's global mean) could fall the other way."""
    s = _staleness_aware_with_history()
    t = StalenessAwareScheduler(seed=1, balance=0.0)
    t.load_state_dict(json.loads(json.dumps(s.state_dict())))
    idle = [1, 5, 6, 7]
    assert t.costs(idle) == s.costs(idle)
    assert [t.choose(idle) for _ in range(30)] == [s.choose(idle) for _ in range(30)]


class _CountingDict(dict):
    calls = 0

    def values(self):
        type(self).calls += 1
        return super().values()


def test_staleness_aware_choice_is_not_quadratic_in_the_clients():
    """``costs`` recomputed the mean over every observed client once per untried idle client:
    O(idle x tried) per choice (25 million additions at 10,000 clients with half of them tried), where
    the docs promise 10,000 clients are affordable. The mean is now computed once per choice, in
    the same order, so the choices are the same."""
    s = StalenessAwareScheduler(seed=0)
    s.on_dispatch(0, 0.0, 0)
    s.on_dispatch(1, 10.0, 20)
    for c in range(0, 400, 2):
        s.on_reply(c, 1.0 + c / 1000, 0)
    reference = StalenessAwareScheduler(seed=0)
    reference.load_state_dict(s.state_dict())
    s.dur_sum = _CountingDict(s.dur_sum)
    _CountingDict.calls = 0
    idle = list(range(400))
    cost = s.costs(idle)
    assert _CountingDict.calls <= 1
    assert cost == reference.costs(idle)
    assert [s.choose(idle) for _ in range(20)] == [reference.choose(idle) for _ in range(20)]


NON_FINITE_KEYS = [
    "server.staleness.a",  # exponential: S(0) = exp(-inf * 0) = NaN; polynomial, hinge: S = 0
    "server.scheduler.beta",  # fastest: inf * log(1) = NaN probabilities, the choice raised
    "server.scheduler.balance",  # staleness_aware: inf * 0 = NaN costs, no minimum, the choice raised
    "server.delay_compensation.lambda",  # dc_asgd: inf * 0 = NaN in every coordinate, even a fresh update
    "clock.sigma",  # speed exp(-inf) = 0: ZeroDivisionError at the first dispatch
    "clock.bandwidth_sigma",  # bandwidth 0: ZeroDivisionError
    "clock.jitter",  # durations inf (or 0): the virtual clock goes to inf, inf - inf = NaN durations
    "clock.step_time",  # every duration inf
    "clock.latency_s",  # every duration inf
    "clock.time_scale",  # emulate: time.sleep(inf) raises OverflowError
]


@pytest.mark.parametrize("key", NON_FINITE_KEYS)
@pytest.mark.parametrize("value", [".inf", "1e400"])
def test_infinite_values_are_refused_naming_the_key(key, value):
    """pydantic's ``ge=0``/``gt=0`` let ``inf`` through (NaN fails the comparison); each of these
    cannot work with ``inf``, so the config refuses it in one line naming the key."""
    with pytest.raises(ConfigError, match=rf"^{key}: "):
        load_config(overrides=[f"{key}={value}"])


def test_pure_constructors_refuse_non_finite_parameters():
    """The registries are public too: a NaN ``a`` or ``b`` passed ``a < 0 or b < 0`` and gave NaN
    weights; ``inf`` gave NaN where documented ``0 < S <= 1``."""
    for kw in ({"a": math.nan}, {"b": math.nan}, {"a": math.inf}):
        with pytest.raises(ValueError, match="staleness"):
            make_staleness_fn("exponential", **kw)
    assert make_staleness_fn("hinge", a=0.5, b=math.inf)(10**6) == 1.0  # b = inf works: never discounted
    for name, kw in (("fastest", {"beta": math.inf}), ("fastest", {"beta": math.nan}),
                     ("fastest", {"explore": math.nan}), ("staleness_aware", {"balance": math.inf}),
                     ("staleness_aware", {"balance": math.nan})):
        with pytest.raises(ValueError, match=name):
            make_scheduler(name, 0, **kw)
    x = {"w": np.ones(3, np.float32)}
    for lam in (math.inf, math.nan):
        with pytest.raises(ValueError, match="lambda"):
            dc_asgd(x, x, x, lam)


@pytest.mark.parametrize("key", ["clock.sigma", "clock.bandwidth_sigma"])
def test_a_spread_that_makes_a_profile_zero_or_infinite_is_refused(key):
    """A finite but huge log-normal spread (1000 here, on the quickstart's 100 clients) drew speeds
    or bandwidths of exactly 0: the first dispatch to such a client raised ZeroDivisionError.
    Refused when the config is loaded, naming the key."""
    with pytest.raises(ConfigError, match=rf"^{key}: "):
        load_config(overrides=[f"{key}=1000"])
    load_config(overrides=[f"{key}=3"])  # a wide but workable spread is still accepted
    load_config(overrides=["clock.bandwidth_mbps=.inf"])  # infinite bandwidth works: no transfer time


def test_a_non_finite_task_duration_is_an_error_naming_the_key():
    """A jitter whose factor overflows made a task last inf virtual seconds: the virtual clock
    went to inf and later durations were inf - inf = NaN. Now an error naming clock.jitter."""
    cfg = ClockConfig(jitter=1000.0)
    profile = make_profiles(1, cfg, 0)[0]
    with pytest.raises(ValueError, match="clock.jitter"):
        for task_id in range(20):
            task_duration(profile, 10, 1000, cfg, 0, task_id)


def test_the_virtual_clock_refuses_nan():
    """``advance_to(nan)`` passed ``t < now`` (False for NaN) and set the clock to NaN for good."""
    clock = VirtualClock()
    with pytest.raises(ValueError):
        clock.advance_to(math.nan)
    assert clock.now == 0.0


class _Crash(BaseException):
    """The process dying right after a commit (nothing in the loop may catch it)."""


def _flaky(params, config):
    from fedasync.clients.runner import handle_train

    if config["client_id"] in (2, 5) and config["task_id"] % 2 == 0:
        raise RuntimeError("flaky client")
    return handle_train(params, config)


def test_resume_after_a_failed_task_is_the_uninterrupted_run(tmp_path):
    """A task that ends with an error reply changes the scheduler's state (on_failure): its
    'failed' status is committed with the loop state, so a crash right after it resumes the run
    that was never interrupted (it was committed without, and the resumed run diverged)."""
    from conftest import small_config
    from fedasync.server.loop import AsyncServer
    from fedasync.server.transport import LocalTransport
    from fedasync.store import Store

    cfg = small_config("clock.sigma=1.5", "server.scheduler.name=staleness_aware")
    ref = AsyncServer(cfg, LocalTransport(_flaky), Store(f"sqlite:///{tmp_path / 'ref'}.db"), clock="virtual").run()
    store = Store(f"sqlite:///{tmp_path / 'crash'}.db")
    server = AsyncServer(cfg, LocalTransport(_flaky), store, clock="virtual")
    failed, commit, set_status = [], store._commit, store.set_dispatch_status

    def note_failure(run_id, task_id, status, *a, **k):
        if status == "failed":
            failed.append(task_id)
        return set_status(run_id, task_id, status, *a, **k)

    def crash_after_the_failure_is_committed(ops):
        commit(ops)
        if failed:
            raise _Crash()

    store.set_dispatch_status, store._commit = note_failure, crash_after_the_failure_is_committed
    with pytest.raises(_Crash):
        server.run()
    out = AsyncServer(cfg, LocalTransport(_flaky), Store(f"sqlite:///{tmp_path / 'crash'}.db"), clock="virtual",
                      resume_run_id=server.run_id).run()
    assert (out["model_sha256"], out["participation"]) == (ref["model_sha256"], ref["participation"])
