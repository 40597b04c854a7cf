"""Only the operator controls the federation (issue 32): the SuperLink ``fedasync server`` starts
serves SuperNodes (the Fleet API) on its public port and nothing else; its Control and Runtime
APIs are on a loopback listener of the server host.

The end-to-end test (marked ``deploy``) plays an outsider who holds only the public CA
certificate and reaches the public port: ``flwr ls``, ``flwr stop`` and ``flwr supernode
register`` are each refused, and the devices keep working (the run completes its versions).
Processes are started and stopped as in ``tests/test_deploy.py``.
"""

from __future__ import annotations

import asyncio
import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml
from typer.testing import CliRunner

from fedasync.cli import app as cli_app
from tests.test_deploy import (Processes, client_cmd, free_ports, keys_and_certs, start_server,
                               wait_for_text, wait_server)

FLWR = str(Path(sys.executable).with_name("flwr"))
CONTROL = ("127.0.0.1", 41000)
PUBLIC = ("127.0.0.1", 9092)


def _call(app, path: str, server: tuple[str, int], client: tuple[str, int] = ("127.0.0.1", 50000)) -> int:
    """The status ``app`` answers a POST ``path`` that arrived on listener ``server`` with."""
    sent = []

    async def receive():
        return {"type": "http.request", "body": b"", "more_body": False}

    async def send(msg):
        sent.append(msg)

    scope = {"type": "http", "method": "POST", "path": path, "raw_path": path.encode(), "server": server,
             "client": client, "headers": [], "query_string": b""}
    asyncio.run(app(scope, receive, send))
    return sent[0]["status"]


def test_public_listener_passes_only_fleet_paths():
    from fedasync.deploy.superlink import PublicFleetOnly

    async def inner(scope, receive, send):
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": b""})

    app = PublicFleetOnly(inner, CONTROL)
    for path in ("/v1/fleet/pull-messages", "/v1/fleet/register-node", "/v1/fleet/push-object"):
        assert _call(app, path, PUBLIC) == 200, path
    # Control and Runtime APIs, docs, health, and tricks on the Fleet prefix: refused on the public port,
    # from the server host itself too (the listener decides, not the caller's address)
    for path in ("/v1/control/list-runs", "/v1/control/stop-run", "/v1/control/register-node",
                 "/v1/runtime/get-nodes", "/v1/runtime/push-messages", "/health", "/docs", "/openapi.json",
                 "/v1/fleet/../control/list-runs", "/v1/fleet/", "/v1/fleetx/list-runs", "//v1/control/list-runs"):
        assert _call(app, path, PUBLIC) == 403, path
        assert _call(app, path, PUBLIC, client=CONTROL) == 403, path
        assert _call(app, path, ("127.0.0.1", CONTROL[1] + 1)) == 403, path
        assert _call(app, path, CONTROL) == 200, path  # the loopback listener serves everything


def test_control_port_and_certificate_inputs(tmp_path):
    from fedasync.deploy.certs import make_certs, tls_hosts
    from fedasync.deploy.superlink import names_loopback

    cfg = tmp_path / "c.yaml"
    cfg.write_text(yaml.safe_dump({"data": {"num_clients": 2}, "server": {"concurrency": 2, "buffer_size": 2}}))
    base = ["server", str(cfg), "--insecure", "--out", str(tmp_path / "o")]
    for extra, msg in ((["--control-port", "70000"], "--control-port: 70000 is not a port"),
                       (["--port", "9200", "--control-port", "9200"], "--control-port: 9200 is the public --port"),
                       (["--superlink", "127.0.0.1:9200", "--control-port", "9300"], "--control-port: only for")):
        r = CliRunner().invoke(cli_app, base + extra)
        assert r.exit_code == 2 and msg in r.output, (extra, r.output)
    assert not (tmp_path / "o").exists()
    assert names_loopback(make_certs(tmp_path / "ours", tls_hosts(["edge.example"]))["cert"])
    assert not names_loopback(make_certs(tmp_path / "theirs", ["edge.example"])["cert"])
    assert not names_loopback(tmp_path / "none.pem")


def _flwr(home: Path, *args: str) -> subprocess.CompletedProcess:
    env = dict(os.environ, FLWR_HOME=str(home))
    return subprocess.run([FLWR, *args], capture_output=True, text=True, env=env, timeout=120)


