"""server.target (issue 33): any metric, max or min; target_accuracy as its alias; every metric of
the task's evaluation in history.csv, summary.json and the store; a part swapped through the
assembly."""

import csv
import json

import pytest

from fedasync import api
from fedasync.assembly import Evaluator, TargetError, assemble
from fedasync.config import ConfigError, config_from_dict, load_config
from fedasync.server.loop import AsyncServer
from fedasync.server.transport import LocalTransport
from fedasync.store import Store

from conftest import SMALL, small_config

pytestmark = pytest.mark.usefixtures("one_thread")


def _dict(*extra: str) -> dict:
    """The small scenario without the quickstart's target_accuracy (a test sets its own target),
    reached at the first evaluation at the target (target_hold 1: tests/test_eval_grid.py holds it longer)."""
    return small_config("server.target_accuracy=null", "server.target_hold=1", *extra).model_dump(mode="json")


def test_target_mode_min_on_a_loss_stops_there(tmp_path):
    """A loss-like metric (lower is better) with mode min: the run stops at the first evaluation at
    or below the value, and time-to-target is that evaluation's time."""
    base = api.simulate(_dict(), out=tmp_path / "base")
    losses = [h["loss"] for h in base.history]
    assert losses[-1] < losses[0]
    goal = (losses[0] + min(losses)) / 2  # reached somewhere after v0, before the end
    first = next(h for h in base.history if h["loss"] <= goal)
    assert first["version"] < base.summary["versions"]
    r = api.simulate(_dict(), set={"server.target": {"metric": "loss", "value": goal, "mode": "min"},
                                   "server.stop_at_target": True}, out=tmp_path / "min")
    s = r.summary
    assert s["stop_reason"] == "target"
    assert s["target"] == {"metric": "loss", "value": goal, "mode": "min"}
    assert s["time_to_target_s"] == pytest.approx(first["virtual_time_s"])
    assert s["versions"] == first["version"]
    assert r.history[-1]["loss"] <= goal < r.history[-2]["loss"]
    # mode max on the same metric is reached at once (v0's loss is above the value)
    r2 = api.simulate(_dict(), set={"server.target": {"metric": "loss", "value": goal, "mode": "max"},
                                    "server.stop_at_target": True}, out=tmp_path / "max")
    assert r2.summary["versions"] == 0 and r2.summary["time_to_target_s"] == 0.0


def test_target_accuracy_is_an_alias(tmp_path):
    r = api.simulate(_dict(), set={"server.target_accuracy": 0.05, "server.stop_at_target": True}, out=tmp_path)
    s = r.summary
    assert s["target"] == {"metric": "accuracy", "value": 0.05, "mode": "max"}
    assert s["target_accuracy"] == 0.05 and s["stop_reason"] == "target_accuracy"
    assert s["time_to_target_s"] == 0.0 and s["final_accuracy"] == s["final_metrics"]["accuracy"]


def test_both_targets_and_bad_targets_are_one_line_errors():
    with pytest.raises(ConfigError) as e:
        config_from_dict({"server": {"target_accuracy": 0.5, "target": {"metric": "accuracy", "value": 0.5}}})
    msg = str(e.value)
    assert "target and target_accuracy" in msg and "\n" not in msg
    for bad, key in [({"metric": "loss", "value": 1, "mode": "lower"}, "server.target.mode"),
                     ({"value": 1}, "server.target.metric"),
                     ({"metric": "loss", "value": "inf"}, "server.target.value")]:
        with pytest.raises(ConfigError) as e:
            config_from_dict({"server": {"target": bad}})
        assert key in str(e.value)


def test_a_metric_the_task_does_not_report_fails_before_anything_is_written(tmp_path):
    out = tmp_path / "run"
    with pytest.raises(TargetError) as e:
        api.simulate(_dict(), set={"server.target": {"metric": "rmse", "value": 1.0, "mode": "min"}}, out=out)
    assert str(e.value) == ("server.target: metric 'rmse' is not one the task reports (its metrics: "
                            "accuracy, loss)")
    assert not out.exists()


def test_the_cli_names_the_missing_metric_and_writes_nothing(tmp_path):
    from typer.testing import CliRunner

    from fedasync.cli import app

    out = tmp_path / "run"
    res = CliRunner().invoke(app, ["simulate", "--backend", "local", "--out", str(out),
                                   *[a for s in SMALL for a in ("--set", s)],
                                   "--set", "server.target_accuracy=null", "--set", "server.target={metric: rmse, value: 1}"])
    assert res.exit_code == 2, res.output
    assert "metric 'rmse' is not one the task reports" in res.output
    assert not out.exists()


def _swapped(cfg, metrics_fn):
    """The run's parts, their evaluator one (given to the assembly) reporting ``metrics_fn(model)``."""
    from fedasync.task.interface import builtin_task

    model = builtin_task(cfg.data, cfg.model, cfg.seed).model()
    return assemble(cfg, evaluator=Evaluator(model, metrics_fn, cfg.server.goal()))


