"""FLchain: a ledger of signed model updates in the SQL store that anyone can audit.

This module is the chain itself: the block format and hashing, who may sign (membership),
the aggregation rule, a peer's view of the chain (:class:`ChainView`) and appending.
A peer's loop is :mod:`fedasync.serverless.ledger_peer`; the auditor is
:mod:`fedasync.serverless.ledger_verify`.

Blocks (table ``ledger_blocks``, one chain per run)
---------------------------------------------------
``height`` (0, 1, 2, ... with no gaps, ``UNIQUE (run_id, height)``), ``prev_hash`` (the hash of
the block at ``height - 1``; 64 zeros for genesis), ``kind`` (``genesis`` | ``member`` |
``update`` | ``aggregate``), ``payload_sha256`` (sha256 of the payload bytes: parameters encoded
with ``fedasync.store.encode_params``, stored once in ``ledger_payloads``; empty for a member
block), ``meta_json``, ``public_key`` (raw Ed25519, hex), ``created`` (epoch seconds; virtual
seconds in the simulator), and

- ``hash = sha256(canonical JSON [1, height, prev_hash, kind, payload_sha256, meta_json,
  public_key, repr(created)])``,
- ``signature = Ed25519(b"fedasync-block-v1\\n" + bytes.fromhex(hash))`` by ``public_key``.

Kinds
-----
- **genesis** (height 0): the initial model; ``meta.rule`` fixes the aggregation rule for the
  whole chain: FedBuff with ``buffer_size`` K, ``server_lr``, ``staleness`` ``{fn, a, b}``,
  ``weighting`` and ``max_aggregates`` (``--max-steps``; null: no limit). ``meta.members``
  pins the signers: ``[{"peer": i, "public_key": hex}, ...]``.
- **member**: ``meta.op`` ``add`` (``peer``, ``public_key``) or ``remove`` (``peer``); no payload.
- **update**: a peer's new parameters ``x_i`` after local training from the model block it
  read, named by ``meta.base`` (its height) and ``meta.base_hash``. Also ``peer``, ``task_id``,
  ``num_examples``, ``loss``, ``epsilon`` (DP) and ``params_sha256``.
- **aggregate**: the next model. ``meta.updates`` names exactly the K **oldest pending** update
  blocks (pending: accepted, and not named by an earlier aggregate), ``meta.parent`` the latest
  model block. The parameters are the FedBuff rule (:class:`fedasync.server.strategies.FedBuff`,
  the server's own code) applied to those updates in height order, from the parent model: the
  update at height ``u`` with base model ``b`` has staleness ``s = m(u) - m(b)``, where ``m(h)``
  is the number of model blocks (genesis and aggregates) below height ``h``, minus one:
  staleness is counted in model blocks, as the server counts it in versions.

Who may sign (membership)
-------------------------
- The genesis block's signer is the run's **authority** (``keys/genesis.key`` of ``fedasync
  ledger run``; derived from the seed in the simulator). ``meta.members`` lists each peer's id
  (``0..N-1``, distinct) and Ed25519 public key (distinct).
- An **update** or **aggregate** block must be signed by the key of a current member, and its
  ``meta.peer`` must be that member's id.
- Membership changes only by a **member** block signed by the authority key: ``add`` a peer id
  that is not a member, with a key no current member uses; ``remove`` a current member. The
  change holds from that height on: a removed member's later blocks are rejected, its earlier
  update blocks stay valid and are aggregated as usual. Members cannot admit anyone, so a
  stolen peer key cannot grow the set of signers; the authority key signs no updates unless it
  is also a member's key.
- A block that breaks these rules (or whose hash or signature does not verify) is
  **rejected**: :class:`ChainView`, what every peer aggregates from, skips it (it is never
  pending, never aggregated, never a model), and the chain continues above it (the next block
  links to its hash, so heights stay contiguous). :func:`fedasync.serverless.ledger_verify.verify_chain`
  reports FAIL at the first such height and still walks the rest, recomputing every later
  aggregate without it: an aggregate that had folded it in would fail that recomputation.

Appending
---------
A peer reads the chain (:class:`ChainView`), builds the block for height ``head + 1`` and inserts
it with its payload in one transaction. If another peer took that height first the database's
unique constraint rejects the insert; the loser re-reads the chain and retries (an update block
is re-linked and re-signed, an aggregate is recomputed from the new pending set, or dropped
when fewer than K are left). No peer is special: whoever sees K pending updates may aggregate.
"""

