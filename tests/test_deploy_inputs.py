"""Input checks of the deployment commands and the deployment's failure handling, tested below the
processes (fast: no SuperLink or SuperNode is started)."""

from __future__ import annotations

import json
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from typer.testing import CliRunner

from fedasync.cli import app as cli_app
from fedasync.deploy import DeployError
from tests.test_deploy import in_a_flower_run  # noqa: F401  (a fixture)


def _cfg(tmp_path: Path) -> Path:
    cfg = tmp_path / "c.yaml"
    cfg.write_text(yaml.safe_dump({"data": {"num_clients": 2}, "server": {"concurrency": 2, "buffer_size": 2}}))
    return cfg


def test_server_refuses_a_port_in_use(tmp_path):
    from fedasync.deploy.processes import check_port_free

    with socket.socket() as s:  # another SuperLink listening there
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        with pytest.raises(DeployError, match=f"--port: 127.0.0.1:{port} is in use"):
            check_port_free("127.0.0.1", port)
        r = CliRunner().invoke(cli_app, ["server", str(_cfg(tmp_path)), "--insecure", "--port", str(port),
                                         "--out", str(tmp_path / "o")])
        assert r.exit_code == 2 and f"--port: 127.0.0.1:{port} is in use" in r.output, r.output
        assert not (tmp_path / "o").exists()
    check_port_free("127.0.0.1", port)  # free again


def test_server_run_submits_nothing_when_its_superlink_died(tmp_path, monkeypatch):
    """The port answers (someone else's SuperLink) but ours exited: fail, submit nothing."""
    from fedasync.config import Config
    from fedasync.deploy import run as run_mod
    from fedasync.deploy.run import TLS, ServerRun

    monkeypatch.setenv("FLWR_HOME", str(tmp_path / "flwr"))
    r = ServerRun(Config(), tmp_path / "o", resume=None, host="127.0.0.1", port=1, superlink=None,
                  tls=TLS(insecure=True), auth_keys={}, public_keys={}, say=lambda m: None, warn=lambda m: None)
    dead = subprocess.Popen([sys.executable, "-c", "raise SystemExit(1)"])
    dead.wait()

    def start_superlink(host, port, certs, auth, log_path):
        r.fed.proc, r.fed.log_path = dead, log_path
        log_path.write_text("address already in use\n")

    submitted = []
    monkeypatch.setattr(r.fed, "start_superlink", start_superlink)
    monkeypatch.setattr(run_mod, "check_port_free", lambda h, p: None)
    monkeypatch.setattr(run_mod, "wait_for_port", lambda *a, **k: True)  # the other SuperLink answers
    monkeypatch.setattr(r.fed, "submit", lambda *a: submitted.append(a) or 7)
    with pytest.raises(DeployError, match="did not start"):
        r.start()
    assert submitted == [] and r.flower_run is None


def test_server_checks_each_supernode_key(tmp_path):
    from fedasync.deploy.keys import make_supernode_auth_key, supernode_auth_keys

    keys = tmp_path / "k"
    make_supernode_auth_key(keys, "supernode-0")
    assert list(supernode_auth_keys(keys)) == [0]
    bad = keys / "supernode-1.pub"
    for text in ("not a key\n", "ssh-ed25519 AAAAC3NzaC1lZDI1NTE5AAAAIE7sGHZ3ZmUy1D1gmtYqAV6vRz4Wnpn8HkLRLjJQK5qL\n"):
        bad.write_text(text)
        with pytest.raises(DeployError, match=f"--supernode-auth: {bad}"):
            supernode_auth_keys(keys)
    bad.write_text("garbage")
    certs = tmp_path / "certs"
    assert CliRunner().invoke(cli_app, ["certs", "gen", "--out", str(certs), "--host", "x"]).exit_code == 0
    r = CliRunner().invoke(cli_app, ["server", str(_cfg(tmp_path)), "--certs", str(certs), "--port", "1",
                                     "--supernode-auth", str(keys), "--out", str(tmp_path / "o")])
    assert r.exit_code == 2 and "--supernode-auth" in r.output and "supernode-1.pub" in r.output, r.output
    assert not (tmp_path / "o").exists()


