"""Auditing a ledger: :func:`verify_chain` re-checks everything every block claims.

For every height, in order: the height is the next one, the kind is allowed there, ``prev_hash``
links to the previous block, the hash recomputes, the signature verifies with the block's key;
then **who signed** (:class:`fedasync.serverless.flchain.Membership`: the genesis block's members
and the member blocks since); then the payload: it exists, hashes to ``payload_sha256``, decodes
to a model of the genesis model's keys, shapes and dtypes and matches ``meta.params_sha256`` (a
member block's payload is empty); an update's base is an earlier model block with that hash;
an aggregate names exactly the K oldest pending updates and the latest model as parent, its
recorded staleness is the chain's, and **its parameters equal FedBuff recomputed from the named
update blocks, bit for bit**.

A failure of integrity (a link, hash, signature or payload, or an aggregate that does not
recompute) stops the walk: nothing above it can be trusted. A block that is intact but signed by
a key that may not sign it (an outsider, a member claiming another peer's id, a removed member)
is **rejected**: it is reported, and the walk goes on treating it as every peer's
:class:`~fedasync.serverless.flchain.ChainView` does, as if it were not there, so every later
aggregate is recomputed without it. The report names the first bad height and why.
"""

from __future__ import annotations

import json
from collections import OrderedDict
from dataclasses import dataclass, field

import numpy as np
from sqlalchemy import select

from fedasync.server.strategies import params_sha256
from fedasync.serverless.flchain import (
    KINDS,
    ZERO_HASH,
    ChainError,
    Membership,
    block_hash,
    payload_digest,
    verify_block_signature,
)
from fedasync.serverless.ledger_rule import Rule, UpdateIn, compute_aggregate, same_params
from fedasync.store import Store, decode_params
from fedasync.store import serverless_schema as SS

Params = dict[str, np.ndarray]


@dataclass
class VerifyReport:
    ok: bool
    run_id: int
    counts: dict = field(default_factory=dict)
    height: int | None = None
    kind: str | None = None
    reason: str | None = None
    rejected: list[tuple[int, str, str]] = field(default_factory=list)  # (height, kind, why), in order
    fatal: tuple[int, str | None, str] | None = None  # (height, kind, why) where the walk stopped

    def line(self) -> str:
        c = self.counts
        if self.ok:
            return (f"OK: ledger of run {self.run_id}: {c['blocks']} blocks (genesis 1, member {c['member']}, update "
                    f"{c['update']}, aggregate {c['aggregate']}), {c['pending']} update(s) pending, {c['members']} "
                    f"member(s), {c['peers']} signer(s), {c['aggregates_recomputed']} aggregate(s) recomputed bit "
                    "for bit")
        what = f" ({self.kind})" if self.kind else ""
        out = f"FAIL: ledger of run {self.run_id}: block at height {self.height}{what}: {self.reason}"
        if self.rejected:
            first = self.rejected[0][0]
            later = sum(1 for h in c.get("aggregate_heights", []) if h > first)
            heights = ", ".join(str(h) for h, _, _ in self.rejected)
            out += (f"; every peer ignores it ({len(self.rejected)} block(s) rejected, at height {heights}; "
                    f"{later} later aggregate(s) recomputed bit for bit without them)")
            if self.fatal is not None:
                fh, fk, fwhy = self.fatal
                out += f"; and at height {fh}{f' ({fk})' if fk else ''}: {fwhy} (the walk stopped there)"
        return out


def verify_chain(store: Store, run_id: int, batch: int = 200) -> VerifyReport:
    """Check everything a block claims; the first bad block and why (see the module docstring)."""
    counts = {"blocks": 0, "genesis": 0, "member": 0, "update": 0, "aggregate": 0, "pending": 0, "peers": 0,
              "members": 0, "rejected": 0, "aggregates_recomputed": 0, "aggregate_heights": []}
    signers: set[str] = set()
    rejected: list[tuple[int, str, str]] = []
    members: Membership | None = None
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
        if rejected:  # the first bad height is a rejected block; report both
            h0, k0, why0 = rejected[0]
            return VerifyReport(False, run_id, counts, h0, k0, why0, rejected, (h, kind, why))
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
            if h == 0 and kind != "genesis":
                return bad(h, kind, "block 0 must be the one genesis block")
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
            try:
                meta = json.loads(row.meta_json)
                if not isinstance(meta, dict):
                    raise ValueError("not an object")
            except ValueError as e:
                return bad(h, kind, f"meta does not decode ({e})")
            prev = row.hash
            counts["blocks"] += 1
            # who signed: the genesis block's members, and the member blocks since
            if h == 0:
                try:
                    members = Membership.from_genesis(row.public_key, meta)
                except ValueError as e:
                    return bad(h, kind, str(e))
            else:
                why = members.check(kind, row.public_key, meta)
                if why is not None:
                    rejected.append((h, kind, why))
                    counts["rejected"] += 1
                    continue
            signers.add(row.public_key)
            counts[kind] += 1
            if data is None:
                return bad(h, kind, f"payload {row.payload_sha256[:12]} is missing")
            if payload_digest(data) != row.payload_sha256:
                return bad(h, kind, f"payload sha256 mismatch: the stored parameters ({row.payload_sha256[:12]}) "
                                    "were changed")
            if kind == "member":
                if data:
                    return bad(h, kind, "a member block's payload must be empty")
                members.apply(h, meta)
                continue
            try:
                params = decode_params(data)
            except Exception as e:  # a payload that hashes right but does not decode was signed that way
                return bad(h, kind, f"payload does not decode ({type(e).__name__})")
            this_spec = [(k, v.shape, v.dtype.str) for k, v in params.items()]
            if spec is None:
                spec = this_spec
            elif this_spec != spec:
                return bad(h, kind, "payload is not a model of the genesis model's keys, shapes and dtypes")
            if meta.get("params_sha256") != params_sha256(params):
                return bad(h, kind, "meta.params_sha256 does not match the payload's parameters")

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
                upd[h] = {"params": params, "base": base, "arrival": len(models) - 1, "peer": int(meta["peer"]),
                          "n": n}
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
                counts["aggregate_heights"].append(h)
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
    counts["members"] = len(members.by_peer) if members is not None else 0
    if rejected:
        h0, k0, why0 = rejected[0]
        return VerifyReport(False, run_id, counts, h0, k0, why0, rejected)
    return VerifyReport(True, run_id, counts)
