"""Deployment on 127.0.0.1: a SuperLink with TLS and SuperNode authentication, SuperNodes started
by ``fedasync client``, the asynchronous ServerApp started by ``fedasync server``.

The end-to-end test starts real Flower processes (marked ``deploy``). Every process is
started in its own session and stopped by PID in ``finally`` (with the processes Flower
started below it, found through /proc); a last sweep stops anything still carrying this
test's private ``FLWR_HOME``.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml
from typer.testing import CliRunner

from fedasync.cli import app as cli_app
from fedasync.deploy.processes import alive, descendants, stop_process, supernode_command

FEDASYNC = str(Path(sys.executable).with_name("fedasync"))


def free_ports(n: int) -> list[int]:
    socks, ports = [], []
    for _ in range(n):
        s = socket.socket()
        s.bind(("127.0.0.1", 0))
        socks.append(s)
        ports.append(s.getsockname()[1])
    for s in socks:
        s.close()
    return ports


class Processes:
    """Processes this test started; all stopped by PID, pass or fail."""

    def __init__(self, marker: Path):
        self.marker = str(marker)
        self.procs: list[subprocess.Popen] = []

    def start(self, cmd: list[str], log: Path, flwr_home: Path) -> subprocess.Popen:
        env = dict(os.environ, FLWR_HOME=str(flwr_home), PYTHONUNBUFFERED="1")
        f = open(log, "wb")
        p = subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=env,
                             start_new_session=True)
        f.close()
        self.procs.append(p)
        return p

    def ours(self) -> list[tuple[int, int]]:
        """Processes whose environment carries this test's FLWR_HOME (Flower's detached children)."""
        out = []
        for d in os.listdir("/proc"):
            if not d.isdigit():
                continue
            try:
                env = Path(f"/proc/{d}/environ").read_bytes()
                stat = Path(f"/proc/{d}/stat").read_text()
            except OSError:
                continue
            if f"FLWR_HOME={self.marker}".encode() in env:
                out.append((int(d), int(stat[stat.rfind(")") + 2:].split()[19])))
        return out

    def stop_all(self) -> None:
        for p in reversed(self.procs):
            stop_process(p, timeout=15)
        left = [x for x in self.ours() if alive(*x)]
        for sig in (signal.SIGTERM, signal.SIGKILL):
            for pid, start in left:
                if alive(pid, start):
                    try:
                        os.kill(pid, sig)
                    except ProcessLookupError:
                        pass
            time.sleep(1.0)
        assert not [x for x in self.ours() if alive(*x)], "processes left running"


def wait_for_text(path: Path, text: str, timeout: float, proc: subprocess.Popen) -> None:
    t0 = time.monotonic()
    while time.monotonic() - t0 < timeout:
        if path.exists() and text in path.read_text(errors="replace"):
            return
        if proc.poll() is not None:
            raise AssertionError(f"process exited ({proc.returncode}):\n{path.read_text(errors='replace')[-3000:]}")
        time.sleep(0.5)
    raise AssertionError(f"{text!r} not seen in {path} after {timeout:.0f} s:\n{path.read_text(errors='replace')[-3000:]}")


def keys_and_certs(tmp_path: Path, clients: int) -> tuple[Path, Path]:
    """``fedasync keys gen`` (signing and SuperNode keys of clients 0..clients-1) into ``keys/`` and
    ``fedasync certs gen`` for 127.0.0.1 into ``certs/``."""
    runner = CliRunner()
    keys, certs = tmp_path / "keys", tmp_path / "certs"
    assert runner.invoke(cli_app, ["keys", "gen", "--out", str(keys), "--clients", str(clients)]).exit_code == 0
    assert runner.invoke(cli_app, ["certs", "gen", "--out", str(certs), "--host", "127.0.0.1"]).exit_code == 0
    return keys, certs


def start_server(procs: Processes, cfg: Path, out: Path, keys: Path, certs: Path, port: int, clients: int,
                 log: Path, flwr_home: Path) -> subprocess.Popen:
    """``fedasync server`` (TLS, SuperNode authentication) on 127.0.0.1:``port``, returned once it has
    registered the SuperNode keys: a SuperNode whose key is not registered yet is refused."""
    server = procs.start([FEDASYNC, "server", str(cfg), "--out", str(out), "--certs", str(certs),
                          "--supernode-auth", str(keys), "--port", str(port)], log, flwr_home)
    wait_for_text(log, f"registered {clients} SuperNode key(s)", 180, server)
    return server


def client_cmd(port: int, i: int, n: int, keys: Path, certs: Path, *extra: str,
               signing_key: Path | None = None) -> list[str]:
    """The README's device command for client ``i`` of ``n`` (TLS, node authentication, signing)."""
    return [FEDASYNC, "client", "--superlink", f"127.0.0.1:{port}", "--partition-id", str(i),
            "--num-partitions", str(n), "--root-certificates", str(certs / "ca.crt"),
            "--auth-key", str(keys / f"supernode-{i}.key"),
            "--signing-key", str(signing_key or keys / f"client-{i}.key"), *extra]


