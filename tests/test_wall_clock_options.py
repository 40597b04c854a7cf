"""benchmarks/wall_clock_vs_flower.py's Flower runs (issue 34): ``flower-fedavg:server_lr=X:server_momentum=Y``
gives Flower's own FedAvgM that server learning rate and momentum; anything else is refused."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))

import wall_clock_vs_flower as wc  # noqa: E402


def test_flower_fedavgm_options():
    assert wc.flower_options([]) == {}
    assert wc.flower_options(["server_lr=1.5", "server_momentum=0.9"]) == {"server_learning_rate": 1.5,
                                                                         "server_momentum": 0.9}
    from flwr.serverapp.strategy import FedAvgM

    s = FedAvgM(**wc.flower_options(["server_momentum=0.9"]))
    assert s.server_momentum == 0.9 and s.server_learning_rate == 1.0
    for bad in (["lr=1.5"], ["server_lr="], ["server_lr=x"]):
        with pytest.raises((SystemExit, ValueError)):
            wc.flower_options(bad)
