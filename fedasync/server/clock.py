"""Clocks and client speed profiles.

Simulation runs on a :class:`VirtualClock`: at dispatch the server draws the task's
duration from the client's :class:`ClientProfile` with :func:`task_duration` (a pure
function of its arguments), so every task has a virtual finish time and replies are
taken in that order, however fast the machine. Deployment uses a :class:`WallClock`.

Profiles (``clock`` in YAML), for client ``c`` with standard normals ``z``:

- ``speed = exp(sigma * z_speed)``  (log-normal, median 1)
- ``bandwidth_bps = bandwidth_mbps * 1e6 * exp(bandwidth_sigma * z_bw)``
- ``latency_s = latency_s``

and a task of ``steps`` local steps on a model of ``model_bytes`` bytes lasts

    2 * latency_s + 2 * model_bytes * 8 / bandwidth_bps + steps * step_time / speed * exp(jitter * z)

with ``z`` drawn from ``np.random.default_rng([seed, task_id, client_id])``.
With ``sigma = bandwidth_sigma = jitter = 0`` every client and task is the same.

Pure: imports neither Flower nor the database.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass
from typing import Any

import numpy as np

from fedasync.config import ClockConfig, profile_draws


@dataclass(frozen=True)
class ClientProfile:
    client_id: int
    speed: float  # relative compute speed, log-normal(0, sigma), median 1
    bandwidth_bps: float  # log-normal around bandwidth_mbps * 1e6 with bandwidth_sigma
    latency_s: float


def make_profiles(num_clients: int, cfg: ClockConfig, seed: int) -> list[ClientProfile]:
    """One profile per client id ``0..num_clients-1``; deterministic for ``seed``."""
    speed, bw = profile_draws(num_clients, cfg, seed)  # refused by the config when 0 or inf
    return [
        ClientProfile(client_id=c, speed=float(speed[c]), bandwidth_bps=float(bw[c]), latency_s=float(cfg.latency_s))
        for c in range(num_clients)
    ]


def task_duration(
    profile: ClientProfile, steps: int, model_bytes: int, cfg: ClockConfig, seed: int, task_id: int
) -> float:
    """Virtual seconds from dispatch to reply (download + compute + upload)."""
    if steps < 0 or model_bytes < 0:
        raise ValueError(f"steps and model_bytes must be >= 0 (got {steps}, {model_bytes})")
    z = np.random.default_rng([seed, task_id, profile.client_id]).standard_normal()
    with np.errstate(over="ignore", under="ignore"):
        jitter_factor = float(np.exp(cfg.jitter * z))
    transfer = 2.0 * model_bytes * 8.0 / profile.bandwidth_bps
    compute = steps * cfg.step_time / profile.speed * jitter_factor
    d = 2.0 * profile.latency_s + transfer + compute
    if not math.isfinite(d):
        raise ValueError(f"clock.jitter: task {task_id} of client {profile.client_id} would last {d} virtual "
                         f"seconds (transfer {transfer:g} s, compute {compute:g} s: jitter factor "
                         f"{jitter_factor:g}, speed {profile.speed:g}); use a smaller clock.jitter or clock.sigma, "
                         "or a larger clock.bandwidth_mbps")
    return d


class VirtualClock:
    """Simulated time in virtual seconds; starts at ``start`` (0.0), moves only forward."""

    virtual = True

    def __init__(self, start: float = 0.0) -> None:
        self._now = float(start)

    @property
    def now(self) -> float:
        return self._now

    def advance_to(self, t: float) -> None:
        if t != t:
            raise ValueError("the virtual clock cannot go to NaN")
        if t < self._now:
            raise ValueError(f"the virtual clock cannot go back (now {self._now}, asked {t})")
        self._now = float(t)

    def state_dict(self) -> dict[str, Any]:
        return {"now": self._now}

    def load_state_dict(self, d: dict[str, Any]) -> None:
        self._now = float(d["now"])


class WallClock:
    """Seconds of ``time.monotonic()`` since creation, plus ``offset`` (e.g. a resumed run's elapsed)."""

    virtual = False

    def __init__(self, offset: float = 0.0) -> None:
        self._t0 = time.monotonic()
        self._offset = float(offset)

    @property
    def now(self) -> float:
        return self._offset + (time.monotonic() - self._t0)
