"""The task interface (issue 33): a user's model, data, loss, metrics and train override, the built-in
task through the same interface, every bad-input line, local DP with a user task, task_mismatch."""

from __future__ import annotations

import json
import textwrap
import types
import warnings

import numpy as np
import pytest
import torch
from torch import nn
from torch.utils.data import Dataset, TensorDataset

from fedasync.config import Config, ModelConfig, TrainConfig, load_config
from fedasync.privacy.budgets import PrivacyError, epsilon_of, extend_history, sample_rate_for
from fedasync.task.interface import TaskError, builtin_task, init_params, load_task, task_from_config
from fedasync.task.models import get_params, set_params
from fedasync.task.train import evaluate, gradient, local_train

CPU = torch.device("cpu")
pytestmark = pytest.mark.usefixtures("one_thread")


# -- a user task, defined here (as a notebook would) ------------------------------------------------------


def _arrays(n=40, seed=0):
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(n, 6)).astype(np.float32)
    y = (x[:, 0] + x[:, 1] > 0).astype(np.int64)
    return x, y


class DictData(Dataset):
    """Items are dicts: the default (x, y) loss cannot read them, the task's own loss can."""

    def __init__(self, x, y):
        self.x, self.y = torch.from_numpy(x), torch.from_numpy(y)

    def __len__(self):
        return len(self.y)

    def __getitem__(self, i):
        return {"features": self.x[i], "target": self.y[i]}


def array_task(**over):
    """model/load_data with (x, y) arrays; task_args hidden and scale."""
    ns = types.SimpleNamespace(__name__="array_task")

    def model(hidden=8, scale=1.0):
        return nn.Sequential(nn.Linear(6, hidden), nn.ReLU(), nn.Linear(hidden, 2))

    def load_data(partition_id, num_partitions, hidden=8, scale=1.0, data_path=None):
        x, y = _arrays(seed=partition_id)
        if data_path is not None:
            d = np.load(data_path)
            x, y = d["x"], d["y"]
        return (x * scale, y), (x[:10], y[:10])

    def load_centralized(hidden=8, scale=1.0):
        return _arrays(n=30, seed=99)

    ns.model, ns.load_data, ns.load_centralized = model, load_data, load_centralized
    for k, v in over.items():
        setattr(ns, k, v)
    return ns


def dict_task():
    ns = types.SimpleNamespace(__name__="dict_task")

    def model():
        return nn.Sequential(nn.Linear(6, 8), nn.ReLU(), nn.Linear(8, 2))

    def load_data(partition_id, num_partitions):
        x, y = _arrays(seed=partition_id)
        return DictData(x, y), DictData(x[:10], y[:10])

    def loss(model, batch):
        return nn.functional.cross_entropy(model(batch["features"]), batch["target"])

    def evaluate(model, loader):
        hits, n, margin = 0, 0, 0.0
        with torch.no_grad():
            for b in loader:
                out = model(b["features"])
                hits += int((out.argmax(1) == b["target"]).sum())
                margin += float((out.max(1).values - out.min(1).values).sum())
                n += len(b["target"])
        return {"hit_rate": hits / n, "margin": margin / n}

    ns.model, ns.load_data, ns.loss, ns.evaluate = model, load_data, loss, evaluate
    return ns


def _fresh(task, seed=0):
    m = task.model()
    set_params(m, init_params(task, seed))
    return m


# -- the functions of the interface ---------------------------------------------------------------------


def test_model_load_data_arrays_and_task_args():
    t = load_task(array_task(), {"hidden": 5, "scale": 2.0})
    assert t.name == "array_task" and len(t.digest) == 64 and t.args == {"hidden": 5, "scale": 2.0}
    assert t.model()[0].out_features == 5  # task_args reach model()
    train, test = t.load_data(3, 10)
    assert isinstance(train, TensorDataset) and len(train) == 40 and len(test) == 10
    x, y = _arrays(seed=3)
    assert train.tensors[0].dtype == torch.float32 and train.tensors[1].dtype == torch.int64
    assert torch.equal(train.tensors[0], torch.from_numpy(x * 2.0))  # scale=2.0 reached load_data
    central = t.load_centralized()
    assert len(central) == 30
    # init_params is task.model() right after manual_seed(seed), and leaves the global RNG alone
    state = torch.random.get_rng_state()
    a, b = init_params(t, 7), init_params(t, 7)
    assert torch.equal(state, torch.random.get_rng_state())
    assert all(np.array_equal(a[k], b[k]) for k in a)
    assert any(not np.array_equal(a[k], v) for k, v in init_params(t, 8).items())


