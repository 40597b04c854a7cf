"""Byzantine filters and robust aggregators on hand-made vectors."""

import json
import math

import numpy as np
import pytest

from fedasync.config import RobustConfig, ServerConfig
from fedasync.server.robust import (
    AGGREGATORS,
    Kardam,
    NormFilter,
    Verdict,
    ZenoPlusPlus,
    aggregate,
    centered_clip,
    flat,
    make_filter,
    pseudo_gradient,
    trimmed_mean,
    unflat,
    validation_split,
)
from fedasync.server.strategies import FedBuff, Update, make_strategy, params_sha256
from fedasync.server.staleness import make_staleness_fn

CONST = make_staleness_fn("constant")


def P(*values):
    return {"w": np.asarray(values, dtype=np.float32)}


def upd(client, base, delta, base_version=0, staleness=0, task_id=0):
    """An update whose Δ = x_client - x_base is ``delta`` (so g = -delta)."""
    base = P(*base) if not isinstance(base, dict) else base
    params = {"w": (base["w"].astype(np.float64) + np.asarray(delta, np.float64)).astype(np.float32)}
    return Update(task_id, client, params, base, base_version, staleness, 10)


# -- zeno++ ------------------------------------------------------------------------------------


def test_zeno_score_and_decision_unnormalized():
    z = ZenoPlusPlus(gamma=1.0, rho=0.5, epsilon=0.3)
    z.set_validation_gradient(P(1.0, 0.0), version=0)
    # Δ = [-1, 0] -> g = [1, 0]: 1*<v,g> - 0.5*|g|^2 = 1 - 0.5 = 0.5 >= -0.3: accepted
    v = z.check(upd(0, [0, 0], [-1, 0]))
    assert v.accepted and v.score == pytest.approx(0.5) and v.threshold == pytest.approx(-0.3)
    # the same direction, 10x: 10 - 50 = -40: rejected (the magnitude term)
    v = z.check(upd(0, [0, 0], [-10, 0]))
    assert v.reason == "zeno" and v.score == pytest.approx(-40.0)
    # sign flipped: g = [-1, 0]: -1 - 0.5 = -1.5: rejected
    assert z.check(upd(0, [0, 0], [1, 0])).reason == "zeno"
    # orthogonal and small: g = [0, 0.5]: 0 - 0.125 >= -0.3: accepted
    assert z.check(upd(0, [0, 0], [0, -0.5])).accepted
    # a zero update is harmless: score 0
    assert z.check(upd(0, [3, 3], [0, 0])).accepted


def test_zeno_normalized_is_a_direction_test():
    z = ZenoPlusPlus(gamma=1.0, rho=0.001, epsilon=0.0, normalize=True)
    z.set_validation_gradient(P(2.0, 0.0), version=0)
    # g~ = (|v|/|g|) g: any positive multiple of v scores gamma|v|^2 - rho|v|^2 = 4 * 0.999
    for scale in (0.01, 1.0, 100.0):
        v = z.check(upd(0, [0, 0], [-scale, 0]))
        assert v.accepted and v.score == pytest.approx(4 * 0.999)
    assert z.check(upd(0, [0, 0], [0, -1])).reason == "zeno"  # orthogonal: -rho|v|^2 < 0
    assert z.check(upd(0, [0, 0], [5, 0])).reason == "zeno"


def test_zeno_needs_v_and_refreshes_lazily():
    z = ZenoPlusPlus(refresh=3)
    assert z.needs_refresh(0)
    with pytest.raises(RuntimeError, match="validation gradient"):
        z.check(upd(0, [0, 0], [1, 1]))
    z.set_validation_gradient(P(1.0, 1.0), version=4)
    assert [z.needs_refresh(v) for v in (4, 5, 6, 7, 9)] == [False, False, False, True, True]
    with pytest.raises(ValueError, match="values"):
        z.check(upd(0, [0, 0, 0], [1, 1, 1]))


# -- kardam ------------------------------------------------------------------------------------


