"""Auditing a ledger: :func:`verify_chain` re-checks everything every block claims, and checks the
chain against what the run recorded outside it.

**The blocks.** For every height, in order, the one per-block check every peer runs
(:func:`fedasync.serverless.ledger_block.check_block`, through a
:class:`~fedasync.serverless.flchain.ChainView`): the height is the next one, ``prev_hash``
links to the previous block, the hash recomputes, the signature verifies with the block's key;
then **who signed** (:class:`~fedasync.serverless.ledger_block.Membership`: the genesis block's
members and the member blocks since); then the payload: it exists, hashes to ``payload_sha256``,
decodes to a model of the genesis model's keys, shapes and dtypes and matches
``meta.params_sha256`` (a member block's payload is empty); an update's base is an earlier model
block with that hash and its ``num_examples`` a non-negative integer within the rule's
``max_examples``; an aggregate names exactly the updates the rule selects (each of the first K
distinct peers' oldest pending update: at most one per peer) and the latest model as parent, its
recorded staleness is the chain's, and **its parameters equal FedBuff recomputed from the named
update blocks, bit for bit**. The genesis block must carry a complete rule and a member list,
as every peer's view requires.

A broken record (a link, hash, signature, or payload bytes missing or changed) stops the walk:
nothing above it can be trusted. A block that is intact but breaks a rule (a key that may not
sign it, a bad base, a wrong-shaped payload, an aggregate that does not recompute, ...) is
**rejected**: it is reported, and the walk goes on treating it as every peer does, as if it
were not there, so every later aggregate is recomputed without it. The report names the first
bad height and why.

**The anchors.** A chain that is consistent in itself could still be another run's, or this
run's cut short. So the genesis block's ``config_sha256``, ``rule`` and ``num_peers`` must match
the run's own rows (``runs.config_yaml``, ``serverless_runs``); for a run that has stopped and
recorded its summary, the chain's last block must be the head it recorded (``head_hash`` at
``height``); ``head`` (``--head``) and ``authority`` (``--authority``) are anchors from outside
the store: the last block's hash and the genesis signer's key. The report says which anchors
were checked and when none from outside the store was given.
"""

from __future__ import annotations

import hashlib
import re
from dataclasses import dataclass, field

from sqlalchemy import select

from fedasync.serverless.flchain import ChainView
from fedasync.serverless.ledger_block import Block, Verdict, check_block
from fedasync.serverless.runs import run_info, run_summary
from fedasync.store import Store
from fedasync.store import serverless_schema as SS


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
    anchor_failures: list[str] = field(default_factory=list)  # the chain is not the one the run recorded
    anchors: list[str] = field(default_factory=list)  # what it was checked against, outside the blocks
    outside: bool = False  # an anchor from outside the store (--head, --authority) was checked

    def line(self) -> str:
        c = self.counts
        if self.ok:
            return (f"OK: ledger of run {self.run_id}: {c['blocks']} blocks (genesis 1, member {c['member']}, update "
                    f"{c['update']}, aggregate {c['aggregate']}), {c['pending']} update(s) pending, {c['members']} "
                    f"member(s), {c['peers']} signer(s), {c['aggregates_recomputed']} aggregate(s) recomputed bit "
                    f"for bit; {self.anchor_line()}")
        if self.height is None:  # the blocks are fine: the chain is not the one the run recorded
            return f"FAIL: ledger of run {self.run_id}: " + "; ".join(self.anchor_failures)
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
        if self.anchor_failures:
            out += "; and " + "; ".join(self.anchor_failures)
        return out

    def anchor_line(self) -> str:
        said = "anchored to " + ", ".join(self.anchors) if self.anchors else "not anchored to anything"
        if not self.outside:
            said += ("; no outside anchor (the store vouches for itself: pass --head HASH from summary.json or "
                     "--authority genesis.pub)")
        return said


HEX = re.compile(r"[0-9a-f]{16,64}")


