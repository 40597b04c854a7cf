"""A malicious update cannot stall a run (issue 32).

Before: a finite but huge update times a ``server_lr`` above 1 overflowed the model to inf and
the loop committed it; from then on every honest reply (the model plus a small step) was
``non_finite`` and a run bounded only by ``max_versions`` never ended. Now every new version is
checked finite before it is committed: the updates that made it are rejected
``non_finite_model``, the previous version and the strategy's state stay, and the run goes on.
And a run where no update is accepted for ``server.max_rejected_in_a_row`` replies in a row stops
with ``no_progress``. In-process loops (virtual clock, SQLite in tmp, a 4-client MLP); each run
here is bounded by ``max_virtual_time`` too, so that the code before the fix ends (and fails)."""

from __future__ import annotations

import logging
from collections import Counter

import numpy as np
import pytest

from fedasync.config import ConfigError, config_from_dict
from fedasync.server.loop import AsyncServer
from fedasync.server.transport import LocalTransport
from fedasync.store import Store

pytestmark = [pytest.mark.usefixtures("one_thread"),
              pytest.mark.filterwarnings("ignore::PendingDeprecationWarning", "ignore::RuntimeWarning")]
F = np.float32
BAD = 3
HUGE = F(3e38)  # finite in float32 (max 3.4e38); ten times it is not


def _cfg(strategy="fedbuff", **server):
    s = {"strategy": strategy, "concurrency": 2, "eval_every": 1000, "max_versions": 6,
         **({"buffer_size": 2} if strategy == "fedbuff" else {}),
         "max_virtual_time": 500.0, **server}
    if strategy == "fedavg":
        s.setdefault("clients_per_round", 2)
        s.setdefault("backup_workers", 1)
        s["concurrency"] = 3
    return config_from_dict({"name": "liveness", "seed": 3,
                             "data": {"dataset": "digits", "num_clients": 4, "partitioner": "iid"},
                             "model": {"name": "mlp", "hidden": 4}, "train": {"local_steps": 1, "batch_size": 8},
                             "server": s, "clock": {"sigma": 0.0, "jitter": 0.0, "bandwidth_sigma": 0.0}})


def honest(params, config):
    rng = np.random.default_rng(config["seed"])
    return {"params": {k: (v + rng.standard_normal(v.shape).astype(v.dtype) * F(0.01)).astype(v.dtype)
                       for k, v in params.items()},
            "metrics": {"num_examples": 10, "loss": 0.5}}


def huge(params, config):
    """A finite reply whose every value is 3e38: valid, but 10 x its delta overflows float32."""
    return {"params": {k: np.full_like(v, HUGE) for k, v in params.items()}, "metrics": {"num_examples": 10}}


def nan(params, config):
    p = {k: v.copy() for k, v in params.items()}
    next(iter(p.values())).flat[0] = np.nan
    return {"params": p, "metrics": {"num_examples": 10}}


def handler(bad=lambda tid: tid == BAD, reply=huge):
    return lambda params, config: (reply if bad(config["task_id"]) else honest)(params, config)


def _finite(params) -> bool:
    return all(bool(np.isfinite(a).all()) for a in params.values())


def _run(db, cfg, fn, **kw):
    store = Store(f"sqlite:///{db}")
    server = AsyncServer(cfg, LocalTransport(fn), store, **kw)
    server.evals.record = lambda at: None
    return server, server.run(), store


def _consistent(store, summary):
    """The summary's counts are the store's, and no rejected update is pending or applied."""
    ups = store.updates(summary["run_id"])
    assert summary["updates_received"] == len(ups)
    assert summary["updates_accepted"] == sum(u.accepted for u in ups)
    assert summary["rejections"] == dict(sorted(Counter(u.reason for u in ups if not u.accepted).items()))
    assert all(u.pending_params is None and u.applied_in_version is None for u in ups if not u.accepted)
    versions = store.versions(summary["run_id"])
    assert [v.version for v in versions] == list(range(summary["versions"] + 1))
    assert summary["model_sha256"] == versions[-1].sha256
    return ups