def lipschitz_update(client, x, L, base_version):
    """An update at base model ``[x]`` with pseudo-gradient ``g = L * x``: its coefficient against the
    client's previous one (same L) is exactly L."""
    return upd(client, [x], [-L * x], base_version=base_version)


def test_kardam_rejects_coefficients_above_the_quantile():
    k = Kardam(byzantine_fraction=0.2, window=10, warmup=5)
    # clients 0..4 honest with L = 1..5, first updates: no coefficient, all accepted
    for c in range(5):
        v = k.check(lipschitz_update(c, 1.0, c + 1, 0))
        assert v.accepted and v.score is None
    # second updates at x = 3 (version 1): coefficients 1..5, still warming up (fewer than 5 before each)
    for c in range(5):
        v = k.check(lipschitz_update(c, 3.0, c + 1, 1))
        assert v.accepted and v.score == pytest.approx(c + 1)
    assert k.coefficients == pytest.approx([1, 2, 3, 4, 5])
    assert k.threshold() == pytest.approx(np.quantile([1, 2, 3, 4, 5], 0.8))  # 4.2
    # an attacker whose gradients jump 10x as much is rejected; the honest L=4 is not
    # (a version is one model: version 0 is x = 1, version 1 is x = 3, version 2 is x = 5)
    assert k.check(lipschitz_update(9, 1.0, 10.0, 0)).accepted  # client 9's first: no coefficient
    v = k.check(lipschitz_update(9, 3.0, 10.0, 1))
    assert v.reason == "kardam" and v.score == pytest.approx(10.0) and v.threshold == pytest.approx(4.2)
    v = k.check(lipschitz_update(3, 5.0, 4, 2))
    assert v.accepted and v.score == pytest.approx(4.0)
    # the window keeps the last 10 coefficients, rejected ones included
    assert k.coefficients[-2:] == pytest.approx([10.0, 4.0]) and len(k.coefficients) == 7


def test_kardam_same_base_model_and_dampening():
    k = Kardam(byzantine_fraction=0.0, window=5, warmup=1, dampening=0.5)
    assert k.check(lipschitz_update(0, 2.0, 1, 3)).accepted
    v = k.check(lipschitz_update(0, 2.0, 7, 3))  # trained from the same model: no coefficient
    assert v.accepted and v.score is None and k.coefficients == []
    u = upd(0, [5.0], [-3.0], base_version=4, staleness=2)
    v = k.check(u)
    assert v.accepted and v.scale == pytest.approx(math.exp(-1.0))
    out = v.apply(u)  # x_base + scale * Δ
    np.testing.assert_allclose(out["w"], [5.0 - 3.0 * math.exp(-1.0)], rtol=1e-6)
    assert out["w"].dtype == np.float32
    # only the versions the clients' previous updates refer to are kept
    assert set(k.models) == {4}


def test_kardam_keeps_models_dtype_and_scores_in_float64():
    """What kardam remembers of each client (its returned model, and the base model) is kept in
    the model's own dtype, not float64 (half the memory: 6.7 MB a client for fedavg_cnn), while the
    coefficient is still ``||g - g_prev|| / ||x - x_prev||`` computed in float64, exactly."""
    rng = np.random.default_rng(0)
    x0, x1 = ({"w": rng.standard_normal(50).astype(np.float32)} for _ in range(2))
    y0 = {"w": (x0["w"] + rng.standard_normal(50).astype(np.float32))}
    y1 = {"w": (x1["w"] + 3 * rng.standard_normal(50).astype(np.float32))}
    k = Kardam(byzantine_fraction=0.0, window=5, warmup=1)
    k.check(Update(0, 7, y0, x0, 0, 0, 10))
    v = k.check(Update(1, 7, y1, x1, 1, 0, 10))
    f64 = {n: {"w": a["w"].astype(np.float64)} for n, a in (("x0", x0), ("x1", x1), ("y0", y0), ("y1", y1))}
    g0, g1 = f64["x0"]["w"] - f64["y0"]["w"], f64["x1"]["w"] - f64["y1"]["w"]
    assert v.score == float(np.linalg.norm(g1 - g0)) / float(np.linalg.norm(f64["x1"]["w"] - f64["x0"]["w"]))
    assert [a.dtype for a in (k.prev[7][0], *k.models.values())] == [np.float32, np.float32]
    assert k.prev[7][0].nbytes == 50 * 4 and set(k.models) == {1}


