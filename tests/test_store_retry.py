"""The store rides out a database that goes away (issue 12 §3): a transaction that fails on a
lost connection is retried whole with bounded, logged backoff; nothing is lost or doubled.

The disconnects here are injected into SQLite (a driver error SQLAlchemy recognises as a lost
connection); ``test_postgres_restart_mid_run`` restarts the CI's PostgreSQL under a run.
"""

from __future__ import annotations

import logging
import os
import shlex
import shutil
import sqlite3
import subprocess
import threading
import time
import uuid
from pathlib import Path

import pytest
from sqlalchemy import create_engine, event, text
from sqlalchemy.exc import IntegrityError, OperationalError

from conftest import small_config
from fedasync.server.loop import AsyncServer
from fedasync.server.transport import LocalTransport
from fedasync.store import Store
from fedasync.store import retry as R


@pytest.fixture
def fake_clock(monkeypatch):
    """The retry module's clock and sleep, virtual: the pauses are recorded, never slept."""
    state = {"t": 0.0, "pauses": []}

    def sleep(s):
        state["pauses"].append(s)
        state["t"] += s

    monkeypatch.setattr(R, "now", lambda: state["t"])
    monkeypatch.setattr(R, "sleep", sleep)
    return state


class Disconnects:
    """Make the next ``n`` SQL statements matching ``when`` fail as a lost connection would."""

    def __init__(self, engine, n: int, when=lambda stmt: True):
        self.left, self.when, self.raised = n, when, 0
        event.listen(engine, "before_cursor_execute", self)

    def __call__(self, conn, cursor, statement, params, context, executemany):
        if self.left > 0 and self.when(statement):
            self.left -= 1
            self.raised += 1
            raise sqlite3.ProgrammingError("Cannot operate on a closed database.")  # a disconnect to SQLAlchemy


def _store(tmp_path, name="s") -> Store:
    return Store(f"sqlite:///{tmp_path / name}.db")


def _arm(store: Store, n: int, when=lambda stmt: True) -> Disconnects:
    # engine.dispose() between retries keeps the engine: listeners stay
    return Disconnects(store.engine, n, when)


def test_a_lost_connection_is_retried_with_doubling_pauses_and_logged(tmp_path, fake_clock, caplog):
    st = _store(tmp_path)
    inj = _arm(st, 4)
    with caplog.at_level(logging.WARNING, logger="fedasync"):
        rid = st.create_run("r", "fedbuff", 0, "{}", "simulation")
    assert inj.raised == 4
    assert fake_clock["pauses"] == [0.25, 0.5, 1.0, 2.0]
    assert [r.id for r in st.list_runs()] == [rid]  # exactly one run, not five
    msgs = [r.getMessage() for r in caplog.records]
    assert sum("create_run failed" in m and "retry" in m for m in msgs) == 4
    assert any("create_run succeeded after 4 retries" in m for m in msgs)


def test_pauses_are_capped(tmp_path, fake_clock):
    st = _store(tmp_path)
    _arm(st, 9)
    st.create_run("r", "fedbuff", 0, "{}", "simulation")
    assert fake_clock["pauses"] == [0.25, 0.5, 1.0, 2.0, 4.0, 8.0, 8.0, 8.0, 8.0]


def test_gives_up_after_retry_for_s_with_the_original_error(tmp_path, fake_clock, caplog):
    st = _store(tmp_path)
    st.retry_for_s = 10.0
    _arm(st, 1000)
    with caplog.at_level(logging.ERROR, logger="fedasync"), pytest.raises(Exception, match="closed database"):
        st.create_run("r", "fedbuff", 0, "{}", "simulation")
    assert sum(fake_clock["pauses"]) <= 10.0
    assert fake_clock["pauses"] == [0.25, 0.5, 1.0, 2.0, 4.0]  # the next 8 s pause would pass 10 s
    assert any("giving up" in r.getMessage() for r in caplog.records)


def test_retry_for_s_zero_means_no_retry(tmp_path, fake_clock):
    st = _store(tmp_path)
    st.retry_for_s = 0
    _arm(st, 1)
    with pytest.raises(Exception, match="closed database"):
        st.create_run("r", "fedbuff", 0, "{}", "simulation")
    assert fake_clock["pauses"] == []


