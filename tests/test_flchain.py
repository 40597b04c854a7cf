"""FLchain: the ledger of signed updates — hashing, appending, races, verify, tampering, processes."""

import json
import os
import threading

import numpy as np
import pytest
from sqlalchemy import select, update
from typer.testing import CliRunner

from conftest import small_config
from fedasync.cli import app
from fedasync.server.loop import AsyncServer
from fedasync.server.transport import LocalTransport
from fedasync.server.strategies import params_sha256
from fedasync.serverless import flchain as F
from fedasync.serverless.sim import simulate_ledger
from fedasync.store import Store, decode_params, encode_params
from fedasync.store import serverless_schema as SS

PG_URL = os.environ.get("FEDASYNC_TEST_POSTGRES_URL")

# 6 peers, K = 3: every client always busy, so the ledger is the FedBuff server's computation
LEDGER = ["data.num_clients=6", "server.concurrency=6", "server.buffer_size=3", "server.max_versions=6",
          "server.eval_every=2", "train.local_steps=3", "server.target_accuracy=null"]


def ledger_cfg(*extra):
    return small_config(*LEDGER, *extra)


@pytest.fixture
def chain(tmp_path):
    """A finished simulated chain: (store, run_id, summary)."""
    store = Store(f"sqlite:///{tmp_path / 'ledger.db'}")
    summary = simulate_ledger(ledger_cfg(), store)
    return store, summary["run_id"], summary


def blocks(store, run_id):
    with store.session() as s:
        return list(s.scalars(select(SS.LedgerBlock).where(SS.LedgerBlock.run_id == run_id)
                              .order_by(SS.LedgerBlock.height)))


def check_structure(store, run_id):
    """No fork, no gap; every update block in exactly one aggregate or still pending."""
    rows = blocks(store, run_id)
    assert [b.height for b in rows] == list(range(len(rows)))
    assert rows[0].kind == "genesis" and all(b.kind != "genesis" for b in rows[1:])
    for prev, b in zip(rows, rows[1:]):
        assert b.prev_hash == prev.hash
    updates = [b.height for b in rows if b.kind == "update"]
    named = [h for b in rows if b.kind == "aggregate" for h in json.loads(b.meta_json)["updates"]]
    assert len(named) == len(set(named)), "an update block is in two aggregates"
    assert set(named) <= set(updates)
    view = F.ChainView(store, run_id)
    view.refresh()
    assert sorted(set(updates) - set(named)) == view.pending
    return rows, view


# -- hashing and signing ------------------------------------------------------------------------


def test_block_hash_covers_every_field_and_signatures_bind_the_key():
    key = F.simulation_key(0, "a")
    pub = key.public_key().public_bytes_raw().hex()
    args = dict(height=3, prev_hash="ab" * 32, kind="update", payload_sha256="cd" * 32, meta_json='{"x":1}',
                public_key=pub, created=1.5)
    h = F.block_hash(**args)
    for field, other in [("height", 4), ("prev_hash", "ac" * 32), ("kind", "aggregate"),
                         ("payload_sha256", "ce" * 32), ("meta_json", '{"x":2}'), ("created", 1.5000001)]:
        assert F.block_hash(**dict(args, **{field: other})) != h, field
    sig = F.sign_block(key, h)
    assert F.verify_block_signature(pub, h, sig)
    assert not F.verify_block_signature(pub, F.block_hash(**dict(args, height=4)), sig)
    other = F.simulation_key(0, "b").public_key().public_bytes_raw().hex()
    assert not F.verify_block_signature(other, h, sig)
    assert not F.verify_block_signature(pub, h, "00" * 64)
    assert not F.verify_block_signature("zz", h, sig)  # never raises


# -- the simulated ledger is the FedBuff server -------------------------------------------------


def test_simulated_ledger_equals_the_fedbuff_server_bit_for_bit(tmp_path):
    cfg = ledger_cfg()
    server = AsyncServer(cfg, LocalTransport(), Store(f"sqlite:///{tmp_path / 'server.db'}")).run()
    store = Store(f"sqlite:///{tmp_path / 'ledger.db'}")
    ledger = simulate_ledger(cfg, store)
    assert ledger["versions"] == server["versions"] == 6
    assert ledger["model_sha256"] == server["model_sha256"]
    strip = lambda hist: [(h["version"], h["virtual_time_s"], h["accuracy"], h["loss"]) for h in hist]  # noqa: E731
    assert strip(ledger["history"]) == strip(server["history"])
    assert ledger["virtual_time_s"] == pytest.approx(server["virtual_time_s"])
    # staleness counted in model blocks == the server's staleness counted in versions
    assert ledger["staleness"]["mean"] == pytest.approx(server["staleness"]["mean"])
    # the aggregates name exactly the updates the server aggregated, in the same order
    assert F.verify_chain(store, ledger["run_id"]).ok


