"""The strategy's snapshot is written when it changes, not with every loop state.

With ``server.server_momentum > 0`` the strategy's state holds the float64 velocity of the whole
model (8 bytes a parameter, more as base64 JSON). The loop commits a loop state with every batch of
dispatches and every reply; only the ones that follow an aggregation may carry the strategy's state
(``runs.strategy_state``), the others refer to it by id. These tests count the bytes of each loop
state written, and check that a store whose loop state embeds the strategy (written before
``runs.strategy_state``) still resumes to the same model.
"""

from __future__ import annotations


import pytest
from sqlalchemy import create_engine, text

from fedasync.config import config_from_dict
from fedasync.server.loop import AsyncServer
from fedasync.server.transport import LocalTransport
from fedasync.store import Store, dumps_state, loads_state, migrate
from test_store import url  # noqa: F401 (a SQLite file, or a fresh PostgreSQL schema: one fixture)

HIDDEN = 960  # mlp on digits, 64 -> H -> H -> 10: 64H + H + H^2 + H + 10H + 10 = 994,570 parameters
PARAMS = 994_570


def cfg_of(hidden: int, max_versions: int, momentum: float = 0.9, strategy: str = "fedbuff"):
    server = {"strategy": strategy, "concurrency": 4, "max_versions": max_versions, "eval_every": 100,
              "server_lr": 0.7, "server_momentum": momentum}
    server.update({"buffer_size": 3} if strategy == "fedbuff" else {"clients_per_round": 3, "backup_workers": 1})
    return config_from_dict({
        "name": "snap", "seed": 3,
        "data": {"dataset": "digits", "num_clients": 8, "partitioner": "iid"},
        "model": {"name": "mlp", "hidden": hidden},
        "train": {"local_steps": 1, "batch_size": 8},
        "server": server,
    })


class Recorder(Store):
    """A store that notes, for each loop state written, its size, the strategy snapshot's size
    (0: none) and whether the write made a new version."""

    def __init__(self, url: str) -> None:
        super().__init__(url)
        self.writes: list[tuple[str, int, int, bool]] = []

    def _note(self, kind: str, loop_state, new_version: bool = False) -> None:
        if loop_state is not None:
            snap = getattr(loop_state, "strategy_state", None)
            self.writes.append((kind, len(str(loop_state)), len(snap) if snap else 0, new_version))

    def record_reply(self, run_id, task_id, row, status, new_version, loop_state, *a, **kw):
        self._note("reply", loop_state, new_version is not None)
        return super().record_reply(run_id, task_id, row, status, new_version, loop_state, *a, **kw)

    def record_dispatches(self, run_id, rows, next_task_id, loop_state=None, **kw):
        self._note("dispatch", loop_state)
        return super().record_dispatches(run_id, rows, next_task_id, loop_state=loop_state, **kw)

    def set_dispatch_status(self, run_id, task_id, status, error=None, loop_state=None, **kw):
        self._note("status", loop_state)
        return super().set_dispatch_status(run_id, task_id, status, error, loop_state=loop_state, **kw)


def test_loop_states_between_aggregations_are_small_with_momentum(tmp_path):
    """fedbuff (K = 3), momentum 0.9, a model of 1 M parameters: the velocity (8 MB of float64)
    is written once per aggregation (and once at the start, without one); every other loop state,
    a buffered reply or a batch of dispatches, is under 8 KB (before: ~10.6 MB each, the velocity
    embedded)."""
    store = Recorder(f"sqlite:///{tmp_path / 's.db'}")
    summary = AsyncServer(cfg_of(HIDDEN, 3), LocalTransport(), store).run()
    assert summary["versions"] == 3
    writes = store.writes
    assert len(writes) > 3 * 3  # K replies per version, plus the dispatches
    assert max(size for _, size, _, _ in writes) < 8_000, [w[:2] for w in writes if w[1] >= 8_000][:3]
    snapshots = [w for w in writes if w[2]]
    # the first loop state (no velocity yet), then one per aggregation: the reply that made a version
    assert snapshots[0] == writes[0]
    assert snapshots[1:] == [w for w in writes if w[3]] and len(snapshots) == 4
    assert all(w[2] > 8 * PARAMS for w in snapshots[1:])  # the velocity, float64, is in them
    between = [w for w in writes[1:] if not w[3]]
    assert len(between) >= 2 * 3 and all(w[2] == 0 for w in between)
    run = store.get_run(summary["run_id"])
    state = loads_state(run.loop_state)
    assert "strategy" not in state
    assert loads_state(run.strategy_state)["id"] == state["strategy_snapshot"] == 3


@pytest.mark.parametrize("strategy", ["fedbuff", "fedavg"])
def test_a_store_whose_loop_state_embeds_the_strategy_still_resumes(url, strategy, tmp_path):
    """A run stopped at 3 versions, its store taken back to revision 0008 (the downgrade puts the
    strategy's snapshot back inside the loop state, as stores written before ``runs.strategy_state``
    hold it), then opened (upgraded) and continued to 6: the model of the run made with 6."""
    ref = AsyncServer(cfg_of(16, 6, strategy=strategy), LocalTransport(),
                      Store(f"sqlite:///{tmp_path / 'ref.db'}")).run()
    store = Store(url)
    first = AsyncServer(cfg_of(16, 3, strategy=strategy), LocalTransport(), store).run()
    snap = loads_state(store.get_run(first["run_id"]).strategy_state)
    assert snap["id"] == 3 and "velocity" in snap["state"]
    store.close()
    engine = create_engine(url)
    migrate.downgrade(engine, "0008")
    with engine.connect() as conn:
        (loop_text,) = conn.execute(text("SELECT loop_state FROM runs WHERE id = :i"), {"i": first["run_id"]}).one()
    engine.dispose()
    state = loads_state(loop_text)
    assert "strategy_snapshot" not in state
    assert dumps_state(state["strategy"]) == dumps_state(snap["state"])
    store = Store(url)  # upgraded on open
    assert store.get_run(first["run_id"]).strategy_state is None
    summary = AsyncServer(cfg_of(16, 6, strategy=strategy), LocalTransport(), store,
                          resume_run_id=first["run_id"]).run()
    assert (summary["versions"], summary["model_sha256"]) == (6, ref["model_sha256"])
    # the resume wrote the embedded snapshot to the column (id 0), then one per aggregation
    assert loads_state(store.get_run(first["run_id"]).strategy_state)["id"] == 3
    store.close()
