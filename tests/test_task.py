"""fedasync.task: data, models, local training (CPU, no network, a few seconds)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from fedasync.config import DataConfig, ModelConfig, TrainConfig
from fedasync.task import data as task_data
from fedasync.task.data import load_federated, load_npz, load_partition, load_test, save_partitions_npz
from fedasync.task.models import build_model, get_params, init_params, set_params
from fedasync.task.train import batch_plan, evaluate, local_train, pick_device, steps_for

CPU = torch.device("cpu")


def _label_entropy(y: np.ndarray, num_classes: int) -> float:
    p = np.bincount(y, minlength=num_classes) / len(y)
    p = p[p > 0]
    return float(-(p * np.log(p)).sum())


pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def digits():
    return load_federated(DataConfig(), 0)


# -- data ---------------------------------------------------------------------------------


def test_digits_shapes_and_sizes(digits):
    fd = digits
    assert fd.input_shape == (64,)
    assert fd.num_classes == 10
    assert len(fd.partitions) == 100
    sizes = [len(y) for _, y in fd.partitions]
    assert min(sizes) >= DataConfig().min_partition_size >= 1
    assert sum(sizes) + len(fd.y_test) == 1797
    assert len(fd.y_test) == int(np.ceil(0.2 * 1797))
    for x, y in fd.partitions:
        assert x.dtype == np.float32 and y.dtype == np.int64
        assert x.shape == (len(y), 64)
    assert fd.x_test.dtype == np.float32 and fd.y_test.dtype == np.int64
    assert 0.0 <= fd.x_test.min() and fd.x_test.max() <= 1.0
    # stratified: every class is in the test set in about its share
    assert np.bincount(fd.y_test, minlength=10).min() >= 30


def test_partitions_and_test_set_are_exactly_the_full_data(digits):
    from sklearn.datasets import load_digits

    full = load_digits()

    def rows(x, y):
        return [r.tobytes() + bytes([int(label)]) for r, label in zip(x, y)]

    expected = sorted(rows((full.data / 16.0).astype(np.float32), full.target))
    got = [k for x, y in digits.partitions for k in rows(x, y)] + rows(digits.x_test, digits.y_test)
    assert sorted(got) == expected  # every sample exactly once, in a client or in the test set


def test_load_federated_is_deterministic_and_seeded(digits):
    task_data._load_cached.cache_clear()
    again = load_federated(DataConfig(), 0)
    assert again is not digits
    for (xa, ya), (xb, yb) in zip(digits.partitions, again.partitions):
        np.testing.assert_array_equal(xa, xb)
        np.testing.assert_array_equal(ya, yb)
    np.testing.assert_array_equal(digits.x_test, again.x_test)
    assert load_federated(DataConfig(), 0) is again  # cached
    other = load_federated(DataConfig(), 1)
    assert any(
        len(ya) != len(yb) or not np.array_equal(ya, yb) for (_, ya), (_, yb) in zip(digits.partitions, other.partitions)
    )
    x, y = load_partition(DataConfig(), 0, 7)
    np.testing.assert_array_equal(y, again.partitions[7][1])
    xt, yt = load_test(DataConfig(), 0)
    np.testing.assert_array_equal(yt, again.y_test)
    with pytest.raises(IndexError):
        load_partition(DataConfig(), 0, 100)
    # cached arrays are read-only
    with pytest.raises(ValueError):
        x[0, 0] = 1.0


def test_dirichlet_is_non_iid(digits):
    iid = load_federated(DataConfig(partitioner="iid"), 0)
    sizes = [len(y) for _, y in iid.partitions]
    assert min(sizes) >= 14 and max(sizes) <= 15
    ent_iid = np.mean([_label_entropy(y, 10) for _, y in iid.partitions])
    ent_dir = np.mean([_label_entropy(y, 10) for _, y in digits.partitions])
    assert ent_dir < ent_iid - 0.3, (ent_dir, ent_iid)
    # label histograms differ across clients
    hists = np.stack([np.bincount(y, minlength=10) / len(y) for _, y in digits.partitions])
    assert hists.std(axis=0).mean() > 1.5 * np.stack(
        [np.bincount(y, minlength=10) / len(y) for _, y in iid.partitions]
    ).std(axis=0).mean()


def test_dirichlet_fallback_repairs_small_clients(caplog):
    # alpha tiny + many clients: flwr-datasets gives up after 10 tries; we repair instead
    cfg = DataConfig(num_clients=200, alpha=0.05, min_partition_size=5)
    with caplog.at_level("WARNING", logger="fedasync.task.data"):
        parts = task_data.partition_labels(cfg, 0, np.repeat(np.arange(10), 120))
    assert "topping small clients up" in caplog.text
    sizes = [len(p) for p in parts]
    assert min(sizes) >= 5 and sum(sizes) == 1200
    assert len(np.unique(np.concatenate(parts))) == 1200
    with pytest.raises(ValueError, match="num_clients"):
        task_data.partition_labels(DataConfig(num_clients=100, min_partition_size=20), 0, np.arange(1000) % 10)


def test_mnist1d_loads_locally():
    cfg = DataConfig(dataset="mnist1d", mnist1d_samples=500, num_clients=10)
    state = np.random.get_state()[1].copy()
    fd = load_federated(cfg, 0)
    np.testing.assert_array_equal(np.random.get_state()[1], state)  # global RNG left alone
    assert fd.input_shape == (40,) and fd.num_classes == 10
    assert sum(len(y) for _, y in fd.partitions) + len(fd.y_test) == 500
    assert all(len(y) >= 1 for _, y in fd.partitions)
    allx = np.concatenate([x for x, _ in fd.partitions] + [fd.x_test])
    assert abs(allx.mean()) < 0.05 and abs(allx.std() - 1) < 0.05


def test_npz_round_trip_and_errors(tmp_path):
    cfg = DataConfig(num_clients=5)
    paths = save_partitions_npz(cfg, 0, tmp_path / "parts")
    assert [p.name for p in paths] == [f"client-{i}.npz" for i in range(5)]
    x, y = load_npz(paths[2])
    x2, y2 = load_partition(cfg, 0, 2)
    np.testing.assert_array_equal(x, x2)
    np.testing.assert_array_equal(y, y2)
    with pytest.raises(FileNotFoundError, match="no such file"):
        load_npz(tmp_path / "nope.npz")
    np.savez(tmp_path / "bad.npz", x=x)
    with pytest.raises(ValueError, match="missing array"):
        load_npz(tmp_path / "bad.npz")
    (tmp_path / "junk.npz").write_text("not a zip")
    with pytest.raises(ValueError, match="not a readable"):
        load_npz(tmp_path / "junk.npz")


def test_hub_fails_clearly_without_network(monkeypatch):
    import datasets

    def offline(*args, **kwargs):
        raise ConnectionError("no network in tests")

    monkeypatch.setattr(datasets, "load_dataset", offline)
    cfg = DataConfig(dataset="hub", hub_name="no-such-user/no-such-dataset-xyz", num_clients=3)
    with pytest.raises(RuntimeError, match="could not load Hugging Face data set .*no network"):
        load_federated(cfg, 0)


# -- models -------------------------------------------------------------------------------


@pytest.mark.parametrize("name", ["mlp", "cnn"])
@pytest.mark.parametrize("shape", [(64,), (40,), (28, 28), (12, 12, 3)])
def test_forward_shapes(name, shape):
    model = build_model(ModelConfig(name=name, hidden=32), shape, 10)
    out = model(torch.randn(5, *shape))
    assert out.shape == (5, 10)
    assert not any(isinstance(m, torch.nn.modules.batchnorm._BatchNorm) for m in model.modules())


def test_cnn_layout():
    cnn2d = build_model(ModelConfig(name="cnn"), (64,), 10)
    assert isinstance(cnn2d.features[0], torch.nn.Conv2d)
    cnn1d = build_model(ModelConfig(name="cnn"), (40,), 10)
    assert isinstance(cnn1d.features[0], torch.nn.Conv1d)


def test_params_round_trip_and_errors():
    cfg = ModelConfig()
    p = init_params(cfg, (64,), 10, seed=3)
    assert list(p) == ["net.1.weight", "net.1.bias", "net.3.weight", "net.3.bias", "net.5.weight", "net.5.bias"]
    assert all(v.dtype == np.float32 for v in p.values())
    q = init_params(cfg, (64,), 10, seed=3)
    assert all(np.array_equal(p[k], q[k]) for k in p)
    r = init_params(cfg, (64,), 10, seed=4)
    assert not np.array_equal(p["net.1.weight"], r["net.1.weight"])

    model = build_model(cfg, (64,), 10)
    set_params(model, p)
    back = get_params(model)
    assert all(np.array_equal(p[k], back[k]) for k in p)
    back["net.1.bias"][:] = 99  # a copy: the model is untouched
    assert float(model.net[1].bias.detach()[0]) != 99

    bad = dict(p)
    bad["net.3.weight"] = np.zeros((3, 3), np.float32)
    with pytest.raises(ValueError, match=r"shape mismatch for 'net.3.weight'"):
        set_params(model, bad)
    missing = {k: v for k, v in p.items() if k != "net.5.bias"}
    with pytest.raises(ValueError, match="missing key.*net.5.bias"):
        set_params(model, missing)
    with pytest.raises(ValueError, match="unexpected key.*extra"):
        set_params(model, {**p, "extra": np.zeros(1, np.float32)})
    # read-only arrays load without complaint
    ro = {k: v.copy() for k, v in p.items()}
    for v in ro.values():
        v.flags.writeable = False
    set_params(model, ro)


# -- training -----------------------------------------------------------------------------


def test_steps_for():
    assert steps_for(TrainConfig(local_steps=7), 100) == 7
    assert steps_for(TrainConfig(local_epochs=2, batch_size=16), 33) == 6
    assert steps_for(TrainConfig(local_epochs=1, batch_size=16), 5) == 1
    assert steps_for(TrainConfig(local_epochs=3, batch_size=16), 32) == 6


def test_batch_plan_is_epoch_style():
    plan = batch_plan(10, 4, 5, seed=0)
    assert len(plan) == 5 and all(len(b) == 4 for b in plan)
    flat = np.array(plan).ravel()
    assert sorted(flat[:10]) == list(range(10))  # first pass is a permutation
    assert sorted(flat[10:20]) == list(range(10))
    assert batch_plan(3, 16, 2, seed=0) == batch_plan(3, 16, 2, seed=0)
    assert all(len(b) == 3 for b in batch_plan(3, 16, 2, seed=0))


def test_pick_device():
    assert pick_device("cpu") == CPU
    assert pick_device("auto").type in ("cpu", "cuda", "mps")
    if not torch.cuda.is_available():
        with pytest.raises(RuntimeError, match="CUDA is not available"):
            pick_device("cuda")
    with pytest.raises(ValueError):
        pick_device("tpu")


def test_local_train_deterministic_and_lowers_loss(digits):
    x, y = digits.partitions[0]
    mcfg = ModelConfig()
    p0 = init_params(mcfg, digits.input_shape, digits.num_classes, seed=0)
    cfg = TrainConfig(local_steps=30, batch_size=16, lr=0.1, momentum=0.5, device="cpu")

    def run(seed):
        m = build_model(mcfg, digits.input_shape, digits.num_classes)
        set_params(m, p0)
        return local_train(m, x, y, cfg, seed=seed, device=CPU)

    a, b, c = run(5), run(5), run(6)
    assert a.steps == 30 and a.num_examples == len(y)
    assert all(np.array_equal(a.params[k], b.params[k]) for k in a.params)
    assert a.loss == b.loss
    assert any(not np.array_equal(a.params[k], c.params[k]) for k in a.params)
    assert list(a.params) == list(p0)

    m = build_model(mcfg, digits.input_shape, digits.num_classes)
    set_params(m, p0)
    before, _ = evaluate(m, x, y)
    set_params(m, a.params)
    after, _ = evaluate(m, x, y)
    assert after < before * 0.5, (before, after)


def test_local_train_uses_current_params_and_epochs(digits):
    x, y = digits.partitions[1]
    m = build_model(ModelConfig(), digits.input_shape, digits.num_classes)
    p0 = get_params(m)
    res = local_train(m, x, y, TrainConfig(local_epochs=2, batch_size=4, device="cpu"), seed=0)
    assert res.steps == 2 * int(np.ceil(len(y) / 4))
    # the model itself was trained in place from its current parameters
    now = get_params(m)
    assert all(np.array_equal(now[k], res.params[k]) for k in now)
    assert any(not np.array_equal(now[k], p0[k]) for k in now)


def test_prox_rho_is_fedasyncs_proximal_objective_and_zero_is_plain_sgd(digits):
    """train.prox_rho: SGD (with momentum) on f(x) + rho/2 ||x - x_tau||^2, x_tau = the start; 0: unchanged."""
    from fedasync.task.train import make_loader

    x, y = digits.partitions[0]
    mcfg = ModelConfig(hidden=16)
    p0 = init_params(mcfg, digits.input_shape, digits.num_classes, seed=0)

    def run(rho):
        m = build_model(mcfg, digits.input_shape, digits.num_classes)
        set_params(m, p0)
        extra = {} if rho is None else {"prox_rho": rho}  # None: a config without the key
        cfg = TrainConfig(local_steps=12, batch_size=16, lr=0.1, momentum=0.5, device="cpu", **extra)
        return local_train(m, x, y, cfg, seed=3, device=CPU).params

    plain, zero, prox = run(None), run(0.0), run(0.5)
    assert all(np.array_equal(plain[k], zero[k]) for k in plain)  # rho = 0: bit for bit the old training
    dist = lambda p: float(np.sqrt(sum(np.sum((p[k].astype(np.float64) - p0[k]) ** 2) for k in p)))  # noqa: E731
    assert dist(prox) < dist(plain)  # pulled towards x_tau

    # the same objective by hand: the loss plus the proximal term, through autograd
    m = build_model(mcfg, digits.input_shape, digits.num_classes)
    set_params(m, p0)
    anchor = [p.detach().clone() for p in m.parameters()]
    opt = torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.5)
    torch.random.default_generator.manual_seed(3)
    for xb, yb in make_loader(x, y, TrainConfig(local_steps=12, batch_size=16), seed=3):
        opt.zero_grad()
        loss = torch.nn.functional.cross_entropy(m(xb), yb)
        loss = loss + 0.25 * sum(((p - a) ** 2).sum() for p, a in zip(m.parameters(), anchor))
        loss.backward()
        opt.step()
    by_hand = get_params(m)
    for k in prox:
        np.testing.assert_allclose(prox[k], by_hand[k], rtol=1e-5, atol=1e-6)


def test_make_private_hook_receives_planned_loader(digits):
    x, y = digits.partitions[2]
    seen = {}

    class CountingLoss(torch.nn.CrossEntropyLoss):
        calls = 0

        def forward(self, out, target):
            CountingLoss.calls += 1
            return super().forward(out, target)

    def hook(model, optimizer, loader):
        seen["len"] = len(loader)
        seen["planned"] = (loader.planned_steps, loader.planned_batch_size)
        seen["dataset"] = type(loader.dataset).__name__
        return model, optimizer, loader, CountingLoss()

    m = build_model(ModelConfig(), digits.input_shape, digits.num_classes)
    cfg = TrainConfig(local_steps=9, batch_size=16, device="cpu")
    res = local_train(m, x, y, cfg, seed=0, make_private=hook)
    assert seen["len"] == 9 and seen["planned"] == (9, min(16, len(y)))
    assert seen["dataset"] == "TensorDataset"
    assert CountingLoss.calls == 9 and res.steps == 9


def test_cnn_trains_on_both_datasets(digits):
    m1 = load_federated(DataConfig(dataset="mnist1d", mnist1d_samples=500, num_clients=10), 0)
    for fd in (digits, m1):
        m = build_model(ModelConfig(name="cnn"), fd.input_shape, fd.num_classes)
        x, y = fd.partitions[0]
        res = local_train(m, x, y, TrainConfig(local_steps=3, device="cpu"), seed=0)
        assert res.steps == 3 and np.isfinite(res.loss)


def test_central_mlp_learns_digits(digits):
    x = np.concatenate([x for x, _ in digits.partitions])
    y = np.concatenate([y for _, y in digits.partitions])
    torch.manual_seed(0)
    m = build_model(ModelConfig(), digits.input_shape, digits.num_classes)
    _, acc0 = evaluate(m, digits.x_test, digits.y_test)
    res = local_train(m, x, y, TrainConfig(local_steps=400, batch_size=32, lr=0.1, momentum=0.9, device="cpu"), seed=0)
    set_params(m, res.params)
    loss, acc = evaluate(m, digits.x_test, digits.y_test, batch_size=100)
    assert 0.0 <= acc0 <= 1.0 and 0.0 <= acc <= 1.0
    assert acc > 0.9, acc
    assert loss < 0.5
