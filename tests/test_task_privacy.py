"""A user task under local DP (issue 33): the privacy report recomputed, the plan the run used.

A small task is written into a temporary project folder beside its YAML (as a user's project
is), run through :func:`fedasync.simulate` with ``privacy.reproducible_noise``; then
``fedasync privacy report`` must agree with Opacus' own accounting of each client's recorded
history and with the store's ``privacy_spend`` rows, and ``fedasync privacy plan`` (from another
working directory: the task is imported from the YAML's folder) must print the client sizes and
sample rates that the run used.
"""

from __future__ import annotations

import json
import math
import textwrap
from pathlib import Path

import pytest
from typer.testing import CliRunner

import fedasync
from fedasync.cli import app
from fedasync.privacy.budgets import epsilon_of
from fedasync.store import Store

runner = CliRunner()

TASK_NAME = "task_privacy_tiny"  # unique in sys.modules across the test session

# client c holds 12 + 8c training samples: with batch 8, q = 1/2, 1/3, 1/4, 1/5 (one plan group each)
TASK_SOURCE = '''
import numpy as np
import torch
from torch import nn
from torch.utils.data import TensorDataset


def _set(n, seed):
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(n, 4)).astype(np.float32)
    y = (x[:, 0] + x[:, 1] > 0).astype(np.int64)
    return TensorDataset(torch.from_numpy(x), torch.from_numpy(y))


def model(hidden=8):
    return nn.Sequential(nn.Linear(4, hidden), nn.ReLU(), nn.Linear(hidden, 2))


def load_data(partition_id, num_partitions, hidden=8):
    return _set(12 + 8 * partition_id, 100 + partition_id), _set(4, 200 + partition_id)


def load_centralized(hidden=8):
    return _set(32, 7)
'''

CONFIG = f"""
name: tiny_dp
seed: 3
task: {TASK_NAME}
task_args:
  hidden: 8
data:
  num_clients: 4
train:
  local_steps: 3
  batch_size: 8
  lr: 0.1
server:
  strategy: fedbuff
  concurrency: 4
  buffer_size: 2
  eval_every: 2
  max_versions: 5
clock:
  sigma: 0.5
  step_time: 0.05
privacy:
  reproducible_noise: true
  local_dp:
    enabled: true
    epsilon: 6.0
    delta: 1.0e-5
    max_grad_norm: 1.0
    noise_multiplier: auto
    planned_tasks: 10
    accountant: rdp
simulation:
  backend: local
"""

SIZES = [12, 20, 28, 36]


def _project(tmp_path: Path) -> Path:
    proj = tmp_path / "proj"
    proj.mkdir()
    (proj / f"{TASK_NAME}.py").write_text(textwrap.dedent(TASK_SOURCE))
    (proj / "config.yaml").write_text(CONFIG)
    return proj / "config.yaml"


@pytest.fixture(scope="module")
def dp_task_run(tmp_path_factory):
    """(config path, Result) of one small local-DP run of the user task."""
    tmp = tmp_path_factory.mktemp("task_privacy")
    config = _project(tmp)
    result = fedasync.simulate(config, out=tmp / "run")
    return config, result


def _opacus_epsilon(entries, delta: float) -> float:
    """Opacus' RDP accountant, stepped through ``[(noise_multiplier, sample_rate, steps), ...]``."""
    from opacus.accountants import RDPAccountant

    acc = RDPAccountant()
    for sigma, q, steps in entries:
        for _ in range(int(steps)):
            acc.step(noise_multiplier=float(sigma), sample_rate=float(q))
    return float(acc.get_epsilon(delta))


