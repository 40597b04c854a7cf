"""Bad or unusual data inputs: pixel scaling decided once, ``seed``'s range, missing group ids,
``data.test_samples`` as an exact count, test columns by name, keys that do not apply, the shard
partitioner's unused samples, and the CLI's one-line errors (plain text, ``--out``).  Every test
writes its own small files."""

from __future__ import annotations

import logging

import numpy as np
import pytest
from typer.testing import CliRunner

from conftest import SMALL
from fedasync.cli import app
from fedasync.config import Config, ConfigError, DataConfig, load_config
from fedasync.task.check import check_data
from fedasync.task.data import load_federated, load_npz
from fedasync.task.files import load_files

pytestmark = pytest.mark.usefixtures("one_thread")


def _xy(n: int, seed: int, hi: int, classes: int = 3, dtype=np.int64, width: int = 4):
    rng = np.random.default_rng(seed)
    return rng.integers(0, hi + 1, size=(n, width)).astype(dtype), (np.arange(n) % classes).astype(np.int64)


def _files(path, **kw) -> DataConfig:
    return DataConfig(dataset="files", path=str(path), num_clients=kw.pop("num_clients", 3), **kw)


def _sets(*extra: str) -> list[str]:
    out = []
    for s in [*SMALL, *extra]:
        out += ["--set", s]
    return out


# -- 1. pixel scaling: decided on the training split, applied to every split and a device's file --


def test_scaling_is_decided_by_the_training_split_and_applied_to_the_test_split(tmp_path):
    x, y = _xy(60, 0, 300)  # training integers above 255: not pixels, not scaled
    xt, yt = _xy(30, 1, 199)  # on its own the test split would look like pixels
    x[0, 0] = 300
    np.savez(tmp_path / "big.npz", x_train=x, y_train=y, x_test=xt, y_test=yt)
    raw = load_files(_files(tmp_path / "big.npz"))
    assert raw.x_train.max() == 300 and np.array_equal(raw.x_test, xt.astype(np.float32))
    # pixels for training, the test split only 0/1: scaled alike (before, the test split was not)
    x, y = _xy(60, 0, 200)
    xt = np.ones((30, 4), np.int64)
    np.savez(tmp_path / "px.npz", x_train=x, y_train=y, x_test=xt, y_test=yt)
    raw = load_files(_files(tmp_path / "px.npz"))
    assert np.allclose(raw.x_test, 1 / 255) and np.allclose(raw.x_train, x / 255)


def test_scaling_of_a_csv_test_split_follows_the_training_split(tmp_path):
    import pandas as pd

    x, y = _xy(60, 0, 300)
    x[0, 0] = 300
    xt, yt = _xy(30, 1, 100)
    for name, (a, b) in {"train": (x, y), "test": (xt, yt)}.items():
        df = pd.DataFrame(a, columns=[f"p{i}" for i in range(4)])
        df["label"] = b
        df.to_csv(tmp_path / f"{name}.csv", index=False)
    raw = load_files(_files(tmp_path))
    assert np.array_equal(raw.x_test, xt.astype(np.float32))


def test_a_devices_own_pixel_file_is_scaled_like_the_simulation(tmp_path):
    x, y = _xy(20, 0, 255, dtype=np.uint8)
    x[0, 0] = 255
    np.savez(tmp_path / "dev.npz", x=x, y=y)
    xl, yl = load_npz(tmp_path / "dev.npz")
    assert xl.dtype == np.float32 and np.array_equal(xl, x.astype(np.float32) / np.float32(255))
    np.savez(tmp_path / "flt.npz", x=x.astype(np.float32) / 255, y=y)  # already scaled: unchanged
    assert np.array_equal(load_npz(tmp_path / "flt.npz")[0], x.astype(np.float32) / np.float32(255))


# -- 2. seed -----------------------------------------------------------------------------------


@pytest.mark.parametrize("seed", [-1, 2**32])
def test_seed_outside_numpys_range_is_rejected_naming_seed(seed):
    with pytest.raises(ConfigError, match=r"^seed: "):
        load_config(None, [f"seed={seed}"])
    assert load_config(None, [f"seed={2**32 - 1}"]).seed == 2**32 - 1


