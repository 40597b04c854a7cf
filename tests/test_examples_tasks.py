"""The user-task examples of issue 33 (``examples/*_task.py``), each run at a small size through
``fedasync.simulate``: a regression with RMSE as a ``mode: min`` target, a sequence task whose
Dataset yields dicts (its own loss and metrics), and the MNIST CNN written as a user task, which
trains the same model (sha256) as the built-in ``fedavg_cnn`` path for the same seed. Also
``fedasync client --task``: the node config carries the task, a bad task is one line."""

from __future__ import annotations

import json
import os
import re
from pathlib import Path

import numpy as np
import pytest
import yaml
from typer.testing import CliRunner

pytestmark = pytest.mark.usefixtures("one_thread")

EXAMPLES = Path(__file__).resolve().parents[1] / "fedasync" / "examples"


def _example(name: str) -> dict:
    return yaml.safe_load((EXAMPLES / name).read_text())


def test_each_example_task_provides_the_interface_and_its_data_is_deterministic():
    """Every function of each example through fedasync's loader: datasets non-empty, the model
    takes a batch, the loss is a scalar, evaluate returns the metrics the YAML aims at; two loads
    give identical data (a device and the simulation make the same samples)."""
    import torch
    from torch.utils.data import DataLoader

    from fedasync.task.interface import check_nonempty, load_task

    for task_file, yaml_file, metric in (("diabetes_task", "diabetes.yaml", "rmse"),
                                         ("sequence_task", "sequence.yaml", "accuracy")):
        cfg = _example(yaml_file)
        assert cfg["task"] == task_file and cfg["server"]["target"]["metric"] == metric
        task = load_task(cfg["task"], cfg["task_args"], EXAMPLES)
        n = cfg["data"]["num_clients"]
        train, test = task.load_data(n - 1, n)
        check_nonempty(train, "train")
        check_nonempty(test, "test")
        again, _ = task.load_data(n - 1, n)
        b1, b2 = next(iter(DataLoader(train, batch_size=8))), next(iter(DataLoader(again, batch_size=8)))
        for t1, t2 in zip(*(b.values() if isinstance(b, dict) else b for b in (b1, b2))):
            assert torch.equal(t1, t2)
        model = task.model()
        loss = task.loss(model, b1)
        assert loss.ndim == 0 and torch.isfinite(loss)
        metrics = task.evaluate(model, DataLoader(task.load_centralized(), batch_size=64))
        assert metric in metrics and "loss" in metrics


@pytest.mark.parametrize("yaml_file, batch, metrics", [
    ("diabetes.yaml", "first batch ([8, 10] float32, [8] float32)", r"loss [\d.]+, rmse [\d.]+"),
    ("sequence.yaml", "first batch {signal: [16, 1, 64] float32, label: [16] int64}", r"loss [\d.]+, accuracy [01]\.?\d*"),
])
def test_task_check_on_each_example_takes_a_dp_step_with_the_tasks_own_loss(yaml_file, batch, metrics):
    """fedasync task check under local DP for the examples that bring their own loss: the step is
    DP-SGD as a run's client takes it (ghost clipping asked for, hooks used: Opacus' ghost mode
    computes only the default loss); the first batch's structure, the parameter count, the metrics the
    task's evaluate names (their values follow the step's secret noise, so only their form is pinned)."""
    from fedasync.cli import app

    r = CliRunner().invoke(app, ["task", "check", str(EXAMPLES / yaml_file), "--set", "privacy.local_dp.enabled=true",
                                 "--set", "privacy.local_dp.epsilon=8"], env={"COLUMNS": "300"})
    assert r.exit_code == 0, r.output
    assert batch in r.output and "parameters" in r.output
    assert re.search(r"evaluate on load_centralized\(\) \(\d+ samples\): " + metrics + r"\n", r.output), r.output
    assert "one DP-SGD (noise multiplier" in r.output and r.output.strip().endswith("ok")


def _small(**extra) -> dict:
    sets = {"server.max_versions": 12, "server.eval_every": 4, "store.save_parameters": False}
    sets.update(extra)
    return sets


