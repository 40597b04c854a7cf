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


# -- bit-identity with the plain-Python policies ------------------------------------------------
# The policies' choices were once computed by O(idle) Python passes; they are now vectorised.
# ``_Ref*`` below are those Python implementations, copied as they were (state in dicts, the same
# Generator calls): the vectorised policies must pick exactly the same clients, raise where they
# raised, and keep the same (JSON) state, including across a save/load and from a state the
# Python implementation saved.

import math  # noqa: E402


class _Ref:
    name = ""

    def __init__(self, seed=0):
        self.rng = np.random.default_rng(seed)

    def eligible(self, idle):
        return list(idle)

    def on_dispatch(self, client, now, version):
        pass

    def on_reply(self, client, duration, staleness):
        pass

    def on_failure(self, client, duration):
        pass

    def observe_budget(self, client, remaining, can_afford):
        pass

    @staticmethod
    def _check(idle):
        if len(idle) == 0:
            raise ValueError("no idle client to choose from")

    def _pick(self, candidates):
        if len(candidates) == 1:
            return int(candidates[0])
        return int(candidates[int(self.rng.integers(len(candidates)))])

    def state_dict(self):
        return {"scheduler": self.name, "bit_generator": self.rng.bit_generator.state}


def _pairs(d):
    return [[int(k), v] for k, v in sorted(d.items())]


class _RefFair(_Ref):
    name = "fair"

    def __init__(self, seed=0):
        super().__init__(seed)
        self.dispatches = {}

    def on_dispatch(self, client, now, version):
        self.dispatches[int(client)] = self.dispatches.get(int(client), 0) + 1

    def _fewest(self, idle):
        least = min(self.dispatches.get(int(c), 0) for c in idle)
        return [int(c) for c in idle if self.dispatches.get(int(c), 0) == least]

    def choose(self, idle):
        self._check(idle)
        return self._pick(self._fewest(idle))

    def state_dict(self):
        return {**super().state_dict(), "dispatches": _pairs(self.dispatches)}


class _RefDurations(_Ref):
    def __init__(self, seed=0):
        super().__init__(seed)
        self.dur_sum, self.dur_n = {}, {}

    def _observe_duration(self, client, duration):
        d = float(duration)
        if not math.isfinite(d) or d < 0:
            return
        c = int(client)
        self.dur_sum[c] = self.dur_sum.get(c, 0.0) + d
        self.dur_n[c] = self.dur_n.get(c, 0) + 1

    def on_reply(self, client, duration, staleness):
        self._observe_duration(client, duration)

    def on_failure(self, client, duration):
        slowest = max((self.mean_duration(c) for c in self.dur_n), default=0.0)
        self._observe_duration(client, max(float(duration), slowest))

    def mean_duration(self, client):
        n = self.dur_n.get(int(client), 0)
        return self.dur_sum[int(client)] / n if n else None

    def state_dict(self):
        return {**super().state_dict(), "dur_sum": [[int(k), v] for k, v in self.dur_sum.items()],
                "dur_n": [[int(k), v] for k, v in self.dur_n.items()]}


class _RefFastest(_RefDurations):
    name = "fastest"

    def __init__(self, seed=0, explore=0.1, beta=1.0):
        super().__init__(seed)
        self.explore, self.beta = explore, beta

    def probabilities(self, tried):
        means = np.array([self.mean_duration(c) for c in tried], dtype=np.float64)
        logw = self.beta * np.log(1.0 / np.maximum(means, 1e-12))
        w = np.exp(logw - logw.max())
        return w / w.sum()

    def choose(self, idle):
        self._check(idle)
        untried = [int(c) for c in idle if self.dur_n.get(int(c), 0) == 0]
        if untried:
            return self._pick(untried)
        if self.explore > 0 and float(self.rng.random()) < self.explore:
            return self._pick(idle)
        tried = [int(c) for c in idle]
        return tried[int(self.rng.choice(len(tried), p=self.probabilities(tried)))]


