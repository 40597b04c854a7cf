"""Simulated attacks: who attacks (by the seed) and what they send (passes the validation battery)."""

import subprocess
import sys

import numpy as np
import pytest

from fedasync.clients.attack import (
    KINDS,
    REPLY_KINDS,
    apply_to_reply,
    attackers,
    flip_labels,
    gaussian,
    scale,
    sign_flip,
    stale_version,
)
from fedasync.config import AttackConfig, ConfigError, ServerConfig, check_no_attack, load_config
from fedasync.server.strategies import params_norm, params_sha256, params_sub
from fedasync.server.validation import UpdateValidator


def P(**arrays):
    return {k: np.asarray(v, dtype=np.float32) for k, v in arrays.items()}


def model_pair(seed=0):
    rng = np.random.default_rng(seed)
    base = P(w=rng.standard_normal((16, 8)), b=rng.standard_normal(8))
    client = {k: (v - 0.05 * rng.standard_normal(v.shape)).astype(np.float32) for k, v in base.items()}
    return base, client


def test_attackers_by_clients_or_by_seeded_fraction():
    assert attackers(None, 100, 0) == frozenset()
    assert attackers(AttackConfig(kind="sign_flip", clients="0-4,9"), 100, 0) == {0, 1, 2, 3, 4, 9}
    a = attackers(AttackConfig(kind="scale", fraction=0.2), 100, seed=0)
    assert len(a) == 20 and all(0 <= c < 100 for c in a)
    assert a == attackers(AttackConfig(kind="gaussian", fraction=0.2), 100, seed=0)  # the kind does not matter
    assert a != attackers(AttackConfig(kind="scale", fraction=0.2), 100, seed=1)
    assert len(attackers(AttackConfig(kind="scale", fraction=0.001), 100, seed=0)) == 1  # at least one
    assert len(attackers(AttackConfig(kind="scale", fraction=1.0), 7, seed=0)) == 7
    with pytest.raises(ConfigError, match="attack.clients"):
        attackers(AttackConfig(kind="scale", clients="0-200"), 100, 0)


def test_reply_transforms_on_hand_made_vectors():
    base, client = P(w=[1.0, 2.0]), P(w=[1.5, 1.0])  # delta = [0.5, -1]
    np.testing.assert_allclose(sign_flip(base, client, 10)["w"], [1.0 - 5.0, 2.0 + 10.0])
    np.testing.assert_allclose(scale(base, client, 10)["w"], [1.0 + 5.0, 2.0 - 10.0])
    np.testing.assert_allclose(sign_flip(base, client, 1)["w"], [0.5, 3.0])
    g = gaussian(base, client, 10, seed=3, task_id=7)
    assert params_norm(params_sub(g, base)) == pytest.approx(10 * np.sqrt(0.25 + 1.0), rel=1e-6)


def test_gaussian_is_deterministic_per_seed_and_task():
    base, client = model_pair()
    a = gaussian(base, client, 10, seed=1, task_id=5)
    assert params_sha256(a) == params_sha256(gaussian(base, client, 10, seed=1, task_id=5))
    assert params_sha256(a) != params_sha256(gaussian(base, client, 10, seed=1, task_id=6))
    assert params_sha256(a) != params_sha256(gaussian(base, client, 10, seed=2, task_id=5))
    d, honest = params_sub(a, base), params_sub(client, base)
    assert params_norm(d) == pytest.approx(10 * params_norm(honest), rel=1e-5)
    cos = sum(float(np.sum(d[k].astype(np.float64) * honest[k])) for k in d) / (params_norm(d) * params_norm(honest))
    assert abs(cos) < 0.3  # a random direction, not the honest one


@pytest.mark.parametrize("kind", REPLY_KINDS)
def test_attacked_updates_pass_the_validation_battery(kind):
    base, client = model_pair(1)
    out = apply_to_reply(kind, base, client, factor=10.0, seed=0, task_id=3)
    v = UpdateValidator(base, ServerConfig())
    assert v.check_params(out, base) is None  # finite, same keys, shapes and dtypes
    assert list(out) == list(client) and all(out[k].dtype == client[k].dtype for k in out)
    assert params_sha256(out) != params_sha256(client)
    assert all(not np.shares_memory(out[k], client[k]) for k in out)