def _rmse_like(model):
    """A made-up regression metric set: rmse falls as the model trains (from the real loss)."""
    from fedasync.task.data import load_test
    from fedasync.task.train import evaluate

    x, y = load_test(small_config().data, 0)
    loss, acc = evaluate(model, x, y)
    return {"rmse": loss ** 0.5, "mae": loss / 2, "r2": acc}


def test_any_metric_flows_into_history_summary_store_and_plots(tmp_path):
    """An evaluator (swapped through the assembly) reports rmse/mae/r2: each is a history.csv
    column, a key of every history row and of final_metrics, and stored with its version; the
    target on rmse (mode min) is reached and stops the run; the plot is rmse.png."""
    from fedasync.outputs import write_run_outputs

    cfg = small_config("server.target_accuracy=null", "server.target={metric: rmse, value: 1.512, mode: min}",
                       "server.stop_at_target=true")
    parts = _swapped(cfg, _rmse_like)
    st = Store(f"sqlite:///{tmp_path / 'a.db'}")
    srv = AsyncServer(cfg, LocalTransport(), st, parts=parts)
    s = srv.run()
    assert srv.policy is parts.policy and srv.evaluator is parts.evaluator
    assert s["stop_reason"] == "target" and s["history"][-1]["rmse"] <= 1.512 < s["history"][0]["rmse"]
    assert all(set(h) == {"version", "virtual_time_s", "rmse", "mae", "r2"} for h in s["history"])
    assert s["final_accuracy"] is None and s["final_metrics"] == {k: s["history"][-1][k] for k in ("rmse", "mae", "r2")}
    stored = {v.version: json.loads(v.metrics) for v in st.versions(s["run_id"]) if v.metrics}
    assert stored == {h["version"]: {k: h[k] for k in ("rmse", "mae", "r2")} for h in s["history"]}
    paths = write_run_outputs(tmp_path / "out", cfg, s)
    with open(paths["history"]) as f:
        rows = list(csv.DictReader(f))
    assert list(rows[0]) == ["version", "virtual_time_s", "rmse", "mae", "r2"]
    assert [float(r["rmse"]) for r in rows] == [h["rmse"] for h in s["history"]]
    assert paths["plot"].name == "rmse.png" and paths["plot"].stat().st_size > 0
    st.close()


def test_a_resumed_run_keeps_every_metric_and_its_target(tmp_path):
    """Resume rebuilds the history of any metric from the store (model_versions.metrics)."""
    cfg = small_config("server.max_versions=6", "server.target_accuracy=null")
    url = f"sqlite:///{tmp_path / 'r.db'}"
    st = Store(url)
    s1 = AsyncServer(cfg, LocalTransport(), st, parts=_swapped(cfg, _rmse_like)).run()
    st.close()
    cfg2 = load_config(None, SMALL + ["server.max_versions=10", "server.target_accuracy=null",
                                      "server.target={metric: rmse, value: 100, mode: min}"])
    st = Store(url)
    srv = AsyncServer(cfg2, LocalTransport(), st, resume_run_id=s1["run_id"],
                      parts=_swapped(cfg2, _rmse_like))
    assert srv.history == s1["history"]
    assert srv.time_to_target == 0.0  # v0's rmse is below 100: found in the stored history
    s2 = srv.run()
    assert s2["history"][: len(s1["history"])] == s1["history"] and s2["versions"] == 10
    st.close()


def test_compare_ratios_on_a_min_target(tmp_path):
    """--compare's time-to-target ratio works on a loss target (mode min)."""
    cfg = _dict("server.max_versions=10")
    first = api.compare(cfg, "fedbuff,fedasync", out=tmp_path / "first")["results"]
    out_dir = tmp_path / "second"
    goal = max(min(h["loss"] for h in r.history) for r in first.values())  # both runs reach it
    out = api.compare(cfg, "fedbuff,fedasync", set={"server.target": {"metric": "loss", "value": goal,
                                                                        "mode": "min"}}, out=out_dir)
    res, comp = out["results"], out["comparison"]
    assert set(res) == {"fedbuff", "fedasync"}
    t = {k: r.summary["time_to_target_s"] for k, r in res.items()}
    assert all(v is not None for v in t.values())
    assert comp["time_to_target_ratio"]["fedasync"] == pytest.approx(t["fedbuff"] / t["fedasync"])
    assert t["fedbuff"] != t["fedasync"] or t["fedbuff"] > 0
    saved = json.loads((out_dir / "comparison.json").read_text())
    assert saved["time_to_target_ratio"] == pytest.approx(comp["time_to_target_ratio"])
    assert (out_dir / "comparison.png").stat().st_size > 0
