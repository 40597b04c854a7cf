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
    assert all("server.concurrency" in knobs[s] for s in knobs)  # FedAvg's cohort too: the same knobs
    assert "server.server_lr" not in knobs["fedasync"]
    for s, pts in points.items():
        assert pts[0] == {k: tune._get(bases[s], k) for k in knobs[s]}  # the defaults
        assert len({json.dumps(p, sort_keys=True) for p in pts}) == 4  # distinct
        assert all(sum(p[k] != pts[0][k] for k in p) == 1 for p in pts[1:])  # one knob at a time first
    assert tune.grids(bases, 4, 0)[0] == points  # seeded
    small, m, _ = tune.grids(bases, 10_000, 0, overrides={"train.lr": [0.2, 0.4]}, notes=(notes := []))
    assert m == min(len(tune.candidates(k, {x: tune._get(bases[s], x) for x in k}, 0))
                    for s, k in tune.grids(bases, 1, 0, overrides={"train.lr": [0.2, 0.4]})[2].items())
    assert all(len(p) == m for p in small.values()) and any("budget cut" in x for x in notes)


def test_fedavgs_cohort_is_its_own_key_where_the_config_sets_it(tmp_path):
    p = tmp_path / "m.yaml"
    p.write_text(YAML.replace("fedbuff, concurrency: 4, buffer_size: 2,", "fedavg, concurrency: 4, clients_per_round: 2,"))
    bases = tune.strategy_bases(p, ["fedavg", "fedbuff"])
    knobs = tune.knobs_for("fedavg", bases["fedavg"])
    assert knobs["server.clients_per_round"] == [1, 2, 4] and "server.concurrency" not in knobs
    fedbuff = tune.knobs_for("fedbuff", bases["fedbuff"])  # clients_per_round reset there
    assert fedbuff["server.concurrency"] == [2, 4, 8] and "server.clients_per_round" not in fedbuff


def test_a_run_config_tunes_on_validation_with_the_grid():
    raw = {"seed": 0, "data": {}, "train": {"lr": 0.1}, "server": {"eval_every": 1, "max_virtual_time": 5}}
    out = tune.run_config(raw, {"train.lr": 0.3}, seed=100, metric="val_accuracy", target=0.8, val_fraction=0.1,
                          eval_every_s=2.0, horizon=50)
    assert out["seed"] == 100 and out["train"]["lr"] == 0.3 and out["data"]["val_fraction"] == 0.1
    assert out["server"]["target"] == {"metric": "val_accuracy", "value": 0.8, "mode": "max"}
    assert out["server"]["eval_every_s"] == 2.0 and "eval_every" not in out["server"]
    assert out["server"]["max_virtual_time"] == 50 and out["server"]["stop_at_target"] is True
    assert raw["train"]["lr"] == 0.1  # not changed in place
    assert "test_samples" not in out["data"]
    sub = tune.run_config(raw, {}, seed=100, metric="val_accuracy", target=0.8, val_fraction=0.1, eval_every_s=2.0,
                          horizon=50, test_samples=100)
    assert sub["data"]["test_samples"] == 100


def test_bad_flags_are_one_line(capsys, config):
    assert tune.main(["--config", str(config), "--name", "x", "--tune-seeds", "1,2", "--report-seeds", "2,3"]) == 2
    err = capsys.readouterr().err.strip()
    assert err == "tune: --report-seeds: [2] are tuning seeds too (report on seeds never tuned on)"
    assert tune.main(["--config", str(config), "--name", "x", "--val-fraction", "0"]) == 2
    assert "--val-fraction" in capsys.readouterr().err
    assert tune.main(["--config", str(config), "--name", "x", "--tune-test-samples", "0"]) == 2
    assert "--tune-test-samples" in capsys.readouterr().err


def test_a_tiny_tuning_run_writes_one_result_file(config, tmp_path, capsys, monkeypatch):
    out = tmp_path / "r.json"
    written = []
    real = tune.write_result
    monkeypatch.setattr(tune, "write_result", lambda path, p: (  # the result file's writes (not the run cache's)
        Path(path) == out and written.append(json.loads(json.dumps(p))), real(path, p))[1])
    argv = ["--config", str(config), "--strategies", "fedavg,fedbuff", "--budget", "2", "--tune-seeds", "100",
            "--report-seeds", "1", "--target", "0.3", "--horizon", "6", "--name", "tiny", "--out", str(out),
            "--knob", "server.server_lr=1.0,1.5", "--knob", "server.server_momentum=0.0",
            "--knob", "server.concurrency=4", "--cache", str(tmp_path / "cache")]
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


