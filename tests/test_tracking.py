"""Experiment tracking (issue 35): metrics.jsonl beside history.csv, TensorBoard event files read back
with TensorBoard's own event reader, MLflow's store queried through its client, a tracker that is not
installed refused in one line before anything runs, the determinism of a run kept, and the progress of
DP noise calibration."""

from __future__ import annotations

import csv
import json
import sys
from pathlib import Path

import numpy as np
import pytest
from typer.testing import CliRunner

from conftest import SMALL
from fedasync.cli import app

pytestmark = pytest.mark.usefixtures("one_thread")

DP = ["privacy.local_dp.enabled=true", "privacy.local_dp.noise_multiplier=1.0", "privacy.local_dp.epsilon=50",
      "train.batch_size=8"]


def _run(tmp_path: Path, *extra: str, name: str = "run"):
    import fedasync

    return fedasync.simulate(None, set=[*SMALL, *extra], backend="local", out=tmp_path / name)  # --set strings


def _history(run_dir: Path) -> list[dict]:
    with open(run_dir / "history.csv", newline="") as f:
        return [{k: float(v) for k, v in row.items() if v != ""} for row in csv.DictReader(f)]


def _jsonl(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def _events(logdir: Path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(logdir), size_guidance={"scalars": 0, "histograms": 0, "tensors": 0})
    acc.Reload()
    return acc


def test_metrics_jsonl_is_written_beside_history_and_equals_it(tmp_path):
    r = _run(tmp_path)
    hist, lines = _history(r.run_dir), _jsonl(r.run_dir)
    assert len(lines) == len(hist) > 2
    for i, (row, line) in enumerate(zip(hist, lines)):  # step: the evaluation's index; the version its own key
        assert line["step"] == i and line["async/version"] == row["version"]
        assert line["virtual_time_s"] == pytest.approx(row["virtual_time_s"])
        for k, v in row.items():
            if k not in ("version", "virtual_time_s"):
                assert line[f"eval/{k}"] == pytest.approx(v, rel=1e-12)
    # the async figures: cumulative and consistent with the summary at the end
    last, s = lines[-1], r.summary
    assert last["async/updates_accepted"] == s["updates_accepted"]
    assert last["async/updates_received"] == s["updates_received"]
    assert last["async/staleness_max"] == s["staleness"]["max"]
    assert last["async/staleness_mean"] == pytest.approx(s["staleness"]["mean"])
    assert last["participation/jain"] == pytest.approx(s["participation"]["jain"])
    assert all("train/loss" in line for line in lines[1:])  # the clients' reported loss (no DP here)
    accepted = [line["async/updates_accepted"] for line in lines]
    assert accepted == sorted(accepted) and accepted[0] == 0


def test_tensorboard_events_read_back_match_history(tmp_path):
    r = _run(tmp_path, *DP, "tracking.backends=[\"tensorboard\"]")
    hist, lines = _history(r.run_dir), _jsonl(r.run_dir)
    acc = _events(r.run_dir / "tensorboard")
    tags = acc.Tags()
    for tag in ("eval/accuracy", "eval/loss", "async/staleness_mean", "async/staleness_max",
                "async/updates_accepted", "privacy/epsilon_max", "participation/jain"):
        assert tag in tags["scalars"], tag
    assert "privacy/epsilon_clients" in tags["histograms"]
    ev = acc.Scalars("eval/accuracy")
    assert [e.step for e in ev] == list(range(len(hist)))
    assert [e.value for e in acc.Scalars("async/version")] == [h["version"] for h in hist]
    assert [e.value for e in ev] == pytest.approx([h["accuracy"] for h in hist], rel=1e-6)
    assert [e.wall_time for e in ev] == pytest.approx([h["virtual_time_s"] for h in hist])  # the virtual time
    eps = acc.Scalars("privacy/epsilon_max")
    assert [e.value for e in eps] == pytest.approx([line["privacy/epsilon_max"] for line in lines], rel=1e-6)
    assert eps[-1].value == pytest.approx(r.summary["privacy"]["epsilon_max"], rel=1e-6)
    h = acc.Histograms("privacy/epsilon_clients")
    assert [x.step for x in h] == list(range(len(hist)))
    assert h[-1].histogram_value.num == r.summary["num_clients"]  # one value per client
    assert h[-1].histogram_value.max == pytest.approx(r.summary["privacy"]["epsilon_max"], rel=1e-6)
    # the resolved config as hparams
    from tensorboard.plugins.hparams import plugin_data_pb2

    content = acc.PluginTagToContent("hparams")
    info = plugin_data_pb2.HParamsPluginData.FromString(content["_hparams_/session_start_info"])
    hp = info.session_start_info.hparams
    assert hp["server.strategy"].string_value == "fedbuff"
    assert hp["data.num_clients"].number_value == 20


def test_mlflow_store_holds_params_metrics_and_the_model(tmp_path):
    from mlflow.tracking import MlflowClient

    from fedasync.server.strategies import params_sha256

    r = _run(tmp_path, "tracking.backends=[\"mlflow\"]", "tracking.experiment=\"exp-a\"")
    hist = _history(r.run_dir)
    client = MlflowClient(f"sqlite:///{r.run_dir / 'mlflow.db'}")
    exp = client.get_experiment_by_name("exp-a")
    runs = client.search_runs([exp.experiment_id])
    assert len(runs) == 1
    run = runs[0]
    assert run.data.params["server.strategy"] == "fedbuff"
    assert run.data.params["data.num_clients"] == "20"
    assert run.data.params["server.max_versions"] == "12"
    m = client.get_metric_history(run.info.run_id, "eval/accuracy")
    assert [x.step for x in m] == list(range(len(hist)))
    assert [x.value for x in m] == pytest.approx([h["accuracy"] for h in hist], rel=1e-12)
    assert [x.timestamp for x in m] == [round(h["virtual_time_s"] * 1000) for h in hist]
    acc = client.get_metric_history(run.info.run_id, "async/updates_accepted")
    assert acc[-1].value == r.summary["updates_accepted"]
    assert [a.path for a in client.list_artifacts(run.info.run_id)] == ["model.npz"]
    local = client.download_artifacts(run.info.run_id, "model.npz", str(tmp_path))
    with np.load(local) as z:
        params = {k: z[k] for k in z.files}
    assert params_sha256(params) == r.summary["model_sha256"]
    assert run.info.status == "FINISHED"


def test_mlflow_uri_of_a_sqlite_file_keeps_the_artifacts_beside_it(tmp_path, monkeypatch):
    from mlflow.tracking import MlflowClient

    monkeypatch.chdir(tmp_path)
    r = _run(tmp_path, "tracking.backends=[\"mlflow\"]", f"tracking.mlflow_uri=\"sqlite:///{tmp_path}/t/m.db\"")
    client = MlflowClient(f"sqlite:///{tmp_path}/t/m.db")
    run = client.search_runs([client.get_experiment_by_name("small").experiment_id])[0]
    assert [a.path for a in client.list_artifacts(run.info.run_id)] == ["model.npz"]
    assert list((tmp_path / "t" / "mlartifacts").rglob("model.npz")) and not (tmp_path / "mlruns").exists()
    assert not (r.run_dir / "mlflow.db").exists()


def test_compare_logs_each_strategy_as_a_run_of_one_experiment(tmp_path):
    from mlflow.tracking import MlflowClient

    out = tmp_path / "cmp"
    sets = [x for s in SMALL for x in ("--set", s)]
    r = CliRunner().invoke(app, ["simulate", "--backend", "local", "--out", str(out), *sets,
                                 "--compare", "fedasync,fedbuff", "--track", "mlflow,tensorboard"])
    assert r.exit_code == 0, r.output
    client = MlflowClient(f"sqlite:///{out / 'mlflow.db'}")
    exp = client.get_experiment_by_name("small")
    runs = {x.info.run_name: x for x in client.search_runs([exp.experiment_id])}
    assert set(runs) == {"fedasync", "fedbuff"}
    for label, run in runs.items():
        hist = _history(out / label)
        m = client.get_metric_history(run.info.run_id, "eval/accuracy")
        assert [x.value for x in m] == pytest.approx([h["accuracy"] for h in hist], rel=1e-12)
        assert run.data.params["server.strategy"] == label
        assert (out / label / "tensorboard").is_dir()


def test_tracking_does_not_change_the_run(tmp_path):
    plain = _run(tmp_path, name="plain")
    tracked = _run(tmp_path, "tracking.backends=[\"tensorboard\", \"mlflow\"]", "tracking.per_client=true",
                   name="tracked")
    assert tracked.summary["model_sha256"] == plain.summary["model_sha256"]
    assert tracked.history == plain.history
    assert _jsonl(tracked.run_dir) == _jsonl(plain.run_dir)
    acc = _events(tracked.run_dir / "tensorboard")  # per_client: histograms, not a series per client
    assert {"participation/dispatches_clients", "async/staleness_clients"} <= set(acc.Tags()["histograms"])
    assert not [t for t in acc.Tags()["scalars"] if "client_" in t or t.split("/")[-1].isdigit()]


@pytest.mark.parametrize("backend,module,extra", [("tensorboard", "tensorboardX", "tensorboard"),
                                                  ("mlflow", "mlflow", "mlflow")])
def test_a_tracker_not_installed_is_one_line_exit_2_and_nothing_written(tmp_path, monkeypatch, backend, module, extra):
    monkeypatch.setitem(sys.modules, module, None)  # import fails as if it were not installed
    out = tmp_path / "run"
    r = CliRunner().invoke(app, ["simulate", "--backend", "local", "--out", str(out), "--track", backend,
                                 *sum([["--set", s] for s in SMALL], [])])
    assert r.exit_code == 2, r.output
    lines = [ln for ln in r.output.splitlines() if ln.strip()]
    assert len(lines) == 1 and f"pip install 'fedasync[{extra}]'" in lines[0] and "tracking.backends" in lines[0]
    assert not out.exists()
    out2 = tmp_path / "ledger"  # the same line from ledger run (and the YAML key instead of --track)
    r = CliRunner().invoke(app, ["ledger", "run", "--virtual", "--peers", "4", "--out", str(out2),
                                 "--set", f"tracking.backends=[{backend}]"])
    assert r.exit_code == 2 and f"pip install 'fedasync[{extra}]'" in r.output, r.output
    assert not out2.exists()


def test_unknown_track_name_is_one_line_exit_2(tmp_path):
    r = CliRunner().invoke(app, ["simulate", "--out", str(tmp_path / "x"), "--track", "tensorboard,wandb"])
    assert r.exit_code == 2 and "--track: wandb is not one of tensorboard, mlflow" in r.output
    r = CliRunner().invoke(app, ["simulate", "--out", str(tmp_path / "x"), "--set", "tracking.backends=[wandb]"])
    assert r.exit_code == 2 and "tracking.backends" in r.output
    assert not (tmp_path / "x").exists()


def test_gossip_virtual_run_writes_metrics_and_tensorboard(tmp_path):
    out = tmp_path / "g"
    r = CliRunner().invoke(app, ["gossip", "run", "--virtual", "--peers", "4", "--max-steps", "4", "--out", str(out),
                                 "--track", "tensorboard", "--set", "train.local_steps=2"])
    assert r.exit_code == 0, r.output
    hist = list(csv.DictReader(open(out / "history.csv")))
    lines = _jsonl(out)
    assert len(lines) == len(hist) > 0
    assert [ln["eval/accuracy"] for ln in lines] == pytest.approx([float(h["accuracy"]) for h in hist])
    # as a server run's: step = the evaluation's index, the model index its own scalar (the grid repeats it)
    assert [ln["step"] for ln in lines] == list(range(len(hist)))
    assert [ln["async/version"] for ln in lines] == [int(h["events"]) for h in hist]  # gossip: events
    acc = _events(out / "tensorboard")
    ev = acc.Scalars("gossip/consensus_distance")
    assert [e.value for e in ev] == pytest.approx([float(h["consensus_distance"]) for h in hist], rel=1e-6)
    assert [e.wall_time for e in ev] == pytest.approx([float(h["time_s"]) for h in hist])


def test_noise_calibration_reports_progress_and_plans_the_same():
    from conftest import small_config
    from fedasync.privacy import budgets

    cfg = small_config("privacy.local_dp.enabled=true", "privacy.local_dp.epsilon=3.0")
    sizes = [40 + 3 * i for i in range(cfg.data.num_clients)]  # 20 distinct sample rates
    budgets.calibrate.cache_clear()
    calls: list[tuple[int, int]] = []
    with_progress = budgets.plan_clients(cfg, sizes, progress=lambda d, t: calls.append((d, t)))
    total = calls[0][1]
    assert calls == [(i, total) for i in range(total + 1)] and total == len({p.sample_rate for p in with_progress})
    budgets.calibrate.cache_clear()
    assert [p.noise_multiplier for p in budgets.plan_clients(cfg, sizes)] == [p.noise_multiplier for p in with_progress]


def test_a_tracker_that_fails_at_the_end_loses_nothing_of_the_run(tmp_path, caplog):
    import logging

    caplog.set_level(logging.WARNING, logger="fedasync")
    (tmp_path / "a-file").write_text("")  # MLflow cannot make its store below a file
    r = _run(tmp_path, "tracking.backends=[\"mlflow\", \"tensorboard\"]",
             f"tracking.mlflow_uri=\"sqlite:///{tmp_path}/a-file/m.db\"")
    assert (r.run_dir / "summary.json").is_file() and len(_jsonl(r.run_dir)) == len(r.history)
    assert "eval/accuracy" in _events(r.run_dir / "tensorboard").Tags()["scalars"]  # the other tracker went on
    warnings = [rec.getMessage() for rec in caplog.records if rec.getMessage().startswith("tracking:")]
    assert len(warnings) == 1 and len(warnings[0].splitlines()) == 1
