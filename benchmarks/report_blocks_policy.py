"""The generated blocks of docs/benchmarks/scale.md and scheduling-robustness.md (see report.py)."""

from __future__ import annotations

from pathlib import Path
from typing import Callable

GENERATORS: dict[str, Callable[[Path], str]] = {}