def test_the_run_cache_reuses_finished_runs_and_budget_1_runs_no_tuning(config, tmp_path, monkeypatch):
    """A second invocation with the same configs takes every run from the cache (no simulation), with
    the same report; ``--budget 1`` runs only the defaults on the report seeds, and its runs are the
    same cache entries the full protocol's report uses."""
    cache = tmp_path / "cache"
    base = ["--config", str(config), "--strategies", "fedavg,fedbuff", "--tune-seeds", "100", "--report-seeds", "1",
            "--target", "0.3", "--horizon", "6", "--name", "tiny", "--cache", str(cache)]
    ran = []
    real = tune.run_one
    monkeypatch.setattr(tune, "run_one", lambda job: (ran.append(job["config"]["seed"]), real(job))[1])
    assert tune.main([*base, "--budget", "1", "--out", str(tmp_path / "a.json")]) == 0
    a = json.loads((tmp_path / "a.json").read_text())
    assert ran == [1, 1]  # no tuning seed ran: one report run per strategy
    assert {(r["comparison"], r["strategy"]) for r in a["report"]} == {("defaults", "fedavg"), ("defaults", "fedbuff")}
    assert all(v["runs"] == [] and v["score"] is None for vs in a["variants"].values() for v in vs)
    assert a["cache"]["commits"] == [a["provenance"]["commit"]] and len(list(cache.glob("*.json"))) == 2

    ran.clear()
    assert tune.main([*base, "--budget", "1", "--out", str(tmp_path / "b.json")]) == 0
    b = json.loads((tmp_path / "b.json").read_text())
    assert ran == [] and b["report"] == a["report"] and b["report_runs"] == a["report_runs"]

    ran.clear()  # the full protocol: its report runs of the defaults come from the cache
    assert tune.main([*base, "--budget", "2", "--knob", "server.server_momentum=0.0", "--knob", "server.concurrency=4",
                      "--knob", "server.server_lr=1.0,1.5", "--out", str(tmp_path / "c.json")]) == 0
    c = json.loads((tmp_path / "c.json").read_text())
    assert sorted(ran).count(100) == 4 and ran.count(1) == sum(c["chosen"][s]["index"] != 0 for s in ("fedavg", "fedbuff"))
    assert c["report_runs"]["fedavg/0"] == a["report_runs"]["fedavg/0"]

    ran.clear()  # --no-cache runs again; a changed config is another key
    assert tune.main([*base, "--budget", "1", "--no-cache", "--out", str(tmp_path / "d.json")]) == 0
    assert ran == [1, 1]
    assert tune.config_key({"a": 1, "b": 2}) == tune.config_key({"b": 2, "a": 1}) != tune.config_key({"a": 1})


def test_the_grid_is_the_yamls_own_unless_given(tmp_path):
    """Without ``--eval-every-s`` the runs keep the YAML's ``server.eval_every_s`` (examples/mnist.yaml
    evaluates every 10 s; it used to be replaced by the default 2)."""
    p = tmp_path / "grid.yaml"
    p.write_text(YAML.replace("max_virtual_time: 6}", "max_virtual_time: 6, eval_every_s: 3}"))
    base = ["--config", str(p), "--strategies", "fedbuff", "--budget", "1", "--report-seeds", "1", "--target", "0.99",
            "--horizon", "6", "--name", "g", "--no-cache"]
    assert tune.main([*base, "--out", str(tmp_path / "a.json")]) == 0
    a = json.loads((tmp_path / "a.json").read_text())
    assert a["protocol"]["eval_every_s"] == 3.0
    assert [h["virtual_time_s"] for h in a["report_runs"]["fedbuff/0"][0]["history"]] == [0.0, 3.0, 6.0]
    assert tune.main([*base, "--eval-every-s", "2", "--out", str(tmp_path / "b.json")]) == 0
    b = json.loads((tmp_path / "b.json").read_text())
    assert [h["virtual_time_s"] for h in b["report_runs"]["fedbuff/0"][0]["history"]] == [0.0, 2.0, 4.0, 6.0]