def verify_chain(store: Store, run_id: int, batch: int = 200, head: str | None = None,
                 authority: str | None = None) -> VerifyReport:
    """Check everything a block claims, and the chain against the run's records (see the module
    docstring); the first bad block and why. ``head``: the hash (16 to 64 lowercase hex digits,
    a prefix) the last block must have; ``authority``: the raw public key (64 hex digits) that
    must have signed the genesis block."""
    if head is not None and not HEX.fullmatch(head):
        raise ValueError(f"--head: {head!r} is not 16 to 64 lowercase hex digits of a block hash")
    if authority is not None and not re.fullmatch(r"[0-9a-f]{64}", authority):
        raise ValueError(f"--authority: {authority!r} is not a raw Ed25519 public key (64 lowercase hex digits)")
    counts = {"blocks": 0, "genesis": 0, "member": 0, "update": 0, "aggregate": 0, "pending": 0, "peers": 0,
              "members": 0, "rejected": 0, "aggregates_recomputed": 0, "aggregate_heights": []}
    signers: set[str] = set()
    rejected: list[tuple[int, str, str]] = []
    view = ChainView(store, run_id)
    report = VerifyReport(False, run_id, counts)

    def bad(h: int, kind: str | None, why: str) -> VerifyReport:
        if rejected:  # the first bad height is a rejected block; report both
            h0, k0, why0 = rejected[0]
            report.height, report.kind, report.reason, report.fatal = h0, k0, why0, (h, kind, why)
        else:
            report.height, report.kind, report.reason = h, kind, why
        report.rejected = rejected
        return report

    q = (select(SS.LedgerBlock, SS.LedgerPayload.data)
         .outerjoin(SS.LedgerPayload, SS.LedgerPayload.sha256 == SS.LedgerBlock.payload_sha256)
         .where(SS.LedgerBlock.run_id == run_id).order_by(SS.LedgerBlock.height))
    with store.session() as s:
        expected = 0
        for row, data in s.execute(q.execution_options(yield_per=batch)):
            h = row.height
            if h != expected:
                return _finish(store, bad(expected, None, f"missing: the next block stored is at height {h}"), view,
                               head, authority)
            expected += 1
            b = Block.from_row(row)
            view._prefetched = {b.payload_sha256: data} if data is not None else {}
            v: Verdict = check_block(view, b)
            view._prefetched = {}
            if v.fatal or (h == 0 and v.why):  # a genesis block no peer accepts either
                return _finish(store, bad(h, b.kind, v.why), view, head, authority)
            view.accept(b, v)
            counts["blocks"] += 1
            if v.why is not None:
                rejected.append((h, b.kind, v.why))
                counts["rejected"] += 1
                continue
            signers.add(b.public_key)
            counts[b.kind] += 1
            if v.recomputed:
                counts["aggregates_recomputed"] += 1
                counts["aggregate_heights"].append(h)
        if expected == 0:
            return _finish(store, bad(0, None, "the chain is empty (no genesis block)"), view, head, authority)
    counts["pending"] = len(view.pending)
    counts["peers"] = len(signers)
    counts["members"] = len(view.members.by_peer) if view.members is not None else 0
    if rejected:
        h0, k0, why0 = rejected[0]
        report.height, report.kind, report.reason, report.rejected = h0, k0, why0, rejected
    else:
        report.ok = True
    return _finish(store, report, view, head, authority)


def _finish(store: Store, report: VerifyReport, view: ChainView, head: str | None,
            authority: str | None) -> VerifyReport:
    """Check the chain against the run's rows, its recorded head and the outside anchors given."""
    fails, said = report.anchor_failures, report.anchors
    run_id = report.run_id
    info = run_info(store, run_id)
    with store.session() as s:
        rows = list(s.execute(select(SS.LedgerBlock.height, SS.LedgerBlock.hash)
                              .where(SS.LedgerBlock.run_id == run_id)
                              .order_by(SS.LedgerBlock.height.desc()).limit(1)))
        g = s.execute(select(SS.LedgerBlock.public_key).where(SS.LedgerBlock.run_id == run_id,
                                                              SS.LedgerBlock.height == 0)).first()
    last = (rows[0].height, rows[0].hash) if rows else None
    genesis = view.blocks[0] if view.blocks and view.blocks[0].meta_error is None else None
    if genesis is not None:
        m = genesis.meta
        want = hashlib.sha256(info.config_yaml.encode()).hexdigest()
        if m.get("config_sha256") != want:
            fails.append(f"the genesis block's config_sha256 {str(m.get('config_sha256'))[:16]} is not the run's "
                         f"config (runs.config_yaml hashes to {want[:16]}): this chain is not run {run_id}'s")
        if "rule" in info.settings and m.get("rule") != info.settings["rule"]:
            fails.append(f"the genesis block's rule {m.get('rule')} is not the run's ({info.settings['rule']})")
        if m.get("num_peers") != info.num_peers:
            fails.append(f"the genesis block's num_peers {m.get('num_peers')!r} is not the run's ({info.num_peers})")
        said.append(f"run {run_id}'s config, rule and peers")
    status, summary = run_summary(store, run_id)
    rec_hash = summary.get("head_hash") if isinstance(summary, dict) else None
    rec_height = summary.get("height", summary.get("blocks", 0) - 1) if isinstance(summary, dict) else None
    if status in ("starting", "running"):
        said.append(f"no recorded head (the run is {status})")
    elif not isinstance(rec_hash, str) or not isinstance(rec_height, int):
        said.append(f"no recorded head (the run is {status} and recorded no summary)")
    elif last is None or last[0] < rec_height:
        have = "no block" if last is None else f"height {last[0]}"
        fails.append(f"the chain ends at {have}, but the run recorded its head at height {rec_height} "
                     f"({rec_hash[:16]}) when it {status}: blocks are missing at the end")
    elif last[0] > rec_height:
        fails.append(f"{last[0] - rec_height} block(s) above the head the run recorded when it {status} "
                     f"(height {rec_height}, {rec_hash[:16]}); the chain now ends at height {last[0]}")
    elif last[1] != rec_hash:
        fails.append(f"the last block (height {last[0]}) has hash {last[1][:16]}, not the head the run recorded "
                     f"when it {status} ({rec_hash[:16]})")
    else:
        said.append(f"the head it recorded when it {status} (height {rec_height})")
    if head is not None:
        report.outside = True
        if last is None or not last[1].startswith(head):
            fails.append(f"the last block's hash {last[1][:16] if last else '(none)'} is not --head {head[:16]}")
        else:
            said.append(f"--head {head[:16]}")
    if authority is not None:
        report.outside = True
        if g is None or g.public_key != authority:
            fails.append(f"the genesis block is signed by {g.public_key[:16] if g else '(none)'}, not by --authority "
                         f"{authority[:16]}")
        else:
            said.append(f"--authority {authority[:16]}")
    if fails:
        report.ok = False
    return report