def test_certs_and_keys_commands_check_their_inputs(tmp_path):
    runner = CliRunner()
    afile = tmp_path / "afile"
    afile.write_text("x")
    cases = [
        (["certs", "gen", "--out", str(tmp_path / "c1"), "--host", "h", "--days", "100000000"], "--days", "c1"),
        (["certs", "gen", "--out", str(tmp_path / "c2"), "--host", "h", "--days", "0"], "--days", "c2"),
        (["certs", "gen", "--out", str(tmp_path / "c3"), "--host", "é"], "--host", "c3"),
        (["certs", "gen", "--out", str(tmp_path / "c4" / "d"), "--host", "a b"], "--host", "c4"),
        (["certs", "gen", "--out", str(afile), "--host", "h"], "--out", None),
        (["certs", "gen", "--out", str(afile / "sub"), "--host", "h"], "--out", None),
        (["keys", "gen", "--out", str(afile), "--clients", "1"], "--out", None),
        (["keys", "gen", "--out", str(afile / "sub"), "--clients", "1"], "--out", None),
    ]
    for args, opt, left in cases:
        r = runner.invoke(cli_app, args)
        assert r.exit_code == 2 and f"error: {opt}" in r.output and "Traceback" not in r.output, (args, r.output)
        assert len(r.output.strip().splitlines()) == 1, r.output
        if left:
            assert not (tmp_path / left).exists(), args
    assert afile.read_text() == "x"
    r = runner.invoke(cli_app, ["certs", "gen", "--out", str(tmp_path / "ok"), "--host", "edge-1.example",
                                "--host", "10.0.0.2", "--days", "36500"])
    assert r.exit_code == 0, r.output


def test_client_poll_interval_must_be_finite(tmp_path, monkeypatch):
    import os

    from fedasync.deploy.processes import supernode_command

    def no_exec(*a):
        raise AssertionError("the SuperNode would have been started")

    monkeypatch.setattr(os, "execve", no_exec)
    runner = CliRunner()
    base = ["client", "--superlink", "127.0.0.1:9092", "--num-partitions", "2", "--partition-id", "0", "--insecure",
            "--no-signing", "--no-supernode-auth", "--privacy-state-dir", str(tmp_path / "p")]
    for bad in ("inf", "1e300", "nan", "0", "-1", "3601"):
        r = runner.invoke(cli_app, base + ["--poll-interval", bad])
        assert r.exit_code == 2 and "--poll-interval" in r.output, (bad, r.output)
        with pytest.raises(DeployError, match="--poll-interval"):
            supernode_command("127.0.0.1:9092", 0, 2, insecure=True, poll_interval=float(bad))
    r = runner.invoke(cli_app, base + ["--max-wait-time", "inf"])
    assert r.exit_code == 2 and "--max-wait-time" in r.output, r.output
    assert "3600" in supernode_command("127.0.0.1:9092", 0, 2, insecure=True, poll_interval=3600)


def test_a_node_turned_away_for_a_stale_node_is_greeted_again(monkeypatch):
    """A restarted device gets a new node id while the old one is still listed (~60 s): the new
    node is turned away ("already served by node N"); once N leaves it must be greeted again."""
    from flwr.supercore.task_identity import TaskIdentity

    from fedasync.server.app import DeployTransport
    from tests.test_deploy import FakeGrid, _hello

    for attr in ("_run_id", "_task_id", "_node_id"):
        monkeypatch.setattr(TaskIdentity, attr, 1, raising=False)
    grid = FakeGrid({21: _hello(0, n=2), 22: _hello(1, n=2)})
    t = DeployTransport(grid, 2, refresh_every=0.0, min_pull_interval=0.0, hello_retry=1e9)
    t.refresh()
    t.refresh()
    assert t.client_node == {0: 21, 1: 22}
    grid.nodes.add(31)  # device 0 restarted: node 31, while 21 is still listed
    grid.hellos[31] = _hello(0, n=2)
    t.refresh()
    t.refresh()
    assert t.client_node == {0: 21, 1: 22} and "already served by node 21" in t.nodes[31]["rejected"]
    grid.nodes.discard(21)  # the old node id leaves
    t.refresh()
    t.refresh()
    assert t.client_node == {0: 31, 1: 22} and t.available_clients() == {0, 1}
    assert [n for n, _ in grid.pushed].count(31) == 2


