"""Scheduling policies, delay compensation, robust filters and simulated attacks in the real loop
(in-process, LocalTransport, small configs): fedasync/server/policy.py and its hooks."""

from __future__ import annotations

from collections import Counter

import pytest
import typer
from typer.testing import CliRunner

from conftest import small_config
from fedasync.cli import app
from fedasync.config import ConfigError
from fedasync.server.loop import AsyncServer
from fedasync.server.transport import LocalTransport
from fedasync.store import Store

POLICIES = ["uniform", "fair", "fastest", "staleness_aware", "budget_aware"]


def run(cfg, tmp_path, name="db"):
    store = Store(f"sqlite:///{tmp_path / name}.db")
    server = AsyncServer(cfg, LocalTransport(), store, clock="virtual")
    return server.run(), store, server


class Crash(BaseException):
    """The process dying (nothing in the loop may catch it)."""


def crash_after(obj, name: str, n: int) -> None:
    orig = getattr(obj, name)
    calls = [0]

    def wrapper(*a, **k):
        out = orig(*a, **k)
        calls[0] += 1
        if calls[0] == n:
            raise Crash(f"{name} #{n}")
        return out

    setattr(obj, name, wrapper)


@pytest.mark.parametrize("policy", POLICIES)
def test_each_policy_runs_and_is_a_function_of_the_seed(policy, tmp_path):
    cfg = small_config(f"server.scheduler.name={policy}", "clock.sigma=1.5")
    a, store, _ = run(cfg, tmp_path, "a")
    b, _, _ = run(cfg, tmp_path, "b")
    assert a["model_sha256"] == b["model_sha256"] and a["participation"] == b["participation"]
    assert a["versions"] == 12
    part = a["participation"]
    assert part["scheduler"] == policy
    assert len(part["counts"]) == 20 and sum(part["counts"]) == store.counts(a["run_id"])["dispatches"]
    assert 0 < part["jain"] <= 1 and part["never"] == sum(1 for x in part["counts"] if x == 0) / 20
    got = Counter(d.client_id for d in store.dispatches(a["run_id"]))
    assert part["counts"] == [got.get(c, 0) for c in range(20)]
    c, _, _ = run(small_config(f"server.scheduler.name={policy}", "clock.sigma=1.5", "seed=1"), tmp_path, "c")
    assert c["model_sha256"] != a["model_sha256"]


def test_fastest_prefers_fast_clients_from_observed_durations(tmp_path):
    cfg = small_config("server.scheduler.name=fastest", "clock.sigma=1.5", "server.max_versions=40")
    s, store, server = run(cfg, tmp_path)
    counts = s["participation"]["counts"]
    speed = [p.speed for p in server.profiles]
    fast = sorted(range(20), key=lambda c: -speed[c])[:5]
    slow = sorted(range(20), key=lambda c: speed[c])[:5]
    assert sum(counts[c] for c in fast) > 2 * sum(counts[c] for c in slow)
    # what it learnt is what the server observed: the mean of reply time - dispatch time per client
    sched = server.scheduler
    for c in range(20):
        ds = [u.received_virtual - d.sent_virtual for d in store.dispatches(s["run_id"])
              for u in store.updates(s["run_id"]) if u.task_id == d.task_id and d.client_id == c]
        if ds:
            assert sched.mean_duration(c) == pytest.approx(sum(ds) / len(ds))


def test_fair_dispatches_every_client_once_per_num_clients_dispatches(tmp_path):
    same = ["clock.sigma=0", "clock.jitter=0", "clock.bandwidth_sigma=0", "data.num_clients=12",
            "server.max_versions=9"]
    for conc, policy, must in ((12, "fair", True), (4, "fair", True), (4, "uniform", False)):
        cfg = small_config(*same, f"server.concurrency={conc}", f"server.buffer_size={conc}",
                           f"server.scheduler.name={policy}")
        s, store, _ = run(cfg, tmp_path, f"{policy}{conc}")
        seq = [d.client_id for d in store.dispatches(s["run_id"])]
        assert len(seq) >= 36
        blocks = [sorted(seq[i: i + 12]) for i in range(0, len(seq) - 11, 12)]
        assert all(b == list(range(12)) for b in blocks) is must, (policy, conc)
        if must:
            assert s["participation"]["jain"] > 0.99


