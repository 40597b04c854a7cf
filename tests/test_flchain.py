"""FLchain: the ledger of signed updates — hashing, appending, races, verify, tampering, membership,
processes, the CLI."""

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
from fedasync.config import load_config
from fedasync.server.strategies import params_sha256
from fedasync.serverless import flchain as F
from fedasync.serverless.ledger_peer import LedgerPeer, Work
from fedasync.serverless.ledger_verify import verify_chain
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
    assert verify_chain(store, ledger["run_id"]).ok


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
    rep = verify_chain(store, run_id)
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
    rep = verify_chain(store, run_id)
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
    rep = verify_chain(store, run_id)
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
    rep = verify_chain(store, run_id)
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
    rep = verify_chain(store, run_id)
    assert not rep.ok and rep.height == head.height
    assert "differ from the FedBuff aggregate recomputed" in rep.reason


def test_a_missing_block_is_named(chain):
    store, run_id, _ = chain
    rows = blocks(store, run_id)
    gone = rows[4]
    with store.session() as s:
        s.delete(s.get(SS.LedgerBlock, gone.id))
    rep = verify_chain(store, run_id)
    assert not rep.ok and rep.height == 4 and "missing" in rep.reason


# -- membership: who may sign -----------------------------------------------------------------------

# a chain that can grow after the simulator stops: no max_aggregates, stopped by virtual time
OPEN = ["server.max_versions=null", "server.max_virtual_time=0.4"]
AUTHORITY = F.simulation_key(0, "genesis")


@pytest.fixture
def open_chain(tmp_path):
    """(store, run_id, url, task): a small simulated chain whose members (simulation keys of seed
    0) may keep appending."""
    from fedasync.serverless.common import PeerTask
    from fedasync.serverless.runs import start_run

    url = f"sqlite:///{tmp_path / 'open.db'}"
    store = Store(url)
    cfg = ledger_cfg(*OPEN)
    summary = simulate_ledger(cfg, store)
    assert summary["stop_reason"] == "max_virtual_time" and summary["aggregate_blocks"] >= 1
    start_run(store, summary["run_id"])  # running again: its head is not recorded (verify checks a stopped run's)
    return store, summary["run_id"], url, PeerTask(cfg)


def member_key(i):
    return F.simulation_key(0, f"peer-{i}")


def append_honest(store, run_id, task, i, key=None):
    """Member ``i`` appends one update (from the head model); its height."""
    p = LedgerPeer(store, run_id, i, key or member_key(i), task)
    base = p.view.head_model
    params = {k: v + np.float32(0.01 * (i + 1)) for k, v in p.view.params(base.height).items()}
    return p, p.append_update(Work(task_id=10_000 + i, base=base.height, base_hash=base.hash, params=params,
                                   metrics={"num_examples": 5}))


def honest_round(store, run_id, task, peers=(1, 2, 3), keys=None):
    """Peers append one update each, each aggregating when K are pending; (update heights, last aggregate)."""
    heights, agg = [], None
    for i in peers:
        p, h = append_honest(store, run_id, task, i, (keys or {}).get(i))
        heights.append(h)
        agg = p.try_aggregate() or agg
    return heights, agg


def append_forged(store, run_id, key, peer, params=None):
    """An update block signed by ``key`` claiming ``peer``, appended at the head with try_append."""
    view = F.ChainView(store, run_id)
    view.refresh()
    base = view.head_model
    params = params if params is not None else view.params(base.height)
    meta = {"base": base.height, "base_hash": base.hash, "peer": peer, "task_id": 99_999, "num_examples": 5,
            "loss": 0.1, "epsilon": None, "params_sha256": params_sha256(params)}
    height = view.height + 1
    assert F.try_append(store, run_id, key, height, view.head.hash, "update", encode_params(params), meta, None,
                        peer) is not None
    return height


def cli_verify(url):
    return CliRunner().invoke(app, ["ledger", "verify", "--store", url])