def _fork(body) -> tuple[int, int]:
    import os

    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:  # pragma: no cover - the child
        os.close(r)
        try:
            body(w)
        finally:
            os._exit(0)
    os.close(w)
    return pid, r


def test_warm_trainer_kills_a_hung_task_process():
    import os
    import signal
    import time

    from fedasync.clients.warm import PUSHED, wait_task_process

    pid, r = _fork(lambda w: os.kill(os.getpid(), signal.SIGSTOP))  # hangs, stopped
    pushed, status, hung = wait_task_process(pid, r, time.monotonic() + 0.5)
    assert hung and pushed == b"" and os.WIFSIGNALED(status) and os.WTERMSIG(status) == signal.SIGKILL
    pid, r = _fork(lambda w: (os.write(w, PUSHED), os.kill(os.getpid(), signal.SIGSTOP)))  # replied, then hung
    pushed, status, hung = wait_task_process(pid, r, time.monotonic() + 0.5)
    assert hung and pushed == PUSHED
    pid, r = _fork(lambda w: os.write(w, PUSHED))  # a task that replies and exits
    pushed, status, hung = wait_task_process(pid, r, time.monotonic() + 60)
    assert not hung and pushed == PUSHED and os.WIFEXITED(status) and os.WEXITSTATUS(status) == 0


def test_warm_trainer_sends_an_error_reply_for_a_hung_task(monkeypatch, in_a_flower_run):
    """run_task with a task process that hangs (SIGSTOP): killed at the message's TTL, an error
    reply sent, and the trainer is free for the next task."""
    import os
    import signal
    from types import SimpleNamespace as NS

    from flwr.app import ConfigRecord, Message, RecordDict

    from fedasync.clients import warm

    msg = Message(RecordDict({"task": ConfigRecord({"json": json.dumps({"task_timeout": 1000})})}),
                  dst_node_id=1, message_type="query", ttl=1.0)
    assert warm.task_deadline(msg) == 1.0
    monkeypatch.setattr(warm, "_client", lambda *a, **k: NS(close=lambda: None))
    monkeypatch.setattr(warm, "pull_task_input", lambda client: (msg, "ctx", NS(), NS(hash_str="h")))
    monkeypatch.setattr(warm, "_task_process", lambda *a: os.kill(os.getpid(), signal.SIGSTOP) or 0)
    failed = []
    monkeypatch.setattr(warm.WarmTrainer, "_fail", staticmethod(lambda c, m, ctx, why: failed.append((m, why))))
    t = warm.WarmTrainer("127.0.0.1:1")
    t.apps["h"] = object()
    old = signal.signal(signal.SIGALRM, lambda *a: (_ for _ in ()).throw(TimeoutError("run_task hung")))
    signal.alarm(60)
    try:
        t.run_task("tok", NS(task_id=5))
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, old)
    assert len(failed) == 1 and failed[0][0] is msg and "hung" in failed[0][1]


def test_deployed_tasks_tell_devices_the_task_timeout(tmp_path):
    # the loop puts server.task_timeout in a deployed task's config: the warm trainer's deadline
    from types import SimpleNamespace as NS

    from conftest import small_config
    from fedasync.clients.runner import handle_train
    from fedasync.clients.warm import DEADLINE_GRACE_S, task_deadline
    from fedasync.server.loop import AsyncServer
    from fedasync.server.transport import LocalTransport
    from fedasync.store import Store

    sent = []

    def client(params, config):
        sent.append(config)
        return handle_train(params, {k: v for k, v in config.items() if k != "deployment"})

    cfg = small_config("server.task_timeout=30", "server.max_versions=1")
    AsyncServer(cfg, LocalTransport(client), Store(f"sqlite:///{tmp_path / 'd'}.db"), clock="wall",
                mode="deployment").run()
    assert sent and all(c["task_timeout"] == 30.0 and c["deployment"] for c in sent)
    message = NS(content=_content(sent[0]), metadata=NS(ttl=None))
    assert task_deadline(message) == 60.0 + DEADLINE_GRACE_S


