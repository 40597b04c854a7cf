"""The ledger's aggregation rule: which update blocks an aggregate takes, and the new model.

**Which updates** (:func:`select_updates`): walk the pending update blocks (accepted, not named
by an earlier aggregate) oldest first and take each peer's oldest one, skipping a peer already
taken, until K distinct peers are taken. An aggregate therefore holds **at most one update per
peer**, and there is no aggregate until K distinct peers have an update pending; a peer's later
updates stay pending, in height order, for later aggregates. So one member, however many update
blocks it appends, contributes one update of K to each model.

**How much each weighs.** ``num_examples`` is self-reported, so the rule bounds it: the genesis
block records ``max_examples``, the largest partition of the run's data (the authority knows
every partition from the config and seed, and an honest peer reports its partition's size), and
an update block claiming more is rejected by every reader. A member's share of an aggregate's
example weights is then at most ``max_examples / (max_examples + the other K-1 updates' examples)``
(a third with K = 3 and equal partitions), never the whole model. A bound that every reader can
check from the chain alone was chosen over clipping (which would hide the claim) and over equal
weights (which would change what ``weighting: examples`` means for honest runs).

**The new model** (:func:`compute_aggregate`): FedBuff (the server's own
:class:`fedasync.server.strategies.FedBuff`, through ``make_strategy``) over exactly the selected
updates in height order, from the latest model; it refuses two updates of one peer or a
``num_examples`` over the bound.

Pure: no store, no flwr, no sqlalchemy. The genesis block carries :meth:`Rule.to_dict`, so a chain
is self-describing.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from fedasync.config import Config, ServerConfig, StalenessConfig
from fedasync.server.strategies import Update, make_strategy, params_sha256

Params = dict[str, np.ndarray]


@dataclass(frozen=True)
class Rule:
    buffer_size: int
    server_lr: float
    staleness: dict
    weighting: str
    max_aggregates: int | None
    max_examples: int | None = None  # None only before create_ledger fills it in; a chain's rule has it

    @classmethod
    def from_config(cls, cfg: Config, max_aggregates: int | None = None, max_examples: int | None = None) -> "Rule":
        s = cfg.server
        return cls(buffer_size=s.buffer_size, server_lr=s.server_lr,
                   staleness={"fn": s.staleness.fn, "a": s.staleness.a, "b": s.staleness.b},
                   weighting="examples" if cfg.weighting == "examples" else "uniform",
                   max_aggregates=max_aggregates, max_examples=max_examples)

    @classmethod
    def from_dict(cls, d: dict) -> "Rule":
        """The rule a genesis block records; ValueError (why) if it is not a complete one."""
        n = d.get("max_examples")
        if not isinstance(n, int) or isinstance(n, bool) or n < 1:
            raise ValueError(f"max_examples {n!r} is not a positive integer (the bound on an update's num_examples)")
        return cls(buffer_size=int(d["buffer_size"]), server_lr=float(d["server_lr"]),
                   staleness=dict(d["staleness"]), weighting=str(d["weighting"]),
                   max_aggregates=None if d.get("max_aggregates") is None else int(d["max_aggregates"]),
                   max_examples=n)

    def to_dict(self) -> dict:
        return {"rule": "fedbuff", "buffer_size": self.buffer_size, "server_lr": self.server_lr,
                "staleness": dict(self.staleness), "weighting": self.weighting,
                "max_aggregates": self.max_aggregates, "max_examples": self.max_examples}

    def examples_error(self, num_examples: int) -> str | None:
        """Why an update claiming ``num_examples`` breaks the rule (None: it does not)."""
        if self.max_examples is not None and num_examples > self.max_examples:
            return (f"meta.num_examples {num_examples} is over the rule's max_examples ({self.max_examples}, the "
                    "largest partition of the run)")
        return None

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


def select_updates(pending: Sequence[tuple[int, int]], k: int) -> list[int] | None:
    """The update heights the next aggregate takes: from ``pending`` ((height, peer), oldest
    first), each peer's oldest, until ``k`` distinct peers; None when fewer than ``k`` distinct
    peers have an update pending (no aggregate yet). In height order."""
    taken: list[int] = []
    peers: set[int] = set()
    for height, peer in pending:
        if peer not in peers:
            peers.add(peer)
            taken.append(height)
            if len(taken) == k:
                return taken
    return None


def compute_aggregate(rule: Rule, parent: Params, parent_index: int, updates: list[UpdateIn]) -> Params:
    """The new model: FedBuff (the server's class) over exactly ``updates``, in this order.

    ValueError unless there are exactly K updates, of K distinct peers, each within max_examples."""
    if len(updates) != rule.buffer_size:
        raise ValueError(f"an aggregate takes exactly K={rule.buffer_size} updates, got {len(updates)}")
    if len({u.peer for u in updates}) != len(updates):
        raise ValueError(f"an aggregate takes at most one update per peer, got peers {[u.peer for u in updates]}")
    for u in updates:
        why = rule.examples_error(u.num_examples)
        if why:
            raise ValueError(f"update block {u.height}: {why}")
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
