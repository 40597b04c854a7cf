"""The store on SQLite and on PostgreSQL: Alembic migrations, the Store API, atomicity.

The PostgreSQL cases need a server: ``FEDASYNC_TEST_POSTGRES_URL`` (``.ci/postgres.sh`` starts
one and exports it; CI always does). Without it they are skipped. Each PostgreSQL test runs in
its own schema (``search_path``), dropped afterwards.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import uuid

import numpy as np
import pytest
from sqlalchemy import create_engine, inspect, text
from sqlalchemy.exc import IntegrityError

from fedasync.store import Store, decode_params, encode_params
from fedasync.store import migrate

PG = os.environ.get("FEDASYNC_TEST_POSTGRES_URL")


@pytest.fixture(params=["sqlite", pytest.param("postgresql", marks=pytest.mark.postgres)])
def url(request, tmp_path):
    if request.param == "sqlite":
        yield f"sqlite:///{tmp_path / 'store.db'}"
        return
    if not PG:
        pytest.skip("FEDASYNC_TEST_POSTGRES_URL is not set (source .ci/postgres.sh)")
    schema = f"t_{uuid.uuid4().hex[:12]}"
    admin = create_engine(PG)
    with admin.begin() as c:
        c.execute(text(f"CREATE SCHEMA {schema}"))
    sep = "&" if "?" in PG else "?"
    try:
        yield f"{PG}{sep}options=-csearch_path%3D{schema}"
    finally:
        with admin.begin() as c:
            c.execute(text(f"DROP SCHEMA {schema} CASCADE"))
        admin.dispose()


def _tables(engine) -> set[str]:
    return set(inspect(engine).get_table_names())


# -- migrations -------------------------------------------------------------------------


def _table_of(diff) -> str | None:
    d = diff[0] if isinstance(diff, list) else diff
    op = d[0]
    if op in ("add_table", "remove_table"):
        return d[1].name
    if op in ("add_column", "remove_column") or op.startswith("modify_"):
        return d[2]
    table = getattr(d[1], "table", None)
    return None if table is None else table.name


def _diffs(url: str, module: str) -> list:
    """What differs between the migrated database and the ORM tables defined in ``module``."""
    import importlib

    from alembic.autogenerate import compare_metadata
    from alembic.runtime.migration import MigrationContext

    metadata = migrate.target_metadata()
    tables = {t.__table__.name for t in vars(importlib.import_module(module)).values()
              if isinstance(t, type) and hasattr(t, "__table__")}
    assert tables
    engine = create_engine(url)
    with engine.connect() as conn:
        diffs = compare_metadata(MigrationContext.configure(conn, opts={"compare_type": True}), metadata)
    engine.dispose()
    return [d for d in diffs if _table_of(d) in tables]


def _migrated(url: str) -> None:
    """Run the migrations only (no fallback create_all), as a fresh deployment would."""
    from alembic import command

    engine = create_engine(url)
    with engine.begin() as conn:
        cfg = migrate.alembic_config()
        cfg.attributes["connection"] = conn
        command.upgrade(cfg, "head")
    engine.dispose()


def test_migrations_create_the_core_schema_exactly(url):
    _migrated(url)
    assert _diffs(url, "fedasync.store.schema") == []
    engine = create_engine(url)
    with engine.connect() as conn:
        assert migrate.current(conn) == migrate.head()
    assert {"runs", "clients", "dispatches", "updates", "model_versions", "privacy_spend", "replays"} <= _tables(engine)
    engine.dispose()


def test_migrations_cover_every_other_schema_module(url):
    """Tables defined on the store's Base in other modules (server-less variants) need a revision."""
    import importlib

    _migrated(url)
    for name in migrate.SCHEMA_MODULES[1:]:
        try:
            importlib.import_module(name)
        except ModuleNotFoundError:
            continue
        assert _diffs(url, name) == [], f"{name}: the ORM and the migrations differ; add a revision"