def test_the_genesis_block_pins_every_peer_and_its_key(chain):
    store, run_id, _ = chain
    rows = blocks(store, run_id)
    meta = json.loads(rows[0].meta_json)
    assert meta["members"] == [{"peer": i, "public_key": member_key(i).public_key().public_bytes_raw().hex()}
                               for i in range(6)]
    assert rows[0].public_key == AUTHORITY.public_key().public_bytes_raw().hex()
    rep = verify_chain(store, run_id)
    assert rep.ok and rep.counts["members"] == 6 and rep.counts["rejected"] == 0


def test_an_outsider_block_fails_verify_and_every_peer_ignores_it(open_chain):
    """Issue 13: a fresh key, registered nowhere, appends an update claiming peer 0 whose parameters
    are all 1e3. Verify names its height; peers never aggregate it; verify recomputes the later
    aggregates without it; `ledger verify` exits 1."""
    from fedasync.signing import generate_key

    store, run_id, url, task = open_chain
    view = F.ChainView(store, run_id)
    view.refresh()
    huge = {k: np.full_like(v, 1e3) for k, v in view.params(view.head_model.height).items()}
    bad = append_forged(store, run_id, generate_key(), 0, huge)
    rep = verify_chain(store, run_id)
    assert not rep.ok and rep.height == bad and rep.kind == "update"
    assert "not a member of the run" in rep.reason and f"height {bad}" in rep.line()
    # honest peers go on; the outsider's update is never pending, so never aggregated
    view.refresh()
    assert view.rejected == [bad] and bad not in view.pending and view.blocks[bad].rejected
    ups, agg = honest_round(store, run_id, task)
    assert agg is not None and bad not in json.loads(blocks(store, run_id)[agg].meta_json)["updates"]
    head = F.ChainView(store, run_id)
    head.refresh()
    assert float(max(np.max(np.abs(a)) for a in head.params(agg).values())) < 100  # no 1e3 in the model
    rep = verify_chain(store, run_id)
    assert not rep.ok and rep.height == bad and rep.fatal is None  # everything else is intact
    assert agg in rep.counts["aggregate_heights"]  # recomputed bit for bit without the outsider
    assert "1 later aggregate(s) recomputed" in rep.line()
    res = cli_verify(url)
    assert res.exit_code == 1 and f"height {bad} (update)" in res.output and "not a member" in res.output


def test_an_aggregate_that_folds_in_a_rejected_block_fails_the_recomputation(open_chain):
    """A member who aggregates the outsider's update (as a peer trusting every block would) writes
    an aggregate the chain's own rule does not produce: verify rejects it, and so does every peer
    (it is never their head model); the walk goes on."""
    from fedasync.signing import generate_key

    store, run_id, url, task = open_chain
    bad = append_forged(store, run_id, generate_key(), 0)
    view = F.ChainView(store, run_id)
    view.refresh()
    while len(view.pending) < 2:  # honest updates, not aggregated
        append_honest(store, run_id, task, 1 + len(view.pending))
        view.refresh()
    names = sorted(view.pending + [bad])[:3]  # what a peer that trusted every block would aggregate
    assert bad in names
    parent = view.models[-1]
    base = int(view.blocks[bad].meta["base"])
    ups = [view.update_in(u) if u != bad else
           F.UpdateIn(bad, 0, view.params(bad), view.params(base), view.model_index[base],
                      view.num_aggregates - view.model_index[base], 5) for u in names]
    new = F.compute_aggregate(view.rule, view.params(parent), view.model_index[parent], ups)
    meta = {"updates": names, "parent": parent, "parent_hash": view.blocks[parent].hash,
            "model_index": view.num_aggregates + 1, "peer": 1, "params_sha256": params_sha256(new)}
    h = view.height + 1
    assert F.try_append(store, run_id, member_key(1), h, view.head.hash, "aggregate", encode_params(new), meta,
                        None, 1)
    rep = verify_chain(store, run_id)
    assert not rep.ok and rep.height == bad and rep.fatal is None
    assert [r[0] for r in rep.rejected] == [bad, h] and "but the rule takes" in rep.rejected[1][2]
    assert "2 block(s) rejected" in rep.line()
    view.refresh()
    assert view.rejected == [bad, h] and view.models[-1] == parent  # no peer takes it as the new model
    assert cli_verify(url).exit_code == 1


