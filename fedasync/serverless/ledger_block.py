"""One ledger block as every reader checks it: hashing, who may sign (:class:`Membership`) and
:func:`check_block`, **the** per-block check. Every peer's
:class:`~fedasync.serverless.flchain.ChainView` (what it trains and aggregates from, and ``ledger
show``) and the auditor :func:`~fedasync.serverless.ledger_verify.verify_chain` both run it, block
by block, so a peer never acts on a block the auditor rejects. The format and the rules are in
:mod:`fedasync.serverless.flchain`'s docstring.

:func:`check_block` returns a :class:`Verdict`: ``why`` is None for a block every reader accepts;
otherwise the block is **rejected** (kept at its height, never pending, never a model). A rejected
block is ``fatal`` when the stored record itself is broken (``prev_hash`` does not link, the hash
does not recompute, the signature does not verify, the payload bytes are missing or changed):
the auditor stops there, a peer skips it. Otherwise it is an intact, signed block that breaks a
rule (a signer that may not sign it; a payload that is not a model of the genesis model's keys,
shapes and dtypes; an update whose ``meta.base`` is not an earlier model block, or whose
``num_examples`` is not a non-negative integer within the rule's ``max_examples``; an aggregate
that does not name exactly the updates the rule selects, at most one per peer
(:func:`~fedasync.serverless.ledger_rule.select_updates`), and the latest model, or whose
parameters are not FedBuff recomputed from them bit for bit): every reader ignores it and reads
on. A genesis block that fails (no valid rule, no valid member list) is refused by every reader:
a peer's view raises :class:`ChainError`, the auditor reports FAIL at height 0.

Pure: no database (payloads come through the view's ``payload``).
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from typing import Any

import numpy as np

from fedasync.server.strategies import params_sha256
from fedasync.serverless.ledger_rule import Rule, UpdateIn, compute_aggregate, same_params
from fedasync.signing import valid_block_key, verify_block_signature

Params = dict[str, np.ndarray]

ZERO_HASH = "0" * 64
HASH_VERSION = 1
KINDS = ("genesis", "member", "update", "aggregate")
EMPTY_SHA256 = hashlib.sha256(b"").hexdigest()  # the payload of a member block


class ChainError(RuntimeError):
    """The chain in the store is not one this code can extend (run ``fedasync ledger verify``)."""


class PayloadError(ChainError):
    """A block's payload bytes are missing from the store or no longer hash to its ``payload_sha256``."""


class BadPayload(ChainError):
    """A block's payload bytes hash right but do not decode to parameters (it was signed that way)."""


# -- hashing --------------------------------------------------------------------------------------


def canonical_json(obj: Any) -> str:
    return json.dumps(obj, sort_keys=True, separators=(",", ":"), allow_nan=False)


def block_hash(height: int, prev_hash: str, kind: str, payload_sha256: str, meta_json: str, public_key: str,
               created: float) -> str:
    body = json.dumps([HASH_VERSION, int(height), prev_hash, kind, payload_sha256, meta_json, public_key,
                       repr(float(created))], separators=(",", ":"))
    return hashlib.sha256(body.encode()).hexdigest()


