"""The ledger's aggregation rule: FedBuff over exactly the K update blocks an aggregate names.

Pure: the server's own :class:`fedasync.server.strategies.FedBuff` (through ``make_strategy``),
no store. The genesis block carries :meth:`Rule.to_dict`, so a chain is self-describing.
"""

from __future__ import annotations

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
