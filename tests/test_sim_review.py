"""`fedasync simulate` stopped with Ctrl-C: the command ends, writes the interrupted run's outputs,
starts no further --compare entry, and (Flower's engine) leaves no process behind."""

import json
import os
import signal
import socket
import sqlite3
import subprocess
import sys
import time

import pytest

from conftest import SMALL


def _start(out, *extra):
    args = [sys.executable, "-m", "fedasync", "simulate", "--out", str(out)]
    for s in SMALL + ["server.max_versions=100000", "server.target_accuracy=null"]:
        args += ["--set", s]

    def sigint_default():  # a background job of a shell starts with SIGINT ignored
        signal.signal(signal.SIGINT, signal.SIG_DFL)

    return subprocess.Popen(args + list(extra), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True, preexec_fn=sigint_default)


def _versions(db) -> int:
    try:
        with sqlite3.connect(f"file:{db}?mode=ro", uri=True, timeout=1) as c:
            return c.execute("select count(*) from model_versions").fetchone()[0]
    except sqlite3.Error:
        return 0


def _ctrl_c_when_running(p, db, timeout=300.0):
    """Ctrl-C at a terminal: SIGINT to the whole process group, once ``db`` holds a few versions."""
    t0 = time.time()
    while _versions(db) < 3:
        assert p.poll() is None, p.stdout.read()
        assert time.time() - t0 < timeout, "the run did not start"
        time.sleep(0.5)
    os.killpg(p.pid, signal.SIGINT)
    return _communicate(p, 120, "after Ctrl-C")[0]


def _communicate(p, timeout: float, what: str) -> tuple[str, str | None]:
    """``p``'s output once it ends within ``timeout`` s; else its process group is killed and the
    test fails ("the command hung ``what``")."""
    try:
        return p.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(p.pid, signal.SIGKILL)
        out, err = p.communicate()
        pytest.fail(f"the command hung {what}:\n" + (err or out)[-3000:])


def _left_in_group(pgid: int, wait_s: float = 10.0) -> list[str]:
    """The processes still running in group ``pgid`` after up to ``wait_s`` s (exited ones that
    their parent has not reaped yet, ``<defunct>``, hold nothing and are not counted)."""
    t0 = time.time()
    while True:
        ps = subprocess.run(["ps", "-eo", "pgid=,pid=,stat=,args="], capture_output=True, text=True).stdout
        left = [line for line in ps.splitlines() if line.split()[0] == str(pgid) and not line.split()[2].startswith("Z")]
        if not left or time.time() - t0 > wait_s:
            return left
        time.sleep(0.5)


def test_ctrl_c_stops_a_compare_run_and_starts_no_other(tmp_path):
    p = _start(tmp_path, "--backend", "local", "--compare", "fedbuff,fedasync")
    out = _ctrl_c_when_running(p, tmp_path / "fedbuff" / "fedasync.db")
    assert p.returncode == 0, out
    assert json.loads((tmp_path / "fedbuff" / "summary.json").read_text())["stop_reason"] == "interrupted"
    assert not (tmp_path / "fedasync").exists(), out
    assert "not run (interrupted): fedasync" in out


@pytest.mark.engine
def test_ctrl_c_stops_a_flower_engine_run(tmp_path):
    p = _start(tmp_path, "--backend", "flower", "--set", "simulation.num_actors=2")
    try:
        out = _ctrl_c_when_running(p, tmp_path / "fedasync.db")
    finally:
        if p.poll() is None:
            os.killpg(p.pid, signal.SIGKILL)
    assert p.returncode == 0, out
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["stop_reason"] == "interrupted" and summary["versions"] >= 3
    assert f"--resume {summary['run_id']}" in out
    left = _left_in_group(p.pid)  # Ray's processes are in the command's process group
    for line in left:
        os.kill(int(line.split()[1]), signal.SIGKILL)
    assert not left, left


@pytest.mark.engine
def test_a_ray_that_cannot_start_fails_in_one_line(tmp_path):
    """RAY_ADDRESS=auto and no cluster runs: the command exits 1 with one line naming the cause (it
    printed Flower's traceback and hung: the ServerApp thread waited for replies forever). (An
    address where nothing listens is refused before Ray is asked: see the test below.)"""
    out_dir = tmp_path / "new"  # made by the command, removed again: the engine failed before a run wrote to it
    args = [sys.executable, "-m", "fedasync", "simulate", "--out", str(out_dir)]
    for s in SMALL:
        args += ["--set", s]
    env = {**os.environ, "RAY_ADDRESS": "auto"}
    p = subprocess.Popen(args, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env,
                         start_new_session=True)
    out, err = _communicate(p, 150, "after Ray failed to start")
    assert p.returncode == 1, out + err
    assert err.strip().splitlines()[-1].startswith("error: Flower's simulation engine failed: ConnectionError: "), err
    assert "Traceback" not in err.split("Flower's simulation engine failed")[-1]
    if out_dir.exists():  # the ServerApp had started its run before Ray failed (a loaded machine): its outputs
        assert json.loads((out_dir / "summary.json").read_text())["stop_reason"] == "interrupted"
    # else: no run had started, and the directory the command made is gone (an empty one was left)


