"""Review findings in local training, DP-SGD and the models (CPU, seconds)."""

from __future__ import annotations

import warnings

import numpy as np
import pytest
import torch

from fedasync.config import ModelConfig, TrainConfig
from fedasync.privacy.budgets import epsilon_of, sample_rate_for
from fedasync.privacy.dp import private_task
from fedasync.task.models import build_model

CPU = torch.device("cpu")

pytestmark = pytest.mark.usefixtures("one_thread")


def _pconf(**kw) -> dict:
    d = {"accountant": "rdp", "delta": 1e-5, "epsilon": None, "noise_multiplier": 1.0, "max_grad_norm": 1.0,
         "history": []}
    d.update(kw)
    return d


@pytest.mark.parametrize("k", [93, 99])  # int(1 / (1 / k)) == k - 1 in floating point
def test_accountant_records_the_sample_rate_that_was_sampled_and_budgeted(k):
    # Opacus' Poisson loader has int(1 / q) steps and make_private accounts at 1 / len(loader):
    # for these k the accountant recorded q = 1 / (k - 1), more than the q budgeted and sampled with
    x = np.random.default_rng(0).normal(size=(k, 4)).astype(np.float32)
    y = np.arange(k) % 2
    q = sample_rate_for(k, 1)
    assert q == 1 / k
    model = build_model(ModelConfig(name="mlp", hidden=8), (4,), 2)
    cfg = TrainConfig(local_steps=3, batch_size=1, device="cpu")
    budget = epsilon_of([(1.0, q, 3)], 1e-5, "rdp")  # exactly what this task costs at q
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        r = private_task(model, x, y, cfg, seed=1, device=CPU, pconf=_pconf(epsilon=budget))
    assert r.refused is None
    assert r.metrics["sample_rate"] == q
    assert r.metrics["accountant_history"] == [[1.0, q, 3]]
    assert r.metrics["epsilon"] <= budget  # the budget check before training held after it


def test_functorch_and_ew_take_empty_poisson_batches_like_hooks():
    # 3 records, q = 1/3: about 30% of the steps draw an empty batch, where functorch's vmap and
    # ExpandedWeights failed ("batch size must be positive"); each such step must still be a noised,
    # accounted step: with the same seed every mode gives the parameters hooks mode gives
    from fedasync.privacy.dp import OpacusHook
    from fedasync.task.models import get_params, init_params, set_params
    from fedasync.task.train import local_train

    rng = np.random.default_rng(0)
    x = rng.normal(size=(3, 8, 8)).astype(np.float32)
    y = np.array([0, 1, 2])
    out = {}
    for mode in ("hooks", "functorch", "ew"):
        for name in ("mlp", "cnn"):
            mcfg = ModelConfig(name=name, hidden=8)
            model = build_model(mcfg, (8, 8), 3)
            set_params(model, init_params(mcfg, (8, 8), 3, 0))
            hook = OpacusHook(noise_multiplier=1.0, max_grad_norm=1.0, grad_sample_mode=mode, seed=5,
                              reproducible_noise=True)
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                r = local_train(model, x, y, TrainConfig(local_steps=12, batch_size=1, lr=0.1), seed=5, device=CPU,
                                make_private=hook)
            hook.close()
            assert r.steps == 12 and hook.history == [(1.0, 1 / 3, 12)]
            assert not any(hasattr(p, "grad_sample") and p.grad_sample is not None for p in model.parameters())
            out[mode, name] = get_params(model)
    for mode in ("functorch", "ew"):
        for name in ("mlp", "cnn"):
            a, b = out[mode, name], out["hooks", name]
            assert all(np.allclose(a[k], b[k], atol=1e-5) for k in a), (mode, name)


def test_a_devices_own_data_that_does_not_fit_the_model_is_a_clear_error(tmp_path):
    # before: torch's "Target 11 is out of bounds" / "mat1 and mat2 shapes cannot be multiplied"
    from fedasync.clients.runner import handle_train
    from fedasync.config import load_config
    from fedasync.server.transport import client_setup_json
    from fedasync.task.data import load_federated
    from fedasync.task.models import init_params

    cfg = load_config(None, ["data.num_clients=4", "server.concurrency=2", "server.buffer_size=2",
                             "train.local_steps=2"])
    fed = load_federated(cfg.data, cfg.seed)
    params = init_params(cfg.model, fed.input_shape, fed.num_classes, cfg.seed)
    task = {"setup": client_setup_json(cfg), "client_id": 1, "seed": 3}
    rng = np.random.default_rng(0)
    good_x = rng.normal(size=(20, *fed.input_shape)).astype(np.float32)
    np.savez(tmp_path / "labels.npz", x=good_x, y=np.arange(20) % (fed.num_classes + 2))
    np.savez(tmp_path / "shape.npz", x=rng.normal(size=(20, 28, 28)).astype(np.float32), y=np.arange(20) % 10)
    np.savez(tmp_path / "good.npz", x=good_x, y=np.arange(20) % fed.num_classes)
    with pytest.raises(ValueError, match=rf"labels\.npz: label {fed.num_classes + 1}, but the federation has "
                                         rf"{fed.num_classes} classes"):
        handle_train(params, task, data_path=str(tmp_path / "labels.npz"))
    with pytest.raises(ValueError, match=r"shape\.npz: samples of shape \(28, 28\), but the federation's model "
                                         r"takes samples of shape \(64,\)"):
        handle_train(params, task, data_path=str(tmp_path / "shape.npz"))
    assert handle_train(params, task, data_path=str(tmp_path / "good.npz"))["metrics"]["num_examples"] == 20


