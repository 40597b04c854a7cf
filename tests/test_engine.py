"""End to end through Flower's simulation engine (Ray): one run shared by several assertions."""

import csv
import json
import subprocess
import sys

import pytest

from conftest import SMALL
from fedasync.store import Store, decode_params
from fedasync.server.strategies import params_sha256

pytestmark = pytest.mark.engine


def _simulate(out, *extra):
    args = [sys.executable, "-m", "fedasync", "simulate", "--out", str(out)]
    for s in SMALL:
        args += ["--set", s]
    return subprocess.run(args + list(extra), capture_output=True, text=True, timeout=600)


@pytest.fixture(scope="module")
def engine_and_local(tmp_path_factory):
    root = tmp_path_factory.mktemp("engine")
    flower = _simulate(root / "flower", "--set", "simulation.num_actors=2")
    assert flower.returncode == 0, flower.stdout + flower.stderr
    local = _simulate(root / "local", "--backend", "local")
    assert local.returncode == 0, local.stdout + local.stderr
    return root, flower.stdout


def test_engine_run_writes_every_output(engine_and_local):
    root, stdout = engine_and_local
    out = root / "flower"
    for name in ("summary.json", "history.csv", "accuracy.png", "config.yaml", "fedasync.db"):
        assert (out / name).is_file(), name
    s = json.loads((out / "summary.json").read_text())
    for key in ("strategy", "seed", "num_clients", "concurrency", "versions", "updates_received",
                "updates_accepted", "updates_rejected", "virtual_time_s", "wall_time_s", "final_accuracy",
                "best_accuracy", "target_accuracy", "time_to_target_s", "staleness", "model_sha256",
                "store_url", "history"):
        assert key in s, key
    assert set(s["staleness"]) == {"mean", "p50", "p95", "max"}
    assert s["versions"] == 12 and s["updates_accepted"] == 36
    rows = list(csv.DictReader((out / "history.csv").open()))
    assert [int(r["version"]) for r in rows] == [h["version"] for h in s["history"]]
    assert "summary.json" in stdout


def test_engine_and_in_process_runs_are_identical(engine_and_local):
    root, _ = engine_and_local
    a = json.loads((root / "flower" / "summary.json").read_text())
    b = json.loads((root / "local" / "summary.json").read_text())
    assert a["model_sha256"] == b["model_sha256"]
    assert a["history"] == b["history"]


def test_engine_store_matches_summary(engine_and_local):
    root, _ = engine_and_local
    s = json.loads((root / "flower" / "summary.json").read_text())
    store = Store(s["store_url"])
    counts = store.counts(s["run_id"])
    assert counts["updates"] == s["updates_received"] and counts["versions"] == s["versions"] + 1
    versions = store.versions(s["run_id"])
    kept = [v for v in versions if v.parameters is not None]
    # retention (store.checkpoint_every) prunes parameters; the latest version always keeps them
    assert kept and kept[-1].version == max(v.version for v in versions)
    for v in kept:
        assert params_sha256(decode_params(v.parameters)) == v.sha256
