"""Tables of the server-less variants (FLchain ledger, gossip), on the store's ``Base``.

Every row names its run (``runs.id``): a ledger or gossip run is a row of ``runs`` with
``mode`` ``ledger`` or ``gossip``, so ``fedasync runs`` lists it beside server runs.

Ledger (``fedasync.serverless.flchain``):

- ``ledger_blocks``: one row per block, ``UNIQUE (run_id, height)``: two peers racing for a
  height are settled here. A block's ``hash`` covers every column but ``id``, ``run_id``,
  ``signature`` and ``created_wall``; the Ed25519 ``signature`` (hex) is over the hash.
- ``ledger_payloads``: parameters (``encode_params`` bytes), stored once, keyed by the
  sha256 of those bytes.
- ``ledger_evals``: accuracy of model blocks (not part of the chain: evaluations are
  observations, not facts anyone signed).

Gossip (``fedasync.serverless.gossip``):

- ``gossip_models``: each peer's own model row (``UNIQUE (run_id, peer_id)``), locked in
  ``id`` order when two are averaged.
- ``gossip_events``: one row per averaging step.
- ``gossip_metrics``: average-model accuracy, min/max peer accuracy, consensus distance
  over time.

``serverless_runs`` holds what every peer of a run must agree on (kind, number of peers,
topology, stop limits) as JSON; ``serverless_peers`` registers each peer when it is ready
(the run starts when all are) and keeps its counts when it stops.
"""

from __future__ import annotations

from sqlalchemy import (
    Boolean,
    Float,
    ForeignKey,
    Index,
    Integer,
    LargeBinary,
    String,
    Text,
    UniqueConstraint,
)
from sqlalchemy.orm import Mapped, mapped_column

from fedasync.store.schema import Base


class ServerlessRun(Base):
    __tablename__ = "serverless_runs"
    run_id: Mapped[int] = mapped_column(ForeignKey("runs.id", ondelete="CASCADE"), primary_key=True)
    kind: Mapped[str] = mapped_column(String(10))  # ledger | gossip
    num_peers: Mapped[int] = mapped_column(Integer)
    topology: Mapped[str | None] = mapped_column(String(20), nullable=True)
    settings_json: Mapped[str] = mapped_column(Text)
    clock: Mapped[str] = mapped_column(String(10), default="wall")  # wall | virtual
    # when every peer was ready and the run went from "starting" to "running" (epoch seconds);
    # times reported for a run count from here
    started_wall: Mapped[float | None] = mapped_column(Float, nullable=True)


class ServerlessPeer(Base):
    """A peer of a run: registered when it is ready to work, closed with its counts when it stops."""

    __tablename__ = "serverless_peers"
    run_id: Mapped[int] = mapped_column(ForeignKey("runs.id", ondelete="CASCADE"), primary_key=True)
    peer_id: Mapped[int] = mapped_column(Integer, primary_key=True)
    public_key: Mapped[str | None] = mapped_column(String(64), nullable=True)  # ledger: raw Ed25519, hex
    host: Mapped[str | None] = mapped_column(String(200), nullable=True)
    pid: Mapped[int | None] = mapped_column(Integer, nullable=True)
    ready_wall: Mapped[float] = mapped_column(Float)
    finished_wall: Mapped[float | None] = mapped_column(Float, nullable=True)
    stop_reason: Mapped[str | None] = mapped_column(String(200), nullable=True)
    stats_json: Mapped[str | None] = mapped_column(Text, nullable=True)


class LedgerPayload(Base):
    __tablename__ = "ledger_payloads"
    sha256: Mapped[str] = mapped_column(String(64), primary_key=True)
    data: Mapped[bytes] = mapped_column(LargeBinary)
    size: Mapped[int] = mapped_column(Integer)


