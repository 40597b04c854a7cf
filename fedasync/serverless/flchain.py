"""FLchain: a ledger of signed model updates in the SQL store that anyone can audit.

Blocks (table ``ledger_blocks``, one chain per run)
---------------------------------------------------
``height`` (0, 1, 2, ... with no gaps, ``UNIQUE (run_id, height)``), ``prev_hash`` (the hash of
the block at ``height - 1``; 64 zeros for genesis), ``kind`` (``genesis`` | ``update`` |
``aggregate``), ``payload_sha256`` (sha256 of the payload bytes: parameters encoded with
``fedasync.store.encode_params``, stored once in ``ledger_payloads``), ``meta_json``,
``public_key`` (raw Ed25519, hex), ``created`` (epoch seconds; virtual seconds in the
simulator), and

- ``hash = sha256(canonical JSON [1, height, prev_hash, kind, payload_sha256, meta_json,
  public_key, repr(created)])``,
- ``signature = Ed25519(b"fedasync-block-v1\\n" + bytes.fromhex(hash))`` by ``public_key``.

Kinds
-----
- **genesis** (height 0): the initial model; ``meta.rule`` fixes the aggregation rule for the
  whole chain: FedBuff with ``buffer_size`` K, ``server_lr``, ``staleness`` ``{fn, a, b}``,
  ``weighting`` and ``max_aggregates`` (``--max-steps``; null: no limit).
- **update**: a peer's new parameters ``x_i`` after local training from the model block it
  read, named by ``meta.base`` (its height) and ``meta.base_hash``. Also ``peer``, ``task_id``,
  ``num_examples``, ``loss``, ``epsilon`` (DP) and ``params_sha256``.
- **aggregate**: the next model. ``meta.updates`` names exactly the K **oldest pending** update
  blocks (pending: not named by an earlier aggregate), ``meta.parent`` the latest model block.
  The parameters are the FedBuff rule (:class:`fedasync.server.strategies.FedBuff`, the server's
  own code) applied to those updates in height order, from the parent model: the update at
  height ``u`` with base model ``b`` has staleness ``s = m(u) - m(b)``, where ``m(h)`` is the
  number of model blocks (genesis and aggregates) below height ``h``, minus one: staleness is
  counted in model blocks, as the server counts it in versions.

Appending
---------
A peer reads the chain (:class:`ChainView`), builds the block for height ``head + 1`` and inserts
it with its payload in one transaction. If another peer took that height first the database's
unique constraint rejects the insert; the loser re-reads the chain and retries (an update block
is re-linked and re-signed, an aggregate is recomputed from the new pending set, or dropped
when fewer than K are left). No peer is special: whoever sees K pending updates may aggregate.

Verifying (:func:`verify_chain`)
--------------------------------
Re-checks every height, hash link, block hash, signature, payload hash and payload shape, every
update's base, and **recomputes every aggregate** from the update blocks it names, comparing
the arrays bit for bit. The first failure is reported with its height and why.
"""

from __future__ import annotations

import hashlib
import json
import logging
import time
import uuid
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any, Callable

import numpy as np
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
from sqlalchemy import func, select
from sqlalchemy.exc import IntegrityError
from sqlalchemy.orm import Session

from fedasync.config import Config, ServerConfig, StalenessConfig
from fedasync.server.strategies import Update, make_strategy, params_sha256
from fedasync.signing import public_raw, sign_block, verify_block_signature  # noqa: F401 (re-exported)
from fedasync.store import Store, decode_params, encode_params
from fedasync.store import serverless_schema as SS

log = logging.getLogger("fedasync.ledger")

Params = dict[str, np.ndarray]

ZERO_HASH = "0" * 64
HASH_VERSION = 1
KINDS = ("genesis", "update", "aggregate")


class ChainError(RuntimeError):
    """The chain in the store is not one this code can extend (run ``fedasync ledger verify``)."""


# -- hashing and signing --------------------------------------------------------------------------


def canonical_json(obj: Any) -> str:
    return json.dumps(obj, sort_keys=True, separators=(",", ":"), allow_nan=False)


def block_hash(height: int, prev_hash: str, kind: str, payload_sha256: str, meta_json: str, public_key: str,
               created: float) -> str:
    body = json.dumps([HASH_VERSION, int(height), prev_hash, kind, payload_sha256, meta_json, public_key,
                       repr(float(created))], separators=(",", ":"))
    return hashlib.sha256(body.encode()).hexdigest()