from __future__ import annotations

import hashlib
import json
import re
import time
import uuid
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any, Callable

import numpy as np
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey, Ed25519PublicKey
from sqlalchemy import func, select
from sqlalchemy.exc import IntegrityError
from sqlalchemy.orm import Session

from fedasync.config import Config
from fedasync.server.strategies import params_sha256
from fedasync.serverless.common import PeerTask
from fedasync.serverless.ledger_rule import Rule, UpdateIn, compute_aggregate, same_params  # noqa: F401 (re-exported)
from fedasync.serverless.runs import create_run
from fedasync.signing import public_raw, sign_block, valid_block_key, verify_block_signature  # noqa: F401
from fedasync.store import Store, decode_params, encode_params
from fedasync.store import serverless_schema as SS

Params = dict[str, np.ndarray]

ZERO_HASH = "0" * 64
HASH_VERSION = 1
KINDS = ("genesis", "member", "update", "aggregate")
EMPTY_SHA256 = hashlib.sha256(b"").hexdigest()  # the payload of a member block


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


def key_hex(key: Ed25519PrivateKey | Ed25519PublicKey | str) -> str:
    """A key as the chain writes it: the raw public key, 64 lowercase hex digits."""
    return key.lower() if isinstance(key, str) else public_raw(key).hex()


# -- membership -----------------------------------------------------------------------------------


def _peer_id(x: Any) -> int | None:
    return x if isinstance(x, int) and not isinstance(x, bool) else None


