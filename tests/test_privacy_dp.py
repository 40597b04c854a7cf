"""fedasync.privacy.dp: the Opacus DP-SGD hook and a client's DP task (CPU, seconds)."""

from __future__ import annotations

import importlib.util
import json
import warnings

import numpy as np
import pytest
import torch
from torch import nn

from fedasync.config import DataConfig, ModelConfig, TrainConfig
from fedasync.privacy.budgets import PrivacyError, epsilon_of, extend_history, sample_rate_for
from fedasync.privacy.dp import OpacusHook, check_secure_mode, make_compatible, private_task
from fedasync.task.data import load_federated
from fedasync.task.models import build_model, get_params, init_params, set_params
from fedasync.task.train import local_train

CPU = torch.device("cpu")


@pytest.fixture(scope="module", autouse=True)
def _one_thread():
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="module")
def digits():
    return load_federated(DataConfig(dataset="digits", num_clients=10, partitioner="iid"), 0)


def _norm(a: dict, b: dict) -> float:
    return float(np.sqrt(sum(np.sum((a[k].astype(np.float64) - b[k]) ** 2) for k in a)))


def _train(fed, model_name, mode, seed, *, sigma=1.0, clip=1.0, lr=0.1, steps=4, history=None):
    mcfg = ModelConfig(name=model_name, hidden=32)
    model = build_model(mcfg, fed.input_shape, fed.num_classes)
    p0 = init_params(mcfg, fed.input_shape, fed.num_classes, 0)
    set_params(model, p0)
    x, y = fed.partitions[0]
    hook = OpacusHook(noise_multiplier=sigma, max_grad_norm=clip, accountant="rdp", grad_sample_mode=mode,
                      history=history, seed=seed)
    cfg = TrainConfig(local_steps=steps, batch_size=16, lr=lr)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            r = local_train(model, x, y, cfg, seed=seed, device=CPU, make_private=hook)
    finally:
        hook.close()
    return p0, r, hook, model


@pytest.mark.parametrize("model_name", ["mlp", "cnn"])
@pytest.mark.parametrize("mode", ["hooks", "functorch", "ew", "ghost"])
def test_every_grad_sample_mode_clips_is_seeded_and_accounts(digits, model_name, mode):
    # no noise, a tiny clipping norm: each step moves the model by at most lr * C * |batch| / E[batch]
    p0, r, hook, model = _train(digits, model_name, mode, seed=3, sigma=0.0, clip=1e-3, lr=1.0, steps=4)
    n = len(digits.partitions[0][1])
    bound = 4 * 1.0 * 1e-3 * n / 16
    moved = _norm(r.params, p0)
    assert 0 < moved <= bound
    _, plain, _, _ = _train(digits, model_name, mode, seed=3, sigma=0.0, clip=1e6, lr=1.0, steps=4)
    assert _norm(plain.params, p0) > 20 * bound  # without clipping the same steps go much further
    # seeded: the same task seed gives the same parameters; another seed other noise
    _, a, ha, _ = _train(digits, model_name, mode, seed=11)
    _, b, _, _ = _train(digits, model_name, mode, seed=11)
    _, c, _, _ = _train(digits, model_name, mode, seed=12)
    assert all(np.array_equal(a.params[k], b.params[k]) for k in a.params)
    assert not all(np.array_equal(a.params[k], c.params[k]) for k in a.params)
    # Opacus' accountant saw every step at q = 1 / ceil(n / batch)
    assert ha.history == [(1.0, sample_rate_for(n, 16), 4)]
    # the reused model carries no Opacus hooks or per-sample attributes afterwards
    assert list(a.params) == list(get_params(model))
    assert not any(hasattr(p, "grad_sample") for p in model.parameters())


