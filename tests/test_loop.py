"""The asynchronous loop, in-process (LocalTransport): determinism, the store, equivalences."""

import numpy as np
import pytest

from conftest import small_config
from fedasync.server.loop import AsyncServer
from fedasync.server.transport import LocalTransport
from fedasync.store import Store, decode_params
from fedasync.server.strategies import params_sha256


def run(cfg, tmp_path, name="db"):
    store = Store(f"sqlite:///{tmp_path / name}.db")
    server = AsyncServer(cfg, LocalTransport(), store, clock="virtual")
    return server.run(), store, server


def test_same_config_and_seed_give_the_same_model_and_history(tmp_path):
    cfg = small_config()
    a, _, _ = run(cfg, tmp_path, "a")
    b, _, _ = run(cfg, tmp_path, "b")
    assert a["model_sha256"] == b["model_sha256"]
    assert a["history"] == b["history"]
    assert a["versions"] == 12 and a["updates_accepted"] == 36
    c, _, _ = run(small_config("seed=1"), tmp_path, "c")
    assert c["model_sha256"] != a["model_sha256"]


def test_store_holds_every_dispatch_update_and_version(tmp_path):
    summary, store, server = run(small_config(), tmp_path)
    rid = summary["run_id"]
    counts = store.counts(rid)
    assert counts["dispatches"] == server.next_task  # one row per dispatch
    assert counts["updates"] == summary["updates_received"]
    assert counts["accepted"] == summary["updates_accepted"]
    versions = store.versions(rid)
    assert [v.version for v in versions] == list(range(summary["versions"] + 1))
    for v in versions:  # retention: the latest and v0 (a checkpoint) keep their parameters, at least
        if v.parameters is not None or v.version in (0, summary["versions"]):
            assert params_sha256(decode_params(v.parameters)) == v.sha256
    assert versions[-1].sha256 == summary["model_sha256"]
    # fedbuff: every accepted update is in exactly one version, or still in the buffer
    applied = {}
    for u in store.updates(rid):
        assert u.staleness == u.version_at_arrival - u.base_version >= 0
        if u.applied_in_version is not None:
            applied.setdefault(u.applied_in_version, []).append(u.task_id)
    assert sorted(applied) == list(range(1, summary["versions"] + 1))
    assert all(len(ts) == 3 for ts in applied.values())  # exactly K per aggregation
    statuses = {d.status for d in store.dispatches(rid)}
    assert statuses <= {"replied", "cancelled"}
    assert store.get_run(rid).status == "finished"


def test_virtual_time_orders_replies_by_finish_time(tmp_path):
    summary, store, _ = run(small_config(), tmp_path)
    rid = summary["run_id"]
    finish = {d.task_id: d.finish_virtual for d in store.dispatches(rid)}
    taken = [(u.received_virtual, u.task_id) for u in store.updates(rid)]
    # each reply is taken at its virtual finish time, and in that order
    assert all(abs(t - finish[tid]) < 1e-12 for t, tid in taken)
    order = [u.id for u in sorted(store.updates(rid), key=lambda u: (u.received_virtual, u.task_id))]
    assert order == sorted(order)


def test_fedbuff_with_k1_and_no_staleness_equals_fedasync(tmp_path):
    common = ["server.concurrency=1", "server.max_versions=15", "server.staleness.fn=polynomial"]
    fb, _, _ = run(small_config(*common, "server.strategy=fedbuff", "server.buffer_size=1", "server.server_lr=0.6"),
                   tmp_path, "fb")
    fa, _, _ = run(small_config(*common, "server.strategy=fedasync", "server.alpha=0.6"), tmp_path, "fa")
    assert fb["staleness"]["max"] == 0
    assert fb["model_sha256"] == fa["model_sha256"]
    assert fb["history"] == fa["history"]