def test_diabetes_regression_reaches_an_rmse_target_with_mode_min(tmp_path):
    import fedasync

    res = fedasync.simulate(str(EXAMPLES / "diabetes.yaml"), out=tmp_path / "run",
                            set=_small(**{"server.target.value": 70.0}))
    hist = res.history
    assert all("rmse" in h and "loss" in h for h in hist)
    assert "accuracy" not in hist[-1]  # a regression: only the metrics its evaluate returns
    first, last = hist[0]["rmse"], hist[-1]["rmse"]
    assert first > 70.0 > last  # learned from the mean's ~77 to below the target
    s = res.summary
    assert s["versions"] == 12
    from fedasync.server.evaluation import Goal, time_to_target

    held = time_to_target(hist, Goal("rmse", 70.0, "min"), s["target_hold"])  # held target_hold evaluations
    assert held is not None and s["time_to_target_s"] == pytest.approx(held)
    rows = (tmp_path / "run" / "history.csv").read_text().splitlines()
    assert "rmse" in rows[0].split(",")


def test_sequence_task_with_dict_batches_and_its_own_loss_learns(tmp_path):
    import fedasync

    res = fedasync.simulate(str(EXAMPLES / "sequence.yaml"), out=tmp_path / "run",
                            set=_small(**{"server.max_versions": 24, "server.eval_every": 8,
                                          "task_args.samples": 64}))
    hist = res.history
    assert hist[0]["accuracy"] < 0.5  # three classes: chance is 1/3
    assert hist[-1]["accuracy"] > 0.75
    assert res.summary["versions"] == 24
    assert res.summary["target"] == {"metric": "accuracy", "value": 0.9, "mode": "max"}


def _mnist_like(path: Path) -> None:
    """A small MNIST-shaped file: uint8 8x8 images of 4 learnable classes (a bright row each), as
    tests/test_data_files.py makes them."""
    def images(n, seed):
        rng = np.random.default_rng(seed)
        y = np.arange(n) % 4
        rng.shuffle(y)
        x = rng.integers(0, 60, size=(n, 8, 8)).astype(np.uint8)
        for i, c in enumerate(y):
            x[i, 2 * c: 2 * c + 2, :] = 250
        return x, y.astype(np.int64)

    x, y = images(160, 0)
    xt, yt = images(40, 1)
    np.savez(path, x_train=x, y_train=y, x_test=xt, y_test=yt)


def test_mnist_as_a_user_task_trains_the_same_model_as_the_builtin_path(tmp_path):
    """examples/mnist_task.py and the built-in fedavg_cnn on the same file, IID split, seed and
    server: the final models are identical (sha256), so the user-task path adds nothing and
    loses nothing."""
    import fedasync

    npz = tmp_path / "mnist.npz"
    _mnist_like(npz)
    common = {"server.max_versions": 6, "server.eval_every": 3, "server.eval_every_s": None, "server.concurrency": 4,
              "server.buffer_size": 2, "data.num_clients": 4, "train.local_steps": 3, "seed": 7}
    builtin = dict(common, **{"task": None, "data.dataset": "files", "data.path": str(npz),
                              "data.partitioner": "iid", "model.name": "fedavg_cnn"})
    user = dict(common, **{"task_args.path": str(npz), "task_args.side": 8, "task_args.num_classes": 4})
    a = fedasync.simulate(str(EXAMPLES / "mnist_task.yaml"), set=builtin, out=tmp_path / "builtin")
    b = fedasync.simulate(str(EXAMPLES / "mnist_task.yaml"), set=user, out=tmp_path / "user")
    assert a.summary["versions"] == b.summary["versions"] == 6
    assert a.summary["model_sha256"] == b.summary["model_sha256"]
    assert [h["accuracy"] for h in a.history] == [h["accuracy"] for h in b.history]
    # and the seed matters: another seed, another model
    c = fedasync.simulate(str(EXAMPLES / "mnist_task.yaml"), set=dict(user, seed=8), out=tmp_path / "user8")
    assert c.summary["model_sha256"] != b.summary["model_sha256"]


# -- fedasync client --task ---------------------------------------------------------------------


def _client_args(*extra: str) -> list[str]:
    return ["client", "--superlink", "127.0.0.1:9092", "--partition-id", "1", "--num-partitions", "4",
            "--insecure", "--no-signing", "--no-supernode-auth", *extra]