def test_label_flip_and_stale_version():
    y = np.array([0, 3, 9, 5], np.int64)
    assert flip_labels(y, 10).tolist() == [9, 6, 0, 4] and flip_labels(y, 10).dtype == np.int64
    assert np.array_equal(flip_labels(flip_labels(y, 10), 10), y)
    with pytest.raises(ValueError):
        flip_labels(np.array([10]), 10)
    assert [stale_version(v, 20) for v in (0, 5, 20, 57)] == [0, 0, 0, 37]
    base, client = model_pair()
    for kind in ("label_flip", "stale"):
        assert apply_to_reply(kind, base, client) is client
    with pytest.raises(ValueError, match="unknown attack kind"):
        apply_to_reply("nope", base, client)
    assert set(KINDS) == {"sign_flip", "scale", "gaussian", "label_flip", "stale"}


def test_config_and_the_deployed_server_check():
    cfg = load_config(None, ["attack.kind=sign_flip", "attack.fraction=0.2"])
    assert cfg.attack.factor == 10.0 and cfg.attack.lag == 20
    with pytest.raises(ConfigError, match="^attack: simulation only"):
        check_no_attack(cfg)
    check_no_attack(load_config())  # no attack section: fine
    for bad, key in ((["attack.kind=sign_flip"], "attack.fraction"),
                     (["attack.kind=flip", "attack.fraction=0.2"], "attack.kind"),
                     (["attack.kind=scale", "attack.fraction=0.2", "attack.clients=0-3"], "attack.fraction"),
                     (["attack.kind=scale", "attack.fraction=1.5"], "attack.fraction"),
                     (["attack.kind=scale", "attack.clients=0-100"], "attack.clients"),
                     (["attack.kind=scale", "attack.fraction=0.1", "attack.bogus=1"], "attack.bogus")):
        with pytest.raises(ConfigError) as e:
            load_config(None, bad)
        assert str(e.value).startswith(key) and "\n" not in str(e.value)


# -- the simulated client path ------------------------------------------------------------------


def _task(cfg, client_id=3, **extra):
    from fedasync.server.transport import client_setup_json

    return {"setup": client_setup_json(cfg), "client_id": client_id, "seed": 11, "task_id": 4, **extra}


def test_runner_applies_the_attack_of_a_simulation_task():
    from fedasync.clients.runner import handle_train
    from fedasync.task.models import init_params

    cfg = load_config(None, ["data.num_clients=10", "server.concurrency=5", "server.buffer_size=5"])
    from fedasync.task.data import load_federated

    fed = load_federated(cfg.data, cfg.seed)
    params = init_params(cfg.model, fed.input_shape, fed.num_classes, 0)
    honest = handle_train(params, _task(cfg))["params"]
    again = handle_train(params, _task(cfg))["params"]
    assert params_sha256(honest) == params_sha256(again)  # deterministic, so the comparison below is exact
    flipped = handle_train(params, _task(cfg, attack={"kind": "sign_flip", "factor": 10.0}))["params"]
    assert params_sha256(flipped) == params_sha256(sign_flip(params, honest, 10.0))
    noisy = handle_train(params, _task(cfg, attack={"kind": "gaussian", "factor": 2.0}))["params"]
    assert params_sha256(noisy) == params_sha256(gaussian(params, honest, 2.0, seed=11, task_id=4))
    lf = handle_train(params, _task(cfg, attack={"kind": "label_flip"}))["params"]
    assert params_sha256(lf) != params_sha256(honest)
    refused = handle_train(params, _task(cfg, attack={"kind": "scale"}, deployment=True))
    assert refused["refused"] == "attack_in_deployment" and "params" not in refused


def test_attack_module_stays_off_the_honest_client_path():
    code = (
        "import sys\n"
        "import fedasync.clients.app, fedasync.clients.runner\n"
        "assert 'fedasync.clients.attack' not in sys.modules\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True)
