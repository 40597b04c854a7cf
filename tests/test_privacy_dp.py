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


pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def digits():
    return load_federated(DataConfig(dataset="digits", num_clients=10, partitioner="iid"), 0)


def _norm(a: dict, b: dict) -> float:
    return float(np.sqrt(sum(np.sum((a[k].astype(np.float64) - b[k]) ** 2) for k in a)))


def _train(fed, model_name, mode, seed, *, sigma=1.0, clip=1.0, lr=0.1, steps=4, history=None, reproducible=True):
    mcfg = ModelConfig(name=model_name, hidden=32)
    model = build_model(mcfg, fed.input_shape, fed.num_classes)
    p0 = init_params(mcfg, fed.input_shape, fed.num_classes, 0)
    set_params(model, p0)
    x, y = fed.partitions[0]
    hook = OpacusHook(noise_multiplier=sigma, max_grad_norm=clip, accountant="rdp", grad_sample_mode=mode,
                      history=history, seed=seed, reproducible_noise=reproducible)
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
    # reproducible_noise: the same task seed gives the same parameters; another seed other noise
    _, a, ha, _ = _train(digits, model_name, mode, seed=11)
    _, b, _, _ = _train(digits, model_name, mode, seed=11)
    _, c, _, _ = _train(digits, model_name, mode, seed=12)
    assert all(np.array_equal(a.params[k], b.params[k]) for k in a.params)
    assert not all(np.array_equal(a.params[k], c.params[k]) for k in a.params)
    # secret (the default): the same task seed gives other noise every time
    _, d, _, _ = _train(digits, model_name, mode, seed=11, reproducible=False)
    _, e, _, _ = _train(digits, model_name, mode, seed=11, reproducible=False)
    assert not any(np.array_equal(d.params[k], e.params[k]) for k in d.params)
    assert not any(np.array_equal(a.params[k], d.params[k]) for k in a.params)
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


# -- secret noise, what a reply carries, gdp, the proximal term ----------------------------------


def test_noise_seeds_come_from_os_entropy_unless_reproducible():
    from fedasync.privacy.dp import noise_seeds

    assert noise_seeds(7, True) == noise_seeds(7, True) != noise_seeds(8, True)
    secret = {noise_seeds(7, False) for _ in range(4)}
    assert len(secret) == 4 and noise_seeds(7, True) not in secret
    assert all(0 <= a < 2**63 and 0 <= b < 2**63 and a != b for a, b in secret)


def test_the_server_cannot_subtract_secret_noise(digits):
    """The issue's attack: rerun the task with the server's seed (here: on the same data, which only
    helps the attacker) and subtract. With reproducible noise it recovers the noiseless run
    exactly; with secret noise the difference is the noise itself."""
    kw = dict(sigma=1000.0, clip=1.0, lr=1e-3, steps=1)
    p0, noiseless, _, _ = _train(digits, "mlp", "hooks", seed=5, **dict(kw, sigma=0.0))
    _, attempt, _, _ = _train(digits, "mlp", "hooks", seed=5, **kw)  # the attacker's rerun with the task seed
    _, reproducible, _, _ = _train(digits, "mlp", "hooks", seed=5, **kw)  # a client with reproducible noise
    _, secret, _, _ = _train(digits, "mlp", "hooks", seed=5, reproducible=False, **kw)  # the default
    signal = _norm(noiseless.params, p0)
    assert _norm(reproducible.params, attempt.params) == 0.0  # the noise subtracts out exactly
    assert _norm(secret.params, attempt.params) > 100 * signal  # it does not


def _setup_cfg(*extra):
    from fedasync.config import load_config

    return load_config(None, ["data.num_clients=4", "server.concurrency=2", "server.buffer_size=2",
                              "train.local_steps=2", *extra])


def test_a_dp_reply_carries_no_loss_and_the_planned_num_examples(digits):
    from fedasync.clients.runner import handle_train
    from fedasync.server.transport import client_setup_json

    cfg = _setup_cfg()
    fed = load_federated(cfg.data, cfg.seed)
    params = init_params(cfg.model, fed.input_shape, fed.num_classes, cfg.seed)
    n = len(fed.partitions[1][1])
    conf = {"setup": client_setup_json(cfg), "client_id": 1, "seed": 3}
    pc = _pconf(sample_rate=sample_rate_for(n, 16), steps=2, num_examples=1234)
    dp = handle_train(params, dict(conf, privacy=pc))
    assert "loss" not in dp["metrics"] and dp["metrics"]["num_examples"] == 1234  # the server's plan, echoed
    opt_in = handle_train(params, dict(conf, privacy=dict(pc, report_loss=True)))
    assert np.isfinite(opt_in["metrics"]["loss"])
    plain = handle_train(params, conf)
    assert np.isfinite(plain["metrics"]["loss"]) and plain["metrics"]["num_examples"] == n