def test_upgrade_is_idempotent_and_downgrade_reverses(url):
    engine = create_engine(url)
    migrate.upgrade(engine)
    migrate.upgrade(engine)
    before = _tables(engine)
    migrate.downgrade(engine, "base")
    assert _tables(engine) <= {"alembic_version"}
    migrate.upgrade(engine)
    assert _tables(engine) == before
    engine.dispose()


def test_a_store_made_before_migrations_is_stamped_and_upgraded(url):
    """fedasync 0.1.0 made its tables with create_all (the baseline) and had no alembic_version."""
    from alembic import command

    engine = create_engine(url)
    with engine.begin() as conn:
        cfg = migrate.alembic_config()
        cfg.attributes["connection"] = conn
        command.upgrade(cfg, migrate.BASELINE)
        conn.execute(text("DROP TABLE alembic_version"))
    assert "replays" not in _tables(engine)
    store = Store(url)
    store.create_run("old", "fedbuff", 0, "x: 1\n", "simulation")
    with engine.connect() as conn:
        assert migrate.current(conn) == migrate.head()
    assert "replays" in _tables(engine)
    engine.dispose()


def _open(url: str) -> int:
    Store(url).close()
    return 0


def test_concurrent_first_opens_migrate_once(url):
    ctx = mp.get_context("spawn")
    with ctx.Pool(4) as pool:
        assert pool.map(_open, [url] * 4) == [0] * 4
    engine = create_engine(url)
    with engine.connect() as conn:
        assert migrate.current(conn) == migrate.head()
        assert conn.execute(text("SELECT count(*) FROM alembic_version")).scalar() == 1
    engine.dispose()


# -- the Store API ------------------------------------------------------------------------


PARAMS = {"a.weight": np.arange(6, dtype=np.float32).reshape(2, 3), "a.bias": np.array([1.5, -2.0], np.float32),
          "steps": np.array([7], np.int64)}


def _run(store: Store) -> int:
    run = store.create_run("t", "fedbuff", 3, "name: t\n", "simulation")
    store.register_clients(run, [{"client_id": c, "profile": {"speed": 1.0 + c}} for c in range(3)])
    store.add_initial_version(run, PARAMS, "0" * 64)
    return run


def test_params_round_trip_exactly(url):
    store = Store(url)
    run = _run(store)
    v, p = store.load_version(run, 0)
    assert v == 0 and list(p) == list(PARAMS)
    for k in PARAMS:
        assert p[k].dtype == PARAMS[k].dtype and np.array_equal(p[k], PARAMS[k])
    assert encode_params(decode_params(encode_params(PARAMS))) == encode_params(PARAMS)


def test_the_store_format_keeps_shapes_dtypes_and_values_exactly():
    from fedasync.store.codec import pack_params, unpack_params

    odd = {"scalar": np.array(3.5), "empty": np.zeros((0, 4), np.int64),
           "strided": np.arange(10, dtype=np.float64)[::2], "fortran": np.asfortranarray(np.ones((2, 3), np.float16))}
    back = unpack_params(pack_params(odd))
    assert list(back) == list(odd)
    for k, a in odd.items():
        assert back[k].shape == a.shape and back[k].dtype == a.dtype and np.array_equal(back[k], a), k