@pytest.mark.parametrize("extra", [
    ["server.scheduler.name=fair"],
    ["server.scheduler.name=fastest"],
    ["server.scheduler.name=staleness_aware", "server.robust.filter=zeno++"],
    ["server.scheduler.name=budget_aware", "server.robust.filter=norm", "server.robust.warmup=3",
     "server.delay_compensation.method=dc_asgd"],
    ["server.strategy=fedasync", "server.scheduler.name=fastest", "server.delay_compensation.method=dc_asgd"],
], ids=["fair", "fastest", "staleness_aware-zeno", "budget_aware-norm-dc", "fedasync-fastest-dc"])
def test_resume_keeps_the_policies_state(extra, tmp_path):
    cfg = small_config("clock.sigma=1.5", *extra)
    ref, _, _ = run(cfg, tmp_path, "ref")
    store = Store(f"sqlite:///{tmp_path / 'crash'}.db")
    server = AsyncServer(cfg, LocalTransport(), store, clock="virtual")
    committed = {}
    commit = store._commit

    def snapshot_on_commit(ops):  # the scheduler's state as of each committed transaction
        commit(ops)
        committed["state"] = server.scheduler.state_dict()

    store._commit = snapshot_on_commit
    crash_after(store, "record_reply", 9)
    with pytest.raises(Crash):
        server.run()
    # the crash rolls back the step it hit (Store.batch): its dispatches and replies are redone
    assert server.scheduler.state_dict() != committed["state"]
    store2 = Store(f"sqlite:///{tmp_path / 'crash'}.db")
    resumed = AsyncServer(cfg, LocalTransport(), store2, clock="virtual", resume_run_id=server.run_id)
    assert resumed.scheduler.state_dict() == committed["state"]  # restored as last committed
    out = resumed.run()
    for k in ("model_sha256", "versions", "updates_received", "rejections", "participation", "virtual_time_s"):
        assert out[k] == ref[k], k


@pytest.mark.parametrize("after", [4, 9, 17])
def test_resume_with_a_stale_attacker_is_the_uninterrupted_run(after, tmp_path):
    """A stale attacker is sent the oldest model of its window; a resume reloads the window and
    re-sends each attacker's task in flight the old model it was sent (the store keeps those
    versions although they are neither the latest, a checkpoint nor a live task's base)."""
    cfg = small_config("clock.sigma=1.5", "attack.kind=stale", "attack.fraction=0.3", "attack.lag=4",
                       "server.max_versions=16", "store.checkpoint_every=0")
    ref, _, _ = run(cfg, tmp_path, "ref")
    assert ref["robust"]["malicious_updates"] > 0
    store = Store(f"sqlite:///{tmp_path / 'crash'}.db")
    server = AsyncServer(cfg, LocalTransport(), store, clock="virtual")
    crash_after(store, "record_reply", after)
    with pytest.raises(Crash):
        server.run()
    resumed = AsyncServer(cfg, LocalTransport(), Store(f"sqlite:///{tmp_path / 'crash'}.db"), clock="virtual",
                          resume_run_id=server.run_id)
    assert resumed.policy.held_versions()  # the window came back from the store
    out = resumed.run()
    for k in ("model_sha256", "versions", "updates_received", "rejections", "staleness", "virtual_time_s"):
        assert out[k] == ref[k], k


def test_stale_attackers_tasks_in_flight_are_resent_the_old_model(tmp_path):
    """At some crash the resumed server re-sends an attacker's task a model older than the task's
    base version, bit for bit the one it was sent (seen by the transport)."""
    cfg = small_config("clock.sigma=1.5", "attack.kind=stale", "attack.fraction=0.3", "attack.lag=4",
                       "server.max_versions=16", "store.checkpoint_every=0")
    from fedasync.server.params import params_sha256

    for after in range(6, 30, 2):
        db = tmp_path / f"c{after}.db"
        store = Store(f"sqlite:///{db}")
        server = AsyncServer(cfg, LocalTransport(), store, clock="virtual")
        first: dict[int, str] = {}  # task id -> sha256 of the model it was sent
        send = server.transport.send

        def record_first(tasks, send=send, first=first):
            for t in tasks:
                first.setdefault(t.task_id, params_sha256(t.params))
            return send(tasks)

        server.transport.send = record_first
        crash_after(store, "record_reply", after)
        with pytest.raises(Crash):
            server.run()
        resumed = AsyncServer(cfg, LocalTransport(), Store(f"sqlite:///{db}"), clock="virtual",
                              resume_run_id=server.run_id)
        stale = {t: v for t, v in resumed.policy._sent.items() if any(d.task_id == t for d in resumed._resend)}
        if not stale:
            continue
        again: dict[int, str] = {}
        send2 = resumed.transport.send

        def record_again(tasks):
            for t in tasks:
                again.setdefault(t.task_id, params_sha256(t.params))
            return send2(tasks)

        resumed.transport.send = record_again
        resumed.run()
        for t, v in stale.items():
            assert again[t] == first[t]  # the same old model as before the crash
            assert v < next(d.base_version for d in store.dispatches(server.run_id) if d.task_id == t)
        return
    pytest.fail("no crash point left an attacker's task in flight")