class Membership:
    """Who may sign which block, as of the height being read (see the module docstring)."""

    def __init__(self, authority: str, num_peers: int, members: dict[int, str]):
        self.authority = authority
        self.num_peers = num_peers
        self.by_peer: dict[int, str] = dict(members)
        self.by_key: dict[str, int] = {k: p for p, k in members.items()}
        self.removed: dict[str, tuple[int, int]] = {}  # key -> (peer, height of the member block)

    @classmethod
    def from_genesis(cls, public_key: str, meta: dict) -> "Membership":
        """The genesis block's members; ValueError (why) if the list is not a valid one."""
        n = _peer_id(meta.get("num_peers"))
        if n is None or n < 1:
            raise ValueError("meta.num_peers is missing")
        rows = meta.get("members")
        if not isinstance(rows, list):
            raise ValueError("meta.members is missing: the chain does not pin its signers")
        members: dict[int, str] = {}
        for r in rows:
            p = _peer_id(r.get("peer")) if isinstance(r, dict) else None
            k = r.get("public_key") if isinstance(r, dict) else None
            if p is None or not 0 <= p < n:
                raise ValueError(f"meta.members: peer {r!r} is not an id in 0..{n - 1}")
            if not valid_block_key(k):
                raise ValueError(f"meta.members: peer {p}'s public_key is not a raw Ed25519 key (hex)")
            if p in members or k in members.values():
                raise ValueError(f"meta.members: peer {p} or its key is listed twice")
            members[p] = k
        return cls(public_key, n, members)

    def peer_of(self, key: str) -> int | None:
        return self.by_key.get(key)

    def key_of(self, peer: int) -> str | None:
        return self.by_peer.get(peer)

    def check(self, kind: str, public_key: str, meta: dict) -> str | None:
        """None if the block at hand may be appended by ``public_key``; else why not."""
        if kind == "genesis":
            return "a second genesis block"
        if kind == "member":
            if public_key != self.authority:
                return (f"a member block must be signed by the run's authority key ({self.authority[:16]}), "
                        f"not {public_key[:16]}")
            op, p = meta.get("op"), _peer_id(meta.get("peer"))
            if p is None or not 0 <= p < self.num_peers:
                return f"meta.peer {meta.get('peer')!r} is not a peer id in 0..{self.num_peers - 1}"
            if op == "add":
                k = meta.get("public_key")
                if p in self.by_peer:
                    return f"peer {p} is already a member"
                if not valid_block_key(k):
                    return "meta.public_key is not a raw Ed25519 key (hex)"
                if k in self.by_key:
                    return f"that key is already peer {self.by_key[k]}'s"
                return None
            if op == "remove":
                return None if p in self.by_peer else f"peer {p} is not a member"
            return f"meta.op {op!r} is not add or remove"
        signer = self.by_key.get(public_key)
        claim = meta.get("peer")
        if signer is None:
            if public_key in self.removed:
                p, h = self.removed[public_key]
                return f"signed by the key of peer {p}, removed from the run at height {h}"
            if public_key == self.authority:
                return "signed by the run's authority key, which signs genesis and member blocks only"
            return f"signed by key {public_key[:16]}, which is not a member of the run"
        if _peer_id(claim) != signer:
            return f"signed by peer {signer}'s key but claims to be peer {claim!r}"
        return None

    def apply(self, height: int, meta: dict) -> None:
        """A member block that passed :meth:`check`."""
        p = int(meta["peer"])
        if meta["op"] == "add":
            k = meta["public_key"]
            self.by_peer[p], self.by_key[k] = k, p
            self.removed.pop(k, None)
        else:
            k = self.by_peer.pop(p)
            del self.by_key[k]
            self.removed[k] = (p, height)


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
    rejected: str | None = None  # why every peer ignores this block (see "Who may sign")

    @classmethod
    def from_row(cls, r: SS.LedgerBlock) -> "Block":
        try:
            meta = json.loads(r.meta_json)
        except (TypeError, ValueError):
            meta = {}
        return cls(r.height, r.prev_hash, r.hash, r.kind, r.payload_sha256, meta if isinstance(meta, dict) else {},
                   r.meta_json, r.public_key, r.signature, r.created, r.peer_id)

    def intact(self) -> str | None:
        """None if the hash recomputes and the signature verifies; else which does not."""
        try:
            h = block_hash(self.height, self.prev_hash, self.kind, self.payload_sha256, self.meta_json,
                           self.public_key, self.created)
        except (TypeError, ValueError) as e:
            return f"cannot hash the block ({e})"
        if h != self.hash:
            return "hash mismatch: the block's contents are not what was hashed and signed"
        if not verify_block_signature(self.public_key, self.hash, self.signature):
            return f"bad signature (key {self.public_key[:16]})"
        return None


