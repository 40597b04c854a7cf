"""The Python API (issue 33): fedasync.simulate / fedasync.compare, Result, a task object, and the
assembly through which a run's parts are built (and swapped)."""

import types

import numpy as np
import pytest
import torch

import fedasync
from fedasync.assembly import RunParts, assemble
from fedasync.config import ConfigError
from fedasync.runs import RunError
from fedasync.server.loop import AsyncServer
from fedasync.server.scheduler import Scheduler
from fedasync.server.transport import LocalTransport
from fedasync.store import Store

from conftest import SMALL, small_config

pytestmark = pytest.mark.usefixtures("one_thread")


def test_two_simulate_calls_in_one_process(tmp_path):
    """A dict config with ``set``: two runs in one process (local backend: no Ray, no subprocess)
    are independent and identical; the Result holds the summary, the history, the run directory,
    the store, the final parameters and the model."""
    cfg = small_config().model_dump(mode="json")
    r1 = fedasync.simulate(cfg, set={"server.max_versions": 8}, out=tmp_path / "a")
    r2 = fedasync.simulate(cfg, set={"server.max_versions": 8}, out=tmp_path / "b")
    assert isinstance(r1, fedasync.Result)
    assert r1.summary["versions"] == 8 and r1.summary["stop_reason"] == "max_versions"
    assert r1.summary["model_sha256"] == r2.summary["model_sha256"]
    assert r1.history == r2.history == r1.summary["history"]
    assert [h["version"] for h in r1.history] == [0, 2, 4, 6, 8]
    assert {"accuracy", "loss"} <= set(r1.history[-1])
    assert r1.run_dir == tmp_path / "a" and (r1.run_dir / "summary.json").is_file()
    assert (r1.run_dir / "history.csv").is_file() and (r1.run_dir / "accuracy.png").is_file()
    assert r1.store_url == f"sqlite:///{tmp_path / 'a' / 'fedasync.db'}" != r2.store_url
    from fedasync.server.strategies import params_sha256

    assert params_sha256(r1.params) == r1.summary["model_sha256"]
    net = r1.model()
    assert isinstance(net, torch.nn.Module)
    sd = net.state_dict()
    assert set(sd) == set(r1.params)
    assert all(np.array_equal(sd[k].numpy(), r1.params[k]) for k in sd)


def test_config_forms_and_bad_input(tmp_path):
    """A path, a dict, a Config: the same run; a bad key or value raises one line, nothing written."""
    from fedasync.config import load_config

    path = tmp_path / "c.yaml"
    cfg = small_config("server.max_versions=4")
    path.write_text(cfg.to_yaml())
    a = fedasync.simulate(str(path), out=tmp_path / "p")
    b = fedasync.simulate(cfg, out=tmp_path / "c")
    c = fedasync.simulate(load_config(None, SMALL), set={"server.max_versions": 4}, out=tmp_path / "d")
    assert a.summary["model_sha256"] == b.summary["model_sha256"] == c.summary["model_sha256"]
    with pytest.raises(ConfigError) as e:
        fedasync.simulate(cfg, set={"server.concurrency": 0}, out=tmp_path / "bad")
    assert "server.concurrency" in str(e.value)
    with pytest.raises(RunError) as e:
        fedasync.simulate(cfg, backend="ray", out=tmp_path / "bad")
    assert "--backend" in str(e.value)
    assert not (tmp_path / "bad").exists()


def _task_object(calls: list):
    """A small task as a notebook would define it: functions on a namespace, no module file."""
    rng = np.random.default_rng(0)
    w = rng.normal(size=(6,)).astype(np.float32)
    x = rng.normal(size=(400, 6)).astype(np.float32)
    y = (x @ w + 0.1 * rng.normal(size=400)).astype(np.float32)[:, None]

    def model():
        return torch.nn.Linear(6, 1)

    def load_data(partition_id, num_partitions):
        calls.append(partition_id)
        idx = np.arange(partition_id, 300, num_partitions)
        return (x[idx], y[idx]), (x[300:], y[300:])

    def loss(model, batch):
        xb, yb = batch
        return torch.nn.functional.mse_loss(model(xb), yb)

    def evaluate(model, loader):
        se, n = 0.0, 0
        for xb, yb in loader:
            se += float(((model(xb) - yb) ** 2).sum())
            n += len(yb)
        return {"rmse": (se / n) ** 0.5, "mse": se / n}

    return types.SimpleNamespace(model=model, load_data=load_data, loss=loss, evaluate=evaluate)


