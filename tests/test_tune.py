"""benchmarks/tune.py (issue 34): the same grid budget for every strategy, tuning on validation seeds,
reporting on test with other seeds, one result file with its provenance; a tiny 10-client run."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[1] / "benchmarks"
sys.path.insert(0, str(BENCH))

import tune  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_thread")

YAML = """
name: tiny
seed: 0
data: {dataset: digits, num_clients: 10, alpha: 0.5}
model: {name: mlp, hidden: 16}
train: {local_steps: 5, batch_size: 16, lr: 0.2}
server: {strategy: fedbuff, concurrency: 4, buffer_size: 2, max_virtual_time: 6}
"""


@pytest.fixture
def config(tmp_path):
    p = tmp_path / "tiny.yaml"
    p.write_text(YAML)
    return p


def test_every_strategy_gets_the_same_budget_defaults_first(config):
    bases = tune.strategy_bases(config, ["fedavg", "fedbuff", "fedasync"])
    points, n, knobs = tune.grids(bases, 4, 0)
    assert n == 4 and all(len(p) == 4 for p in points.values())
    assert "train.lr" in knobs["fedavg"] and "server.server_lr" in knobs["fedavg"]
    assert "server.concurrency" in knobs["fedasync"] and "server.concurrency" not in knobs["fedavg"]
    for s, pts in points.items():
        assert pts[0] == {k: tune._get(bases[s], k) for k in knobs[s]}  # the defaults
        assert len({json.dumps(p, sort_keys=True) for p in pts}) == 4  # distinct
        assert all(sum(p[k] != pts[0][k] for k in p) == 1 for p in pts[1:])  # one knob at a time first
    assert tune.grids(bases, 4, 0)[0] == points  # seeded
    small, m, _ = tune.grids(bases, 10_000, 0, overrides={"train.lr": [0.2, 0.4]}, notes=(notes := []))
    assert m == min(len(tune.candidates(k, {x: tune._get(bases[s], x) for x in k}, 0))
                    for s, k in tune.grids(bases, 1, 0, overrides={"train.lr": [0.2, 0.4]})[2].items())
    assert all(len(p) == m for p in small.values()) and any("budget cut" in x for x in notes)


def test_a_run_config_tunes_on_validation_with_the_grid():
    raw = {"seed": 0, "data": {}, "train": {"lr": 0.1}, "server": {"eval_every": 1, "max_virtual_time": 5}}
    out = tune.run_config(raw, {"train.lr": 0.3}, seed=100, metric="val_accuracy", target=0.8, val_fraction=0.1,
                          eval_every_s=2.0, horizon=50)
    assert out["seed"] == 100 and out["train"]["lr"] == 0.3 and out["data"]["val_fraction"] == 0.1
    assert out["server"]["target"] == {"metric": "val_accuracy", "value": 0.8, "mode": "max"}
    assert out["server"]["eval_every_s"] == 2.0 and "eval_every" not in out["server"]
    assert out["server"]["max_virtual_time"] == 50 and out["server"]["stop_at_target"] is True
    assert raw["train"]["lr"] == 0.1  # not changed in place


def test_bad_flags_are_one_line(capsys, config):
    assert tune.main(["--config", str(config), "--name", "x", "--tune-seeds", "1,2", "--report-seeds", "2,3"]) == 2
    err = capsys.readouterr().err.strip()
    assert err == "tune: --report-seeds: [2] are tuning seeds too (report on seeds never tuned on)"
    assert tune.main(["--config", str(config), "--name", "x", "--val-fraction", "0"]) == 2
    assert "--val-fraction" in capsys.readouterr().err


def test_a_tiny_tuning_run_writes_one_result_file(config, tmp_path, capsys, monkeypatch):
    out = tmp_path / "r.json"
    written = []
    real = tune.write_result
    monkeypatch.setattr(tune, "write_result", lambda path, p: (written.append(json.loads(json.dumps(p))),
                                                               real(path, p))[1])
    argv = ["--config", str(config), "--strategies", "fedavg,fedbuff", "--budget", "2", "--tune-seeds", "100",
            "--report-seeds", "1", "--target", "0.3", "--horizon", "6", "--name", "tiny", "--out", str(out),
            "--knob", "server.server_lr=1.0,1.5", "--knob", "server.server_momentum=0.0",
            "--knob", "server.concurrency=4"]
    assert tune.main(argv) == 0
    r = json.loads(out.read_text())
    # the tuning phase is saved before the report runs start; the file ends complete
    assert [w["complete"] for w in written] == [False, True] and r["complete"] is True
    assert written[0]["report"] == [] and written[0]["variants"] == r["variants"]
    prov = r["provenance"]
    assert prov["command"].startswith("python benchmarks/tune.py --config") and len(prov["commit"]) == 40
    assert {"nproc", "platform"} <= prov["machine"].keys() and prov["torch"] and prov["date"]
    assert r["protocol"]["budget"] == 2 and r["protocol"]["tune_metric"] == "val_accuracy"
    assert r["protocol"]["report_metric"] == "accuracy"
    for s in ("fedavg", "fedbuff"):
        vs = r["variants"][s]
        assert len(vs) == 2 and vs[0]["default"] and vs[0]["overrides"]["train.lr"] == 0.2  # the YAML's own
        for v in vs:
            assert [run["seed"] for run in v["runs"]] == [100]
            assert all("val_accuracy" in h and "accuracy" in h for h in v["runs"][0]["history"])
        best = min(vs, key=lambda v: (tune.score(v["runs"], "val_accuracy"), v["index"]))
        assert r["chosen"][s]["index"] == best["index"]
        for key, runs in r["report_runs"].items():
            assert [run["seed"] for run in runs] == [1]
    rows = {(row["comparison"], row["strategy"]): row for row in r["report"]}
    assert set(rows) == {(c, s) for c in ("defaults", "tuned") for s in ("fedavg", "fedbuff")}
    assert rows[("tuned", "fedbuff")]["point"] == r["chosen"]["fedbuff"]["index"]
    fedavg, fedbuff = rows[("defaults", "fedavg")], rows[("defaults", "fedbuff")]
    if fedavg["median_s"] and fedbuff["median_s"]:
        assert fedbuff["ratio_vs_fedavg"] == pytest.approx(fedavg["median_s"] / fedbuff["median_s"], rel=1e-3)
    report_run = r["report_runs"][f"fedbuff/{rows[('defaults', 'fedbuff')]['point']}"][0]
    at = [h["virtual_time_s"] for h in report_run["history"] if h["accuracy"] >= 0.3]
    assert report_run["time_to_target_s"] is None or report_run["time_to_target_s"] in at  # on TEST accuracy
    assert "| defaults | fedavg |" in capsys.readouterr().out