def test_data_path_reaches_load_data(tmp_path):
    x, y = _arrays(n=12, seed=5)
    np.savez(tmp_path / "mine.npz", x=x, y=y)
    t = load_task(array_task())
    train, _ = t.load_data(0, 4, data_path=str(tmp_path / "mine.npz"))
    assert len(train) == 12 and torch.equal(train.tensors[0], torch.from_numpy(x))
    # a load_data without data_path: the device's --data cannot reach it, one line says so
    t2 = load_task(array_task(load_data=lambda partition_id, num_partitions, **kw: (_arrays(), _arrays())))
    t2_no = load_task(types.SimpleNamespace(model=t2.fns["model"],
                                             load_data=lambda partition_id, num_partitions: (_arrays(), _arrays())))
    with pytest.raises(TaskError, match=r"^task .*: load_data does not accept data_path="):
        t2_no.load_data(0, 4, data_path=str(tmp_path / "mine.npz"))
    assert len(t2.load_data(0, 4, data_path="x")[0]) == 40  # **kwargs takes it


def test_custom_loss_with_dict_batches_and_custom_metrics():
    t = load_task(dict_task())
    train, test = t.load_data(0, 2)
    m = _fresh(t)
    before = evaluate(t, m, train)
    assert set(before) == {"hit_rate", "margin"}
    cfg = TrainConfig(local_steps=40, batch_size=8, lr=0.2, device="cpu")
    r1 = local_train(m, train, cfg, seed=3, device=CPU, task=t)
    assert r1.steps == 40 and r1.num_examples == 40 and np.isfinite(r1.loss)
    after = evaluate(t, m, train)
    assert after["hit_rate"] > before["hit_rate"]
    m2 = _fresh(t)
    r2 = local_train(m2, train, cfg, seed=3, device=CPU, task=t)
    assert all(np.array_equal(r1.params[k], r2.params[k]) for k in r1.params)  # seeded: bit-identical
    # the default loss cannot read dict batches: one line naming loss
    with pytest.raises(TaskError, match=r"loss: the default loss needs \(x, y\) batches"):
        local_train(_fresh(t), train, cfg, seed=3, device=CPU)
    # gradient() (the robust filters' validation gradient) uses the task's loss
    g = gradient(_fresh(t), train, task=t)
    assert set(g) == set(get_params(m)) and all(np.isfinite(v).all() for v in g.values())


def test_default_evaluate_and_user_evaluate_return_dicts():
    t = load_task(array_task())
    m = _fresh(t)
    x, y = _arrays(n=30, seed=99)
    d = evaluate(t, m, t.load_centralized())
    loss, acc = evaluate(m, x, y)  # the array form, unchanged
    assert d == pytest.approx({"loss": loss, "accuracy": acc})


def test_train_override_gets_the_loop_and_must_take_the_budgeted_steps():
    seen = {}

    def train(model, loader, optimizer, steps):
        seen["steps"], seen["len"] = steps, len(loader)
        done = 0
        while done < steps:
            for xb, yb in loader:
                optimizer.zero_grad()
                nn.functional.cross_entropy(model(xb), yb).backward()
                optimizer.step()
                done += 1
                if done == steps:
                    break
        return {"loss": 0.25}

    t = load_task(array_task(train=train))
    train_ds, _ = t.load_data(0, 1)
    cfg = TrainConfig(local_steps=7, batch_size=8, lr=0.1, device="cpu")
    r = local_train(_fresh(t), train_ds, cfg, seed=1, device=CPU, task=t)
    assert seen == {"steps": 7, "len": 7} and r.steps == 7 and r.loss == 0.25
    # fedasync's loop with the same seed gives the same model: the override saw the same plan
    plain = local_train(_fresh(t), train_ds, cfg, seed=1, device=CPU)
    assert all(np.array_equal(r.params[k], plain.params[k]) for k in r.params)

    def short(model, loader, optimizer, steps):
        for xb, yb in loader:
            optimizer.zero_grad()
            nn.functional.cross_entropy(model(xb), yb).backward()
            optimizer.step()
            break
        return {}

    t2 = load_task(array_task(train=short))
    with pytest.raises(TaskError, match=r"^task array_task: train\(model, loader, optimizer, steps\) called "
                                        r"optimizer.step\(\) 1 times, the step budget is 7"):
        local_train(_fresh(t2), train_ds, cfg, seed=1, device=CPU, task=t2)


