"""The Store API: every write the asynchronous server makes goes through here.

The rule that makes a killed server safe to resume: an accepted update, the model
version it produced (if any), the dispatch's new status and the loop's resumable state
are committed in **one transaction** (:meth:`Store.record_reply`), before the server acts
on them (evaluates, dispatches again, reports).
"""

from __future__ import annotations

import json
import secrets
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Callable, Iterator

import numpy as np
from sqlalchemy import bindparam, create_engine, event, func, insert, select, update
from sqlalchemy.engine import Connection, Engine
from sqlalchemy.orm import Session, sessionmaker

from fedasync.private import mask_url
from fedasync.store import schema as S
from fedasync.store.blobs import EXTERNAL_MIN_BYTES, BlobFiles, is_marker
from fedasync.store.codec import pack_parts, unpack_params
from fedasync.store.compact import settle
from fedasync.store import serverless_schema as _serverless_schema  # noqa: F401  (its tables on S.Base)
from fedasync.store.retry import retrying_transactions

Params = dict[str, np.ndarray]

# tables of the hot path (Core statements)
_RUN, _C, _D, _U, _MV, _PS, _EV = (m.__table__ for m in (S.Run, S.Client, S.Dispatch, S.Update, S.ModelVersion,
                                                        S.PrivacySpend, S.Evaluation))
_B = bindparam
_SET_DISPATCH = update(_D).where(_D.c.run_id == _B("b_run"), _D.c.task_id == _B("b_task")) \
    .values(status=_B("b_status"), error=_B("b_error"), done_wall=_B("b_now"))
_RUN_STEP = update(_RUN).where(_RUN.c.id == _B("b_run")).values(loop_state=_B("b_state"), virtual_time=_B("b_vt"))
_RUN_VERSION = _RUN_STEP.values(current_version=_B("b_cv"))
_RUN_DISPATCH = _RUN_STEP.values(next_task_id=_B("b_next"))
_APPLIED = update(_U).where(_U.c.run_id == _B("b_run"), _U.c.task_id.in_(_B("b_ids", expanding=True))) \
    .values(applied_in_version=_B("b_v"), pending_params=None)
_SNAPSHOT = {k: update(_RUN).where(_RUN.c.id == _B("b_run")).values({k: _B("b_snap")})
             for k in ("scheduler_state", "strategy_state")}
_REJECT = update(_U).where(_U.c.run_id == _B("b_run"), _U.c.task_id == _B("b_task")) \
    .values(accepted=False, reason=_B("b_reason"), pending_params=None)
_FORGET_FILTER = update(_U).where(_U.c.run_id == _B("b_run"), _U.c.task_id == _B("b_task")) \
    .values(filter_params=None)
_INSERT_U, _INSERT_MV, _INSERT_D = insert(_U), insert(_MV), insert(_D)


def _update(model):
    """An UPDATE that does not look for the rows among the session's objects (none are loaded)."""
    return update(model).execution_options(synchronize_session=False)


def _snapshots(c: Connection, run_id: int, loop_state: Any) -> None:
    """Write the scheduler and strategy snapshots a :class:`~fedasync.store.codec.LoopState`
    carries (if any) in the transaction that writes the loop state referring to them."""
    for col, stmt in _SNAPSHOT.items():
        snap = getattr(loop_state, col, None)
        if snap is not None:
            c.execute(stmt, {"b_run": run_id, "b_snap": snap})


def default_sqlite_url(run_dir: str | Path) -> str:
    return f"sqlite:///{Path(run_dir).resolve() / 'fedasync.db'}"


def make_engine(url: str) -> Engine:
    """An engine; SQLite gets WAL, a busy timeout and foreign keys (several writers may share it)."""
    if url.startswith("sqlite"):
        engine = create_engine(url, connect_args={"timeout": 60})

        @event.listens_for(engine, "connect")
        def _pragmas(dbapi_conn, _rec):  # pragma: no cover - trivial
            cur = dbapi_conn.cursor()
            cur.execute("PRAGMA journal_mode=WAL")
            cur.execute("PRAGMA foreign_keys=ON")
            cur.execute("PRAGMA synchronous=NORMAL")
            cur.close()

        return engine
    return create_engine(url, pool_pre_ping=True)