def test_fedbuff_with_k_equal_clients_and_equal_speeds_equals_fedavg(tmp_path):
    n = 8
    common = [f"data.num_clients={n}", f"server.concurrency={n}", "server.max_versions=4",
              "clock.sigma=0", "clock.jitter=0", "clock.bandwidth_sigma=0", "server.weighting=uniform"]
    fb, s1, srv1 = run(small_config(*common, "server.strategy=fedbuff", f"server.buffer_size={n}"), tmp_path, "fb")
    fa, s2, srv2 = run(small_config(*common, "server.strategy=fedavg"), tmp_path, "fa")
    assert fb["versions"] == fa["versions"] == 4
    assert fb["staleness"]["max"] == 0
    for k in srv1.params:
        np.testing.assert_allclose(srv1.params[k], srv2.params[k], rtol=0, atol=1e-6)
    assert [h["version"] for h in fb["history"]] == [h["version"] for h in fa["history"]]
    np.testing.assert_allclose([h["accuracy"] for h in fb["history"]], [h["accuracy"] for h in fa["history"]])


def test_fedavg_backup_workers_discard_the_slowest(tmp_path):
    cfg = small_config("server.strategy=fedavg", "server.concurrency=4", "server.backup_workers=2",
                       "server.max_versions=5")
    summary, store, _ = run(cfg, tmp_path)
    ups = store.updates(summary["run_id"])
    by_version = {}
    for u in ups:
        if u.accepted:
            by_version.setdefault(u.applied_in_version, []).append(u)
    assert sorted(by_version) == [1, 2, 3, 4, 5]
    assert all(len(v) == 4 for v in by_version.values())  # m = 4 aggregated per round
    assert all(u.accepted for u in ups)  # the b stragglers never reply: their round cancelled them
    # every dispatch of a round carried that round's version; a round sends m + b tasks
    per_round = {}
    for d in store.dispatches(summary["run_id"]):
        per_round[d.base_version] = per_round.get(d.base_version, 0) + 1
    assert per_round[0] == 6
    cancelled = [d for d in store.dispatches(summary["run_id"]) if d.status == "cancelled"]
    assert len(cancelled) == 2 * 5 and all(d.error == "round_closed" for d in cancelled)


def test_backup_workers_restart_together_when_every_client_is_in_the_round(tmp_path):
    """n = m + b = 6: each round's 6 tasks leave at one virtual instant (Chen et al. 2016), the
    2 stragglers of the closed round are cancelled, not waited for; and a resumed run agrees."""
    cfg = small_config("data.num_clients=6", "server.strategy=fedavg", "server.concurrency=4",
                       "server.backup_workers=2", "server.max_versions=6")
    summary, store, _ = run(cfg, tmp_path)
    rounds = {}
    for d in store.dispatches(summary["run_id"]):
        rounds.setdefault(d.base_version, []).append(d)
    assert sorted(rounds) == list(range(6))
    for v, ds in rounds.items():
        assert len(ds) == 6 and len({d.sent_virtual for d in ds}) == 1, (v, [d.sent_virtual for d in ds])
        assert sorted(d.client_id for d in ds) == list(range(6))
        assert sorted(d.status for d in ds) == ["cancelled"] * 2 + ["replied"] * 4
    # the next round starts when its m-th reply closes the previous one
    for v in range(1, 6):
        closing = max(d.finish_virtual for d in rounds[v - 1] if d.status == "replied")
        assert rounds[v][0].sent_virtual == closing


def test_max_staleness_rejects_stale_updates_and_keeps_the_model(tmp_path):
    cfg = small_config("server.strategy=fedasync", "server.max_staleness=1", "server.max_versions=20")
    summary, store, _ = run(cfg, tmp_path)
    ups = store.updates(summary["run_id"])
    stale = [u for u in ups if u.reason == "stale"]
    assert stale and all(u.staleness > 1 and u.applied_in_version is None for u in stale)
    assert summary["rejections"]["stale"] == len(stale)
    assert summary["updates_rejected"] == len(stale)


