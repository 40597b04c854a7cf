"""``data.val_fraction`` (issue 34): a seeded stratified validation split carved out of the training
pool before partitioning; the server reports ``val_accuracy``/``val_loss`` beside the test metrics; a
client builds exactly the server's partition from its setup; a user task brings ``load_validation``."""

from __future__ import annotations

import json
import types

import numpy as np
import pytest
import torch
from torch import nn

from fedasync.assembly import assemble
from fedasync.config import ConfigError, DataConfig, config_from_dict
from fedasync.task.data import load_federated
from fedasync.task.interface import TaskError
from fedasync.task.train import evaluate

pytestmark = pytest.mark.usefixtures("one_thread")


def _ids_file(tmp_path, n=600, classes=4):
    """An .npz whose first feature is each sample's id (unique), so a split can be traced by id."""
    rng = np.random.default_rng(3)
    y = np.arange(n) % classes
    x = np.concatenate([np.arange(n)[:, None], rng.normal(size=(n, 3)) + y[:, None]], axis=1).astype(np.float32)
    path = tmp_path / "ids.npz"
    np.savez(path, x=x, y=y.astype(np.int64))
    return str(path), n, classes


def _data(path, **over):
    return DataConfig.model_validate({"dataset": "files", "path": path, "num_clients": 10, "partitioner": "dirichlet",
                                      "alpha": 0.5, "test_fraction": 0.2, **over})


def _cfg(**data):
    raw = {"seed": 4, "data": {"dataset": "digits", "num_clients": 10, "alpha": 0.5, **data},
           "model": {"name": "mlp", "hidden": 16}, "train": {"local_steps": 5, "batch_size": 16, "lr": 0.2},
           "server": {"strategy": "fedbuff", "concurrency": 4, "buffer_size": 2, "eval_every": 1,
                      "max_virtual_time": 8, "target_accuracy": None}}
    return config_from_dict(raw)