def test_other_errors_are_raised_at_once(tmp_path, fake_clock):
    st = _store(tmp_path)
    rid = st.create_run("r", "fedbuff", 0, "{}", "simulation")
    st.add_initial_version(rid, None, "x", save=False)
    with pytest.raises(IntegrityError):  # a duplicate version 0: a bug, not an outage
        st.add_initial_version(rid, None, "x", save=False)
    with st.engine.begin() as c:
        c.execute(text("DROP TABLE replays"))
    with pytest.raises(OperationalError, match="no such table"):  # SQLite's OperationalError: setup error
        st.record_replay(rid, {"client_id": 1, "task_id": 5, "reason": "unknown_task"})
    assert fake_clock["pauses"] == []


def test_a_transaction_broken_halfway_is_rolled_back_and_done_once(tmp_path, fake_clock):
    """record_reply writes the update, the dispatch, the version, the run: the connection breaks
    at the run's UPDATE (after the update row was inserted); the retry writes everything once."""
    st = _store(tmp_path)
    rid = st.create_run("r", "fedbuff", 0, "{}", "simulation")
    st.add_initial_version(rid, None, "v0", save=False)
    st.record_dispatch(rid, 0, 3, 0, 0.0, 1.0, None, None)
    inj = _arm(st, 1, when=lambda s: s.startswith("UPDATE runs"))
    st.record_reply(rid, 0, {"client_id": 3, "base_version": 0, "version_at_arrival": 0, "staleness": 0,
                             "accepted": True, "received_virtual": 1.0, "num_examples": 10},
                    "accepted", {"version": 1, "parent": 0, "params": None, "sha256": "v1", "task_ids": [0]},
                    "{}", 1.0)
    assert inj.raised == 1 and fake_clock["pauses"] == [0.25]
    ups = st.updates(rid)
    assert len(ups) == 1 and ups[0].applied_in_version == 1
    assert [v.version for v in st.versions(rid)] == [0, 1]
    assert st.get_run(rid).current_version == 1
    assert st.dispatch_status_counts(rid) == {"accepted": 1}


def test_nested_store_calls_retry_once_at_the_outside(tmp_path, fake_clock):
    calls = []

    @R.retrying_transactions
    class Outer:
        url = "postgresql://x"

        def inner(self):
            calls.append("inner")
            raise OperationalError("SELECT 1", {}, Exception("server closed the connection"))

        def outer(self):
            calls.append("outer")
            if len(calls) < 4:
                return self.inner()
            return "ok"

    assert Outer().outer() == "ok"
    assert calls == ["outer", "inner", "outer", "inner", "outer"]
    assert fake_clock["pauses"] == [0.25, 0.5]


def test_what_counts_as_transient():
    op = OperationalError("SELECT 1", {}, Exception("connection refused"))
    assert R.is_transient(op, "postgresql+psycopg://h/db")
    assert not R.is_transient(op, "sqlite:///x.db")
    lost = OperationalError("SELECT 1", {}, Exception("x"), connection_invalidated=True)
    assert R.is_transient(lost, "sqlite:///x.db")
    assert not R.is_transient(IntegrityError("INSERT", {}, Exception("dup")), "postgresql://h/db")
    assert not R.is_transient(ValueError("x"), "postgresql://h/db")


def test_a_batch_broken_at_commit_time_is_retried_whole(tmp_path, fake_clock):
    """Store.batch (the loop's one transaction per step) runs its writes when the block ends,
    outside any public method: a lost connection there retries the whole batch, written once."""
    st = _store(tmp_path)
    rid = st.create_run("r", "fedbuff", 0, "{}", "simulation")
    st.add_initial_version(rid, None, "v0", save=False)
    inj = _arm(st, 1, when=lambda s: s.startswith("INSERT INTO dispatches"))
    with st.batch():
        st.record_dispatch(rid, 0, 3, 0, 0.0, 1.0, None, None)
        st.record_dispatch(rid, 1, 4, 0, 0.0, 2.0, None, None)
        assert inj.raised == 0  # nothing is executed before the block ends
    assert inj.raised == 1 and fake_clock["pauses"] == [0.25]
    assert st.dispatch_status_counts(rid) == {"in_flight": 2}