def wait_server(server: subprocess.Popen, log: Path, out: Path, timeout: float) -> None:
    """The server exits 0 within ``timeout`` seconds; else fail with the tail of its output and log."""
    def tails() -> str:
        run_log = out / "server.log"
        return (log.read_text(errors="replace")[-3000:] + "\n"
                + (run_log.read_text(errors="replace")[-3000:] if run_log.exists() else ""))

    try:
        rc = server.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        raise AssertionError("server did not finish:\n" + tails()) from None
    assert rc == 0, tails()


def test_keys_and_certs_commands(tmp_path):
    runner = CliRunner()
    r = runner.invoke(cli_app, ["keys", "gen", "--out", str(tmp_path / "k"), "--clients", "2"])
    assert r.exit_code == 0, r.output
    names = sorted(p.name for p in (tmp_path / "k").iterdir())
    assert names == ["client-0.key", "client-0.pub", "client-1.key", "client-1.pub",
                     "supernode-0.key", "supernode-0.pub", "supernode-1.key", "supernode-1.pub"]
    assert (tmp_path / "k" / "client-0.key").stat().st_mode & 0o077 == 0
    assert (tmp_path / "k" / "supernode-0.pub").read_text().startswith("ecdsa-sha2-nistp384 ")
    r = runner.invoke(cli_app, ["keys", "gen", "--out", str(tmp_path / "k"), "--clients", "1"])
    assert r.exit_code == 2 and "not overwriting" in r.output
    r = runner.invoke(cli_app, ["certs", "gen", "--out", str(tmp_path / "c"), "--host", "edge.example"])
    assert r.exit_code == 0, r.output
    from cryptography import x509

    cert = x509.load_pem_x509_certificate((tmp_path / "c" / "server.pem").read_bytes())
    ca = x509.load_pem_x509_certificate((tmp_path / "c" / "ca.crt").read_bytes())
    sans = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    assert "edge.example" in sans.get_values_for_type(x509.DNSName)
    assert "localhost" in sans.get_values_for_type(x509.DNSName)
    assert [str(a) for a in sans.get_values_for_type(x509.IPAddress)] == ["127.0.0.1"]
    cert.verify_directly_issued_by(ca)  # raises if the CA did not sign it


def test_client_command_checks_its_inputs(tmp_path):
    runner = CliRunner()
    base = ["client", "--superlink", "127.0.0.1:9092", "--num-partitions", "4"]
    off = ["--no-signing", "--no-supernode-auth"]
    cases = [
        (["--partition-id", "4", "--insecure"], "--partition-id: 4 is not in 0-3"),
        (["--partition-id", "0"], "--root-certificates: needed for TLS"),
        (["--partition-id", "0", "--insecure", "--auth-key", str(tmp_path / "x")], "needs TLS"),
        (["--partition-id", "0", "--root-certificates", str(tmp_path / "nope.crt"), *off], "no such file"),
        (["--partition-id", "0", "--insecure", "--device", "tpu", *off], "--device"),
    ]
    for extra, msg in cases:
        r = runner.invoke(cli_app, base + extra)
        assert r.exit_code == 2 and msg in r.output, (extra, r.output)
    r = runner.invoke(cli_app, ["client", "--superlink", "nohostport", "--partition-id", "0",
                                "--num-partitions", "2", "--insecure", "--no-signing", "--no-supernode-auth"])
    assert r.exit_code == 2 and "HOST:PORT" in r.output