def test_an_overflowing_fedbuff_aggregation_is_rejected_and_the_run_goes_on(tmp_path):
    """fedbuff, server_lr 10: task 3's finite reply of 3e38 makes the aggregate overflow."""
    cfg = _cfg("fedbuff", server_lr=10.0)
    server, summary, store = _run(tmp_path / "s.db", cfg, handler())
    assert _finite(server.params)
    assert summary["stop_reason"] == "max_versions" and summary["versions"] == 6
    ups = {u.task_id: u for u in _consistent(store, summary)}
    dropped = sorted(t for t, u in ups.items() if u.reason == "non_finite_model")
    assert BAD in dropped and len(dropped) == cfg.server.buffer_size  # the buffer that made it, whole
    assert not any(ups[t].accepted for t in dropped)
    assert summary["rejections"] == {"non_finite_model": 2}
    for v in store.versions(summary["run_id"]):  # every committed version is finite
        if v.parameters is not None:
            assert _finite(store.load_version(summary["run_id"], v.version)[1])
    # the rejected updates are in no version; the run took the same number of accepted ones as versions need
    assert sum(u.accepted for u in ups.values()) == 6 * cfg.server.buffer_size


def _inf_when(server, bad=BAD):
    """Make the strategy's aggregation overflow whenever task ``bad`` is in it (as a huge update
    would under a strategy whose arithmetic cannot overflow on its own: a convex combination)."""
    orig = server.strategy.add

    def add(model, upd, version):
        new = orig(model, upd, version)
        if new is not None and bad in server.strategy.last_aggregated():
            new = {k: np.full_like(v, np.inf) for k, v in new.items()}
        return new

    server.strategy.add = add


@pytest.mark.parametrize("strategy", ["fedasync", "fedbuff", "fedavg"])
def test_a_non_finite_model_is_never_committed_under_every_strategy(tmp_path, strategy):
    cfg = _cfg(strategy)
    store = Store(f"sqlite:///{tmp_path / 's.db'}")
    server = AsyncServer(cfg, LocalTransport(handler(reply=honest)), store)
    server.evals.record = lambda at: None
    _inf_when(server)
    summary = server.run()
    assert _finite(server.params)
    assert summary["stop_reason"] == "max_versions" and summary["versions"] >= 6  # (replies due at one instant)
    ups = {u.task_id: u for u in _consistent(store, summary)}
    dropped = sorted(t for t, u in ups.items() if u.reason == "non_finite_model")
    # fedasync: that update; fedbuff: the buffer (K = 2); fedavg: the round (m = 2)
    assert BAD in dropped and len(dropped) == (1 if strategy == "fedasync" else 2)
    assert server.strategy.pending() == [] or set(server.strategy.pending()).isdisjoint(dropped)


def test_fedavg_reopens_a_discarded_round():
    """The strategy alone: the round's updates leave with the discarded model, its version is open
    again (a later update of the same base version is taken), and ``last_aggregated`` is as before."""
    from fedasync.server.strategies import FedAvg, Update

    s = FedAvg(clients_per_round=2)
    x = {"w": np.zeros(3, F)}

    def upd(t, v=0):
        return Update(task_id=t, client_id=t, params={"w": np.full(3, F(t))}, base_params=x, base_version=v,
                      staleness=0, num_examples=1)

    assert s.add(x, upd(0), 0) is None
    before = s.undo_state()
    assert s.add(x, upd(1), 0) is not None and s.check(upd(2), 0) == "round_closed"
    s.discard(before)
    assert s.pending() == [] and s.last_aggregated() == [] and s.check(upd(2), 0) is None
    assert s.add(x, upd(2), 0) is None and s.pending() == [2]


def test_a_run_that_accepts_nothing_stops_with_no_progress(tmp_path, caplog):
    cfg = _cfg("fedasync", max_rejected_in_a_row=5, max_virtual_time=10_000.0, max_versions=None)
    with caplog.at_level(logging.ERROR, logger="fedasync"):
        server, summary, store = _run(tmp_path / "s.db", cfg, handler(bad=lambda t: True, reply=nan))
    assert summary["stop_reason"] == "no_progress"
    assert summary["versions"] == 0 and summary["updates_accepted"] == 0
    assert 5 <= summary["updates_received"] < 5 + cfg.server.concurrency  # the replies due at that instant
    assert store.get_run(summary["run_id"]).stop_reason == "no_progress"
    lines = [r.getMessage() for r in caplog.records if "max_rejected_in_a_row" in r.getMessage()]
    assert len(lines) == 1 and "no_progress" in lines[0] and f"last {summary['updates_received']} replies" in lines[0]


def test_a_run_whose_every_aggregation_overflows_stops_with_no_progress(tmp_path):
    """Every reply is huge: each buffered one is accepted on arrival, then rejected with the buffer.
    Those later-rejected updates do not count as accepted: the run stops (it ran until the virtual
    time limit when they reset the count)."""
    cfg = _cfg("fedbuff", server_lr=10.0, max_rejected_in_a_row=5, max_virtual_time=10_000.0, max_versions=None)
    server, summary, store = _run(tmp_path / "s.db", cfg, handler(bad=lambda t: True))
    assert summary["stop_reason"] == "no_progress" and summary["versions"] == 0
    assert summary["updates_accepted"] == 0 and _finite(server.params)
    assert 5 <= summary["updates_received"] < 5 + cfg.server.buffer_size + cfg.server.concurrency
    assert set(summary["rejections"]) == {"non_finite_model"}


