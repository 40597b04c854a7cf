import json

import numpy as np
import pytest

from fedasync.config import SchedulerConfig
from fedasync.server.scheduler import (
    SCHEDULERS,
    BudgetAwareScheduler,
    FairScheduler,
    FastestScheduler,
    StalenessAwareScheduler,
    UniformScheduler,
    make_scheduler,
    participation,
    scheduler_from_config,
)


def draws(s, n=50, idle=(0, 2, 3, 7, 9)):
    return [s.choose(list(idle)) for _ in range(n)]


def test_deterministic_for_seed():
    assert draws(UniformScheduler(3)) == draws(UniformScheduler(3))
    assert draws(UniformScheduler(3)) != draws(UniformScheduler(4))


def test_uniform_keeps_the_stream_of_every_earlier_run():
    """uniform draws ``idle[rng.integers(len(idle))]`` from ``default_rng(seed)``, whatever hooks are
    called: the model hashes pinned before the other policies existed hold."""
    for seed in (0, 1, 12345):
        s = make_scheduler("uniform", seed)
        rng = np.random.default_rng(seed)
        idle = list(range(100))
        for t in range(300):
            if len(idle) < 5:
                idle = list(range(100))
            expected = idle[int(rng.integers(len(idle)))]
            c = s.choose(idle)
            assert c == expected
            s.on_dispatch(c, float(t), t // 10)
            s.on_reply(c, 1.5, 3)
            s.observe_budget(c, 1.0, False)  # ignored by uniform
            assert s.eligible(idle) == idle
            idle.remove(c)
    assert UniformScheduler(5).state_dict().keys() == {"scheduler", "bit_generator"}


def test_choices_are_idle_and_roughly_uniform():
    s = make_scheduler("uniform", seed=0)
    out = draws(s, n=3000, idle=(4, 5, 6))
    assert set(out) == {4, 5, 6}
    assert all(800 < out.count(c) < 1200 for c in (4, 5, 6))
    assert s.choose([11]) == 11


@pytest.mark.parametrize("name", sorted(SCHEDULERS))
def test_empty_raises(name):
    with pytest.raises(ValueError):
        make_scheduler(name, 0).choose([])


def test_state_round_trip_continues_sequence():
    a = UniformScheduler(5)
    draws(a, 17)
    state = a.state_dict()
    expected = draws(a, 30)
    b = UniformScheduler(999)
    b.load_state_dict(state)
    assert draws(b, 30) == expected


def test_registry():
    assert SCHEDULERS == {"uniform": UniformScheduler, "fair": FairScheduler, "fastest": FastestScheduler,
                          "staleness_aware": StalenessAwareScheduler, "budget_aware": BudgetAwareScheduler}
    with pytest.raises(ValueError, match="unknown scheduler 'round_robin'; known: uniform, fair"):
        make_scheduler("round_robin", 0)
    with pytest.raises(ValueError, match="takes no parameter beta"):
        make_scheduler("fair", 0, beta=2.0)
    with pytest.raises(ValueError):
        make_scheduler("fastest", 0, explore=1.5)
    f = make_scheduler("fastest", 1, explore=0.3, beta=2.0)
    assert (f.explore, f.beta, f.seed) == (0.3, 2.0, 1)


def test_from_config_passes_only_the_policys_parameters():
    s = scheduler_from_config(SchedulerConfig(name="fastest", explore=0.2, beta=3.0, balance=9.0), seed=4)
    assert isinstance(s, FastestScheduler) and (s.explore, s.beta) == (0.2, 3.0)
    s = scheduler_from_config(SchedulerConfig(name="staleness_aware", balance=0.5), seed=4)
    assert isinstance(s, StalenessAwareScheduler) and s.balance == 0.5
    for name in SCHEDULERS:
        assert scheduler_from_config(SchedulerConfig(name=name), 0).name == name
    assert isinstance(scheduler_from_config(SchedulerConfig(), 0), UniformScheduler)


# -- a small simulated loop: the call sequence the server makes ------------------------------------


def simulate(sched, num_clients=30, concurrency=6, replies=600, sigma=1.5, seed=0):
    """Tasks in flight ``concurrency``; a reply is taken in order of finish time, then the freed slot
    is filled. Durations: per-client speed ~ log-normal(sigma), jitter 0.1. The scheduler sees only
    observed durations. A new version every third reply. Returns (dispatch counts, virtual time
    of the last reply, choices, mean staleness of the replies)."""
    rng = np.random.default_rng(seed)
    speed = np.exp(rng.normal(0.0, sigma, num_clients))
    inflight: list[tuple[float, int, float, int]] = []
    stale: list[int] = []
    busy: set[int] = set()
    counts = [0] * num_clients
    choices = []
    now, version = 0.0, 0

    def fill():
        idle = sched.eligible([c for c in range(num_clients) if c not in busy])
        while len(inflight) < concurrency and idle:
            c = sched.choose(idle)
            idle.remove(c)
            sched.on_dispatch(c, now, version)
            busy.add(c)
            counts[c] += 1
            choices.append(c)
            inflight.append((now + float(np.exp(rng.normal(0, 0.1))) / speed[c], c, now, version))
            inflight.sort()

    fill()
    for i in range(replies):
        finish, c, sent, base = inflight.pop(0)
        now = finish
        busy.discard(c)
        stale.append(version - base)
        sched.on_reply(c, now - sent, version - base)
        if i % 3 == 2:
            version += 1
        fill()
    return counts, now, choices, float(np.mean(stale))


def test_fair_every_client_once_per_num_clients_dispatches_when_all_are_idle():
    """Every choice made over all clients (e.g. concurrency = num_clients, each round's tasks all
    back before the next fill): each block of N consecutive dispatches is a permutation."""
    n = 12
    for name, must_hold in (("fair", True), ("uniform", False)):
        s = make_scheduler(name, 3)
        seq = []
        for _ in range(10 * n):
            c = s.choose(list(range(n)))
            s.on_dispatch(c, 0.0, 0)
            seq.append(c)
        blocks_ok = all(sorted(seq[i: i + n]) == list(range(n)) for i in range(0, len(seq), n))
        assert blocks_ok is must_hold, name


def test_fair_with_concurrency_equal_to_num_clients_dispatches_each_once_per_block():
    """concurrency = num_clients, all tasks of a round awaited before the slots are refilled."""
    n = 10
    s = make_scheduler("fair", 1)
    seq = []
    for _ in range(6):  # rounds
        idle = list(range(n))
        while idle:
            c = s.choose(idle)
            idle.remove(c)
            s.on_dispatch(c, 0.0, 0)
            seq.append(c)
        for c in range(n):
            s.on_reply(c, 1.0, 0)
    assert all(sorted(seq[i: i + n]) == list(range(n)) for i in range(0, len(seq), n))
    assert seq[:n] != seq[n: 2 * n]  # ties are broken by the seeded stream, not by id


def test_fair_balances_participation_under_heterogeneous_speeds():
    fair = simulate(make_scheduler("fair", 0))[0]
    unif = simulate(make_scheduler("uniform", 0))[0]
    jf, ju = participation(fair)["jain"], participation(unif)["jain"]
    assert min(fair) > 0 and jf >= 0.95 and jf > ju
    assert max(fair) - min(fair) <= max(unif) - min(unif)


def test_fastest_prefers_fast_clients_and_finishes_sooner():
    fast, t_fast, _, _ = simulate(make_scheduler("fastest", 0, explore=0.1, beta=1.0))
    unif, t_unif, _, _ = simulate(make_scheduler("uniform", 0))
    assert t_fast < t_unif  # the same number of replies in less virtual time
    assert min(fast) >= 1  # untried clients first: every client was tried
    rng = np.random.default_rng(0)  # simulate()'s speeds
    speed = np.exp(rng.normal(0.0, 1.5, 30))
    fastest5, slowest5 = np.argsort(-speed)[:5], np.argsort(speed)[:5]
    assert sum(fast[c] for c in fastest5) > sum(fast[c] for c in slowest5)


def test_fastest_untried_first_then_proportional_to_speed_power_beta():
    s = FastestScheduler(seed=7, explore=0.0, beta=1.0)
    assert s.choose([1, 2, 3]) in (1, 2, 3)
    s.on_reply(1, 1.0, 0)  # speed 1
    s.on_reply(2, 3.0, 0)  # speed 1/3
    assert s.choose([1, 2, 3]) == 3  # 3 was never tried
    s.on_reply(3, 1.0, 0)
    s.on_reply(3, 3.0, 0)  # mean 2 -> speed 1/2
    np.testing.assert_allclose(s.probabilities([1, 2, 3]), np.array([1, 1 / 3, 1 / 2]) / (11 / 6))
    out = [s.choose([1, 2]) for _ in range(4000)]
    assert abs(out.count(1) / 4000 - 0.75) < 0.03
    s2 = FastestScheduler(seed=7, explore=0.0, beta=2.0)
    for c, d in ((1, 1.0), (2, 3.0)):
        s2.on_reply(c, d, 0)
    np.testing.assert_allclose(s2.probabilities([1, 2]), [0.9, 0.1])
    s3 = FastestScheduler(seed=7, explore=1.0, beta=5.0)  # all exploration: uniform
    for c, d in ((1, 1.0), (2, 100.0)):
        s3.on_reply(c, d, 0)
    out = [s3.choose([1, 2]) for _ in range(4000)]
    assert abs(out.count(1) / 4000 - 0.5) < 0.03


def test_staleness_aware_formula():
    s = StalenessAwareScheduler(seed=0, balance=1.0)
    assert s.version_rate == 0.0 and s.costs([1, 2]) == [0.0, 0.0]
    s.on_dispatch(1, 0.0, 0)
    s.on_dispatch(2, 10.0, 20)  # r = 2 versions per second
    assert s.version_rate == 2.0
    s.on_reply(1, 1.0, 0)
    s.on_reply(2, 5.0, 0)
    assert s.expected_staleness(1) == 2.0 and s.expected_staleness(2) == 10.0
    assert s.expected_staleness(99) == 2.0 * 3.0  # untried: the mean of all durations (1 and 5)
    assert s.choose([1, 2]) == 1
    for _ in range(8):
        s.on_dispatch(1, 10.0, 20)  # 1 now has 9 dispatches, 2 has 1
    assert s.costs([1, 2]) == [2.0 + 8.0, 10.0]
    # a tie: the seeded stream decides; one more dispatch of 1 makes 2 the cheaper
    s.on_dispatch(1, 10.0, 20)
    assert s.costs([1, 2]) == [11.0, 10.0] and s.choose([1, 2]) == 2
    z = StalenessAwareScheduler(seed=0, balance=0.0)
    z.on_dispatch(1, 0.0, 0)
    z.on_dispatch(2, 10.0, 20)
    z.on_reply(1, 1.0, 0)
    z.on_reply(2, 5.0, 0)
    for _ in range(50):
        z.on_dispatch(1, 10.0, 20)
    assert z.choose([1, 2]) == 1  # balance 0: the expected freshest reply, always


def test_staleness_aware_trades_fresh_tasks_against_participation():
    """balance 1: participation stays balanced (Jain >= 0.95) and replies come faster than with
    fair; balance 0.2: faster than uniform. Every client takes part in both."""
    un = simulate(make_scheduler("uniform", 0), replies=900)
    fa = simulate(make_scheduler("fair", 0), replies=900)
    sa1 = simulate(make_scheduler("staleness_aware", 0, balance=1.0), replies=900)
    sa02 = simulate(make_scheduler("staleness_aware", 0, balance=0.2), replies=900)
    assert participation(sa1[0])["jain"] >= 0.95 and sa1[1] < fa[1]
    assert sa02[1] < un[1] and sa02[1] > simulate(make_scheduler("staleness_aware", 0, balance=0.0), replies=900)[1]
    assert min(sa1[0]) >= 1 and min(sa02[0]) >= 1
    # the mean staleness of the replies is about (C - 1) / K whatever the policy (see the docstring)
    for r in (un, fa, sa1, sa02):
        assert abs(r[3] - 5 / 3) < 0.15


def test_budget_aware_richest_affordable_and_never_an_unaffordable_one():
    s = BudgetAwareScheduler(seed=0)
    s.observe_budget(1, 2.0, True)
    s.observe_budget(2, 5.0, False)  # the most remaining, but its next task would not fit
    s.observe_budget(3, 4.0, True)
    s.observe_budget(4, 4.0, True)
    assert s.eligible([1, 2, 3, 4]) == [1, 3, 4]
    picks = []
    for _ in range(2):
        c = s.choose([1, 2, 3, 4])
        s.on_dispatch(c, 0.0, 0)
        picks.append(c)
    assert sorted(picks) == [3, 4]  # tie on epsilon: fewest dispatches, then the stream
    assert 2 not in [s.choose([1, 2]) for _ in range(20)]
    with pytest.raises(ValueError, match="afford"):
        s.choose([2])
    s.observe_budget(5, None, True)  # no budget: unlimited
    assert s.choose([1, 3, 5]) == 5


def test_budget_aware_without_budgets_is_fair():
    a, b = BudgetAwareScheduler(seed=11), FairScheduler(seed=11)
    assert simulate(a)[2] == simulate(b)[2]


# -- purity and state ----------------------------------------------------------------------------


PARAMS = {"fastest": {"explore": 0.2, "beta": 1.5}, "staleness_aware": {"balance": 0.7}}


def drive(s, steps, start=0):
    """A fixed call sequence with every hook; returns the choices."""
    out = []
    for t in range(start, start + steps):
        idle = [c for c in range(20) if (c + t) % 4 != 0]
        s.observe_budget(t % 20, 10.0 - (t % 7), t % 5 != 0)
        ok = s.eligible(idle)
        c = s.choose(ok)
        out.append(c)
        s.on_dispatch(c, 0.5 * t, t // 3)
        s.on_reply((c * 7 + t) % 20, 0.3 + (c % 5) * 0.7, t % 4)
    return out


@pytest.mark.parametrize("name", sorted(SCHEDULERS))
def test_every_policy_is_a_pure_function_of_seed_and_calls(name):
    p = PARAMS.get(name, {})
    a, b = make_scheduler(name, 42, **p), make_scheduler(name, 42, **p)
    assert drive(a, 200) == drive(b, 200)
    assert drive(make_scheduler(name, 42, **p), 200) != drive(make_scheduler(name, 43, **p), 200)


@pytest.mark.parametrize("name", sorted(SCHEDULERS))
def test_every_policy_survives_a_json_state_round_trip(name):
    p = PARAMS.get(name, {})
    a = make_scheduler(name, 8, **p)
    drive(a, 90)
    state = json.loads(json.dumps(a.state_dict()))  # the loop stores it as JSON
    expected = drive(a, 120, start=90)
    b = make_scheduler(name, 1234, **p)
    b.load_state_dict(state)
    assert drive(b, 120, start=90) == expected
    assert json.loads(json.dumps(b.state_dict())) == json.loads(json.dumps(a.state_dict()))


def test_load_state_of_another_policy_raises():
    with pytest.raises(ValueError, match="for scheduler 'fair'"):
        UniformScheduler(0).load_state_dict(FairScheduler(0).state_dict())


def test_participation_figures():
    p = participation([5, 5, 5, 5])
    assert p["jain"] == 1.0 and p["never"] == 0.0
    p = participation({0: 8}, num_clients=4)
    assert p["counts"] == [8, 0, 0, 0] and p["jain"] == 0.25 and p["never"] == 0.75
    assert participation([1, 3])["jain"] == pytest.approx(16 / (2 * 10))
    assert participation([0, 0, 0])["jain"] == 1.0


@pytest.mark.parametrize("name", ["fastest", "staleness_aware"])
def test_a_failure_counts_as_the_slowest_reply_so_far(name):
    # a client whose tasks only fail was "untried" for ever: fastest picked it first every time
    s = make_scheduler(name, 0)
    s.on_reply(1, 2.0, 0)
    s.on_reply(2, 5.0, 0)
    s.on_failure(3, 0.1)  # failed fast: counted as slow as the slowest mean (5.0)
    assert s.mean_duration(3) == 5.0
    s.on_failure(4, 9.0)  # a timeout longer than that: its own duration
    assert s.mean_duration(4) == 9.0


def test_fastest_stops_sending_to_a_client_whose_tasks_fail(tmp_path):
    from conftest import small_config
    from fedasync.clients.runner import handle_train
    from fedasync.server.loop import AsyncServer
    from fedasync.server.transport import LocalTransport
    from fedasync.store import Store

    def client(params, config):
        if config["client_id"] == 3:
            raise RuntimeError("device broken")
        return handle_train(params, config)

    store = Store(f"sqlite:///{tmp_path / 'f'}.db")
    s = AsyncServer(small_config("server.max_versions=30", "server.scheduler.name=fastest"), LocalTransport(client),
                    store, clock="virtual").run()
    to_broken = [d for d in store.dispatches(s["run_id"]) if d.client_id == 3]
    assert 1 <= len(to_broken) <= 3  # tried, then ranked last (before: about a quarter of all tasks)
