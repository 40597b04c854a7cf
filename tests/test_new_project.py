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