def test_an_accepted_update_resets_the_count(tmp_path):
    """Two bad replies in three, never three in a row: a limit of 3 never stops the run."""
    cfg = _cfg("fedasync", concurrency=1, max_rejected_in_a_row=3)
    server, summary, store = _run(tmp_path / "s.db", cfg, handler(bad=lambda t: t % 3 != 0, reply=nan))
    assert summary["stop_reason"] == "max_versions"
    assert summary["rejections"] == {"non_finite": 10}  # tasks 1, 2, 4, 5, ... 14; 0, 3, ... 15 accepted


def test_the_default_and_bad_values_of_the_limit():
    assert _cfg().server.max_rejected_in_a_row == 1000
    assert _cfg(max_rejected_in_a_row=0).server.max_rejected_in_a_row == 0  # off
    assert _cfg(max_rejected_in_a_row=None).server.max_rejected_in_a_row is None  # off
    for bad in (-1, 2.5, "many"):
        with pytest.raises(ConfigError, match="server.max_rejected_in_a_row"):
            _cfg(max_rejected_in_a_row=bad)


# -- resume ---------------------------------------------------------------------------------


class Crash(BaseException):
    """Stands for the process dying."""


def _crash_on(store, n, before):
    orig = store.record_reply
    calls = [0]

    def wrapper(*a, **k):
        calls[0] += 1
        if calls[0] == n and before:
            raise Crash()
        out = orig(*a, **k)
        if calls[0] == n:
            raise Crash()
        return out

    store.record_reply = wrapper


SAME = ("versions", "updates_received", "updates_accepted", "rejections", "staleness", "model_sha256",
        "virtual_time_s", "stop_reason")


@pytest.mark.parametrize("n,before", [(3, True), (4, False), (5, False)])
def test_a_resumed_run_drops_the_same_aggregation_and_ends_the_same(tmp_path, n, before):
    """A crash before or after the reply whose aggregation was discarded (task 3's: the 4th reply
    at concurrency 1), and after the next: the resumed run ends with the uninterrupted run's model
    and counts (the rejected buffered update is not re-added from the store)."""
    cfg = _cfg("fedbuff", server_lr=10.0, concurrency=1)
    _, ref, _ = _run(tmp_path / "ref.db", cfg, handler())
    assert ref["rejections"] == {"non_finite_model": 2}
    db = tmp_path / "s.db"
    store = Store(f"sqlite:///{db}")
    _crash_on(store, n, before)
    server = AsyncServer(cfg, LocalTransport(handler()), store)
    server.evals.record = lambda at: None
    with pytest.raises(Crash):
        server.run()
    _, summary, store2 = _run(db, cfg, handler(), resume_run_id=server.run_id)
    _consistent(store2, summary)
    for k in SAME:
        assert summary[k] == ref[k], k


@pytest.mark.parametrize("strategy,reply,crash", [("fedasync", nan, 5), ("fedbuff", huge, 4), ("fedbuff", huge, 5)])
def test_the_count_of_rejections_in_a_row_survives_a_resume(tmp_path, strategy, reply, crash):
    """fedasync: NaN replies from task 2 on; fedbuff (K = 2, server_lr 10): huge ones, each pair
    accepted then discarded together. A crash in the middle: the resumed run stops at the same reply."""
    cfg = _cfg(strategy, concurrency=1, max_rejected_in_a_row=6, max_versions=None,
               **({"server_lr": 10.0} if strategy == "fedbuff" else {}))
    fn = handler(bad=lambda t: t >= 2, reply=reply)
    _, ref, _ = _run(tmp_path / "ref.db", cfg, fn)
    assert ref["stop_reason"] == "no_progress" and ref["updates_received"] == 2 + 6
    db = tmp_path / "s.db"
    store = Store(f"sqlite:///{db}")
    _crash_on(store, crash, False)  # after the 2nd or 3rd bad reply
    server = AsyncServer(cfg, LocalTransport(fn), store)
    server.evals.record = lambda at: None
    with pytest.raises(Crash):
        server.run()
    _, summary, _ = _run(db, cfg, fn, resume_run_id=server.run_id)
    assert summary["stop_reason"] == "no_progress" and summary["updates_received"] == ref["updates_received"]
