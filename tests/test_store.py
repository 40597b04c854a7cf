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


def _legacy_metadata(node_id_type, serverless: bool = False):
    """The tables as the code before migrations made them with ``create_all`` (copied from
    fedasync/store/schema.py and serverless_schema.py at f9ab1b8, 74dbad9 and e0aee4a, not
    imported): no ``updates.pending_params``; ``node_id`` BIGINT at f9ab1b8 (fedasync 0.1.0),
    VARCHAR(24) from 74dbad9; the server-less tables once a ledger/gossip command had run."""
    from sqlalchemy import (BigInteger, Boolean, Column, Float, ForeignKey, Index, Integer, LargeBinary,
                            MetaData, String, Table, Text, UniqueConstraint)

    md = MetaData()

    def c(name, type_, null=False, **kw):
        return Column(name, type_, nullable=null, **kw)

    def ident():
        return Column("id", Integer, primary_key=True, autoincrement=True)

    def run_fk(pk=False):
        return Column("run_id", ForeignKey("runs.id", ondelete="CASCADE"), primary_key=pk, nullable=False)

    Table("runs", md, ident(), c("name", String(200)), c("strategy", String(40)), c("mode", String(20)),
          c("seed", Integer), c("config_yaml", Text), c("status", String(20)), c("stop_reason", String(200), True),
          c("created_wall", Float), c("finished_wall", Float, True), c("current_version", Integer),
          c("next_task_id", Integer), c("virtual_time", Float), c("loop_state", Text, True),
          c("summary_json", Text, True))
    Table("clients", md, run_fk(True), Column("client_id", Integer, primary_key=True),
          c("profile_json", Text, True), c("node_id", node_id_type, True), c("public_key", Text, True),
          c("exhausted", Boolean), c("exhausted_reason", String(200), True), c("accountant_state", Text, True),
          c("epsilon", Float, True), c("tasks_done", Integer))
    Table("dispatches", md, ident(), run_fk(), c("task_id", Integer), c("client_id", Integer),
          c("node_id", node_id_type, True), c("message_id", String(100), True), c("base_version", Integer),
          c("sent_virtual", Float), c("finish_virtual", Float, True), c("sent_wall", Float),
          c("done_wall", Float, True), c("status", String(20)), c("error", Text, True),
          UniqueConstraint("run_id", "task_id"), Index("ix_dispatch_status", "run_id", "status"))
    Table("updates", md, ident(), run_fk(), c("task_id", Integer), c("client_id", Integer),
          c("base_version", Integer), c("version_at_arrival", Integer), c("staleness", Integer),
          c("weight", Float, True), c("num_examples", Integer, True), c("loss", Float, True),
          c("epsilon", Float, True), c("params_sha256", String(64), True), c("accepted", Boolean),
          c("reason", String(100), True), c("applied_in_version", Integer, True), c("received_virtual", Float),
          c("received_wall", Float), UniqueConstraint("run_id", "task_id"))
    Table("model_versions", md, run_fk(True), Column("version", Integer, primary_key=True),
          c("parent", Integer, True), c("sha256", String(64)), c("parameters", LargeBinary, True),
          c("num_updates", Integer), c("created_virtual", Float), c("created_wall", Float),
          c("accuracy", Float, True), c("loss", Float, True))
    Table("privacy_spend", md, ident(), run_fk(), c("client_id", Integer), c("task_id", Integer, True),
          c("accountant", String(10)), c("noise_multiplier", Float), c("sample_rate", Float), c("steps", Integer),
          c("epsilon", Float), c("delta", Float), c("recorded_wall", Float))
    if serverless:
        Table("serverless_runs", md, run_fk(True), c("kind", String(10)), c("num_peers", Integer),
              c("topology", String(20), True), c("settings_json", Text), c("clock", String(10)),
              c("started_wall", Float, True))
        Table("serverless_peers", md, run_fk(True), Column("peer_id", Integer, primary_key=True),
              c("public_key", String(64), True), c("host", String(200), True), c("pid", Integer, True),
              c("ready_wall", Float), c("finished_wall", Float, True), c("stop_reason", String(200), True),
              c("stats_json", Text, True))
        Table("ledger_payloads", md, Column("sha256", String(64), primary_key=True), c("data", LargeBinary),
              c("size", Integer))
        Table("ledger_blocks", md, ident(), run_fk(), c("height", Integer), c("prev_hash", String(64)),
              c("hash", String(64)), c("kind", String(10)), c("payload_sha256", String(64)), c("meta_json", Text),
              c("public_key", String(64)), c("signature", String(128)), c("created", Float),
              c("created_wall", Float), c("peer_id", Integer, True),
              UniqueConstraint("run_id", "height", name="uq_ledger_blocks_run_height"),
              Index("ix_ledger_blocks_run_kind", "run_id", "kind"))
        Table("ledger_evals", md, run_fk(True), Column("height", Integer, primary_key=True),
              c("model_index", Integer), c("accuracy", Float), c("loss", Float), c("evaluated_wall", Float))
        Table("gossip_models", md, ident(), run_fk(), c("peer_id", Integer), c("version", Integer),
              c("steps", Integer), c("params", LargeBinary), c("sha256", String(64)), c("updated_virtual", Float),
              c("updated_wall", Float), c("exhausted", Boolean), c("exhausted_reason", String(200), True),
              c("epsilon", Float, True), UniqueConstraint("run_id", "peer_id", name="uq_gossip_models_run_peer"))
        Table("gossip_events", md, ident(), run_fk(), c("peer_id", Integer), c("neighbour_id", Integer),
              c("step", Integer), c("peer_version", Integer), c("neighbour_version", Integer),
              c("base_version", Integer), c("sha256", String(64)), c("loss", Float, True),
              c("epsilon", Float, True), c("virtual_time", Float), c("wall_time", Float),
              Index("ix_gossip_events_run", "run_id", "id"))
        Table("gossip_metrics", md, ident(), run_fk(), c("events", Integer), c("time_s", Float),
              c("accuracy", Float), c("loss", Float), c("min_accuracy", Float), c("max_accuracy", Float),
              c("consensus_distance", Float), c("recorded_wall", Float))
    return md


