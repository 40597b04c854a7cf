"""One evaluation grid (issue 34): every strategy is evaluated at the same virtual times
(``server.eval_every_s``), the model current at each grid time; time to target is the first grid
time from which the target holds ``server.target_hold`` evaluations in a row."""

from __future__ import annotations

import math

import pytest

from fedasync.config import ConfigError, config_from_dict, load_config
from fedasync.server.evaluation import (Goal, accuracy_goal, grid_value, next_grid_index,
                                        time_to_target)
from fedasync.server.loop import AsyncServer
from fedasync.server.transport import LocalTransport
from fedasync.store import Store

from test_resume import Crash, assert_same_run, check_invariants, crash_at, make_cfg, store_at

pytestmark = pytest.mark.usefixtures("one_thread")


def quick(strategy: str, *extra: str):
    """The quickstart, shrunk: 20 clients, 10 virtual seconds, the default grid (every 2 s)."""
    per = {"fedbuff": ["server.buffer_size=3"], "fedavg": ["server.clients_per_round=5"], "fedasync": []}[strategy]
    return load_config(None, ["data.num_clients=20", "server.concurrency=5", f"server.strategy={strategy}",
                              "server.max_virtual_time=10", "train.local_steps=5", *per, *extra])


def run(cfg, store: Store | None = None) -> tuple[dict, Store]:
    store = store or Store("sqlite://")
    return AsyncServer(cfg, LocalTransport(), store).run(), store


def version_at(store: Store, run_id: int, t: float) -> int:
    """The last version committed at a virtual time <= t."""
    return max(v.version for v in store.versions(run_id) if v.created_virtual <= t)


@pytest.mark.parametrize("strategy", ["fedbuff", "fedasync", "fedavg"])
def test_rows_are_at_the_grid_times_with_the_model_current_there(strategy):
    cfg = quick(strategy)
    assert cfg.server.eval_every_s == 2.0  # the quickstart evaluates on the default grid
    s, store = run(cfg)
    assert s["stop_reason"] == "max_virtual_time" and s["versions"] > 5
    assert [h["virtual_time_s"] for h in s["history"]] == [0.0, 2.0, 4.0, 6.0, 8.0, 10.0]
    for h in s["history"]:
        assert h["version"] == version_at(store, s["run_id"], h["virtual_time_s"]), h
    assert s["history"][-1]["version"] == s["versions"]  # the final model is the last row (at 10 s)
    rows = store.evaluations(s["run_id"])  # every row stored, with its time
    assert [(e.version, e.virtual_time, e.accuracy) for e in rows] == \
           [(h["version"], h["virtual_time_s"], h["accuracy"]) for h in s["history"]]
    assert s["eval_every_s"] == 2.0 and s["target_hold"] == 3


def test_fedavg_between_rounds_repeats_the_version_and_its_metrics_without_evaluating_again():
    cfg = quick("fedavg", "server.eval_every_s=0.25", "server.max_virtual_time=4")
    srv = AsyncServer(cfg, LocalTransport(), Store("sqlite://"))
    evaluated = []
    inner = srv.evaluator
    srv.evaluator = lambda params: evaluated.append(1) or inner(params)
    s = srv.run()
    h = s["history"]
    assert [r["virtual_time_s"] for r in h] == [k * 0.25 for k in range(17)]
    repeats = [(a, b) for a, b in zip(h, h[1:]) if a["version"] == b["version"]]
    assert repeats  # a round lasts longer than 0.25 s
    for a, b in repeats:
        assert (a["accuracy"], a["loss"]) == (b["accuracy"], b["loss"])
    assert len(evaluated) == len({r["version"] for r in h})  # one evaluation per version, reused after
    assert [e.version for e in srv.store.evaluations(s["run_id"])] == [r["version"] for r in h]


def _hist(accs: list[float | None], dt: float = 2.0) -> list[dict]:
    return [{"version": i, "virtual_time_s": i * dt, **({} if a is None else {"accuracy": a})}
            for i, a in enumerate(accs)]