def test_client_task_reaches_the_clientapp_as_node_config(tmp_path, monkeypatch):
    from fedasync.cli import app

    monkeypatch.chdir(EXAMPLES)  # the device's environment: the task module imports from here
    started = {}
    monkeypatch.setattr(os, "execve", lambda exe, cmd, env: started.setdefault("cmd", cmd))
    r = CliRunner().invoke(app, _client_args("--task", "sequence_task", "--privacy-state-dir", str(tmp_path / "s")))
    assert r.exit_code == 0, r.output
    cmd = started["cmd"]
    node = dict(kv.split("=", 1) for kv in cmd[cmd.index("--node-config") + 1].split(" "))
    assert json.loads(node["task"]) == "sequence_task"
    assert "data-path" not in node


def test_client_task_with_its_own_data_file(tmp_path, monkeypatch):
    """--data with --task is whatever the task's load_data reads (here mnist_task's x/y .npz)."""
    from fedasync.cli import app

    monkeypatch.chdir(EXAMPLES)
    x = np.random.default_rng(0).integers(0, 255, size=(20, 8, 8)).astype(np.uint8)
    np.savez(tmp_path / "mine.npz", x=x, y=np.arange(20) % 4)
    started = {}
    monkeypatch.setattr(os, "execve", lambda exe, cmd, env: started.setdefault("cmd", cmd))
    r = CliRunner().invoke(app, _client_args("--task", "mnist_task", "--data", str(tmp_path / "mine.npz"),
                                             "--privacy-state-dir", str(tmp_path / "s")))
    assert r.exit_code == 0, r.output
    cmd = started["cmd"]
    node = dict(kv.split("=", 1) for kv in cmd[cmd.index("--node-config") + 1].split(" "))
    assert json.loads(node["task"]) == "mnist_task"
    assert json.loads(node["data-path"]) == str((tmp_path / "mine.npz").resolve())


@pytest.mark.parametrize("task, said", [
    ("no_such_task_module", "--task: task no_such_task_module: no module named"),
    ("./missing_task.py", "--task: task ./missing_task.py: no such file"),
])
def test_client_refuses_a_task_it_cannot_import(tmp_path, monkeypatch, task, said):
    from fedasync.cli import app

    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(os, "execve", lambda *a: pytest.fail("the SuperNode must not start"))
    r = CliRunner().invoke(app, _client_args("--task", task, "--privacy-state-dir", str(tmp_path / "s")),
                           env={"COLUMNS": "300"})
    assert r.exit_code == 2 and said in r.output, r.output
    assert len(r.output.strip().splitlines()) == 1
    assert not (tmp_path / "s").exists()


def test_client_refuses_a_task_that_cannot_load_the_devices_data(tmp_path, monkeypatch):
    from fedasync.cli import app

    (tmp_path / "broken_task.py").write_text(
        "import torch\n"
        "def model():\n    return torch.nn.Linear(2, 2)\n"
        "def load_data(partition_id, num_partitions, data_path=None):\n"
        "    return open(data_path).read(), None\n")
    (tmp_path / "data.bin").write_bytes(b"\xff\xfe")
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(os, "execve", lambda *a: pytest.fail("the SuperNode must not start"))
    r = CliRunner().invoke(app, _client_args("--task", "broken_task", "--data", "data.bin",
                                             "--privacy-state-dir", str(tmp_path / "s")), env={"COLUMNS": "300"})
    assert r.exit_code == 2 and "--task: task broken_task: load_data(1, 4, data_path=...) raised" in r.output, r.output
    assert len(r.output.strip().splitlines()) == 1