def test_simulate_with_a_negative_seed_exits_2_writing_nothing(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    r = CliRunner().invoke(app, ["simulate", "--backend", "local", *_sets("seed=-5")])
    assert r.exit_code == 2 and r.output.startswith("error: seed: "), r.output
    assert list(tmp_path.iterdir()) == []


# -- 3. natural partitioning: samples without a group id ---------------------------------------


def test_nan_group_ids_are_one_line_naming_partition_column(tmp_path):
    x, y = _xy(40, 0, 1, dtype=np.float32)
    groups = (np.arange(40) % 4).astype(np.float64)
    groups[[3, 7]] = np.nan
    np.savez(tmp_path / "g.npz", x=x, y=y, writer=groups)
    cfg = Config(data=_files(tmp_path / "g.npz", partitioner="natural", partition_column="writer"),
                 server={"concurrency": 2, "buffer_size": 2})
    with pytest.raises(ConfigError, match=r"^data\.partition_column: 2 samples have no value"):
        check_data(cfg)
    # the same column is ignored by the other partitioners (not checked)
    load_federated(_files(tmp_path / "g.npz", partitioner="iid", partition_column="writer"), 0)


def test_null_group_ids_in_parquet_are_rejected(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    x, y = _xy(40, 0, 1, dtype=np.float32)
    writer = [f"w{i % 4}" for i in range(40)]
    writer[5] = None
    pq.write_table(pa.table({"x": list(x), "label": y, "writer": writer}), tmp_path / "train.parquet")
    cfg = Config(data=_files(tmp_path, partitioner="natural", partition_column="writer"),
                 server={"concurrency": 2, "buffer_size": 2})
    with pytest.raises(ConfigError, match=r"^data\.partition_column: 1 samples have no value"):
        check_data(cfg)


# -- 4./5. the CLI: plain-text error lines, --out that is not a directory ----------------------


@pytest.mark.parametrize("path", ["[/x]", "a[bold]b[/bold].npz"])
def test_error_lines_are_plain_text_not_markup(tmp_path, monkeypatch, path):
    monkeypatch.chdir(tmp_path)
    r = CliRunner().invoke(app, ["simulate", "--backend", "local",
                                 *_sets("data.dataset=files", f"data.path='{path}'")])
    assert r.exit_code == 2, r.output
    assert r.output.strip() == f"error: data.path: {path}: no such file or folder"


def test_fail_prints_brackets_as_they_are(capsys):
    import typer

    from fedasync.cli.common import fail

    with pytest.raises(typer.Exit):
        fail("data.partition_column: x.npz[writer_train] and [/x] [red]")
    assert capsys.readouterr().err.strip() == "error: data.partition_column: x.npz[writer_train] and [/x] [red]"


@pytest.mark.parametrize("below", [False, True])
def test_out_at_or_below_a_file_exits_2_naming_out(tmp_path, monkeypatch, below):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "f.txt").write_text("x")
    out = "f.txt/run" if below else "f.txt"
    r = CliRunner().invoke(app, ["simulate", "--backend", "local", "--out", out, *_sets()])
    assert r.exit_code == 2, r.output
    assert r.output.strip().startswith(f"error: --out: {out}") and "f.txt is not a directory" in r.output
    assert sorted(p.name for p in tmp_path.iterdir()) == ["f.txt"]


def test_server_out_below_a_file_is_a_deploy_error(tmp_path):
    from fedasync.deploy import DeployError
    from fedasync.deploy.run import check_out_dir

    (tmp_path / "f").write_text("x")
    with pytest.raises(DeployError, match=r"^--out: .* is not a directory"):
        check_out_dir(tmp_path / "f" / "run", None)
    with pytest.raises(DeployError, match=r"^--out: .* is not a directory"):
        check_out_dir(tmp_path / "f", 3)


# -- 6. data.test_samples: an exact count ------------------------------------------------------


def test_test_samples_is_an_exact_count_and_keeps_the_old_subset_when_that_was_right(tmp_path):
    from sklearn.model_selection import train_test_split

    x, ytr = _xy(100, 0, 1, classes=10, dtype=np.float32)
    xt, yt = _xy(397, 1, 1, classes=10, dtype=np.float32)
    np.savez(tmp_path / "t.npz", x_train=x, y_train=ytr, x_test=xt, y_test=yt)
    fd = load_federated(_files(tmp_path / "t.npz", test_samples=15), 0)
    assert len(fd.y_test) == 15  # a fraction 15 / 397 gave sklearn's ceil(15 / 397 * 397) = 16

    from fedasync.task.data import subsample_test

    y = np.arange(397) % 10
    assert len(subsample_test(y, 15, 10, 0)) == 15
    for k in (20, 100, 200):  # counts sklearn already met: the very same samples as before
        old = train_test_split(np.arange(len(y)), test_size=k / len(y), random_state=3, stratify=y, shuffle=True)[1]
        assert len(old) == k and np.array_equal(subsample_test(y, k, 10, 3), old)


def test_test_samples_near_full_size_or_with_a_rare_class_falls_back_to_a_seeded_pick(tmp_path):
    from fedasync.task.data import subsample_test

    y = np.arange(360) % 10
    keep = subsample_test(y, 359, 10, 0)  # stratifying would leave 1 sample for 10 classes
    assert len(keep) == 359 and len(set(keep.tolist())) == 359
    assert np.array_equal(keep, subsample_test(y, 359, 10, 0))
    x, ytr = _xy(60, 0, 1, dtype=np.float32)
    xt, yt = _xy(30, 1, 1, dtype=np.float32)
    yt[:] = 0
    yt[1:15] = 1
    yt[-1] = 2  # one sample of class 2: no stratified split
    np.savez(tmp_path / "rare.npz", x_train=x, y_train=ytr, x_test=xt, y_test=yt)
    fd = load_federated(_files(tmp_path / "rare.npz", test_samples=10), 0)
    assert len(fd.y_test) == 10


# -- 7. CSV/parquet test split: columns by name ------------------------------------------------


def _csv(path, x, y, order=None, extra=None):
    import pandas as pd

    df = pd.DataFrame(x, columns=[f"p{i}" for i in range(x.shape[1])])
    df["label"] = y
    if extra:
        for k, v in extra.items():
            df[k] = v
    (df if order is None else df[order]).to_csv(path, index=False)


def test_test_columns_are_picked_by_name_not_position(tmp_path):
    x, y = _xy(60, 0, 9)
    xt, yt = _xy(30, 1, 9)
    for d, order in (("same", None), ("perm", ["label", "p3", "p1", "p0", "p2"])):
        (tmp_path / d).mkdir()
        _csv(tmp_path / d / "train.csv", x, y)
        _csv(tmp_path / d / "test.csv", xt, yt, order=order)
    same, perm = load_files(_files(tmp_path / "same")), load_files(_files(tmp_path / "perm"))
    assert np.array_equal(same.x_test, perm.x_test) and np.array_equal(same.x_train, perm.x_train)


def test_a_test_split_missing_a_feature_column_names_split_and_column(tmp_path):
    x, y = _xy(60, 0, 9)
    xt, yt = _xy(30, 1, 9)
    _csv(tmp_path / "train.csv", x, y)
    _csv(tmp_path / "test.csv", xt, yt, order=["p0", "p1", "p3", "label"])
    with pytest.raises(ValueError, match=r"^data\.feature_column: .*\(test\) has no column 'p2'"):
        load_files(_files(tmp_path))


def test_the_test_split_needs_no_partition_column(tmp_path):
    x, y = _xy(60, 0, 9)
    xt, yt = _xy(30, 1, 9)
    _csv(tmp_path / "train.csv", x, y, extra={"writer": np.arange(60) % 3})
    _csv(tmp_path / "test.csv", xt, yt)
    fd = load_federated(_files(tmp_path, partitioner="natural", partition_column="writer"), 0)
    assert fd.x_test.shape == (30, 4) and fd.num_clients == 3


# -- 8. keys that do not apply / are honoured --------------------------------------------------


@pytest.mark.parametrize("key", ["label_column", "feature_column"])
def test_npz_rejects_column_names_it_has_no_array_for(tmp_path, key):
    x, y = _xy(40, 0, 1, dtype=np.float32)
    np.savez(tmp_path / "d.npz", x=x, y=y)
    with pytest.raises(ValueError, match=rf"^data\.{key}: 'digit' does not apply to an \.npz"):
        load_files(_files(tmp_path / "d.npz", **{key: "digit"}))
    load_files(_files(tmp_path / "d.npz", label_column="y", feature_column="x"))  # the arrays' own names


def test_shard_logs_how_many_samples_it_leaves_out(caplog):
    cfg = DataConfig(dataset="digits", num_clients=50, partitioner="shard", shards_per_client=8)
    with caplog.at_level(logging.WARNING, logger="fedasync.task.data"):
        fd = load_federated(cfg, 0)
    used = sum(fd.sizes())
    lines = [r.getMessage() for r in caplog.records if "shard leaves" in r.getMessage()]
    assert len(lines) == 1 and lines[0].startswith(f"data.partitioner: shard leaves {1437 - used} of 1437")


def test_hub_honours_label_feature_shape_num_classes_and_test_samples(tmp_path, monkeypatch):
    """A local folder stands in for a Hugging Face data set id (no network)."""
    import datasets
    import pandas as pd

    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", tmp_path / "cache")
    (tmp_path / "hub" / "data").mkdir(parents=True)
    for split, n, seed in (("train", 120, 0), ("test", 60, 1)):
        x, y = _xy(n, seed, 255, classes=4, dtype=np.uint8, width=16)
        x[0, 0] = 255
        pd.DataFrame({"pix": list(x), "digit": y, "other": np.zeros(n)}).to_parquet(
            tmp_path / "hub" / "data" / f"{split}-00000-of-00001.parquet")
    cfg = DataConfig(dataset="hub", hub_name=str(tmp_path / "hub"), num_clients=3, partitioner="iid",
                     label_column="digit", feature_column="pix", shape=[4, 4], num_classes=6, test_samples=20)
    fd = load_federated(cfg, 0)
    assert fd.input_shape == (4, 4) and fd.num_classes == 6 and len(fd.y_test) == 20
    assert 0 < fd.x_test.max() <= 1 and sum(fd.sizes()) == 120
    with pytest.raises(ValueError, match=r"^data\.label_column: .* has no column 'nope'"):
        load_federated(cfg.model_copy(update={"label_column": "nope"}), 0)
