"""DC-ASGD delay compensation: the formula on hand-made vectors, and lambda = 0 == none."""

import copy

import numpy as np
import pytest

from fedasync.config import DelayCompensationConfig, ServerConfig, StalenessConfig
from fedasync.server.delay import dc_asgd, make_delay_compensation
from fedasync.server.strategies import Update, make_strategy, params_sha256


def P(**arrays):
    return {k: np.asarray(v, dtype=np.float32) for k, v in arrays.items()}


def test_formula_on_hand_made_vectors():
    # g = x_base - x_client = [0.5, -0.5]; drift = x_now - x_base = [1, -2]
    # g~ = g + 0.5 * g*g*drift = [0.5 + 0.125, -0.5 - 0.25]; result = x_base - g~ = [0.375, 2.75]
    out = dc_asgd(P(w=[2.0, 0.0]), P(w=[1.0, 2.0]), P(w=[0.5, 2.5]), 0.5)
    np.testing.assert_array_equal(out["w"], np.array([0.375, 2.75], np.float32))
    assert out["w"].dtype == np.float32
    # a second key, a 2-D array, lambda 2: g = 1, drift = 3 -> g~ = 1 + 2*1*3 = 7 -> 1 - 7 = -6
    out = dc_asgd(P(a=[[4.0]], b=[1.0]), P(a=[[1.0]], b=[1.0]), P(a=[[0.0]], b=[1.0]), 2.0)
    np.testing.assert_array_equal(out["a"], np.array([[-6.0]], np.float32))
    np.testing.assert_array_equal(out["b"], np.array([1.0], np.float32))


def test_fresh_update_unchanged_and_inputs_not_mutated():
    rng = np.random.default_rng(0)
    base = P(w=rng.standard_normal((4, 3)), b=rng.standard_normal(3))
    client = {k: (v + 0.1 * rng.standard_normal(v.shape)).astype(np.float32) for k, v in base.items()}
    now = {k: (v + rng.standard_normal(v.shape)).astype(np.float32) for k, v in base.items()}
    snap = copy.deepcopy((now, base, client))
    out = dc_asgd(base, base, client, 0.7)  # x_now == x_base: no drift
    assert params_sha256(out) == params_sha256(client)
    dc_asgd(now, base, client, 0.7)
    for a, b in zip((now, base, client), snap):
        assert params_sha256(a) == params_sha256(b)
    assert all(not np.shares_memory(out[k], client[k]) for k in out)


def test_lambda_zero_is_bit_identical_to_the_client_model():
    rng = np.random.default_rng(1)
    for _ in range(20):
        base = P(w=rng.standard_normal((8, 5)) * 3, b=rng.standard_normal(5) * 1e-3)
        client = {k: (v - 0.05 * rng.standard_normal(v.shape)).astype(np.float32) for k, v in base.items()}
        now = {k: (v + rng.standard_normal(v.shape)).astype(np.float32) for k, v in base.items()}
        assert params_sha256(dc_asgd(now, base, client, 0.0)) == params_sha256(client)


def test_compensation_moves_the_update_along_the_drift():
    """lambda > 0: each coordinate of the step g changes by lambda * g^2 * drift."""
    base, client, now = P(w=[0.0, 0.0]), P(w=[-1.0, 1.0]), P(w=[1.0, 1.0])
    out = dc_asgd(now, base, client, 0.1)  # g = [1, -1], g~ = [1.1, -0.9]
    np.testing.assert_allclose(out["w"], [-1.1, 0.9], rtol=1e-6)


@pytest.mark.parametrize("strategy", ["fedasync", "fedbuff"])
def test_dc_asgd_lambda_zero_gives_the_same_model_as_none(strategy):
    """A run of stale updates through the strategy: compensating with lambda = 0 before the strategy
    sees each update gives bit-identical models to no compensation; lambda > 0 does not."""
    cfg = ServerConfig(strategy=strategy, buffer_size=3, concurrency=4, staleness=StalenessConfig(fn="polynomial"))
    none = make_delay_compensation(DelayCompensationConfig())
    zero = make_delay_compensation(DelayCompensationConfig.model_validate({"method": "dc_asgd", "lambda": 0.0}))
    pos = make_delay_compensation(DelayCompensationConfig.model_validate({"method": "dc_asgd", "lambda": 0.5}))
    assert none is None and zero is not None

    def run(comp):
        rng = np.random.default_rng(7)
        s = make_strategy(cfg, "uniform")
        x = P(w=rng.standard_normal((6, 4)), b=rng.standard_normal(4))
        versions, v = {0: x}, 0
        hashes = []
        for t in range(40):
            bv = max(0, v - int(rng.integers(0, 4)))
            base = versions[bv]
            client = {k: (a - 0.1 * rng.standard_normal(a.shape)).astype(np.float32) for k, a in base.items()}
            params = client if comp is None else comp(x, base, client)
            new = s.add(x, Update(t, t % 5, params, base, bv, v - bv, 10), v)
            if new is not None:
                x, v = new, v + 1
                versions[v] = x
                hashes.append(params_sha256(x))
        return hashes

    h_none = run(none)
    assert len(h_none) > 5
    assert run(zero) == h_none
    assert run(pos) != h_none


def test_config_lambda_alias_and_bad_values():
    c = DelayCompensationConfig.model_validate({"method": "dc_asgd", "lambda": 0.1})
    assert c.lambda_ == 0.1 and c.model_dump(mode="json") == {"method": "dc_asgd", "lambda": 0.1}
    assert DelayCompensationConfig().lambda_ == 0.04
    with pytest.raises(ValueError):
        dc_asgd(P(w=[0.0]), P(w=[0.0]), P(w=[0.0]), -1.0)
    with pytest.raises(ValueError, match="keys"):
        dc_asgd(P(w=[0.0]), P(v=[0.0]), P(w=[0.0]), 0.1)