def test_dc_asgd_with_lambda_zero_is_no_compensation(tmp_path):
    for strategy in ("fedbuff", "fedasync"):
        base = small_config(f"server.strategy={strategy}", "clock.sigma=1.5")
        none, _, _ = run(base, tmp_path, f"{strategy}-none")
        zero, _, _ = run(small_config(f"server.strategy={strategy}", "clock.sigma=1.5",
                                      "server.delay_compensation.method=dc_asgd",
                                      "server.delay_compensation.lambda=0"), tmp_path, f"{strategy}-zero")
        on, _, _ = run(small_config(f"server.strategy={strategy}", "clock.sigma=1.5",
                                    "server.delay_compensation.method=dc_asgd",
                                    "server.delay_compensation.lambda=5"), tmp_path, f"{strategy}-on")
        assert zero["model_sha256"] == none["model_sha256"], strategy
        assert zero["staleness"]["max"] > 0  # there were stale updates to compensate
        assert on["model_sha256"] != none["model_sha256"], strategy
        assert zero["robust"]["delay_compensation"] == "dc_asgd"


ATTACK = ["attack.kind=sign_flip", "attack.clients=0-3"]


def test_zeno_rejects_sign_flip_attackers_and_records_why(tmp_path):
    cfg = small_config(*ATTACK, "server.robust.filter=zeno++", "server.max_versions=15")
    s, store, _ = run(cfg, tmp_path)
    ups = store.updates(s["run_id"])
    bad = [u for u in ups if u.client_id in range(4)]
    good = [u for u in ups if u.client_id not in range(4)]
    assert bad and all(not u.accepted and u.reason == "zeno" for u in bad)
    assert sum(1 for u in good if not u.accepted) <= 0.1 * len(good)
    r = s["robust"]
    assert r["attack"] == "sign_flip" and r["attackers"] == [0, 1, 2, 3]
    assert r["true_rejection_rate"] == 1.0 and r["malicious_updates"] == len(bad)
    assert r["rejected"]["zeno"] == s["rejections"]["zeno"] == sum(1 for u in ups if u.reason == "zeno")
    assert r["false_rejection_rate"] == pytest.approx(r["honest_rejected"] / len(good))


def test_without_a_filter_a_sign_flip_attack_is_accepted_and_hurts(tmp_path):
    clean, _, _ = run(small_config("server.max_versions=15"), tmp_path, "clean")
    s, store, _ = run(small_config(*ATTACK, "server.max_versions=15"), tmp_path, "att")
    assert s["rejections"] == {} and s["robust"]["malicious_updates"] > 0
    assert s["final_accuracy"] < clean["final_accuracy"] - 0.1


@pytest.mark.parametrize("kind", ["sign_flip", "scale", "gaussian", "label_flip", "stale"])
def test_every_attack_passes_the_validation_battery(kind, tmp_path):
    cfg = small_config(f"attack.kind={kind}", "attack.fraction=0.2", "attack.lag=3", "server.max_update_norm=1e6")
    s, store, server = run(cfg, tmp_path)
    assert s["rejections"] == {}, s["rejections"]  # finite, right shapes, under the norm cap
    assert s["robust"]["malicious_updates"] > 0 and len(s["robust"]["attackers"]) == 4
    honest, _, _ = run(small_config("server.max_update_norm=1e6"), tmp_path, "honest")
    assert s["model_sha256"] != honest["model_sha256"]