class _RefStaleness(_RefDurations):
    name = "staleness_aware"

    def __init__(self, seed=0, balance=1.0):
        super().__init__(seed)
        self.balance, self.dispatches, self.first, self.last = balance, {}, None, None

    def on_dispatch(self, client, now, version):
        self.dispatches[int(client)] = self.dispatches.get(int(client), 0) + 1
        point = [float(now), float(version)]
        if self.first is None:
            self.first = point
        self.last = point

    @property
    def version_rate(self):
        if self.first is None or self.last is None or self.last[0] <= self.first[0]:
            return 0.0
        return (self.last[1] - self.first[1]) / (self.last[0] - self.first[0])

    def costs(self, idle):
        least = min(self.dispatches.get(int(c), 0) for c in idle)
        total_n = sum(self.dur_n.values())
        everyone = sum(self.dur_sum.values()) / total_n if total_n else 0.0
        out = []
        for c in idle:
            d = self.mean_duration(c)
            out.append(self.version_rate * (everyone if d is None else d)
                       + self.balance * (self.dispatches.get(int(c), 0) - least))
        return out

    def choose(self, idle):
        self._check(idle)
        cost = self.costs(idle)
        best = min(cost)
        return self._pick([int(c) for c, k in zip(idle, cost) if k == best])

    def state_dict(self):
        return {**super().state_dict(), "dispatches": _pairs(self.dispatches), "first": self.first, "last": self.last}


class _RefBudget(_RefFair):
    name = "budget_aware"

    def __init__(self, seed=0):
        super().__init__(seed)
        self.remaining, self.affordable = {}, {}

    def observe_budget(self, client, remaining, can_afford):
        self.remaining[int(client)] = None if remaining is None else float(remaining)
        self.affordable[int(client)] = bool(can_afford)

    def eligible(self, idle):
        return [int(c) for c in idle if self.affordable.get(int(c), True)]

    def _room(self, c):
        r = self.remaining.get(int(c))
        return math.inf if r is None else r

    def choose(self, idle):
        self._check(idle)
        ok = self.eligible(idle)
        if not ok:
            raise ValueError("budget_aware: no idle client can afford another task")
        most = max(self._room(c) for c in ok)
        return self._pick(self._fewest([c for c in ok if self._room(c) == most]))

    def state_dict(self):
        return {**super().state_dict(), "remaining": _pairs(self.remaining), "affordable": _pairs(self.affordable)}


_REFS = {"fair": (_RefFair, {}), "fastest": (_RefFastest, {"explore": 0.2, "beta": 1.7}),
         "staleness_aware": (_RefStaleness, {"balance": 0.3}), "budget_aware": (_RefBudget, {})}


def _outcome(f):
    try:
        return f()
    except Exception as e:  # noqa: BLE001 -- the same exception type, where the reference raised
        return type(e)


def _reload(s, state):
    t = make_scheduler(s.name, 12345, **{"fastest": {"explore": 0.2, "beta": 1.7},
                                         "staleness_aware": {"balance": 0.3}}.get(s.name, {}))
    t.load_state_dict(json.loads(json.dumps(state)))
    return t