def _refused(r: subprocess.CompletedProcess) -> bool:
    """flwr reported no success and the SuperLink's answer was 403 Forbidden (not, say, a
    connection error: the outsider reached the port and was turned away)."""
    from fedasync.deploy.federation import last_json

    try:
        data = last_json(r.stdout)
    except ValueError:
        data = {}
    return not data.get("success") and "403" in str(data.get("error-message", "")) + r.stderr


@pytest.mark.deploy
def test_outsider_with_the_ca_cannot_list_stop_or_register(tmp_path):
    keys, certs = keys_and_certs(tmp_path, 2)
    own = tmp_path / "outsider-keys"
    assert CliRunner().invoke(cli_app, ["keys", "gen", "--out", str(own), "--clients", "1"]).exit_code == 0
    cfg = tmp_path / "deploy.yaml"
    cfg.write_text(yaml.safe_dump({
        "name": "control", "seed": 0,
        "data": {"dataset": "digits", "num_clients": 2, "partitioner": "iid"},
        "model": {"name": "mlp", "hidden": 8},
        "train": {"local_epochs": 1, "batch_size": 64, "lr": 0.1},
        "server": {"strategy": "fedasync", "concurrency": 2, "max_versions": 3, "eval_every": 3,
                   "task_timeout": 600},
        "deploy": {"signing": True, "public_keys": str(keys), "node_discovery_timeout": 300},
    }))
    home, out = tmp_path / "flwr", tmp_path / "run"
    link_port, *node_ports = free_ports(3)
    outsider = tmp_path / "outsider"  # the outsider's flwr: the public address and the CA, nothing else
    outsider.mkdir()
    (outsider / "config.toml").write_text(
        '[superlink]\ndefault = "target"\n\n[superlink.target]\n'
        f'address = "127.0.0.1:{link_port}"\nroot-certificates = "{(certs / "ca.crt").resolve()}"\n')
    procs = Processes(home)
    try:
        server = start_server(procs, cfg, out, keys, certs, link_port, 2, tmp_path / "server.out", home / "server")
        for i in range(2):
            procs.start(client_cmd(link_port, i, 2, keys, certs, "--port", str(node_ports[i]), "--device", "cpu"),
                        tmp_path / f"client-{i}.log", home / f"node-{i}")
        wait_for_text(tmp_path / "server.out", "Flower run ", 180, server)
        flower_run = re.search(r"Flower run (\d+)", (tmp_path / "server.out").read_text()).group(1)

        listed = _flwr(outsider, "ls", "target", "--format", "json")
        assert _refused(listed) and flower_run not in listed.stdout, listed.stdout + listed.stderr
        stopped = _flwr(outsider, "stop", flower_run, "target", "--format", "json")
        assert _refused(stopped), stopped.stdout + stopped.stderr
        registered = _flwr(outsider, "supernode", "register", str(own / "supernode-0.pub"), "target",
                           "--format", "json")
        assert _refused(registered), registered.stdout + registered.stderr
        # the operator, on the server host's loopback listener, still sees the run and no outsider's key
        operator = home / "server" / "cli"
        assert "127.0.0.1:" in (operator / "config.toml").read_text()
        ls = _flwr(operator, "ls", "fedasync", "--run-id", flower_run, "--format", "json")
        assert ls.returncode == 0 and '"success": true' in ls.stdout, ls.stdout + ls.stderr
        for _ in range(10):  # a SuperLink busy with the run may answer one Control call with an error: ask again
            nodes = _flwr(operator, "supernode", "list", "fedasync", "--format", "json")
            assert nodes.returncode == 0, nodes.stdout + nodes.stderr
            listing = json.loads(nodes.stdout[nodes.stdout.index("{"):])
            if "nodes" in listing:
                break
            time.sleep(3)
        assert len(listing.get("nodes", ())) == 2, nodes.stdout + nodes.stderr  # ours only
        wait_server(server, tmp_path / "server.out", out, 900)
    finally:
        procs.stop_all()  # asserts that nothing is left running

    summary = json.loads((out / "summary.json").read_text())
    assert summary["versions"] >= 3 and summary["updates_accepted"] >= 3
    log = (out / "superlink.log").read_text(errors="replace")
    assert re.search(r'"POST /v1/control/(list-runs|stop-run|register-node) HTTP/1.1" 403', log), log[-2000:]