def test_pseudo_gradient_is_base_minus_update_in_float64_and_refuses_a_size_mismatch():
    base = {"a": np.array([1.0, 2.0], np.float32), "b": np.array([[0.5]], np.float32)}
    u = Update(0, 1, {"b": np.array([[0.25]], np.float32), "a": np.array([0.5, 3.0], np.float32)}, base, 0, 0, 1)
    g = pseudo_gradient(u)
    assert g.dtype == np.float64 and g.tolist() == [0.5, -1.0, 0.25]  # in the base model's key order
    u.params["a"] = np.array([1.0], np.float32)  # one value: it must not broadcast
    with pytest.raises(ValueError, match="'a' has 1 values in the update, 2 in the base model"):
        pseudo_gradient(u, out=np.empty(3))


def test_kardam_state_round_trip_continues_identically():
    rng = np.random.default_rng(3)
    seq = [(int(rng.integers(6)), float(rng.normal()), float(rng.uniform(0.5, 3)), t) for t in range(80)]
    seq = [(c, x, L * (12 if c == 5 else 1), t) for c, x, L, t in seq]
    a = Kardam(byzantine_fraction=0.2, window=20, warmup=5)
    for c, x, L, t in seq[:40]:
        a.check(lipschitz_update(c, x, L, t))
    b = Kardam(byzantine_fraction=0.2, window=20, warmup=5)
    b.load_state_dict(json.loads(json.dumps(a.state_dict())))
    ra = [a.check(lipschitz_update(c, x, L, t)) for c, x, L, t in seq[40:]]
    rb = [b.check(lipschitz_update(c, x, L, t)) for c, x, L, t in seq[40:]]
    assert [(v.reason, v.score) for v in ra] == [(v.reason, v.score) for v in rb]
    assert any(v.reason == "kardam" for v in ra)
    for k in (a, b):  # it keeps the base models its clients' previous updates refer to, no other
        assert set(k.models) == {v for _, v in k.prev.values()} and len(k.models) <= 6


# -- norm ----------------------------------------------------------------------------------------


def test_norm_filter_rejects_or_clips_above_multiplier_times_median():
    f = NormFilter(norm_multiplier=3.0, window=4, warmup=3)
    for n in (1.0, 2.0, 3.0):  # warming up: accepted whatever the norm
        assert f.check(upd(0, [0, 0], [n, 0])).accepted
    assert f.threshold() == pytest.approx(6.0)  # 3 * median(1, 2, 3)
    v = f.check(upd(0, [0, 0], [0, 7.0]))
    assert v.reason == "norm" and v.score == pytest.approx(7.0) and f.norms == [1.0, 2.0, 3.0]
    assert f.check(upd(0, [0, 0], [3.0, 4.0])).accepted  # norm 5
    assert f.norms == [1.0, 2.0, 3.0, 5.0] and f.threshold() == pytest.approx(7.5)

    c = NormFilter(norm_multiplier=3.0, clip=True, window=4, warmup=3)
    for n in (1.0, 2.0, 3.0):
        c.check(upd(0, [0, 0], [n, 0]))
    u = upd(0, [1.0, 1.0], [0.0, 12.0])
    v = c.check(u)
    assert v.accepted and v.score == pytest.approx(12.0)
    np.testing.assert_allclose(v.apply(u)["w"], [1.0, 7.0])  # clipped to the threshold 6
    assert c.norms[-1] == pytest.approx(6.0)  # the clipped norm is what is remembered
    # window: only the last 4
    c.check(upd(0, [0, 0], [1.0, 0]))
    assert c.norms == pytest.approx([2.0, 3.0, 6.0, 1.0])


def test_verdict_that_changes_nothing_returns_the_update_params_object():
    u = upd(0, [1, 2], [0.5, 0.5])
    assert Verdict(None).apply(u) is u.params