def test_stops_at_virtual_time_and_target(tmp_path):
    s, _, _ = run(small_config("server.max_versions=null", "server.max_virtual_time=5"), tmp_path, "t")
    assert s["stop_reason"] == "max_virtual_time" and s["virtual_time_s"] == 5
    s2, _, _ = run(small_config("server.max_versions=500", "server.target_accuracy=0.3",
                                "server.stop_at_target=true"), tmp_path, "acc")
    assert s2["stop_reason"] == "target_accuracy"
    assert s2["final_accuracy"] >= 0.3 and s2["time_to_target_s"] is not None


def test_a_failing_client_does_not_stop_the_run(tmp_path):
    from fedasync.clients.runner import handle_train

    def flaky(params, config):
        if config["client_id"] % 4 == 0:
            raise RuntimeError("device fell over")
        return handle_train(params, config)

    store = Store(f"sqlite:///{tmp_path / 'f'}.db")
    summary = AsyncServer(small_config(), LocalTransport(flaky), store).run()
    assert summary["versions"] == 12 and summary["tasks_failed"] > 0
    failed = store.dispatches(summary["run_id"], status="failed")
    assert failed and all("device fell over" in d.error for d in failed)


def test_fedasync_proximal_term_reaches_the_clients(tmp_path):
    # train.prox_rho travels in the task's setup; 0 (the default) is the run above, bit for bit
    base, _, _ = run(small_config("server.strategy=fedasync"), tmp_path, "a")
    zero, _, _ = run(small_config("server.strategy=fedasync", "train.prox_rho=0"), tmp_path, "b")
    prox, _, _ = run(small_config("server.strategy=fedasync", "train.prox_rho=0.5"), tmp_path, "c")
    assert zero["model_sha256"] == base["model_sha256"] != prox["model_sha256"]


def test_wall_clock_late_reply_of_a_cancelled_backup_is_rejected_without_a_slot(tmp_path):
    """Wall clock: client 2 is always slow. Its task is cancelled when the round closes, the next
    round goes out to all three clients at once, and its late reply is recorded as round_closed."""
    from fedasync.clients.runner import handle_train

    class SlowClient2(LocalTransport):
        def __init__(self):
            super().__init__(handle_train)
            self.client_of, self.polls = {}, 0

        def send(self, tasks):
            ids = super().send(tasks)
            self.client_of.update({m: t.client_id for m, t in zip(ids, tasks)})
            return ids

        def poll(self, message_ids):
            self.polls += 1  # client 2's replies only come back on every third poll
            ready = [m for m in message_ids if self.client_of[m] != 2 or self.polls % 3 == 0]
            return super().poll(ready)

    cfg = small_config("data.num_clients=3", "server.strategy=fedavg", "server.concurrency=2",
                       "server.backup_workers=1", "server.max_versions=4", "server.poll_interval=0.001")
    store = Store(f"sqlite:///{tmp_path / 'w'}.db")
    summary = AsyncServer(cfg, SlowClient2(), store, clock="wall").run()
    ds = store.dispatches(summary["run_id"])
    rounds = {}
    for d in ds:
        rounds.setdefault(d.base_version, []).append(d)
    assert all(sorted(d.client_id for d in rounds[v]) == [0, 1, 2] for v in range(4))
    late = [u for u in store.updates(summary["run_id"]) if u.reason == "round_closed"]
    assert late and all(u.client_id == 2 and u.applied_in_version is None for u in late)
    assert summary["rejections"]["round_closed"] == len(late)
    by_task = {d.task_id: d for d in ds}
    assert all(by_task[u.task_id].status == "cancelled" for u in late)


def test_idle_clients_is_the_sorted_list_the_scheduler_always_got():
    import random

    from fedasync.server.idle import IdleClients

    rng = random.Random(0)
    idle = IdleClients(50)
    exhausted: set[int] = set()
    for _ in range(200):
        busy = set(rng.sample(range(50), rng.randint(0, 12)))
        if rng.random() < 0.1:
            exhausted.add(rng.randrange(50))
        avail = set(rng.sample(range(50), 30)) if rng.random() < 0.2 else None
        want = [c for c in range(50) if c not in busy and c not in exhausted and (avail is None or c in avail)]
        assert idle(busy, exhausted, avail) == want