def test_dispatch_reply_and_version_in_one_transaction(url):
    store = Store(url)
    run = _run(store)
    big_node = 2 ** 64 - 5  # Flower node ids are uint64
    store.record_dispatches(run, [
        {"task_id": 0, "client_id": 1, "base_version": 0, "sent_virtual": 0.0, "finish_virtual": 1.0,
         "node_id": big_node, "message_id": "m0"},
        {"task_id": 1, "client_id": 2, "base_version": 0, "sent_virtual": 0.0, "finish_virtual": 2.0,
         "node_id": None, "message_id": None, "status": "failed", "error": "push failed"},
    ], next_task_id=2, loop_state='{"s": 1}', virtual_time=0.0)
    r = store.get_run(run)
    assert (r.next_task_id, r.loop_state) == (2, '{"s": 1}')
    ds = store.dispatches(run)
    assert [(d.task_id, d.status, d.node_id) for d in ds] == [(0, "in_flight", str(big_node)), (1, "failed", None)]
    # re-sending a task (resume) updates its row, keeps one row per task
    store.record_dispatches(run, [{"task_id": 0, "client_id": 1, "base_version": 0, "sent_virtual": 0.0,
                                   "finish_virtual": 1.0, "node_id": 9, "message_id": "m0b"}], next_task_id=2)
    assert [(d.task_id, d.message_id) for d in store.dispatches(run)] == [(0, "m0b"), (1, None)]
    row = {"client_id": 1, "base_version": 0, "version_at_arrival": 0, "staleness": 0, "weight": 1.0,
           "num_examples": 10, "loss": 0.5, "epsilon": None, "params_sha256": "1" * 64, "accepted": True,
           "reason": None, "received_virtual": 1.0, "pending_params": PARAMS}
    store.record_reply(run, 0, row, "replied", None, '{"s": 2}', 1.0)
    pend = store.pending_updates(run)
    assert [u.task_id for u, _ in pend] == [0] and np.array_equal(pend[0][1]["a.weight"], PARAMS["a.weight"])
    new_version = {"version": 1, "parent": 0, "sha256": "2" * 64, "params": PARAMS, "task_ids": [0]}
    row2 = dict(row, pending_params=None, client_id=2)
    store.record_dispatches(run, [{"task_id": 2, "client_id": 2, "base_version": 0, "sent_virtual": 1.0,
                                   "finish_virtual": 3.0, "node_id": None, "message_id": "m2"}], next_task_id=3)
    store.record_reply(run, 2, row2, "late", new_version, '{"s": 3}', 3.0)
    r = store.get_run(run)
    assert (r.current_version, r.loop_state, r.virtual_time) == (1, '{"s": 3}', 3.0)
    ups = {u.task_id: u for u in store.updates(run)}
    assert ups[0].applied_in_version == 1 and ups[0].pending_params is None
    assert store.pending_updates(run) == []
    assert store.dispatch_status_counts(run) == {"replied": 1, "failed": 1, "late": 1}
    assert store.counts(run) == {"dispatches": 3, "updates": 2, "accepted": 2, "rejected": 0, "versions": 2}
    # a second reply for a closed task cannot enter `updates`: the whole transaction rolls back
    with pytest.raises(IntegrityError):
        store.record_reply(run, 2, row2, "replied", {"version": 2, "parent": 1, "sha256": "3" * 64,
                                                     "params": PARAMS, "task_ids": [2]}, '{"s": 4}', 4.0)
    r = store.get_run(run)
    assert (r.current_version, r.loop_state) == (1, '{"s": 3}')
    assert [v.version for v in store.versions(run)] == [0, 1]
    # ... it is recorded as a replay instead
    store.record_replay(run, {"task_id": 2, "client_id": 2, "message_id": "m2", "reason": "replay",
                              "params_sha256": "1" * 64, "received_virtual": 4.0})
    assert [(x.task_id, x.reason) for x in store.replays(run)] == [(2, "replay")]
    assert store.mark_in_flight(run, "cancelled") == 0


def blob_names(files) -> list[str]:
    """The parameter files a store names or may name (not the spares it keeps to write over)."""
    return sorted(p.name for p in files.iterdir() if p.name != ".spare")