@pytest.mark.parametrize("filt", ["kardam", "norm"])
def test_other_filters_record_their_reason(filt, tmp_path):
    cfg = small_config("attack.kind=scale", "attack.clients=0-3", f"server.robust.filter={filt}",
                       "server.robust.warmup=3", "server.robust.byzantine_fraction=0.2", "server.max_versions=15")
    s, store, _ = run(cfg, tmp_path)
    reasons = Counter(u.reason for u in store.updates(s["run_id"]) if not u.accepted)
    assert set(reasons) == {filt} and s["robust"]["rejected"][filt] == reasons[filt] > 0
    assert s["robust"]["true_rejection_rate"] > 0.5


def test_norm_clip_clips_instead_of_rejecting(tmp_path):
    cfg = small_config("attack.kind=scale", "attack.clients=0-3", "server.robust.filter=norm",
                       "server.robust.clip=true", "server.robust.warmup=3")
    s, _, _ = run(cfg, tmp_path)
    assert s["rejections"] == {} and s["robust"]["clipped"] > 0


def test_robust_aggregator_runs_in_the_loop(tmp_path):
    a, _, _ = run(small_config("server.robust.aggregator=median"), tmp_path, "median")
    b, _, _ = run(small_config(), tmp_path, "mean")
    assert a["versions"] == b["versions"] == 12 and a["model_sha256"] != b["model_sha256"]
    assert a["robust"]["aggregator"] == "median"


DP = ["privacy.local_dp.enabled=true", "privacy.local_dp.noise_multiplier=1.0", "privacy.local_dp.epsilon=100",
      "privacy.reproducible_noise=true", "train.batch_size=8"]


def test_a_rejected_update_still_spends_privacy(tmp_path):
    # sigma 0.3: zeno++ passes the honest noisy updates (at sigma 1 the noise dominates ||g||^2 and
    # it rejects every update, so no version is ever made); the time limit bounds the run anyway
    cfg = small_config(*DP, *ATTACK, "privacy.local_dp.noise_multiplier=0.3", "server.robust.filter=zeno++",
                       "server.max_versions=6", "server.max_virtual_time=60")
    s, store, _ = run(cfg, tmp_path)
    rejected = [u for u in store.updates(s["run_id"]) if u.reason == "zeno"]
    assert rejected and s["versions"] == 6
    spend = Counter(r.client_id for r in store.privacy_spend(s["run_id"]))
    for u in rejected:
        assert spend[u.client_id] >= 1
    rows = {r.client_id: r for r in store.clients(s["run_id"])}
    for c in {u.client_id for u in rejected}:
        assert rows[c].tasks_done == sum(1 for u in store.updates(s["run_id"]) if u.client_id == c)


def test_budget_aware_never_sends_a_task_over_budget(tmp_path):
    common = [*DP, "privacy.local_dp.epsilon=2.2", "server.max_versions=60", "data.num_clients=6",
              "server.concurrency=2", "server.buffer_size=2", "data.min_partition_size=20"]
    fair, fstore, _ = run(small_config(*common, "server.scheduler.name=fair"), tmp_path, "fair")
    ba, bstore, _ = run(small_config(*common, "server.scheduler.name=budget_aware"), tmp_path, "ba")
    assert any(d.status == "refused" for d in fstore.dispatches(fair["run_id"]))  # fair hits the budget
    assert not any(d.status == "refused" for d in bstore.dispatches(ba["run_id"]))
    assert ba["privacy"]["epsilon_max"] <= 2.2
    assert ba["updates_received"] > 0


def test_budget_aware_run_ends_with_every_client_out_of_budget(tmp_path, caplog):
    """Run until no budget is left: budget_aware never sends a task over budget, so no client ever
    refuses one; at the stop, the clients it would no longer pick are marked exhausted (in the
    loop and in the store, reason next_task_over_budget), and the message says so."""
    common = [*DP, "privacy.local_dp.epsilon=2.2", "server.max_versions=null", "server.max_virtual_time=null",
              "data.num_clients=6", "server.concurrency=2", "server.buffer_size=2", "data.min_partition_size=20"]
    with caplog.at_level("WARNING", logger="fedasync"):
        s, store, srv = run(small_config(*common, "server.scheduler.name=budget_aware"), tmp_path, "ba")
    assert s["stop_reason"] == "no_client_can_train"
    assert not any(d.status == "refused" for d in store.dispatches(s["run_id"]))
    assert srv.exhausted == set(range(6))
    rows = store.clients(s["run_id"])
    assert len(rows) == 6 and all(r.exhausted and r.exhausted_reason == "next_task_over_budget" for r in rows)
    assert "all 6 clients have exhausted their privacy budget" in caplog.text
    assert s["privacy"]["epsilon_max"] <= 2.2