@pytest.mark.parametrize("f", [
    lambda: ZenoPlusPlus(),
    lambda: Kardam(window=10, warmup=3),
    lambda: NormFilter(window=10, warmup=3, clip=True),
])
def test_filters_state_is_json_and_wrong_state_raises(f):
    a = f()
    if isinstance(a, ZenoPlusPlus):
        a.set_validation_gradient(P(0.3, -0.2), 2)
    for t in range(12):
        a.check(upd(t % 4, [t * 0.1, 1.0], [(-1) ** t * 0.1 * (t + 1), 0.05], base_version=t, staleness=t % 3))
    b = f()
    b.load_state_dict(json.loads(json.dumps(a.state_dict())))
    assert json.dumps(b.state_dict()) == json.dumps(a.state_dict())
    for t in range(12, 20):
        u = upd(t % 4, [t * 0.1, 1.0], [(-1) ** t * 0.3 * t, 0.05], base_version=t, staleness=1)
        va, vb = a.check(u), b.check(u)
        assert (va.reason, va.score, va.threshold) == (vb.reason, vb.score, vb.threshold)
    with pytest.raises(ValueError, match="state is for filter"):
        b.load_state_dict({"filter": "other"})


def test_make_filter_from_config():
    assert make_filter(RobustConfig()) is None
    z = make_filter(RobustConfig(filter="zeno++", gamma=2.0, rho=0.1, epsilon=0.2, refresh=4))
    assert isinstance(z, ZenoPlusPlus) and (z.gamma, z.rho, z.epsilon, z.refresh, z.normalize) == (2.0, 0.1, 0.2, 4, False)
    assert make_filter(RobustConfig(filter="zeno++", normalize=True)).normalize
    k = make_filter(RobustConfig(filter="kardam", byzantine_fraction=0.2, window=50, warmup=5))
    assert isinstance(k, Kardam) and k.quantile == pytest.approx(0.8) and (k.window, k.warmup) == (50, 5)
    n = make_filter(RobustConfig(filter="norm", norm_multiplier=4.0, clip=True))
    assert isinstance(n, NormFilter) and (n.multiplier, n.clip) == (4.0, True)


# -- validation split ------------------------------------------------------------------------------


def test_validation_split_draws_from_the_training_partitions_by_seed():
    parts = [(np.full((n, 2), c, np.float32) + np.arange(n, dtype=np.float32)[:, None] / 100,
              np.full(n, c, np.int64)) for c, n in enumerate((5, 0, 7, 3))]
    x, y = validation_split(parts, 6, seed=1)
    assert x.shape == (6, 2) and y.shape == (6,) and x.dtype == np.float32 and y.dtype == np.int64
    pool_x = np.concatenate([p[0] for p in parts])
    assert all(any(np.array_equal(row, r) for r in pool_x) for row in x)  # rows of the training pool
    assert len({tuple(r) for r in x}) == 6  # without replacement
    x2, y2 = validation_split(parts, 6, seed=1)
    assert np.array_equal(x, x2) and np.array_equal(y, y2)
    x3, _ = validation_split(parts, 6, seed=2)
    assert not np.array_equal(x, x3)
    assert validation_split(parts, 100, seed=0)[0].shape == (15, 2)  # capped at the pool


# -- aggregators --------------------------------------------------------------------------------------