def test_validation_is_carved_from_the_training_pool_and_no_client_holds_it(tmp_path):
    path, n, classes = _ids_file(tmp_path)
    base = load_federated(_data(path), 7)
    fed = load_federated(_data(path, val_fraction=0.1), 7)
    ids = lambda x: set(int(v) for v in np.asarray(x)[:, 0])  # noqa: E731
    val, test = ids(fed.x_val), ids(fed.x_test)
    parts = [ids(x) for x, _ in fed.partitions]
    assert ids(base.x_test) == test  # the test set is the one of before: never carved from
    assert len(val) == len(fed.y_val) == int(np.ceil(0.1 * (n - len(test))))
    assert np.bincount(fed.y_val, minlength=classes).tolist() == [len(val) // classes] * classes  # stratified
    assert not val & test
    assert all(not val & p for p in parts)  # no validation sample in any client's partition
    assert set().union(*parts) | val | test == set(range(n))  # the rest of the training pool is partitioned
    assert sum(fed.sizes()) == sum(base.sizes()) - len(val)
    again = load_federated(_data(path, val_fraction=0.1, num_classes=None), 7)  # seeded: same split
    assert ids(again.x_val) == val
    other = load_federated(_data(path, val_fraction=0.1), 8)
    assert ids(other.x_val) != val
    assert not fed.x_val.flags.writeable


def test_a_client_builds_the_servers_partition_from_its_setup():
    from fedasync.clients.runner import setup_task

    cfg = _cfg(val_fraction=0.2)
    parts = assemble(cfg)
    setup = json.loads(parts.setup_json)
    assert setup["data"]["val_fraction"] == 0.2
    client = setup_task(parts.setup_json)
    fed = load_federated(cfg.data, cfg.seed)
    x_val = {row.tobytes() for row in fed.x_val}
    for i in range(cfg.data.num_clients):
        train, _ = client.load_data(i, cfg.data.num_clients)
        x, y = (t.numpy() for t in train.tensors)
        np.testing.assert_array_equal(x, fed.partitions[i][0])
        np.testing.assert_array_equal(y, fed.partitions[i][1])
        assert not x_val & {row.tobytes() for row in x}
    assert parts.num_examples == fed.sizes()
    assert sum(fed.sizes()) + len(fed.y_val) + len(fed.y_test) == 1797


def test_default_zero_keeps_the_setup_and_digest_of_before():
    plain, zero = _cfg(), _cfg(val_fraction=0.0)
    a, b = assemble(plain), assemble(zero)
    assert a.setup_json == b.setup_json and "val_fraction" not in json.loads(b.setup_json)["data"]
    assert a.task.digest == b.task.digest
    metrics = b.evaluator(b.initial_params())
    assert sorted(metrics) == ["accuracy", "loss"]
    assert assemble(_cfg(val_fraction=0.1)).task.digest != a.task.digest


def test_the_server_reports_val_metrics_and_a_target_may_name_them(tmp_path):
    import fedasync

    cfg = _cfg(val_fraction=0.15)
    parts = assemble(cfg)
    fed = load_federated(cfg.data, cfg.seed)
    params = parts.initial_params()
    m = parts.evaluator(params)
    model = parts.new_model(params)
    val_loss, val_acc = evaluate(model, fed.x_val, fed.y_val)
    test_loss, test_acc = evaluate(model, fed.x_test, fed.y_test)
    assert m == {"accuracy": test_acc, "loss": test_loss, "val_accuracy": val_acc, "val_loss": val_loss}

    raw = cfg.model_dump(mode="json")
    raw["server"].update(target={"metric": "val_accuracy", "value": 0.5, "mode": "max"}, stop_at_target=True)
    if "target_hold" in raw["server"]:
        raw["server"]["target_hold"] = 1  # the first evaluation at the target
    r = fedasync.simulate(raw, backend="local", out=tmp_path)
    assert all({"val_accuracy", "val_loss", "accuracy"} <= h.keys() for h in r.history)
    at = [h["virtual_time_s"] for h in r.history if h["val_accuracy"] >= 0.5]
    assert at and r.summary["time_to_target_s"] == at[0]  # the first evaluation at the target on validation
    assert r.summary["stop_reason"] == "target"


def _user_task(with_validation: bool):
    ns = types.SimpleNamespace(__name__="valtask")
    rng = np.random.default_rng(0)
    x = rng.normal(size=(80, 4)).astype(np.float32)
    y = (x[:, 0] > 0).astype(np.int64)
    ns.model = lambda: nn.Sequential(nn.Linear(4, 2))
    ns.load_data = lambda partition_id, num_partitions: ((x[partition_id::num_partitions],
                                                         y[partition_id::num_partitions]), (x[:8], y[:8]))
    ns.load_centralized = lambda: (x[:20], y[:20])
    if with_validation:
        ns.load_validation = lambda: (x[20:50], y[20:50])
    return ns


def test_a_user_task_with_load_validation_gets_val_metrics():
    cfg = _cfg()
    parts = assemble(cfg, task=_user_task(True))
    params = parts.initial_params()
    m = parts.evaluator(params)
    assert sorted(m) == ["accuracy", "loss", "val_accuracy", "val_loss"]
    model = parts.new_model(params)
    with torch.no_grad():
        logits = model(torch.from_numpy(_user_task(True).load_validation()[0]))
    y = _user_task(True).load_validation()[1]
    assert m["val_accuracy"] == pytest.approx(float((logits.argmax(1).numpy() == y).mean()))
    assert sorted(assemble(cfg, task=_user_task(False)).evaluator(params)) == ["accuracy", "loss"]


def test_val_fraction_with_a_user_task_is_one_line_naming_load_validation():
    with pytest.raises(TaskError, match=r"data.val_fraction: .*define load_validation in the task") as e:
        assemble(_cfg(val_fraction=0.1), task=_user_task(True))
    assert "\n" not in str(e.value)


def test_bad_val_fraction_is_refused_naming_the_key():
    for bad in (1.0, -0.1):
        with pytest.raises(ConfigError, match="val_fraction"):
            _cfg(val_fraction=bad)
    with pytest.raises(ValueError, match=r"^data.val_fraction: cannot split"):
        load_federated(_cfg(val_fraction=0.001).data, 0)  # 2 samples cannot hold 10 classes
    with pytest.raises(ValueError, match=r"^data.val_fraction: not available with data.dataset hub"):
        load_federated(DataConfig(dataset="hub", hub_name="nobody/nothing", val_fraction=0.1), 0)