def test_deployment_refuses_an_attack(tmp_path):
    cfg = small_config(*ATTACK)
    with pytest.raises(ConfigError, match="^attack: simulation only"):
        AsyncServer(cfg, LocalTransport(), Store(f"sqlite:///{tmp_path}/d.db"), clock="wall", mode="deployment")


def test_fedasync_server_refuses_an_attack_with_exit_2(tmp_path, monkeypatch):
    from fedasync.config import packaged_example

    monkeypatch.chdir(tmp_path)
    r = CliRunner().invoke(app, ["server", str(packaged_example("quickstart")), "--insecure",
                                 "--set", "attack.kind=sign_flip", "--set", "attack.fraction=0.2"])
    assert r.exit_code == 2, r.output
    lines = [ln for ln in r.output.strip().splitlines() if ln.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: attack: simulation only")
    assert list(tmp_path.iterdir()) == []


def test_compare_entries_set_nested_server_keys():
    from fedasync.cli.simulate import parse_compare

    base = small_config()
    out = parse_compare("fedbuff,fedbuff:scheduler.name=fair,fedbuff:delay_compensation.method=dc_asgd,"
                        "fedasync:staleness.fn=adaptive:robust.filter=zeno++", base)
    labels = [lbl for lbl, _ in out]
    assert labels == ["fedbuff", "fedbuff-scheduler.name=fair", "fedbuff-delay_compensation.method=dc_asgd",
                      "fedasync-staleness.fn=adaptive-robust.filter=zeno++"]
    cfgs = [c for _, c in out]
    assert cfgs[1].server.scheduler.name == "fair" and cfgs[0].server.scheduler.name == "uniform"
    assert cfgs[2].server.delay_compensation.method == "dc_asgd"
    assert cfgs[3].server.strategy == "fedasync" and cfgs[3].server.staleness.fn == "adaptive"
    assert cfgs[3].server.robust.filter == "zeno++" and cfgs[3].data == base.data


@pytest.mark.parametrize("entry, says", [
    ("fedbuff:scheduler.name=round_robin", "server.scheduler.name: Input should be 'uniform', 'fair', 'fastest', "
                                           "'staleness_aware' or 'budget_aware'"),
    ("fedbuff:scheduler.nme=fair", "server.scheduler.nme: unknown key; known: name, explore, beta, balance"),
    ("fedbuff:delay_compensation.method=dc", "server.delay_compensation.method: Input should be 'none' or 'dc_asgd'"),
    ("fedbuff:robust.filter=krum", "server.robust.filter: Input should be 'none', 'zeno++', 'kardam' or 'norm'"),
])
def test_compare_bad_key_or_unknown_policy_exits_2_naming_it(entry, says, tmp_path):
    r = CliRunner().invoke(app, ["simulate", "--backend", "local", "--out", str(tmp_path / "o"),
                                 "--compare", f"fedbuff,{entry}"])
    assert r.exit_code == 2, r.output
    lines = [ln for ln in r.output.strip().splitlines() if ln.strip()]
    assert len(lines) == 1 and lines[0] == f"error: --compare {entry}: {says}"
    assert not (tmp_path / "o").exists()


def test_simulate_writes_participation(tmp_path):
    from fedasync.outputs import write_run_outputs

    s, _, _ = run(small_config(), tmp_path)
    paths = write_run_outputs(tmp_path / "out", small_config(), s)
    assert paths["participation"].stat().st_size > 1000
    with pytest.raises(typer.Exit):
        from fedasync.cli.simulate import parse_compare

        parse_compare("", small_config())


def test_a_filter_that_rejects_everything_is_reported_once(tmp_path, caplog, monkeypatch):
    """zeno++ set so that no update can pass (rho huge, epsilon 0): the loop warns, once, that the
    model is not moving and what to change; a filter that accepts says nothing."""
    import logging

    from fedasync.server import policy

    monkeypatch.setattr(policy, "FILTER_WARN_AFTER", 10)
    stuck = small_config("server.robust.filter=zeno++", "server.robust.rho=1e9", "server.robust.epsilon=0",
                         "server.max_versions=null", "server.max_virtual_time=20")
    with caplog.at_level(logging.WARNING, logger="fedasync"):
        s, _, _ = run(stuck, tmp_path, "stuck")
    warned = [r.getMessage() for r in caplog.records if "rejected the last 10 updates in a row" in r.getMessage()]
    assert s["versions"] == 0 and s["rejections"]["zeno"] >= 20  # it went on rejecting after the warning
    assert len(warned) == 1 and "server.robust.epsilon" in warned[0] and "zeno++" in warned[0]
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="fedasync"):
        run(small_config("server.robust.filter=zeno++"), tmp_path, "fine")
    assert not [r for r in caplog.records if "in a row" in r.getMessage()]