def test_a_member_signing_as_another_member_fails_verify(open_chain):
    store, run_id, url, task = open_chain
    bad = append_forged(store, run_id, member_key(1), 0)  # peer 1's own key, claiming peer 0
    rep = verify_chain(store, run_id)
    assert not rep.ok and rep.height == bad
    assert rep.reason == "signed by peer 1's key but claims to be peer 0"
    view = F.ChainView(store, run_id)
    view.refresh()
    assert view.rejected == [bad] and bad not in view.pending
    res = cli_verify(url)
    assert res.exit_code == 1 and f"height {bad}" in res.output and "claims to be peer 0" in res.output


def test_a_removed_member_cannot_append(open_chain):
    store, run_id, url, task = open_chain
    before, _ = honest_round(store, run_id, task, peers=(2,))  # peer 2's update while a member
    removal = F.append_member(store, run_id, AUTHORITY, "remove", 2)
    assert verify_chain(store, run_id).ok  # removing is fine; its earlier update stays valid
    peer = LedgerPeer(store, run_id, 0, member_key(0), task)
    assert peer.view.members.key_of(2) is None and before[0] in peer.view.pending
    with pytest.raises(F.ChainError, match="is not peer 2's key"):
        LedgerPeer(store, run_id, 2, member_key(2), task)
    bad = append_forged(store, run_id, member_key(2), 2)
    rep = verify_chain(store, run_id)
    assert not rep.ok and rep.height == bad
    assert rep.reason == f"signed by the key of peer 2, removed from the run at height {removal}"
    res = cli_verify(url)
    assert res.exit_code == 1 and f"height {bad}" in res.output and "removed from the run" in res.output


def test_only_the_authority_admits_peers(open_chain, tmp_path):
    """Peer 2 removed and re-admitted with a new key (through the CLI, the authority's key file):
    the new key signs for 2, the old one does not; a member cannot admit anyone."""
    from fedasync.signing import generate_key, save_keypair

    store, run_id, url, task = open_chain
    save_keypair(AUTHORITY, tmp_path / "keys", "genesis")
    new = generate_key()
    save_keypair(new, tmp_path / "keys", "peer-2")
    runner = CliRunner()
    auth = ["--store", url, "--authority", str(tmp_path / "keys" / "genesis.key")]
    res = runner.invoke(app, ["ledger", "member", "add", *auth, "--peer-id", "2",
                              "--public-key", str(tmp_path / "keys" / "peer-2.pub")])
    assert res.exit_code == 2 and "peer 2 is already a member" in res.output
    res = runner.invoke(app, ["ledger", "member", "remove", *auth, "--peer-id", "2"])
    assert res.exit_code == 0 and "removed peer 2" in res.output, res.output
    res = runner.invoke(app, ["ledger", "member", "add", *auth, "--peer-id", "2",
                              "--public-key", str(tmp_path / "keys" / "peer-2.pub")])
    assert res.exit_code == 0 and "admitted peer 2" in res.output, res.output
    # a member's key is not the authority: refused before anything is written, and rejected if forced
    with pytest.raises(F.ChainError, match="must be signed by the run's authority"):
        F.append_member(store, run_id, member_key(0), "add", 3, generate_key())
    ups, agg = honest_round(store, run_id, task, peers=(2, 1, 0), keys={2: new})
    assert agg is not None and verify_chain(store, run_id).ok
    view = F.ChainView(store, run_id)
    view.refresh()
    h = view.height + 1
    meta = {"op": "add", "peer": 5, "public_key": generate_key().public_key().public_bytes_raw().hex()}
    assert F.try_append(store, run_id, member_key(0), h, view.head.hash, "member", b"", meta, None, None)
    rep = verify_chain(store, run_id)
    assert not rep.ok and rep.height == h and rep.kind == "member" and "authority" in rep.reason
    assert cli_verify(url).exit_code == 1
    res = runner.invoke(app, ["ledger", "show", "--store", url])
    assert res.exit_code == 0 and f"rejected block at height {h} (member)" in res.output


