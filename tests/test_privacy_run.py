"""DP runs end to end (in-process backend): accounting, enforcement, determinism, report, central DP."""

from __future__ import annotations

import json
import logging
import warnings

import pytest
from opacus.accountants import create_accountant
from typer.testing import CliRunner

from fedasync.cli import app
from fedasync.config import load_config
from fedasync.store import Store

runner = CliRunner()

# 4 clients, budgets planned for 3 tasks each (client 3: a smaller epsilon), K = 2
SMALL = [
    "name=dp-small", "data.num_clients=4", "data.partitioner=iid", "model.hidden=16",
    "train.local_steps=3", "train.batch_size=64", "train.lr=0.2",
    "server.strategy=fedbuff", "server.concurrency=4", "server.buffer_size=2", "server.eval_every=2",
    "privacy.local_dp.enabled=true", "privacy.local_dp.epsilon=3.0", "privacy.local_dp.planned_tasks=3",
    "privacy.overrides=[{clients: '3', epsilon: 1.5}]",
    "privacy.reproducible_noise=true",  # these tests pin model hashes; the default noise is secret
]
SECRET = [s for s in SMALL if not s.startswith("privacy.reproducible_noise")]
BUDGET = {0: 3.0, 1: 3.0, 2: 3.0, 3: 1.5}


pytestmark = pytest.mark.usefixtures("one_thread")


def _fresh_eps(name: str, history, delta: float) -> float:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        acc = create_accountant(mechanism=name)
    acc.load_state_dict({"history": [tuple(h) for h in history], "mechanism": name})
    return acc.get_epsilon(delta)


def _run(sets, store_dir, resume_run_id=None):
    from fedasync.server.loop import AsyncServer
    from fedasync.server.transport import LocalTransport
    from fedasync.store import default_sqlite_url

    cfg = load_config(None, sets)
    store_dir.mkdir(parents=True, exist_ok=True)
    store = Store(default_sqlite_url(store_dir))
    try:
        return AsyncServer(cfg, LocalTransport(), store, resume_run_id=resume_run_id).run()
    finally:
        store.close()


@pytest.fixture(scope="module")
def dp_run(tmp_path_factory):
    """One CLI run whose budgets all run out (shared by several tests)."""
    out = tmp_path_factory.mktemp("dp") / "run"
    args = ["simulate", "--backend", "local", "--out", str(out)]
    for s in SMALL:
        args += ["--set", s]
    res = runner.invoke(app, args)
    assert res.exit_code == 0, res.output
    summary = json.loads((out / "summary.json").read_text())
    return out, summary


def test_summary_reports_privacy_and_the_run_stops_when_budgets_run_out(dp_run):
    out, s = dp_run
    p = s["privacy"]
    assert s["stop_reason"] == "no_client_can_train"
    assert p["accountant"] == "rdp" and p["delta"] == 1e-5
    assert p["clients_exhausted"] == 4 and p["clients_trained"] == 4
    assert 1.5 < p["epsilon_max"] <= 3.0
    store = Store(f"sqlite:///{out / 'fedasync.db'}")
    eps = [c.epsilon for c in store.clients(s["run_id"])]
    assert p["epsilon_max"] == max(eps)
    assert p["epsilon_mean"] == pytest.approx(sum(eps) / len(eps), abs=1e-12)
    store.close()


def test_dp_replies_carry_no_loss_and_the_planned_num_examples(dp_run):
    out, s = dp_run
    assert s["privacy"]["noise"] == {"reproducible": True, "local_dp": "task_seed", "central_dp": None}
    store = Store(f"sqlite:///{out / 'fedasync.db'}")
    from fedasync.task.data import load_federated

    cfg = load_config(None, SMALL)
    sizes = load_federated(cfg.data, cfg.seed).sizes()
    ups = store.updates(s["run_id"])
    assert ups and all(u.loss is None for u in ups)  # updates.loss is NULL under local DP
    assert all(u.num_examples == sizes[u.client_id] for u in ups)  # the server's own plan
    store.close()


def test_two_dp_runs_differ_by_default_and_match_with_reproducible_noise(tmp_path):
    short = ["server.max_versions=2"]
    a = _run(SECRET + short, tmp_path / "a")
    b = _run(SECRET + short, tmp_path / "b")
    assert a["privacy"]["noise"] == {"reproducible": False, "local_dp": "os_entropy", "central_dp": None}
    assert a["model_sha256"] != b["model_sha256"]
    assert a["privacy"]["epsilon_max"] == b["privacy"]["epsilon_max"]  # the same accounting, other noise
    c = _run(SMALL + short, tmp_path / "c")
    d = _run(SMALL + short, tmp_path / "d")
    assert c["model_sha256"] == d["model_sha256"] not in (a["model_sha256"], b["model_sha256"])


