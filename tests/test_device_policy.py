"""A device decides its own privacy (issue 32): a real device (``device_node``) checks every DP task
against its own policy, keeps its own accountant keyed by its own id, and says nothing about its
record count. Tried as a malicious server would, through the real client handler
(``fedasync.clients.runner.handle_train``) on a device's own ``.npz`` and state dir (CPU, seconds)."""

from __future__ import annotations

import json
import os
import stat

import numpy as np
import pytest
import yaml
from typer.testing import CliRunner

from fedasync.clients.runner import handle_train
from fedasync.config import load_config
from fedasync.privacy.budgets import epsilon_of, extend_history
from fedasync.privacy.policy import DevicePolicy
from fedasync.server.transport import client_setup_json
from fedasync.task.data import load_federated
from fedasync.task.models import init_params

pytestmark = pytest.mark.usefixtures("one_thread")

Q, STEPS, SIGMA = 0.5, 2, 6.0  # the server's public plan: 96 records, batch 48
POLICY = DevicePolicy(epsilon=1.0, delta=1e-5, min_noise_multiplier=1.0, max_sample_rate=0.5, max_grad_norm=1.0)


@pytest.fixture(scope="module")
def fed_setup(tmp_path_factory):
    cfg = load_config(None, ["data.num_clients=2", "server.concurrency=2", "server.buffer_size=2", "model.hidden=8",
                             "train.batch_size=48", "train.local_steps=2", "train.lr=0.1"])
    fed = load_federated(cfg.data, cfg.seed)
    params = init_params(cfg.model, fed.input_shape, fed.num_classes, cfg.seed)
    x, y = fed.partitions[0]
    d = tmp_path_factory.mktemp("npz")
    paths = {}
    for n in (96, 97):
        paths[n] = str(d / f"device-{n}.npz")
        np.savez(paths[n], x=x[:n], y=y[:n])
    return cfg, fed, params, paths


def _pconf(**kw):
    """A deployment task's privacy block as PrivacyTracker.client_config sends it (no history)."""
    base = {"local_dp": True, "epsilon": 1.0, "delta": 1e-5, "planned_tasks": 3, "noise_multiplier": SIGMA,
            "noise_auto": False, "sample_rate": Q, "steps": STEPS, "max_grad_norm": 1.0, "accountant": "rdp",
            "grad_sample_mode": "ghost", "secure_mode": False, "reproducible_noise": False, "report_loss": False,
            "num_examples": 96, "server_history": []}
    base.update(kw)
    return {k: v for k, v in base.items() if v is not ...}


def _task(fed_setup, state_dir, privacy, *, n=96, policy=POLICY, setup=None, run_id=1, task_id=1, **kw):
    cfg, fed, params, paths = fed_setup
    config = {"setup": setup or client_setup_json(cfg, fed), "client_id": 0, "seed": 3 + task_id, "run_id": run_id,
              "task_id": task_id, "base_version": 0, "deployment": True, "privacy": privacy}
    if policy is not None:
        kw["policy"] = policy
    return handle_train(params, config, data_path=paths[n], state_dir=str(state_dir), device_node=True, **kw)


def _accountant_files(state_dir):
    return sorted(p.name for p in state_dir.glob("accountant-*.json"))


# -- a malicious server's tasks are refused before training -------------------------------------------------