def test_a_peer_whose_key_is_not_a_member_is_refused_before_it_starts(open_chain, tmp_path):
    from fedasync.serverless.common import ServerlessError
    from fedasync.serverless.runner import ledger_peer_loop

    store, run_id, url, task = open_chain
    with pytest.raises(ServerlessError, match=r"peer 3: key \w+ is not peer 3's key .*/peer-3\.pub"):
        ledger_peer_loop(store, run_id, 3, tmp_path / "k" / "peer-3.key")
    assert (tmp_path / "k" / "peer-3.pub").exists()  # created, for the authority to admit


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
    task = PeerTask(cfg)
    run_id = F.create_ledger(store, cfg, F.Rule.from_config(cfg, 4), F.simulation_key(0, "g"), "wall", 0.0,
                             members={i: F.simulation_key(0, f"p{i}") for i in range(8)}, init=task.init)
    barrier = threading.Barrier(8)
    errors = []

    def peer(i):
        try:
            p = LedgerPeer(Store(url), run_id, i, F.simulation_key(0, f"p{i}"), task)
            work = Work(task_id=i, base=0, base_hash=p.view.blocks[0].hash,
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
    assert verify_chain(store, run_id).ok


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
    from fedasync.serverless.runner import run_ledger
    from fedasync.serverless.runs import peers as peer_rows

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
    rep = verify_chain(store, run_id)
    assert rep.ok, rep.line()
    peers = peer_rows(store, run_id)
    assert [p["peer"] for p in peers] == list(range(8))
    assert all(p["finished_wall"] is not None for p in peers)
    assert summary["peer_exit_codes"] == [0] * 8
    assert not any(_alive(p["pid"]) for p in peers)
    # every update block is signed by the key its peer registered, the key the genesis block pinned
    keys = {p["peer"]: p["public_key"] for p in peers}
    assert all(b.public_key == keys[b.peer_id] for b in rows if b.kind == "update")
    assert {m["peer"]: m["public_key"] for m in json.loads(rows[0].meta_json)["members"]} == keys
    assert (tmp_path / "out" / "keys" / "genesis.key").exists()


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


@pytest.mark.parametrize("kind", ["ledger", "gossip"])
def test_cli_peers_caps_concurrency_and_buffer_size_and_says_so(kind, tmp_path):
    """The quickstart (concurrency 20, buffer_size 10) with --peers 4: both capped at 4, one line."""
    res = CliRunner().invoke(app, [kind, "run", "--virtual", "--peers", "4", "--max-steps", "1",
                                   "--out", str(tmp_path / "o")])
    assert res.exit_code == 0, res.output
    notes = [line for line in res.output.splitlines() if line.startswith("note:")]
    assert notes == ["note: 4 peers: capped server.concurrency 20 -> 4, server.buffer_size 10 -> 4 (they cannot "
                     "exceed the number of peers)"]
    cfg = load_config(tmp_path / "o" / "config.yaml")
    assert (cfg.data.num_clients, cfg.server.concurrency, cfg.server.buffer_size) == (4, 4, 4)
    summary = json.loads((tmp_path / "o" / "summary.json").read_text())
    assert summary["num_peers"] == 4
    if kind == "ledger":
        assert summary["buffer_size"] == 4 and summary["aggregate_blocks"] == 1


@pytest.mark.parametrize("kind", ["ledger", "gossip"])
@pytest.mark.parametrize("bad", [["--peers", "4", "--spawn", "5"], ["--virtual", "--spawn", "2"],
                                 ["--peers", "4", "--store", "nosuchdb://x"]])
def test_cli_bad_spawn_or_store_creates_nothing(kind, bad, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # the default output directory would be ./runs/...
    for out in ([], ["--out", str(tmp_path / "o")]):
        res = CliRunner().invoke(app, [kind, "run", *bad, *out])
        assert res.exit_code == 2, res.output
        assert ("--spawn" if "--spawn" in bad else "--store") in res.output
        assert len(res.output.strip().splitlines()) == 1
        assert not (tmp_path / "o").exists() and not (tmp_path / "runs").exists()


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
    assert verify_chain(store, s["run_id"]).ok


# -- review findings: anchors, one per-block check for peers and verify, strict encodings -----------


def test_verify_fails_a_chain_cut_short_or_grown_after_the_run_recorded_its_head(chain):
    """A finished run recorded its head: deleting the last blocks (every remaining hash, link and
    aggregate still checks) or adding blocks above it fails, naming what differs."""
    store, run_id, summary = chain
    rows = blocks(store, run_id)
    assert summary["height"] == rows[-1].height and summary["head_hash"] == rows[-1].hash
    rep = verify_chain(store, run_id)
    assert rep.ok and f"the head it recorded when it finished (height {rows[-1].height})" in rep.line()
    assert "no outside anchor" in rep.line()
    with store.session() as s:
        s.execute(SS.LedgerBlock.__table__.delete().where(SS.LedgerBlock.run_id == run_id,
                                                          SS.LedgerBlock.height >= rows[-2].height))
    rep = verify_chain(store, run_id)
    assert not rep.ok and rep.height is None
    assert (f"the chain ends at height {rows[-3].height}, but the run recorded its head at height "
            f"{rows[-1].height} ({rows[-1].hash[:16]})") in rep.line()
    # the append path refuses a stopped run's chain (a member block would break its recorded head)
    with pytest.raises(F.ChainError, match="chain is closed at the head it recorded"):
        F.append_member(store, run_id, AUTHORITY, "remove", 2)


def test_verify_fails_another_runs_chain_put_in_a_runs_place(tmp_path):
    """A whole self-consistent chain of another run (another config, seed and authority)
    substituted for run 1's: its genesis does not match run 1's own rows."""
    store = Store(f"sqlite:///{tmp_path / 'two.db'}")
    one = simulate_ledger(ledger_cfg(), store)["run_id"]
    two = simulate_ledger(ledger_cfg("seed=7", "train.lr=0.5"), store)["run_id"]
    assert verify_chain(store, two).ok
    with store.session() as s:
        s.execute(SS.LedgerBlock.__table__.delete().where(SS.LedgerBlock.run_id == one))
        s.execute(update(SS.LedgerBlock).where(SS.LedgerBlock.run_id == two).values(run_id=one))
    rep = verify_chain(store, one)
    assert not rep.ok and "config_sha256" in rep.line() and f"this chain is not run {one}'s" in rep.line()


def test_cli_verify_head_and_authority_anchors(tmp_path):
    from fedasync.signing import save_keypair

    runner = CliRunner()
    out = tmp_path / "out"
    url = f"sqlite:///{out / 'fedasync.db'}"
    res = runner.invoke(app, ["ledger", "run", "--virtual", "--out", str(out),
                              *sum((["--set", s] for s in LEDGER[:-1]), [])])
    assert res.exit_code == 0, res.output
    head = json.loads((out / "summary.json").read_text())["head_hash"]
    save_keypair(AUTHORITY, tmp_path / "keys", "genesis")
    save_keypair(F.simulation_key(0, "someone"), tmp_path / "keys", "other")
    ok = runner.invoke(app, ["ledger", "verify", "--store", url, "--head", head,
                             "--authority", str(tmp_path / "keys" / "genesis.pub")])
    assert ok.exit_code == 0 and ok.output.startswith("OK:"), ok.output
    assert "--head" in ok.output and "--authority" in ok.output and "no outside anchor" not in ok.output
    res = runner.invoke(app, ["ledger", "verify", "--store", url, "--head", head[:16]])  # a prefix will do
    assert res.exit_code == 0, res.output
    res = runner.invoke(app, ["ledger", "verify", "--store", url, "--head", "ab" * 32])
    assert res.exit_code == 1 and "is not --head abababab" in res.output
    res = runner.invoke(app, ["ledger", "verify", "--store", url, "--authority", str(tmp_path / "keys" / "other.pub")])
    assert res.exit_code == 1 and "not by --authority" in res.output
    for bad in (["--head", "XYZ"], ["--authority", str(tmp_path / "nope.pub")]):
        res = runner.invoke(app, ["ledger", "verify", "--store", url, *bad])
        assert res.exit_code == 2 and len(res.output.strip().splitlines()) == 1, res.output


def append_raw(store, run_id, key, kind, meta, params=None, meta_json=None, prev_hash=None):
    """A block signed by ``key`` at the head, with exactly this meta (or meta_json text)."""
    view = F.ChainView(store, run_id)
    view.refresh()
    data = encode_params(params) if params is not None else b""
    sha = F.payload_digest(data)
    meta_json = meta_json if meta_json is not None else F.canonical_json(meta)
    h, prev = view.height + 1, prev_hash or view.head.hash
    pub = key.public_key().public_bytes_raw().hex()
    bh = F.block_hash(h, prev, kind, sha, meta_json, pub, 1.0)
    with store.session() as s:
        F._insert_payload(s, sha, data)
        s.add(SS.LedgerBlock(run_id=run_id, height=h, prev_hash=prev, hash=bh, kind=kind, payload_sha256=sha,
                             meta_json=meta_json, public_key=pub, signature=F.sign_block(key, bh), created=1.0,
                             created_wall=1.0, peer_id=None))
    return h


def _update_meta(view, base, params, **kv):
    return dict({"base": base, "base_hash": view.blocks[base].hash, "peer": 1, "task_id": 99_999,
                 "num_examples": 5, "loss": 0.1, "epsilon": None, "params_sha256": params_sha256(params)}, **kv)


@pytest.mark.parametrize("bad", ["base", "shape", "num_examples"])
def test_a_members_malformed_update_is_rejected_by_every_peer_and_by_verify(open_chain, bad):
    """t3/t9: a member signs an update whose base is not a model block, whose payload is not a
    model of the genesis shapes, or whose num_examples is 1e400 (inf). Peers used to take it as
    pending and crash when aggregating (KeyError, ValueError, OverflowError); verify crashed on
    1e400. Now every reader rejects it, peers aggregate without it, verify reports FAIL there."""
    store, run_id, url, task = open_chain
    view = F.ChainView(store, run_id)
    view.refresh()
    base = view.head_model.height
    params = view.params(base)
    if bad == "base":
        upd = max(view.arrival)  # an update block, not a model block
        h = append_raw(store, run_id, member_key(1), "update", _update_meta(view, upd, params), params=params)
        why = f"meta.base {upd} is not an earlier model block"
    elif bad == "shape":
        p2 = {k: (np.zeros((3,), v.dtype) if i == 0 else v) for i, (k, v) in enumerate(params.items())}
        h = append_raw(store, run_id, member_key(1), "update", _update_meta(view, base, p2), params=p2)
        why = "payload is not a model of the genesis model's keys, shapes and dtypes"
    else:
        text = F.canonical_json(_update_meta(view, base, params)).replace('"num_examples":5', '"num_examples":1e400')
        h = append_raw(store, run_id, member_key(1), "update", None, params=params, meta_json=text)
        why = "meta.num_examples inf is not a non-negative integer"
    view.refresh()
    assert view.rejected == [h] and h not in view.pending and view.blocks[h].rejected == why
    ups, agg = honest_round(store, run_id, task)  # honest peers go on and aggregate, without it
    assert agg is not None and h not in json.loads(blocks(store, run_id)[agg].meta_json)["updates"]
    rep = verify_chain(store, run_id)
    assert not rep.ok and rep.height == h and rep.reason == why and rep.fatal is None
    assert agg in rep.counts["aggregate_heights"]
    res = cli_verify(url)
    assert res.exit_code == 1 and f"height {h} (update)" in res.output


@pytest.mark.parametrize("bad", ["params", "notlist"])
def test_a_forged_aggregate_is_never_a_peers_model(open_chain, bad):
    """t5: a member signs an aggregate of the K oldest pending updates whose parameters are all
    7.0 (staleness right, so only recomputation catches it), or whose ``updates`` is not a list.
    Peers used to train from it (or crash reading the chain); now they reject it, keep the previous
    model, and an honest peer aggregates the same updates properly."""
    store, run_id, url, task = open_chain
    view = F.ChainView(store, run_id)
    view.refresh()
    while len(view.pending) < 3:
        append_honest(store, run_id, task, 1 + len(view.pending))
        view.refresh()
    parent = view.models[-1]
    names = view.pending[:3]
    evil = {k: np.full_like(v, 7.0) for k, v in view.params(parent).items()}
    meta = {"updates": names if bad == "params" else names[0], "parent": parent,
            "parent_hash": view.blocks[parent].hash, "model_index": len(view.models),
            "staleness": [view.staleness(u) for u in names], "peer": 1, "params_sha256": params_sha256(evil)}
    h = append_raw(store, run_id, member_key(1), "aggregate", meta, params=evil)
    peer = LedgerPeer(store, run_id, 4, member_key(4), task)
    work = peer.start_task(30_000)
    assert work.base == parent and peer.view.rejected == [h]
    assert not all(np.all(a == 7.0) for a in peer.view.params(work.base).values())
    agg = peer.try_aggregate()  # the same K updates, aggregated by the rule
    assert agg == h + 1 and json.loads(blocks(store, run_id)[agg].meta_json)["updates"] == names
    rep = verify_chain(store, run_id)
    assert not rep.ok and rep.height == h and rep.fatal is None and agg in rep.counts["aggregate_heights"]
    assert ("differ from the FedBuff aggregate recomputed" if bad == "params" else "but the rule takes") in rep.reason
    res = CliRunner().invoke(app, ["ledger", "show", "--store", url])
    assert res.exit_code == 0 and f"rejected block at height {h} (aggregate)" in res.output


def test_a_block_spliced_from_another_run_is_rejected_by_peers(tmp_path):
    """t6: the same member keys (same seed) in two runs; run 2's block 5 put in run 1's place.
    Peers used to accept it (ChainView never checked prev_hash); now it is rejected, and verify
    stops there."""
    store = Store(f"sqlite:///{tmp_path / 'splice.db'}")
    one = simulate_ledger(ledger_cfg(), store)["run_id"]
    two = simulate_ledger(ledger_cfg("train.lr=0.9"), store)["run_id"]
    b1, b2 = blocks(store, one)[5], blocks(store, two)[5]
    assert b1.public_key == b2.public_key and b1.hash != b2.hash
    with store.session() as s:
        s.execute(SS.LedgerBlock.__table__.delete().where(SS.LedgerBlock.id == b1.id))
        s.execute(update(SS.LedgerBlock).where(SS.LedgerBlock.id == b2.id).values(run_id=one))
    view = F.ChainView(store, one)
    view.refresh()
    assert 5 in view.rejected and view.blocks[5].fatal and "the chain is broken here" in view.blocks[5].rejected
    assert 5 not in view.pending and 5 not in view.models
    rep = verify_chain(store, one)
    assert not rep.ok and rep.height == 5 and "does not match the hash of block 4" in rep.reason


def test_block_signatures_and_keys_must_be_lowercase_hex(chain):
    """t4: bytes.fromhex accepts spaces and capitals, so a stored signature's text could change
    and still verify. Only 128 (signature) / 64 (key) lowercase hex digits verify now."""
    store, run_id, _ = chain
    rows = blocks(store, run_id)
    b = rows[5]
    assert F.verify_block_signature(b.public_key, b.hash, b.signature)
    for sig in (b.signature.upper(), " ".join(b.signature[i:i + 2] for i in range(0, 128, 2)), b.signature + "\n"):
        assert not F.verify_block_signature(b.public_key, b.hash, sig)
    assert not F.verify_block_signature(b.public_key.upper(), b.hash, b.signature)
    assert not F.verify_block_signature(b.public_key, b.hash.upper(), b.signature)
    with store.session() as s:
        s.execute(update(SS.LedgerBlock).where(SS.LedgerBlock.id == b.id).values(signature=b.signature.upper()))
    rep = verify_chain(store, run_id)
    assert not rep.ok and rep.height == 5 and "bad signature" in rep.reason