def _pconf(**kw):
    d = {"accountant": "rdp", "delta": 1e-5, "epsilon": None, "noise_multiplier": 1.1, "max_grad_norm": 1.0,
         "history": [], "reproducible_noise": True, "grad_sample_mode": "ghost"}
    d.update(kw)
    return d


def test_train_override_under_dp_gets_opacus_objects_and_a_step_mismatch_is_an_error():
    from opacus import GradSampleModule
    from opacus.optimizers import DPOptimizer

    from fedasync.privacy.dp import private_task

    got = {}

    def make(extra):
        def train(model, loader, optimizer, steps):
            got.update(model=type(model), optimizer=type(optimizer), sampler=type(loader.batch_sampler).__name__)
            done = 0
            while done < steps + extra:
                for xb, yb in loader:
                    optimizer.zero_grad()
                    nn.functional.cross_entropy(model(xb), yb).backward()
                    optimizer.step()
                    done += 1
                    if done == steps + extra:
                        break
            return {"loss": 1.0}
        return train

    cfg = TrainConfig(local_steps=4, batch_size=8, lr=0.1, device="cpu")
    t = load_task(array_task(train=make(0)))
    data, _ = t.load_data(0, 1)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        out = private_task(_fresh(t), data, None, cfg, 1, CPU, _pconf(grad_sample_mode="hooks"), task=t)
    assert out.refused is None and out.metrics["dp_steps"] == 4
    assert issubclass(got["model"], GradSampleModule) and issubclass(got["optimizer"], DPOptimizer)
    assert got["sampler"] == "UniformWithReplacementSampler"  # Opacus' Poisson sampling
    t2 = load_task(array_task(train=make(1)))  # one step more than accounted for
    with warnings.catch_warnings(), pytest.raises(TaskError, match=r"called optimizer.step\(\) 5 times, the step "
                                                                   r"budget is 4"):
        warnings.simplefilter("ignore")
        private_task(_fresh(t2), data, None, cfg, 1, CPU, _pconf(grad_sample_mode="hooks"), task=t2)


def test_user_task_under_local_dp_trains_and_its_accounting_is_the_privacy_math():
    from fedasync.privacy.dp import private_task

    t = load_task(dict_task())
    data, _ = t.load_data(1, 2)
    cfg = TrainConfig(local_steps=6, batch_size=8, lr=0.1, device="cpu")
    runs = []
    for _ in range(2):
        m = _fresh(t)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            # ghost clipping needs criterion(outputs, targets): with the task's own loss it runs as hooks
            runs.append(private_task(m, data, None, cfg, 5, CPU, _pconf(epsilon=50.0), task=t))
    a, b = runs
    assert a.refused is None
    q = sample_rate_for(len(data), cfg.batch_size)
    history = extend_history([], 1.1, q, 6, "rdp")
    assert a.metrics["sample_rate"] == q and a.metrics["dp_steps"] == 6
    assert a.metrics["accountant_history"] == [[1.1, q, 6]]
    assert a.metrics["epsilon"] == pytest.approx(epsilon_of(history, 1e-5, "rdp"))
    assert all(np.array_equal(a.train.params[k], b.train.params[k]) for k in a.train.params)  # reproducible noise
    p0 = init_params(t, 0)
    assert any(not np.array_equal(a.train.params[k], p0[k]) for k in p0)


def test_a_model_opacus_cannot_train_names_the_layer_and_the_fix():
    from fedasync.privacy.dp import check_model

    def model():
        return nn.Sequential(nn.Linear(6, 8), nn.BatchNorm1d(8), nn.Linear(8, 2))

    t = load_task(array_task(model=model))
    with pytest.raises(PrivacyError, match=r"^model: Opacus cannot train .*BatchNorm at 1.*"
                                           r"privacy\.local_dp\.fix_model: true"):
        check_model(t.model())
    dp = ["privacy.local_dp.enabled=true", "privacy.local_dp.epsilon=5"]
    with pytest.raises(TaskError, match=r"^task array_task: model: Opacus cannot train it under DP-SGD: BatchNorm at 1 "
                                        r".*Set privacy\.local_dp\.fix_model: true"):
        task_from_config(load_config(None, dp), task=array_task(model=model))
    cfg = load_config(None, dp + ["privacy.local_dp.fix_model=true"])
    fixed = task_from_config(cfg, task=array_task(model=model))
    m = fixed.model()
    assert isinstance(m[1], nn.GroupNorm)
    check_model(m)  # trainable now
    assert not task_from_config(Config(), task=array_task(model=model)).fix_model  # off by default


