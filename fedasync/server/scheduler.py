"""Which idle client gets the next task.

A scheduler is chosen by name (``SCHEDULERS``). It sees only client ids: the caller
passes the idle ids sorted, so the choice is a pure function of the seed and the
sequence of calls. ``state_dict``/``load_state_dict`` save the random stream so a
resumed run continues the same sequence.

Pure: imports neither Flower nor the database.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Any, Sequence

import numpy as np


class Scheduler(ABC):
    name: str = ""

    @abstractmethod
    def choose(self, idle: Sequence[int]) -> int:
        """One client id from ``idle`` (non-empty, sorted by the caller)."""

    def state_dict(self) -> dict[str, Any]:
        return {"scheduler": self.name}

    def load_state_dict(self, d: dict[str, Any]) -> None:
        if d.get("scheduler") != self.name:
            raise ValueError(f"state is for scheduler {d.get('scheduler')!r}, not {self.name!r}")


class UniformScheduler(Scheduler):
    """Uniformly at random among the idle clients, from one Generator seeded once."""

    name = "uniform"

    def __init__(self, seed: int = 0) -> None:
        self.seed = seed
        self.rng = np.random.default_rng(seed)

    def choose(self, idle: Sequence[int]) -> int:
        if len(idle) == 0:
            raise ValueError("no idle client to choose from")
        return int(idle[int(self.rng.integers(len(idle)))])

    def state_dict(self) -> dict[str, Any]:
        d = super().state_dict()
        d["bit_generator"] = self.rng.bit_generator.state
        return d

    def load_state_dict(self, d: dict[str, Any]) -> None:
        super().load_state_dict(d)
        self.rng.bit_generator.state = d["bit_generator"]


#: name -> class taking ``seed``
SCHEDULERS: dict[str, type[Scheduler]] = {"uniform": UniformScheduler}


def make_scheduler(name: str = "uniform", seed: int = 0) -> Scheduler:
    if name not in SCHEDULERS:
        raise ValueError(f"unknown scheduler {name!r}; known: {', '.join(SCHEDULERS)}")
    return SCHEDULERS[name](seed)
