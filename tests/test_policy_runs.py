"""benchmarks/policy_runs.py's grid runner (scheduling.py, robustness.py): a results file skips the
(label, seed) runs it holds, and its medians always cover every run it holds, also when an
invocation ran nothing new (runs recorded by another invocation, e.g. of another part of the grid),
and so do its goals."""

from __future__ import annotations

import json
import sys
from pathlib import Path

BENCH = Path(__file__).resolve().parents[1] / "benchmarks"
sys.path.insert(0, str(BENCH))

import policy_runs  # noqa: E402


def _extract(s: dict) -> dict:
    return {"final_accuracy": s["acc"]}


def test_run_grid_skips_what_it_holds_and_takes_medians_over_every_run(tmp_path, monkeypatch):
    calls = []

    def fake(overrides, seed):
        calls.append((overrides[0], seed))
        return {"stop_reason": "max_virtual_time", "acc": 0.5 + seed / 100 + (0.1 if overrides[0] == "b" else 0.0)}

    monkeypatch.setattr(policy_runs, "run_one", fake)
    path = tmp_path / "r.json"
    grid = [("A", ["a"]), ("B", ["b"])]
    data = policy_runs.run_grid(grid[:1], [1, 2, 3], path, _extract, meta={})
    assert calls == [("a", 1), ("a", 2), ("a", 3)] and data["medians"]["A"]["final_accuracy"] == 0.52
    # another invocation's runs of B land in the file (as when two parts of a grid ran apart)
    held = json.loads(path.read_text())
    held["runs"] += [{"label": "B", "seed": s, "overrides": ["b"], "final_accuracy": 0.6 + s / 100, "wall_s": 1.0}
                     for s in (1, 2, 3)]
    path.write_text(json.dumps(held))
    calls.clear()
    goals = lambda med: {"B beats A": med["B"]["final_accuracy"] > med["A"]["final_accuracy"]}  # noqa: E731
    data = policy_runs.run_grid(grid, [1, 2, 3], path, _extract, meta={}, goals=goals)
    assert calls == []  # every (label, seed) is held: nothing runs
    assert data["goals"] == {"B beats A": True}  # judged on every run held, also when nothing ran
    assert list(data["medians"]) == ["A", "B"] and data["medians"]["B"]["final_accuracy"] == 0.62
    assert data["medians"]["B"]["seeds"] == [1, 2, 3]