def payload_digest(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


# -- membership -----------------------------------------------------------------------------------


def _int(x: Any) -> int | None:
    """``x`` when it is an int (not a bool), else None: a peer id, a count, a height from JSON."""
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
        n = _int(meta.get("num_peers"))
        if n is None or n < 1:
            raise ValueError("meta.num_peers is missing")
        rows = meta.get("members")
        if not isinstance(rows, list):
            raise ValueError("meta.members is missing: the chain does not pin its signers")
        members: dict[int, str] = {}
        for r in rows:
            p = _int(r.get("peer")) if isinstance(r, dict) else None
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
            op, p = meta.get("op"), _int(meta.get("peer"))
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
        if _int(claim) != signer:
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


# -- a block as read ------------------------------------------------------------------------------


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
    fatal: bool = False  # rejected because the stored record is broken (link, hash, signature, payload bytes)
    meta_error: str | None = None  # why meta_json is not a JSON object (meta is then {})

    @classmethod
    def from_row(cls, r: Any) -> "Block":
        """A ``ledger_blocks`` row as read (nothing checked yet: :func:`check_block` does)."""
        err = None
        try:
            meta = json.loads(r.meta_json)
            if not isinstance(meta, dict):
                err, meta = "not an object", {}
        except (TypeError, ValueError) as e:
            err, meta = str(e), {}
        return cls(r.height, r.prev_hash, r.hash, r.kind, r.payload_sha256, meta, r.meta_json, r.public_key,
                   r.signature, r.created, r.peer_id, meta_error=err)

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


# -- the per-block check ----------------------------------------------------------------------------


@dataclass(frozen=True)
class UpdateFacts:
    """An accepted update block's checked meta: what the aggregation rule reads."""

    base: int  # height of the model block it started from
    peer: int
    num_examples: int
    arrival: int  # model index of the latest model block below it


@dataclass
class Verdict:
    why: str | None = None  # None: accepted
    fatal: bool = False  # the stored record is broken: the auditor stops here
    update: UpdateFacts | None = None  # an accepted update block
    rule: Rule | None = None  # the genesis block's
    spec: list | None = None  # the genesis model's (key, shape, dtype)
    members: Membership | None = None  # the genesis block's
    recomputed: bool = False  # an accepted aggregate, recomputed bit for bit


def _spec(params: Params) -> list:
    return [(k, tuple(v.shape), v.dtype.str) for k, v in params.items()]


def check_block(view: Any, b: Block) -> Verdict:
    """Whether every reader accepts block ``b`` at height ``len(view.blocks)``, given the blocks
    below it as ``view`` (a :class:`~fedasync.serverless.flchain.ChainView`) has applied them.

    ``view`` provides ``blocks``, ``members``, ``rule``, ``spec``, ``models``, ``model_index``,
    ``pending``, ``next_updates()`` (the rule's selection from the pending updates),
    ``payload(sha)`` (:class:`PayloadError` / :class:`BadPayload`), ``params(height)`` and
    ``update_in(height)``. Never raises for anything stored in the chain."""
    h = len(view.blocks)
    prev = view.blocks[-1].hash if view.blocks else ZERO_HASH
    if h == 0 and b.kind != "genesis":
        return Verdict("block 0 must be the one genesis block", fatal=True)
    if b.prev_hash != prev:
        below = f"the hash of block {h - 1}" if h else "64 zeros (the genesis block)"
        return Verdict(f"prev_hash {str(b.prev_hash)[:12]} does not match {below} ({prev[:12]}): the chain is "
                       "broken here", fatal=True)
    why = b.intact()
    if why is not None:
        return Verdict(why, fatal=True)
    if b.meta_error is not None:
        return Verdict(f"meta does not decode ({b.meta_error})")
    if b.kind not in KINDS:
        return Verdict(f"unknown kind {b.kind!r}")
    if h > 0:
        why = view.members.check(b.kind, b.public_key, b.meta)  # an accepted genesis pinned them
        if why is not None:
            return Verdict(why)
    if b.kind == "member":
        return Verdict() if b.payload_sha256 == EMPTY_SHA256 else Verdict("a member block's payload must be empty")
    try:
        params = view.payload(b.payload_sha256)
    except PayloadError as e:
        return Verdict(str(e), fatal=True)
    except BadPayload as e:
        return Verdict(str(e))
    spec = _spec(params)
    if h > 0 and spec != view.spec:
        return Verdict("payload is not a model of the genesis model's keys, shapes and dtypes")
    if b.meta.get("params_sha256") != params_sha256(params):
        return Verdict("meta.params_sha256 does not match the payload's parameters")
    if b.kind == "genesis":
        return _genesis(b, spec)
    if b.kind == "update":
        return _update(view, b)
    return _aggregate(view, b, params)


def _genesis(b: Block, spec: list) -> Verdict:
    try:
        rule = Rule.from_dict(b.meta["rule"])
        if _int(rule.buffer_size) is None or rule.buffer_size < 1:
            raise ValueError(f"buffer_size {rule.buffer_size!r}")
        rule.strategy()
    except Exception as e:
        return Verdict(f"meta.rule is not a valid aggregation rule ({e})")
    try:
        members = Membership.from_genesis(b.public_key, b.meta)
    except ValueError as e:
        return Verdict(str(e))
    return Verdict(rule=rule, spec=spec, members=members)


def _update(view: Any, b: Block) -> Verdict:
    m = b.meta
    if "base" not in m:
        return Verdict("meta.base (the model block it started from) is missing")
    base = _int(m["base"])
    if base is None or base not in view.model_index:
        return Verdict(f"meta.base {m['base']!r} is not an earlier model block")
    if m.get("base_hash") != view.blocks[base].hash:
        return Verdict(f"meta.base_hash does not match block {base}")
    n = m.get("num_examples", 0)
    if _int(n) is None or n < 0:
        return Verdict(f"meta.num_examples {n!r} is not a non-negative integer")
    why = view.rule.examples_error(n)
    if why:
        return Verdict(why)
    peer = _int(m.get("peer"))
    if peer is None:
        return Verdict(f"meta.peer {m.get('peer')!r} is not a peer id")
    return Verdict(update=UpdateFacts(base, peer, n, len(view.models) - 1))


def _aggregate(view: Any, b: Block, params: Params) -> Verdict:
    rule, m = view.rule, b.meta
    k = rule.buffer_size
    if rule.max_aggregates is not None and len(view.models) - 1 >= rule.max_aggregates:
        return Verdict(f"more aggregates than the chain's max_aggregates ({rule.max_aggregates})")
    names = m.get("updates")
    chosen = view.next_updates()
    if chosen is None:
        return Verdict(f"names update blocks {names!r} but the rule takes none: fewer than K={k} distinct peers "
                       "have an update pending")
    if not (isinstance(names, list) and all(_int(u) is not None for u in names) and names == chosen):
        return Verdict(f"names update blocks {names!r} but the rule takes {chosen} (each of the first {k} "
                       "distinct peers' oldest pending update)")
    parent = m.get("parent")
    if _int(parent) is None or parent != view.models[-1]:
        return Verdict(f"meta.parent {parent!r} is not the latest model block ({view.models[-1]})")
    try:
        ups: list[UpdateIn] = [view.update_in(u) for u in names]
        if m.get("staleness") is not None and m["staleness"] != [u.staleness for u in ups]:
            return Verdict(f"meta.staleness {m['staleness']} differs from the chain's {[u.staleness for u in ups]}")
        expect = compute_aggregate(rule, view.params(parent), view.model_index[parent], ups)
    except PayloadError as e:
        return Verdict(f"an earlier block's payload changed while reading: {e}", fatal=True)
    except Exception as e:
        return Verdict(f"cannot recompute the aggregate ({type(e).__name__}: {e})")
    if not same_params(expect, params):
        diff = max(float(np.max(np.abs(expect[x].astype(np.float64) - params[x].astype(np.float64)), initial=0.0))
                   for x in expect)
        return Verdict(f"parameters differ from the FedBuff aggregate recomputed from update blocks {names} "
                       f"(max |difference| {diff:.3g})")
    return Verdict(recomputed=True)