# -- loading: module name, path, object; every bad input is one line ----------------------------------------


MODULE = textwrap.dedent("""
    import numpy as np
    from torch import nn

    def model(width=4):
        return nn.Linear(3, width)

    def load_data(partition_id, num_partitions, width=4, data_path=None):
        x = np.ones((5, 3), np.float32) * partition_id
        return (x, np.zeros(5, np.int64)), (x, np.zeros(5, np.int64))
""")


def test_a_module_by_name_from_base_dir_and_by_path(tmp_path):
    (tmp_path / "t33_mod_a.py").write_text(MODULE)
    t = load_task("t33_mod_a", {"width": 6}, base_dir=tmp_path)
    assert t.name == "t33_mod_a" and t.model().out_features == 6
    import hashlib

    assert t.digest == hashlib.sha256((tmp_path / "t33_mod_a.py").read_bytes()).hexdigest()
    p = load_task("./t33_mod_a.py", base_dir=tmp_path)
    assert p.digest == t.digest and len(p.load_data(2, 3)[0]) == 5
    cfg = load_config(None, ["task=t33_mod_a", "task_args.width=2"])
    assert task_from_config(cfg, base_dir=tmp_path).model().out_features == 2


@pytest.mark.parametrize("source,pattern", [
    ("import not_a_module_t33\n", r"^task {name}: the module does not import: ModuleNotFoundError: No module named "
                                  r"'not_a_module_t33'$"),
    ("raise ImportError('needs libfoo')\n", r"^task {name}: the module does not import: ImportError: needs libfoo$"),
    ("def load_data(partition_id, num_partitions):\n    pass\n", r"^task {name}: no model function"),
    ("def model():\n    pass\n", r"^task {name}: no load_data function"),
    ("def model(x, y):\n    pass\ndef load_data(partition_id, num_partitions):\n    pass\n",
     r"^task {name}: model\(x, y\) cannot be called as model\(no arguments\)"),
    ("def model():\n    pass\ndef load_data(partition_id):\n    pass\n",
     r"^task {name}: load_data\(partition_id\) cannot be called as load_data\(partition_id, num_partitions\)"),
    ("def model():\n    pass\ndef load_data(partition_id, num_partitions):\n    pass\ndef loss(batch):\n    pass\n",
     r"^task {name}: loss\(batch\) cannot be called as loss\(model, batch\)"),
    ("def model():\n    pass\ndef load_data(a, b):\n    pass\ndef evaluate(model):\n    pass\n",
     r"^task {name}: evaluate\(model\) cannot be called as evaluate\(model, loader\)"),
    ("def model():\n    pass\ndef load_data(a, b):\n    pass\ndef train(model, loader):\n    pass\n",
     r"^task {name}: train\(model, loader\) cannot be called as train\(model, loader, optimizer, steps\)"),
])
def test_bad_modules_are_one_line_naming_the_function(tmp_path, source, pattern):
    import re

    name = f"t33_bad_{abs(hash(source)) % 10**8}"
    (tmp_path / f"{name}.py").write_text(source)
    with pytest.raises(TaskError) as e:
        load_task(name, base_dir=tmp_path)
    assert re.match(pattern.format(name=name), str(e.value)), str(e.value)
    assert "\n" not in str(e.value)