def test_a_device_refuses_a_task_asking_for_reproducible_noise(digits):
    from fedasync.clients.runner import handle_train
    from fedasync.server.transport import client_setup_json

    cfg = _setup_cfg()
    fed = load_federated(cfg.data, cfg.seed)
    params = init_params(cfg.model, fed.input_shape, fed.num_classes, cfg.seed)
    n = len(fed.partitions[1][1])
    conf = {"setup": client_setup_json(cfg), "client_id": 1, "seed": 3,
            "privacy": _pconf(sample_rate=sample_rate_for(n, 16), steps=2, reproducible_noise=True)}
    with pytest.raises(PrivacyError, match=r"^privacy.reproducible_noise: true derives the DP noise"):
        handle_train(params, conf, device_node=True)
    with pytest.raises(PrivacyError, match=r"^privacy.reproducible_noise"):
        handle_train(params, dict(conf, deployment=True))
    assert handle_train(params, conf)["metrics"]["dp_steps"] == 2  # a simulated client may


def test_a_client_never_enforces_a_budget_with_gdp(digits):
    with pytest.raises(PrivacyError, match=r"^privacy.local_dp.accountant: gdp .*can underestimate epsilon"):
        _task(digits, _pconf(accountant="gdp"))


def test_opacus_secure_rng_warning_becomes_one_info_line(digits, caplog, recwarn):
    import logging

    import fedasync.privacy.dp as dpmod

    dpmod._said_insecure = False
    with caplog.at_level(logging.INFO, logger="fedasync.privacy"):
        for seed in (1, 2):
            _train(digits, "mlp", "ghost", seed=seed, steps=1, reproducible=False)
    said = [r for r in caplog.records if "Secure RNG turned off" in r.getMessage()]
    assert len(said) == 1 and said[0].levelname == "INFO" and "\n" not in said[0].getMessage()


@pytest.mark.parametrize("mode", ["hooks", "functorch", "ew", "ghost"])
def test_the_proximal_term_is_added_after_clipping_and_noise(digits, mode):
    """x_0 = x_tau + v; no noise and a clipping norm of 1e-7, so the private gradient is ~0: each step
    is x <- x - lr rho (x - x_tau), whole. Had the term gone through Opacus (per-sample clipping, or
    no per-sample gradient at all), x would stay at x_0."""
    from fedasync.task.train import local_train as lt

    mcfg = ModelConfig(name="mlp", hidden=16)
    model = build_model(mcfg, digits.input_shape, digits.num_classes)
    p0 = init_params(mcfg, digits.input_shape, digits.num_classes, 0)
    set_params(model, p0)
    x, y = digits.partitions[0]
    v = {k: np.random.default_rng(1).normal(size=a.shape).astype(np.float32) * 0.1 for k, a in p0.items()}
    hook = OpacusHook(noise_multiplier=0.0, max_grad_norm=1e-7, grad_sample_mode=mode, seed=0, reproducible_noise=True)

    def shift_then_private(m, opt, loader):  # after the anchor x_tau is taken: start at x_tau + v
        with torch.no_grad():
            for name, p in m.named_parameters():
                p.add_(torch.from_numpy(v[name]))
        return hook(m, opt, loader)

    lr, rho, steps = 0.1, 2.0, 5
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        r = lt(model, x, y, TrainConfig(local_steps=steps, batch_size=16, lr=lr, prox_rho=rho), seed=0, device=CPU,
               make_private=shift_then_private)
    hook.close()
    shrink = (1 - lr * rho) ** steps
    for k in p0:
        np.testing.assert_allclose(r.params[k], p0[k] + shrink * v[k], atol=1e-5)
    assert hook.history == [(0.0, sample_rate_for(len(y), 16), steps)]  # the same steps accounted: no extra cost


def test_a_device_without_a_state_dir_refuses_to_train(digits):
    # a real device (the task carries only the server's record) must keep its own accountant:
    # the server's record misses the tasks whose replies it never took
    conf = _pconf(state_key="run1-client0")
    del conf["history"]
    conf["server_history"] = []
    with pytest.raises(PrivacyError, match="privacy-state-dir"):
        _task(digits, conf)