def test_supernode_command_carries_the_node_config(tmp_path):
    key = tmp_path / "client-1.key"
    key.write_text("x")
    cmd = supernode_command("10.0.0.1:9092", 1, 4, data=tmp_path / "d 1.npz", insecure=True, signing_key=key,
                            port=9101, device="cpu")
    from flwr.common.config import parse_config_args

    node = parse_config_args([cmd[cmd.index("--node-config") + 1]])
    assert node == {"partition-id": 1, "num-partitions": 4, "deployed": True,
                    "data-path": str((tmp_path / "d 1.npz").resolve()),
                    "signing-key": str(key.resolve()), "device": "cpu"}
    assert cmd[cmd.index("--superlink") + 1] == "10.0.0.1:9092" and "--insecure" in cmd
    assert cmd[cmd.index("--port") + 1] == "9101"


def test_server_command_checks_its_inputs(tmp_path):
    runner = CliRunner()
    cfg = tmp_path / "c.yaml"
    cfg.write_text(yaml.safe_dump({"data": {"num_clients": 4}, "server": {"concurrency": 2, "buffer_size": 2},
                                   "deploy": {"signing": True}}))
    r = runner.invoke(cli_app, ["server", str(cfg), "--insecure", "--no-supernode-auth", "--out", str(tmp_path / "o")])
    assert r.exit_code == 2 and "deploy.public_keys: updates are signed by default" in r.output
    cfg.write_text(yaml.safe_dump({"data": {"num_clients": 4}, "server": {"concurrency": 2, "buffer_size": 2}}))
    r = runner.invoke(cli_app, ["server", str(cfg), "--out", str(tmp_path / "o")])
    assert r.exit_code == 2 and "TLS: give --certs" in r.output
    r = runner.invoke(cli_app, ["server", str(cfg), "--insecure", "--supernode-auth", str(tmp_path)])
    assert r.exit_code == 2 and "needs TLS" in r.output
    r = runner.invoke(cli_app, ["server", "--insecure"])
    assert r.exit_code == 2 and "CONFIG" in r.output
    assert not (tmp_path / "o").exists()


def test_descendants_finds_grandchildren():
    p = subprocess.Popen([sys.executable, "-c", "import subprocess,sys,time; "
                          "subprocess.Popen([sys.executable,'-c','import time; time.sleep(60)']); time.sleep(60)"],
                         start_new_session=True)
    try:
        t0 = time.monotonic()
        while not descendants(p.pid) and time.monotonic() - t0 < 20:
            time.sleep(0.1)
        below = descendants(p.pid)
        assert len(below) == 1
    finally:
        stop_process(p, timeout=1)
    assert not alive(*below[0])


class FakeGrid:
    """Nodes answer the hello with ``hellos[node]`` (None: an error reply)."""

    def __init__(self, hellos: dict[int, dict | None]):
        self.hellos = dict(hellos)
        self.nodes = set(hellos)
        self.pushed: list = []
        self.replies: dict[str, object] = {}
        self.n = 0

    def get_node_ids(self):
        return sorted(self.nodes)

    def push_messages(self, msgs):
        from types import SimpleNamespace as NS

        ids = []
        for m in msgs:
            self.n += 1
            mid = f"h{self.n}"
            self.pushed.append((m.metadata.dst_node_id, m.metadata.message_type))
            info = self.hellos[m.metadata.dst_node_id]
            self.replies[mid] = NS(metadata=NS(reply_to_message_id=mid), has_error=lambda info=info: info is None,
                                   error=NS(code=2, reason="boom"),
                                   content={"hello": {"json": json.dumps(info)}})
            ids.append(mid)
        return ids

    def pull_messages(self, ids):
        return [self.replies.pop(i) for i in ids if i in self.replies]


@pytest.fixture
def in_a_flower_run(monkeypatch):
    """Flower's Message() needs the identity of a running task (the ServerApp's, in a real run)."""
    from flwr.supercore.task_identity import TaskIdentity

    for attr in ("_run_id", "_task_id", "_node_id"):
        monkeypatch.setattr(TaskIdentity, attr, 1, raising=False)


def _hello(c, n=4, key=""):
    return {"partition_id": c, "num_partitions": n, "public_key": key, "device": "cpu"}