def test_report_of_a_user_task_under_local_dp_is_opacus_accounting_of_its_history(dp_task_run):
    _, result = dp_task_run
    s = result.summary
    assert list(result.parts.num_examples) == SIZES  # the run's clients are the task's
    res = runner.invoke(app, ["privacy", "report", "--store", str(result.run_dir), "--json"])
    assert res.exit_code == 0, res.output
    rows = json.loads(res.output)
    assert sorted(r["client"] for r in rows) == [0, 1, 2, 3]
    st = Store(result.store_url)
    try:
        spend = st.privacy_spend(s["run_id"])
    finally:
        st.close()
    for r in rows:
        c = r["client"]
        mine = [p for p in spend if p.client_id == c]
        assert r["tasks_done"] == len(mine) >= 1, (c, r["tasks_done"], len(mine))
        assert r["accountant"] == "rdp" and r["delta"] == 1e-5 and r["epsilon_budget"] == 6.0
        # the report's epsilon is the one recomputed from the recorded history ...
        assert math.isclose(r["epsilon"], epsilon_of(r["history"], r["delta"], r["accountant"]), rel_tol=1e-9)
        assert math.isclose(r["epsilon"], _opacus_epsilon(r["history"], r["delta"]), rel_tol=1e-9)
        # ... and that history is the composition of the client's privacy_spend rows
        rows_eps = _opacus_epsilon([(p.noise_multiplier, p.sample_rate, p.steps) for p in mine], r["delta"])
        assert math.isclose(r["epsilon"], rows_eps, rel_tol=1e-9)
        assert sum(h[2] for h in r["history"]) == sum(p.steps for p in mine) == 3 * len(mine)
        assert math.isclose(mine[-1].epsilon, r["epsilon"], rel_tol=1e-12)
        assert 0 < r["epsilon"] <= r["epsilon_budget"] and not r["exhausted"]
        # the sample rate Opacus derives from the task's own client size: q = 1/ceil(n/batch)
        assert {p.sample_rate for p in mine} == {1.0 / math.ceil(SIZES[c] / 8)}
    priv = s["privacy"]
    assert math.isclose(priv["epsilon_max"], max(r["epsilon"] for r in rows), rel_tol=1e-12)
    assert priv["tasks_private"] == sum(r["tasks_done"] for r in rows) == len(spend)


def test_plan_of_a_user_task_is_the_plan_its_run_used(dp_task_run, tmp_path, monkeypatch):
    config, result = dp_task_run
    monkeypatch.chdir(tmp_path)  # the task is imported from the YAML's folder, not the working directory
    res = runner.invoke(app, ["privacy", "plan", str(config), "--json"])
    assert res.exit_code == 0, res.output
    groups = json.loads(res.output)["local_dp"]
    st = Store(result.store_url)
    try:
        spend = st.privacy_spend(result.summary["run_id"])
    finally:
        st.close()
    planned = {}
    for g in groups:
        for part in g["clients"].split(","):
            lo, _, hi = part.partition("-")
            for c in range(int(lo), int(hi or lo) + 1):
                planned[c] = g
    assert sorted(planned) == [0, 1, 2, 3]
    for c, g in planned.items():
        run_n = result.parts.num_examples[c]
        assert g["records"][0] <= run_n <= g["records"][1], (c, g["records"], run_n)
        mine = [p for p in spend if p.client_id == c]
        assert mine, c
        for p in mine:  # what the run charged each task of this client is what the plan says
            assert p.sample_rate == g["sample_rate"], (c, p.sample_rate, g["sample_rate"])
            assert p.noise_multiplier == g["noise_multiplier"] and p.steps == g["steps_per_task"]
    assert [planned[c]["records"] for c in range(4)] == [[n, n] for n in SIZES]
    text = runner.invoke(app, ["privacy", "plan", str(config)], env={"COLUMNS": "200"})
    assert text.exit_code == 0, text.output
    lines = {ln.split()[0]: ln.split() for ln in text.output.splitlines() if ln.strip()[:1].isdigit()}
    assert [lines[str(c)][1] for c in range(4)] == [str(n) for n in SIZES]  # n per client, as the run had


def test_plan_of_a_task_that_does_not_load_is_one_line(tmp_path):
    config = _project(tmp_path)
    (config.parent / f"{TASK_NAME}_broken.py").write_text("import no_such_module_anywhere\n")
    res = runner.invoke(app, ["privacy", "plan", str(config), "--set", f"task={TASK_NAME}_broken"])
    assert res.exit_code == 2
    out = res.output.strip()
    assert len(out.splitlines()) == 1 and f"task {TASK_NAME}_broken" in out and "does not import" in out, out
    res = runner.invoke(app, ["privacy", "plan", str(config), "--set", "task=no_such_task_module"])
    assert res.exit_code == 2 and len(res.output.strip().splitlines()) == 1
    assert "no module named 'no_such_task_module'" in res.output and str(config.parent.resolve()) in res.output