def test_time_to_target_is_the_first_grid_time_the_target_holds_from():
    h = _hist([0.5, 0.91, 0.89, 0.92, 0.93, 0.95, 0.80, 0.97])
    goal = accuracy_goal(0.9)
    assert time_to_target(h, goal, 1) == 2.0
    assert time_to_target(h, goal, 2) == 6.0
    assert time_to_target(h, goal, 3) == 6.0
    assert time_to_target(h, goal, 4) is None
    assert time_to_target([], goal, 1) is None
    # a row without the metric or with a value that is not a number breaks the run
    assert time_to_target(_hist([0.95, None, 0.95, 0.95]), goal, 2) == 4.0
    assert time_to_target(_hist([0.95, math.nan, 0.95, 0.95]), goal, 2) == 4.0
    loss = [{"virtual_time_s": t, "loss": v} for t, v in [(0, 2.0), (1, 0.4), (2, 0.6), (3, 0.3), (4, 0.2)]]
    assert time_to_target(loss, Goal("loss", 0.5, "min"), 1) == 1
    assert time_to_target(loss, Goal("loss", 0.5, "min"), 2) == 3
    with pytest.raises(ValueError):
        time_to_target(h, goal, 0)


def test_the_step_function_and_the_grid_position():
    # the value at g is the last one recorded at a time <= g (Flower's rounds read on the grid)
    assert grid_value([1.5, 3.0, 3.1], ["a", "b", "c"], [0, 2, 3, 4]) == [None, "a", "b", "c"]
    assert next_grid_index([], 2.0) == 0
    assert next_grid_index([0.0, 2.0, 4.0, 5.3], 2.0) == 3  # 5.3: a final row, off the grid
    assert next_grid_index([0.0, 0.3, round(3 * 0.3, 6)], 0.3) == 4
    assert next_grid_index([0.0, 2.0, 4.0], 3.0) == 2  # a grid changed on resume: the first time after the rows


def test_stop_at_target_stops_once_it_has_held_target_hold_evaluations():
    held = run(quick("fedbuff", "server.target_accuracy=0.05", "server.stop_at_target=true"))[0]
    assert held["stop_reason"] == "target_accuracy" and held["time_to_target_s"] == 0.0
    assert [h["virtual_time_s"] for h in held["history"]] == [0.0, 2.0, 4.0]
    assert held["virtual_time_s"] == 4.0 and held["target_hold"] == 3
    once = run(quick("fedbuff", "server.target_accuracy=0.05", "server.stop_at_target=true",
                     "server.target_hold=1"))[0]
    assert (once["versions"], once["time_to_target_s"], len(once["history"])) == (0, 0.0, 1)