@pytest.mark.parametrize("attack", [
    pytest.param({"history": []}, id="history-reset"),
    pytest.param({"state_key": "fresh-key"}, id="state-key"),
    pytest.param({"epsilon": None, "noise_multiplier": 0.0, "report_loss": True}, id="no-noise"),
    pytest.param({"report_loss": True}, id="report-loss-forbidden"),
    pytest.param({"max_grad_norm": 5.0}, id="looser-clip"),
    pytest.param({"sample_rate": 1.0}, id="larger-q"),
    pytest.param({"noise_multiplier": 0.5}, id="noise-below-min"),
    pytest.param({"accountant": "prv"}, id="other-accountant"),
    pytest.param({"local_dp": False}, id="not-local-dp"),
])
def test_a_task_asking_for_less_privacy_is_refused_without_training(fed_setup, tmp_path, caplog, attack):
    import logging

    with caplog.at_level(logging.WARNING, logger="fedasync.privacy"):
        out = _task(fed_setup, tmp_path, _pconf(**attack))
    assert out["refused"] == "privacy_policy" and "params" not in out, out
    assert _accountant_files(tmp_path) == []  # nothing trained, nothing charged
    said = [r.getMessage() for r in caplog.records if "privacy policy: refused" in r.getMessage()]
    assert len(said) == 1 and out["metrics"]["policy_rule"] in said[0]


def test_a_task_without_privacy_is_refused_by_a_dp_device(fed_setup, tmp_path):
    out = _task(fed_setup, tmp_path, None)
    assert out["refused"] == "privacy_policy" and "not local DP" in out["metrics"]["policy_rule"]


def test_a_device_without_a_policy_refuses_dp_tasks_and_trains_the_rest(fed_setup, tmp_path):
    out = _task(fed_setup, tmp_path, _pconf(), policy=None)
    assert out["refused"] == "privacy_policy" and "--privacy-policy" in out["metrics"]["policy_rule"]
    assert _accountant_files(tmp_path) == []
    plain = _task(fed_setup, tmp_path, None, policy=None)
    assert plain.get("refused") is None and plain["metrics"]["steps"] == 2 and "loss" in plain["metrics"]


def test_the_loss_is_reported_only_when_the_policy_allows_it(fed_setup, tmp_path):
    allowed = POLICY.model_copy(update={"allow_report_loss": True})
    out = _task(fed_setup, tmp_path, _pconf(report_loss=True), policy=allowed)
    assert out.get("refused") is None and np.isfinite(out["metrics"]["loss"])


def test_max_epsilon_per_task_refuses_a_costly_task(fed_setup, tmp_path):
    one = epsilon_of([(SIGMA, Q, STEPS)], 1e-5, "rdp")
    tight = DevicePolicy(epsilon=10.0, max_epsilon_per_task=one * 0.9)
    out = _task(fed_setup, tmp_path, _pconf(), policy=tight)
    assert out["refused"] == "privacy_policy" and "max_epsilon_per_task" in out["metrics"]["policy_rule"]
    ok = _task(fed_setup, tmp_path, _pconf(), policy=DevicePolicy(epsilon=10.0, max_epsilon_per_task=one))
    assert ok.get("refused") is None


# -- the device's budget and record ---------------------------------------------------------------------


def _tasks_until_refused(fed_setup, state_dir, pconf, run_id, limit=12):
    for t in range(1, limit + 1):
        out = _task(fed_setup, state_dir, pconf, run_id=run_id, task_id=t)
        if out.get("refused"):
            return t - 1, out
    raise AssertionError(f"still training after {limit} tasks")


def test_the_budget_holds_across_tasks_and_runs_whatever_the_task_says(fed_setup, tmp_path):
    per_task = extend_history([], SIGMA, Q, STEPS, "rdp")
    fits = max(t for t in range(1, 20)
               if epsilon_of([(SIGMA, Q, STEPS * t)], 1e-5, "rdp") <= POLICY.epsilon)
    assert per_task and 1 <= fits < 12
    # the server wishes for epsilon 100: the device's policy (1.0) decides
    done, out = _tasks_until_refused(fed_setup, tmp_path, _pconf(epsilon=100.0), run_id=1)
    assert done == fits and out["refused"] == "privacy_budget_exhausted"
    assert out["metrics"]["epsilon_budget"] == POLICY.epsilon
    files = _accountant_files(tmp_path)
    assert len(files) == 1 and files[0].startswith("accountant-device-")
    # another run (another server, a fresh record there, no server_history at all): still exhausted
    for privacy in (_pconf(), _pconf(server_history=...)):
        again = _task(fed_setup, tmp_path, privacy, run_id=2, task_id=1)
        assert again["refused"] == "privacy_budget_exhausted"
    assert _accountant_files(tmp_path) == files
    assert stat.S_IMODE(os.stat(tmp_path / "device-id").st_mode) == 0o600


