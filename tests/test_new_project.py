"""``fedasync new NAME`` and ``fedasync task check`` (issue 33): the project template is a working
project: written, installed with pip (editable, into this environment), checked, simulated, and
its own tests pass; bad names and occupied directories are refused before anything is written."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from typer.testing import CliRunner

from fedasync.cli import app

pytestmark = pytest.mark.usefixtures("one_thread")

EXPECTED = {"pyproject.toml", "README.md", "config.yaml", "{n}/__init__.py", "{n}/task.py", "tests/test_task.py"}


def _files(root: Path) -> set[str]:
    return {p.relative_to(root).as_posix() for p in root.rglob("*") if p.is_file()}


def test_new_writes_the_project_with_the_name_filled_in(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    r = CliRunner().invoke(app, ["new", "weather"])
    assert r.exit_code == 0, r.output
    root = tmp_path / "weather"
    assert _files(root) == {f.format(n="weather") for f in EXPECTED}
    for p in root.rglob("*"):
        if p.is_file():
            assert "{{name}}" not in p.read_text(), p
    assert 'name = "weather"' in (root / "pyproject.toml").read_text()
    assert '"fedasync"' in (root / "pyproject.toml").read_text()
    from fedasync.config import load_config

    cfg = load_config(str(root / "config.yaml"))  # a valid config: FedBuff, local DP with a budget, the task
    assert cfg.task == "weather.task"
    assert cfg.server.strategy == "fedbuff"
    assert cfg.privacy.local_dp.enabled and cfg.privacy.local_dp.epsilon is not None
    compile((root / "weather" / "task.py").read_text(), "task.py", "exec")
    compile((root / "tests" / "test_task.py").read_text(), "test_task.py", "exec")


def test_new_into_an_empty_directory_with_dir(tmp_path):
    dest = tmp_path / "here"
    dest.mkdir()
    r = CliRunner().invoke(app, ["new", "proj", "--dir", str(dest)])
    assert r.exit_code == 0, r.output
    assert _files(dest) == {f.format(n="proj") for f in EXPECTED}


@pytest.mark.parametrize("name", ["my-project", "1st", "class", "", "a b", "fedasync"])
def test_new_refuses_a_name_that_is_not_a_python_identifier(tmp_path, monkeypatch, name):
    monkeypatch.chdir(tmp_path)
    r = CliRunner().invoke(app, ["new", name])
    assert r.exit_code == 2
    lines = [ln for ln in r.output.strip().splitlines() if ln]
    assert len(lines) == 1 and "NAME" in lines[0], r.output
    assert list(tmp_path.iterdir()) == []  # nothing written


def test_new_refuses_an_existing_non_empty_directory(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "proj").mkdir()
    (tmp_path / "proj" / "mine.txt").write_text("keep me")
    r = CliRunner().invoke(app, ["new", "proj"])
    assert r.exit_code == 2 and "NAME: proj exists and is not empty" in r.output
    assert _files(tmp_path / "proj") == {"mine.txt"}
    (tmp_path / "other").mkdir()
    (tmp_path / "other" / "x").write_text("")
    r = CliRunner().invoke(app, ["new", "fine", "--dir", "other"])
    assert r.exit_code == 2 and "--dir: other exists and is not empty" in r.output
    assert _files(tmp_path / "other") == {"x"}
    (tmp_path / "afile").write_text("")
    r = CliRunner().invoke(app, ["new", "fine", "--dir", "afile"])
    assert r.exit_code == 2 and "not a directory" in r.output


def _run(cmd: list[str], cwd: Path, timeout: int = 300) -> subprocess.CompletedProcess:
    env = dict(os.environ, OMP_NUM_THREADS="1", COLUMNS="300")
    return subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)


def test_new_project_installs_checks_simulates_and_its_tests_pass(tmp_path):
    """The README's five minutes: fedasync new, pip install -e (into this environment, no deps, no
    build isolation: nothing downloaded), fedasync task check, fedasync simulate, the project's own
    tests; then the project is uninstalled again."""
    name = "fedasync_t3_newproj"
    root = tmp_path / "project"  # not the package's name: from tmp_path, only the installed package imports
    r = CliRunner().invoke(app, ["new", name, "--dir", str(root)])
    assert r.exit_code == 0, r.output
    bin_dir = Path(sys.executable).parent
    pip = _run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--no-build-isolation", "-e", "."], root)
    assert pip.returncode == 0, pip.stderr
    try:
        elsewhere = _run([sys.executable, "-c", f"import {name}.task as t; print(t.__file__)"], tmp_path)
        assert elsewhere.returncode == 0 and str(root) in elsewhere.stdout, elsewhere.stderr  # installed
        check = _run([str(bin_dir / "fedasync"), "task", "check", "config.yaml"], root)
        assert check.returncode == 0, check.stderr
        out = check.stdout
        assert f"task {name}.task" in out and "4,810 parameters" in out  # 64*64+64 + 64*10+10
        assert "first batch ([32, 64] float32, [32] int64)" in out
        assert "one DP-SGD (noise multiplier" in out and "evaluate on load_centralized() (359 samples)" in out
        sim = _run([str(bin_dir / "fedasync"), "simulate", "config.yaml", "--out", "run",
                    "--set", "server.max_versions=6", "--set", "server.eval_every=3"], root)
        assert sim.returncode == 0, sim.stderr
        summary = json.loads((root / "run" / "summary.json").read_text())
        assert summary["versions"] == 6 and summary["strategy"] == "fedbuff"
        assert summary["privacy"]["epsilon_max"] > 0  # local DP on, as the template configures it
        tests = _run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "tests"], root)
        assert tests.returncode == 0, tests.stdout[-3000:]
        assert "3 passed" in tests.stdout
    finally:
        gone = _run([sys.executable, "-m", "pip", "uninstall", "-y", "-q", name], tmp_path)
        assert gone.returncode == 0, gone.stderr
    gone = _run([sys.executable, "-c", f"import {name}"], tmp_path)
    assert gone.returncode != 0


def test_task_check_refuses_a_broken_task_with_one_line(tmp_path):
    """Each bad task is the TaskError's one line, exit 2: no model, a wrong signature, a Dataset that
    yields nothing, a module that does not import, a layer Opacus cannot train under DP, a target
    metric evaluate does not return."""
    from fedasync.templates import new_project

    new_project("proj", tmp_path)
    task_py = tmp_path / "proj" / "task.py"
    good = task_py.read_text()
    cases = [
        (good.replace("def model(", "def not_model("), [], "task proj.task: no model function"),
        (good.replace("def load_data(partition_id: int, num_partitions: int,", "def load_data(partition_id: int,"),
         [], "task proj.task: load_data"),
        (good.replace("    (x, y), _ = _digits()\n", "    (x, y), _ = _digits()\n    x, y = x[:0], y[:0]\n"),
         [], "yields nothing"),
        ("import not_a_module_anywhere\n" + good, [], "the module does not import"),
        (good.replace("nn.Linear(64, hidden), nn.ReLU()", "nn.Linear(64, hidden), nn.BatchNorm1d(hidden), nn.ReLU()"),
         [], "BatchNorm"),
        (good, ["--set", "server.target.metric=f1"], "server.target.metric: 'f1' is not a metric"),
        (good, ["--client", "10"], "--client: 10 is not in 0-9 (data.num_clients)"),
    ]
    for source, extra, said in cases:
        for mod in [m for m in sys.modules if m == "proj" or m.startswith("proj.")]:
            del sys.modules[mod]
        task_py.write_text(source)
        r = CliRunner().invoke(app, ["task", "check", str(tmp_path / "config.yaml"), *extra], env={"COLUMNS": "300"})
        lines = [ln for ln in r.output.strip().splitlines() if ln]
        assert r.exit_code == 2 and said in r.output, (said, r.output)
        assert len(lines) == 1, r.output
    for mod in [m for m in sys.modules if m == "proj" or m.startswith("proj.")]:
        del sys.modules[mod]
