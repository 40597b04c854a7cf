"""The blocks of issue 34's protocol (benchmarks/report_blocks*.py): MNIST on the evaluation grid
(defaults vs defaults, or tuned vs tuned once the full protocol's file is complete), the wall clock
on the grid against Flower's FedAvg and FedAvgM, and the tuning cost; every figure they print comes
from the file."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[1] / "benchmarks"
sys.path.insert(0, str(BENCH))

import report_blocks as rb  # noqa: E402
import report_blocks_wall as rw  # noqa: E402

PROV = {"command": "python benchmarks/tune.py --name x", "commit": "a" * 40, "dirty": False,
        "machine": {"nproc": 2}, "date": "2026-12-06T23:00:00Z"}


def _row(kind, strategy, median, lo, hi, ratio, reached="3/3"):
    return {"comparison": kind, "strategy": strategy, "point": 0, "overrides": {"train.lr": 0.1},
            "median_s": median, "min_s": lo, "max_s": hi, "reached": reached, "ratio_vs_fedavg": ratio}


def _runs(times):
    return [{"seed": seed, "time_to_target_s": t} for seed, t in zip((1, 2, 3), times)]


#: per seed: fedavg 1400, 1230, 1100 against fedbuff 330, 310, 290 (ratios 4.24, 3.97, 3.79)
RUNS = {"fedavg/0": _runs([1400.0, 1230.0, 1100.0]), "fedbuff/0": _runs([330.0, 310.0, 290.0])}


def _tuning(budget, rows, complete=True, runs=None):
    return {"provenance": PROV, "complete": complete, "report": rows, "report_runs": runs or RUNS,
            "protocol": {"budget": budget, "strategies": ["fedavg", "fedbuff"], "knobs": {"fedavg": {}, "fedbuff": {}},
                         "target": 0.97, "tune_metric": "val_accuracy", "report_metric": "accuracy",
                         "val_fraction": 0.05, "tune_seeds": [100, 101], "report_seeds": [1, 2, 3],
                         "horizon": 1800.0, "eval_every_s": 10.0}}


@pytest.fixture
def results(tmp_path):
    return tmp_path


def _write(results: Path, name: str, payload: dict) -> None:
    (results / name).write_text(json.dumps(payload))


def test_mnist_defaults_are_published_and_tuned_is_said_missing(results):
    assert "not been run" in rb.mnist_grid(results)
    _write(results, "mnist_defaults.json", _tuning(1, [_row("defaults", "fedavg", 1230.0, 1100.0, 1400.0, 1.0),
                                                        _row("defaults", "fedbuff", 310.0, 290.0, 330.0, 3.968)]))
    block = rb.mnist_grid(results)
    assert "Defaults vs defaults" in block and "| defaults | fedbuff |" in block and "| tuned |" not in block
    assert "310.0 (290.0–330.0)" in block and "3.97" in block and "**not measured yet**" in block
    assert "| 3/3 | 3.97 | 3.79–4.24 |" in block  # FedAvg's time over FedBuff's, seed by seed
    readme = rb._readme_mnist(results)
    assert "**3.97×**" in readme and "1,230.0 (1,100.0–1,400.0)" in readme and "not measured yet" in readme
    assert "3.79–4.24× seed by seed" in readme and "97 % test accuracy" in readme
    assert "`mnist_defaults.json`" in readme and "commit aaaaaaa" in readme


def test_a_complete_tuning_file_replaces_the_defaults_and_an_incomplete_one_does_not(results):
    _write(results, "mnist_defaults.json", _tuning(1, [_row("defaults", "fedavg", 1230.0, 1100.0, 1400.0, 1.0),
                                                        _row("defaults", "fedbuff", 310.0, 290.0, 330.0, 3.968)]))
    tuned = [_row("defaults", "fedavg", 1230.0, 1100.0, 1400.0, 1.0), _row("defaults", "fedbuff", 310.0, 290.0, 330.0, 3.968),
             _row("tuned", "fedavg", 600.0, 560.0, 650.0, 1.0), _row("tuned", "fedbuff", 200.0, 190.0, 220.0, 3.0)]
    tuned[2]["point"], tuned[3]["point"] = 2, 3
    runs = {**RUNS, "fedavg/2": _runs([600.0, 650.0, None]), "fedbuff/3": _runs([200.0, 190.0, 220.0])}
    _write(results, "mnist_tuning.json", _tuning(6, tuned, complete=False, runs=runs))
    assert rb.mnist_grid_file(results) == "mnist_defaults.json"  # a stopped protocol is not published
    _write(results, "mnist_tuning.json", _tuning(6, tuned, runs=runs))
    assert rb.mnist_grid_file(results) == "mnist_tuning.json"
    block = rb.mnist_grid(results)
    assert "Tuned on validation" in block and "| tuned | fedbuff |" in block and "not measured" not in block
    readme = rb._readme_mnist(results)
    assert "tuned vs tuned (each over 6 points" in readme and "**3.00×**" in readme and "FedAvgM in 600.0" in readme
    assert "3.00–3.42× seed by seed" in readme  # seed 3: FedAvgM did not reach the target, left out


def test_the_wall_clock_grid_names_each_flower_baseline(results):
    assert "Not run yet" in rw.wall_clock_grid(results)
    fedbuff = {"time_to_target_s": 250.0, "wall_s": 260.0, "best_accuracy": 0.91, "versions": 100, "updates": 1000}
    avg = {"time_to_target_s": 1200.0, "wall_s": 1200.0, "best_accuracy": 0.9, "rounds": 80, "updates": 1600}
    avgm = {"time_to_target_s": 500.0, "wall_s": 500.0, "best_accuracy": 0.9, "rounds": 30, "updates": 600}
    m = "flower-fedavg:server_lr=1.0:server_momentum=0.9"
    head = {"provenance": PROV, "time_scale": 4.0, "eval_every_wall_s": 8.0, "target_hold": 3, "target_accuracy": 0.9,
            "actors": 20, "engine_start_s": 10.0, "warmup_s": 90.0}
    _write(results, "wall_clock_grid.json", {
        **head, "runs": {"fedbuff": fedbuff, m: avgm, "flower-fedavg": avg},
        "speedup_vs": {m: {"fedbuff": 2.0, m: 1.0, "flower-fedavg": 0.417},
                       "flower-fedavg": {"fedbuff": 4.8, m: 2.4, "flower-fedavg": 1.0}}})
    table = rw.wall_clock_grid(results)
    assert "| vs Flower FedAvgM, `server_lr` 1.0, `server_momentum` 0.9 | vs Flower FedAvg |" in table
    assert "| 250.0 | 0.9100 | 2.00× | 4.80× |" in table and "100 s, not counted" in table and "20 actors" in table
    readme = rw._readme_wallclock(results)
    assert "4.80× sooner than Flower's own FedAvg (1,200.0 s)" in readme
    assert "2.00× sooner than Flower's own FedAvgM, `server_lr` 1.0, `server_momentum` 0.9 (500.0 s)" in readme
    assert "grid of 8 wall s" in readme and "tuned against tuned" not in readme

    tuned = {"time_to_target_s": 150.0, "wall_s": 160.0, "best_accuracy": 0.92, "versions": 90, "updates": 900}
    _write(results, "wall_clock_grid_tuned.json", {
        **head, "actors": 40, "runs": {"fedbuff:concurrency=40": tuned, m: {**avgm, "time_to_target_s": 450.0}},
        "speedup_vs": {m: {"fedbuff:concurrency=40": 3.0, m: 1.0}}})
    both = rw.wall_clock_grid(results)
    assert both.startswith(table) and "40 actors" in both
    assert "| fedasync FedBuff, `concurrency` 40 | 150.0 | 0.9200 | 3.00× |" in both
    readme = rw._readme_wallclock(results)
    assert ("tuned against tuned (fedasync FedBuff, `concurrency` 40, the quickstart's tuned point): 3.00× sooner than "
            "Flower's own FedAvgM, `server_lr` 1.0, `server_momentum` 0.9 (450.0 s)") in readme


def test_the_goals_block_judges_each_goal_by_its_file(results):
    import report_blocks_goals as goals

    block = goals.readme_goals(results)  # nothing measured: every goal said missed, none met
    assert block.count("**missed**") == 3 and "**met**" not in block and block.count("not measured") == 3
    _write(results, "quickstart_tuning.json", _tuning(4, [_row("defaults", "fedavg", 280.0, 240.0, 360.0, 1.0),
                                                          _row("defaults", "fedbuff", 62.0, 52.0, 72.0, 4.516)]))
    rows = [_row("defaults", "fedavg", 1230.0, 1100.0, 1400.0, 1.0), _row("defaults", "fedbuff", 310.0, 290.0, 330.0, 3.968),
            _row("tuned", "fedavg", 600.0, 560.0, 650.0, 1.0), _row("tuned", "fedbuff", 210.0, 190.0, 220.0, 2.857)]
    _write(results, "mnist_tuning.json", _tuning(6, rows))
    m = "flower-fedavg:server_lr=1.0:server_momentum=0.9"
    _write(results, "wall_clock_grid.json", {
        "provenance": PROV, "runs": {"fedbuff": {}, m: {}, "flower-fedavg": {}},
        "speedup_vs": {m: {"fedbuff": 4.1}, "flower-fedavg": {"fedbuff": 6.2}}})
    block = goals.readme_goals(results)
    assert "4.52× (goal ≥ 4.5×: **met**; `quickstart_tuning.json`)" in block
    assert "tuned FedAvgM to 97 %: 2.86× (goal ≥ 3×: **missed**; `mnist_tuning.json`)" in block
    # judged against Flower given the tuned momentum, not against its plain FedAvg
    assert "`server_momentum` 0.9 (Flower given a tuned server learning rate and momentum): 4.10× (goal ≥ 4×: **met**" in block
    assert "against Flower's plain FedAvg 6.20×" in block
    rows[3]["ratio_vs_fedavg"] = 3.0
    _write(results, "mnist_tuning.json", _tuning(6, rows))
    assert "3.00× (goal ≥ 3×: **met**" in goals.readme_goals(results)


def test_the_tuning_cost_block_sums_each_phases_runs_and_counts_the_cached_ones(results, tmp_path):
    import report
    import report_blocks_tuning as rt

    mine, old = "a" * 40, "b" * 40
    run = lambda wall, commit: {"wall_s": wall, "commit": commit}  # noqa: E731
    d = _tuning(2, [], runs={"fedavg/0": [run(60.0, old), run(120.0, mine)], "fedbuff/1": [run(600.0, mine)]})
    d["variants"] = {"fedavg": [{"runs": [run(300.0, mine), run(900.0, old)]}], "fedbuff": [{"runs": [run(1800.0, mine)]}]}
    _write(results, "mnist_tuning.json", d)
    block = rt.tuning_cost(results)
    # tuning 300 + 900 + 1800 s = 50 min, report 60 + 120 + 600 s = 13 min; longest 30 min; 4 of 6 at the commit
    assert "| `mnist_tuning.json` | fedavg, fedbuff | 2 | 3 + 3 | 50 + 13 | 30 | 4 of 6 |" in block
    assert "quickstart_tuning.json" not in block  # a file not there has no row
    # a page outside docs/benchmarks with a block is one of report's pages; one without is not
    (tmp_path / "docs" / "howto").mkdir(parents=True)
    (tmp_path / "docs" / "howto" / "t.md").write_text("x\n<!-- report:tuning-cost -->\n<!-- /report -->\n")
    (tmp_path / "docs" / "howto" / "u.md").write_text("no block\n")
    assert tmp_path / "docs" / "howto" / "t.md" in report.pages(tmp_path)
    assert tmp_path / "docs" / "howto" / "u.md" not in report.pages(tmp_path)


def test_the_wall_clock_on_more_seeds_is_a_median_table_and_the_goal_is_judged_on_the_median(results):
    import report_blocks_goals as goals

    m = "flower-fedavg:server_lr=1.0:server_momentum=0.9"

    def wall(seed, mine, flower, plain=None):
        runs = {"fedbuff": {"time_to_target_s": mine, "wall_s": 300.0, "best_accuracy": 0.91, "versions": 100,
                            "updates": 1000},
                m: {"time_to_target_s": flower, "wall_s": 400.0, "best_accuracy": 0.9, "rounds": 20, "updates": 400}}
        speed = {m: {"fedbuff": None if mine is None else round(flower / mine, 3), m: 1.0}}
        if plain:
            runs["flower-fedavg"] = {"time_to_target_s": plain, "wall_s": plain, "best_accuracy": 0.9, "rounds": 60,
                                     "updates": 1200}
            speed["flower-fedavg"] = {"fedbuff": round(plain / mine, 3)}
        prov = {**PROV, "argv": ["benchmarks/wall_clock_vs_flower.py"] + (["--set", f"seed={seed}"] if seed else [])}
        return {"provenance": prov, "time_scale": 4.0, "eval_every_wall_s": 8.0, "target_hold": 3,
                "target_accuracy": 0.9, "actors": 20, "runs": runs, "speedup_vs": speed}

    _write(results, "wall_clock_grid.json", wall(0, 200.0, 300.0, plain=800.0))  # no seed key: the quickstart's, 0
    one = rw.wall_clock_grid(results)
    assert "| seed |" not in one and "1.50× (goal ≥ 4×: **missed**" in goals.readme_goals(results)
    _write(results, "wall_clock_grid_seed1.json", {**wall(1, 100.0, 400.0), "seed": 1})
    _write(results, "wall_clock_grid_seed2.json", wall(2, None, 350.0))  # FedBuff missed on seed 2: infinite
    block = rw.wall_clock_grid(results)
    assert block.startswith(one.rstrip("\n"))
    assert "| 0 | `wall_clock_grid.json` | 200.0 | 300.0 | 1.50× |" in block
    assert "| 1 | `wall_clock_grid_seed1.json` | 100.0 | 400.0 | 4.00× |" in block
    assert "| 2 | `wall_clock_grid_seed2.json` | not reached | 350.0 | - |" in block
    # medians: FedBuff {100, 200, inf} -> 200, FedAvgM {300, 350, 400} -> 350: 1.75x, seeds 1.50-4.00
    assert "| median | | 200.0 | 350.0 | 1.75× (1.50–4.00) |" in block and "At defaults on 3 seeds" in block
    g = goals.readme_goals(results)
    assert "1.75× (goal ≥ 4×: **missed**; median of 3 seeds, 1.50–4.00× seed by seed" in g
    assert "against Flower's plain FedAvg 4.00× on seed 0" in g and "`wall_clock_grid_seed2.json`, one run each" in g
    readme = rw._readme_wallclock(results)
    assert ("over 3 seeds (seeds 0, 1, 2, one engine start each), 1.75× sooner than Flower's own FedAvgM, "
            "`server_lr` 1.0, `server_momentum` 0.9 (median times' ratio, 1.50–4.00× seed by seed)") in readme
