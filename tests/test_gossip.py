"""Gossip (AD-PSGD / A(DP)²SGD): pairwise averaging in the store, atomicity, the simulator, DP, processes."""

import json
import os
import threading

import numpy as np
import pytest
from sqlalchemy import func, select
from typer.testing import CliRunner

from conftest import small_config
from fedasync.cli import app
from fedasync.config import load_config
from fedasync.privacy.budgets import resolve_budgets
from fedasync.serverless import gossip as G
from fedasync.serverless.common import PeerTask, config_for_peers
from fedasync.serverless.runs import run_info
from fedasync.serverless.sim import simulate_gossip
from fedasync.server.strategies import params_sha256
from fedasync.store import Store
from fedasync.store import schema as S
from fedasync.store import serverless_schema as SS

PG_URL = os.environ.get("FEDASYNC_TEST_POSTGRES_URL")
GOSSIP = ["data.num_clients=6", "server.concurrency=6", "train.local_steps=3", "server.target_accuracy=null"]


BACKENDS = ["sqlite", pytest.param("postgres", marks=pytest.mark.postgres)]


def store_url(backend, tmp_path):
    if backend == "postgres":
        if not PG_URL:
            pytest.skip("FEDASYNC_TEST_POSTGRES_URL is not set")
        return PG_URL
    return f"sqlite:///{tmp_path / 'gossip.db'}"


# -- parameter math ------------------------------------------------------------------------------


def test_average_with_delta_and_consensus_distance():
    a = {"w": np.array([1.0, 3.0], np.float32)}
    b = {"w": np.array([5.0, -1.0], np.float32)}
    d = {"w": np.array([2.0, 0.0])}
    out = G.average_with_delta(a, d, b)
    assert out["w"].dtype == np.float32 and out["w"].tolist() == [4.0, 1.0]
    assert G.mean_params([a, b])["w"].tolist() == [3.0, 1.0]
    # (1/N) sum_i ||x_i - mean||^2 = ((2^2 + 2^2) + (2^2 + 2^2)) / 2
    assert G.consensus_distance([a, b]) == pytest.approx(8.0)
    assert G.consensus_distance([a, a, a]) == 0.0


def test_step_orders_paper_is_ad_psgd_and_symmetric_averages_after_the_update():
    a = {"w": np.array([1.0, 3.0], np.float32)}
    b = {"w": np.array([5.0, -1.0], np.float32)}
    d = {"w": np.array([2.0, 0.0])}
    # paper (AD-PSGD): x_j <- (x_i + x_j)/2 = [3, 1]; x_i <- (x_i + x_j)/2 + delta = [5, 1]
    new_i, new_j = G.gossip_step(a, d, b, "paper")
    assert new_i["w"].tolist() == [5.0, 1.0] and new_j["w"].tolist() == [3.0, 1.0]
    assert new_i["w"].dtype == new_j["w"].dtype == np.float32
    # symmetric: both ((x_i + delta) + x_j)/2 = [4, 1]
    new_i, new_j = G.gossip_step(a, d, b, "symmetric")
    assert new_i["w"].tolist() == new_j["w"].tolist() == [4.0, 1.0]
    with pytest.raises(ValueError, match="gossip.step_order"):
        G.gossip_step(a, d, b, "zigzag")


@pytest.mark.parametrize("order", G.STEP_ORDERS)
def test_both_step_orders_keep_the_network_mean(order):
    """Each step adds exactly delta_i / N to the mean of all models, whichever order; they differ
    in where delta lands, hence in consensus distance."""
    rng = np.random.default_rng(7)
    n = 5
    models = [{"w": rng.normal(size=(3, 4)), "b": rng.normal(size=4)} for _ in range(n)]
    mean0 = G.mean_params(models)
    total = {k: np.zeros_like(v) for k, v in mean0.items()}
    for step in range(40):
        i, j = rng.choice(n, size=2, replace=False)
        d = {k: rng.normal(scale=0.1, size=np.shape(v)) for k, v in models[i].items()}
        models[i], models[j] = G.gossip_step(models[i], d, models[j], order)
        for k in total:
            total[k] += d[k]
    mean1 = G.mean_params(models)
    for k in mean0:
        assert np.allclose(mean1[k], mean0[k] + total[k] / n, atol=1e-12), k


# -- one averaging step, and many at once --------------------------------------------------------


def _gossip_run(url, n=6, topology="ring", order="paper"):
    cfg = small_config(f"data.num_clients={n}", f"server.concurrency={min(5, n)}", f"gossip.step_order={order}")
    store = Store(url)
    task = PeerTask(cfg)
    run_id = G.create_gossip(store, cfg, topology, 2, "wall", {}, task.init)
    return cfg, store, task, run_id