def test_deleted_parameter_files_are_written_over_then_removed(tmp_path):
    """A buffered update's deleted blob file becomes a spare the next blob is written over (cut to
    its length: a smaller blob over a bigger spare reads back exactly); a version's is unlinked;
    at most SPARE_FILES are kept; close() and a resume's sweep delete them."""
    from fedasync.store import blobs as B

    bf = B.BlobFiles(tmp_path / "db-params")
    big, small = os.urandom(3000), os.urandom(1000)
    bf.put("r1-u0", [big[:1000], big[1000:]])
    bf.put("r1-u1", [big])
    bf.put("r1-v0", [big])
    bf.delete(["r1-v0"])  # not as a spare: unlinked
    assert not (tmp_path / "db-params" / "r1-v0").exists() and not (tmp_path / "db-params" / ".spare").exists()
    bf.delete(["r1-u0", "r1-u1", "r1-missing"], spare=True)
    spares = sorted((tmp_path / "db-params" / ".spare").iterdir())
    assert len(spares) == 2 and not (tmp_path / "db-params" / "r1-u0").exists()
    inode = {p.stat().st_ino for p in spares}
    assert bf.get(bf.put("r1-v5", [small])) == small  # written over a 3,000-byte spare
    assert (tmp_path / "db-params" / "r1-v5").stat().st_ino in inode
    assert len(list((tmp_path / "db-params" / ".spare").iterdir())) == 1
    # a spare another process left (killed) goes at the sweep; this process's own stays
    (tmp_path / "db-params" / ".spare" / "999999-1").write_bytes(b"x")
    assert bf.sweep("r1-", {bf.put("r1-v6", [big])}) == 1  # r1-v5: no row names it
    assert [p.name for p in (tmp_path / "db-params").iterdir() if p.is_file()] == ["r1-v6"]
    assert len(list((tmp_path / "db-params" / ".spare").iterdir())) == 0  # v6 took the last own spare
    bf.delete([f"r1-x{i}" for i in range(3)], spare=True)  # nothing to keep
    for i in range(B.SPARE_FILES + 3):
        bf.put(f"r2-u{i}", [small])
    bf.delete([f"r2-u{i}" for i in range(B.SPARE_FILES + 3)], spare=True)
    assert len(list((tmp_path / "db-params" / ".spare").iterdir())) == B.SPARE_FILES
    bf.close()
    assert not (tmp_path / "db-params" / ".spare").exists()
    assert bf.get(bf.put("r2-u0", [small])) == small  # after close: a new file


