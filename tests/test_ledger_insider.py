"""Issue 32, "the ledger caps each member": one member of a ledger run cannot make up an aggregate.

Before: the rule took the K oldest pending update blocks whatever their peer, and ``num_examples``
was whatever an update claimed, so K updates from peer 0 formed an aggregate on their own (the
new model was exactly the attacker's parameters) and ``ledger verify`` said OK; and a peer's
chain view took a genesis block without a member list that ``verify`` refused. Now an aggregate
holds at most one update per peer (each of the first K distinct peers' oldest pending update),
``num_examples`` is bounded by the genesis rule's ``max_examples``, and every reader (each peer's
``ChainView`` and ``verify``, one check) refuses a block or a genesis that breaks this.
"""

import hashlib

import numpy as np
import pytest

from conftest import small_config
from fedasync.server.strategies import Update, params_sha256
from fedasync.serverless import flchain as F
from fedasync.serverless.common import PeerTask
from fedasync.serverless.ledger_peer import LedgerPeer, Work
from fedasync.serverless.ledger_rule import UpdateIn, select_updates
from fedasync.serverless.ledger_verify import verify_chain
from fedasync.serverless.runs import create_run
from fedasync.store import Store, encode_params

# 6 peers, K = 3, server_lr 1: an aggregate of three identical updates is exactly those parameters
CFG = ["data.num_clients=6", "server.concurrency=6", "server.buffer_size=3", "server.server_lr=1.0",
       "server.max_versions=null", "train.local_steps=3", "server.target_accuracy=null"]
AUTHORITY = F.simulation_key(0, "genesis")


def key(i):
    return F.simulation_key(0, f"peer-{i}")


@pytest.fixture
def ledger(tmp_path):
    """(store, run_id, task): a new chain of 6 members with only its genesis block."""
    cfg = small_config(*CFG)
    store = Store(f"sqlite:///{tmp_path / 'insider.db'}")
    task = PeerTask(cfg)
    run_id = F.create_ledger(store, cfg, F.Rule.from_config(cfg), AUTHORITY, "wall", 0.0,
                             members={i: key(i) for i in range(6)}, init=task.init)
    return store, run_id, task


def append(store, run_id, task, peer, params=None, num_examples=5, aggregate=False):
    """Member ``peer`` appends one update from the head model (``params``, or the head model
    nudged by its id); (the peer, the update's height, the aggregate's height or None)."""
    p = LedgerPeer(store, run_id, peer, key(peer), task)
    base = p.view.head_model
    if params is None:
        params = {k: v + np.float32(0.01 * (peer + 1)) for k, v in p.view.params(base.height).items()}
    h = p.append_update(Work(task_id=1000 * (peer + 1) + p.view.height, base=base.height, base_hash=base.hash,
                             params=params, metrics={"num_examples": num_examples}))
    return p, h, (p.try_aggregate() if aggregate else None)


def evil_params(view):
    return {k: np.full_like(v, 7.0) for k, v in view.params(0).items()}


def is_evil(params):
    return all(np.all(a == 7.0) for a in params.values())


def test_the_rule_takes_each_peers_oldest_pending_update_until_k_distinct_peers():
    pending = [(10, 0), (11, 0), (12, 1), (13, 0), (14, 2), (15, 3)]
    assert select_updates(pending, 3) == [10, 12, 14]
    assert select_updates(pending, 4) == [10, 12, 14, 15]
    assert select_updates(pending, 5) is None
    assert select_updates([(10, 0), (11, 0), (12, 0)], 3) is None


def test_k_updates_from_one_peer_never_form_an_aggregate(ledger):
    """Peer 0 appends K = 3 updates whose parameters are all 7.0 and tries to aggregate after
    each: no aggregate (before: the third formed one, and the new model was exactly 7.0).
    Honest peers 1 and 2 then append one each: their aggregate holds one update per peer, the
    attacker's oldest and theirs; its other two stay pending."""
    store, run_id, task = ledger
    view = F.ChainView(store, run_id)
    view.refresh()
    evil = evil_params(view)
    mine = []
    for _ in range(3):
        _, h, agg = append(store, run_id, task, 0, evil, aggregate=True)
        mine.append(h)
        assert agg is None
    view.refresh()
    assert view.num_aggregates == 0 and view.pending == mine
    _, h1, agg1 = append(store, run_id, task, 1, aggregate=True)
    assert agg1 is None  # two distinct peers pending
    _, h2, agg = append(store, run_id, task, 2, aggregate=True)
    assert agg is not None
    view.refresh()
    assert view.blocks[agg].meta["updates"] == [mine[0], h1, h2]
    assert view.pending == mine[1:]
    assert not is_evil(view.params(agg))
    rep = verify_chain(store, run_id)
    assert rep.ok, rep.line()


def _fedbuff_over(view, names):
    """FedBuff over exactly ``names`` from the head model, as a forger computes it (the server's
    class, no per-peer check)."""
    strategy = view.rule.strategy()
    parent = view.models[-1]
    out = None
    for u in names:
        x: UpdateIn = view.update_in(u)
        out = strategy.add(view.params(parent), Update(task_id=u, client_id=x.peer, params=x.params,
                                                       base_params=x.base_params, base_version=x.base_index,
                                                       staleness=x.staleness, num_examples=x.num_examples),
                           view.model_index[parent])
    return out


