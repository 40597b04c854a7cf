"""FLchain: a ledger of signed model updates in the SQL store that anyone can audit.

This module is the chain itself: the block format, a peer's view of the chain
(:class:`ChainView`) and appending; hashing, who may sign (membership) and the per-block check
live in :mod:`fedasync.serverless.ledger_block` (re-exported here), the aggregation rule in
:mod:`fedasync.serverless.ledger_rule`.
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
  ``weighting``, ``max_aggregates`` (``--max-steps``; null: no limit) and ``max_examples`` (the
  largest partition of the run's data: no update may claim more ``num_examples``).
  ``meta.members`` pins the signers: ``[{"peer": i, "public_key": hex}, ...]``. A genesis block
  without a valid rule or member list is refused by every reader (a peer's view raises
  :class:`ChainError`, ``verify`` fails at height 0): one check, :func:`check_block`.
- **member**: ``meta.op`` ``add`` (``peer``, ``public_key``) or ``remove`` (``peer``); no payload.
- **update**: a peer's new parameters ``x_i`` after local training from the model block it
  read, named by ``meta.base`` (its height) and ``meta.base_hash``. Also ``peer``, ``task_id``,
  ``num_examples``, ``loss``, ``epsilon`` (DP) and ``params_sha256``.
- **aggregate**: the next model. ``meta.updates`` names exactly the update blocks the rule
  selects (:func:`fedasync.serverless.ledger_rule.select_updates`): walking the pending update
  blocks (accepted, and not named by an earlier aggregate) oldest first, each peer's oldest one,
  until K **distinct peers**: **at most one update per peer**; a peer's later updates stay pending
  for later aggregates, and there is no aggregate until K distinct peers have one pending.
  ``meta.parent`` is the latest model block. The parameters are the FedBuff rule (:class:`fedasync.server.strategies.FedBuff`,
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
- A block that breaks these rules, or any other (its ``prev_hash``, hash or signature does not
  verify; its payload is not a model of the genesis model's keys, shapes and dtypes; an
  update's ``meta.base`` is not an earlier model block or its ``num_examples`` not a
  non-negative integer within ``max_examples``; an aggregate does not name the updates the rule
  selects (two updates of one peer, say) or does not recompute bit for bit) is **rejected**: :class:`ChainView`, what every peer aggregates from,
  skips it (it is never pending, never aggregated, never a model), and the chain continues
  above it (the next block links to its hash, so heights stay contiguous). The check is one
  function, :func:`fedasync.serverless.ledger_block.check_block`, that
  :func:`fedasync.serverless.ledger_verify.verify_chain` runs too: it reports FAIL at the first
  such height and still walks the rest, recomputing every later aggregate without it (it stops
  at a broken link, hash, signature or payload bytes: nothing above those can be trusted).

Appending
---------
A peer reads the chain (:class:`ChainView`), builds the block for height ``head + 1`` and inserts
it with its payload in one transaction. If another peer took that height first the database's
unique constraint rejects the insert; the loser re-reads the chain and retries (an update block
is re-linked and re-signed, an aggregate is recomputed from the new pending set, or dropped
when fewer than K distinct peers have an update pending). No peer is special: whoever sees K pending updates may aggregate.
"""

from __future__ import annotations

import hashlib
import time
import uuid
from collections import OrderedDict
from dataclasses import replace
from typing import Any, Callable

import numpy as np
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey, Ed25519PublicKey
from sqlalchemy import func, select
from sqlalchemy.exc import IntegrityError
from sqlalchemy.orm import Session

from fedasync.config import Config
from fedasync.server.strategies import params_sha256
from fedasync.serverless.common import PeerTask
from fedasync.serverless.ledger_block import (  # noqa: F401 (re-exported: the chain's format)
    EMPTY_SHA256,
    HASH_VERSION,
    KINDS,
    ZERO_HASH,
    BadPayload,
    Block,
    ChainError,
    Membership,
    PayloadError,
    UpdateFacts,
    Verdict,
    block_hash,
    canonical_json,
    check_block,
    payload_digest,
)
from fedasync.serverless.ledger_rule import (  # noqa: F401 (re-exported)
    Rule,
    UpdateIn,
    compute_aggregate,
    same_params,
    select_updates,
)
from fedasync.serverless.runs import create_run, run_summary
from fedasync.signing import public_raw, sign_block, valid_block_key, verify_block_signature  # noqa: F401
from fedasync.store import Store, decode_params, encode_params
from fedasync.store import serverless_schema as SS

Params = dict[str, np.ndarray]


# -- keys ------------------------------------------------------------------------------------------


def simulation_key(seed: int, name: str) -> Ed25519PrivateKey:
    """A key derived from the seed, so a simulated chain is a pure function of config and seed.
    Anyone who knows the seed can sign with it: for the simulator only, never for deployment."""
    return Ed25519PrivateKey.from_private_bytes(hashlib.sha256(f"fedasync-sim-key:{seed}:{name}".encode()).digest())


def key_hex(key: Ed25519PrivateKey | Ed25519PublicKey | str) -> str:
    """A key as the chain writes it: the raw public key, 64 lowercase hex digits."""
    return key.lower() if isinstance(key, str) else public_raw(key).hex()


# -- reading the chain ----------------------------------------------------------------------------