def test_a_task_object_defined_here_runs_to_an_rmse_target(tmp_path):
    """``task=`` an object with the task's functions: the server evaluates its metrics, the
    clients train its model with its loss; mode min on rmse reaches the target and stops."""
    calls: list = []
    task = _task_object(calls)
    sets = {"data.num_clients": 4, "server.concurrency": 2, "server.buffer_size": 2, "server.eval_every": 1,
            "server.max_versions": 40, "train.local_steps": 5, "train.lr": 0.05,
            "server.target": {"metric": "rmse", "value": 0.5, "mode": "min"}, "server.stop_at_target": True}
    r = fedasync.simulate(small_config("server.target_accuracy=null").model_dump(mode="json"), set=sets, task=task,
                          out=tmp_path)
    assert set(calls) == {0, 1, 2, 3}
    assert all(set(h) == {"version", "virtual_time_s", "rmse", "mse"} for h in r.history)
    assert r.history[0]["rmse"] > 0.5 >= r.history[-1]["rmse"]
    assert r.summary["stop_reason"] == "target" and r.summary["updates_accepted"] > 0
    assert r.summary["final_accuracy"] is None
    net = r.model()
    assert isinstance(net, torch.nn.Linear)
    assert np.array_equal(net.weight.detach().numpy(), r.params["weight"])


def test_compare_from_python(tmp_path):
    out = fedasync.compare(small_config("server.max_versions=6").model_dump(mode="json"), "fedbuff,fedasync:alpha=0.5",
                           out=tmp_path)
    assert set(out["results"]) == {"fedbuff", "fedasync-alpha=0.5"}
    assert out["results"]["fedasync-alpha=0.5"].run_dir == tmp_path / "fedasync-alpha=0.5"
    assert out["results"]["fedasync-alpha=0.5"].summary["strategy"] == "fedasync"
    assert (tmp_path / "comparison.json").is_file()
    assert out["comparison"]["time_to_target_ratio"] == {"fedbuff": None, "fedasync-alpha=0.5": None}
    with pytest.raises(ConfigError) as e:
        fedasync.compare(small_config().model_dump(mode="json"), "fedbuff,fedbuff", out=tmp_path / "x")
    assert "listed twice" in str(e.value)


class _LastFirst(Scheduler):
    """A scheduler object of the test's own: always the highest idle client id."""

    name = "last_first"

    def __init__(self):
        super().__init__(0)
        self.dispatched = []

    def choose(self, idle):
        return max(idle)

    def on_dispatch(self, client, now, version):
        self.dispatched.append(client)


def test_a_part_swapped_through_the_assembly(tmp_path):
    """assemble(scheduler=..., strategy=...) hands those objects to the loop as they are."""
    from fedasync.server.strategies import make_strategy

    cfg = small_config("server.max_versions=4")
    sched = _LastFirst()
    strategy = make_strategy(cfg.server, cfg.weighting, cfg.seed)
    parts = assemble(cfg, scheduler=sched, strategy=strategy)
    assert isinstance(parts, RunParts) and parts.scheduler is sched and parts.strategy is strategy
    st = Store(f"sqlite:///{tmp_path / 's.db'}")
    srv = AsyncServer(cfg, LocalTransport(), st, parts=parts)
    assert srv.scheduler is sched and srv.strategy is strategy
    srv.run()
    assert sched.dispatched[:5] == [19, 18, 17, 16, 15]
    assert [d.client_id for d in st.dispatches(srv.run_id)][:5] == [19, 18, 17, 16, 15]
    st.close()


def test_zeno_validates_a_user_task_with_its_own_loss():
    """server.robust.filter zeno++ on a user task: the validation gradient is the gradient of the
    task's loss over (here: all of) the pooled training sets, at the model it is given."""
    task = _task_object([])
    cfg = small_config("data.num_clients=4", "server.concurrency=2", "server.robust.filter=zeno++",
                       "server.robust.validation_size=1000",
                       "server.target_accuracy=null")
    parts = assemble(cfg, task=task)
    params = parts.initial_params()
    grad = parts.policy._zeno_grad(params)
    model = parts.new_model(params)
    xs, ys = zip(*(task.load_data(c, 4)[0] for c in range(4)))
    x, y = torch.from_numpy(np.concatenate(xs)), torch.from_numpy(np.concatenate(ys))
    torch.nn.functional.mse_loss(model(x), y).backward()
    assert set(grad) == set(params)
    for k, p in model.named_parameters():
        np.testing.assert_allclose(grad[k], p.grad.numpy(), rtol=1e-5, atol=1e-6)


def test_the_cli_refuses_a_task_that_does_not_load_and_writes_nothing(tmp_path):
    from typer.testing import CliRunner

    from fedasync.cli import app

    out = tmp_path / "run"
    res = CliRunner().invoke(app, ["simulate", "--backend", "local", "--out", str(out),
                                   *[a for s in SMALL for a in ("--set", s)], "--set", "task=./no_such_task.py"])
    assert res.exit_code == 2, res.output
    assert "task ./no_such_task.py: no such file" in res.output
    assert not out.exists()