def test_deploy_transport_maps_nodes_to_clients_by_hello(in_a_flower_run):
    from fedasync.server.app import DeployTransport

    k2 = bytes(range(32))
    grid = FakeGrid({11: _hello(0), 12: _hello(1), 13: _hello(1), 14: _hello(7), 15: _hello(2, n=5),
                     16: None, 17: _hello(3), 18: _hello(2, key=k2.hex())})
    seen = []
    t = DeployTransport(grid, 4, registered={3: 99}, public_keys={2: k2}, on_node=lambda c, n, i: seen.append((c, n)),
                        refresh_every=0.0, min_pull_interval=0.0, hello_retry=0.0)
    t.refresh()
    assert sorted(n for n, kind in grid.pushed) == sorted(grid.nodes) and {k for _, k in grid.pushed} == {"query"}
    t.refresh()
    # 12 and 13 both claim client 1: the first answer wins; 14 is out of range; 15 has another
    # num-partitions; 16 failed (retried later); 17 claims client 3, registered to node 99
    assert t.client_node == {0: 11, 1: 12, 2: 18}
    assert t.available_clients() == {0, 1, 2} and t.node_for_client(2) == 18 and t.node_for_client(3) is None
    assert sorted(seen) == [(0, 11), (1, 12), (2, 18)]
    assert "already served" in t.nodes[13]["rejected"] and "registered to node 99" in t.nodes[17]["rejected"]
    assert "not a client id" in t.nodes[14]["rejected"] and "num-partitions" in t.nodes[15]["rejected"]
    assert 16 in t.hello_failed and 16 not in t.nodes
    # a node that leaves is unmapped; the failed one is greeted again, and so is 13, turned away
    # because 12 served client 1: 13 answers first and serves client 1 now
    grid.nodes.discard(12)
    grid.hellos[16] = _hello(1)
    t.refresh()
    t.refresh()
    assert t.client_node == {0: 11, 2: 18, 1: 13}
    assert "already served by node 13" in t.nodes[16]["rejected"]


@pytest.mark.deploy
def test_deploy_end_to_end_tls_auth_signing(tmp_path):
    """3 honest SuperNodes and one signing with an unregistered key; >= 6 updates applied."""
    keys, certs = keys_and_certs(tmp_path, 4)
    bad = tmp_path / "bad"
    assert CliRunner().invoke(cli_app, ["keys", "gen", "--out", str(bad), "--clients", "1", "--first", "3",
                                        "--no-supernode-auth"]).exit_code == 0
    cfg = tmp_path / "deploy.yaml"
    cfg.write_text(yaml.safe_dump({
        "name": "e2e", "seed": 0,
        "data": {"dataset": "digits", "num_clients": 4, "partitioner": "iid"},
        "model": {"name": "mlp", "hidden": 32},
        "train": {"local_epochs": 1, "batch_size": 32, "lr": 0.1},
        "server": {"strategy": "fedasync", "concurrency": 4, "max_versions": 6, "eval_every": 3,
                   "task_timeout": 600},
        "deploy": {"public_keys": str(keys), "node_discovery_timeout": 300},  # signing: on by default
    }))
    home = tmp_path / "flwr"
    out = tmp_path / "run"
    link_port, *node_ports = free_ports(5)
    procs = Processes(home)
    try:
        server = start_server(procs, cfg, out, keys, certs, link_port, 4, tmp_path / "server.out", home / "server")
        for i in range(4):
            procs.start(client_cmd(link_port, i, 4, keys, certs, "--port", str(node_ports[i]), "--device", "cpu",
                                   signing_key=bad / "client-3.key" if i == 3 else None),
                        tmp_path / f"client-{i}.log", home / f"node-{i}")
        wait_server(server, tmp_path / "server.out", out, 900)
    finally:
        procs.stop_all()

    summary = json.loads((out / "summary.json").read_text())
    assert summary["versions"] >= 6 and summary["updates_accepted"] >= 6
    from fedasync.store import Store

    store = Store(summary["store_url"], create=False)
    run = store.get_run(summary["run_id"])
    assert run.mode == "deployment" and run.status == "finished"
    ups = store.updates(summary["run_id"])
    honest = [u for u in ups if u.client_id in (0, 1, 2)]
    forged = [u for u in ups if u.client_id == 3]
    assert len(honest) >= 6 and all(u.accepted for u in honest)
    assert forged and all(not u.accepted and u.reason == "bad_signature" for u in forged)
    assert summary["rejections"] == {"bad_signature": len(forged)}
    assert summary["updates_accepted"] == sum(u.accepted for u in ups) == len(honest)
    # each applied version came from exactly one honest update (fedasync: one update per version)
    assert sorted(u.applied_in_version for u in honest if u.applied_in_version) == list(range(1, summary["versions"] + 1))
    # the server learnt which node is which client (the hello) and recorded it
    nodes = {c.client_id: c.node_id for c in store.clients(summary["run_id"])}
    assert all(nodes[c] for c in range(4)) and len(set(nodes.values())) == 4
    assert (out / "history.csv").exists() and (out / "config.yaml").exists()