def test_a_run_with_disconnects_keeps_every_accepted_update(tmp_path, fake_clock, caplog):
    """The loop waits out a dozen lost connections spread over the run; the run ends exactly as
    an undisturbed one does (same model, same accepted updates)."""
    cfg = small_config("server.strategy=fedbuff")
    calm = AsyncServer(cfg, LocalTransport(), _store(tmp_path, "calm"), clock="virtual").run()
    st = _store(tmp_path, "rough")
    seen = {"n": 0}

    def every_seventh(stmt):
        seen["n"] += 1
        return seen["n"] % 7 == 0

    inj = _arm(st, 12, every_seventh)
    with caplog.at_level(logging.WARNING, logger="fedasync"):
        rough = AsyncServer(cfg, LocalTransport(), st, clock="virtual").run()
    assert inj.raised == 12
    assert rough["model_sha256"] == calm["model_sha256"]
    assert rough["versions"] == calm["versions"]
    assert rough["updates_received"] == calm["updates_received"]
    counts = st.counts(rough["run_id"])
    assert counts["accepted"] == calm["updates_received"] - calm["updates_rejected"]
    assert sum("retry" in r.getMessage() for r in caplog.records) == 12


# -- a real PostgreSQL restarted under a run (CI) ------------------------------------------

PG = os.environ.get("FEDASYNC_TEST_POSTGRES_URL")


def _pg_ctl() -> list[str]:
    """pg_ctl on the CI's cluster (.ci/postgres.sh: $FEDASYNC_PG_DIR, as user postgres when root)."""
    data = os.environ.get("FEDASYNC_PG_DIR", "/tmp/fedasync-pg")
    found = sorted(Path("/usr/lib/postgresql").glob("*/bin/pg_ctl"))
    exe = str(found[-1]) if found else shutil.which("pg_ctl")
    if exe is None or not (Path(data) / "PG_VERSION").exists():
        pytest.skip(f"no pg_ctl or no cluster in {data} (FEDASYNC_PG_DIR): cannot restart the server")
    as_ = ["runuser", "-u", "postgres", "--"] if os.geteuid() == 0 else []
    return [*as_, exe, "-D", data]


@pytest.mark.postgres
def test_postgres_restart_mid_run(tmp_path, caplog):
    """Stop the server at version 3, start it again 3 s later: the run waits, retries, and ends
    with the model and accepted updates of the same run on SQLite."""
    if not PG:
        pytest.skip("FEDASYNC_TEST_POSTGRES_URL is not set (source .ci/postgres.sh)")
    ctl = _pg_ctl()
    schema = f"t_{uuid.uuid4().hex[:12]}"
    admin = create_engine(PG, pool_pre_ping=True)  # its connection does not survive the restart
    with admin.begin() as c:
        c.execute(text(f"CREATE SCHEMA {schema}"))
    url = f"{PG}{'&' if '?' in PG else '?'}options=-csearch_path%3D{schema}"
    cfg = small_config("server.strategy=fedbuff", "server.max_versions=10", "server.eval_every=1")
    calm = AsyncServer(cfg, LocalTransport(), _store(tmp_path, "calm"), clock="virtual").run()
    st = Store(url)
    restarted = threading.Event()
    starter: list[threading.Thread] = []

    def progress(ev):
        if ev["version"] == 3 and not starter:
            # the options the server runs with (port, socket dir: .ci/postgres.sh), for the start
            argv = shlex.split((Path(ctl[-1]) / "postmaster.opts").read_text())[1:]
            i = argv.index("-D") if "-D" in argv else -1
            opts = " ".join(shlex.quote(a) for k, a in enumerate(argv) if k not in (i, i + 1))
            subprocess.run([*ctl, "stop", "-m", "fast", "-w"], check=True, capture_output=True)

            def start_later():
                time.sleep(3.0)
                subprocess.run([*ctl, "start", "-w", "-l", str(Path(ctl[-1]) / "server.log"), "-o", opts],
                               check=True, capture_output=True)
                restarted.set()

            starter.append(threading.Thread(target=start_later, daemon=True))
            starter[0].start()

    try:
        with caplog.at_level(logging.WARNING, logger="fedasync"):
            rough = AsyncServer(cfg, LocalTransport(), st, clock="virtual", progress=progress).run()
        assert starter and restarted.wait(60)
        assert any("retry" in r.getMessage() for r in caplog.records), "the server was never missed"
        assert any("succeeded after" in r.getMessage() for r in caplog.records)
        assert rough["model_sha256"] == calm["model_sha256"]
        assert rough["versions"] == calm["versions"]
        c = st.counts(rough["run_id"])
        assert c["accepted"] == calm["updates_received"] - calm["updates_rejected"]
        assert c["versions"] == calm["versions"] + 1  # version 0 too
    finally:
        if starter:
            starter[0].join(60)
        st.close()
        with admin.begin() as c:
            c.execute(text(f"DROP SCHEMA {schema} CASCADE"))
        admin.dispose()