def _closed_port() -> int:
    with socket.socket() as s:  # bound, never listening: a connection to it is refused
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_ray_address_where_no_cluster_listens_is_refused_at_once(tmp_path):
    """RAY_ADDRESS naming host:port where nothing listens: Ray retried it for minutes (the command
    looked hung); now `simulate` refuses it in one line before anything is written, exit 2."""
    from fedasync.runs import ray_address_problem

    port = _closed_port()
    for addr in (f"127.0.0.1:{port}", f"ray://127.0.0.1:{port}"):
        msg = ray_address_problem({"RAY_ADDRESS": addr}, timeout=2)
        assert msg and msg.startswith(f"RAY_ADDRESS={addr}: no Ray cluster at 127.0.0.1:{port}"), msg
    with socket.socket() as srv:  # something listens: joining it is left to Ray
        srv.bind(("127.0.0.1", 0))
        srv.listen()
        assert ray_address_problem({"RAY_ADDRESS": f"127.0.0.1:{srv.getsockname()[1]}"}) is None
    for addr in ("auto", "local", "", "not an address"):  # Ray's own forms, and what Ray reports itself
        assert ray_address_problem({"RAY_ADDRESS": addr}) is None

    from typer.testing import CliRunner

    from fedasync.cli import app

    out = tmp_path / "out"
    sets = [a for s in SMALL for a in ("--set", s)]
    r = CliRunner().invoke(app, ["simulate", "--out", str(out), *sets], env={"RAY_ADDRESS": f"127.0.0.1:{port}"})
    assert r.exit_code == 2, r.output
    assert f"no Ray cluster at 127.0.0.1:{port}" in r.output
    assert not out.exists()
    r = CliRunner().invoke(app, ["simulate", "--backend", "local", "--out", str(out), *sets,
                                 "--set", "server.max_versions=2"], env={"RAY_ADDRESS": f"127.0.0.1:{port}"})
    assert r.exit_code == 0, r.output  # the local backend does not use Ray


def test_remove_if_empty_keeps_any_directory_holding_a_file(tmp_path):
    from fedasync.outputs import remove_if_empty

    (tmp_path / "a" / "b" / "c").mkdir(parents=True)
    (tmp_path / "a" / "d").mkdir()
    assert remove_if_empty(tmp_path / "a") and not (tmp_path / "a").exists()
    (tmp_path / "x" / "y").mkdir(parents=True)
    (tmp_path / "x" / "y" / "f").write_text("1")
    assert not remove_if_empty(tmp_path / "x") and (tmp_path / "x" / "y" / "f").exists()


def test_flwr_run_takes_the_nodes_its_federation_has():
    """``flwr run .`` without ``simulation.num_supernodes``: the federation's size is Flower's
    config, so the ServerApp takes the nodes that connect (until none joins for ``settle_s``)
    instead of waiting for ``data.num_clients`` of them and failing after 120 s."""
    from fedasync.server.app import GridTransport

    class Grid:  # nodes join one by one, as a simulation engine registers them
        calls = 0

        def get_node_ids(self):
            self.calls += 1
            return list(range(1, min(self.calls, 3) + 1))

    assert GridTransport(Grid()).wait_for_nodes(1) == [1]  # without settling: the first node only
    assert GridTransport(Grid()).wait_for_nodes(1, settle_s=0.5) == [1, 2, 3]
    with pytest.raises(RuntimeError, match="only 3 of 5 nodes connected"):
        GridTransport(Grid()).wait_for_nodes(5, timeout=1.0, settle_s=0.5)


def test_ray_backend_config_joins_an_existing_cluster_without_a_core_count():
    """Ray refuses num_cpus when it joins a cluster (RAY_ADDRESS): fedasync simulate failed there.
    Checked by hand against `ray start --head`: the same model sha256 as the local backend."""
    from fedasync.runs import ray_backend_config

    here = ray_backend_config(2, False, environ={})
    assert here["init_args"]["num_cpus"] == (os.cpu_count() or 1)
    assert here["client_resources"]["num_cpus"] == (os.cpu_count() or 1) / 2
    cluster = ray_backend_config(2, False, environ={"RAY_ADDRESS": "10.0.0.1:6379"})
    assert "num_cpus" not in cluster["init_args"] and cluster["client_resources"]["num_cpus"] == 1