def test_every_epsilon_recomputes_from_the_recorded_history(dp_run):
    out, s = dp_run
    store = Store(f"sqlite:///{out / 'fedasync.db'}")
    run_id = s["run_id"]
    clients = store.clients(run_id)
    for c in clients:
        st = json.loads(c.accountant_state)
        assert st["accountant"] == "rdp"
        assert abs(_fresh_eps("rdp", st["history"], 1e-5) - c.epsilon) <= 1e-9
    # every privacy_spend row: epsilon after that task from the steps recorded so far
    steps_so_far: dict[int, int] = {}
    updates = {u.task_id: u for u in store.updates(run_id)}
    rows = store.privacy_spend(run_id)
    assert len(rows) == len(updates) > 0
    for r in rows:
        steps_so_far[r.client_id] = steps_so_far.get(r.client_id, 0) + r.steps
        hist = [(r.noise_multiplier, r.sample_rate, steps_so_far[r.client_id])]
        assert abs(_fresh_eps(r.accountant, hist, r.delta) - r.epsilon) <= 1e-9
        assert updates[r.task_id].epsilon == r.epsilon  # recorded per update too
    for c in clients:
        assert json.loads(c.accountant_state)["history"][0][2] == steps_so_far[c.client_id]
    store.close()


def test_no_client_exceeds_its_budget_and_exhausted_clients_get_no_more_tasks(dp_run, caplog):
    out, s = dp_run
    store = Store(f"sqlite:///{out / 'fedasync.db'}")
    run_id = s["run_id"]
    for r in store.privacy_spend(run_id):
        assert r.epsilon <= BUDGET[r.client_id]
    dispatches = store.dispatches(run_id)
    for c in store.clients(run_id):
        assert c.exhausted and c.exhausted_reason == "privacy_budget_exhausted"
        assert c.tasks_done == 3  # sigma was calibrated for exactly the planned tasks
        mine = [d for d in dispatches if d.client_id == c.client_id]
        refused = [d for d in mine if d.status == "refused"]
        assert len(refused) == 1 and refused[0].task_id == mine[-1].task_id  # nothing after the refusal
        assert [d.status for d in mine[:-1]] == ["replied"] * 3
    store.close()


def test_report_json_exposes_the_same_history(dp_run):
    out, s = dp_run
    res = runner.invoke(app, ["privacy", "report", "--store", str(out), "--json"])
    assert res.exit_code == 0, res.output
    rows = json.loads(res.output)
    store = Store(f"sqlite:///{out / 'fedasync.db'}")
    by_id = {c.client_id: c for c in store.clients(s["run_id"])}
    store.close()
    assert sorted(r["client"] for r in rows) == [0, 1, 2, 3]
    for r in rows:
        c = by_id[r["client"]]
        assert r["history"] == json.loads(c.accountant_state)["history"]
        assert r["epsilon"] == c.epsilon and r["delta"] == 1e-5 and r["accountant"] == "rdp"
        assert r["epsilon_budget"] == BUDGET[r["client"]] and r["exhausted"] is True
        assert abs(_fresh_eps("rdp", r["history"], r["delta"]) - r["epsilon"]) <= 1e-9
    table = runner.invoke(app, ["privacy", "report", "--store", str(out / "fedasync.db")])
    assert table.exit_code == 0 and "4 of 4 clients exhausted" in table.output
    bad = runner.invoke(app, ["privacy", "report", "--store", str(out / "nope.db")])
    assert bad.exit_code == 2 and "no database" in bad.output


def test_dp_run_is_deterministic_for_config_and_seed(dp_run, tmp_path, caplog):
    _, s = dp_run
    with caplog.at_level(logging.WARNING, logger="fedasync"):
        again = _run(SMALL, tmp_path / "a")
    assert again["model_sha256"] == s["model_sha256"]
    assert again["privacy"]["epsilon_max"] == s["privacy"]["epsilon_max"]
    assert any("all 4 clients have exhausted their privacy budget" in r.getMessage() for r in caplog.records)
    other = _run(SMALL + ["seed=1"], tmp_path / "b")
    assert other["model_sha256"] != s["model_sha256"]