def test_a_real_device_refuses_an_attack_task_even_without_the_deployment_mark():
    # like privacy.reproducible_noise: a device started by `fedasync client` never runs attack code,
    # whatever server sends the task (it ran sign_flip for a task not marked ``deployment``)
    import subprocess
    import sys

    code = (
        "import sys\n"
        "from fedasync.clients.runner import handle_train\n"
        "from fedasync.config import load_config\n"
        "from fedasync.server.transport import client_setup_json\n"
        "from fedasync.task.data import load_federated\n"
        "from fedasync.task.models import init_params\n"
        "cfg = load_config(None, ['data.num_clients=4', 'server.concurrency=2', 'server.buffer_size=2',\n"
        "                         'train.local_steps=2'])\n"
        "fed = load_federated(cfg.data, cfg.seed)\n"
        "params = init_params(cfg.model, fed.input_shape, fed.num_classes, cfg.seed)\n"
        "task = {'setup': client_setup_json(cfg), 'client_id': 1, 'seed': 3, 'task_id': 4,\n"
        "        'attack': {'kind': 'sign_flip', 'factor': 10.0}}\n"
        "out = handle_train(params, task, device_node=True)\n"
        "assert out['refused'] == 'attack_in_deployment' and 'params' not in out, out\n"
        "assert 'fedasync.clients.attack' not in sys.modules\n"
        "assert 'params' in handle_train(params, task)  # a simulated client still attacks\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


@pytest.mark.parametrize("mode", ["ghost", "hooks"])
def test_the_noised_sum_is_averaged_over_n_over_k_records(mode):
    # Opacus' expected batch size int(n * q) is n // k - 1 where n * (1 / k) rounds below n // k:
    # 49 records at batch 1 divided by 0 (a NaN model), 784 at batch 16 by 15 (a 16/15 larger step)
    from fedasync.privacy.dp import OpacusHook
    from fedasync.task.models import get_params, init_params, set_params
    from fedasync.task.train import local_train

    for n, b in ((49, 1), (784, 16)):
        x = np.zeros((n, 4), np.float32)  # zero inputs: the data moves only the last biases, by < 1e-2
        y = np.arange(n) % 2
        mcfg = ModelConfig(name="mlp", hidden=200)
        model = build_model(mcfg, (4,), 2)
        p0 = init_params(mcfg, (4,), 2, 0)
        set_params(model, p0)
        hook = OpacusHook(noise_multiplier=1.0, max_grad_norm=1000.0, grad_sample_mode=mode, seed=1,
                          reproducible_noise=True)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            local_train(model, x, y, TrainConfig(local_steps=1, batch_size=b, lr=1.0), seed=1, device=CPU,
                        make_private=hook)
        hook.close()
        p1 = get_params(model)
        step = np.concatenate([(p1[k] - p0[k]).ravel() for k in p0])
        assert np.isfinite(step).all(), (n, b)
        # the step is the noise / (n // k) = sigma * C / b: std 1000 / b, over ~41k coordinates
        assert abs(step.std() / (1000.0 / b) - 1) < 0.03, (n, b, step.std())


def test_literature_models_are_what_their_papers_describe_and_opacus_can_train_them():
    from torch import nn

    from fedasync.privacy.dp import model_problems
    from fedasync.task.models import get_params, init_params, num_params

    cnn = build_model(ModelConfig(name="fedavg_cnn"), (28, 28), 10)  # McMahan et al. 2017
    convs = [m for m in cnn.modules() if isinstance(m, nn.Conv2d)]
    assert [(c.out_channels, c.kernel_size) for c in convs] == [(32, (5, 5)), (64, (5, 5))]
    assert sum(isinstance(m, nn.MaxPool2d) and m.kernel_size == 2 for m in cnn.modules()) == 2
    assert [m.out_features for m in cnn.modules() if isinstance(m, nn.Linear)] == [512, 10]
    assert num_params(get_params(cnn)) == 1_663_370 and model_problems(cnn) == []
    res = build_model(ModelConfig(name="resnet20"), (32, 32, 3), 10)
    assert not any(isinstance(m, nn.modules.batchnorm._BatchNorm) for m in res.modules())
    assert sum(isinstance(m, nn.GroupNorm) for m in res.modules()) == 1 + 9 * 2 + 2  # stem, blocks, shortcuts
    assert sum(isinstance(m, nn.Conv2d) and m.kernel_size == (3, 3) for m in res.modules()) == 19
    assert model_problems(res) == [] and 0.26e6 < num_params(get_params(res)) < 0.28e6
    assert res(torch.zeros(2, 32, 32, 3)).shape == (2, 10)
    # input shape and classes come from the data; init is a pure function of the seed
    p = init_params(ModelConfig(name="fedavg_cnn"), (3, 16, 16), 7, 5)
    assert p["features.0.weight"].shape == (32, 3, 5, 5) and p["head.2.weight"].shape == (7, 512)
    q = init_params(ModelConfig(name="fedavg_cnn"), (3, 16, 16), 7, 5)
    assert all(np.array_equal(p[k], q[k]) for k in p)