def _legacy_store(url: str, node_id_type, serverless: bool = False, edit=None) -> None:
    """A store as the code before migrations left it: its tables (``edit`` may change them first)
    and a finished run with a client, a dispatch, its update and two versions."""
    md = _legacy_metadata(node_id_type, serverless)
    if edit:
        edit(md)
    engine = create_engine(url)
    md.create_all(engine)
    t = md.tables
    node = 123456789 if node_id_type.__class__.__name__ == "BigInteger" else "123456789"
    with engine.begin() as conn:
        conn.execute(t["runs"].insert(), dict(name="old", strategy="fedbuff", mode="simulation", seed=0,
                                              config_yaml="x: 1\n", status="finished", created_wall=1.0,
                                              current_version=1, next_task_id=1, virtual_time=2.0))
        conn.execute(t["clients"].insert(), dict(run_id=1, client_id=0, node_id=node, exhausted=False, tasks_done=1))
        conn.execute(t["dispatches"].insert(), dict(run_id=1, task_id=0, client_id=0, node_id=node, base_version=0,
                                                    sent_virtual=0.0, sent_wall=1.0, status="replied"))
        conn.execute(t["updates"].insert(), dict(run_id=1, task_id=0, client_id=0, base_version=0,
                                                 version_at_arrival=0, staleness=0, accepted=True,
                                                 applied_in_version=1, received_virtual=1.0, received_wall=1.5))
        for v in (0, 1):
            conn.execute(t["model_versions"].insert(), dict(run_id=1, version=v, sha256=str(v) * 64, num_updates=v,
                                                            parameters=encode_params(PARAMS),
                                                            created_virtual=float(v), created_wall=1.0))
        if serverless:
            conn.execute(t["runs"].insert(), dict(name="g", strategy="gossip", mode="gossip", seed=0,
                                                  config_yaml="x: 1\n", status="finished", created_wall=1.0,
                                                  current_version=0, next_task_id=0, virtual_time=0.0))
            conn.execute(t["serverless_runs"].insert(), dict(run_id=2, kind="gossip", num_peers=2,
                                                             settings_json="{}", clock="wall"))
            conn.execute(t["ledger_payloads"].insert(), dict(sha256="a" * 64, data=b"xyz", size=3))
    engine.dispose()


def _short_run(store: Store) -> dict:
    """A fedbuff run (its buffer keeps pending updates in updates.pending_params)."""
    from fedasync.config import config_from_dict
    from fedasync.server.loop import AsyncServer
    from fedasync.server.transport import LocalTransport

    cfg = config_from_dict({"seed": 2, "data": {"num_clients": 6, "partitioner": "iid"},
                            "model": {"hidden": 8}, "train": {"local_steps": 2, "batch_size": 8},
                            "server": {"strategy": "fedbuff", "concurrency": 3, "buffer_size": 2, "max_versions": 3}})
    return AsyncServer(cfg, LocalTransport(), store).run()


@pytest.mark.parametrize("node_id", ["bigint", "text"])
def test_a_real_store_made_before_migrations_is_repaired_stamped_and_runs(url, node_id):
    """The code before migrations had no updates.pending_params (and BIGINT node ids at 0.1.0):
    stamping it at 0001 as it was made the first buffered update fail (no such column)."""
    from sqlalchemy import BigInteger, String

    _legacy_store(url, BigInteger() if node_id == "bigint" else String(24))
    store = Store(url)
    engine = create_engine(url)
    with engine.connect() as conn:
        assert migrate.current(conn) == migrate.head()
    assert _diffs(url, "fedasync.store.schema") == []
    assert "replays" in _tables(engine) and "ledger_blocks" in _tables(engine)
    with engine.connect() as conn:
        assert conn.execute(text("SELECT node_id FROM clients")).scalar() == "123456789"
        assert conn.execute(text("SELECT node_id FROM dispatches")).scalar() == "123456789"
    engine.dispose()
    old = store.get_run(1)
    assert (old.name, old.status, old.current_version) == ("old", "finished", 1)
    assert len(store.updates(1)) == 1 and np.array_equal(store.load_version(1, 1)[1]["a.weight"], PARAMS["a.weight"])
    summary = _short_run(store)
    assert store.get_run(summary["run_id"]).status == "finished"
    assert store.counts(summary["run_id"])["versions"] == 4