def payload_digest(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def simulation_key(seed: int, name: str) -> Ed25519PrivateKey:
    """A key derived from the seed, so a simulated chain is a pure function of config and seed.
    Anyone who knows the seed can sign with it: for the simulator only, never for deployment."""
    return Ed25519PrivateKey.from_private_bytes(hashlib.sha256(f"fedasync-sim-key:{seed}:{name}".encode()).digest())


# -- the aggregation rule -------------------------------------------------------------------------


@dataclass(frozen=True)
class Rule:
    buffer_size: int
    server_lr: float
    staleness: dict
    weighting: str
    max_aggregates: int | None

    @classmethod
    def from_config(cls, cfg: Config, max_aggregates: int | None = None) -> "Rule":
        s = cfg.server
        return cls(buffer_size=s.buffer_size, server_lr=s.server_lr,
                   staleness={"fn": s.staleness.fn, "a": s.staleness.a, "b": s.staleness.b},
                   weighting="examples" if cfg.weighting == "examples" else "uniform",
                   max_aggregates=max_aggregates)

    @classmethod
    def from_dict(cls, d: dict) -> "Rule":
        return cls(buffer_size=int(d["buffer_size"]), server_lr=float(d["server_lr"]),
                   staleness=dict(d["staleness"]), weighting=str(d["weighting"]),
                   max_aggregates=None if d.get("max_aggregates") is None else int(d["max_aggregates"]))

    def to_dict(self) -> dict:
        return {"rule": "fedbuff", "buffer_size": self.buffer_size, "server_lr": self.server_lr,
                "staleness": dict(self.staleness), "weighting": self.weighting,
                "max_aggregates": self.max_aggregates}

    def strategy(self):
        cfg = ServerConfig(strategy="fedbuff", buffer_size=self.buffer_size, server_lr=self.server_lr,
                           staleness=StalenessConfig(**self.staleness))
        return make_strategy(cfg, self.weighting)


@dataclass
class UpdateIn:
    """One update block as the FedBuff rule sees it."""

    height: int
    peer: int
    params: Params
    base_params: Params
    base_index: int
    staleness: int
    num_examples: int


def compute_aggregate(rule: Rule, parent: Params, parent_index: int, updates: list[UpdateIn]) -> Params:
    """The new model: FedBuff (the server's class) over exactly ``updates``, in this order."""
    if len(updates) != rule.buffer_size:
        raise ValueError(f"an aggregate takes exactly K={rule.buffer_size} updates, got {len(updates)}")
    strategy = rule.strategy()
    out = None
    for u in updates:
        out = strategy.add(parent, Update(task_id=u.height, client_id=u.peer, params=u.params,
                                          base_params=u.base_params, base_version=u.base_index,
                                          staleness=u.staleness, num_examples=u.num_examples), parent_index)
    assert out is not None
    return out


def same_params(a: Params, b: Params) -> bool:
    """Bit for bit: keys in order, dtypes, shapes and bytes."""
    return params_sha256(a) == params_sha256(b)


# -- reading the chain ----------------------------------------------------------------------------


@dataclass
class Block:
    height: int
    prev_hash: str
    hash: str
    kind: str
    payload_sha256: str
    meta: dict
    meta_json: str
    public_key: str
    signature: str
    created: float
    peer_id: int | None

    @classmethod
    def from_row(cls, r: SS.LedgerBlock) -> "Block":
        try:
            meta = json.loads(r.meta_json)
        except (TypeError, ValueError):
            meta = {}
        return cls(r.height, r.prev_hash, r.hash, r.kind, r.payload_sha256, meta if isinstance(meta, dict) else {},
                   r.meta_json, r.public_key, r.signature, r.created, r.peer_id)


class ChainView:
    """A peer's incrementally refreshed copy of the chain's headers (blocks are immutable)."""

    def __init__(self, store: Store, run_id: int, cache_size: int = 64):
        self.store = store
        self.run_id = run_id
        self.blocks: list[Block] = []
        self.models: list[int] = []  # heights of model blocks (genesis, aggregates); index = model index
        self.model_index: dict[int, int] = {}
        self.pending: list[int] = []  # update heights not yet aggregated, oldest first
        self.arrival: dict[int, int] = {}  # update height -> model index of the latest model below it
        self._cache: OrderedDict[str, Params] = OrderedDict()
        self._cache_size = cache_size
        self.rule: Rule | None = None

    def refresh(self) -> int:
        """Read blocks above the known head; returns how many were new."""
        with self.store.session() as s:
            rows = list(s.scalars(select(SS.LedgerBlock)
                                  .where(SS.LedgerBlock.run_id == self.run_id,
                                         SS.LedgerBlock.height >= len(self.blocks))
                                  .order_by(SS.LedgerBlock.height)))
        for r in rows:
            self._apply(Block.from_row(r))
        return len(rows)

    def _apply(self, b: Block) -> None:
        h = len(self.blocks)
        if b.height != h:
            raise ChainError(f"run {self.run_id}: block heights jump from {h - 1} to {b.height}")
        if h == 0:
            if b.kind != "genesis":
                raise ChainError(f"run {self.run_id}: block 0 is {b.kind!r}, not genesis")
            self.rule = Rule.from_dict(b.meta["rule"])
        if b.kind in ("genesis", "aggregate"):
            if b.kind == "aggregate":
                named = set(b.meta.get("updates", []))
                self.pending = [u for u in self.pending if u not in named]
            self.model_index[h] = len(self.models)
            self.models.append(h)
        elif b.kind == "update":
            self.pending.append(h)
            self.arrival[h] = len(self.models) - 1
        else:
            raise ChainError(f"run {self.run_id}: block {h} has unknown kind {b.kind!r}")
        self.blocks.append(b)

    @property
    def height(self) -> int:
        return len(self.blocks) - 1

    @property
    def head(self) -> Block:
        return self.blocks[-1]

    @property
    def head_model(self) -> Block:
        return self.blocks[self.models[-1]]

    @property
    def num_aggregates(self) -> int:
        return len(self.models) - 1

    def payload(self, sha: str) -> Params:
        if sha in self._cache:
            self._cache.move_to_end(sha)
            return self._cache[sha]
        with self.store.session() as s:
            data = s.scalar(select(SS.LedgerPayload.data).where(SS.LedgerPayload.sha256 == sha))
        if data is None:
            raise ChainError(f"run {self.run_id}: payload {sha[:12]} is missing")
        params = decode_params(data)
        self._cache[sha] = params
        while len(self._cache) > self._cache_size:
            self._cache.popitem(last=False)
        return params

    def params(self, height: int) -> Params:
        return self.payload(self.blocks[height].payload_sha256)

    def staleness(self, update_height: int) -> int:
        base = int(self.blocks[update_height].meta["base"])
        return self.arrival[update_height] - self.model_index[base]

    def update_in(self, height: int) -> UpdateIn:
        b = self.blocks[height]
        base = int(b.meta["base"])
        return UpdateIn(height=height, peer=int(b.meta.get("peer", -1)), params=self.params(height),
                        base_params=self.params(base), base_index=self.model_index[base],
                        staleness=self.staleness(height), num_examples=int(b.meta.get("num_examples", 0)))


# -- writing --------------------------------------------------------------------------------------


def _insert_payload(s: Session, sha: str, data: bytes) -> None:
    """Insert the payload unless it is already stored (payloads are stored once)."""
    dialect = s.get_bind().dialect.name
    values = {"sha256": sha, "data": data, "size": len(data)}
    if dialect == "postgresql":
        from sqlalchemy.dialects.postgresql import insert
    elif dialect == "sqlite":
        from sqlalchemy.dialects.sqlite import insert
    else:  # pragma: no cover - other backends: check first (a race is settled by the primary key)
        if s.get(SS.LedgerPayload, sha) is None:
            s.add(SS.LedgerPayload(**values))
            s.flush()
        return
    s.execute(insert(SS.LedgerPayload).values(**values).on_conflict_do_nothing(index_elements=["sha256"]))


def try_append(store: Store, run_id: int, key: Ed25519PrivateKey, height: int, prev_hash: str, kind: str,
               data: bytes, meta: dict, created: float | None, peer_id: int | None,
               extra: Callable[[Session], None] | None = None) -> str | None:
    """Insert one block (and its payload) at ``height``; its hash, or None if the height is taken.

    ``created``: the block's time (None: now, wall clock). ``extra(session)`` runs in the same
    transaction (e.g. the peer's privacy spend)."""
    created = time.time() if created is None else float(created)
    sha = payload_digest(data)
    meta_json = canonical_json(meta)
    pub = public_raw(key).hex()
    h = block_hash(height, prev_hash, kind, sha, meta_json, pub, created)
    sig = sign_block(key, h)
    try:
        with store.session() as s:
            _insert_payload(s, sha, data)
            s.add(SS.LedgerBlock(run_id=run_id, height=height, prev_hash=prev_hash, hash=h, kind=kind,
                                 payload_sha256=sha, meta_json=meta_json, public_key=pub, signature=sig,
                                 created=float(created), created_wall=time.time(), peer_id=peer_id))
            s.flush()
            if extra is not None:
                extra(s)
    except IntegrityError:
        with store.session() as s:
            taken = s.scalar(select(func.count()).select_from(SS.LedgerBlock)
                             .where(SS.LedgerBlock.run_id == run_id, SS.LedgerBlock.height == height))
        if taken:
            return None
        raise
    return h


def create_ledger(store: Store, cfg: Config, rule: Rule, key: Ed25519PrivateKey, clock: str, created: float,
                  settings: dict | None = None, nonce: str | None = None) -> int:
    """A new ledger run: the run's rows and the genesis block (the initial model)."""
    from fedasync.serverless.common import PeerTask, create_run

    task = PeerTask(cfg)
    settings = dict(settings or {})
    settings.update({"rule": rule.to_dict()})
    run_id = create_run(store, cfg, "ledger", "ledger-fedbuff", settings, clock)
    meta = {
        "rule": rule.to_dict(), "name": cfg.name, "seed": cfg.seed, "num_peers": cfg.data.num_clients,
        "params_sha256": params_sha256(task.init),
        "config_sha256": hashlib.sha256(cfg.to_yaml().encode()).hexdigest(),
        "nonce": nonce or uuid.uuid4().hex,
    }
    if try_append(store, run_id, key, 0, ZERO_HASH, "genesis", encode_params(task.init), meta, created, None) is None:
        raise ChainError(f"run {run_id}: genesis height already taken")  # pragma: no cover - a new run
    return run_id


@dataclass
class Work:
    """A peer's trained update, not yet appended."""

    task_id: int
    base: int  # height of the model block it started from
    base_hash: str
    params: Params | None
    metrics: dict
    refused: str | None = None


class LedgerPeer:
    """One peer: reads the head model block, trains, appends signed update and aggregate blocks.

    The same object is driven by a process loop (:func:`fedasync.serverless.runner.ledger_peer_loop`)
    or by the virtual-clock simulator (:mod:`fedasync.serverless.sim`)."""

    def __init__(self, store: Store, run_id: int, peer_id: int, key: Ed25519PrivateKey, task, privacy=None,
                 emulate: bool = False, max_retries: int = 10000):
        self.store = store
        self.run_id = run_id
        self.peer_id = peer_id
        self.key = key
        self.task = task
        self.privacy = privacy
        self.emulate = emulate
        self.view = ChainView(store, run_id)
        self.max_retries = max_retries
        self.conflicts = 0  # inserts lost to another peer (height taken)
        self.updates = 0
        self.aggregates = 0
        self.view.refresh()

    @property
    def rule(self) -> Rule:
        return self.view.rule

    def done(self) -> bool:
        m = self.rule.max_aggregates
        return m is not None and self.view.num_aggregates >= m

    def start_task(self, task_id: int) -> Work:
        """Read the head model block and train on it (the client's own code path)."""
        self.view.refresh()
        base = self.view.head_model
        pconf = self.privacy.task_config(self.peer_id) if self.privacy is not None else None
        reply = self.task.train(self.peer_id, self.view.payload(base.payload_sha256), task_id,
                                emulate=self.emulate, privacy=pconf)
        if reply.get("refused"):
            return Work(task_id, base.height, base.hash, None, dict(reply.get("metrics", {})), reply["refused"])
        return Work(task_id, base.height, base.hash, reply["params"], dict(reply["metrics"]))

    def append_update(self, work: Work, created: float | None = None) -> int:
        """Append ``work`` as a signed update block; retries until it has a height.

        ``created``: the block's time (virtual seconds in the simulator; None: wall clock, now)."""
        from fedasync.serverless.common import finite, write_privacy

        m = work.metrics
        rows, state = ([], None)
        if self.privacy is not None:
            rows, state = self.privacy.rows(self.peer_id, work.task_id, m)
        meta = {"base": work.base, "base_hash": work.base_hash, "peer": self.peer_id, "task_id": work.task_id,
                "num_examples": int(m.get("num_examples", 0)), "loss": finite(m.get("loss")),
                "epsilon": finite(m.get("epsilon")), "params_sha256": params_sha256(work.params)}
        data = encode_params(work.params)

        def extra(s: Session) -> None:
            if rows or state:
                write_privacy(s, self.run_id, self.peer_id, work.task_id, rows, state)

        for _ in range(self.max_retries):
            self.view.refresh()
            height = self.view.height + 1
            if try_append(self.store, self.run_id, self.key, height, self.view.head.hash, "update", data, meta,
                          created, self.peer_id, extra) is not None:
                self.updates += 1
                self.view.refresh()
                return height
            self.conflicts += 1
        raise ChainError(f"peer {self.peer_id}: could not append an update block in {self.max_retries} tries")

    def try_aggregate(self, created: float | None = None) -> int | None:
        """Append the aggregate block if K updates are pending (retrying lost races); its height."""
        for _ in range(self.max_retries):
            self.view.refresh()
            rule = self.rule
            if self.done() or len(self.view.pending) < rule.buffer_size:
                return None
            names = self.view.pending[: rule.buffer_size]
            parent = self.view.models[-1]
            parent_index = self.view.model_index[parent]
            ups = [self.view.update_in(h) for h in names]
            new = compute_aggregate(rule, self.view.params(parent), parent_index, ups)
            meta = {"updates": names, "parent": parent, "parent_hash": self.view.blocks[parent].hash,
                    "model_index": parent_index + 1, "staleness": [u.staleness for u in ups],
                    "peer": self.peer_id, "params_sha256": params_sha256(new)}
            height = self.view.height + 1
            if try_append(self.store, self.run_id, self.key, height, self.view.head.hash, "aggregate",
                          encode_params(new), meta, created, self.peer_id) is not None:
                self.aggregates += 1
                self.view.refresh()
                return height
            self.conflicts += 1
        raise ChainError(f"peer {self.peer_id}: could not append an aggregate block in {self.max_retries} tries")


# -- verifying ------------------------------------------------------------------------------------


@dataclass
class VerifyReport:
    ok: bool
    run_id: int
    counts: dict = field(default_factory=dict)
    height: int | None = None
    kind: str | None = None
    reason: str | None = None

    def line(self) -> str:
        c = self.counts
        if self.ok:
            return (f"OK: ledger of run {self.run_id}: {c['blocks']} blocks (genesis 1, update {c['update']}, "
                    f"aggregate {c['aggregate']}), {c['pending']} update(s) pending, {c['peers']} signer(s), "
                    f"{c['aggregates_recomputed']} aggregate(s) recomputed bit for bit")
        what = f" ({self.kind})" if self.kind else ""
        return f"FAIL: ledger of run {self.run_id}: block at height {self.height}{what}: {self.reason}"


def verify_chain(store: Store, run_id: int, batch: int = 200) -> VerifyReport:
    """Check everything a block claims; the first bad block and why (see the module docstring)."""
    counts = {"blocks": 0, "genesis": 0, "update": 0, "aggregate": 0, "pending": 0, "peers": 0,
              "aggregates_recomputed": 0}
    signers: set[str] = set()
    spec: list[tuple[str, tuple, str]] | None = None
    rule: Rule | None = None
    prev: str = ZERO_HASH
    models: list[int] = []
    model_index: dict[int, int] = {}
    model_params: OrderedDict[int, Params] = OrderedDict()
    model_sha: dict[int, str] = {}
    model_hash: dict[int, str] = {}
    pending: list[int] = []
    upd: dict[int, dict] = {}  # pending update height -> {params, base, arrival, peer, n}

    def bad(h: int, kind: str | None, why: str) -> VerifyReport:
        return VerifyReport(False, run_id, counts, h, kind, why)

    def model(h: int) -> Params:
        if h not in model_params:
            with store.session() as s2:
                data = s2.scalar(select(SS.LedgerPayload.data).where(SS.LedgerPayload.sha256 == model_sha[h]))
            if data is None or payload_digest(data) != model_sha[h]:
                raise ChainError(f"the payload of model block {h} changed while it was being verified")
            model_params[h] = decode_params(data)
        model_params.move_to_end(h)
        return model_params[h]

    q = (select(SS.LedgerBlock, SS.LedgerPayload.data)
         .outerjoin(SS.LedgerPayload, SS.LedgerPayload.sha256 == SS.LedgerBlock.payload_sha256)
         .where(SS.LedgerBlock.run_id == run_id).order_by(SS.LedgerBlock.height))
    with store.session() as s:
        expected = 0
        for row, data in s.execute(q.execution_options(yield_per=batch)):
            h, kind = row.height, row.kind
            if h != expected:
                return bad(expected, None, f"missing: the next block stored is at height {h}")
            expected += 1
            if kind not in KINDS:
                return bad(h, kind, f"unknown kind {kind!r}")
            if (h == 0) != (kind == "genesis"):
                return bad(h, kind, "block 0 must be the one genesis block" if h == 0 else "a second genesis block")
            if row.prev_hash != prev:
                return bad(h, kind, f"prev_hash {row.prev_hash[:12]} does not match the hash of block {h - 1} "
                                    f"({prev[:12]}): the chain is broken here")
            try:
                recomputed = block_hash(h, row.prev_hash, kind, row.payload_sha256, row.meta_json, row.public_key,
                                        row.created)
            except (TypeError, ValueError) as e:
                return bad(h, kind, f"cannot hash the block ({e})")
            if recomputed != row.hash:
                return bad(h, kind, "hash mismatch: the block's contents are not what was hashed and signed")
            if not verify_block_signature(row.public_key, row.hash, row.signature):
                return bad(h, kind, f"bad signature (key {row.public_key[:16]})")
            if data is None:
                return bad(h, kind, f"payload {row.payload_sha256[:12]} is missing")
            if payload_digest(data) != row.payload_sha256:
                return bad(h, kind, f"payload sha256 mismatch: the stored parameters ({row.payload_sha256[:12]}) "
                                    "were changed")
            try:
                params = decode_params(data)
                meta = json.loads(row.meta_json)
            except Exception as e:  # a payload that hashes right but does not decode was signed that way
                return bad(h, kind, f"payload or meta does not decode ({type(e).__name__})")
            this_spec = [(k, v.shape, v.dtype.str) for k, v in params.items()]
            if spec is None:
                spec = this_spec
            elif this_spec != spec:
                return bad(h, kind, "payload is not a model of the genesis model's keys, shapes and dtypes")
            if meta.get("params_sha256") != params_sha256(params):
                return bad(h, kind, "meta.params_sha256 does not match the payload's parameters")
            signers.add(row.public_key)
            counts["blocks"] += 1
            counts[kind] += 1
            prev = row.hash

            if kind == "genesis":
                try:
                    rule = Rule.from_dict(meta["rule"])
                    rule.strategy()
                except Exception as e:
                    return bad(h, kind, f"meta.rule is not a valid aggregation rule ({e})")
                model_index[h] = 0
                model_sha[h] = row.payload_sha256
                model_hash[h] = row.hash
                models.append(h)
                model_params[h] = params
            elif kind == "update":
                try:
                    base = int(meta["base"])
                    n = int(meta.get("num_examples", 0))
                except (KeyError, TypeError, ValueError):
                    return bad(h, kind, "meta.base (the model block it started from) is missing")
                if base not in model_index:
                    return bad(h, kind, f"meta.base {base} is not an earlier model block")
                if meta.get("base_hash") != model_hash[base]:
                    return bad(h, kind, f"meta.base_hash does not match block {base}")
                pending.append(h)
                upd[h] = {"params": params, "base": base, "arrival": len(models) - 1,
                          "peer": int(meta.get("peer", -1)), "n": n}
            else:  # aggregate
                names = meta.get("updates")
                k = rule.buffer_size
                if rule.max_aggregates is not None and len(models) - 1 >= rule.max_aggregates:
                    return bad(h, kind, f"more aggregates than the chain's max_aggregates ({rule.max_aggregates})")
                if not isinstance(names, list) or names != pending[:k] or len(names) != k:
                    return bad(h, kind, f"names update blocks {names} but the {k} oldest pending are {pending[:k]}")
                parent = meta.get("parent")
                if parent != models[-1]:
                    return bad(h, kind, f"meta.parent {parent} is not the latest model block ({models[-1]})")
                try:
                    ups = [UpdateIn(height=u, peer=upd[u]["peer"], params=upd[u]["params"],
                                    base_params=model(upd[u]["base"]), base_index=model_index[upd[u]["base"]],
                                    staleness=upd[u]["arrival"] - model_index[upd[u]["base"]],
                                    num_examples=upd[u]["n"]) for u in names]
                except ChainError as e:
                    return bad(h, kind, str(e))
                if meta.get("staleness") is not None and meta["staleness"] != [u.staleness for u in ups]:
                    return bad(h, kind, f"meta.staleness {meta['staleness']} differs from the chain's "
                                        f"{[u.staleness for u in ups]}")
                try:
                    expect = compute_aggregate(rule, model(parent), model_index[parent], ups)
                except Exception as e:
                    return bad(h, kind, f"cannot recompute the aggregate ({type(e).__name__}: {e})")
                if not same_params(expect, params):
                    diff = max(float(np.max(np.abs(expect[k].astype(np.float64) - params[k].astype(np.float64))))
                               for k in expect)
                    return bad(h, kind, f"parameters differ from the FedBuff aggregate recomputed from update "
                                        f"blocks {names} (max |difference| {diff:.3g})")
                counts["aggregates_recomputed"] += 1
                pending = pending[k:]
                for u in names:
                    del upd[u]
                model_index[h] = len(models)
                model_sha[h] = row.payload_sha256
                model_hash[h] = row.hash
                models.append(h)
                model_params[h] = params
                # a later update may name any earlier model block as its base: keep the recent
                # models in memory and reload older ones from the store (re-checking their hash)
                while len(model_params) > 64:
                    model_params.popitem(last=False)
        if expected == 0:
            return bad(0, None, "the chain is empty (no genesis block)")
    counts["pending"] = len(pending)
    counts["peers"] = len(signers)
    return VerifyReport(True, run_id, counts)


# -- evaluations and a summary of the chain ---------------------------------------------------------


def record_eval(store: Store, run_id: int, height: int, model_index: int, loss: float, acc: float) -> None:
    with store.session() as s:
        if s.get(SS.LedgerEval, (run_id, height)) is None:
            s.add(SS.LedgerEval(run_id=run_id, height=height, model_index=model_index, accuracy=acc, loss=loss,
                                evaluated_wall=time.time()))


def chain_overview(store: Store, run_id: int) -> dict:
    """Head, counts per kind, per-peer contributions and the evaluated model blocks."""
    view = ChainView(store, run_id)
    view.refresh()
    per_peer: dict[str, dict] = {}
    for b in view.blocks:
        if b.kind == "genesis":
            continue
        p = per_peer.setdefault(str(b.peer_id if b.peer_id is not None else b.public_key[:16]),
                                {"update": 0, "aggregate": 0, "key": b.public_key[:16]})
        p[b.kind] += 1
    with store.session() as s:
        evals = {e.height: e for e in s.scalars(select(SS.LedgerEval).where(SS.LedgerEval.run_id == run_id))}
    models = []
    for i, h in enumerate(view.models):
        e = evals.get(h)
        b = view.blocks[h]
        models.append({"model_index": i, "height": h, "created": b.created,
                       "updates": len(b.meta.get("updates", [])),
                       "accuracy": None if e is None else e.accuracy, "loss": None if e is None else e.loss})
    from fedasync.serverless.common import started_at

    kinds = {k: sum(1 for b in view.blocks if b.kind == k) for k in KINDS}
    head = view.head if view.blocks else None
    return {
        "run_id": run_id, "height": view.height, "head_hash": head.hash if head else None,
        "head_kind": head.kind if head else None, "counts": kinds, "pending": len(view.pending),
        "rule": view.rule.to_dict() if view.rule else None, "peers": per_peer, "models": models,
        "started": started_at(store, run_id) if view.blocks and view.blocks[0].created > 1e8 else 0.0,
    }