def test_aggregators_on_hand_made_vectors():
    u = [np.array([1.0, 0.0]), np.array([2.0, 0.0]), np.array([3.0, 1.0]), np.array([100.0, 1.0])]
    np.testing.assert_allclose(aggregate(u, "mean"), [26.5, 0.5])
    np.testing.assert_allclose(aggregate(u, "median"), [2.5, 0.5])
    np.testing.assert_allclose(aggregate(u, "trimmed_mean", trim=0.25), [2.5, 0.5])  # drop 1 at each end
    np.testing.assert_allclose(aggregate(u, "trimmed_mean", trim=0.0), [26.5, 0.5])
    np.testing.assert_allclose(trimmed_mean(np.array([[1.0], [5.0], [9.0]]), 0.49), [5.0])  # keeps one
    # centered clipping in 1-D from the median 0.5 with tau = 1:
    c = np.array([[0.0], [0.0], [1.0], [10.0]])
    # iteration 1: diffs -0.5 -0.5 0.5 9.5 -> clipped -0.5 -0.5 0.5 1 -> mean 0.125 -> 0.625
    np.testing.assert_allclose(centered_clip(c, radius=1.0, iters=1), [0.625])
    # iteration 2: diffs -0.625 -0.625 0.375 9.375 -> -0.625 -0.625 0.375 1 -> mean 0.03125
    np.testing.assert_allclose(centered_clip(c, radius=1.0, iters=2), [0.65625])
    # default tau: the median distance to the start (0.5, 0.5, 0.5, 9.5 -> 0.5)
    np.testing.assert_allclose(aggregate(list(c), "centered_clip", cc_iters=1), [0.5 + (-0.5 - 0.5 + 0.5 + 0.5) / 4])
    with pytest.raises(ValueError, match="unknown aggregator"):
        aggregate(u, "krum")
    with pytest.raises(ValueError):
        aggregate([], "median")


def test_aggregate_takes_parameter_dicts():
    a = {"w": np.array([[1.0, 2.0]]), "b": np.array([0.0])}
    b = {"w": np.array([[3.0, 2.0]]), "b": np.array([4.0])}
    out = unflat(aggregate([a, b, b], "median"), a)
    np.testing.assert_allclose(out["w"], [[3.0, 2.0]])
    np.testing.assert_allclose(out["b"], [4.0])
    assert np.array_equal(flat(out), np.array([3.0, 2.0, 4.0]))


def _buffer_run(fb, deltas, staleness=None, num_examples=None):
    x = {"w": np.zeros(3, np.float32)}
    out = None
    for i, d in enumerate(deltas):
        u = Update(i, i, {"w": np.asarray(d, np.float32)}, x, 0, 0 if staleness is None else staleness[i],
                   10 if num_examples is None else num_examples[i])
        out = fb.add(x, u, 0)
    return out


def test_fedbuff_median_ignores_a_minority_of_attackers():
    honest = [[1.0, 1.0, 0.0]] * 4
    attack = [[-10.0, -10.0, 0.0]]
    mean = _buffer_run(FedBuff(5, 1.0, CONST), honest + attack)
    med = _buffer_run(FedBuff(5, 1.0, CONST, aggregator="median"), honest + attack)
    tm = _buffer_run(FedBuff(5, 1.0, CONST, aggregator="trimmed_mean", aggregator_params={"trim": 0.2}),
                     honest + attack)
    cc = _buffer_run(FedBuff(5, 1.0, CONST, aggregator="centered_clip"), honest + attack)
    np.testing.assert_allclose(mean["w"], [-1.2, -1.2, 0.0], rtol=1e-6)
    np.testing.assert_allclose(med["w"], [1.0, 1.0, 0.0])
    np.testing.assert_allclose(tm["w"], [1.0, 1.0, 0.0])
    np.testing.assert_allclose(cc["w"], [1.0, 1.0, 0.0])  # tau = median distance = 0


def test_fedbuff_robust_aggregators_scale_by_staleness_and_examples():
    s = make_staleness_fn("polynomial", a=1.0)  # S(1) = 1/2, S(3) = 1/4
    out = _buffer_run(FedBuff(3, 2.0, s, aggregator="median"), [[4.0, 0, 0], [4.0, 0, 0], [4.0, 0, 0]],
                      staleness=[0, 1, 3])
    np.testing.assert_allclose(out["w"], [2.0 * 2.0, 0, 0])  # eta * median(4, 2, 1)
    # examples weighting: u_i = K n_i S_i / sum n * delta_i = 3 * (1, 2, 3)/6 * 6 = 3, 6, 9 -> median 6
    out = _buffer_run(FedBuff(3, 1.0, CONST, weighting="examples", aggregator="median"),
                      [[6.0, 0, 0]] * 3, num_examples=[1, 2, 3])
    np.testing.assert_allclose(out["w"], [6.0, 0, 0])
    # and every robust aggregator equals the mean when all buffered updates are equal
    for agg in AGGREGATORS:
        out = _buffer_run(FedBuff(3, 1.0, CONST, aggregator=agg), [[0.5, -1.0, 2.0]] * 3)
        np.testing.assert_allclose(out["w"], [0.5, -1.0, 2.0])