def test_supernode_command_warm_and_poll(tmp_path):
    cmd = supernode_command("127.0.0.1:9092", 0, 2, insecure=True, port=9101, poll_interval=0.5)
    i = cmd.index("--")
    assert cmd[1:3] == ["-m", "fedasync.deploy.supernode"]
    assert cmd[cmd.index("--poll-interval") + 1] == "0.5" and "--no-warm" not in cmd[:i]
    assert cmd[i + 1:i + 3] == ["--superlink", "127.0.0.1:9092"]
    cold = supernode_command("127.0.0.1:9092", 0, 2, insecure=True, warm=False)
    assert "--no-warm" in cold[:cold.index("--")]
    from fedasync.deploy import DeployError

    with pytest.raises(DeployError, match="--poll-interval"):
        supernode_command("127.0.0.1:9092", 0, 2, insecure=True, poll_interval=0)
    r = CliRunner().invoke(cli_app, ["client", "--superlink", "127.0.0.1:9092", "--partition-id", "0",
                                     "--num-partitions", "2", "--insecure", "--no-signing", "--no-supernode-auth",
                                     "--poll-interval", "-1"])
    assert r.exit_code == 2 and "--poll-interval" in r.output


def test_poll_clock_maps_flowers_sleeps(monkeypatch):
    import time as _time

    from fedasync.deploy import supernode as sn

    slept = []
    monkeypatch.setattr(_time, "sleep", slept.append)
    clock = sn.PollClock(0.25)
    clock.sleep(3)
    clock.sleep(0.5)
    clock.sleep(0.1)
    assert slept == [0.25, sn.REPLY_CHECK_S, 0.1]
    assert clock.monotonic is _time.monotonic  # everything else is the time module's
    assert sn.runtime_port(["--superlink", "h:1", "--port", "9123"]) == 9123
    assert sn.runtime_port(["--port=9124"]) == 9124 and sn.runtime_port([]) == 9094
    import flwr.supernode.start_client_internal as sci

    monkeypatch.setattr(sci, "time", _time)
    monkeypatch.setattr(sci, "pull_objects", sci.pull_objects)  # restored after the test
    assert sn.patch_poll(0.25) and isinstance(sci.time, sn.PollClock)  # Flower's module still sleeps via `time`
    assert sci.pull_objects.keywords == {"initial_backoff": 0.05, "backoff_cap": 1.0}


def test_warm_preload_then_forked_training_matches_in_process(tmp_path):
    """The warm trainer's caches (data, model, torch's lazy set-up) serve a forked task process,
    which trains exactly as a fresh process would (same parameters for the same task)."""
    import numpy as np

    from fedasync.clients import runner
    from fedasync.clients.warm import preload
    from fedasync.config import load_config
    from fedasync.server.transport import client_setup_json
    from fedasync.task.models import get_params

    preload()
    cfg = load_config(None, ["data.dataset=digits", "data.num_clients=20", "model.name=mlp", "model.hidden=16",
                             "train.device=cpu"])
    setup = client_setup_json(cfg)
    runner.warm(setup, 3)
    model = runner._setup(setup)[2]
    params = get_params(model)
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:
        os.close(r)
        out = runner.handle_train(params, {"setup": setup, "client_id": 3, "seed": 7})
        os.write(w, np.concatenate([v.ravel() for v in out["params"].values()]).astype(np.float32).tobytes())
        os._exit(0)
    os.close(w)
    buf = b""
    while chunk := os.read(r, 1 << 16):
        buf += chunk
    os.close(r)
    assert os.waitpid(pid, 0)[1] == 0
    here = runner.handle_train(params, {"setup": setup, "client_id": 3, "seed": 7})["params"]
    np.testing.assert_array_equal(np.frombuffer(buf, np.float32),
                                  np.concatenate([v.ravel() for v in here.values()]).astype(np.float32))


