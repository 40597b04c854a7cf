"""A ledger peer: reads the head model block, trains, appends signed update and aggregate blocks.

The same :class:`LedgerPeer` is driven by a process loop (:func:`fedasync.serverless.runner.ledger_peer_loop`)
or by the virtual-clock simulator (:mod:`fedasync.serverless.sim`). The chain's format and rules
are in :mod:`fedasync.serverless.flchain`.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
from sqlalchemy.orm import Session

from fedasync.server.strategies import params_sha256
from fedasync.serverless.common import finite, write_privacy
from fedasync.serverless.flchain import ChainError, ChainView, key_hex, try_append
from fedasync.serverless.ledger_rule import Rule, compute_aggregate
from fedasync.store import Store, encode_params

Params = dict[str, np.ndarray]


def membership_error(view: ChainView, peer_id: int, public_key: str) -> str | None:
    """Why ``public_key`` may not sign for ``peer_id`` in the chain ``view`` reads (None: it may)."""
    view.refresh()
    if not view.blocks:
        return f"run {view.run_id}: the chain is empty"
    if view.members.key_of(peer_id) != public_key:
        return (f"peer {peer_id}: key {public_key[:16]} is not peer {peer_id}'s key in run {view.run_id}; the run's "
                "authority must admit it first (`fedasync ledger member add`)")
    return None


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
    """One peer of a ledger run, signing with ``key`` (a member's key for ``peer_id``)."""

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
        self.public_key = key_hex(key)
        why = membership_error(self.view, peer_id, self.public_key)
        if why:
            raise ChainError(why)

    def is_member(self, refresh: bool = True) -> bool:
        """Whether this key may still sign for this peer id (it may have been removed)."""
        if refresh:
            self.view.refresh()
        return self.view.members.key_of(self.peer_id) == self.public_key

    def _check_member(self) -> None:
        if not self.is_member(refresh=False):
            raise ChainError(f"peer {self.peer_id}: removed from run {self.run_id}; it may not append")

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
            self._check_member()
            height = self.view.height + 1
            if try_append(self.store, self.run_id, self.key, height, self.view.head.hash, "update", data, meta,
                          created, self.peer_id, extra) is not None:
                self.updates += 1
                self.view.refresh()
                return height
            self.conflicts += 1
        raise ChainError(f"peer {self.peer_id}: could not append an update block in {self.max_retries} tries")

    def try_aggregate(self, created: float | None = None) -> int | None:
        """Append the aggregate block if K distinct peers have an update pending (retrying lost
        races); its height. It takes the rule's selection: each of the first K distinct peers'
        oldest pending update, at most one per peer."""
        for _ in range(self.max_retries):
            self.view.refresh()
            self._check_member()
            rule = self.rule
            names = None if self.done() else self.view.next_updates()
            if names is None:
                return None
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