class ChainView:
    """A peer's incrementally refreshed copy of the chain's headers (blocks are immutable).

    Every block is checked as it is read by :func:`~fedasync.serverless.ledger_block.check_block`,
    the auditor's own check (link, hash, signature, signer, payload, base, aggregate recomputed);
    a block that fails is kept at its height with ``rejected`` set and otherwise ignored."""

    def __init__(self, store: Store, run_id: int, cache_size: int = 64):
        self.store = store
        self.run_id = run_id
        self.blocks: list[Block] = []
        self.models: list[int] = []  # heights of model blocks (genesis, aggregates); index = model index
        self.model_index: dict[int, int] = {}
        self.pending: list[int] = []  # accepted update heights not yet aggregated, oldest first
        self.arrival: dict[int, int] = {}  # update height -> model index of the latest model below it
        self.updates: dict[int, UpdateFacts] = {}  # accepted update height -> its checked meta
        self.rejected: list[int] = []  # heights every peer ignores
        self.members: Membership | None = None  # None until the genesis block is read (a view refuses one without)
        self.spec: list | None = None  # the genesis model's (key, shape, dtype)
        self._cache: OrderedDict[str, Params] = OrderedDict()
        self._cache_size = cache_size
        self._prefetched: dict[str, bytes] = {}  # payload bytes already read with their block (verify)
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

    def _apply(self, b: Block) -> Verdict:
        h = len(self.blocks)
        if b.height != h:
            raise ChainError(f"run {self.run_id}: block heights jump from {h - 1} to {b.height}")
        v = check_block(self, b)
        if h == 0 and v.why is not None:
            raise ChainError(f"run {self.run_id}: the genesis block: {v.why}")
        self.accept(b, v)
        return v

    def accept(self, b: Block, v: Verdict) -> None:
        """Apply block ``b`` (the next height) as :func:`check_block` judged it (``v``)."""
        h = len(self.blocks)
        if v.why is not None:
            b.rejected, b.fatal = v.why, v.fatal
            self.rejected.append(h)
        elif b.kind in ("genesis", "aggregate"):
            if b.kind == "genesis":
                self.rule, self.spec, self.members = v.rule, v.spec, v.members
            else:
                named = set(b.meta["updates"])  # checked: the rule's selection
                self.pending = [u for u in self.pending if u not in named]
            self.model_index[h] = len(self.models)
            self.models.append(h)
        elif b.kind == "update":
            self.pending.append(h)
            self.arrival[h] = v.update.arrival
            self.updates[h] = v.update
        else:  # member (an accepted genesis pinned the members)
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
        """The parameters stored under ``sha``: :class:`PayloadError` if missing or changed,
        :class:`BadPayload` if they do not decode."""
        if sha in self._cache:
            self._cache.move_to_end(sha)
            return self._cache[sha]
        data = self._prefetched.get(sha)
        if data is None:
            with self.store.session() as s:
                data = s.scalar(select(SS.LedgerPayload.data).where(SS.LedgerPayload.sha256 == sha))
        if data is None:
            raise PayloadError(f"payload {str(sha)[:12]} is missing")
        if payload_digest(data) != sha:
            raise PayloadError(f"payload sha256 mismatch: the stored parameters ({str(sha)[:12]}) were changed")
        try:
            params = decode_params(data)
        except Exception as e:  # bytes that hash right but do not decode were signed that way
            raise BadPayload(f"payload does not decode ({type(e).__name__})") from None
        self._cache[sha] = params
        while len(self._cache) > self._cache_size:
            self._cache.popitem(last=False)
        return params

    def params(self, height: int) -> Params:
        return self.payload(self.blocks[height].payload_sha256)

    def next_updates(self) -> list[int] | None:
        """The update heights the next aggregate takes (at most one per peer, see
        :func:`~fedasync.serverless.ledger_rule.select_updates`); None while fewer than K distinct
        peers have an update pending."""
        return select_updates([(h, self.updates[h].peer) for h in self.pending], self.rule.buffer_size)

    def staleness(self, update_height: int) -> int:
        f = self.updates[update_height]
        return f.arrival - self.model_index[f.base]

    def update_in(self, height: int) -> UpdateIn:
        f = self.updates[height]
        return UpdateIn(height=height, peer=f.peer, params=self.params(height), base_params=self.params(f.base),
                        base_index=self.model_index[f.base], staleness=f.arrival - self.model_index[f.base],
                        num_examples=f.num_examples)


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
    run's authority ``key``), pinning ``members`` ({peer id: public key}) as the signers.

    A ``rule`` without ``max_examples`` gets the largest partition of the run's data (every
    peer trains on its partition of ``cfg.data``, so an honest update never claims more)."""
    if init is None:
        init = PeerTask(cfg).init
    if rule.max_examples is None:
        from fedasync.task.data import load_federated  # cached per process: the peers' own partitions

        sizes = [len(y) for _, y in load_federated(cfg.data, cfg.seed).partitions]
        rule = replace(rule, max_examples=max(1, *sizes))
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

    Raises :class:`ChainError` with the reason if the chain would reject it, or if the run has
    stopped and recorded its head (a block above it would make ``ledger verify`` fail)."""
    status, summary = run_summary(store, run_id)
    if status not in ("starting", "running") and summary is not None and summary.get("head_hash"):
        raise ChainError(f"run {run_id} has {status}: its chain is closed at the head it recorded (height "
                         f"{summary.get('height', summary.get('blocks', 0) - 1)}); start a new run")
    meta: dict[str, Any] = {"op": op, "peer": peer}
    if op == "add":
        meta["public_key"] = key_hex(public_key)
    view = ChainView(store, run_id)
    for _ in range(max_retries):
        view.refresh()
        if not view.blocks:
            raise ChainError(f"run {run_id}: the chain is empty")
        why = view.members.check("member", key_hex(authority), meta)
        if why:
            raise ChainError(f"run {run_id}: {why}")
        height = view.height + 1
        if try_append(store, run_id, authority, height, view.head.hash, "member", b"", meta, created,
                      None) is not None:
            return height
    raise ChainError(f"run {run_id}: could not append a member block in {max_retries} tries")