def test_a_stale_window_version_the_store_lost_is_skipped_with_a_warning(caplog):
    """A window naming a version whose parameters are gone (a store written otherwise): the resume
    goes on without it, warns, and an in-flight task sent that version gets its base model."""
    import logging

    import numpy as np

    from fedasync.server.policy import Policies

    cfg = small_config("attack.kind=stale", "attack.fraction=0.3", "attack.lag=4")
    pol = Policies(cfg)
    models = {v: {"w": np.full(2, float(v), np.float32)} for v in (3, 5)}

    def load(v):
        return models[v]  # KeyError for any other version

    with caplog.at_level(logging.WARNING, logger="fedasync"):
        pol.load_state_dict({"clipped": 0, "stale_window": [2, 3, 5], "stale_sent": [[40, 1], [41, 3]]}, load)
        base = {"w": np.zeros(2, np.float32)}
        assert pol.sent_params(41, base, load) is models[3]
        assert pol.sent_params(40, base, load) is base  # version 1 is gone: its base model
        assert pol.sent_params(42, base, load) is base  # not an attacker's task
    assert sorted(pol._old) == [3, 5] and pol.held_versions() == {1, 3, 5}
    msgs = [r.getMessage() for r in caplog.records]
    assert any("version 2 was not kept" in m for m in msgs) and any("version 1 (sent to task 40)" in m for m in msgs)


@pytest.mark.parametrize("strategy,versions,after,files", [("fedbuff", 15, 5, False), ("fedbuff", 15, 13, True),
                                                            ("fedasync", 45, 30, True)])
def test_resume_with_kardam_is_the_uninterrupted_run(strategy, versions, after, files, tmp_path, monkeypatch):
    """Kardam judges each update against the same client's previous one; the store keeps that
    update (``updates.filter_params``, one per client) and its base version, so a resumed run
    makes the same decisions and the same model as the uninterrupted one. With every blob in a
    file, the files left are exactly those the rows name (a forgotten update's file is deleted,
    a crash's leftover swept)."""
    if files:
        monkeypatch.setattr("fedasync.store.store.EXTERNAL_MIN_BYTES", 0)
    cfg = small_config("clock.sigma=1.5", f"server.strategy={strategy}", "attack.kind=scale",
                       "attack.clients=0-3", "server.robust.filter=kardam", "server.robust.warmup=3",
                       "server.robust.byzantine_fraction=0.2", f"server.max_versions={versions}",
                       "store.checkpoint_every=0")
    ref, _, _ = run(cfg, tmp_path, "ref")
    assert ref["robust"]["rejected"]["kardam"] > 0
    store = Store(f"sqlite:///{tmp_path / 'crash'}.db")
    server = AsyncServer(cfg, LocalTransport(), store, clock="virtual")
    crash_after(store, "record_reply", after)
    with pytest.raises(Crash):
        server.run()
    store2 = Store(f"sqlite:///{tmp_path / 'crash'}.db")
    kept = store2.filter_updates(server.run_id)
    clients = [r.client_id for r, _ in kept]
    assert kept and len(clients) == len(set(clients))  # one remembered update per client
    for r, _ in kept:  # each is the client's last recorded update, and its base model was kept
        assert r.task_id == max(u.task_id for u in store2.updates(server.run_id) if u.client_id == r.client_id)
        store2.load_version(server.run_id, r.base_version)
    params_dir = tmp_path / "crash.db-params"
    if files:
        (params_dir / f"r{server.run_id}-k999").write_bytes(b"left by a crash")
    resumed = AsyncServer(cfg, LocalTransport(), store2, clock="virtual", resume_run_id=server.run_id)
    assert set(resumed.policy.filter.prev) == set(clients)
    out = resumed.run()
    for k in ("model_sha256", "versions", "updates_received", "rejections", "staleness", "virtual_time_s"):
        assert out[k] == ref[k], k
    kept = store2.filter_updates(server.run_id)
    assert sorted(r.client_id for r, _ in kept) == sorted({u.client_id for u in store2.updates(server.run_id)})
    if files:
        from fedasync.store.blobs import is_marker

        ups, vs = store2.updates(server.run_id), store2.versions(server.run_id)
        named = {b[4:].decode() for b in [v.parameters for v in vs] + [u.pending_params for u in ups]
                 + [u.filter_params for u in ups] if is_marker(b)}
        assert {p.name for p in params_dir.iterdir() if p.name != ".spare"} == named
        assert sum(n.startswith(f"r{server.run_id}-k") for n in named) == len(kept)