def test_a_forged_aggregate_with_two_updates_of_one_peer_is_refused_by_peers_and_verify(ledger):
    """Peer 0 appends two updates, peer 1 one; peer 0 signs an aggregate of those three (the
    three oldest pending, parameters FedBuff recomputed bit for bit). Before: accepted by every
    peer and by verify. Now every reader rejects it, the head model stays genesis, and honest
    peer 2's aggregate takes one update per peer."""
    store, run_id, task = ledger
    view = F.ChainView(store, run_id)
    view.refresh()
    evil = evil_params(view)
    a0 = append(store, run_id, task, 0, evil)[1]
    a1 = append(store, run_id, task, 0, evil)[1]
    h1 = append(store, run_id, task, 1)[1]
    view.refresh()
    names = [a0, a1, h1]
    assert view.pending == names
    new = _fedbuff_over(view, names)
    meta = {"updates": names, "parent": 0, "parent_hash": view.blocks[0].hash, "model_index": 1,
            "staleness": [0, 0, 0], "peer": 0, "params_sha256": params_sha256(new)}
    forged = view.height + 1
    assert F.try_append(store, run_id, key(0), forged, view.head.hash, "aggregate", encode_params(new), meta,
                        None, 0)
    peer = LedgerPeer(store, run_id, 2, key(2), task)
    assert peer.view.rejected == [forged] and peer.view.models == [0]
    assert "but the rule takes none" in peer.view.blocks[forged].rejected
    assert peer.start_task(5).base == 0  # trains from genesis, not from the forged model
    rep = verify_chain(store, run_id)
    assert not rep.ok and rep.height == forged and rep.kind == "aggregate" and rep.fatal is None
    _, h2, agg = append(store, run_id, task, 2, aggregate=True)
    view.refresh()
    assert view.blocks[agg].meta["updates"] == [a0, h1, h2] and view.pending == [a1]


def test_an_inflated_num_examples_is_refused_by_peers_and_verify(ledger):
    """Peer 0 claims 10**9 examples (a valid integer) for parameters all 7.0: under example
    weighting that update would be nearly the whole aggregate. Before: accepted as pending by
    every peer and by verify. Now it is over the genesis rule's max_examples: every reader
    rejects it and the honest peers aggregate without it."""
    store, run_id, task = ledger
    view = F.ChainView(store, run_id)
    view.refresh()
    bound = max(len(y) for _, y in task.fed.partitions)  # the largest partition of the run's data
    bad = append(store, run_id, task, 0, evil_params(view), num_examples=10**9)[1]
    ok = append(store, run_id, task, 3, num_examples=bound)[1]  # at the bound: accepted
    view.refresh()
    assert view.rejected == [bad] and bad not in view.pending and ok in view.pending
    assert view.rule.max_examples == bound == view.blocks[0].meta["rule"]["max_examples"]
    why = f"meta.num_examples 1000000000 is over the rule's max_examples ({bound}, the largest partition of the run)"
    assert view.blocks[bad].rejected == why
    agg = None
    for i in (1, 2):
        agg = append(store, run_id, task, i, aggregate=True)[2] or agg
    view.refresh()
    assert agg is not None and bad not in view.blocks[agg].meta["updates"]
    rep = verify_chain(store, run_id)
    assert not rep.ok and rep.height == bad and rep.reason == why and agg in rep.counts["aggregate_heights"]


@pytest.mark.parametrize("missing", ["members", "max_examples"])
def test_a_genesis_without_members_or_bound_is_refused_by_a_peer_as_by_verify(tmp_path, missing):
    """A genesis block signed by the authority with no member list (or a rule with no
    max_examples). Before: verify refused the first, a peer's chain view took it (and both took
    the second). Now both refuse it, with the same reason."""
    cfg = small_config(*CFG)
    store = Store(f"sqlite:///{tmp_path / 'g.db'}")
    init = PeerTask(cfg).init
    rule = F.Rule.from_config(cfg, max_examples=None if missing == "max_examples" else 100).to_dict()
    meta = {"rule": rule, "name": cfg.name, "seed": cfg.seed, "num_peers": 6, "params_sha256": params_sha256(init),
            "config_sha256": hashlib.sha256(cfg.to_yaml().encode()).hexdigest(), "nonce": "n"}
    if missing != "members":
        meta["members"] = [{"peer": i, "public_key": F.key_hex(key(i))} for i in range(6)]
    run_id = create_run(store, cfg, "ledger", "ledger-fedbuff", {"rule": rule}, "wall")
    assert F.try_append(store, run_id, AUTHORITY, 0, F.ZERO_HASH, "genesis", encode_params(init), meta, 0.0, None)
    rep = verify_chain(store, run_id)
    assert not rep.ok and rep.height == 0
    assert ("meta.members is missing" if missing == "members" else "max_examples None") in rep.reason
    view = F.ChainView(store, run_id)
    with pytest.raises(F.ChainError) as e:
        view.refresh()
    assert str(e.value) == f"run {run_id}: the genesis block: {rep.reason}"
    with pytest.raises(F.ChainError):
        LedgerPeer(store, run_id, 0, key(0), PeerTask(cfg))