def test_big_parameters_live_in_files_beside_a_sqlite_file(url, tmp_path):
    """Blobs of at least EXTERNAL_MIN_BYTES go to ``<db>-params/`` (SQLite file only): the row
    holds a marker, the file is written before the commit that names it and deleted after the
    commit that forgets it; small ones and PostgreSQL's stay in the row. Round trips are exact."""
    from fedasync.store.blobs import EXTERNAL_MIN_BYTES, is_marker

    big = {"w": np.random.default_rng(0).standard_normal(EXTERNAL_MIN_BYTES // 4 + 10).astype(np.float32),
           "b": np.arange(3, dtype=np.int64)}
    store = Store(url)
    on_files = url.startswith("sqlite")
    files = tmp_path / "store.db-params"
    run = store.create_run("t", "fedbuff", 3, "name: t\n", "simulation")
    store.add_initial_version(run, big, "0" * 64)
    store.record_dispatches(run, [{"task_id": t, "client_id": 0, "base_version": 0, "sent_virtual": 0.0,
                                   "finish_virtual": 1.0, "node_id": None, "message_id": None} for t in (0, 1)],
                            next_task_id=2)
    row = {"client_id": 0, "base_version": 0, "version_at_arrival": 0, "staleness": 0, "weight": 1.0,
           "num_examples": 10, "loss": 0.5, "epsilon": None, "params_sha256": "1" * 64, "accepted": True,
           "reason": None, "received_virtual": 1.0, "pending_params": big}
    store.record_reply(run, 0, row, "replied", None, "{}", 1.0)
    store.record_reply(run, 1, dict(row, pending_params=PARAMS), "replied", None, "{}", 1.0)  # small: in the row
    ups = {u.task_id: u for u in store.updates(run)}
    assert is_marker(ups[0].pending_params) == on_files and not is_marker(ups[1].pending_params)
    assert is_marker(store.versions(run)[0].parameters) == on_files
    if on_files:
        assert blob_names(files) == [f"r{run}-u0", f"r{run}-v0"]
    [(u0, p0), (u1, p1)] = store.pending_updates(run)
    assert all(np.array_equal(p0[k], big[k]) and p0[k].dtype == big[k].dtype for k in big)
    assert all(np.array_equal(p1[k], PARAMS[k]) for k in PARAMS)
    # version 1 aggregates both updates and retention forgets version 0: both files go after the commit
    store.record_dispatches(run, [{"task_id": 2, "client_id": 1, "base_version": 0, "sent_virtual": 0.0,
                                   "finish_virtual": 1.0, "node_id": None, "message_id": None}], next_task_id=3)
    store.record_reply(run, 2, dict(row, pending_params=None, client_id=1), "replied",
                       {"version": 1, "parent": 0, "sha256": "2" * 64, "params": big, "task_ids": [0, 1]},
                       "{}", 2.0, drop_params=[0])
    assert store.pending_updates(run) == []
    v, p = store.load_version(run)
    assert v == 1 and all(np.array_equal(p[k], big[k]) for k in big)
    if on_files:
        assert blob_names(files) == [f"r{run}-v1"]
        assert len(list((files / ".spare").iterdir())) == 1  # u0's file, kept to write over (v0's unlinked)
        # a crash between a file and its commit leaves a file no row names: resume sweeps it
        (files / f"r{run}-u7").write_bytes(b"x")
        (files / f"r{run}-v2.tmp").write_bytes(b"x")
        assert store.sweep_params(run) == 2
        assert blob_names(files) == [f"r{run}-v1"]
        # a row whose file is gone says so, naming the file
        (files / f"r{run}-v1").unlink()
        with pytest.raises(FileNotFoundError, match="-params/"):
            store.load_version(run)
    else:
        assert not files.exists()


def test_the_filter_keeps_one_update_per_client(url, tmp_path):
    """``filter_params`` (kardam's remembered update): written with the reply, forgotten in the
    same transaction as the client's next one (its file becomes a spare), swept if no row names it."""
    from fedasync.store.blobs import EXTERNAL_MIN_BYTES, is_marker

    big = {"w": np.random.default_rng(1).standard_normal(EXTERNAL_MIN_BYTES // 4 + 10).astype(np.float32)}
    store = Store(url)
    on_files = url.startswith("sqlite")
    files = tmp_path / "store.db-params"
    run = store.create_run("t", "fedasync", 3, "name: t\n", "simulation")
    store.add_initial_version(run, PARAMS, "0" * 64)
    store.record_dispatches(run, [{"task_id": t, "client_id": t % 2, "base_version": 0, "sent_virtual": 0.0,
                                   "finish_virtual": 1.0, "node_id": None, "message_id": None} for t in range(3)],
                            next_task_id=3)
    row = {"client_id": 0, "base_version": 0, "version_at_arrival": 0, "staleness": 0, "weight": None,
           "num_examples": 10, "loss": 0.5, "epsilon": None, "params_sha256": "1" * 64, "accepted": False,
           "reason": "kardam", "received_virtual": 1.0, "pending_params": None, "filter_params": big}
    store.record_reply(run, 0, row, "replied", None, "{}", 1.0)
    store.record_reply(run, 1, dict(row, client_id=1, filter_params=PARAMS), "replied", None, "{}", 1.0)
    assert [(u.task_id, u.client_id) for u, _ in store.filter_updates(run)] == [(0, 0), (1, 1)]
    if on_files:
        assert blob_names(files) == [f"r{run}-k0"]
    store.record_reply(run, 2, dict(row, filter_params=big), "replied", None, "{}", 2.0, forget_filter_params=0)
    kept = store.filter_updates(run)
    assert [(u.task_id, u.client_id) for u, _ in kept] == [(1, 1), (2, 0)]
    assert np.array_equal(kept[1][1]["w"], big["w"]) and np.array_equal(kept[0][1]["steps"], PARAMS["steps"])
    assert {u.task_id: u.filter_params is None for u in store.updates(run)} == {0: True, 1: False, 2: False}
    if on_files:
        assert is_marker(store.updates(run)[2].filter_params)
        assert blob_names(files) == [f"r{run}-k2"] and len(list((files / ".spare").iterdir())) == 1
        (files / f"r{run}-k5").write_bytes(b"x")  # left by a crash
        assert store.sweep_params(run) == 1 and blob_names(files) == [f"r{run}-k2"]


def test_an_in_memory_sqlite_store_keeps_big_parameters_in_the_row():
    from fedasync.store.blobs import EXTERNAL_MIN_BYTES, is_marker

    store = Store("sqlite://")
    run = store.create_run("t", "fedbuff", 3, "name: t\n", "simulation")
    big = {"w": np.ones(EXTERNAL_MIN_BYTES // 4 + 10, np.float32)}
    store.add_initial_version(run, big, "0" * 64)
    assert not is_marker(store.versions(run)[0].parameters)
    assert np.array_equal(store.load_version(run)[1]["w"], big["w"])


def test_a_short_run_on_the_store(url, tmp_path):
    from fedasync.config import config_from_dict
    from fedasync.server.loop import AsyncServer
    from fedasync.server.transport import LocalTransport

    cfg = config_from_dict({"seed": 2, "data": {"num_clients": 6, "partitioner": "iid"},
                            "model": {"hidden": 8}, "train": {"local_steps": 2, "batch_size": 8},
                            "server": {"strategy": "fedbuff", "concurrency": 3, "buffer_size": 2, "max_versions": 3}})
    ref = AsyncServer(cfg, LocalTransport(), Store(f"sqlite:///{tmp_path / 'ref.db'}")).run()
    store = Store(url)
    summary = AsyncServer(cfg, LocalTransport(), store).run()
    assert summary["model_sha256"] == ref["model_sha256"]  # the database does not change the run
    assert store.get_run(summary["run_id"]).status == "finished"
    assert store.counts(summary["run_id"])["versions"] == 4


def test_one_transaction_per_step_and_a_crash_inside_it_loses_nothing_committed(tmp_path):
    """Under the virtual clock each step of the loop (the dispatches filling free slots, the
    replies taken at the next virtual instant, the versions and evaluations they made) is one
    transaction: a reply is never committed without its version, nor a version without its reply.
    A crash in the middle of that transaction (after some of its statements ran) leaves the store
    at the previous step, and the resumed run is the run never interrupted."""
    from collections import Counter

    from fedasync.config import config_from_dict
    from fedasync.server.loop import AsyncServer
    from fedasync.server.transport import LocalTransport

    cfg = config_from_dict({"seed": 3, "data": {"num_clients": 8, "partitioner": "iid"}, "model": {"hidden": 8},
                            "train": {"local_steps": 2, "batch_size": 8},
                            "server": {"strategy": "fedasync", "concurrency": 3, "max_versions": 12, "eval_every": 4}})
    ref = AsyncServer(cfg, LocalTransport(), Store(f"sqlite:///{tmp_path / 'ref.db'}")).run()

    class Crash(BaseException):
        pass

    store = Store(f"sqlite:///{tmp_path / 's.db'}")
    commits: list[Counter] = []
    orig = store._commit

    def commit(ops):
        kinds = Counter(op.__qualname__.split(".")[1] for op in ops)
        commits.append(kinds)
        if len(commits) == 9:  # die half-way through this transaction's statements
            def die(c):
                raise Crash("killed inside the transaction")
            ops = ops[: len(ops) // 2] + [die]
        return orig(ops)

    store._commit = commit
    with pytest.raises(Crash):
        AsyncServer(cfg, LocalTransport(), store).run()
    assert commits[0] == {"record_eval": 1}  # v0's evaluation, before the loop
    steps = commits[1:-1]
    assert len(steps) == 7
    # each step: the dispatch that filled the free slot and the reply taken next (with its version)
    assert all(c["record_dispatches"] == 1 and c["record_reply"] == 1 for c in steps)
    assert [c["record_eval"] for c in steps] == [0, 0, 0, 1, 0, 0, 0]  # eval_every 4: inside its step
    store2 = Store(f"sqlite:///{tmp_path / 's.db'}")
    run = store2.get_run(1)
    assert run.current_version == len(steps)  # FedAsync: a version per reply; the 8th step left nothing
    assert len(store2.updates(1)) == run.current_version and len(store2.versions(1)) == run.current_version + 1
    summary = AsyncServer(cfg, LocalTransport(), store2, resume_run_id=1).run()
    assert summary["model_sha256"] == ref["model_sha256"] and summary["history"] == ref["history"]