def test_retention_releases_what_nothing_refers_to():
    from fedasync.server.retention import Retention

    r = Retention(checkpoint_every=3, held=[0])
    assert r.held == set()  # v0 is a checkpoint: never released
    for v in (1, 2, 4):
        r.stored(v)
    r.stored(3)  # a checkpoint
    r.buffered(task_id=7, base_version=1)
    assert r.release(current=4, live_bases=[2], pending=[7]) == []
    assert r.release(current=4, live_bases=[], pending=[7]) == [2]
    assert r.release(current=5, live_bases=[], pending=[]) == [1, 4]
    assert r.held == set()
    assert Retention(0, save=False, held=[0, 1]).release(5, [], []) == []


def test_the_loop_runs_numpy_blas_on_one_thread_and_gives_the_setting_back(tmp_path):
    # OpenBLAS's idle threads spin after every call, taking cores from the clients; the loop's
    # vector products run on one thread (server/params.py: one_blas_thread), restored at the end
    from threadpoolctl import threadpool_info, threadpool_limits

    from fedasync.clients.runner import handle_train

    def blas_threads() -> set[int]:
        return {i["num_threads"] for i in threadpool_info() if i["user_api"] == "blas"}

    seen = []

    def client(params, config):
        seen.append(blas_threads())
        return handle_train(params, config)

    with threadpool_limits(limits=2, user_api="blas"):
        assert blas_threads() == {2}
        AsyncServer(small_config(), LocalTransport(client), Store(f"sqlite:///{tmp_path / 'b'}.db")).run()
        after = blas_threads()
    assert seen and all(s == {1} for s in seen)
    assert after == {2}


def test_fedavg_backups_with_replies_at_the_same_instant_do_not_stop_the_run(tmp_path):
    # equal speeds: the round's m-th reply and its backups finish at one virtual instant; the
    # backups the round's close cancelled are skipped, not taken (they were a KeyError)
    cfg = small_config("data.num_clients=8", "server.concurrency=4", "server.max_versions=3", "clock.sigma=0",
                       "clock.jitter=0", "clock.bandwidth_sigma=0", "server.strategy=fedavg",
                       "server.clients_per_round=4", "server.backup_workers=2")
    store = Store(f"sqlite:///{tmp_path / 'ties'}.db")
    s = AsyncServer(cfg, LocalTransport(), store, clock="virtual").run()
    assert s["stop_reason"] == "max_versions" and s["versions"] == 3 and s["updates_accepted"] == 12
    cancelled = [d for d in store.dispatches(s["run_id"]) if d.status == "cancelled"]
    assert cancelled and all(d.error == "round_closed" for d in cancelled)


@pytest.mark.parametrize("strategy", [["server.strategy=fedbuff", "server.weighting=examples", "server.buffer_size=1"],
                                      ["server.strategy=fedavg", "server.clients_per_round=1"]])
def test_an_update_without_examples_is_rejected_under_examples_weighting(tmp_path, strategy):
    # it has no weight: a buffer or round of such updates only had nothing to normalise by
    from fedasync.clients.runner import handle_train

    def client(params, config):
        out = handle_train(params, config)
        if config["client_id"] % 2 == 0:
            out["metrics"] = {k: v for k, v in out["metrics"].items() if k != "num_examples"}
        return out

    store = Store(f"sqlite:///{tmp_path / 'noex'}.db")
    s = AsyncServer(small_config("server.concurrency=1", "server.max_versions=4", *strategy), LocalTransport(client),
                    store).run()
    assert s["stop_reason"] == "max_versions" and s["rejections"].get("no_examples", 0) > 0
    assert all(u.client_id % 2 == 0 for u in store.updates(s["run_id"]) if u.reason == "no_examples")