def _trainer_line(log: Path, what: str, after: int = 0, timeout: float = 300) -> tuple[int, int, int]:
    """Wait for the trainer's next ``task ... (train) in process PID`` line in a device's log:
    (trainer pid, task process pid, offset after the line)."""
    import re

    pat = re.compile(r"fedasync trainer \[(\d+)\]: task \d+ \(train\) in process (\d+)")
    t0 = time.monotonic()
    while time.monotonic() - t0 < timeout:
        text = log.read_text(errors="replace") if log.exists() else ""
        m = pat.search(text, after)
        if m:
            return int(m.group(1)), int(m.group(2)), m.end()
        time.sleep(0.1)
    raise AssertionError(f"no task in {log} ({what}):\n{log.read_text(errors='replace')[-2000:]}")


@pytest.mark.deploy
def test_deploy_device_failures_cost_one_task(tmp_path):
    """Warm trainers: a task process killed mid-task, a warm trainer killed, a whole device killed:
    each costs at most its task (recorded failed/timeout), never the run."""
    cfg = tmp_path / "deploy.yaml"
    cfg.write_text(yaml.safe_dump({
        "name": "failures", "seed": 0,
        "data": {"dataset": "digits", "num_clients": 3, "partitioner": "iid"},
        "model": {"name": "mlp", "hidden": 16},
        "train": {"local_epochs": 1, "batch_size": 32, "lr": 0.1},
        # every task sleeps ~3 s (the wall-clock emulation): long enough to be killed mid-task
        "clock": {"emulate": True, "time_scale": 3.0, "sigma": 0.0, "jitter": 0.0},
        "server": {"strategy": "fedasync", "concurrency": 3, "max_versions": 12, "eval_every": 6,
                   "task_timeout": 60},
        "deploy": {"node_discovery_timeout": 300},
    }))
    home = tmp_path / "flwr"
    out = tmp_path / "run"
    link_port, *node_ports = free_ports(4)
    procs = Processes(home)
    logs = [tmp_path / f"client-{i}.log" for i in range(3)]
    try:
        server = procs.start([FEDASYNC, "server", str(cfg), "--out", str(out), "--insecure", "--port", str(link_port),
                              "--no-signing", "--no-supernode-auth"], tmp_path / "server.out", home / "server")
        wait_for_text(tmp_path / "server.out", "submitted", 180, server)
        nodes = [procs.start([FEDASYNC, "client", "--superlink", f"127.0.0.1:{link_port}", "--partition-id", str(i),
                              "--num-partitions", "3", "--insecure", "--no-signing", "--no-supernode-auth",
                              "--port", str(node_ports[i]), "--device", "cpu", "--poll-interval", "0.5"],
                             logs[i], home / f"node-{i}") for i in range(3)]
        # device 0: its task process dies mid-task -> the trainer sends an error reply
        _, task0, _ = _trainer_line(logs[0], "device 0")
        os.kill(task0, signal.SIGKILL)
        # device 1: its warm trainer dies mid-task -> started again; the task process carries on
        trainer1, _, _ = _trainer_line(logs[1], "device 1")
        os.kill(trainer1, signal.SIGKILL)
        # device 2: the whole device dies mid-task (SuperNode, trainer, task process)
        _, task2, _ = _trainer_line(logs[2], "device 2")
        below = descendants(nodes[2].pid)
        for pid in [nodes[2].pid] + [p for p, _ in below]:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        nodes[2].wait(timeout=10)
        wait_server(server, tmp_path / "server.out", out, 600)
    finally:
        procs.stop_all()

    summary = json.loads((out / "summary.json").read_text())
    assert summary["versions"] == 12
    from fedasync.store import Store

    store = Store(summary["store_url"], create=False)
    rid = summary["run_id"]
    disp = store.dispatches(rid)
    ups = {u.task_id: u for u in store.updates(rid)}
    # device 0: exactly the killed task failed, with the trainer's error reply; later tasks succeeded
    failed0 = [d for d in disp if d.client_id == 0 and d.status == "failed"]
    assert len(failed0) == 1 and "task process died" in failed0[0].error, [(d.status, d.error) for d in disp]
    assert any(u.client_id == 0 and u.accepted and u.task_id > failed0[0].task_id for u in ups.values())
    # device 1: its trainer was started again and it kept contributing
    text1 = logs[1].read_text(errors="replace")
    assert "the warm trainer exited" in text1 and text1.count("ClientApp loaded; polling") >= 2
    assert sum(u.client_id == 1 and u.accepted for u in ups.values()) >= 2
    assert len([d for d in disp if d.client_id == 1 and d.status in ("failed", "timeout")]) <= 1
    # device 2: the task it died in is recorded failed or timeout (and so is any task the server
    # sent it before noticing it left); it never replied again. On a quiet machine the two live
    # devices can reach max_versions before the dead task's 60 s timeout: the run's end then
    # records it cancelled, like every task still in flight at the end.
    gone = ("failed", "timeout", "cancelled")
    lost2 = [d for d in disp if d.client_id == 2 and d.status in gone]
    assert lost2 and all(d.status in gone for d in disp if d.client_id == 2 and d.task_id >= lost2[0].task_id)
    assert not [u for u in ups.values() if u.client_id == 2 and u.task_id >= lost2[0].task_id]
    assert store.get_run(rid).status == "finished"