@pytest.mark.parametrize("order", G.STEP_ORDERS)
def test_finish_step_updates_both_rows_in_one_transaction(order, tmp_path):
    cfg, store, task, run_id = _gossip_run(f"sqlite:///{tmp_path / 'g.db'}", order=order)
    nb = run_info(store, run_id).settings["neighbours"]
    assert run_info(store, run_id).settings["step_order"] == order
    p = G.GossipPeer(store, run_id, 2, task, nb[2], cfg.seed, step_order=cfg.gossip.step_order)
    st = p.start_step(0)
    j = p.neighbour(0)
    assert j in (1, 3)
    ev = p.finish_step(st, virtual_time=1.25)
    models, info = G.snapshot(store, run_id)
    expect_i, expect_j = G.gossip_step(task.init, st.delta, task.init, order)
    if order == "paper":  # both rows held the initial model: x_j stays, x_i = x_0 + delta
        assert all(np.array_equal(expect_j[k], task.init[k]) for k in task.init)
        assert all(np.allclose(expect_i[k], task.init[k] + st.delta[k], atol=1e-6) for k in task.init)
    for k in task.init:
        assert np.array_equal(models[2][k], expect_i[k]) and np.array_equal(models[j][k], expect_j[k])
    assert ev["sha256"] == params_sha256(models[2])
    untouched = [i for i in range(6) if i not in (2, j)]
    assert all(np.array_equal(models[i][k], task.init[k]) for i in untouched for k in task.init)
    assert [r["version"] for r in info] == [1 if i in (2, j) else 0 for i in range(6)]
    assert info[2]["steps"] == 1 and info[j]["steps"] == 0
    assert ev["neighbour_id"] == j and ev["peer_version"] == 1 and ev["virtual_time"] == 1.25
    assert G.event_count(store, run_id) == 1


