"""SQLAlchemy 2 ORM schema of the fedasync store.

One database may hold many runs. Every row names its run. Times are stored twice where it
matters: ``*_virtual`` (the simulated clock, seconds) and ``*_wall`` (UTC epoch seconds).
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
from sqlalchemy.orm import DeclarativeBase, Mapped, mapped_column


class Base(DeclarativeBase):
    pass


class Run(Base):
    __tablename__ = "runs"
    id: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=True)
    name: Mapped[str] = mapped_column(String(200))
    strategy: Mapped[str] = mapped_column(String(40))
    mode: Mapped[str] = mapped_column(String(20))  # simulation | deployment
    seed: Mapped[int] = mapped_column(Integer)
    # the run's random identifier (secrets.token_hex(16)), which every signed update covers: it
    # binds a signature to this run of this store (``id`` is 1 in every fresh store). Migration 0006
    run_key: Mapped[str | None] = mapped_column(String(32), nullable=True)  # (never NULL: see 0006)
    config_yaml: Mapped[str] = mapped_column(Text)
    status: Mapped[str] = mapped_column(String(20), default="running")  # running|finished|stopped|failed
    stop_reason: Mapped[str | None] = mapped_column(String(200), nullable=True)
    created_wall: Mapped[float] = mapped_column(Float)
    finished_wall: Mapped[float | None] = mapped_column(Float, nullable=True)
    current_version: Mapped[int] = mapped_column(Integer, default=0)
    next_task_id: Mapped[int] = mapped_column(Integer, default=0)
    virtual_time: Mapped[float] = mapped_column(Float, default=0.0)
    # the loop's resumable state: strategy buffer, scheduler RNG (JSON, arrays base64)
    loop_state: Mapped[str | None] = mapped_column(Text, nullable=True)
    # the scheduler's per-client state, written whole now and then; loop_state holds what changed since
    scheduler_state: Mapped[str | None] = mapped_column(Text, nullable=True)
    # the strategy's state, written when an aggregation changed it; loop_state refers to it (0009)
    strategy_state: Mapped[str | None] = mapped_column(Text, nullable=True)
    summary_json: Mapped[str | None] = mapped_column(Text, nullable=True)


class Client(Base):
    __tablename__ = "clients"
    run_id: Mapped[int] = mapped_column(ForeignKey("runs.id", ondelete="CASCADE"), primary_key=True)
    client_id: Mapped[int] = mapped_column(Integer, primary_key=True)
    profile_json: Mapped[str | None] = mapped_column(Text, nullable=True)
    node_id: Mapped[str | None] = mapped_column(String(24), nullable=True)  # uint64: too big for BIGINT
    public_key: Mapped[str | None] = mapped_column(Text, nullable=True)
    exhausted: Mapped[bool] = mapped_column(Boolean, default=False)
    exhausted_reason: Mapped[str | None] = mapped_column(String(200), nullable=True)
    # privacy: the client's persistent accountant (JSON: {"accountant": name, "history": [[sigma, q, steps], ...]})
    accountant_state: Mapped[str | None] = mapped_column(Text, nullable=True)
    epsilon: Mapped[float | None] = mapped_column(Float, nullable=True)
    tasks_done: Mapped[int] = mapped_column(Integer, default=0)


class Dispatch(Base):
    __tablename__ = "dispatches"
    __table_args__ = (UniqueConstraint("run_id", "task_id"), Index("ix_dispatch_status", "run_id", "status"))
    id: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=True)
    run_id: Mapped[int] = mapped_column(ForeignKey("runs.id", ondelete="CASCADE"))
    task_id: Mapped[int] = mapped_column(Integer)
    client_id: Mapped[int] = mapped_column(Integer)
    node_id: Mapped[str | None] = mapped_column(String(24), nullable=True)  # uint64: too big for BIGINT
    message_id: Mapped[str | None] = mapped_column(String(100), nullable=True)
    base_version: Mapped[int] = mapped_column(Integer)
    sent_virtual: Mapped[float] = mapped_column(Float)
    finish_virtual: Mapped[float | None] = mapped_column(Float, nullable=True)
    sent_wall: Mapped[float] = mapped_column(Float)
    done_wall: Mapped[float | None] = mapped_column(Float, nullable=True)
    # in_flight | replied | failed | timeout | cancelled | lost (in flight when the server died)
    status: Mapped[str] = mapped_column(String(20), default="in_flight")
    error: Mapped[str | None] = mapped_column(Text, nullable=True)


class Update(Base):
    __tablename__ = "updates"
    __table_args__ = (UniqueConstraint("run_id", "task_id"),)
    id: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=True)
    run_id: Mapped[int] = mapped_column(ForeignKey("runs.id", ondelete="CASCADE"))
    task_id: Mapped[int] = mapped_column(Integer)
    client_id: Mapped[int] = mapped_column(Integer)
    base_version: Mapped[int] = mapped_column(Integer)
    version_at_arrival: Mapped[int] = mapped_column(Integer)
    staleness: Mapped[int] = mapped_column(Integer)
    weight: Mapped[float | None] = mapped_column(Float, nullable=True)
    num_examples: Mapped[int | None] = mapped_column(Integer, nullable=True)
    loss: Mapped[float | None] = mapped_column(Float, nullable=True)
    epsilon: Mapped[float | None] = mapped_column(Float, nullable=True)
    params_sha256: Mapped[str | None] = mapped_column(String(64), nullable=True)
    accepted: Mapped[bool] = mapped_column(Boolean)
    reason: Mapped[str | None] = mapped_column(String(100), nullable=True)
    applied_in_version: Mapped[int | None] = mapped_column(Integer, nullable=True)
    # the parameters of an accepted update still waiting in the strategy's buffer (cleared once
    # aggregated): a resumed server rebuilds the buffer from these
    pending_params: Mapped[bytes | None] = mapped_column(LargeBinary, nullable=True)
    # the update's parameters as the robust filter judged them, while the filter remembers it as
    # its client's previous update (kardam; cleared by the client's next judged update): a resumed
    # server rebuilds the filter's per-client state from these
    filter_params: Mapped[bytes | None] = mapped_column(LargeBinary, nullable=True)
    received_virtual: Mapped[float] = mapped_column(Float)
    received_wall: Mapped[float] = mapped_column(Float)


class ModelVersion(Base):
    __tablename__ = "model_versions"
    run_id: Mapped[int] = mapped_column(ForeignKey("runs.id", ondelete="CASCADE"), primary_key=True)
    version: Mapped[int] = mapped_column(Integer, primary_key=True)
    parent: Mapped[int | None] = mapped_column(Integer, nullable=True)
    sha256: Mapped[str] = mapped_column(String(64))
    parameters: Mapped[bytes | None] = mapped_column(LargeBinary, nullable=True)
    num_updates: Mapped[int] = mapped_column(Integer, default=0)
    created_virtual: Mapped[float] = mapped_column(Float)
    created_wall: Mapped[float] = mapped_column(Float)
    accuracy: Mapped[float | None] = mapped_column(Float, nullable=True)
    loss: Mapped[float | None] = mapped_column(Float, nullable=True)
    # the version's latest evaluation (every one, with its time, is a row of ``evaluations``)
    metrics: Mapped[str | None] = mapped_column(Text, nullable=True)  # JSON: every metric of the evaluation


class Evaluation(Base):
    """One row of a run's history: the model current at ``virtual_time`` (version ``version``)
    evaluated on the server's evaluation set. Several rows may share a version (the evaluation
    grid, ``server.eval_every_s``, records one per grid time). Added by migration 0008."""

    __tablename__ = "evaluations"
    __table_args__ = (Index("ix_evaluations_run", "run_id"),)
    id: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=True)
    run_id: Mapped[int] = mapped_column(ForeignKey("runs.id", ondelete="CASCADE"))
    version: Mapped[int] = mapped_column(Integer)
    virtual_time: Mapped[float] = mapped_column(Float)  # the grid time (or the run's time: eval_every, the end)
    accuracy: Mapped[float | None] = mapped_column(Float, nullable=True)
    loss: Mapped[float | None] = mapped_column(Float, nullable=True)
    metrics: Mapped[str | None] = mapped_column(Text, nullable=True)  # JSON: every metric of the evaluation
    recorded_wall: Mapped[float] = mapped_column(Float)


class PrivacySpend(Base):
    __tablename__ = "privacy_spend"
    id: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=True)
    run_id: Mapped[int] = mapped_column(ForeignKey("runs.id", ondelete="CASCADE"))
    client_id: Mapped[int] = mapped_column(Integer)  # -1: the server (central DP)
    task_id: Mapped[int | None] = mapped_column(Integer, nullable=True)
    accountant: Mapped[str] = mapped_column(String(10))
    noise_multiplier: Mapped[float] = mapped_column(Float)
    sample_rate: Mapped[float] = mapped_column(Float)
    steps: Mapped[int] = mapped_column(Integer)
    epsilon: Mapped[float] = mapped_column(Float)
    delta: Mapped[float] = mapped_column(Float)
    recorded_wall: Mapped[float] = mapped_column(Float)


class Replay(Base):
    """A reply that matched no open task (a replay of a closed task's reply, or one for a task
    that was never dispatched). Kept apart from ``updates``, whose ``UNIQUE(run_id, task_id)``
    holds the one reply that closed each task. Added by migration 0002."""

    __tablename__ = "replays"
    __table_args__ = (Index("ix_replays_run", "run_id"),)
    id: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=True)
    run_id: Mapped[int] = mapped_column(ForeignKey("runs.id", ondelete="CASCADE"))
    task_id: Mapped[int | None] = mapped_column(Integer, nullable=True)  # the task it claims to answer
    client_id: Mapped[int | None] = mapped_column(Integer, nullable=True)
    message_id: Mapped[str | None] = mapped_column(String(100), nullable=True)
    reason: Mapped[str] = mapped_column(String(100))  # replay
    params_sha256: Mapped[str | None] = mapped_column(String(64), nullable=True)
    received_virtual: Mapped[float] = mapped_column(Float)
    received_wall: Mapped[float] = mapped_column(Float)

