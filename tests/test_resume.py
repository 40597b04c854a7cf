"""Crash safety and resume.

Under the virtual clock a resumed run re-sends the tasks that were in flight exactly as they
were, so a run that crashed (anywhere) and was resumed must end with the same model, history
and counts as the run that never stopped. That is checked here for crashes injected at every
kind of commit point (in process, fast), for a real ``kill -9`` of ``fedasync simulate`` and for
SIGINT, plus the store invariants: versions contiguous, every accepted update applied in
exactly one version or still pending in the restored buffer, summary counts equal to the store.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

import numpy as np
import pytest
import yaml

from fedasync.config import config_from_dict
from fedasync.server.loop import AsyncServer
from fedasync.server.resume import check_resume_config
from fedasync.server.transport import LocalTransport
from fedasync.store import Store, loads_state

FEDASYNC = str(Path(sys.executable).with_name("fedasync"))


class Crash(BaseException):
    """Stands for the process dying (not an Exception: nothing in the loop may catch it)."""


def make_cfg(strategy: str, **extra):
    server = {"strategy": strategy, "concurrency": 4, "max_versions": 8, "eval_every": 3}
    if strategy == "fedbuff":
        server["buffer_size"] = 3
    if strategy == "fedavg":
        server.update(clients_per_round=3, backup_workers=1)
    server.update(extra.pop("server", {}))
    raw = {
        "name": f"resume-{strategy}", "seed": 5,
        "data": {"dataset": "digits", "num_clients": 12, "partitioner": "dirichlet", "alpha": 0.5},
        "model": {"name": "mlp", "hidden": 16},
        "train": {"local_steps": 3, "batch_size": 8},
        "server": server,
        **extra,
    }
    return config_from_dict(raw)


def store_at(path: Path) -> Store:
    return Store(f"sqlite:///{path}")


_REFS: dict[str, dict] = {}


def reference(cfg, tmp_path_factory) -> dict:
    key = cfg.to_yaml()
    if key not in _REFS:
        d = tmp_path_factory.mktemp("ref")
        _REFS[key] = AsyncServer(cfg, LocalTransport(), store_at(d / "ref.db")).run()
    return _REFS[key]


def check_invariants(store: Store, summary: dict) -> None:
    run_id = summary["run_id"]
    run = store.get_run(run_id)
    versions = store.versions(run_id)
    assert [v.version for v in versions] == list(range(summary["versions"] + 1))
    assert all(v.parent == v.version - 1 for v in versions[1:])
    ups = store.updates(run_id)
    accepted = [u for u in ups if u.accepted]
    applied = Counter(u.applied_in_version for u in accepted if u.applied_in_version is not None)
    for v in versions[1:]:  # every version names the updates it was made of; none is used twice
        assert applied[v.version] == v.num_updates >= 1
    assert sum(applied.values()) + len([u for u in accepted if u.applied_in_version is None]) == len(accepted)
    pending = sorted(u.task_id for u in accepted if u.applied_in_version is None)
    assert pending == sorted(u.task_id for u, _ in store.pending_updates(run_id))
    assert all(u.applied_in_version is None for u in ups if not u.accepted)
    # the summary's counts are the store's
    replays = store.replays(run_id)
    st = store.dispatch_status_counts(run_id)
    assert summary["updates_received"] == len(ups)
    assert summary["updates_accepted"] == len(accepted)
    assert summary["updates_rejected"] == len(ups) - len(accepted)
    assert summary["rejections"] == dict(sorted((Counter(u.reason for u in ups if not u.accepted)
                                                 + Counter(r.reason for r in replays)).items()))
    assert summary["tasks_failed"] == sum(st.get(k, 0) for k in ("failed", "timeout", "late"))
    assert st.get("in_flight", 0) == 0
    assert summary["model_sha256"] == versions[-1].sha256
    assert json.loads(run.summary_json)["model_sha256"] == summary["model_sha256"]
    assert run.current_version == summary["versions"]


SAME = ("versions", "updates_received", "updates_accepted", "rejections", "tasks_failed", "staleness",
        "model_sha256", "final_accuracy", "time_to_target_s", "virtual_time_s")


def assert_same_run(a: dict, b: dict) -> None:
    for k in SAME:
        assert a[k] == b[k], k
    assert [(h["version"], h["accuracy"], h["loss"]) for h in a["history"]] == \
           [(h["version"], h["accuracy"], h["loss"]) for h in b["history"]]
    assert [h["virtual_time_s"] for h in a["history"]] == pytest.approx([h["virtual_time_s"] for h in b["history"]])


def crash_at(obj, name: str, n: int, before: bool) -> None:
    """Make the n-th call of ``obj.name`` crash, before or after it did its work (committed)."""
    orig = getattr(obj, name)
    calls = [0]

    def wrapper(*a, **k):
        calls[0] += 1
        if calls[0] == n and before:
            raise Crash(f"{name} #{n} (before)")
        out = orig(*a, **k)
        if calls[0] == n:
            raise Crash(f"{name} #{n} (after)")
        return out

    setattr(obj, name, wrapper)


def crashed_run(cfg, db: Path, point: tuple[str, int, bool]) -> tuple[Store, int]:
    """Run ``cfg`` on a store at ``db`` until it crashes at ``point``; the store reopened, the run id."""
    store = store_at(db)
    crash_at(store, *point)
    server = AsyncServer(cfg, LocalTransport(), store)
    with pytest.raises(Crash):
        server.run()
    return store_at(db), server.run_id


POINTS = [("send", 3, True), ("record_dispatches", 4, False), ("record_reply", 5, True),
          ("record_reply", 9, False), ("record_eval", 2, True), ("record_reply", 14, False)]
CASES = [("fedbuff", p) for p in POINTS] + [("fedasync", POINTS[2]), ("fedasync", ("record_reply", 6, False)),
                                            ("fedavg", POINTS[1]), ("fedavg", POINTS[3])]


@pytest.mark.parametrize("strategy,point", CASES, ids=[f"{s}-{p[0]}{p[1]}{'b' if p[2] else 'a'}" for s, p in CASES])
def test_crash_anywhere_then_resume_is_the_uninterrupted_run(tmp_path, tmp_path_factory, strategy, point):
    cfg = make_cfg(strategy)
    ref = reference(cfg, tmp_path_factory)
    db = tmp_path / "s.db"
    store = store_at(db)
    transport = LocalTransport()
    name, n, before = point
    crash_at(transport if name == "send" else store, name, n, before)
    server = AsyncServer(cfg, transport, store)
    with pytest.raises(Crash):
        server.run()
    run_id = server.run_id
    assert store_at(db).get_run(run_id).status == "running"  # as a killed server leaves it

    store2 = store_at(db)
    summary = AsyncServer(cfg, LocalTransport(), store2, resume_run_id=run_id).run()
    assert summary["run_id"] == run_id and summary["stop_reason"] == "max_versions"
    check_invariants(store2, summary)
    assert_same_run(summary, ref)


MOMENTUM = [("fedbuff", POINTS[3]), ("fedbuff", POINTS[5]), ("fedavg", POINTS[1]), ("fedavg", POINTS[3])]


@pytest.mark.parametrize("strategy,point", MOMENTUM, ids=[f"{s}-{p[0]}{p[1]}" for s, p in MOMENTUM])
def test_server_momentum_survives_a_crash_and_resume(tmp_path, tmp_path_factory, strategy, point):
    """FedAvgM's velocity is strategy state: a run resumed after a crash ends with the model (sha256)
    of the run never stopped, and momentum moved that model (it is not the beta = 0 one)."""
    cfg = make_cfg(strategy, server={"server_momentum": 0.9, "server_lr": 0.7})
    ref = reference(cfg, tmp_path_factory)
    assert ref["model_sha256"] != reference(make_cfg(strategy, server={"server_lr": 0.7}),
                                            tmp_path_factory)["model_sha256"]
    store = store_at(tmp_path / "s.db")
    crash_at(store, *point)
    server = AsyncServer(cfg, LocalTransport(), store)
    with pytest.raises(Crash):
        server.run()
    summary = AsyncServer(cfg, LocalTransport(), store_at(tmp_path / "s.db"), resume_run_id=server.run_id).run()
    assert summary["stop_reason"] == "max_versions"
    assert_same_run(summary, ref)


def central_dp_cfg():
    """fedbuff (K = 3) with central DP and momentum: six clients of very different speeds, all busy,
    so a fast client's second update is held and refills the buffer right after each release (the
    buffer never empties after the first aggregation: replies 10, 16, 22, ... each make a version
    and leave two held updates buffered)."""
    return make_cfg("fedbuff", data={"dataset": "digits", "num_clients": 6, "partitioner": "iid"},
                    clock={"sigma": 2.5, "latency_s": 0.0},
                    server={"concurrency": 6, "max_versions": 10, "server_momentum": 0.9, "server_lr": 0.7},
                    privacy={"central_dp": {"enabled": True, "clip": 1.0, "noise_multiplier": 0.5},
                             "reproducible_noise": True})


@pytest.mark.parametrize("point", [("record_reply", 16, False), ("record_reply", 17, False),
                                   ("record_reply", 28, True)], ids=["16a", "17a", "28b"])
def test_central_dp_crash_after_a_release_that_refilled_the_buffer_then_resume(tmp_path, tmp_path_factory,
                                                                                   point):
    """A crash after a central-DP release whose held updates refilled the buffer: the resumed run
    takes up the strategy as it was after that release (release count: the reproducible noise of
    each release; velocity), not one aggregation behind, and ends as the run never stopped."""
    cfg = central_dp_cfg()
    ref = reference(cfg, tmp_path_factory)
    assert ref["rejections"].get("client_backlog", 0) > 0  # updates were held back (and some backlogged)
    store, run_id = crashed_run(cfg, tmp_path / "s.db", point)
    run = store.get_run(run_id)
    assert store.pending_updates(run_id)  # the crash left updates buffered (held ones among them)
    snapshot = loads_state(run.strategy_state)["state"]
    assert snapshot["central_dp"]["releases"] == run.current_version  # one release per version, none missing
    assert snapshot["buffer"] == [] and "held" not in snapshot  # those are re-added from the store
    summary = AsyncServer(cfg, LocalTransport(), store, resume_run_id=run_id).run()
    assert summary["stop_reason"] == "max_versions"
    check_invariants(store, summary)
    assert summary["privacy"]["central_dp"]["releases"] == 10
    assert_same_run(summary, ref)


def test_crash_twice_then_resume(tmp_path, tmp_path_factory):
    cfg = make_cfg("fedbuff")
    ref = reference(cfg, tmp_path_factory)
    db = tmp_path / "s.db"
    store, run_id = crashed_run(cfg, db, ("record_reply", 4, False))
    crash_at(store, "record_reply", 6, True)
    with pytest.raises(Crash):
        AsyncServer(cfg, LocalTransport(), store, resume_run_id=run_id).run()
    store = store_at(db)
    summary = AsyncServer(cfg, LocalTransport(), store, resume_run_id=run_id).run()
    check_invariants(store, summary)
    assert_same_run(summary, ref)


def test_finished_run_continues_with_a_higher_limit(tmp_path, tmp_path_factory):
    """A run stopped at max_versions=8 and continued to 12 is the run made with 12 (its live tasks
    were cancelled at the stop and are re-sent as they were)."""
    ref12 = reference(make_cfg("fedbuff", server={"max_versions": 12}), tmp_path_factory)
    db = tmp_path / "s.db"
    first = AsyncServer(make_cfg("fedbuff"), LocalTransport(), store_at(db)).run()
    assert first["versions"] == 8
    cfg12 = make_cfg("fedbuff", server={"max_versions": 12})
    summary = AsyncServer(cfg12, LocalTransport(), store_at(db), resume_run_id=first["run_id"]).run()
    check_invariants(store_at(db), summary)
    for k in ("versions", "model_sha256", "updates_received", "updates_accepted"):
        assert summary[k] == ref12[k], k


def test_wall_clock_resume_redispatches_lost_tasks_first(tmp_path):
    cfg = make_cfg("fedbuff", server={"max_versions": 6})
    db = tmp_path / "s.db"
    store = store_at(db)
    crash_at(store, "record_reply", 7, False)
    server = AsyncServer(cfg, LocalTransport(), store, clock="wall", mode="deployment")
    with pytest.raises(Crash):
        server.run()
    store = store_at(db)
    in_flight = [d for d in store.dispatches(server.run_id) if d.status == "in_flight"]
    next_task = store.get_run(server.run_id).next_task_id
    assert in_flight
    with pytest.raises(RuntimeError, match="deployment run"):
        AsyncServer(cfg, LocalTransport(), store, resume_run_id=server.run_id)  # not as a simulation
    summary = AsyncServer(cfg, LocalTransport(), store, clock="wall", mode="deployment",
                          resume_run_id=server.run_id).run()
    check_invariants(store, summary)
    ds = store.dispatches(server.run_id)
    assert {d.task_id for d in ds if d.status == "lost"} == {d.task_id for d in in_flight}
    first_new = [d for d in ds if d.task_id >= next_task][:len(in_flight)]
    assert {d.client_id for d in first_new} == {d.client_id for d in in_flight}
    assert summary["versions"] == 6


def test_resume_refuses_a_different_experiment():
    stored = make_cfg("fedbuff").to_yaml()
    raw = yaml.safe_load(stored)
    assert check_resume_config(stored, make_cfg("fedbuff", server={"max_versions": 50, "eval_every": 2})) is None
    other = config_from_dict({**raw, "server": {**raw["server"], "server_lr": 0.5}})
    assert check_resume_config(stored, other) == "server.server_lr is 0.5, the run was made with 1.0"
    assert check_resume_config(stored, config_from_dict({**raw, "seed": 6})).startswith("seed is 6")
    assert check_resume_config(stored, config_from_dict({**raw, "data": {**raw["data"], "alpha": 0.1}})) \
        .startswith("data.alpha")
    # a run stored before a key existed (here server.scheduler) resumes under the key's default
    older = dict(raw, server={k: v for k, v in raw["server"].items() if k != "scheduler"})
    assert check_resume_config(yaml.safe_dump(older), make_cfg("fedbuff")) is None
    assert check_resume_config(yaml.safe_dump(older), make_cfg("fedbuff", server={"scheduler": {"name": "fair"}})) \
        .startswith("server.scheduler.name is 'fair'")


def _kept(store: Store, run_id: int) -> set[int]:
    return set(store.versions_with_parameters(run_id))


def _needed(store: Store, run_id: int, every: int) -> set[int]:
    """What retention must keep: the latest version, the checkpoints, the base of every task a
    resume re-sends and of every update still buffered."""
    run = store.get_run(run_id)
    ckpt = {v for v in range(run.current_version + 1) if every and v % every == 0}
    resend = {d.base_version for d in store.dispatches(run_id)
              if d.status in ("in_flight", "cancelled", "lost", "timeout") and d.error != "round_closed"}
    pending = {u.base_version for u, _ in store.pending_updates(run_id)}
    return {run.current_version} | ckpt | resend | pending


@pytest.mark.parametrize("strategy,every,point", [("fedbuff", 0, ("record_reply", 9, False)),
                                                  ("fedasync", 3, ("record_reply", 6, False)),
                                                  ("fedavg", 2, ("record_dispatches", 4, False))])
def test_retention_keeps_only_what_is_needed_and_resume_is_unchanged(tmp_path, tmp_path_factory, strategy,
                                                                     every, point):
    """Parameters are kept for the latest version, the checkpoints and the versions live tasks or
    the buffer refer to, no more (every version keeps its row); a run killed and resumed under
    retention ends exactly as the run that keeps every version (checkpoint_every: 1)."""
    ref = reference(make_cfg(strategy, store={"checkpoint_every": 1}), tmp_path_factory)
    cfg = make_cfg(strategy, store={"checkpoint_every": every})
    store, run_id = crashed_run(cfg, tmp_path / "s.db", point)
    kept = _kept(store, run_id)
    assert kept >= _needed(store, run_id, every)
    assert len(kept - _needed(store, run_id, every)) <= 1  # at most the one a commit in flight would drop
    summary = AsyncServer(cfg, LocalTransport(), store, resume_run_id=run_id).run()
    check_invariants(store, summary)
    assert_same_run(summary, ref)
    assert _kept(store, run_id) == _needed(store, run_id, every)
    assert len(store.versions(run_id)) == summary["versions"] + 1  # every version keeps its row


def test_average_last_evaluates_the_mean_of_the_last_versions_and_resumes(tmp_path, tmp_path_factory):
    """server.average_last: 3 trains exactly the run of average_last 1 (the same model, version for
    version) but evaluates the mean of the last three versions; retention keeps those three, and a
    run killed and resumed ends as the uninterrupted one."""
    from fedasync.server.params import params_mean

    plain = reference(make_cfg("fedbuff", store={"checkpoint_every": 1}), tmp_path_factory)
    cfg1 = make_cfg("fedbuff", server={"average_last": 3}, store={"checkpoint_every": 1})
    store = store_at(tmp_path / "every.db")
    srv = AsyncServer(cfg1, LocalTransport(), store)
    ref = srv.run()
    assert ref["model_sha256"] == plain["model_sha256"]  # training is untouched
    assert [h["loss"] for h in ref["history"][1:]] != [h["loss"] for h in plain["history"][1:]]  # v0 alike
    for h in ref["history"]:
        v = h["version"]
        mean = params_mean([store.load_version(ref["run_id"], u)[1] for u in range(max(0, v - 2), v + 1)])
        assert srv.evaluator(mean) == {"accuracy": h["accuracy"], "loss": h["loss"]}

    cfg = make_cfg("fedbuff", server={"average_last": 3}, store={"checkpoint_every": 0})
    store, run_id = crashed_run(cfg, tmp_path / "s.db", ("record_reply", 9, False))
    cur = store.get_run(run_id).current_version
    assert cur == 2 and _kept(store, run_id) >= _needed(store, run_id, 0) | {0, 1, 2}
    summary = AsyncServer(cfg, LocalTransport(), store, resume_run_id=run_id).run()
    check_invariants(store, summary)
    assert_same_run(summary, ref)
    last = summary["versions"]
    assert _kept(store, run_id) == _needed(store, run_id, 0) | {last - 2, last - 1, last}


def _named_files(store: Store, run_id: int) -> set[str]:
    from fedasync.store.blobs import is_marker

    blobs = [v.parameters for v in store.versions(run_id)] + [u.pending_params for u in store.updates(run_id)]
    return {b[4:].decode() for b in blobs if is_marker(b)}


@pytest.mark.parametrize("strategy,point", [("fedbuff", ("record_reply", 5, True)),
                                            ("fedbuff", ("record_reply", 9, False)),
                                            ("fedasync", ("record_reply", 6, False))])
def test_crash_with_parameters_in_files_then_resume(tmp_path, tmp_path_factory, monkeypatch, strategy, point):
    """Every parameter blob in a file beside the database (threshold 0): a crash anywhere and a
    resume still end as the uninterrupted run, and afterwards the files are exactly those the
    rows name (the crash's leftovers swept, retention's deletions done)."""
    ref = reference(make_cfg(strategy, store={"checkpoint_every": 1}), tmp_path_factory)
    monkeypatch.setattr("fedasync.store.store.EXTERNAL_MIN_BYTES", 0)
    cfg = make_cfg(strategy, store={"checkpoint_every": 0})
    store, run_id = crashed_run(cfg, tmp_path / "s.db", point)
    files = tmp_path / "s.db-params"
    (files / f"r{run_id}-u999").write_bytes(b"left by a crash")
    summary = AsyncServer(cfg, LocalTransport(), store, resume_run_id=run_id).run()
    check_invariants(store, summary)
    assert_same_run(summary, ref)
    on_disk = {p.name for p in files.iterdir()}
    assert on_disk == _named_files(store, run_id) == {f"r{run_id}-v{v}" for v in _kept(store, run_id)}


def test_resume_without_stored_parameters_fails_clearly(tmp_path):
    cfg = make_cfg("fedasync", store={"save_parameters": False}, server={"max_versions": 2})
    store = store_at(tmp_path / "s.db")
    first = AsyncServer(cfg, LocalTransport(), store).run()
    with pytest.raises(RuntimeError, match="save_parameters"):
        AsyncServer(cfg, LocalTransport(), store, resume_run_id=first["run_id"])


# -- real processes: kill -9 and SIGINT of `fedasync simulate` ----------------------------


def _slow_cfg_file(tmp_path: Path, **extra) -> Path:
    # emulate: each task really sleeps (about 60 ms), so that the process can be hit mid-run
    cfg = make_cfg("fedbuff", server={"max_versions": 12}, clock={"emulate": True, "time_scale": 0.2}, **extra)
    path = tmp_path / "slow.yaml"
    path.write_text(cfg.to_yaml())
    return path


def _start_simulate(args: list[str], log: Path) -> subprocess.Popen:
    f = open(log, "wb")
    p = subprocess.Popen([FEDASYNC, "simulate", "--backend", "local", *args], stdout=f, stderr=subprocess.STDOUT,
                         stdin=subprocess.DEVNULL, start_new_session=True)
    f.close()
    return p


def _wait_for_version(db: Path, version: int, proc: subprocess.Popen, log: Path, timeout: float = 180) -> None:
    t0 = time.monotonic()
    store = None
    while time.monotonic() - t0 < timeout:
        if proc.poll() is not None:
            raise AssertionError(f"simulate exited early ({proc.returncode}):\n{log.read_text()[-2000:]}")
        if store is None and db.exists():
            try:
                store = Store(f"sqlite:///{db}", create=False)
            except Exception:
                store = None
        if store is not None:
            try:
                if store.get_run(1).current_version >= version:
                    return
            except Exception:
                pass
        time.sleep(0.05)
    raise AssertionError(f"version {version} not reached:\n{log.read_text()[-2000:]}")


@pytest.fixture(scope="module")
def slow_reference(tmp_path_factory):
    d = tmp_path_factory.mktemp("slowref")
    cfg = config_from_dict(yaml.safe_load(_slow_cfg_file(d).read_text()))
    cfg = cfg.model_copy(update={"clock": cfg.clock.model_copy(update={"emulate": False})})
    return AsyncServer(cfg, LocalTransport(), store_at(d / "ref.db")).run()


def _stop(p: subprocess.Popen) -> None:
    if p.poll() is None:
        p.kill()
        p.wait(timeout=10)


def test_sigkill_mid_run_then_resume(tmp_path, slow_reference):
    cfg_file, out = _slow_cfg_file(tmp_path), tmp_path / "run"
    db = out / "fedasync.db"
    p = _start_simulate([str(cfg_file), "--out", str(out)], tmp_path / "first.log")
    try:
        _wait_for_version(db, 4, p, tmp_path / "first.log")
        os.kill(p.pid, signal.SIGKILL)
        p.wait(timeout=30)
    finally:
        _stop(p)
    store = Store(f"sqlite:///{db}", create=False)
    run = store.get_run(1)
    assert run.status == "running" and 4 <= run.current_version < 12
    assert not (out / "summary.json").exists()
    r = subprocess.run([FEDASYNC, "simulate", "--backend", "local", "--resume", "1", "--out", str(out)],
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    summary = json.loads((out / "summary.json").read_text())
    check_invariants(Store(f"sqlite:///{db}", create=False), summary)
    assert_same_run(summary, slow_reference)


def test_sigint_stops_gracefully_then_resume(tmp_path, slow_reference):
    cfg_file, out = _slow_cfg_file(tmp_path), tmp_path / "run"
    db = out / "fedasync.db"
    p = _start_simulate([str(cfg_file), "--out", str(out)], tmp_path / "first.log")
    try:
        _wait_for_version(db, 3, p, tmp_path / "first.log")
        os.kill(p.pid, signal.SIGINT)
        rc = p.wait(timeout=120)
    finally:
        _stop(p)
    assert rc == 0, (tmp_path / "first.log").read_text()[-2000:]
    assert "continue with --resume 1" in (tmp_path / "first.log").read_text()
    store = Store(f"sqlite:///{db}", create=False)
    run = store.get_run(1)
    assert (run.status, run.stop_reason) == ("stopped", "interrupted")
    stopped = json.loads((out / "summary.json").read_text())
    assert stopped["stop_reason"] == "interrupted" and stopped["versions"] < 12
    check_invariants(store, stopped)  # a graceful stop leaves the summary equal to the store
    assert store.dispatch_status_counts(1).get("cancelled", 0) > 0
    r = subprocess.run([FEDASYNC, "simulate", "--backend", "local", "--resume", "1", "--out", str(out)],
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    summary = json.loads((out / "summary.json").read_text())
    check_invariants(Store(f"sqlite:///{db}", create=False), summary)
    for k in ("versions", "model_sha256", "updates_received", "updates_accepted", "rejections"):
        assert summary[k] == slow_reference[k], k


def _big_model() -> str:
    """``fedavg_cnn`` (McMahan et al. 2017) where the model registry has it, else ``cnn``."""
    from fedasync.config import ConfigError

    try:
        make_cfg("fedbuff", model={"name": "fedavg_cnn"})
        return "fedavg_cnn"
    except ConfigError:
        return "cnn"


def test_sigkill_a_cnn_run_with_retention_then_resume(tmp_path):
    """kill -9 of a CNN run that keeps only the latest version's parameters (checkpoint_every: 0),
    then --resume: the same model as the run never interrupted."""
    extra = {"model": {"name": _big_model()}, "store": {"checkpoint_every": 0}}
    cfg_file, out = _slow_cfg_file(tmp_path, **extra), tmp_path / "run"
    cfg = config_from_dict(yaml.safe_load(cfg_file.read_text()))
    ref = AsyncServer(cfg.model_copy(update={"clock": cfg.clock.model_copy(update={"emulate": False})}),
                      LocalTransport(), store_at(tmp_path / "ref.db")).run()
    db = out / "fedasync.db"
    p = _start_simulate([str(cfg_file), "--out", str(out)], tmp_path / "first.log")
    try:
        _wait_for_version(db, 5, p, tmp_path / "first.log")
        os.kill(p.pid, signal.SIGKILL)
        p.wait(timeout=30)
    finally:
        _stop(p)
    store = Store(f"sqlite:///{db}", create=False)
    assert store.get_run(1).status == "running" and store.get_run(1).current_version < 12
    assert _kept(store, 1) - _needed(store, 1, 0) <= {store.get_run(1).current_version - 1}
    r = subprocess.run([FEDASYNC, "simulate", "--backend", "local", "--resume", "1", "--out", str(out)],
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    summary = json.loads((out / "summary.json").read_text())
    check_invariants(Store(f"sqlite:///{db}", create=False), summary)
    assert_same_run(summary, ref)
    assert _kept(store, 1) == _needed(store, 1, 0)


def test_simulate_resume_checks_its_inputs(tmp_path):
    from typer.testing import CliRunner

    from fedasync.cli import app

    runner = CliRunner()
    r = runner.invoke(app, ["simulate", "--backend", "local", "--resume", "1"])
    assert r.exit_code == 2 and "--resume: give --out" in r.output
    r = runner.invoke(app, ["simulate", "--backend", "local", "--resume", "1", "--out", str(tmp_path)])
    assert r.exit_code == 2 and "no store at" in r.output
    Store(f"sqlite:///{tmp_path / 'fedasync.db'}")
    r = runner.invoke(app, ["simulate", "--backend", "local", "--resume", "3", "--out", str(tmp_path)])
    assert r.exit_code == 2 and "no run 3" in r.output


def test_deployment_stop_request_through_the_store(tmp_path):
    """`fedasync server`'s Ctrl-C sets the run's status to `stopping`; the ServerApp (another
    process) stops after the reply being handled and marks the run stopped."""
    from fedasync.clients.runner import handle_train

    cfg = make_cfg("fedasync", server={"max_versions": 1000, "poll_interval": 0.01})
    store = store_at(tmp_path / "s.db")
    calls = []

    def handler(params, config):
        calls.append(config["task_id"])
        if len(calls) == 5:
            store_at(tmp_path / "s.db").set_run_status(config["run_id"], "stopping")
        return handle_train(params, config)

    summary = AsyncServer(cfg, LocalTransport(handler), store, clock="wall", mode="deployment").run()
    assert summary["stop_reason"] == "interrupted" and summary["versions"] < 1000
    run = store.get_run(summary["run_id"])
    assert (run.status, run.stop_reason) == ("stopped", "interrupted")
    check_invariants(store, summary)


@pytest.mark.parametrize("clock", ["wall", "virtual"])
def test_an_abrupt_stop_after_an_uncommitted_version_keeps_the_stored_one_resumable(tmp_path, clock):
    # a second Ctrl-C lands between the loop making a version and recording the reply that made
    # it: the run must end with the store's current version (its parameters kept, the summary's
    # model that one), and resume
    cfg = make_cfg("fedasync", store={"checkpoint_every": 0}, server={"poll_interval": 0.01})
    store = store_at(tmp_path / "s.db")
    server = AsyncServer(cfg, LocalTransport(), store, clock=clock,
                         mode="deployment" if clock == "wall" else "simulation")
    orig, calls = server.policy.on_reply, [0]

    def on_reply(*a, **k):  # called in _take after the new version, before record_reply
        calls[0] += 1
        if calls[0] == 6:
            raise KeyboardInterrupt
        return orig(*a, **k)

    server.policy.on_reply = on_reply
    summary = server.run()
    assert summary["stop_reason"] == "interrupted"
    store2 = store_at(tmp_path / "s.db")
    run = store2.get_run(server.run_id)
    assert summary["versions"] == run.current_version
    assert run.current_version in store2.versions_with_parameters(server.run_id)
    assert summary["model_sha256"] == store2.versions(server.run_id)[-1].sha256
    check_invariants(store2, summary)
    AsyncServer(cfg, LocalTransport(), store2, clock=clock, mode="deployment" if clock == "wall" else "simulation",
                resume_run_id=server.run_id)  # resumable


def test_a_kill_right_after_the_target_is_reached_keeps_time_to_target(tmp_path):
    # time_to_target is set by the evaluation after the step's loop state was written: a kill
    # before the next write must not lose it (the resume recomputes it from the stored accuracies)
    cfg = make_cfg("fedasync", server={"max_versions": 40, "eval_every": 1, "target_accuracy": 0.5,
                                       "stop_at_target": True}, train={"local_steps": 20, "batch_size": 16, "lr": 0.2})
    ref = AsyncServer(cfg, LocalTransport(), store_at(tmp_path / "ref.db")).run()
    assert ref["stop_reason"] == "target_accuracy" and ref["time_to_target_s"] is not None
    store = store_at(tmp_path / "c.db")
    crash_at(store, "mark_in_flight", 1, True)  # after the target step committed, before _finish writes
    server = AsyncServer(cfg, LocalTransport(), store)
    with pytest.raises(Crash):
        server.run()
    out = AsyncServer(cfg, LocalTransport(), store_at(tmp_path / "c.db"), resume_run_id=server.run_id).run()
    for k in ("stop_reason", "versions", "time_to_target_s", "model_sha256"):
        assert out[k] == ref[k], k


@pytest.mark.parametrize("name", ["uniform", "fair", "fastest", "staleness_aware", "budget_aware"])
def test_the_scheduler_state_is_a_snapshot_plus_the_clients_touched_since(name):
    """The loop state carries the scheduler's per-client entries of the clients touched since the
    last snapshot (``runs.scheduler_state``), not all of them (10,000 clients' JSON cost ~45 ms,
    twice per update): snapshot plus changes is the scheduler's state_dict exactly (the observed
    durations in insertion order, which a resumed mean is summed in), at every step."""
    from types import SimpleNamespace

    from fedasync.server.resume import PER_CLIENT, loop_state, scheduler_state
    from fedasync.server.scheduler import make_scheduler

    rng = np.random.default_rng(7)
    sched = make_scheduler(name, 3)
    touched: set[int] = set()
    srv = SimpleNamespace(strategy=SimpleNamespace(settled_state=lambda: None), _strategy_snapshot={},
                          version=0, rejections={}, _scheduler_snap=None,
                          scheduler=sched, policy=SimpleNamespace(touched=touched, state_dict=dict),
                          clock=SimpleNamespace(now=0.0), exhausted=set(), time_to_target=None,
                          liveness=SimpleNamespace(state_dict=dict))
    n, snapshots, sizes, column = 400, 0, [], None
    for step in range(3000):
        c = int(rng.integers(n))
        kind = rng.integers(4)
        if kind == 0:
            sched.on_dispatch(c, float(step), step // 3)
        elif kind == 1:
            sched.on_reply(c, float(rng.exponential(2.0)), int(rng.integers(5)))
        elif kind == 2:
            sched.on_failure(c, float(rng.exponential(2.0)))
        elif hasattr(sched, "observe_budget"):
            sched.observe_budget(c, None if rng.random() < 0.1 else float(rng.random()), bool(rng.random() < 0.9))
        touched.add(c)
        if step % 7:
            continue
        text = loop_state(srv)
        if text.scheduler_state is not None:  # written with this loop state, in its transaction
            column, snapshots = text.scheduler_state, snapshots + 1
        saved = loads_state(str(text))["scheduler"]
        sizes.append(sum(len(v) for v in saved["changes"].values()))
        got, want = scheduler_state(saved, column), sched.state_dict()
        for k in PER_CLIENT:
            if k in want:  # the durations in the same order; the others are sorted by state_dict
                assert (got[k] if k.startswith("dur_") else sorted(got[k])) == want[k], (step, k)
        assert {k: v for k, v in got.items() if k not in PER_CLIENT} == \
            {k: v for k, v in want.items() if k not in PER_CLIENT}
        assert set(got) == set(want)
    if name != "uniform":
        assert snapshots > 3 and max(sizes) < 3 * 2 * n ** 0.5 + 8  # a few snapshots; the changes stay small
    with pytest.raises(RuntimeError, match="inconsistent"):
        scheduler_state(dict(saved, snapshot=saved["snapshot"] + 1), column)