def test_a_held_target_is_the_first_time_of_the_run_in_the_history():
    s = run(quick("fedbuff", "server.max_virtual_time=16"))[0]
    accs = [h["accuracy"] for h in s["history"]]
    goal = sorted(accs)[len(accs) // 2]  # a level the run passes, not always keeps
    for hold in (1, 2, 3):
        r = run(quick("fedbuff", "server.max_virtual_time=16", f"server.target_accuracy={goal}",
                      f"server.target_hold={hold}"))[0]
        assert r["history"] == s["history"]
        assert r["time_to_target_s"] == time_to_target(s["history"], accuracy_goal(goal), hold)


def test_the_grid_never_changes_the_model():
    def sha(*extra):
        s = run(quick("fedbuff", "server.max_virtual_time=null", "server.max_versions=15", *extra))[0]
        return s["model_sha256"], s["versions"], len(s["history"])

    every_version, fine, coarse = sha("server.eval_every=1"), sha("server.eval_every_s=0.3"), sha("server.eval_every_s=5")
    assert every_version[:2] == fine[:2] == coarse[:2]
    assert fine[2] > coarse[2]


GRID = {"eval_every": 5, "eval_every_s": 0.25}
GRID_POINTS = [("record_eval", 4, True), ("record_eval", 6, False), ("record_reply", 7, False),
               ("record_dispatches", 3, False)]


@pytest.mark.parametrize("point", GRID_POINTS, ids=[f"{p[0]}{p[1]}{'b' if p[2] else 'a'}" for p in GRID_POINTS])
def test_a_crashed_run_resumed_on_the_grid_is_the_run_never_interrupted(tmp_path, point):
    cfg = make_cfg("fedbuff", server=dict(GRID))
    ref, ref_store = run(cfg, store_at(tmp_path / "ref.db"))
    assert len(ref["history"]) >= 5 and len({h["version"] for h in ref["history"]}) >= 3
    store = store_at(tmp_path / "s.db")
    crash_at(store, *point)
    srv = AsyncServer(cfg, LocalTransport(), store)
    with pytest.raises(Crash):
        srv.run()
    store2 = store_at(tmp_path / "s.db")
    out = AsyncServer(cfg, LocalTransport(), store2, resume_run_id=srv.run_id).run()
    check_invariants(store2, out)
    assert_same_run(out, ref)
    assert out["history"] == ref["history"]  # every row, its time and its metrics
    assert [(e.version, e.virtual_time) for e in store2.evaluations(out["run_id"])] == \
           [(e.version, e.virtual_time) for e in ref_store.evaluations(ref["run_id"])]


def test_a_run_resumed_after_the_target_was_held_keeps_its_time_to_target(tmp_path):
    cfg = make_cfg("fedbuff", server={**GRID, "max_versions": 30, "target_accuracy": 0.05, "stop_at_target": True})
    ref = run(cfg, store_at(tmp_path / "ref.db"))[0]
    assert ref["stop_reason"] == "target_accuracy" and ref["time_to_target_s"] == 0.0
    assert [h["virtual_time_s"] for h in ref["history"]] == [0.0, 0.25, 0.5]
    store = store_at(tmp_path / "c.db")
    crash_at(store, "mark_in_flight", 1, True)  # the target held, before _finish writes
    srv = AsyncServer(cfg, LocalTransport(), store)
    with pytest.raises(Crash):
        srv.run()
    out = AsyncServer(cfg, LocalTransport(), store_at(tmp_path / "c.db"), resume_run_id=srv.run_id).run()
    for k in ("stop_reason", "versions", "time_to_target_s", "model_sha256", "history"):
        assert out[k] == ref[k], k


def test_the_wall_clock_grid_is_in_seconds_since_the_start(tmp_path):
    cfg = make_cfg("fedbuff", server={"eval_every": 5, "eval_every_s": 0.05, "max_versions": 6})
    s = AsyncServer(cfg, LocalTransport(), store_at(tmp_path / "w.db"), clock="wall", mode="deployment").run()
    times = [h["virtual_time_s"] for h in s["history"]]
    # the rows: consecutive grid times from 0, then the final model at the end time if its version had no
    # row yet (that time is wherever the run ended: on the grid or not, depending on the machine's speed)
    grid = [round(k * 0.05, 6) for k in range(len(times))]
    assert times[:-1] == grid[:-1] and times[-1] >= grid[-1] - 0.05
    assert times[-1] == grid[-1] or s["history"][-1]["version"] != s["history"][-2]["version"]


@pytest.mark.parametrize("value,why", [(0, "greater than 0"), (-1, "greater than 0"), (math.inf, "finite"),
                                       (math.nan, "finite"), ("x", "number")])
def test_a_bad_eval_every_s_is_one_line_naming_the_key(value, why):
    with pytest.raises(ConfigError) as e:
        config_from_dict({"server": {"eval_every_s": value}})
    msg = str(e.value)
    assert msg.startswith("server.eval_every_s: ") and why in msg and "\n" not in msg


def test_eval_every_and_eval_every_s_both_given_is_one_error_and_eval_every_alone_counts_versions():
    with pytest.raises(ConfigError) as e:
        config_from_dict({"server": {"eval_every_s": 3, "eval_every": 2}})
    assert str(e.value).startswith("server.eval_every_s: ") and "eval_every" in str(e.value)
    with pytest.raises(ConfigError) as e:
        config_from_dict({"server": {"target_hold": 0}})
    assert str(e.value).startswith("server.target_hold: ")
    alone = config_from_dict({"server": {"eval_every": 2}}).server
    assert (alone.eval_every_s, alone.eval_every) == (None, 2)
    assert config_from_dict({}).server.eval_every_s == 2.0


def test_compare_on_versions_warns_that_the_times_are_not_comparable():
    import warnings

    from fedasync.api import compare_configs

    with pytest.warns(UserWarning, match=r"every 3 versions, not on a common grid.*server\.eval_every_s"):
        compare_configs("fedavg,fedbuff", config_from_dict({"server": {"eval_every": 3}}))
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # on the grid, or one strategy alone: nothing to warn about
        compare_configs("fedavg,fedbuff", config_from_dict({}))
        compare_configs("fedbuff", config_from_dict({"server": {"eval_every": 3}}))