def test_server_refuses_a_task_that_does_not_import_before_anything_starts(tmp_path, monkeypatch):
    """fedasync server imports a YAML's task from the YAML's folder, before any SuperLink starts."""
    from fedasync.cli import app

    (tmp_path / "cfgs").mkdir()
    cfg = tmp_path / "cfgs" / "t.yaml"
    cfg.write_text(yaml.safe_dump({"name": "t", "task": "not_here_task", "data": {"num_clients": 2},
                                   "server": {"concurrency": 2, "buffer_size": 2}}))
    monkeypatch.chdir(tmp_path)
    r = CliRunner().invoke(app, ["server", str(cfg), "--insecure", "--no-supernode-auth", "--no-signing",
                                 "--out", str(tmp_path / "run")], env={"COLUMNS": "300"})
    assert r.exit_code == 2, r.output
    assert f"task not_here_task: no module named 'not_here_task' in {tmp_path / 'cfgs'}" in r.output
    assert not (tmp_path / "run").exists()
    (tmp_path / "cfgs" / "not_here_task.py").write_text("def model():\n    return 1\n"
                                                       "def load_data(partition_id, num_partitions):\n    return 0\n")
    r = CliRunner().invoke(app, ["server", str(cfg), "--insecure", "--no-supernode-auth", "--no-signing",
                                 "--out", str(tmp_path / "run")], env={"COLUMNS": "300"})
    assert r.exit_code == 2 and "model(...) returned int, not a torch.nn.Module" in r.output, r.output
    assert not (tmp_path / "run").exists()


@pytest.mark.deploy
def test_two_devices_train_a_user_task_and_a_device_with_another_source_refuses(tmp_path, monkeypatch):
    """The deployment path with a user task: the server imports sequence_task from its YAML's folder,
    two devices (TLS, node authentication, signed updates) each from their own environment
    (PYTHONPATH) with ``fedasync client --task sequence_task``; both train. A third device whose
    sequence_task.py differs by one line refuses every task it gets (task_mismatch), so nothing of
    it is accepted."""
    import shutil

    from tests.test_deploy import Processes, client_cmd, free_ports, keys_and_certs, start_server, wait_server

    keys, certs = keys_and_certs(tmp_path, 3)
    server_dir, same, other = tmp_path / "server", tmp_path / "device", tmp_path / "other"
    for d in (server_dir, same, other):
        d.mkdir()
        shutil.copy(EXAMPLES / "sequence_task.py", d / "sequence_task.py")
    (other / "sequence_task.py").write_text((other / "sequence_task.py").read_text() + "\n# edited on this device\n")
    cfg = server_dir / "seq.yaml"
    cfg.write_text(yaml.safe_dump({
        "name": "seqdeploy", "seed": 0, "task": "sequence_task", "task_args": {"samples": 32, "length": 32},
        "data": {"num_clients": 3},
        "train": {"local_steps": 4, "batch_size": 16, "lr": 0.1},
        # each task sleeps ~2 s: one device alone could not finish the run before the others join
        "clock": {"emulate": True, "time_scale": 2.0, "sigma": 0.0, "jitter": 0.0},
        "server": {"strategy": "fedasync", "concurrency": 3, "max_versions": 8, "eval_every": 8,
                   "task_timeout": 300},
        "deploy": {"public_keys": str(keys), "node_discovery_timeout": 300},
    }))
    home, out = tmp_path / "flwr", tmp_path / "run"
    (link_port,) = free_ports(1)
    procs = Processes(home)
    try:
        server = start_server(procs, cfg, out, keys, certs, link_port, 3, tmp_path / "server.out", home / "server")
        monkeypatch.setenv("XDG_STATE_HOME", str(tmp_path / "state"))
        for i, env_dir in enumerate((same, same, other)):
            monkeypatch.setenv("PYTHONPATH", str(env_dir))  # the device's own environment holds its task
            procs.start(client_cmd(link_port, i, 3, keys, certs, "--task", "sequence_task"),
                        tmp_path / f"client-{i}.log", home / "devices")
        wait_server(server, tmp_path / "server.out", out, 600)
    finally:
        procs.stop_all()

    logs = [(tmp_path / f"client-{i}.log").read_text(errors="replace") for i in range(3)]
    assert not any("Traceback" in t for t in logs[:2]), logs
    assert "task_mismatch" in logs[2] or "differs from the server's" in logs[2], logs[2][-3000:]
    summary = json.loads((out / "summary.json").read_text())
    assert summary["versions"] == 8 and "accuracy" in summary["history"][-1]
    from fedasync.store import Store

    store = Store(summary["store_url"], create=False)
    ups = store.updates(summary["run_id"])
    assert {u.client_id for u in ups if u.accepted} == {0, 1}, [(u.client_id, u.accepted, u.reason) for u in ups]