@pytest.mark.parametrize("name", sorted(_REFS))
@pytest.mark.parametrize("seed", [0, 1, 2, 3])
def test_choices_are_bit_identical_to_the_python_reference(name, seed):
    ref_cls, kw = _REFS[name]
    ref, new = ref_cls(seed, **kw), make_scheduler(name, seed, **kw)
    rng = np.random.default_rng(1000 + seed)
    n = 40 + 30 * seed  # clients join as the run goes
    busy, exhausted, now, version, choices = set(), set(), 0.0, 0, 0
    durations = [0.25, 0.5, 1.0, 3.0]  # repeated values: equal means, equal costs, ties
    for step in range(3000):
        op = rng.random()
        if op < 0.01:
            n += int(rng.integers(1, 20))
        elif op < 0.02 and n > 5:
            exhausted.add(int(rng.integers(n)))
        if op < 0.45:
            idle = [c for c in range(n) if c not in busy and c not in exhausted]
            if rng.random() < 0.5 and idle:  # a sub-list, sometimes of numpy ints, as a caller may pass
                idle = sorted(rng.choice(idle, int(rng.integers(1, len(idle) + 1)), replace=False).tolist())
                idle = [np.int64(c) for c in idle] if rng.random() < 0.3 else idle
            assert new.eligible(idle) == ref.eligible(idle)
            ok = ref.eligible(idle)
            if rng.random() < 0.05:
                ok = idle  # budget_aware's choose must refuse the unaffordable ones itself
            got = _outcome(lambda: new.choose(ok))
            assert got == _outcome(lambda: ref.choose(ok)), (step, got)
            choices += 1
            if isinstance(got, int):
                assert type(got) is int
                now += float(rng.exponential(0.7)) if rng.random() < 0.9 else 0.0
                version += int(rng.random() < 0.3)
                for s in (new, ref):
                    s.on_dispatch(got, now, version)
                busy.add(got)
        elif op < 0.75 and busy:
            c = sorted(busy)[int(rng.integers(len(busy)))]
            busy.discard(c)
            u = rng.random()
            d = (durations[int(rng.integers(4))] if u < 0.4 else float(rng.lognormal(0, 1)) if u < 0.9
                 else [0.0, -1.0, math.nan, math.inf, 1e-300][int(rng.integers(5))])
            fail = rng.random() < 0.15
            for s in (new, ref):
                s.on_failure(c, d) if fail else s.on_reply(c, d, 1)
        elif op < 0.9:
            c = int(rng.integers(n + 3))
            u = rng.random()
            remaining = None if u < 0.15 else [0.0, 1.0, 2.5][int(rng.integers(3))] if u < 0.5 else \
                math.nan if u < 0.52 else float(rng.uniform(0, 5))
            afford = bool(rng.random() < 0.85)
            for s in (new, ref):
                s.observe_budget(c, remaining, afford)
        if name == "staleness_aware" and step % 97 == 0:
            idle = [c for c in range(n) if c not in busy]
            assert _outcome(lambda: new.costs(idle)) == _outcome(lambda: ref.costs(idle))
        if name == "fastest" and step % 97 == 0:
            tried = [c for c in range(n) if c in ref.dur_n]
            if tried:
                assert new.probabilities(tried).tobytes() == ref.probabilities(tried).tobytes()
        if step % 500 == 250:  # save and load, from the new state and from the reference's
            state = json.loads(json.dumps(new.state_dict()))
            assert state == json.loads(json.dumps(ref.state_dict()))
            new = _reload(new, ref.state_dict() if step % 1000 == 250 else state)
    assert json.loads(json.dumps(new.state_dict())) == json.loads(json.dumps(ref.state_dict()))
    assert choices > 1000


@pytest.mark.parametrize("name", sorted(_REFS))
def test_nan_costs_and_odd_client_ids_match_the_python_reference(name):
    """Python's min/max with a NaN (the first element decides) and ids that are no array index
    (negative, huge): the same choices, raises and state as the plain-Python version."""
    ref_cls, kw = _REFS[name]
    ref, new = ref_cls(7, **kw), make_scheduler(name, 7, **kw)
    for s in (ref, new):
        s.on_dispatch(0, 0.0, 0)
        s.on_dispatch(1, 5e-324, 10)  # a version rate of inf: inf * 0 = NaN costs
        s.on_reply(0, 0.0, 0)
        s.on_reply(1, 2.0, 0)
        s.observe_budget(0, math.nan, True)
        s.observe_budget(2, 1.0, True)
    for idle in ([0, 1, 2], [1, 2, 0], [2, 0], [1, 2]):
        for _ in range(5):
            assert _outcome(lambda: new.choose(idle)) == _outcome(lambda: ref.choose(idle))
    for s in (ref, new):
        s.on_dispatch(-5, 1.0, 11)
        s.on_reply(-5, 0.5, 0)
        s.observe_budget(2**40, 3.0, True)
        s.on_failure(2**40, 0.1)
    for idle in ([-5, 1, 2], [1, 2, 2**40], [3, 4, 2**70], [-5, 3]):
        assert new.eligible(idle) == ref.eligible(idle)
        for _ in range(5):
            assert _outcome(lambda: new.choose(idle)) == _outcome(lambda: ref.choose(idle))
    assert json.loads(json.dumps(_reload(new, new.state_dict()).state_dict())) == \
        json.loads(json.dumps(ref.state_dict()))