def test_resumed_run_continues_each_accountant(tmp_path):
    sets = SMALL + ["server.max_versions=2"]
    first = _run(sets, tmp_path)
    store = Store(f"sqlite:///{tmp_path / 'fedasync.db'}")
    before = {c.client_id: json.loads(c.accountant_state)["history"] if c.accountant_state else []
              for c in store.clients(first["run_id"])}
    store.close()
    assert any(before.values())
    second = _run(SMALL, tmp_path, resume_run_id=first["run_id"])  # no version cap: budgets run out
    assert second["stop_reason"] == "no_client_can_train"
    store = Store(f"sqlite:///{tmp_path / 'fedasync.db'}")
    for c in store.clients(first["run_id"]):
        hist = json.loads(c.accountant_state)["history"]
        assert hist[0][2] == 3 * c.tasks_done == 9  # never reset: 3 tasks of 3 steps over both parts
        assert c.epsilon <= BUDGET[c.client_id]
    store.close()


def test_central_dp_is_accounted_per_aggregation(tmp_path):
    sets = SMALL + ["privacy.central_dp.enabled=true", "privacy.central_dp.noise_multiplier=0.8",
                    "privacy.central_dp.clip=0.5"]
    s = _run(sets, tmp_path)
    c = s["privacy"]["central_dp"]
    assert c["releases"] == s["versions"] > 0
    assert c["sample_rate"] == 2 / 4  # K / num_clients
    assert "K / num_clients" in c["sampling_assumption"]
    assert abs(c["epsilon"] - _fresh_eps("rdp", [(0.8, 0.5, s["versions"])], 1e-5)) <= 1e-9
    store = Store(f"sqlite:///{tmp_path / 'fedasync.db'}")
    rows = store.privacy_spend(s["run_id"])
    server_rows = [r for r in rows if r.client_id == -1]
    assert sum(r.steps for r in server_rows) == s["versions"]
    assert len(rows) - len(server_rows) == s["updates_received"]  # client rows recorded alongside
    store.close()
    res = runner.invoke(app, ["privacy", "report", "--store", str(tmp_path), "--json"])
    central = [r for r in json.loads(res.output) if r["client"] == -1]
    assert central and central[0]["history"] == [[0.8, 0.5, s["versions"]]]


# 6 clients, K = 3, widely spread speeds: fast clients finish again before the buffer fills
SIX = ["name=six", "data.num_clients=6", "server.concurrency=6", "server.buffer_size=3", "clock.sigma=2.5",
       "server.strategy=fedbuff", "server.max_versions=40", "server.max_virtual_time=null", "server.eval_every=10",
       "train.local_steps=3", "clock.latency_s=0.0"]
CENTRAL = ["privacy.central_dp.enabled=true", "privacy.central_dp.noise_multiplier=0.5",
           "privacy.central_dp.clip=1.0"]


def _clients_per_version(store, run_id):
    per: dict[int, list[int]] = {}
    for u in store.updates(run_id):
        if u.applied_in_version is not None:
            per.setdefault(u.applied_in_version, []).append(u.client_id)
    return per


def test_central_dp_releases_hold_one_term_per_client(tmp_path):
    plain = _run(SIX, tmp_path / "plain")
    store = Store(f"sqlite:///{tmp_path / 'plain' / 'fedasync.db'}")
    repeats = sum(len(set(c)) < len(c) for c in _clients_per_version(store, plain["run_id"]).values())
    store.close()
    assert repeats >= 5  # without central DP a client fills several slots of one aggregation (9 of 40)

    s = _run(SIX + CENTRAL, tmp_path / "dp")
    assert s["versions"] == 40 and s["privacy"]["central_dp"]["releases"] == 40
    assert s["privacy"]["noise"] == {"reproducible": False, "local_dp": None, "central_dp": "os_entropy"}
    store = Store(f"sqlite:///{tmp_path / 'dp' / 'fedasync.db'}")
    per = _clients_per_version(store, s["run_id"])
    assert sorted(per) == list(range(1, 41))
    for v, clients in per.items():
        assert len(clients) == 3 and len(set(clients)) == 3, (v, clients)  # K distinct clients per release
    rejected = [u for u in store.updates(s["run_id"]) if not u.accepted]
    assert rejected and {u.reason for u in rejected} == {"client_backlog"}
    assert s["rejections"] == {"client_backlog": len(rejected)}
    store.close()


def test_central_dp_resumed_run_equals_an_uninterrupted_one_with_reproducible_noise(tmp_path):
    sets = SIX + CENTRAL + ["privacy.reproducible_noise=true", "server.max_versions=24"]
    whole = _run(sets, tmp_path / "whole")
    again = _run(sets, tmp_path / "again")
    assert whole["model_sha256"] == again["model_sha256"]
    first = _run(sets[:-1] + ["server.max_versions=9"], tmp_path / "parts")
    resumed = _run(sets, tmp_path / "parts", resume_run_id=first["run_id"])
    assert resumed["model_sha256"] == whole["model_sha256"]
    assert resumed["privacy"]["central_dp"]["releases"] == 24
    assert resumed["privacy"]["central_dp"]["epsilon"] == whole["privacy"]["central_dp"]["epsilon"]