def _content(config):
    from flwr.app import ConfigRecord, RecordDict

    return RecordDict({"task": ConfigRecord({"json": json.dumps(config)})})


def test_resume_on_an_external_superlink_reuses_the_registered_key(tmp_path, monkeypatch):
    """An external SuperLink keeps a registered key: registering it again answers 412; the run
    goes on with the node id the SuperLink lists for that key."""
    from types import SimpleNamespace as NS

    from fedasync.config import Config
    from fedasync.deploy.keys import make_supernode_auth_key
    from fedasync.deploy.run import TLS, ServerRun, already_registered

    assert already_registered("registering supernode-0.pub failed: Client error '412 Precondition Failed' for url")
    assert already_registered("Public key already in use") and not already_registered("503 Service Unavailable")
    _, pub0 = make_supernode_auth_key(tmp_path / "k", "supernode-0")
    _, pub1 = make_supernode_auth_key(tmp_path / "k", "supernode-1")
    monkeypatch.setenv("FLWR_HOME", str(tmp_path / "flwr"))
    r = ServerRun(Config(), tmp_path / "o", resume=1, host="127.0.0.1", port=1, superlink="127.0.0.1:2",
                  tls=TLS(insecure=True), auth_keys={0: pub0, 1: pub1}, public_keys={}, say=lambda m: None,
                  warn=lambda m: None)

    def register(pub):
        raise RuntimeError(f"registering {pub.name} failed: Client error '412 Precondition Failed' for url")

    from flwr.cli.supernode.register import try_load_public_key

    nodes = [NS(node_id=41, public_key=try_load_public_key(pub1), status="online"),
             NS(node_id=40, public_key=try_load_public_key(pub0), status="unregistered"),
             NS(node_id=42, public_key=try_load_public_key(pub0), status="registered")]
    monkeypatch.setattr(r.fed, "control", lambda: NS(ListNodes=lambda req: NS(nodes_info=nodes)))
    monkeypatch.setattr(r.fed, "register", register)
    jobs = []
    monkeypatch.setattr(r, "_submit", lambda registered: jobs.append(dict(registered)) or 3)
    r.start()
    assert jobs == [{0: 42, 1: 41}] and r.flower_run == 3


def test_a_node_claiming_another_clients_registered_key_is_not_used(in_a_flower_run):
    from fedasync.server.app import DeployTransport
    from tests.test_deploy import FakeGrid, _hello

    grid = FakeGrid({51: _hello(0, n=3), 52: _hello(1, n=3)})  # node 52 holds client 2's auth key
    t = DeployTransport(grid, 3, registered={0: 51, 2: 52}, refresh_every=0.0, min_pull_interval=0.0)
    t.refresh()
    t.refresh()
    assert t.client_node == {0: 51} and "auth key is client 2's" in t.nodes[52]["rejected"]


# -- secure by default (issue 32) ---------------------------------------------------------


def _one_line(r, *texts: str) -> None:
    assert r.exit_code == 2, r.output
    lines = [ln for ln in r.output.strip().splitlines() if ln.strip()]
    assert len(lines) == 1 and all(t in lines[0] for t in texts), r.output