def test_grid_transport_drains_the_replies_a_run_left():
    """``drain`` pulls the replies of the given messages as they come (Flower deletes a pulled
    message and its reply), skips ids never sent, and gives up after its timeout, saying how
    many never came."""
    from types import SimpleNamespace as NS

    from fedasync.server.app import GridTransport

    class SlowGrid:
        def __init__(self):
            self.ready: set[str] = set()
            self.pulls = 0

        def pull_messages(self, ids):
            self.pulls += 1
            if self.pulls == 3:  # the replies arrive while drain waits
                self.ready |= {"a", "b"}
            got = [i for i in ids if i in self.ready]
            self.ready -= set(got)
            return [NS(metadata=NS(reply_to_message_id=i)) for i in got]

    grid = SlowGrid()
    t = GridTransport(grid)
    assert t.drain(["a", "b", None]) == 0 and grid.pulls == 3
    assert t.drain(["c"], timeout=0.1) == 1 and grid.pulls > 3


def test_grid_transport_builds_each_models_record_once(monkeypatch):
    """One ArrayRecord per model object, also when tasks alternate between two models (the
    current one and a stale attacker's old one); a third model evicts the oldest."""
    import numpy as np

    import fedasync.server.app as app_mod
    from fedasync.server.app import GridTransport
    from fedasync.server.transport import TaskMsg

    from types import SimpleNamespace as NS

    built = []
    real = app_mod.params_to_record
    monkeypatch.setattr(app_mod, "params_to_record", lambda p: built.append(p) or real(p))
    monkeypatch.setattr(app_mod, "Message", lambda content, **kw: NS(content=content, **kw))  # no Flower run here

    class Grid:
        def __init__(self):
            self.sent = []

        def push_messages(self, msgs):
            self.sent += msgs
            return [str(len(self.sent) - len(msgs) + i) for i in range(len(msgs))]

    a, b, c = ({"w": np.full(3, x, np.float32)} for x in (1.0, 2.0, 3.0))
    t = GridTransport(Grid())
    t.send([TaskMsg(i, i, 1, p, {}) for i, p in enumerate([a, b, a, b, a])])
    assert [x is a for x in built] == [True, False]
    t.send([TaskMsg(5, 0, 1, b, {}), TaskMsg(6, 0, 1, c, {}), TaskMsg(7, 0, 1, b, {}), TaskMsg(8, 0, 1, a, {})])
    assert len(built) == 4 and built[2] is c and built[3] is a  # a was evicted by c
    recs = [m.content["params"] for m in t.grid.sent]  # the shared record of each model, its arrays intact
    assert recs[0] is recs[2] is recs[4] and recs[1] is recs[3] is recs[5] is recs[7] and recs[0] is not recs[1]
    assert [float(r.to_numpy_ndarrays()[0][0]) for r in recs] == [1, 2, 1, 2, 1, 2, 3, 2, 1]


