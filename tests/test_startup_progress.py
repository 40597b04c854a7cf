"""Start-up progress (issue 35): DP noise calibration reports progress on every path that calibrates
before a run: the Python API (lines on stderr every few seconds by default), a user task's assembly,
`fedasync privacy plan`, and `fedasync server` (the ServerApp's status file, shown as a bar)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from typer.testing import CliRunner

from conftest import SMALL

pytestmark = pytest.mark.usefixtures("one_thread")

# 4 clients, noise calibrated from epsilon: one calibration per distinct sample rate
DP = ["data.num_clients=4", "server.concurrency=4", "server.max_versions=2", "train.batch_size=8",
      "privacy.local_dp.enabled=true", "privacy.local_dp.epsilon=4.0", "privacy.local_dp.noise_multiplier=\"auto\""]


@pytest.fixture
def recorded():
    """Every progress(done, total) check_runnable reports when its caller gives none."""
    from fedasync.privacy import budgets
    from fedasync.privacy.tracker import set_calibration_progress

    calls: list[tuple[int, int]] = []
    budgets.calibrate.cache_clear()  # a calibration found in the cache reports nothing to wait for
    prev = set_calibration_progress(lambda: lambda d, t: calls.append((d, t)))
    yield calls
    set_calibration_progress(prev)
    budgets.calibrate.cache_clear()


def _counts_up(calls: list[tuple[int, int]]) -> int:
    total = calls[0][1]
    assert total >= 1 and calls == [(i, total) for i in range(total + 1)]
    return total


def test_the_python_api_reports_the_calibration(tmp_path, recorded):
    import fedasync

    r = fedasync.simulate(None, set=[*SMALL, *DP], backend="local", out=tmp_path / "run")
    assert r.summary["privacy"]["epsilon_max"] is not None
    _counts_up(recorded[: recorded[0][1] + 1])  # the calibration (the run's own check finds it cached)


def test_a_user_task_reports_the_calibration(tmp_path, recorded):
    import fedasync
    from test_task_privacy import _project

    fedasync.simulate(_project(tmp_path), set={"server.max_versions": 1}, out=tmp_path / "run")
    # 4 clients, 4 sample rates (12, 20, 28, 36 records, batch 8); the run's own check finds them cached
    assert _counts_up(recorded[:5]) == 4


def test_privacy_plan_shows_the_calibration(tmp_path, monkeypatch):
    from fedasync.cli import app
    from fedasync.privacy import budgets, tracker

    calls: list[tuple[int, int]] = []

    class Bar:
        def __init__(self, bars):
            pass

        def __call__(self, done: int, total: int) -> None:
            calls.append((done, total))

    monkeypatch.setattr(tracker, "CalibrationBar", Bar)
    budgets.calibrate.cache_clear()
    sets = [a for s in [*SMALL, *DP] for a in ("--set", s)]
    res = CliRunner().invoke(app, ["privacy", "plan", *sets])
    assert res.exit_code == 0, res.output
    _counts_up(calls)


def test_progress_lines_every_few_seconds_on_a_fake_clock():
    from fedasync.privacy.tracker import ProgressLines

    now = [0.0]
    lines: list[str] = []
    p = ProgressLines(every_s=3.0, first_s=2.0, write=lines.append, clock=lambda: now[0])
    for done, t in [(0, 0.0), (1, 1.0), (2, 2.5), (3, 4.0), (4, 5.6), (5, 6.0)]:
        now[0] = t
        p(done, 5)
    assert [ln.split(":")[1].split()[0] for ln in lines] == ["2/5", "4/5", "5/5"]
    quiet: list[str] = []  # a calibration found in the cache: done at once, nothing written
    q = ProgressLines(write=quiet.append, clock=lambda: 0.0)
    q(0, 3), q(3, 3)
    assert quiet == []


def test_fedasync_server_shows_the_serverapps_calibration(tmp_path):
    from fedasync.deploy.run import ServerRun
    from fedasync.privacy.tracker import check_runnable, set_calibration_progress
    from fedasync.server.app import _write_status
    from fedasync.privacy import budgets
    from conftest import small_config

    out = tmp_path / "run"
    out.mkdir()
    # the ServerApp side: its calibration written to server-status.json as it goes
    budgets.calibrate.cache_clear()
    written: list[list[int]] = []

    def status(d: int, t: int) -> None:
        _write_status(out, state="starting", calibration=[d, t])
        written.append(json.loads((out / "server-status.json").read_text())["calibration"])

    prev = set_calibration_progress(lambda: status)
    try:
        check_runnable(small_config(*DP))
    finally:
        set_calibration_progress(prev)
    total = _counts_up([tuple(w) for w in written])
    # the command's side: follow() shows what the status file says while the ServerApp starts
    run = object.__new__(ServerRun)
    run.fed = type("Fed", (), {"proc": None, "run_status": lambda self, r: None})()
    run.out, run.flower_run, run.warn = out, 1, lambda m: None
    shown: list[tuple[int, int]] = []
    steps = iter(range(total + 1))

    def bar(done: int, total_: int) -> None:
        shown.append((done, total_))
        nxt = next(steps, None)
        if nxt is None or nxt == total:  # then the ServerApp is done
            (out / "summary.json").write_text("{}")
            _write_status(out, state="done")
        else:
            _write_status(out, state="starting", calibration=[nxt + 1, total])

    _write_status(out, state="starting", calibration=[0, total])
    next(steps)
    assert run.follow(lambda ev: None, lambda: 0, calibration=bar) == {}
    assert [d for d, _ in shown] == sorted(d for d, _ in shown) and shown[0] == (0, total)
