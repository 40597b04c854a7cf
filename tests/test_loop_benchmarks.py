"""The measuring helpers of benchmarks/loop_overhead.py and benchmarks/loop_cost.py (no engine started)."""

import importlib.util
from pathlib import Path

import numpy as np
import pytest

from fedasync.config import load_config
from fedasync.wire import record_to_params

ROOT = Path(__file__).parents[1] / "benchmarks"


def _load(name):
    spec = importlib.util.spec_from_file_location(f"bench_{name}", ROOT / f"{name}.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


@pytest.fixture(scope="module")
def overhead():
    return _load("loop_overhead")


def test_bare_loops_send_one_record_or_a_new_changed_model_every_n_replies(overhead):
    params = {"w": np.arange(6, dtype=np.float32).reshape(2, 3), "b": np.zeros(3, np.float32)}
    once = overhead.model_records(params, 0)
    assert once(0) is once(7) is once(10_000)  # the baseline: one record throughout
    every = overhead.model_records(params, 10)
    first = every(0)
    assert every(9) is first
    second = every(10)
    assert second is not first and every(19) is second and every(20) is not second
    a, b = record_to_params(first), record_to_params(second)
    assert a["w"].dtype == b["w"].dtype == np.float32 and a["w"].shape == (2, 3)
    np.testing.assert_array_equal(a["w"], params["w"])  # the first is the model itself
    assert not np.array_equal(a["w"], b["w"])  # a new model, not a copy of the same bytes


def test_machine_cpu_per_update_is_busy_time_over_updates(overhead):
    use = overhead.cpu_use((10.0, 40.0), (12.0, 44.0), 100)  # 2 s busy of 4 s, 100 updates
    assert use == {"cpu_ms_per_update": 20.0, "busy": 0.5}
    assert overhead.cpu_use(None, (1.0, 2.0), 10) is None and overhead.cpu_use((0, 0), (1, 2), 0) is None
    now = overhead.machine_cpu()
    if now is not None:  # Linux
        busy, total = now
        assert 0 < busy <= total


def test_loop_cost_floor_times_each_piece_of_unavoidable_array_work():
    cost = _load("loop_cost")
    cfg = load_config(None, ["data.num_clients=20"])  # the quickstart's MLP on digits
    fl = cost.floor(cfg, k=4, reps=3)
    pieces = ["reply_sha256", "finite_check", "buffered_update_write", "aggregation_share",
              "version_sha256_share", "task_record_share"]
    assert set(fl) == set(pieces) | {"total_ms", "buffer_size"} and fl["buffer_size"] == 4
    assert all(fl[p] >= 0 for p in pieces)
    assert fl["total_ms"] == pytest.approx(sum(fl[p] for p in pieces), abs=1e-2)
    assert fl["reply_sha256"] > 0  # hashing 9k parameters takes measurable time


def test_kardam_cost_benchmark_times_checks_in_a_steady_state():
    """benchmarks/kardam_cost.py: every client has a previous update before timing starts, and
    the filter keeps only the base versions those updates refer to (a few, not one per update)."""
    r = _load("kardam_cost").measure("mlp", clients=6, updates=30, buffer=3)
    assert r["updates_timed"] == 30 and r["parameters"] > 0
    assert r["check_ms_median"] > 0 and 1 <= r["base_versions_kept"] <= 4  # the last 6 updates span <= 4 bases