@retrying_transactions  # a lost connection: the whole method again, with bounded backoff (retry.py)
class Store:
    """Open (and create if needed) the store at ``url``."""

    def __init__(self, url: str, create: bool = True):
        self.url = url
        self.engine = make_engine(url)
        if create:
            from fedasync.store.migrate import upgrade

            upgrade(self.engine)
        self._sessions = sessionmaker(self.engine, expire_on_commit=False)
        self._batch: list[Callable[[Connection], Any]] | None = None
        self._next_task: dict[int, int] = {}  # run id -> next task id as committed by this store
        # big parameter blobs as files beside a SQLite file (blobs.py); deleted after the commit
        self.blobs = BlobFiles.for_sqlite(self.engine.url.database) if url.startswith("sqlite") else None
        self._unlink: list[str] = []  # files of blobs the open transaction forgets (versions)
        self._recycle: list[str] = []  # ... of buffered updates' blobs: kept to write over (blobs.py)

    def close(self) -> None:
        self.drop_spare_files()
        self.engine.dispose()

    def drop_spare_files(self) -> None:
        """Delete the parameter files this process kept to write over (blobs.py); the server calls
        it when its run ends."""
        if self.blobs is not None:
            self.blobs.close()

    @contextmanager
    def session(self) -> Iterator[Session]:
        """A transaction: committed on success, rolled back on any error."""
        with self._sessions.begin() as s:
            yield s

    # -- runs ------------------------------------------------------------------------
    def create_run(self, name: str, strategy: str, seed: int, config_yaml: str, mode: str) -> int:
        """A new run's id; the run gets a random ``run_key`` (what signed updates are bound to)."""
        with self.session() as s:
            run = S.Run(
                name=name, strategy=strategy, seed=seed, config_yaml=config_yaml, mode=mode,
                run_key=secrets.token_hex(16),
                status="running", created_wall=time.time(), current_version=0, next_task_id=0,
            )
            s.add(run)
            s.flush()
            return run.id

    def get_run(self, run_id: int) -> S.Run:
        with self.session() as s:
            run = s.get(S.Run, run_id)
            if run is None:
                raise KeyError(f"no run {run_id} in {mask_url(self.url)}")
            return run

    def list_runs(self) -> list[S.Run]:
        with self.session() as s:
            return list(s.scalars(select(S.Run).order_by(S.Run.id)))

    def set_run_status(self, run_id: int, status: str, stop_reason: str | None = None,
                       summary: dict | None = None) -> None:
        with self.session() as s:
            run = s.get(S.Run, run_id)
            run.status = status
            run.stop_reason = stop_reason
            if status != "running":
                run.finished_wall = time.time()
            if summary is not None:
                run.summary_json = json.dumps(summary)

    # -- clients ---------------------------------------------------------------------
    def register_clients(self, run_id: int, clients: list[dict]) -> None:
        """``clients``: dicts with client_id and optionally profile (dict), public_key, node_id."""
        with self.session() as s:
            for c in clients:
                row = s.get(S.Client, (run_id, c["client_id"]))
                if row is None:
                    row = S.Client(run_id=run_id, client_id=c["client_id"], exhausted=False, tasks_done=0)
                    s.add(row)
                if "profile" in c:
                    row.profile_json = json.dumps(c["profile"])
                for key in ("public_key", "node_id"):
                    if key in c:
                        setattr(row, key, c[key])

    def clients(self, run_id: int) -> list[S.Client]:
        with self.session() as s:
            return list(s.scalars(select(S.Client).where(S.Client.run_id == run_id).order_by(S.Client.client_id)))

    def mark_exhausted(self, run_id: int, client_id: int, reason: str) -> None:
        self._write(lambda c: c.execute(update(_C).where(_C.c.run_id == run_id, _C.c.client_id == client_id)
                                        .values(exhausted=True, exhausted_reason=reason)))

    # -- model versions --------------------------------------------------------------
    def _version_row(self, run_id: int, version: int, parent: int | None, params: Params, sha: str,
                     num_updates: int, virtual: float) -> S.ModelVersion:
        return S.ModelVersion(
            run_id=run_id, version=version, parent=parent, sha256=sha,
            parameters=self._pack(params, f"r{run_id}-v{version}") if params is not None else None,
            num_updates=num_updates, created_virtual=virtual, created_wall=time.time(),
        )

    def add_initial_version(self, run_id: int, params: Params, sha: str, save: bool = True) -> None:
        with self.session() as s:
            s.add(self._version_row(run_id, 0, None, params if save else None, sha, 0, 0.0))

    def load_version(self, run_id: int, version: int | None = None) -> tuple[int, Params]:
        """(version, params) of ``version``, or of the latest version that kept its parameters."""
        with self.session() as s:
            q = select(S.ModelVersion).where(S.ModelVersion.run_id == run_id, S.ModelVersion.parameters.is_not(None))
            if version is not None:
                q = q.where(S.ModelVersion.version == version)
            row = s.scalars(q.order_by(S.ModelVersion.version.desc()).limit(1)).first()
            if row is None:
                raise KeyError(f"run {run_id}: no stored parameters for version {version}")
            return row.version, self._unpack(row.parameters)

    def versions(self, run_id: int) -> list[S.ModelVersion]:
        with self.session() as s:
            return list(s.scalars(select(S.ModelVersion).where(S.ModelVersion.run_id == run_id)
                                  .order_by(S.ModelVersion.version)))

    def record_eval(self, run_id: int, version: int, accuracy: float | None, loss: float | None,
                    metrics: dict[str, float] | None = None, virtual_time: float | None = None) -> None:
        """An evaluation of version ``version``, standing for virtual time ``virtual_time`` (None:
        the version's own time): ``accuracy`` and ``loss`` (None: the task has no such metric) and
        every metric the task reported (``metrics``, JSON). One ``evaluations`` row each; the
        version's row keeps its latest."""
        text = None if metrics is None else json.dumps(metrics, allow_nan=True)

        def op(c: Connection) -> None:
            c.execute(update(_MV).where(_MV.c.run_id == run_id, _MV.c.version == version)
                      .values(accuracy=accuracy, loss=loss, metrics=text))
            t = virtual_time if virtual_time is not None else c.execute(
                select(_MV.c.created_virtual).where(_MV.c.run_id == run_id, _MV.c.version == version)).scalar()
            c.execute(insert(_EV).values(run_id=run_id, version=version, virtual_time=t or 0.0, accuracy=accuracy,
                                         loss=loss, metrics=text, recorded_wall=time.time()))
        self._write(op)

    def evaluations(self, run_id: int) -> list[S.Evaluation]:
        """Run ``run_id``'s evaluations in the order they were recorded (its history)."""
        with self.session() as s:
            return list(s.scalars(select(S.Evaluation).where(S.Evaluation.run_id == run_id)
                                  .order_by(S.Evaluation.id)))

    # -- dispatches and replies (SQLAlchemy Core: the loop's hot path) -----------------
    @contextmanager
    def batch(self) -> Iterator[None]:
        """Every write made inside is committed in **one** transaction when the block ends (the
        loop: the replies taken at one step, the versions they made and the dispatches that
        follow); nothing is written if an exception escapes (a crash), except KeyboardInterrupt (an
        abrupt Ctrl-C): the writes made so far are committed, as if each had been on its own.
        Nested: the outer one commits."""
        if self._batch is not None:
            yield
            return
        self._batch = ops = []
        try:
            yield
        except KeyboardInterrupt:
            self._batch = None
            if ops:
                self._commit(ops)
            raise
        finally:
            self._batch = None
        if ops:
            self._commit(ops)

    def _commit(self, ops: list[Callable[[Connection], Any]]) -> None:
        self._unlink, self._recycle = [], []
        with self.engine.begin() as conn:
            for op in ops:
                op(conn)
        self._unlink_committed()

    # -- parameter blobs (in the row, or a file beside a SQLite file: blobs.py) -----------
    def _pack(self, params: Params, key: str) -> bytes:
        parts = pack_parts(params)
        if self.blobs is not None and sum(len(p) for p in parts) >= EXTERNAL_MIN_BYTES:
            return self.blobs.put(key, parts)
        return b"".join(parts)

    def _unpack(self, blob: bytes) -> Params:
        if is_marker(blob):
            if self.blobs is None:
                raise ValueError(f"{mask_url(self.url)}: a row names a parameter file, but only a SQLite file has them")
            blob = self.blobs.get(blob)
        return unpack_params(blob)

    def _unlink_committed(self) -> None:
        """Delete the files of the blobs the transaction just committed forgot. A buffered
        update's file is read only by the server that owns the run (on resume), so it becomes a
        spare to write over; a version's may be open in a reader outside the server, so it is
        unlinked (the reader keeps what it opened)."""
        keys, self._unlink = self._unlink, []
        spares, self._recycle = self._recycle, []
        if self.blobs is not None:
            if keys:
                self.blobs.delete(keys)
            if spares:
                self.blobs.delete(spares, spare=True)

    def sweep_params(self, run_id: int) -> int:
        """Delete run ``run_id``'s parameter files that no row names (a crash between a file and
        its transaction). Only the server that owns the run may call it (on resume)."""
        if self.blobs is None:
            return 0
        with self.session() as s:
            named = set(s.scalars(select(_MV.c.parameters).where(_MV.c.run_id == run_id,
                                                                 _MV.c.parameters.is_not(None))))
            for col in (_U.c.pending_params, _U.c.filter_params):
                named |= set(s.scalars(select(col).where(_U.c.run_id == run_id, col.is_not(None))))
        return self.blobs.sweep(f"r{run_id}-", named)

    def _write(self, op: Callable[[Connection], Any]) -> None:
        """Run ``op`` in its own transaction, or in the open :meth:`batch`."""
        if self._batch is not None:
            self._batch.append(op)
        else:
            self._commit([op])

    def record_dispatch(self, run_id: int, task_id: int, client_id: int, base_version: int,
                        sent_virtual: float, finish_virtual: float | None, node_id: int | None,
                        message_id: str | None) -> None:
        self.record_dispatches(run_id, [{
            "task_id": task_id, "client_id": client_id, "base_version": base_version, "sent_virtual": sent_virtual,
            "finish_virtual": finish_virtual, "node_id": node_id, "message_id": message_id}], task_id + 1)

    def set_dispatch_status(self, run_id: int, task_id: int, status: str, error: str | None = None,
                            loop_state: str | None = None) -> None:
        now = time.time()

        def op(c: Connection) -> None:
            self._set_dispatch(c, run_id, task_id, status, error, now)
            if loop_state is not None:
                c.execute(update(_RUN).where(_RUN.c.id == run_id).values(loop_state=str(loop_state)))
                _snapshots(c, run_id, loop_state)
        self._write(op)

    def _drop_params(self, c: Connection, run_id: int, versions: list[int] | None) -> None:
        """Retention: forget the parameters of ``versions`` (their rows stay; their files go after
        the commit), on SQLite without leaving their pages underfull (compact.py)."""
        if versions:
            where = (_MV.c.run_id == run_id, _MV.c.version.in_(versions))
            c.execute(update(_MV).where(*where).values(parameters=None))
            settle(c, _MV, *where)
            self._unlink += [f"r{run_id}-v{v}" for v in versions]

    def versions_with_parameters(self, run_id: int) -> list[int]:
        with self.session() as s:
            return list(s.scalars(select(S.ModelVersion.version).where(
                S.ModelVersion.run_id == run_id, S.ModelVersion.parameters.is_not(None))))

    @staticmethod
    def _set_dispatch(c: Connection, run_id: int, task_id: int, status: str, error: str | None, now: float) -> None:
        c.execute(_SET_DISPATCH, {"b_run": run_id, "b_task": task_id, "b_status": status, "b_error": error,
                                  "b_now": now})

    def record_reply(self, run_id: int, task_id: int, update_row: dict, dispatch_status: str,
                     new_version: dict | None, loop_state: str, virtual_time: float,
                     privacy: dict | list[dict] | None = None, client_state: dict | None = None,
                     drop_params: list[int] | None = None, forget_filter_params: int | None = None,
                     rejected: dict[int, str] | None = None) -> None:
        """One transaction (or part of the open :meth:`batch`): the update (accepted or rejected),
        the dispatch's status, the model version it produced (with the ids of every update
        aggregated into it), the run's current version and resumable loop state, the client's
        privacy spend, the parameters of ``drop_params`` versions forgotten (retention) and the
        ``filter_params`` of task ``forget_filter_params`` (the same client's update the filter
        remembered until this one), and the buffered updates ``rejected`` ({task id: reason}: an
        aggregation that made a non-finite model) rewritten rejected, their parameters forgotten."""
        now = time.time()
        row = dict(update_row, run_id=run_id, task_id=task_id, received_wall=now)
        for col, tag in (("pending_params", "u"), ("filter_params", "k")):
            row[col] = self._pack(row[col], f"r{run_id}-{tag}{task_id}") if row.get(col) is not None else None
        version_row = None
        if new_version is not None:
            params = new_version.get("params")
            version_row = {
                "run_id": run_id, "version": new_version["version"], "parent": new_version["parent"],
                "sha256": new_version["sha256"],
                "parameters": self._pack(params, f"r{run_id}-v{new_version['version']}") if params is not None else None,
                "num_updates": len(new_version["task_ids"]), "created_virtual": virtual_time, "created_wall": now}
        spends = [dict(r, run_id=run_id, task_id=task_id, recorded_wall=now)
                  for r in ([privacy] if isinstance(privacy, dict) else privacy or [])]

        run_values = {"b_run": run_id, "b_state": str(loop_state), "b_vt": virtual_time}

        def op(c: Connection) -> None:
            cleared: list[int] = []  # updates whose pending_params / filter_params this step forgets
            c.execute(_INSERT_U, row)
            self._set_dispatch(c, run_id, task_id, dispatch_status, None, now)
            if version_row is not None:
                c.execute(_INSERT_MV, version_row)
                c.execute(_APPLIED, {"b_run": run_id, "b_ids": list(new_version["task_ids"]),
                                     "b_v": version_row["version"]})
                cleared += [t for t in new_version["task_ids"] if t != task_id or row["pending_params"] is not None]
                self._recycle += [f"r{run_id}-u{t}" for t in new_version["task_ids"]]
                c.execute(_RUN_VERSION, dict(run_values, b_cv=version_row["version"]))
            else:
                c.execute(_RUN_STEP, run_values)
            _snapshots(c, run_id, loop_state)
            self._drop_params(c, run_id, drop_params)
            if forget_filter_params is not None:
                c.execute(_FORGET_FILTER, {"b_run": run_id, "b_task": forget_filter_params})
                cleared.append(forget_filter_params)
                self._recycle.append(f"r{run_id}-k{forget_filter_params}")
            for t, why in (rejected or {}).items():
                c.execute(_REJECT, {"b_run": run_id, "b_task": t, "b_reason": why})
                self._recycle.append(f"r{run_id}-u{t}")
                cleared.append(t)
            if cleared:  # their blobs just went: no page left almost empty (compact.py)
                settle(c, _U, _U.c.run_id == run_id, _U.c.task_id.in_(cleared))
            if spends:
                c.execute(insert(_PS), spends)
            if client_state:
                c.execute(update(_C).where(_C.c.run_id == run_id, _C.c.client_id == update_row["client_id"])
                          .values(**client_state))
        self._write(op)

    def record_dispatches(self, run_id: int, rows: list[dict], next_task_id: int,
                          loop_state: str | None = None, virtual_time: float | None = None) -> None:
        """One transaction (or part of the open :meth:`batch`) for a batch of dispatches: their
        rows (``task_id, client_id, base_version, sent_virtual, finish_virtual, node_id,
        message_id`` and optionally ``status``/``error``; a row whose task id exists already is
        updated: a task re-sent on resume), the run's next task id and the loop state after
        choosing them. New rows go in with one bulk INSERT."""
        now = time.time()
        out = []
        for r in rows:
            r = dict(r, run_id=run_id, sent_wall=now, done_wall=None)
            node = r.pop("node_id", None)
            r["node_id"] = None if node is None else str(node)
            r.setdefault("status", "in_flight")
            r.setdefault("error", None)
            out.append(r)
        values: dict[str, Any] = {"next_task_id": next_task_id}
        if loop_state is not None:
            values["loop_state"] = str(loop_state)
        if virtual_time is not None:
            values["virtual_time"] = virtual_time

        def op(c: Connection) -> None:
            if out:
                # only a task id below the next id this store committed may exist already (a re-send)
                known = self._next_task.get(run_id, 0)
                ids = [r["task_id"] for r in out if r["task_id"] < known or run_id not in self._next_task]
                old = set(c.scalars(select(_D.c.task_id).where(_D.c.run_id == run_id, _D.c.task_id.in_(ids)))) \
                    if ids else set()
                new = [r for r in out if r["task_id"] not in old]
                if new:
                    c.execute(_INSERT_D, new)
                for r in out:
                    if r["task_id"] in old:
                        c.execute(update(_D).where(_D.c.run_id == run_id, _D.c.task_id == r["task_id"])
                                  .values(**{k: v for k, v in r.items() if k not in ("run_id", "task_id")}))
            if loop_state is not None and virtual_time is not None:
                c.execute(_RUN_DISPATCH, {"b_run": run_id, "b_state": str(loop_state), "b_vt": virtual_time,
                                          "b_next": next_task_id})
            else:
                c.execute(update(_RUN).where(_RUN.c.id == run_id).values(**values))
            _snapshots(c, run_id, loop_state)
            self._next_task[run_id] = max(next_task_id, self._next_task.get(run_id, 0))
        self._write(op)

    def record_replay(self, run_id: int, row: dict) -> None:
        """A reply that matched no open task (see ``schema.Replay``)."""
        row = dict(row, run_id=run_id, received_wall=time.time())
        self._write(lambda c: c.execute(insert(S.Replay.__table__), row))

    def replays(self, run_id: int) -> list[S.Replay]:
        with self.session() as s:
            return list(s.scalars(select(S.Replay).where(S.Replay.run_id == run_id).order_by(S.Replay.id)))

    def dispatch_status_counts(self, run_id: int) -> dict[str, int]:
        with self.session() as s:
            rows = s.execute(select(S.Dispatch.status, func.count()).where(S.Dispatch.run_id == run_id)
                             .group_by(S.Dispatch.status))
            return {status: int(n) for status, n in rows}

    def pending_updates(self, run_id: int) -> list[tuple[S.Update, Params]]:
        """Accepted updates not yet aggregated, with their parameters, in the order they arrived."""
        with self.session() as s:
            rows = s.scalars(select(S.Update).where(S.Update.run_id == run_id, S.Update.accepted.is_(True),
                                                    S.Update.applied_in_version.is_(None),
                                                    S.Update.pending_params.is_not(None))
                             .order_by(S.Update.id))  # the order they were added in (float sums)
            return [(r, self._unpack(r.pending_params)) for r in rows]

    def filter_updates(self, run_id: int) -> list[tuple[S.Update, Params]]:
        """The updates the robust filter remembers (one per client at most: its last judged update),
        with their parameters as judged, in task order."""
        with self.session() as s:
            rows = s.scalars(select(S.Update).where(S.Update.run_id == run_id, S.Update.filter_params.is_not(None))
                             .order_by(S.Update.task_id))
            return [(r, self._unpack(r.filter_params)) for r in rows]

    def dispatches(self, run_id: int, status: str | None = None) -> list[S.Dispatch]:
        with self.session() as s:
            q = select(S.Dispatch).where(S.Dispatch.run_id == run_id)
            if status is not None:
                q = q.where(S.Dispatch.status == status)
            return list(s.scalars(q.order_by(S.Dispatch.task_id)))

    def updates(self, run_id: int) -> list[S.Update]:
        with self.session() as s:
            return list(s.scalars(select(S.Update).where(S.Update.run_id == run_id).order_by(S.Update.task_id)))

    def mark_in_flight(self, run_id: int, status: str, drop_params: list[int] | None = None) -> int:
        """Close every dispatch still in flight (at the end of a run, or on resume). Returns the count."""
        self._unlink, self._recycle = [], []
        with self.session() as s:
            self._drop_params(s.connection(), run_id, drop_params)
            res = s.execute(_update(S.Dispatch)
                            .where(S.Dispatch.run_id == run_id, S.Dispatch.status == "in_flight")
                            .values(status=status, done_wall=time.time()))
            n = res.rowcount or 0
        self._unlink_committed()
        return n

    def counts(self, run_id: int) -> dict[str, int]:
        with self.session() as s:
            def n(model, *conds):
                return s.scalar(select(func.count()).select_from(model).where(model.run_id == run_id, *conds))
            return {
                "dispatches": n(S.Dispatch),
                "updates": n(S.Update),
                "accepted": n(S.Update, S.Update.accepted.is_(True)),
                "rejected": n(S.Update, S.Update.accepted.is_(False)),
                "versions": n(S.ModelVersion),
            }

    def privacy_spend(self, run_id: int) -> list[S.PrivacySpend]:
        with self.session() as s:
            return list(s.scalars(select(S.PrivacySpend).where(S.PrivacySpend.run_id == run_id)
                                  .order_by(S.PrivacySpend.id)))
