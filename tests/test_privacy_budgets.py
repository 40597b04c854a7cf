"""fedasync.privacy.budgets: per-client budgets, sample rates, calibration, histories (pure math)."""

from __future__ import annotations

import logging
import math
import warnings

import pytest
from opacus.accountants import create_accountant

from fedasync.config import PrivacyConfig, load_config
from fedasync.privacy.budgets import (
    Budget,
    PrivacyError,
    calibrate,
    central_epsilon,
    epsilon_of,
    extend_history,
    format_clients,
    group_plans,
    milestones,
    plan_clients,
    resolve_budgets,
    sample_rate_for,
)


def _fresh_eps(name: str, history, delta: float) -> float:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        acc = create_accountant(mechanism=name)
    acc.history = [tuple(h) for h in history]
    return acc.get_epsilon(delta)


def test_overrides_apply_in_order_field_by_field():
    p = PrivacyConfig.model_validate({
        "local_dp": {"enabled": True, "epsilon": 8.0, "delta": 1e-5, "planned_tasks": 20},
        "overrides": [
            {"clients": "0-4", "epsilon": 2.0},
            {"clients": "3,5", "delta": 1e-6, "planned_tasks": 5},
            {"clients": "4", "epsilon": 1.0, "noise_multiplier": 1.5},
        ],
    })
    b = resolve_budgets(p, 7)
    assert b[0] == Budget(epsilon=2.0, delta=1e-5, planned_tasks=20, noise_multiplier=None)
    assert b[3] == Budget(epsilon=2.0, delta=1e-6, planned_tasks=5, noise_multiplier=None)
    assert b[4] == Budget(epsilon=1.0, delta=1e-5, planned_tasks=20, noise_multiplier=1.5)
    assert b[5] == Budget(epsilon=8.0, delta=1e-6, planned_tasks=5, noise_multiplier=None)
    assert b[6] == Budget(epsilon=8.0, delta=1e-5, planned_tasks=20, noise_multiplier=None)


def test_override_outside_the_clients_is_a_clear_error():
    p = PrivacyConfig.model_validate({"local_dp": {"enabled": True, "epsilon": 8.0},
                                      "overrides": [{"clients": "5-12", "epsilon": 1.0}]})
    with pytest.raises(PrivacyError, match=r"^privacy.overrides.0.clients: '5-12' names a client outside 0-9"):
        resolve_budgets(p, 10)


def test_sample_rate_is_opacus_one_over_loader_length():
    from torch.utils.data import DataLoader

    for n, b in [(144, 16), (143, 32), (10, 16), (97, 8), (1, 4)]:
        expected = 1.0 / len(DataLoader(list(range(n)), batch_size=min(b, n)))
        assert sample_rate_for(n, b) == expected
    assert sample_rate_for(144, 16) == 1 / 9
    with pytest.raises(PrivacyError):
        sample_rate_for(0, 16)


def test_calibration_spends_the_budget_in_the_planned_tasks():
    accountant = "rdp"
    q, steps, tasks, eps, delta = 0.2, 10, 6, 3.0, 1e-5
    sigma = calibrate(eps, delta, q, steps * tasks, accountant)
    planned = _fresh_eps(accountant, [(sigma, q, steps * tasks)], delta)
    one_more = _fresh_eps(accountant, [(sigma, q, steps * (tasks + 1))], delta)
    assert eps - 0.011 <= planned <= eps  # Opacus' search tolerance is 0.01
    assert one_more > eps  # here one more task does not fit ...


def test_one_more_task_can_still_fit_when_a_task_costs_less_than_the_tolerance():
    # ... but that is not a property of the plan: 200 one-step tasks at q = 0.01 each cost
    # about 0.002, less than the 0.01 the calibration may leave unspent
    q, tasks, eps, delta = 0.01, 200, 2.0, 1e-5
    sigma = calibrate(eps, delta, q, tasks, "rdp")
    assert epsilon_of([(sigma, q, tasks)], delta, "rdp") <= eps
    assert epsilon_of([(sigma, q, tasks + 1)], delta, "rdp") <= eps