def test_a_store_made_before_migrations_with_serverless_tables_is_stamped_at_their_revision(url):
    """A ledger/gossip command run before migrations had already made revision 0003's tables:
    0003 failed with 'table ledger_payloads already exists' and the store could not be opened."""
    from sqlalchemy import String

    _legacy_store(url, String(24), serverless=True)
    store = Store(url)
    engine = create_engine(url)
    with engine.connect() as conn:
        assert migrate.current(conn) == migrate.head()
        assert conn.execute(text("SELECT size FROM ledger_payloads")).scalar() == 3
        assert conn.execute(text("SELECT kind FROM serverless_runs WHERE run_id = 2")).scalar() == "gossip"
    for module in migrate.SCHEMA_MODULES:
        assert _diffs(url, module) == [], module
    assert "replays" in _tables(engine)  # revision 0002, between the baseline and 0003
    engine.dispose()
    assert store.get_run(2).mode == "gossip"
    assert store.counts(_short_run(store)["run_id"])["versions"] == 4


def test_an_unversioned_store_of_another_schema_is_refused_and_left_unchanged(url):
    """A column added, one dropped, one of another type, server-less tables in part: an error that
    names each difference, before anything is changed (no alembic_version, no column added)."""
    from alembic.util import CommandError
    from sqlalchemy import Column, String

    def edit(md):
        md.tables["runs"].append_column(Column("owner", String(20), nullable=True))
        md.tables["clients"].c.tasks_done.type = String(10)
        for name in ("gossip_events", "gossip_metrics", "gossip_models", "ledger_blocks", "ledger_evals",
                     "serverless_peers"):
            md.remove(md.tables[name])

    _legacy_store(url, String(24), serverless=True, edit=edit)
    engine = create_engine(url)
    with engine.begin() as conn:
        conn.execute(text("ALTER TABLE privacy_spend DROP COLUMN delta"))
    before = {t: [(c["name"], str(c["type"])) for c in inspect(engine).get_columns(t)] for t in _tables(engine)}
    with pytest.raises(CommandError) as e:
        Store(url)
    msg = str(e.value)
    for part in ("runs.owner", "privacy_spend.delta is missing",
                 "clients.tasks_done is string(10) not null, expected integer not null",
                 "gossip_events", "Nothing was changed"):
        assert part in msg, msg
    assert "pending_params" not in msg and "\n" not in msg
    after = {t: [(c["name"], str(c["type"])) for c in inspect(engine).get_columns(t)] for t in _tables(engine)}
    assert after == before and "alembic_version" not in after
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


def test_a_scheduler_snapshot_is_written_with_the_loop_state_that_refers_to_it(url):
    """``LoopState.scheduler_state`` goes to ``runs.scheduler_state`` in the loop state's own
    transaction (by every writer of the loop state), and not at all when that rolls back."""
    from fedasync.store import LoopState

    def state(text, snap=None):
        s = LoopState(text)
        s.scheduler_state = snap
        return s

    store = Store(url)
    run = _run(store)
    d = {"client_id": 1, "base_version": 0, "sent_virtual": 0.0, "finish_virtual": 1.0, "node_id": None}
    store.record_dispatches(run, [dict(d, task_id=0, message_id="m0"), dict(d, task_id=1, message_id="m1")],
                            next_task_id=2, loop_state=state('{"s": 1}', '{"id": 0}'), virtual_time=0.0)
    assert (store.get_run(run).loop_state, store.get_run(run).scheduler_state) == ('{"s": 1}', '{"id": 0}')
    store.set_dispatch_status(run, 1, "failed", "boom", loop_state=state('{"s": 2}', '{"id": 1}'))
    assert (store.get_run(run).loop_state, store.get_run(run).scheduler_state) == ('{"s": 2}', '{"id": 1}')
    row = {"client_id": 1, "base_version": 0, "version_at_arrival": 0, "staleness": 0, "weight": 1.0,
           "num_examples": 10, "loss": 0.5, "epsilon": None, "params_sha256": "1" * 64, "accepted": True,
           "reason": None, "received_virtual": 1.0, "pending_params": None}
    store.record_reply(run, 0, row, "replied", None, state('{"s": 3}'), 1.0)  # no snapshot: the last one stays
    assert (store.get_run(run).loop_state, store.get_run(run).scheduler_state) == ('{"s": 3}', '{"id": 1}')
    with pytest.raises(IntegrityError):  # the task replied already: nothing of it is written
        store.record_reply(run, 0, row, "replied", None, state('{"s": 4}', '{"id": 2}'), 2.0)
    assert (store.get_run(run).loop_state, store.get_run(run).scheduler_state) == ('{"s": 3}', '{"id": 1}')
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