class ChainView:
    """A peer's incrementally refreshed copy of the chain's headers (blocks are immutable).

    Every block is checked as it is read (hash, signature, membership); a block that fails is
    kept at its height with ``rejected`` set and otherwise ignored."""

    def __init__(self, store: Store, run_id: int, cache_size: int = 64):
        self.store = store
        self.run_id = run_id
        self.blocks: list[Block] = []
        self.models: list[int] = []  # heights of model blocks (genesis, aggregates); index = model index
        self.model_index: dict[int, int] = {}
        self.pending: list[int] = []  # accepted update heights not yet aggregated, oldest first
        self.arrival: dict[int, int] = {}  # update height -> model index of the latest model below it
        self.rejected: list[int] = []  # heights every peer ignores
        self.members: Membership | None = None  # None: a chain written before signers were pinned
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
        if b.kind not in KINDS:
            raise ChainError(f"run {self.run_id}: block {h} has unknown kind {b.kind!r}")
        why = b.intact()
        if h == 0:
            if b.kind != "genesis":
                raise ChainError(f"run {self.run_id}: block 0 is {b.kind!r}, not genesis")
            if why:
                raise ChainError(f"run {self.run_id}: the genesis block: {why}")
            self.rule = Rule.from_dict(b.meta["rule"])
            try:
                self.members = Membership.from_genesis(b.public_key, b.meta)
            except ValueError:
                self.members = None  # readable (ledger show); LedgerPeer and verify refuse it
        elif why is None and self.members is not None:
            why = self.members.check(b.kind, b.public_key, b.meta)
        if why is not None:
            b.rejected = why
            self.rejected.append(h)
        elif b.kind in ("genesis", "aggregate"):
            if b.kind == "aggregate":
                named = set(b.meta.get("updates", []))
                self.pending = [u for u in self.pending if u not in named]
            self.model_index[h] = len(self.models)
            self.models.append(h)
        elif b.kind == "update":
            self.pending.append(h)
            self.arrival[h] = len(self.models) - 1
        elif self.members is not None:  # member
            self.members.apply(h, b.meta)
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

    def accepted(self, kind: str | None = None) -> list[Block]:
        """The blocks every peer acts on (not rejected), of ``kind`` if given."""
        return [b for b in self.blocks if b.rejected is None and (kind is None or b.kind == kind)]

    def payload(self, sha: str) -> Params:
        if sha in self._cache:
            self._cache.move_to_end(sha)
            return self._cache[sha]
        with self.store.session() as s:
            data = s.scalar(select(SS.LedgerPayload.data).where(SS.LedgerPayload.sha256 == sha))
        if data is None:
            raise ChainError(f"run {self.run_id}: payload {sha[:12]} is missing")
        if payload_digest(data) != sha:
            raise ChainError(f"run {self.run_id}: payload {sha[:12]} was changed in the store")
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
    transaction (e.g. the peer's privacy spend). Nothing here checks membership: a block from a
    key that may not sign is stored like any other, and every reader rejects it."""
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
                  members: dict[int, Any], settings: dict | None = None, nonce: str | None = None,
                  init: Params | None = None) -> int:
    """A new ledger run: the run's rows and the genesis block (the initial model, signed by the
    run's authority ``key``), pinning ``members`` ({peer id: public key}) as the signers."""
    if init is None:
        init = PeerTask(cfg).init
    pinned = [{"peer": int(p), "public_key": key_hex(k)} for p, k in sorted(members.items())]
    settings = dict(settings or {})
    settings.update({"rule": rule.to_dict()})
    meta = {
        "rule": rule.to_dict(), "name": cfg.name, "seed": cfg.seed, "num_peers": cfg.data.num_clients,
        "members": pinned, "params_sha256": params_sha256(init),
        "config_sha256": hashlib.sha256(cfg.to_yaml().encode()).hexdigest(),
        "nonce": nonce or uuid.uuid4().hex,
    }
    try:
        Membership.from_genesis(key_hex(key), meta)
    except ValueError as e:
        raise ChainError(f"cannot start a ledger: {e}") from None
    run_id = create_run(store, cfg, "ledger", "ledger-fedbuff", settings, clock)
    if try_append(store, run_id, key, 0, ZERO_HASH, "genesis", encode_params(init), meta, created, None) is None:
        raise ChainError(f"run {run_id}: genesis height already taken")  # pragma: no cover - a new run
    return run_id


def append_member(store: Store, run_id: int, authority: Ed25519PrivateKey, op: str, peer: int,
                  public_key: Any = None, created: float | None = None, max_retries: int = 1000) -> int:
    """Append a member block (``op`` add | remove) signed by the run's authority key; its height.

    Raises :class:`ChainError` with the reason if the chain would reject it."""
    meta: dict[str, Any] = {"op": op, "peer": peer}
    if op == "add":
        meta["public_key"] = key_hex(public_key)
    view = ChainView(store, run_id)
    for _ in range(max_retries):
        view.refresh()
        if not view.blocks:
            raise ChainError(f"run {run_id}: the chain is empty")
        if view.members is None:
            raise ChainError(f"run {run_id}: the genesis block pins no signers (a chain from an older fedasync)")
        why = view.members.check("member", key_hex(authority), meta)
        if why:
            raise ChainError(f"run {run_id}: {why}")
        height = view.height + 1
        if try_append(store, run_id, authority, height, view.head.hash, "member", b"", meta, created,
                      None) is not None:
            return height
    raise ChainError(f"run {run_id}: could not append a member block in {max_retries} tries")