@pytest.mark.parametrize("order", G.STEP_ORDERS)
@pytest.mark.parametrize("backend", BACKENDS)
def test_concurrent_averaging_loses_no_update(backend, order, tmp_path):
    """Eight writers (own engines) average at once on a complete graph. Each step adds its delta to
    the sum of all models (either step order), so sum(final) = sum(initial) + sum(deltas) unless a
    step was lost or interleaved; and each row's version counts exactly the steps that touched it."""
    url = store_url(backend, tmp_path)
    cfg, store, task, run_id = _gossip_run(url, n=8, topology="complete", order=order)
    nb = run_info(store, run_id).settings["neighbours"]
    rng = np.random.default_rng(0)
    deltas = {i: [{k: rng.normal(size=v.shape) for k, v in task.init.items()} for _ in range(6)] for i in range(8)}
    barrier = threading.Barrier(8)
    errors = []

    def peer(i):
        try:
            p = G.GossipPeer(Store(url), run_id, i, task, nb[i], cfg.seed, step_order=order)
            barrier.wait()
            for step, d in enumerate(deltas[i]):
                p.finish_step(G.Step(step, p.task_id(step), 0, d, {}))
        except Exception as e:  # pragma: no cover - reported below
            errors.append(e)

    threads = [threading.Thread(target=peer, args=(i,)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors
    models, info = G.snapshot(store, run_id)
    for k, v in task.init.items():
        total = sum(np.asarray(m[k], np.float64) for m in models)
        expect = 8 * np.asarray(v, np.float64) + sum(d[k] for ds in deltas.values() for d in ds)
        assert np.allclose(total, expect, atol=1e-3), k
    with store.session() as s:
        evs = list(s.scalars(select(SS.GossipEvent).where(SS.GossipEvent.run_id == run_id)))
    assert len(evs) == 48
    for r in info:
        touched = [e for e in evs if r["peer"] in (e.peer_id, e.neighbour_id)]
        assert r["version"] == len(touched)
        seen = sorted([e.peer_version for e in evs if e.peer_id == r["peer"]]
                      + [e.neighbour_version for e in evs if e.neighbour_id == r["peer"]])
        assert seen == list(range(1, len(touched) + 1)), "two steps wrote the same row version"


# -- the simulator ---------------------------------------------------------------------------------


def test_simulated_gossip_is_deterministic_and_records_metrics(tmp_path):
    cfg = small_config(*GOSSIP)
    a = simulate_gossip(cfg, Store(f"sqlite:///{tmp_path / 'a.db'}"), "exponential", max_steps=4, eval_every=6)
    b = simulate_gossip(cfg, Store(f"sqlite:///{tmp_path / 'b.db'}"), "exponential", max_steps=4, eval_every=6)
    assert a["model_sha256"] == b["model_sha256"]
    assert [(h["events"], h["time_s"], h["accuracy"]) for h in a["history"]] == \
        [(h["events"], h["time_s"], h["accuracy"]) for h in b["history"]]
    assert a["averaging_events"] == 24 and a["stop_reason"] == "max_steps"
    assert a["steps_per_peer"] == {"min": 4, "max": 4, "mean": 4.0}
    assert [h["events"] for h in a["history"]] == [0, 6, 12, 18, 24]
    for h in a["history"]:
        assert h["min_accuracy"] <= h["max_accuracy"] and h["consensus_distance"] >= 0
    store = Store(f"sqlite:///{tmp_path / 'a.db'}")
    with store.session() as s:
        assert s.scalar(select(func.count()).select_from(SS.GossipMetric)) == len(a["history"])
    c = simulate_gossip(cfg, Store(f"sqlite:///{tmp_path / 'c.db'}"), "ring", max_steps=4, eval_every=6)
    assert c["model_sha256"] != a["model_sha256"]
    assert a["step_order"] == "paper"
    sym = simulate_gossip(small_config(*GOSSIP, "gossip.step_order=symmetric"),
                          Store(f"sqlite:///{tmp_path / 'd.db'}"), "exponential", max_steps=4, eval_every=6)
    assert sym["step_order"] == "symmetric" and sym["model_sha256"] != a["model_sha256"]
    assert sym["averaging_events"] == a["averaging_events"] == 24


def test_quickstart_ring_of_16_reaches_90_percent_and_consensus_distance_falls(tmp_path):
    cfg = config_for_peers(load_config(None, []), 16)  # digits, Dirichlet 0.5, 16 peers
    assert cfg.data.dataset == "digits" and cfg.data.alpha == 0.5 and cfg.server.target_accuracy == 0.9
    s = simulate_gossip(cfg, Store(f"sqlite:///{tmp_path / 'q.db'}"), "ring")
    assert s["stop_reason"] == "target_accuracy"
    assert s["final_accuracy"] >= 0.9 and s["time_to_target_s"] is not None
    cd = [h["consensus_distance"] for h in s["history"]]
    peak = int(np.argmax(cd))
    assert 0 < peak < len(cd) - 1
    late = cd[-max(3, len(cd) // 5):]
    assert max(late) < 0.75 * cd[peak], "consensus distance did not fall after its peak"
    assert np.mean(cd[len(cd) // 2:]) < np.mean(cd[len(cd) // 4: len(cd) // 2])
    assert all(h["min_accuracy"] <= h["accuracy"] + 0.2 for h in s["history"])


def test_dp_peers_stay_within_their_budgets(tmp_path):
    cfg = small_config("data.num_clients=6", "data.partitioner=iid", "server.concurrency=6",
                       "server.max_versions=null", "server.target_accuracy=null", "train.local_steps=2",
                       "train.batch_size=32", "privacy.local_dp.enabled=true", "privacy.local_dp.epsilon=8.0",
                       "privacy.local_dp.planned_tasks=2", "privacy.overrides=[{clients: '4-5', epsilon: 4.0}]")
    store = Store(f"sqlite:///{tmp_path / 'dp.db'}")
    s = simulate_gossip(cfg, store, "ring")
    budgets = resolve_budgets(cfg.privacy, 6)
    assert s["stop_reason"] == "no_peer_can_train" and s["peers_exhausted"] == 6
    eps = {int(k): v for k, v in s["privacy"]["epsilon_per_peer"].items()}
    for peer in range(6):
        assert 0 < eps[peer] <= budgets[peer].epsilon
    assert eps[4] <= 4.0 < eps[0]  # the override's smaller budget
    run_id = s["run_id"]
    with store.session() as sess:
        spend = list(sess.scalars(select(S.PrivacySpend).where(S.PrivacySpend.run_id == run_id)))
        clients = list(sess.scalars(select(S.Client).where(S.Client.run_id == run_id)))
    # every step recorded its spend; each peer trained its planned 2 tasks and then refused
    assert len(spend) == s["averaging_events"] == 12
    assert all(sum(r.client_id == p for r in spend) == 2 for p in range(6))
    assert all(c.exhausted and c.exhausted_reason == "privacy_budget_exhausted" for c in clients)
    assert all(json.loads(c.accountant_state)["history"] for c in clients)


# -- peer processes -------------------------------------------------------------------------------


@pytest.mark.parametrize("backend", BACKENDS)
def test_gossip_peer_processes_run_and_are_stopped(backend, tmp_path):
    from fedasync.serverless.runner import run_gossip
    from fedasync.serverless.runs import peers as peer_rows

    url = store_url(backend, tmp_path)
    cfg = small_config("data.num_clients=4", "server.concurrency=4", "train.local_steps=2",
                       "server.target_accuracy=null")
    s = run_gossip(cfg, url, 4, tmp_path / "out", "ring", max_steps=5, eval_every=4)
    store = Store(url)
    assert s["stop_reason"] == "max_steps" and s["averaging_events"] == 20
    assert s["peer_exit_codes"] == [0] * 4
    models, info = G.snapshot(store, s["run_id"])
    assert [r["steps"] for r in info] == [5] * 4
    with store.session() as sess:
        evs = list(sess.scalars(select(SS.GossipEvent).where(SS.GossipEvent.run_id == s["run_id"])))
    for r in info:
        assert r["version"] == sum(r["peer"] in (e.peer_id, e.neighbour_id) for e in evs)
    for e in evs:  # ring: only neighbours average
        assert (e.neighbour_id - e.peer_id) % 4 in (1, 3)
    for p in peer_rows(store, s["run_id"]):
        with pytest.raises(ProcessLookupError):
            os.kill(p["pid"], 0)
    assert (tmp_path / "out" / "logs" / "peer-3.log").exists()


# -- the CLI --------------------------------------------------------------------------------------


def test_cli_gossip_virtual_run_and_errors(tmp_path):
    runner = CliRunner()
    args = ["gossip", "run", "--virtual", "--topology", "torus", "--max-steps", "2", "--out", str(tmp_path / "o"),
            *sum((["--set", x] for x in GOSSIP), [])]
    res = runner.invoke(app, args)
    assert res.exit_code == 0, res.output
    s = json.loads((tmp_path / "o" / "summary.json").read_text())
    assert s["strategy"] == "gossip-torus" and s["averaging_events"] == 12
    assert (tmp_path / "o" / "consensus_distance.png").exists()
    header = (tmp_path / "o" / "history.csv").read_text().splitlines()[0]
    assert header == "events,time_s,accuracy,loss,min_accuracy,max_accuracy,consensus_distance"
    res = runner.invoke(app, ["gossip", "run", "--virtual", "--topology", "star", "--out", str(tmp_path / "p")])
    assert res.exit_code == 2 and "--topology: 'star' is not one of" in res.output
    assert not (tmp_path / "p").exists()
    res = runner.invoke(app, ["gossip", "run", "--virtual", "--set", "gossip.step_order=zigzag",
                              "--out", str(tmp_path / "p")])
    assert res.exit_code == 2 and res.output.startswith("error: gossip.step_order:") and not (tmp_path / "p").exists()
    res = runner.invoke(app, ["gossip", "peer", "--store", f"sqlite:///{tmp_path / 'o' / 'fedasync.db'}",
                              "--peer-id", "0"])
    assert res.exit_code == 2 and "no starting or running gossip run" in res.output
    # a peer joins only a starting or running run, and never overwrites a finished one's records
    db = f"sqlite:///{tmp_path / 'o' / 'fedasync.db'}"
    before = (tmp_path / "o" / "fedasync.db").read_bytes()
    res = runner.invoke(app, ["gossip", "peer", "--store", db, "--peer-id", "0", "--run-id", "1"])
    assert res.exit_code == 2 and "gossip run 1 is finished: a peer joins only a starting or running run" in res.output
    assert (tmp_path / "o" / "fedasync.db").read_bytes() == before
    res = runner.invoke(app, ["gossip", "peer", "--store", db, "--peer-id", "0", "--run-id", "99"])
    assert res.exit_code == 2 and "no gossip run 99" in res.output and "gossip runs: 1" in res.output
    res = runner.invoke(app, ["gossip", "peer", "--store", db, "--peer-id", "0", "--set", "seed=5"])
    assert res.exit_code == 2 and "--set: needs CONFIG" in res.output
    res = runner.invoke(app, ["gossip", "peer", "--store", f"sqlite:///{tmp_path / 'none.db'}", "--peer-id", "0"])
    assert res.exit_code == 2 and not (tmp_path / "none.db").exists()
    for bad in ("nan", "inf", "0"):
        res = runner.invoke(app, ["gossip", "run", "--virtual", "--time-budget", bad, "--out", str(tmp_path / "t")])
        assert res.exit_code == 2 and "--time-budget: must be a finite number > 0" in res.output, bad
    # runs lists the run's model count (a gossip run has no global version)
    res = runner.invoke(app, ["runs", "--store", db], env={"COLUMNS": "250"})
    row = [ln for ln in res.output.splitlines() if "gossip-torus" in ln]
    assert res.exit_code == 0 and len(row) == 1 and row[0].split()[5] == "12", res.output  # id name strategy mode status versions
