"""A DP run through Flower's simulation engine equals the in-process run (same model, same epsilons)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys

import pytest

from test_privacy_run import SMALL

pytestmark = pytest.mark.engine


def _simulate(out, *extra):
    args = [sys.executable, "-m", "fedasync", "simulate", "--out", str(out)]
    for s in SMALL:
        args += ["--set", s]
    proc = subprocess.Popen(args + list(extra), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)
    try:
        stdout, stderr = proc.communicate(timeout=600)
    finally:
        try:  # whatever the engine left in this process group (Ray workers), by its group id
            os.killpg(proc.pid, signal.SIGTERM)
        except (ProcessLookupError, PermissionError):
            pass
    return proc.returncode, stdout + stderr


def test_dp_run_is_identical_on_the_engine_and_in_process(tmp_path):
    rc, log = _simulate(tmp_path / "flower", "--backend", "flower", "--set", "simulation.num_actors=2",
                        "--set", "simulation.num_supernodes=2")
    assert rc == 0, log
    rc, log2 = _simulate(tmp_path / "local", "--backend", "local")
    assert rc == 0, log2
    a = json.loads((tmp_path / "flower" / "summary.json").read_text())
    b = json.loads((tmp_path / "local" / "summary.json").read_text())
    assert a["model_sha256"] == b["model_sha256"]
    assert a["privacy"] == b["privacy"]
    assert a["stop_reason"] == "no_client_can_train"
    assert "all 4 clients have exhausted their privacy budget" in log