def test_simulated_chain_is_a_pure_function_of_config_and_seed(tmp_path):
    a = simulate_ledger(ledger_cfg(), Store(f"sqlite:///{tmp_path / 'a.db'}"))
    b = simulate_ledger(ledger_cfg(), Store(f"sqlite:///{tmp_path / 'b.db'}"))
    c = simulate_ledger(ledger_cfg("seed=1"), Store(f"sqlite:///{tmp_path / 'c.db'}"))
    assert a["head_hash"] == b["head_hash"] and a["model_sha256"] == b["model_sha256"]
    assert c["head_hash"] != a["head_hash"]


def test_chain_structure_and_verify_ok(chain):
    store, run_id, summary = chain
    rows, view = check_structure(store, run_id)
    assert summary["aggregate_blocks"] == 6 and summary["stop_reason"] == "max_steps"
    rep = F.verify_chain(store, run_id)
    assert rep.ok, rep.line()
    assert rep.counts["aggregate"] == rep.counts["aggregates_recomputed"] == 6
    assert rep.counts["update"] == sum(b.kind == "update" for b in rows)
    assert rep.counts["pending"] == len(view.pending)
    assert rep.line().startswith("OK: ledger of run")
    # the genesis block carries the rule, so verify needs no config
    assert json.loads(rows[0].meta_json)["rule"]["buffer_size"] == 3
    # every aggregate names the K oldest pending updates and its parent is the previous model
    for b in rows:
        if b.kind == "aggregate":
            meta = json.loads(b.meta_json)
            assert len(meta["updates"]) == 3 and meta["parent"] == max(
                r.height for r in rows if r.kind != "update" and r.height < b.height)


# -- tampering ----------------------------------------------------------------------------------


def _first(rows, kind, after=1):
    return next(b for b in rows if b.kind == kind and b.height >= after)