class LedgerBlock(Base):
    __tablename__ = "ledger_blocks"
    __table_args__ = (
        UniqueConstraint("run_id", "height", name="uq_ledger_blocks_run_height"),
        Index("ix_ledger_blocks_run_kind", "run_id", "kind"),
    )
    id: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=True)
    run_id: Mapped[int] = mapped_column(ForeignKey("runs.id", ondelete="CASCADE"))
    height: Mapped[int] = mapped_column(Integer)
    prev_hash: Mapped[str] = mapped_column(String(64))
    hash: Mapped[str] = mapped_column(String(64))
    kind: Mapped[str] = mapped_column(String(10))  # genesis | update | aggregate
    payload_sha256: Mapped[str] = mapped_column(String(64))
    meta_json: Mapped[str] = mapped_column(Text)
    public_key: Mapped[str] = mapped_column(String(64))  # raw Ed25519 public key, hex
    signature: Mapped[str] = mapped_column(String(128))  # hex
    created: Mapped[float] = mapped_column(Float)  # epoch seconds (wall) or virtual seconds (simulation)
    created_wall: Mapped[float] = mapped_column(Float)  # when the row was written (not hashed)
    peer_id: Mapped[int | None] = mapped_column(Integer, nullable=True)


class LedgerEval(Base):
    __tablename__ = "ledger_evals"
    run_id: Mapped[int] = mapped_column(ForeignKey("runs.id", ondelete="CASCADE"), primary_key=True)
    height: Mapped[int] = mapped_column(Integer, primary_key=True)
    model_index: Mapped[int] = mapped_column(Integer)
    accuracy: Mapped[float] = mapped_column(Float)
    loss: Mapped[float] = mapped_column(Float)
    evaluated_wall: Mapped[float] = mapped_column(Float)


class GossipModel(Base):
    __tablename__ = "gossip_models"
    __table_args__ = (UniqueConstraint("run_id", "peer_id", name="uq_gossip_models_run_peer"),)
    id: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=True)
    run_id: Mapped[int] = mapped_column(ForeignKey("runs.id", ondelete="CASCADE"))
    peer_id: Mapped[int] = mapped_column(Integer)
    version: Mapped[int] = mapped_column(Integer, default=0)  # bumped by every write to this row
    steps: Mapped[int] = mapped_column(Integer, default=0)  # averaging steps this peer started
    params: Mapped[bytes] = mapped_column(LargeBinary)
    sha256: Mapped[str] = mapped_column(String(64))  # params_sha256 of the arrays
    updated_virtual: Mapped[float] = mapped_column(Float, default=0.0)
    updated_wall: Mapped[float] = mapped_column(Float)
    exhausted: Mapped[bool] = mapped_column(Boolean, default=False)
    exhausted_reason: Mapped[str | None] = mapped_column(String(200), nullable=True)
    epsilon: Mapped[float | None] = mapped_column(Float, nullable=True)


class GossipEvent(Base):
    __tablename__ = "gossip_events"
    __table_args__ = (Index("ix_gossip_events_run", "run_id", "id"),)
    id: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=True)
    run_id: Mapped[int] = mapped_column(ForeignKey("runs.id", ondelete="CASCADE"))
    peer_id: Mapped[int] = mapped_column(Integer)
    neighbour_id: Mapped[int] = mapped_column(Integer)
    step: Mapped[int] = mapped_column(Integer)
    peer_version: Mapped[int] = mapped_column(Integer)  # versions after the write
    neighbour_version: Mapped[int] = mapped_column(Integer)
    base_version: Mapped[int] = mapped_column(Integer)  # the peer's row version it trained from
    sha256: Mapped[str] = mapped_column(String(64))  # of the averaged model both rows now hold
    loss: Mapped[float | None] = mapped_column(Float, nullable=True)
    epsilon: Mapped[float | None] = mapped_column(Float, nullable=True)
    virtual_time: Mapped[float] = mapped_column(Float)
    wall_time: Mapped[float] = mapped_column(Float)


class GossipMetric(Base):
    __tablename__ = "gossip_metrics"
    id: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=True)
    run_id: Mapped[int] = mapped_column(ForeignKey("runs.id", ondelete="CASCADE"))
    events: Mapped[int] = mapped_column(Integer)
    time_s: Mapped[float] = mapped_column(Float)  # virtual (simulation) or wall seconds since start
    accuracy: Mapped[float] = mapped_column(Float)  # of the average model
    loss: Mapped[float] = mapped_column(Float)
    min_accuracy: Mapped[float] = mapped_column(Float)
    max_accuracy: Mapped[float] = mapped_column(Float)
    consensus_distance: Mapped[float] = mapped_column(Float)
    recorded_wall: Mapped[float] = mapped_column(Float)