def test_gdp_never_calibrates_noise():
    with pytest.raises(PrivacyError, match=r"^privacy.local_dp.accountant: gdp .*can underestimate epsilon"):
        calibrate(3.0, 1e-5, 0.2, 60, "gdp")


def test_delta_at_least_one_over_n_is_warned_naming_the_clients_and_n():
    from fedasync.privacy.budgets import central_delta_warning, delta_warnings

    cfg = load_config(None, ["data.num_clients=6", "server.concurrency=2", "server.buffer_size=2",
                             "privacy.local_dp.enabled=true", "privacy.local_dp.noise_multiplier=1.0",
                             "privacy.local_dp.delta=1e-5", "privacy.overrides=[{clients: '2-4', delta: 0.01}]"])
    sizes = [300, 300, 80, 120, 300, 90]
    out = delta_warnings(plan_clients(cfg, sizes))
    # delta 0.01 >= 1/n once n >= 100: clients 3 and 4 of the override's 2-4; the others have delta 1e-5
    assert out == ["privacy: delta 0.01 >= 1/n for clients 3-4 (n = 120-300 records): (epsilon, delta)-DP with "
                   "delta >= 1/n allows publishing a record outright; choose delta well below 1/n"]
    assert delta_warnings(plan_clients(cfg, [99, 99, 99, 99, 99, 99])) == []
    assert "n = 10 clients" in central_delta_warning(0.1, 10)
    assert central_delta_warning(0.01, 10) is None


def test_calibration_failure_is_one_clear_line():
    with pytest.raises(PrivacyError, match="privacy.local_dp.epsilon: cannot calibrate noise"):
        calibrate(1e-4, 1e-5, 1.0, 10_000, "rdp")


def test_a_calibration_failure_names_the_override_that_set_the_budget():
    cfg = load_config(None, ["data.num_clients=4", "server.concurrency=4", "server.buffer_size=2",
                             "privacy.local_dp.enabled=true", "privacy.local_dp.epsilon=3",
                             "privacy.overrides=[{clients: '1', delta: 1e-6}, {clients: '0', epsilon: 0.0001}]"])
    with pytest.raises(PrivacyError, match=r"^privacy.overrides.1.epsilon: cannot calibrate noise"):
        plan_clients(cfg, [400, 400, 400, 400])


def test_extend_history_matches_what_the_opacus_accountant_records():
    h = extend_history([], 1.3, 0.1, 7, "rdp")
    assert h == [(1.3, 0.1, 7)]
    h = extend_history(h, 1.3, 0.1, 5, "rdp")  # same mechanism: Opacus merges the entries
    assert h == [(1.3, 0.1, 12)]
    h2 = extend_history(h, 0.9, 0.2, 3, "rdp")
    assert h2 == [(1.3, 0.1, 12), (0.9, 0.2, 3)]
    assert epsilon_of(h2, 1e-5, "rdp") == pytest.approx(_fresh_eps("rdp", h2, 1e-5), abs=1e-12)
    assert epsilon_of(h2, 1e-5, "rdp") > epsilon_of(h, 1e-5, "rdp") > 0
    assert epsilon_of([], 1e-5, "rdp") == 0.0
    with pytest.raises(PrivacyError, match="gdp"):
        extend_history([(1.3, 0.1, 4)], 0.9, 0.1, 1, "gdp")  # gdp refuses a changing sigma


def test_central_epsilon_is_an_opacus_accountant_over_releases():
    e = central_epsilon(1.1, 0.25, 30, 1e-5, "rdp")
    assert e == pytest.approx(_fresh_eps("rdp", [(1.1, 0.25, 30)], 1e-5), abs=1e-12)
    assert central_epsilon(1.1, 0.25, 31, 1e-5, "rdp") > e
    assert central_epsilon(1.1, 0.25, 0, 1e-5, "rdp") == 0.0
    assert math.isinf(central_epsilon(0.0, 0.25, 3, 1e-5, "rdp"))


def test_format_clients_and_milestones():
    assert format_clients([7, 0, 1, 2, 5, 8]) == "0-2,5,7-8"
    assert format_clients([3]) == "3"
    assert milestones(20) == [1, 10, 20]
    assert milestones(1) == [1]
    assert milestones(2) == [1, 2]