def test_the_server_record_only_raises_the_device_record(fed_setup, tmp_path):
    roomy = DevicePolicy(epsilon=5.0, min_noise_multiplier=1.0)
    first = _task(fed_setup, tmp_path, _pconf(), task_id=1, policy=roomy)
    assert first["metrics"]["accountant_history"] == [[SIGMA, Q, STEPS]]
    # many steps at a huge sigma spend nothing: a "longer" record that would lower epsilon is ignored
    lower = _task(fed_setup, tmp_path, _pconf(server_history=[[1e6, Q, 1000]]), task_id=2, policy=roomy)
    assert lower["metrics"]["accountant_history"] == [[SIGMA, Q, 2 * STEPS]]
    # a record holding every local step and more (the device lost a reply's worth): taken
    higher = _task(fed_setup, tmp_path, _pconf(server_history=[[SIGMA, Q, 5 * STEPS]]), task_id=3, policy=roomy)
    assert higher["metrics"]["accountant_history"] == [[SIGMA, Q, 6 * STEPS]]


# -- nothing about the record count leaves the device ------------------------------------------------------


@pytest.mark.parametrize("epochs", [None, 1])
def test_neighbouring_record_counts_give_identical_dp_metadata(fed_setup, tmp_path, epochs):
    cfg, fed, _params, _paths = fed_setup
    setup = None
    if epochs is not None:
        c = load_config(None, ["data.num_clients=2", "server.concurrency=2", "server.buffer_size=2",
                               "model.hidden=8", "train.batch_size=48", f"train.local_epochs={epochs}"])
        setup = client_setup_json(c, fed)
    seen = []
    for n in (96, 97):
        out = _task(fed_setup, tmp_path / str(n), _pconf(), n=n, setup=setup)
        assert out.get("refused") is None and np.all([np.isfinite(v).all() for v in out["params"].values()])
        m = {k: v for k, v in out["metrics"].items() if k != "train_time_s"}
        seen.append(json.dumps(m, sort_keys=True))
    assert seen[0] == seen[1], seen
    m = json.loads(seen[0])
    assert (m["sample_rate"], m["noise_multiplier"], m["dp_steps"], m["steps"], m["num_examples"]) == \
        (Q, SIGMA, STEPS, STEPS, 96)


# -- the server side: a prv claim never lowers the record --------------------------------------------------


def test_under_prv_a_claimed_epsilon_of_zero_is_not_recorded(tmp_path):
    from fedasync.privacy.tracker import PrivacyTracker
    from fedasync.store import Store

    cfg = load_config(None, ["data.num_clients=4", "data.partitioner=iid", "model.hidden=16",
                             "train.local_steps=3", "train.batch_size=64", "server.strategy=fedbuff",
                             "server.concurrency=4", "server.buffer_size=2", "privacy.local_dp.enabled=true",
                             "privacy.local_dp.epsilon=3.0", "privacy.local_dp.planned_tasks=3",
                             "privacy.local_dp.accountant=prv"])
    store = Store(f"sqlite:///{tmp_path / 'fedasync.db'}")
    run_id = store.create_run("prv", "fedbuff", 0, "{}", "deployment")
    tracker = PrivacyTracker(cfg, store, run_id, strategy=None)
    conf = tracker.client_config(1)
    hist = extend_history([], conf["noise_multiplier"], conf["sample_rate"], conf["steps"], "prv")
    claim = {"noise_multiplier": conf["noise_multiplier"], "sample_rate": conf["sample_rate"],
             "dp_steps": conf["steps"], "accountant_history": [list(e) for e in hist], "epsilon": 0.0}
    assert tracker.check_reply(1, claim) is None
    tracker.on_reply(1, 1, claim)
    assert tracker.eps[1] == pytest.approx(epsilon_of(hist, conf["delta"], "prv")) and tracker.eps[1] > 0
    store.close()


