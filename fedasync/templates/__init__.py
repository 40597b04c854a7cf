"""The project template of ``fedasync new NAME`` (files under ``project/``, ``{{name}}`` filled in).

``project/`` holds the files as ``*.tmpl`` (so that neither pytest nor the package's own checks take
them for modules of fedasync); ``package/`` becomes the ``NAME/`` package.  :func:`new_project`
checks its inputs before it writes anything; :class:`TemplateError` is one line naming the input.
"""

from __future__ import annotations

import keyword
from importlib import resources
from pathlib import Path

__all__ = ["TemplateError", "new_project", "template_files"]


class TemplateError(ValueError):
    """A name or directory ``fedasync new`` cannot use (one line naming it)."""


def template_files() -> dict[str, str]:
    """The template: relative path in the new project (``{{name}}`` unfilled) -> text."""
    root = resources.files(__name__) / "project"
    out: dict[str, str] = {}

    def walk(node, rel: str) -> None:
        for child in sorted(node.iterdir(), key=lambda c: c.name):
            path = f"{rel}{child.name}"
            if child.is_dir():
                if child.name != "__pycache__":
                    walk(child, path + "/")
            elif child.name.endswith(".tmpl"):
                out[path[: -len(".tmpl")].replace("package/", "{{name}}/", 1)] = child.read_text()

    walk(root, "")
    return out


def check_name(name: str) -> None:
    """A project name must be a Python identifier (it is the package's name) and not a keyword,
    nor the name of a module the project imports."""
    if not name.isidentifier() or keyword.iskeyword(name):
        raise TemplateError(f"NAME: {name!r} is not a Python identifier (letters, digits and _, not starting "
                            "with a digit; it becomes the package name)")
    if name in ("fedasync", "torch", "numpy", "sklearn", "flwr", "tests", "test"):
        raise TemplateError(f"NAME: {name!r} would shadow a module the project needs; choose another name")


def new_project(name: str, directory: str | Path | None = None) -> list[Path]:
    """Write the project ``name`` into ``directory`` (default ``./name``); returns the files written.
    Refuses a bad name or an existing non-empty directory before writing anything (the error names
    ``--dir`` when ``directory`` is given, else ``NAME``)."""
    check_name(name)
    dest = Path(directory) if directory is not None else Path(name)
    key = "--dir" if directory is not None else "NAME"
    if dest.exists() and not dest.is_dir():
        raise TemplateError(f"{key}: {dest} exists and is not a directory")
    if dest.is_dir() and any(dest.iterdir()):
        raise TemplateError(f"{key}: {dest} exists and is not empty; choose another NAME or --dir")
    files = {rel.replace("{{name}}", name): text.replace("{{name}}", name) for rel, text in template_files().items()}
    written: list[Path] = []
    made: list[Path] = []  # directories this call created, to take back on a failure
    try:
        for rel, text in files.items():
            path = dest / rel
            for parent in reversed([path.parent, *path.parent.parents]):
                if not parent.exists():
                    parent.mkdir()
                    made.append(parent)
            path.write_text(text)
            written.append(path)
    except OSError:  # no permission, disk full: leave nothing half-written behind
        for path in written:
            path.unlink(missing_ok=True)
        for d in reversed(made):
            try:
                d.rmdir()
            except OSError:
                pass
        raise
    return written