def test_kardam_restore_skips_an_update_whose_base_model_is_lost(caplog):
    """restore_filter rebuilds kardam's per-client gradient (``x_base - x_client``) from the kept
    rows; a row whose base version the store lost is skipped with a warning (that client's next
    update has no coefficient), and is still forgotten by that client's next judged update."""
    import logging
    from types import SimpleNamespace

    import numpy as np

    from fedasync.server.policy import Policies
    from fedasync.server.strategies import Update

    pol = Policies(small_config("server.robust.filter=kardam", "server.robust.warmup=1"))
    models = {2: {"w": np.array([1.0, 2.0], np.float32)}}
    rows = [(SimpleNamespace(task_id=7, client_id=0, base_version=2, staleness=0, num_examples=5),
             {"w": np.array([0.5, 1.0], np.float32)}),
            (SimpleNamespace(task_id=9, client_id=1, base_version=4, staleness=1, num_examples=5),
             {"w": np.array([0.0, 0.0], np.float32)})]
    with caplog.at_level(logging.WARNING, logger="fedasync"):
        pol.restore_filter(rows, lambda v: models[v])  # KeyError for version 4
    g, v = pol.filter.prev[0]
    assert v == 2 and np.array_equal(g, np.array([0.5, 1.0])) and set(pol.filter.prev) == {0}
    assert pol.held_versions() == {2}
    assert any("version 4 was not kept" in r.getMessage() for r in caplog.records)
    upd = Update(task_id=12, client_id=1, params={"w": np.ones(2, np.float32)}, base_params=models[2],
                 base_version=2, staleness=0, num_examples=5)
    assert pol.judge(upd, models[2], 2) is None  # no previous gradient for client 1: accepted
    params, forget = pol.take_remembered()
    assert forget == 9 and params is upd.params and pol.take_remembered() is None


def test_kardam_keeps_no_updates_when_the_store_keeps_no_parameters(tmp_path):
    """store.save_parameters: false means no resume, so the updates kardam remembers are not
    written either (with parameters kept, every client that sent an update has one)."""
    common = ["server.robust.filter=kardam", "server.robust.warmup=3", "server.max_versions=6"]
    off, store, _ = run(small_config(*common, "store.save_parameters=false"), tmp_path, "off")
    on, store_on, _ = run(small_config(*common), tmp_path, "on")
    assert store.filter_updates(off["run_id"]) == []
    assert off["model_sha256"] == on["model_sha256"]  # the same decisions either way
    assert len(store_on.filter_updates(on["run_id"])) == len({u.client_id for u in store_on.updates(on["run_id"])}) > 0


def test_retention_keeps_the_version_zenos_validation_gradient_was_computed_at(tmp_path):
    # zeno++ refreshes its validation gradient every 6 versions; a resume recomputes it at the
    # version the loop state names, so the store must still hold that version's parameters
    from fedasync.store import loads_state

    cfg = small_config("server.strategy=fedasync", "server.robust.filter=zeno++", "server.robust.refresh=6",
                       "store.checkpoint_every=0")
    store = Store(f"sqlite:///{tmp_path / 'crash'}.db")
    server = AsyncServer(cfg, LocalTransport(), store, clock="virtual")
    crash_after(store, "record_reply", 11)
    with pytest.raises(Crash):
        server.run()
    store2 = Store(f"sqlite:///{tmp_path / 'crash'}.db")
    run = store2.get_run(server.run_id)
    v = loads_state(run.loop_state)["policy"]["zeno_v_version"]
    assert v is not None and v < run.current_version  # an older version than the latest
    assert v in store2.versions_with_parameters(server.run_id)
