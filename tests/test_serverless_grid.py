"""The ledger and gossip on the virtual clock evaluate on the server's grid (issue 34): a row at every
``server.eval_every_s`` with the model current then, time to target held ``server.target_hold``
rows (:func:`fedasync.server.evaluation.time_to_target`), the models untouched by the cadence."""

import pytest
from sqlalchemy import select

from fedasync.config import load_config
from fedasync.server.evaluation import accuracy_goal, time_to_target
from fedasync.serverless.common import ServerlessError
from fedasync.serverless.flchain import ChainView
from fedasync.serverless.sim import simulate_gossip, simulate_ledger
from fedasync.store import Store
from fedasync.store import serverless_schema as SS

pytestmark = pytest.mark.usefixtures("one_thread")

# six peers (= concurrency), K = 3, the quickstart's data and speeds
BASE = ["name=grid", "data.num_clients=6", "server.concurrency=6", "server.buffer_size=3",
        "server.max_virtual_time=null", "train.local_steps=3", "server.target_accuracy=null"]


def cfg_of(*overrides: str):
    return load_config(None, BASE + list(overrides))


def store(tmp_path, name):
    return Store(f"sqlite:///{tmp_path / name}.db")


def _on_grid(history, every_s):
    """All rows but a final one at the grid times 0, every_s, 2 every_s, ... in order."""
    times = [h["time_s"] for h in history]
    grid = [round(k * every_s, 6) for k in range(len(times))]
    return times == grid or times[:-1] == grid[:-1]


def test_ledger_rows_at_the_grid_times_hold_the_model_current_then(tmp_path):
    st = store(tmp_path, "l")
    s = simulate_ledger(cfg_of("server.eval_every_s=0.05", "server.max_versions=8"), st)
    h = s["history"]
    assert s["eval_every_s"] == 0.05 and s["target_hold"] == 3 and s["stop_reason"] == "max_steps"
    assert _on_grid(h, 0.05) and len(h) > s["versions"] + 1  # more grid times than model blocks
    view = ChainView(st, s["run_id"])
    view.refresh()
    made = [view.blocks[m].created for m in view.models]  # model index i made at made[i]
    for row in h:
        assert row["version"] == max(i for i, t in enumerate(made) if t <= row["time_s"] + 1e-6)
        assert row["virtual_time_s"] == row["time_s"]
    assert h[-1]["version"] == s["versions"] == 8
    # the metrics of a model are measured once and reused: the same model, the same figures
    by_version = {}
    for row in h:
        assert by_version.setdefault(row["version"], (row["accuracy"], row["loss"])) == (row["accuracy"], row["loss"])


def test_gossip_rows_at_the_grid_times_hold_the_events_done_then(tmp_path):
    st = store(tmp_path, "g")
    s = simulate_gossip(cfg_of("server.eval_every_s=0.05"), st, "ring", max_steps=3)
    h = s["history"]
    assert s["eval_every_s"] == 0.05 and s["eval_every"] is None and s["target_hold"] == 3
    assert _on_grid(h, 0.05) and len(h) > 3
    with st.session() as ses:
        done = sorted(ses.scalars(select(SS.GossipEvent.virtual_time)
                                  .where(SS.GossipEvent.run_id == s["run_id"])).all())
        metric_times = sorted(ses.scalars(select(SS.GossipMetric.time_s)
                                          .where(SS.GossipMetric.run_id == s["run_id"])).all())
    assert len(done) == s["averaging_events"] == 18
    for row in h:
        assert row["events"] == row["version"] == sum(1 for t in done if t <= row["time_s"] + 1e-6)
    assert metric_times == pytest.approx(sorted(row["time_s"] for row in h))  # one gossip_metrics row per row


def test_time_to_target_is_the_held_one_of_the_history(tmp_path):
    # low targets, first met by a row the next ones fall from: held once vs three times differ
    for hold in (1, 3):
        cfg = cfg_of("server.eval_every_s=0.05", "server.max_versions=14", "server.target_accuracy=0.2",
                     f"server.target_hold={hold}")
        s = simulate_ledger(cfg, store(tmp_path, f"l{hold}"), stop_at_target=False)
        want = time_to_target([dict(r, virtual_time_s=r["time_s"]) for r in s["history"]], accuracy_goal(0.2), hold)
        assert want is not None and s["time_to_target_s"] == want and s["target_hold"] == hold
        cfg = cfg_of("server.eval_every_s=0.05", "server.target_accuracy=0.13", f"server.target_hold={hold}")
        g = simulate_gossip(cfg, store(tmp_path, f"g{hold}"), "ring", max_steps=6, stop_at_target=False)
        want = time_to_target(g["history"], accuracy_goal(0.13), hold)
        assert want is not None and g["time_to_target_s"] == want
        assert g["target"] == {"metric": "accuracy", "value": 0.13, "mode": "max"} and g["target_hold"] == hold
        if hold == 1:
            first = (s["time_to_target_s"], g["time_to_target_s"])
    assert s["time_to_target_s"] > first[0] and g["time_to_target_s"] > first[1]  # the hold moved both


def test_stop_at_target_stops_once_the_target_has_held(tmp_path):
    cfg = cfg_of("server.eval_every_s=0.05", "server.max_versions=40", "server.target_accuracy=0.2")
    s = simulate_ledger(cfg, store(tmp_path, "l"))
    h = s["history"]
    assert s["stop_reason"] == "target_accuracy" and s["versions"] < 40
    assert [r["accuracy"] >= 0.2 for r in h[-3:]] == [True] * 3 and h[-4]["accuracy"] < 0.2
    assert h[-3]["time_s"] == s["time_to_target_s"] and h[-1]["time_s"] == pytest.approx(s["time_to_target_s"] + 0.1)
    assert s["virtual_time_s"] == h[-1]["time_s"]


def test_the_models_do_not_depend_on_the_evaluation_cadence(tmp_path):
    ledger = {simulate_ledger(load_config(None, BASE + cad + ["server.max_versions=6"]),
                              store(tmp_path, f"l{i}"))["model_sha256"]
              for i, cad in enumerate((["server.eval_every_s=0.05"], ["server.eval_every_s=0.3"],
                                       ["server.eval_every=2"]))}
    assert len(ledger) == 1
    gossip = {simulate_gossip(load_config(None, BASE + cad), store(tmp_path, f"g{i}"), "ring",
                              max_steps=3, eval_every=every)["model_sha256"]
              for i, (cad, every) in enumerate(((["server.eval_every_s=0.05"], None),
                                                (["server.eval_every_s=0.3"], None), ([], 6)))}
    assert len(gossip) == 1


def test_eval_every_keeps_the_index_cadence(tmp_path):
    s = simulate_ledger(cfg_of("server.eval_every=2", "server.max_versions=6"), store(tmp_path, "l"))
    assert s["eval_every_s"] is None and s["eval_every"] == 2
    assert [r["version"] for r in s["history"]] == [0, 2, 4, 6]
    g = simulate_gossip(cfg_of(), store(tmp_path, "g"), "ring", max_steps=2, eval_every=4)
    assert g["eval_every_s"] is None and g["eval_every"] == 4
    assert [r["events"] for r in g["history"]] == [0, 4, 8, 12]


def test_a_target_on_a_metric_the_peers_do_not_measure_is_one_line(tmp_path):
    cfg = cfg_of("server.target.metric=f1", "server.target.value=0.5", "server.max_versions=2")
    with pytest.raises(ServerlessError, match=r"^server\.target\.metric: a ledger run measures accuracy and loss, "
                                              r"not 'f1'$"):
        simulate_ledger(cfg, store(tmp_path, "l"))