def test_server_needs_both_kinds_of_keys_unless_turned_off(tmp_path, monkeypatch):
    """Node authentication and update signing are on by default: without their keys the server
    refuses (one line naming what to pass); --no-* turns each off with a warning, and the
    ServerApp's config says whether it signs."""
    from fedasync.deploy import run as run_mod

    runner = CliRunner()
    keys, certs = tmp_path / "keys", tmp_path / "certs"
    assert runner.invoke(cli_app, ["keys", "gen", "--out", str(keys), "--clients", "2"]).exit_code == 0
    assert runner.invoke(cli_app, ["certs", "gen", "--out", str(certs), "--host", "x"]).exit_code == 0
    cfg = _cfg(tmp_path)
    tls = ["--certs", str(certs), "--port", "1", "--out", str(tmp_path / "o")]
    _one_line(runner.invoke(cli_app, ["server", str(cfg), *tls]), "--supernode-auth", "--no-supernode-auth")
    _one_line(runner.invoke(cli_app, ["server", str(cfg), "--insecure", "--out", str(tmp_path / "o")]),
              "--supernode-auth", "--no-supernode-auth")
    _one_line(runner.invoke(cli_app, ["server", str(cfg), *tls, "--supernode-auth", str(keys)]),
              "deploy.public_keys", "--no-signing")
    _one_line(runner.invoke(cli_app, ["server", str(cfg), *tls, "--supernode-auth", str(keys),
                                      "--no-supernode-auth", "--no-signing"]), "exclude each other")
    # the YAML cannot turn signing off behind the operator's back: that takes --no-signing
    _one_line(runner.invoke(cli_app, ["server", str(cfg), *tls, "--supernode-auth", str(keys),
                                      "--set", f"deploy.public_keys={keys}", "--set", "deploy.signing=false"]),
              "deploy.signing", "--no-signing")
    assert not (tmp_path / "o").exists()

    seen = []

    class NoRun:  # stands in for ServerRun: records what the server would run with, starts nothing
        def __init__(self, cfg, out, **kw):
            seen.append((cfg.deploy.signing, kw["auth_keys"], kw["public_keys"]))
            raise DeployError("not started (test)")

    monkeypatch.setattr(run_mod, "ServerRun", NoRun)
    r = runner.invoke(cli_app, ["server", str(cfg), *tls, "--supernode-auth", str(keys),
                                "--set", f"deploy.public_keys={keys}"])
    assert "warning" not in r.output and "not started (test)" in r.output, r.output
    signing, auth, pub = seen.pop()
    assert signing and sorted(auth) == [0, 1] and sorted(pub) == [0, 1]
    r = runner.invoke(cli_app, ["server", str(cfg), "--insecure", "--no-supernode-auth", "--no-signing",
                                "--set", "deploy.signing=true", "--out", str(tmp_path / "o")])
    assert "warning: --no-supernode-auth" in r.output and "warning: --no-signing" in r.output, r.output
    assert seen.pop() == (False, {}, {})


def test_client_needs_both_keys_unless_turned_off(tmp_path, monkeypatch):
    import os

    runner = CliRunner()
    keys, certs = tmp_path / "keys", tmp_path / "certs"
    assert runner.invoke(cli_app, ["keys", "gen", "--out", str(keys), "--clients", "1"]).exit_code == 0
    assert runner.invoke(cli_app, ["certs", "gen", "--out", str(certs), "--host", "x"]).exit_code == 0
    base = ["client", "--superlink", "127.0.0.1:9092", "--partition-id", "0", "--num-partitions", "1",
            "--privacy-state-dir", str(tmp_path / "p")]
    tls = ["--root-certificates", str(certs / "ca.crt")]
    auth, sign = ["--auth-key", str(keys / "supernode-0.key")], ["--signing-key", str(keys / "client-0.key")]
    execs = []
    monkeypatch.setattr(os, "execve", lambda path, cmd, env: execs.append(cmd))
    _one_line(runner.invoke(cli_app, base + tls + sign), "--auth-key", "--no-supernode-auth")
    _one_line(runner.invoke(cli_app, base + ["--insecure"] + sign), "--auth-key", "--no-supernode-auth")
    _one_line(runner.invoke(cli_app, base + tls + auth), "--signing-key", "--no-signing")
    _one_line(runner.invoke(cli_app, base + tls + auth + sign + ["--no-signing"]), "exclude each other")
    assert execs == []
    r = runner.invoke(cli_app, base + tls + auth + sign)
    assert r.exit_code == 0 and "warning" not in r.output, r.output
    r = runner.invoke(cli_app, base + ["--insecure", "--no-signing", "--no-supernode-auth"])
    assert r.exit_code == 0 and "warning: --no-signing" in r.output and "warning: --no-supernode-auth" in r.output
    secure, bare = execs
    assert "--auth-supernode-private-key" in secure and "signing-key" in secure[secure.index("--node-config") + 1]
    assert "--auth-supernode-private-key" not in bare and "signing-key" not in bare[bare.index("--node-config") + 1]