def test_other_bad_inputs_are_one_line(tmp_path):
    with pytest.raises(TaskError, match=r"^task t33_nowhere: no module named 't33_nowhere' in .* or the environment$"):
        load_task("t33_nowhere", base_dir=tmp_path)
    with pytest.raises(TaskError, match=r"^task ./gone.py: no such file"):
        load_task("./gone.py", base_dir=tmp_path)
    with pytest.raises(TaskError, match=r"^task array_task: model\(\) cannot be called as model\(hidden=\)"):
        load_task(array_task(model=lambda: nn.Linear(6, 2)), {"hidden": 3})  # a task_arg model() does not take
    bad_model = load_task(array_task(model=lambda hidden=8, scale=1.0: "not a model"))
    with pytest.raises(TaskError, match=r"^task array_task: model\(...\) returned str, not a torch.nn.Module$"):
        bad_model.model()
    one = load_task(array_task(load_data=lambda partition_id, num_partitions, **kw: _arrays()))
    with pytest.raises(TaskError, match=r"^task array_task: load_data\(...\) returned \(x, y\) arrays; expected "
                                        r"\(train, test\), each a Dataset or \(x, y\) arrays$"):
        one.load_data(0, 1)
    ragged = load_task(array_task(load_data=lambda p, n, **kw: ((np.ones((3, 2)), np.ones(4)), (None, None))))
    with pytest.raises(TaskError, match=r"^task array_task: load_data\(...\)\[0\] \(train\): x has 3 rows but y has 4$"):
        ragged.load_data(0, 1)
    bad_loss = load_task(array_task(loss=lambda model, batch: torch.ones(3)))
    with pytest.raises(TaskError, match=r"^task array_task: loss\(model, batch\) returned a tensor of shape \(3,\)"):
        bad_loss.loss(bad_loss.model(), next(iter(bad_loss.load_data(0, 1)[0])))
    bad_eval = load_task(array_task(evaluate=lambda model, loader: {"acc": "high"}))
    with pytest.raises(TaskError, match=r"^task array_task: evaluate\(model, loader\): every metric must be a number"):
        evaluate(bad_eval, bad_eval.model(), bad_eval.load_centralized())


def test_an_empty_centralized_set_is_one_line():
    t = load_task(array_task(load_centralized=lambda **kw: (np.zeros((0, 6), np.float32), np.zeros(0, np.int64))))
    with pytest.raises(TaskError, match=r"^task array_task: load_centralized\(...\): the Dataset yields nothing"):
        t.load_centralized()


def test_a_dataset_that_yields_nothing_is_an_error_where_data_is_first_loaded():
    from fedasync.clients.runner import handle_train
    from fedasync.server.transport import client_setup_json

    empty = array_task(load_data=lambda partition_id, num_partitions, **kw: (
        TensorDataset(torch.zeros(0, 6), torch.zeros(0, dtype=torch.int64)), _arrays()))
    cfg = load_config(None, ["data.num_clients=2", "server.concurrency=1", "server.buffer_size=1"])
    t = task_from_config(cfg, task=empty)
    setup = client_setup_json(cfg, task=t)
    with pytest.raises(TaskError, match=r"^task array_task: load_data\(1, 2\)\[0\] \(train\): the Dataset yields "
                                        r"nothing \(len 0\)$"):
        handle_train(get_params(t.model()), {"setup": setup, "client_id": 1, "seed": 3})


# -- the built-in task through the interface --------------------------------------------------------------


def test_the_builtin_task_is_the_builtin_path_bit_for_bit():
    from fedasync.task.data import load_federated
    from fedasync.task.models import init_params as builtin_init

    cfg = Config()
    digits = load_federated(cfg.data, cfg.seed)
    t = task_from_config(cfg)
    assert t.name == "builtin" and t.fns.keys() == {"model", "load_data", "load_centralized"}
    p_task, p_old = init_params(t, 4), builtin_init(cfg.model, digits.input_shape, digits.num_classes, 4)
    assert list(p_task) == list(p_old) and all(np.array_equal(p_task[k], p_old[k]) for k in p_old)
    train, test = t.load_data(2, cfg.data.num_clients)
    x, y = digits.partitions[2]
    assert len(train) == len(y) and len(test) == len(digits.y_test)
    tcfg = TrainConfig(local_steps=9, batch_size=8, lr=0.1, momentum=0.5, device="cpu")
    m1, m2 = t.model(), t.model()
    set_params(m1, p_old)
    set_params(m2, p_old)
    a = local_train(m1, train, tcfg, seed=11, device=CPU, task=t)
    b = local_train(m2, x, y, tcfg, seed=11, device=CPU)  # the array path of before
    assert all(np.array_equal(a.params[k], b.params[k]) for k in a.params) and a.loss == b.loss
    loss, acc = evaluate(m1, digits.x_test, digits.y_test)
    assert evaluate(t, m1, t.load_centralized()) == {"loss": loss, "accuracy": acc}
    g_new, g_old = gradient(m1, t.load_centralized(), task=t), gradient(m1, digits.x_test, digits.y_test)
    assert all(np.array_equal(g_new[k], g_old[k]) for k in g_old)