@pytest.mark.deploy
def test_deploy_devices_apply_their_own_dp_policy(tmp_path):
    """A local-DP run (TLS, node auth, signing: the defaults) with two devices started by
    ``fedasync client --privacy-policy``: device 0's policy admits the server's plan (sigma 1.2),
    device 1's asks for more noise (min 5.0). Device 0 trains, its accountant file (in its own state
    dir) records what it spent; device 1 refuses without training (``privacy_policy``, recorded in
    the store) and the run completes on device 0 alone."""
    from fedasync.privacy.budgets import history_steps

    keys, certs = keys_and_certs(tmp_path, 2)
    cfg = tmp_path / "dp.yaml"
    cfg.write_text(yaml.safe_dump({
        "name": "dp-devices", "seed": 0,
        "data": {"dataset": "digits", "num_clients": 2, "partitioner": "iid"},
        "model": {"name": "mlp", "hidden": 16},
        "train": {"local_steps": 2, "batch_size": 32, "lr": 0.1},
        "server": {"strategy": "fedasync", "concurrency": 2, "max_versions": 3, "eval_every": 3,
                   "task_timeout": 600},
        "privacy": {"local_dp": {"enabled": True, "epsilon": 50.0, "noise_multiplier": 1.2, "max_grad_norm": 1.0,
                                 "planned_tasks": 10, "accountant": "rdp"}},
        "deploy": {"public_keys": str(keys), "node_discovery_timeout": 300},
    }))
    policies, states = [], []
    for i, min_noise in enumerate((1.0, 5.0)):  # the plan's 1.2 is enough for device 0, not for device 1
        p = tmp_path / f"policy-{i}.yaml"
        p.write_text(yaml.safe_dump({"accountant": "rdp", "epsilon": 100.0, "delta": 1e-5,
                                     "min_noise_multiplier": min_noise, "max_sample_rate": 0.5,
                                     "max_grad_norm": 1.0, "allow_report_loss": False}))
        policies.append(p)
        states.append(tmp_path / f"state-{i}")
    home = tmp_path / "flwr"
    out = tmp_path / "run"
    link_port, *node_ports = free_ports(3)
    procs = Processes(home)
    logs = [tmp_path / f"client-{i}.log" for i in range(2)]
    try:
        server = start_server(procs, cfg, out, keys, certs, link_port, 2, tmp_path / "server.out", home / "server")
        for i in range(2):
            procs.start(client_cmd(link_port, i, 2, keys, certs, "--privacy-policy", str(policies[i]),
                                   "--privacy-state-dir", str(states[i]), "--port", str(node_ports[i]),
                                   "--device", "cpu"),
                        logs[i], home / f"node-{i}")
        wait_server(server, tmp_path / "server.out", out, 900)
    finally:
        procs.stop_all()

    summary = json.loads((out / "summary.json").read_text())
    assert summary["versions"] == 3
    from fedasync.store import Store

    store = Store(summary["store_url"], create=False)
    rid = summary["run_id"]
    assert store.get_run(rid).status == "finished"
    ups = store.updates(rid)
    assert [u.client_id for u in ups if u.accepted] == [0, 0, 0] and not [u for u in ups if u.client_id == 1]
    refused = [d for d in store.dispatches(rid) if d.client_id == 1]
    assert refused and all(d.status == "refused" and d.error == "privacy_policy" for d in refused), \
        [(d.status, d.error) for d in refused]
    clients = {c.client_id: c for c in store.clients(rid)}
    assert clients[1].exhausted and clients[1].exhausted_reason == "privacy_policy"
    assert not clients[0].exhausted
    # device 0's own record of its spend: one accountant file in its state dir, charged for each task
    files0 = sorted(states[0].glob("accountant-device-*.json"))
    assert len(files0) == 1
    record = json.loads(files0[0].read_text())
    assert record["accountant"] == "rdp" and record["epsilon"] > 0
    assert all(sigma == 1.2 for sigma, _q, _n in record["history"])
    assert history_steps(record["history"]) >= 2 * 3  # 2 steps per task, at least the 3 accepted tasks
    # device 1 spent nothing: it refused before training, and said why in its own log
    assert not list(states[1].glob("accountant-*.json"))
    assert "privacy policy: refused task" in logs[1].read_text(errors="replace")
