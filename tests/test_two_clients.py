"""Several devices on one host (issue 32, "Each device is its own"): each ``fedasync client``
gets its own local SuperNode port unless ``--port`` is given, a ``--port`` in use is one line
and exit 2 before anything starts, and a warm trainer serves only its own SuperNode.

The end-to-end test (marker ``deploy``) starts a server and two clients exactly as the README
shows (TLS, node authentication, signed updates, no ``--port``) and stops every process it
started by PID (and what Flower started below them), pass or fail."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys

import pytest
import yaml
from typer.testing import CliRunner

from fedasync.cli import app as cli_app
from tests.test_deploy import (Processes, client_cmd, free_ports, keys_and_certs, start_server,
                               wait_server)


def _client_args(tmp_path, *extra: str) -> list[str]:
    return ["client", "--superlink", "127.0.0.1:9092", "--partition-id", "0", "--num-partitions", "2", "--insecure",
            "--no-signing", "--no-supernode-auth", "--privacy-state-dir", str(tmp_path / "p"), *extra]


def test_each_client_gets_a_free_port_and_a_port_in_use_is_one_line(tmp_path, monkeypatch):
    execs = []
    monkeypatch.setattr(os, "execve", lambda path, cmd, env: execs.append(cmd))
    runner = CliRunner()
    for _ in range(2):
        assert runner.invoke(cli_app, _client_args(tmp_path)).exit_code == 0
    ports = [int(cmd[cmd.index("--port") + 1]) for cmd in execs]
    assert len(set(ports)) == 2 and 9094 not in ports, ports  # never Flower's shared default
    with socket.socket() as s:  # the first device's SuperNode, listening on its port
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        r = runner.invoke(cli_app, _client_args(tmp_path, "--port", str(port)))
    assert r.exit_code == 2, r.output
    lines = [ln for ln in r.output.strip().splitlines() if ln.strip() and not ln.startswith("warning")]
    assert len(lines) == 1 and lines[0].startswith(f"error: --port: 127.0.0.1:{port} is in use"), r.output
    assert len(execs) == 2  # nothing started
    r = runner.invoke(cli_app, _client_args(tmp_path, "--port", str(port)))  # free again
    assert r.exit_code == 0 and execs[-1][execs[-1].index("--port") + 1] == str(port)


def test_warm_trainer_serves_only_its_own_supernodes_port(tmp_path):
    """The trainer is told its SuperNode's port and pid: a port another process listens on is
    not served (the second of two SuperNodes given one port used to feed the first one's tasks
    to its trainer)."""
    from fedasync.clients.warm import WarmTrainer, runtime_api_owner

    with socket.socket() as s:  # this process stands for the SuperNode: its own listener
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        assert runtime_api_owner(port, os.getpid()) == "parent"
        assert WarmTrainer(f"127.0.0.1:{port}", supernode_pid=os.getpid()).wait_for_parent()
    assert runtime_api_owner(port, os.getpid()) == "none"
    other = subprocess.Popen([sys.executable, "-c", "import socket,sys,time; s=socket.socket(); "
                              "s.bind(('127.0.0.1',0)); s.listen(); print(s.getsockname()[1], flush=True); "
                              "time.sleep(60)"], stdout=subprocess.PIPE, text=True)
    try:
        port = int(other.stdout.readline())
        assert runtime_api_owner(port, os.getpid()) == "other"
        assert not WarmTrainer(f"127.0.0.1:{port}", supernode_pid=os.getpid()).wait_for_parent()
    finally:
        other.kill()
        other.wait()


@pytest.mark.deploy
def test_two_clients_on_one_host_both_train(tmp_path, monkeypatch):
    """README commands on one host, two devices without --port: both partitions train."""
    keys, certs = keys_and_certs(tmp_path, 2)
    cfg = tmp_path / "edge.yaml"
    cfg.write_text(yaml.safe_dump({
        "name": "two", "seed": 0,
        "data": {"dataset": "digits", "num_clients": 2, "partitioner": "iid"},
        "model": {"name": "mlp", "hidden": 16},
        "train": {"local_epochs": 1, "batch_size": 32, "lr": 0.1},
        # each task sleeps ~2 s: one device alone could not finish the run before the other joins
        "clock": {"emulate": True, "time_scale": 2.0, "sigma": 0.0, "jitter": 0.0},
        "server": {"strategy": "fedasync", "concurrency": 2, "max_versions": 8, "eval_every": 8,
                   "task_timeout": 300},
        "deploy": {"public_keys": str(keys), "node_discovery_timeout": 300},
    }))
    home, out = tmp_path / "flwr", tmp_path / "run"
    (link_port,) = free_ports(1)
    procs = Processes(home)
    devices_env = home / "devices"  # one FLWR_HOME for both devices, as two clients started from one shell
    try:
        server = start_server(procs, cfg, out, keys, certs, link_port, 2, tmp_path / "server.out", home / "server")
        monkeypatch.setenv("XDG_STATE_HOME", str(tmp_path / "state"))  # their DP state dir: not the home's
        for i in range(2):  # exactly the README's device command (no --port)
            procs.start(client_cmd(link_port, i, 2, keys, certs), tmp_path / f"client-{i}.log", devices_env)
        wait_server(server, tmp_path / "server.out", out, 600)
    finally:
        procs.stop_all()

    logs = [(tmp_path / f"client-{i}.log").read_text(errors="replace") for i in range(2)]
    assert not any("Traceback" in t for t in logs), logs
    summary = json.loads((out / "summary.json").read_text())
    from fedasync.store import Store

    store = Store(summary["store_url"], create=False)
    ups = store.updates(summary["run_id"])
    assert {u.client_id for u in ups if u.accepted} == {0, 1}, [(u.client_id, u.accepted, u.reason) for u in ups]
    nodes = {c.client_id: c.node_id for c in store.clients(summary["run_id"])}
    assert nodes.get(0) and nodes.get(1) and nodes[0] != nodes[1]