def test_fedbuff_mean_is_the_default_and_bit_identical():
    rng = np.random.default_rng(5)
    deltas = [rng.standard_normal(3).astype(np.float32) for _ in range(4)]
    a = _buffer_run(FedBuff(4, 0.7, CONST), deltas)
    b = _buffer_run(make_strategy(ServerConfig(strategy="fedbuff", buffer_size=4, server_lr=0.7,
                                               staleness={"fn": "constant"}), "uniform"), deltas)
    c = _buffer_run(FedBuff(4, 0.7, CONST, aggregator="mean"), deltas)
    assert params_sha256(a) == params_sha256(b) == params_sha256(c)
    d = _buffer_run(FedBuff(4, 0.7, CONST, aggregator="median"), deltas)
    assert params_sha256(d) != params_sha256(a)


def test_fedbuff_aggregator_checks():
    from fedasync.server.strategies import CentralDP

    with pytest.raises(ValueError, match="aggregator"):
        FedBuff(3, 1.0, CONST, aggregator="krum")
    with pytest.raises(ValueError, match="central DP"):
        FedBuff(3, 1.0, CONST, aggregator="median", central_dp=CentralDP(1.0, 1.0))
    fb = make_strategy(ServerConfig(strategy="fedbuff", robust={"aggregator": "trimmed_mean", "trim": 0.3}),
                       "uniform")
    assert fb.aggregator == "trimmed_mean" and fb.aggregator_params["trim"] == 0.3
    with pytest.raises(ValueError, match="needs server.strategy fedbuff"):
        make_strategy(ServerConfig(strategy="fedasync", robust={"aggregator": "median"}), "uniform")


def test_fedbuff_robust_aggregator_does_not_depend_on_the_update_key_order():
    x = {"a": np.zeros(2, np.float32), "b": np.zeros(3, np.float32)}
    fb = FedBuff(2, 1.0, CONST, aggregator="median")
    for i in range(2):
        params = {"b": np.full(3, 2.0 + i, np.float32), "a": np.full(2, -1.0 - i, np.float32)}  # reversed order
        out = fb.add(x, Update(i, i, params, x, 0, 0, 1), 0)
    assert list(out) == ["a", "b"]
    np.testing.assert_allclose(out["a"], [-1.5, -1.5])
    np.testing.assert_allclose(out["b"], [2.5, 2.5, 2.5])


def test_filters_read_the_update_in_the_base_models_key_order():
    base = {"a": np.array([0.0, 0.0], np.float32), "b": np.array([1.0], np.float32)}
    params = {"b": np.array([1.0], np.float32), "a": np.array([-1.0, 0.0], np.float32)}  # other order
    u = Update(0, 0, params, base, 0, 0, 1)
    z = ZenoPlusPlus(rho=0.0, epsilon=0.0)
    z.set_validation_gradient({"a": np.array([1.0, 0.0]), "b": np.array([0.0])}, 0)
    v = z.check(u)  # g = [1, 0, 0] in (a, b) order: <v, g> = 1
    assert v.accepted and v.score == pytest.approx(1.0)
    n = NormFilter(norm_multiplier=2.0, window=3, warmup=1, clip=True)
    n.check(Update(1, 0, {"a": np.array([0.1, 0.0], np.float32), "b": np.array([1.0], np.float32)}, base, 0, 0, 1))
    out = n.check(u).apply(u)  # clipped to 2 * 0.1 along a[0]
    assert list(out) == ["b", "a"]
    np.testing.assert_allclose(out["a"], [-0.2, 0.0], rtol=1e-6)
    np.testing.assert_allclose(out["b"], [1.0])
