"""The generated blocks of docs/benchmarks/mnist.md and deployment.md, benchmarks/README.md (see report.py)."""

from __future__ import annotations

from pathlib import Path
from typing import Callable

GENERATORS: dict[str, Callable[[Path], str]] = {}