def test_a_task_object_reaches_an_in_process_client():
    """The Python API's object (functions defined here) is what the local backend's client trains."""
    from fedasync.clients.runner import handle_train
    from fedasync.server.transport import client_setup_json

    cfg = load_config(None, ["data.num_clients=3", "server.concurrency=1", "server.buffer_size=1",
                             "train.local_steps=5", "train.device=cpu"])
    t = task_from_config(cfg, task=dict_task())
    setup = json.loads(client_setup_json(cfg, task=t))
    assert setup["task"] == {"name": "dict_task", "digest": t.digest, "args": {}, "base_dir": None}
    assert "data" not in setup and "model" not in setup  # never code, nothing of the built-in task
    p0 = init_params(t, cfg.seed)
    out = handle_train(p0, {"setup": json.dumps(setup, sort_keys=True), "client_id": 2, "seed": 9})
    m = t.model()
    set_params(m, p0)
    ref = local_train(m, t.load_data(2, 3)[0], TrainConfig(local_steps=5, device="cpu"), seed=9, device=CPU, task=t)
    assert out["metrics"]["steps"] == 5
    assert all(np.array_equal(out["params"][k], ref.params[k]) for k in ref.params)


# -- deployment: a device imports its own task; a different module is refused -------------------------------


def _module_setup(tmp_path, name, source):
    (tmp_path / f"{name}.py").write_text(source)
    cfg = load_config(None, ["data.num_clients=3", "server.concurrency=1", "server.buffer_size=1",
                             f"task={name}", "train.local_steps=2", "train.device=cpu"])
    t = task_from_config(cfg, base_dir=tmp_path)
    return t, client_setup_json_for(cfg, t)


def client_setup_json_for(cfg, t):
    from fedasync.server.transport import client_setup_json

    return client_setup_json(cfg, task=t)


def test_a_device_refuses_a_task_whose_module_differs(tmp_path, monkeypatch, caplog):
    from fedasync.clients.runner import handle_train

    t, setup = _module_setup(tmp_path, "t33_dev_task", MODULE)
    params = init_params(t, 0)
    task = {"setup": setup, "client_id": 0, "seed": 1, "task_id": 7, "deployment": True}
    # the device's environment holds the same module: it trains
    monkeypatch.syspath_prepend(str(tmp_path))
    ok = handle_train(params, task, device_node=True, node_task="t33_dev_task")
    assert "refused" not in ok and ok["metrics"]["steps"] == 2
    # another module name on the device
    (tmp_path / "t33_other.py").write_text(MODULE)
    with caplog.at_level("WARNING", logger="fedasync.task"):
        out = handle_train(params, task, device_node=True, node_task="t33_other")
    assert out["refused"] == "task_mismatch" and "the server's task is 't33_dev_task'" in out["metrics"]["task_rule"]
    assert "task mismatch: refused task 7" in caplog.text
    # the same name, another source (the device's copy was edited): the digest differs
    other = tmp_path / "dev"
    other.mkdir()
    (other / "t33_dev_task2.py").write_text(MODULE + "\n# edited on the device\n")
    (tmp_path / "t33_dev_task2.py").write_text(MODULE)
    t2, setup2 = _module_setup(tmp_path, "t33_dev_task2", MODULE)
    monkeypatch.syspath_prepend(str(other))  # the device imports its own copy
    import sys

    sys.modules.pop("t33_dev_task2", None)
    out2 = handle_train(params, {**task, "setup": setup2}, device_node=True, node_task="t33_dev_task2")
    assert out2["refused"] == "task_mismatch" and "differs from the server's" in out2["metrics"]["task_rule"]
    # a device with a task of its own, sent the built-in task
    from fedasync.server.transport import client_setup_json

    builtin = client_setup_json(Config())
    out3 = handle_train(get_params(builtin_task(Config().data, Config().model, 0).model()),
                        {**task, "setup": builtin}, device_node=True, node_task="t33_dev_task")
    assert out3["refused"] == "task_mismatch" and "built-in task" in out3["metrics"]["task_rule"]