def test_tamper_one_payload_byte(chain):
    store, run_id, _ = chain
    rows = blocks(store, run_id)
    target = _first(rows, "update", after=len(rows) // 2)
    with store.session() as s:
        p = s.get(SS.LedgerPayload, target.payload_sha256)
        data = bytearray(p.data)
        data[len(data) // 2] ^= 0x01
        p.data = bytes(data)
    rep = F.verify_chain(store, run_id)
    assert not rep.ok and rep.height == target.height and rep.kind == "update"
    assert "payload sha256 mismatch" in rep.reason
    assert f"height {target.height}" in rep.line()


def test_tamper_one_signature(chain):
    store, run_id, _ = chain
    rows = blocks(store, run_id)
    target = _first(rows, "aggregate")
    sig = target.signature
    forged = ("0" if sig[10] != "0" else "1").join([sig[:10], sig[11:]])
    with store.session() as s:
        s.execute(update(SS.LedgerBlock).where(SS.LedgerBlock.id == target.id).values(signature=forged))
    rep = F.verify_chain(store, run_id)
    assert not rep.ok and rep.height == target.height and "bad signature" in rep.reason


def _replace_params(store, block, params):
    data = encode_params(params)
    sha = F.payload_digest(data)
    meta = json.loads(block.meta_json)
    meta["params_sha256"] = params_sha256(params)
    meta_json = F.canonical_json(meta)
    with store.session() as s:
        s.add(SS.LedgerPayload(sha256=sha, data=data, size=len(data)))
        s.execute(update(SS.LedgerBlock).where(SS.LedgerBlock.id == block.id)
                  .values(payload_sha256=sha, meta_json=meta_json))
    return sha, meta_json


def _nudged(store, block):
    with store.session() as s:
        params = decode_params(s.get(SS.LedgerPayload, block.payload_sha256).data)
    k = next(iter(params))
    params[k] = params[k].copy()
    params[k].flat[0] += np.float32(1e-3)
    return params


def test_tamper_aggregate_parameters_fails_on_the_hash(chain):
    """Another model put in an aggregate's place (payload and its sha fixed up): the hash breaks."""
    store, run_id, _ = chain
    target = _first(blocks(store, run_id), "aggregate")
    _replace_params(store, target, _nudged(store, target))
    rep = F.verify_chain(store, run_id)
    assert not rep.ok and rep.height == target.height and rep.kind == "aggregate"
    assert "hash mismatch" in rep.reason


def test_tamper_aggregate_resigned_by_its_author_is_caught_by_recomputation(chain):
    """The head aggregate replaced, re-hashed and re-signed with its author's own key: every hash,
    link and signature is valid, and only recomputing FedBuff from the update blocks catches it."""
    store, run_id, summary = chain
    rows = blocks(store, run_id)
    head = rows[-1]
    assert head.kind == "aggregate"
    sha, meta_json = _replace_params(store, head, _nudged(store, head))
    key = F.simulation_key(0, f"peer-{head.peer_id}")
    h = F.block_hash(head.height, head.prev_hash, head.kind, sha, meta_json, head.public_key, head.created)
    with store.session() as s:
        s.execute(update(SS.LedgerBlock).where(SS.LedgerBlock.id == head.id)
                  .values(hash=h, signature=F.sign_block(key, h)))
    rep = F.verify_chain(store, run_id)
    assert not rep.ok and rep.height == head.height
    assert "differ from the FedBuff aggregate recomputed" in rep.reason


def test_a_missing_block_is_named(chain):
    store, run_id, _ = chain
    rows = blocks(store, run_id)
    gone = rows[4]
    with store.session() as s:
        s.delete(s.get(SS.LedgerBlock, gone.id))
    rep = F.verify_chain(store, run_id)
    assert not rep.ok and rep.height == 4 and "missing" in rep.reason


# -- races ----------------------------------------------------------------------------------------


def test_a_lost_height_race_is_retried_not_forked(chain):
    store, run_id, _ = chain
    rows = blocks(store, run_id)
    key = F.simulation_key(0, "intruder")
    # a stale writer trying a height that is already taken loses; nothing is written
    assert F.try_append(store, run_id, key, len(rows) - 1, rows[-2].hash, "update", b"x",
                        {"peer": 0}, 0.0, 0) is None
    assert len(blocks(store, run_id)) == len(rows)


def test_threads_racing_for_heights_leave_one_contiguous_chain(tmp_path):
    """Eight writers (own engines, like processes) append update and aggregate blocks at once."""
    from fedasync.serverless.common import PeerTask

    cfg = ledger_cfg("data.num_clients=8", "server.concurrency=8", "server.max_versions=null")
    url = f"sqlite:///{tmp_path / 'race.db'}"
    store = Store(url)
    run_id = F.create_ledger(store, cfg, F.Rule.from_config(cfg, 4), F.simulation_key(0, "g"), "wall", 0.0)
    task = PeerTask(cfg)
    barrier = threading.Barrier(8)
    errors = []

    def peer(i):
        try:
            p = F.LedgerPeer(Store(url), run_id, i, F.simulation_key(0, f"p{i}"), task)
            work = F.Work(task_id=i, base=0, base_hash=p.view.blocks[0].hash,
                          params={k: v + np.float32(i) for k, v in task.init.items()}, metrics={"num_examples": 1})
            barrier.wait()
            for _ in range(2):
                p.append_update(work)
                p.try_aggregate()
        except Exception as e:  # pragma: no cover - reported below
            errors.append(e)

    threads = [threading.Thread(target=peer, args=(i,)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors
    rows, view = check_structure(store, run_id)
    assert sum(b.kind == "update" for b in rows) == 16
    assert view.num_aggregates == 4  # the rule's max_aggregates: 16 updates, K = 3, at most 4
    assert F.verify_chain(store, run_id).ok


# -- peer processes -------------------------------------------------------------------------------


def _alive(pid):
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


BACKENDS = ["sqlite", pytest.param("postgres", marks=pytest.mark.postgres)]


@pytest.mark.parametrize("backend", BACKENDS)
def test_eight_peer_processes_append_to_one_ledger(backend, tmp_path):
    from fedasync.serverless.common import peers as peer_rows
    from fedasync.serverless.runner import run_ledger

    if backend == "postgres":
        if not PG_URL:
            pytest.skip("FEDASYNC_TEST_POSTGRES_URL is not set")
        url = PG_URL
    else:
        url = f"sqlite:///{tmp_path / 'ledger.db'}"
    cfg = small_config("data.num_clients=8", "server.concurrency=8", "server.buffer_size=3",
                       "server.max_versions=null", "train.local_steps=2", "server.target_accuracy=null")
    summary = run_ledger(cfg, url, 8, tmp_path / "out", max_steps=4)
    store = Store(url)
    run_id = summary["run_id"]
    rows, view = check_structure(store, run_id)
    assert view.num_aggregates == 4 and summary["stop_reason"] == "max_steps"
    rep = F.verify_chain(store, run_id)
    assert rep.ok, rep.line()
    peers = peer_rows(store, run_id)
    assert [p["peer"] for p in peers] == list(range(8))
    assert all(p["finished_wall"] is not None for p in peers)
    assert summary["peer_exit_codes"] == [0] * 8
    assert not any(_alive(p["pid"]) for p in peers)
    # every update block is signed by the key its peer registered
    keys = {p["peer"]: p["public_key"] for p in peers}
    assert all(b.public_key == keys[b.peer_id] for b in rows if b.kind == "update")


# -- the CLI --------------------------------------------------------------------------------------


def test_cli_virtual_run_verify_show_and_tamper(tmp_path):
    runner = CliRunner()
    url = f"sqlite:///{tmp_path / 'out' / 'fedasync.db'}"
    res = runner.invoke(app, ["ledger", "run", "--virtual", "--out", str(tmp_path / "out"),
                              *sum((["--set", s] for s in LEDGER[:-1]), [])])
    assert res.exit_code == 0, res.output
    summary = json.loads((tmp_path / "out" / "summary.json").read_text())
    assert summary["aggregate_blocks"] == 6 and (tmp_path / "out" / "history.csv").exists()
    res = runner.invoke(app, ["ledger", "verify", "--store", url])
    assert res.exit_code == 0 and res.output.startswith("OK:"), res.output
    res = runner.invoke(app, ["ledger", "show", "--store", url])
    assert res.exit_code == 0 and "per-peer contributions" in res.output and "aggregate 6" in res.output
    store = Store(url)
    target = _first(blocks(store, summary["run_id"]), "update", after=5)
    with store.session() as s:
        s.execute(update(SS.LedgerBlock).where(SS.LedgerBlock.id == target.id).values(signature="00" * 64))
    res = runner.invoke(app, ["ledger", "verify", "--store", url])
    assert res.exit_code == 1 and f"height {target.height}" in res.output and "bad signature" in res.output


def test_cli_errors_are_one_line(tmp_path):
    runner = CliRunner()
    res = runner.invoke(app, ["ledger", "verify", "--store", f"sqlite:///{tmp_path / 'none.db'}"])
    assert res.exit_code == 2 and "no database" in res.output
    Store(f"sqlite:///{tmp_path / 'empty.db'}")
    res = runner.invoke(app, ["ledger", "verify", "--store", f"sqlite:///{tmp_path / 'empty.db'}"])
    assert res.exit_code == 2 and "no ledger run" in res.output
    res = runner.invoke(app, ["ledger", "run", "--virtual", "--peers", "4", "--out", str(tmp_path / "o")])
    assert res.exit_code == 2 and "server.buffer_size" in res.output


def test_dp_ledger_peers_stay_within_budget_and_the_chain_verifies(tmp_path):
    from fedasync.privacy.budgets import resolve_budgets

    cfg = ledger_cfg("data.partitioner=iid", "server.max_versions=null", "train.batch_size=32",
                     "privacy.local_dp.enabled=true", "privacy.local_dp.epsilon=6.0",
                     "privacy.local_dp.planned_tasks=2", "privacy.overrides=[{clients: '0-1', epsilon: 3.0}]")
    store = Store(f"sqlite:///{tmp_path / 'dp.db'}")
    s = simulate_ledger(cfg, store)
    assert s["stop_reason"] == "no_peer_can_train" and s["update_blocks"] == 12  # 6 peers x 2 planned tasks
    budgets = resolve_budgets(cfg.privacy, 6)
    eps = {}
    for b in blocks(store, s["run_id"]):
        if b.kind == "update":
            m = json.loads(b.meta_json)
            eps[m["peer"]] = max(eps.get(m["peer"], 0.0), m["epsilon"])
    assert sorted(eps) == list(range(6))
    assert all(0 < eps[p] <= budgets[p].epsilon for p in range(6))
    assert eps[0] <= 3.0 < eps[5]
    assert F.verify_chain(store, s["run_id"]).ok