def test_ghost_mode_uses_the_wrapped_criterion(digits):
    from opacus.utils.fast_gradient_clipping_utils import DPLossFastGradientClipping

    model = build_model(ModelConfig(name="mlp", hidden=16), digits.input_shape, digits.num_classes)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    from fedasync.task.train import make_loader

    x, y = digits.partitions[0]
    loader = make_loader(x, y, TrainConfig(local_steps=2, batch_size=16), seed=0)
    hook = OpacusHook(noise_multiplier=1.0, max_grad_norm=1.0, grad_sample_mode="ghost", seed=0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        _, _, dl, crit = hook(model, opt, loader)
    hook.close()
    assert isinstance(crit, DPLossFastGradientClipping)
    assert dl.sample_rate == 1 / 9
    hook2 = OpacusHook(noise_multiplier=1.0, max_grad_norm=1.0, grad_sample_mode="hooks", seed=0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        assert hook2(model, torch.optim.SGD(model.parameters(), lr=0.1), loader)[3] is None
    hook2.close()


def test_accountant_continues_from_the_history(digits):
    n = len(digits.partitions[0][1])
    q = sample_rate_for(n, 16)
    _, _, h1, _ = _train(digits, "mlp", "ghost", seed=1, steps=3)
    _, _, h2, _ = _train(digits, "mlp", "ghost", seed=2, steps=3, history=h1.history)
    assert h2.history == [(1.0, q, 6)] == extend_history(h1.history, 1.0, q, 3, "rdp")
    assert epsilon_of(h2.history, 1e-5, "rdp") > epsilon_of(h1.history, 1e-5, "rdp") > 0


def test_batchnorm_is_rejected_clearly_and_make_compatible_fixes_it(digits):
    bn = nn.Sequential(nn.Linear(64, 16), nn.BatchNorm1d(16), nn.ReLU(), nn.Linear(16, 10))
    x, y = digits.partitions[0]
    cfg = TrainConfig(local_steps=2, batch_size=16)
    hook = OpacusHook(noise_multiplier=1.0, max_grad_norm=1.0, seed=0)
    with pytest.raises(PrivacyError, match=r"^model: Opacus cannot train .*BatchNorm at 1") as e:
        local_train(bn, x, y, cfg, seed=0, device=CPU, make_private=hook)
    assert "\n" not in str(e.value)
    with pytest.warns(UserWarning, match="ModuleValidator.fix"):
        fixed = make_compatible(bn)
    assert isinstance(fixed[1], nn.GroupNorm)
    hook = OpacusHook(noise_multiplier=1.0, max_grad_norm=1.0, seed=0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        r = local_train(fixed, x, y, cfg, seed=0, device=CPU, make_private=hook)
    hook.close()
    assert r.steps == 2 and hook.history[0][2] == 2


@pytest.mark.skipif(importlib.util.find_spec("torchcsprng") is not None, reason="torchcsprng is installed")
def test_secure_mode_without_torchcsprng_is_a_clear_error():
    with pytest.raises(PrivacyError, match=r"^privacy.local_dp.secure_mode: true needs the torchcsprng package"):
        check_secure_mode(True)
    check_secure_mode(False)
    with pytest.raises(PrivacyError, match="torchcsprng"):
        OpacusHook(noise_multiplier=1.0, max_grad_norm=1.0, secure_mode=True)


def test_empty_poisson_batches_do_not_break_training():
    # 3 records, q = 1/3: about 30% of the 12 steps draw an empty batch
    x = np.random.default_rng(0).normal(size=(3, 64)).astype(np.float32)
    y = np.array([0, 1, 2])
    for mode in ("hooks", "ghost"):
        model = build_model(ModelConfig(name="mlp", hidden=8), (64,), 10)
        hook = OpacusHook(noise_multiplier=1.0, max_grad_norm=1.0, grad_sample_mode=mode, seed=5)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            r = local_train(model, x, y, TrainConfig(local_steps=12, batch_size=1, lr=0.1), seed=5, device=CPU,
                            make_private=hook)
        hook.close()
        assert r.steps == 12 and hook.history == [(1.0, 1 / 3, 12)]
        assert all(np.isfinite(v).all() for v in r.params.values())


# -- a client's DP task ---------------------------------------------------------------------------


def _pconf(**kw):
    base = {"local_dp": True, "epsilon": 5.0, "delta": 1e-5, "planned_tasks": 3, "noise_multiplier": 1.2,
            "noise_auto": False, "sample_rate": 1 / 9, "steps": 3, "max_grad_norm": 1.0, "accountant": "rdp",
            "grad_sample_mode": "ghost", "secure_mode": False, "history": []}
    base.update(kw)
    return base


def _task(fed, pconf, state_dir=None, seed=0):
    model = build_model(ModelConfig(name="mlp", hidden=16), fed.input_shape, fed.num_classes)
    p0 = init_params(ModelConfig(name="mlp", hidden=16), fed.input_shape, fed.num_classes, 0)
    set_params(model, p0)
    x, y = fed.partitions[0]
    out = private_task(model, x, y, TrainConfig(local_steps=3, batch_size=16, lr=0.1), seed, CPU, pconf,
                       state_dir=state_dir)
    return out, p0, model


def test_refuses_before_training_when_the_task_would_exceed_the_budget(digits):
    h = [(1.2, 1 / 9, 30)]
    eps_now = epsilon_of(h, 1e-5, "rdp")
    eps_next = epsilon_of([(1.2, 1 / 9, 33)], 1e-5, "rdp")
    budget = (eps_now + eps_next) / 2  # the next task would cross it
    out, p0, model = _task(digits, _pconf(epsilon=budget, history=h))
    assert out.refused == "privacy_budget_exhausted" and out.train is None
    assert out.metrics["epsilon"] == pytest.approx(eps_now, abs=1e-12)
    assert out.metrics["epsilon_next"] == pytest.approx(eps_next, abs=1e-12)
    assert all(np.array_equal(v, p0[k]) for k, v in get_params(model).items())  # it did not train
    ok, _, _ = _task(digits, _pconf(epsilon=eps_next, history=h))  # exactly at the budget: allowed
    assert ok.refused is None and ok.metrics["epsilon"] == pytest.approx(eps_next, abs=1e-12)


def test_device_keeps_its_accountant_in_a_local_file(digits, tmp_path):
    conf = _pconf(epsilon=None, state_key="run1-client0")
    del conf["history"]
    conf["server_history"] = []
    a, _, _ = _task(digits, conf, state_dir=str(tmp_path), seed=1)
    path = tmp_path / "accountant-run1-client0.json"
    saved = json.loads(path.read_text())
    assert saved["history"] == [[1.2, 1 / 9, 3]] and saved["epsilon"] == a.metrics["epsilon"]
    b, _, _ = _task(digits, conf, state_dir=str(tmp_path), seed=2)
    assert b.metrics["accountant_history"] == [[1.2, 1 / 9, 6]]
    assert b.metrics["epsilon"] > a.metrics["epsilon"]
    # the file is lost: the server's record is a floor, epsilon never resets
    path.unlink()
    c, _, _ = _task(digits, dict(conf, server_history=[[1.2, 1 / 9, 6]]), state_dir=str(tmp_path), seed=3)
    assert c.metrics["accountant_history"] == [[1.2, 1 / 9, 9]]
    # an explicit history in the task (simulation) wins over the file
    d, _, _ = _task(digits, dict(conf, history=[]), state_dir=str(tmp_path), seed=4)
    assert d.metrics["accountant_history"] == [[1.2, 1 / 9, 3]]


def test_auto_noise_is_recalibrated_when_the_device_data_differ(digits):
    from fedasync.privacy.budgets import calibrate

    # the server planned for 1000 records; this device has 144: sigma is calibrated for its own q
    out, _, _ = _task(digits, _pconf(noise_auto=True, noise_multiplier=0.5, sample_rate=0.016, epsilon=3.0))
    n = len(digits.partitions[0][1])
    q = sample_rate_for(n, 16)
    assert out.metrics["sample_rate"] == q
    assert out.metrics["noise_multiplier"] == calibrate(3.0, 1e-5, q, 3 * 3, "rdp")


def test_handle_train_non_dp_path_has_no_privacy_metrics():
    from fedasync.clients.runner import handle_train
    from fedasync.config import load_config
    from fedasync.server.transport import client_setup_json

    cfg = load_config(None, ["data.num_clients=4", "server.concurrency=2", "server.buffer_size=2",
                             "train.local_steps=2"])
    fed = load_federated(cfg.data, cfg.seed)
    params = init_params(cfg.model, fed.input_shape, fed.num_classes, cfg.seed)
    out = handle_train(params, {"setup": client_setup_json(cfg), "client_id": 1, "seed": 3})
    assert "epsilon" not in out["metrics"] and out["metrics"]["steps"] == 2
    dp = handle_train(params, {"setup": client_setup_json(cfg), "client_id": 1, "seed": 3,
                               "privacy": _pconf(sample_rate=sample_rate_for(len(fed.partitions[1][1]), 16),
                                                 steps=2)})
    assert dp["metrics"]["epsilon"] > 0 and dp["metrics"]["dp_steps"] == 2
    assert not all(np.array_equal(out["params"][k], dp["params"][k]) for k in params)