# -- fedasync client: the policy's flags and file --------------------------------------------------------------


def _client_args(tmp_path, *extra):
    return ["client", "--superlink", "127.0.0.1:9092", "--partition-id", "0", "--num-partitions", "2", "--insecure",
            "--no-signing", "--no-supernode-auth", "--privacy-state-dir", str(tmp_path / "state"), *extra]


def test_client_help_shows_the_policy_options():
    from fedasync.cli import app as cli_app

    r = CliRunner().invoke(cli_app, ["client", "--help"], env={"COLUMNS": "200"})
    assert r.exit_code == 0
    for opt in ("--privacy-policy", "--dp-epsilon", "--dp-delta", "--dp-accountant", "--dp-min-noise",
                "--dp-max-task-epsilon", "--dp-max-sample-rate", "--dp-max-grad-norm", "--dp-allow-loss"):
        assert opt in r.output, opt


@pytest.mark.parametrize("text, flags, said", [
    ("epsilon: 1\nmin_noise: 1\n", [], "min_noise: Extra inputs are not permitted"),
    ("epsilon: 1\nmin_noise_multiplier: 1\naccountant: gdp\n", [], "accountant: gdp is Opacus"),
    ("epsilon: 1\n", [], "min_noise_multiplier or --privacy-policy"),
    ("epsilon: 1\nmin_noise_multiplier: 1\n", ["--dp-max-sample-rate", "2"], "--dp-max-sample-rate: Input should"),
])
def test_a_bad_policy_is_one_line_and_exit_2(tmp_path, text, flags, said):
    from fedasync.cli import app as cli_app

    path = tmp_path / "policy.yaml"
    path.write_text(text)
    r = CliRunner().invoke(cli_app, _client_args(tmp_path, "--privacy-policy", str(path), *flags),
                           env={"COLUMNS": "300"})
    assert r.exit_code == 2 and said in r.output, r.output
    assert not (tmp_path / "state").exists()  # nothing written


def test_the_client_hands_its_policy_to_the_clientapp(tmp_path, monkeypatch):
    from fedasync.cli import app as cli_app
    from fedasync.clients.app import node_policy

    started = {}
    monkeypatch.setattr(os, "execve", lambda exe, cmd, env: started.setdefault("cmd", cmd))
    path = tmp_path / "policy.yaml"
    path.write_text(yaml.safe_dump({"epsilon": 4.0, "min_noise_multiplier": 0.8, "accountant": "prv"}))
    r = CliRunner().invoke(cli_app, _client_args(tmp_path, "--privacy-policy", str(path), "--dp-epsilon", "2",
                                                 "--dp-allow-loss"))
    assert r.exit_code == 0, r.output
    cmd = started["cmd"]
    node = dict(kv.split("=", 1) for kv in cmd[cmd.index("--node-config") + 1].split(" "))
    policy_path = json.loads(node["privacy-policy"])
    assert stat.S_IMODE(os.stat(policy_path).st_mode) == 0o600
    pol = node_policy({"privacy-policy": policy_path})
    assert (pol.epsilon, pol.min_noise_multiplier, pol.accountant, pol.allow_report_loss) == (2.0, 0.8, "prv", True)


def test_the_example_policy_loads():
    from pathlib import Path

    from fedasync.privacy.policy import resolve_policy

    pol = resolve_policy(Path(__file__).parents[1] / "fedasync" / "examples" / "device-policy.yaml", {})
    assert pol.accountant == "rdp" and pol.min_noise_multiplier is not None and not pol.allow_report_loss