def test_plan_prints_groups_and_the_central_assumption():
    res = runner.invoke(app, ["privacy", "plan", "examples/privacy.yaml", "--json"])
    if res.exit_code != 0:  # the packaged path works from any directory
        from fedasync.config import packaged_example

        res = runner.invoke(app, ["privacy", "plan", str(packaged_example("privacy")), "--json"])
    assert res.exit_code == 0, res.output
    plan = json.loads(res.output)
    groups = plan["local_dp"]
    assert [g["clients"] for g in groups] == ["0-7", "8-9"]
    for g in groups:
        eps = list(g["epsilon_after"].values())
        assert eps == sorted(eps) and eps[-1] <= g["epsilon_budget"]
        assert list(g["epsilon_after"]) == ["1", "20", "40"]
    from fedasync.config import packaged_example

    path = str(packaged_example("privacy"))
    text = runner.invoke(app, ["privacy", "plan", path, "--set", "privacy.central_dp.enabled=true"])
    assert text.exit_code == 0, text.output
    assert "q = K / num_clients" in " ".join(text.output.split())
    off = runner.invoke(app, ["privacy", "plan"])
    assert off.exit_code == 2 and "nothing to plan" in off.output
    low = runner.invoke(app, ["privacy", "plan", path, "--set", "privacy.local_dp.epsilon=0.0001"])
    assert low.exit_code == 2 and "cannot calibrate noise" in low.output


def _run_with(sets, tmp_path, client):
    """A DP run whose clients are ``client(params, config)`` (in-process); (summary, store)."""
    from fedasync.server.loop import AsyncServer
    from fedasync.server.transport import LocalTransport

    store = Store(f"sqlite:///{tmp_path / 'fedasync.db'}")
    return AsyncServer(load_config(None, sets), LocalTransport(client), store).run(), store


def _trained_steps():
    """A client that notes the DP-SGD steps of every task it really trained: task -> (client, steps)."""
    from fedasync.clients.runner import handle_train

    steps: dict[int, tuple[int, int]] = {}

    def client(params, config):
        out = handle_train(params, config)
        if out.get("params") is not None:
            steps[int(config["task_id"])] = (int(config["client_id"]), int(out["metrics"]["dp_steps"]))
        return out
    return steps, client


def _taken(store, run_id, trained) -> dict[int, int]:
    """Per client, the steps of the trained tasks whose replies the server took (a simulated run's
    tasks still in flight at its end are not: a resume sends them again)."""
    out: dict[int, int] = {}
    for u in store.updates(run_id):
        c, n = trained[u.task_id]
        out[c] = out.get(c, 0) + n
    return out


def _recorded_steps(store, run_id) -> dict[int, int]:
    return {c.client_id: sum(e[2] for e in json.loads(c.accountant_state)["history"])
            for c in store.clients(run_id) if c.accountant_state}


def test_cancelled_backups_are_accounted_under_the_virtual_clock(tmp_path):
    # synchronous FedAvg, 2 of 4 clients per round and 2 backups: every round cancels two tasks
    # whose clients trained all the same; their next task must start from a record that has them
    steps, client = _trained_steps()
    sets = [s for s in SMALL if not s.startswith(("server.strategy", "server.buffer_size"))] + [
        "server.strategy=fedavg", "server.clients_per_round=2", "server.backup_workers=2"]
    summary, store = _run_with(sets, tmp_path, client)
    assert summary["stop_reason"] == "no_client_can_train"
    assert summary["rejections"].get("round_closed", 0) > 0  # the backups' replies, taken for their spend
    assert sorted(steps) == sorted(u.task_id for u in store.updates(summary["run_id"]))  # all taken
    assert _recorded_steps(store, summary["run_id"]) == _taken(store, summary["run_id"], steps)
    for c in store.clients(summary["run_id"]):
        assert c.epsilon <= BUDGET[c.client_id]
        assert _taken(store, summary["run_id"], steps)[c.client_id] == 3 * 3  # 3 planned tasks, backups included
    store.close()


def test_a_device_that_starts_from_an_older_record_cannot_shrink_the_servers(tmp_path):
    # client 0 forgets its history before every task (a device whose record was lost): the server
    # composes its record with each task's steps instead of taking the device's shorter history
    steps, counting = _trained_steps()

    def client(params, config):
        if config["client_id"] == 0 and config.get("privacy", {}).get("history"):
            config = dict(config, privacy=dict(config["privacy"], history=[]))
        return counting(params, config)

    summary, store = _run_with(SMALL + ["server.max_versions=7"], tmp_path, client)
    taken = _taken(store, summary["run_id"], steps)
    assert taken[0] > 3  # it trained more than one task
    assert _recorded_steps(store, summary["run_id"]) == taken
    store.close()