def test_plans_group_identical_clients_and_cover_each_once():
    cfg = load_config(None, ["data.num_clients=12", "server.concurrency=4", "server.buffer_size=4",
                             "privacy.local_dp.enabled=true", "privacy.local_dp.epsilon=4",
                             "privacy.local_dp.planned_tasks=3", "train.batch_size=32"])
    sizes = [100] * 6 + [40] * 5 + [20]
    plans = plan_clients(cfg, sizes)
    assert [p.sample_rate for p in plans] == [sample_rate_for(n, 32) for n in sizes]
    groups = group_plans(plans)
    assert [g.clients for g in groups] == [list(range(6)), list(range(6, 11)), [11]]
    for g in groups:  # every group's sigma spends at most its budget in the planned tasks
        assert g.plan.epsilon_after(3) <= 4.0
        assert g.plan.epsilon_after(4) > 4.0


def test_budget_view_says_what_the_client_would_refuse():
    """budget_aware's input: remaining epsilon and whether the next task fits, by the client's rule."""
    from fedasync.config import LocalDPConfig
    from fedasync.privacy.budgets import budget_view, plan_client

    dp = LocalDPConfig(enabled=True, epsilon=3.0, planned_tasks=4)
    plan = plan_client(0, 80, 10, 16, Budget(epsilon=3.0, delta=1e-5, planned_tasks=4, noise_multiplier=None), dp)
    hist, views = [], []
    for _ in range(5):
        views.append(budget_view(plan, hist))
        hist = extend_history(hist, plan.noise_multiplier, plan.sample_rate, plan.steps, plan.accountant)
    remaining = [r for r, _ in views]
    assert [ok for _, ok in views] == [True, True, True, True, False]  # calibrated for exactly 4 tasks
    assert remaining[0] == 3.0 and all(a > b for a, b in zip(remaining, remaining[1:]))
    assert remaining[4] == pytest.approx(3.0 - epsilon_of(plan.history_after(4), 1e-5, "rdp"))
    free = plan_client(0, 80, 10, 16, Budget(epsilon=None, delta=1e-5, planned_tasks=4, noise_multiplier=1.0), dp)
    assert budget_view(free, hist) == (None, True)


def test_rdp_epsilon_is_opacus_accountant_bit_for_bit():
    """epsilon_of's cached RDP path (one RDP vector per (sigma, q), times the steps) gives the
    same float as a fresh Opacus RDPAccountant, over mixed histories, empty steps, q = 1 and
    repeated (sigma, q) pairs (the cache hit)."""
    import random

    rng = random.Random(7)
    pairs = [(0.5, 1 / 38), (0.94, 1 / 38), (1.3, 0.1), (2.0, 1.0), (0.7, 1 / 3)]
    for _ in range(60):
        hist = [(*rng.choice(pairs), rng.randint(0, 400)) for _ in range(rng.randint(1, 4))]
        delta = rng.choice([1e-5, 1e-3])
        got = epsilon_of(hist, delta, "rdp")
        assert got == _fresh_eps("rdp", hist, delta), hist
    assert epsilon_of([(0.94, 1 / 38, 0)], 1e-5, "rdp") == _fresh_eps("rdp", [(0.94, 1 / 38, 0)], 1e-5)


def test_calibration_says_how_many_searches_it_runs(caplog):
    cfg = load_config(None, ["data.num_clients=4", "server.concurrency=2", "server.buffer_size=2",
                             "privacy.local_dp.enabled=true", "privacy.local_dp.epsilon=4",
                             "privacy.local_dp.planned_tasks=3", "train.batch_size=32"])
    with caplog.at_level(logging.INFO, logger="fedasync"):
        plan_clients(cfg, [100, 100, 40, 20])  # three sample rates: three searches
    assert [r.getMessage() for r in caplog.records] == [
        "privacy: calibrating the noise multiplier for 3 distinct (epsilon, delta, sample rate, steps)"]
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="fedasync"):
        plan_clients(cfg, [100, 100, 100, 100])  # one search: nothing to say
    assert caplog.records == []
