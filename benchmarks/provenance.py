"""Where a benchmark result came from: the shared header every ``benchmarks/results/*.json`` carries.

``provenance(argv)`` returns the command line, the git commit (and whether the working tree had
uncommitted changes), the machine (CPU count, platform, processor), the Python and torch versions
and the UTC date. ``write_result(path, payload)`` writes ``payload`` as indented JSON, creating
the folder, through a temporary file renamed into place (a run killed mid-write leaves the old file).

Scripts in ``benchmarks/`` are run as ``python benchmarks/<name>.py``, so this folder is on
``sys.path`` and ``from provenance import provenance, write_result`` works; tests add the folder.
"""

from __future__ import annotations

import datetime as _dt
import json
import os
import platform
import shlex
import subprocess
import sys
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent


def _git(*args: str) -> str | None:
    """Output of ``git <args>`` in the repository, or None where git or the repository is missing."""
    try:
        out = subprocess.run(["git", *args], cwd=REPO, capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.SubprocessError):
        return None
    return out.stdout.strip() if out.returncode == 0 else None


def _torch_version() -> str | None:
    try:
        import torch
    except ImportError:
        return None
    return str(torch.__version__)


def provenance(argv: list[str] | None = None) -> dict[str, Any]:
    """The header of a result file: how it was made, on which code, on which machine, when.

    ``argv`` is the script's ``sys.argv`` (the default); ``command`` is it joined as a shell line
    with the interpreter in front. ``dirty`` is True when tracked files differ from the commit
    (untracked files do not count), None when git cannot tell.
    """
    argv = list(sys.argv if argv is None else argv)
    status = _git("status", "--porcelain", "--untracked-files=no")
    return {
        "command": shlex.join(["python", *argv]),
        "argv": argv,
        "commit": _git("rev-parse", "HEAD"),
        "dirty": None if status is None else bool(status),
        "machine": {
            "nproc": os.cpu_count(),
            "platform": platform.platform(),
            "processor": platform.processor() or platform.machine(),
        },
        "python": platform.python_version(),
        "torch": _torch_version(),
        "date": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
    }


def write_result(path: str | os.PathLike[str], payload: dict[str, Any]) -> Path:
    """Write ``payload`` as JSON to ``path`` (folders made; atomic rename) and return the path."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(payload, indent=2, sort_keys=False, default=str) + "\n")
    os.replace(tmp, path)
    return path