@pytest.mark.parametrize("corrupt,reason", [
    (lambda m: m.pop("noise_multiplier"), "privacy_accounting"),
    (lambda m: m.update(accountant_history=[[1.0, 0.5]]), "privacy_accounting"),
    (lambda m: m.pop("accountant_history"), "privacy_accounting"),
    (lambda m: m.update(accountant_history=[[m["noise_multiplier"], m["sample_rate"], 10_000]]), "over_budget"),
])
def test_a_reply_with_bad_privacy_accounting_is_rejected_and_still_charged(tmp_path, corrupt, reason):
    from fedasync.clients.runner import handle_train

    def client(params, config):
        out = handle_train(params, config)
        if config["task_id"] == 2 and out.get("params") is not None:
            corrupt(out["metrics"])
        return out

    summary, store = _run_with(SMALL + ["server.max_versions=3"], tmp_path, client)
    assert summary["stop_reason"] == "max_versions"  # the run goes on
    bad = [u for u in store.updates(summary["run_id"]) if u.task_id == 2]
    assert len(bad) == 1 and not bad[0].accepted and bad[0].reason == reason
    spend = [r for r in store.privacy_spend(summary["run_id"]) if r.task_id == 2]
    assert len(spend) == 1 and spend[0].steps == 3  # the task's own steps (its planned ones when unreadable)
    client_id = bad[0].client_id
    recorded = _recorded_steps(store, summary["run_id"])[client_id]
    assert recorded >= (10_000 if reason == "over_budget" else 3)  # charged: the planned task at least
    store.close()


def test_a_deployment_task_names_no_accountant_file(tmp_path):
    # a device keys its accountant by its own id (issue 32): the server sends neither a state key
    # nor a history to use, only its record as a floor
    from fedasync.privacy.tracker import PrivacyTracker

    store = Store(f"sqlite:///{tmp_path / 'fedasync.db'}")
    run_id = store.create_run("first-name", "fedbuff", 0, "{}", "deployment")
    renamed = load_config(None, [s for s in SECRET if not s.startswith("name=")] + ["name=second-name"])
    conf = PrivacyTracker(renamed, store, run_id, strategy=None, resumed=True).client_config(1)
    assert "state_key" not in conf and "history" not in conf and conf["server_history"] == []
    store.close()


def test_a_stop_between_a_rounds_close_and_its_backups_cancel_loses_no_spend(tmp_path):
    # local DP, synchronous FedAvg with backups: an abrupt stop (a second Ctrl-C: what the step
    # wrote so far is committed) after the version that closes a round, before its backups are
    # cancelled; the resume resends them and takes their replies for their spend, as the
    # uninterrupted run did
    from fedasync.server.loop import AsyncServer
    from fedasync.server.transport import LocalTransport

    sets = [s for s in SMALL if not s.startswith(("server.strategy", "server.buffer_size"))] + [
        "server.strategy=fedavg", "server.clients_per_round=2", "server.backup_workers=2", "server.max_versions=2"]
    cfg = load_config(None, sets)
    ref_store = Store(f"sqlite:///{tmp_path / 'ref.db'}")
    ref = AsyncServer(cfg, LocalTransport(), ref_store).run()
    store = Store(f"sqlite:///{tmp_path / 'stop.db'}")
    orig = store.set_dispatch_status

    def set_status(run_id, task_id, status, *a, **k):
        if status == "cancelled" and a and a[0] == "round_closed":
            store.set_dispatch_status = orig
            raise KeyboardInterrupt
        return orig(run_id, task_id, status, *a, **k)

    store.set_dispatch_status = set_status
    stopped = AsyncServer(cfg, LocalTransport(), store).run()
    assert stopped["stop_reason"] == "interrupted" and stopped["versions"] == 1
    resumed = AsyncServer(cfg, LocalTransport(), store, resume_run_id=stopped["run_id"]).run()
    assert resumed["model_sha256"] == ref["model_sha256"] and resumed["rejections"] == ref["rejections"]
    assert ref["rejections"].get("round_closed", 0) > 0

    def accounts(st, run_id):
        return {c.client_id: (c.accountant_state, c.tasks_done) for c in st.clients(run_id)}
    assert accounts(store, stopped["run_id"]) == accounts(ref_store, ref["run_id"])
    store.close(), ref_store.close()
