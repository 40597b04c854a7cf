"""``fedasync new NAME``: write a project from the template (:mod:`fedasync.templates`), like
Flower's ``flwr new``: ``pyproject.toml``, ``NAME/task.py``, ``config.yaml``, ``tests/test_task.py``
and a ``README.md``."""

from __future__ import annotations

from pathlib import Path
from typing import Optional

import typer

from fedasync.cli.common import console, fail


def new(
    name: str = typer.Argument(..., help="The project's name: a Python identifier (it names the package)."),
    directory: Optional[Path] = typer.Option(None, "--dir", help="Where to write it (default ./NAME); must be "
                                             "new or empty."),
) -> None:
    """Write a new fedasync project: a task (model, data, evaluation), a config (FedBuff, local DP) and tests."""
    from fedasync.templates import TemplateError, new_project

    dest = directory if directory is not None else Path(name)
    try:
        written = new_project(name, directory)
    except TemplateError as e:
        fail(str(e))
    except OSError as e:
        fail(f"--dir: {dest}: {e.strerror or e}")
    console.print(f"wrote {len(written)} files to {dest}/:", markup=False)
    for p in written:
        console.print(f"  {p.relative_to(dest)}", markup=False)
    console.print(f"next: cd {dest} && pip install -e . && fedasync task check config.yaml && "
                  "fedasync simulate config.yaml", markup=False, soft_wrap=True)


def register(app: typer.Typer) -> None:
    app.command("new")(new)
