"""A sequence task for fedasync: tell noisy sine, square and sawtooth waves apart with a small 1-D CNN.

Written as a user writes a task: plain torch and numpy, nothing from fedasync.
``examples/sequence.yaml`` names it (``task: sequence_task``).  The data are generated, seeded, so
every process (a simulated client, a device, the server) makes the same samples offline.

Its Dataset yields a dict, ``{"signal": (1, length) float tensor, "label": int}``, so it brings its
own ``loss`` and ``evaluate`` (fedasync's defaults expect ``(x, y)`` batches).  Each client's waves
have frequencies from its own band (client 0 the slowest): the clients' data differ, as devices'
do.  ``model``, ``load_data`` and ``load_centralized`` receive the YAML's ``task_args``
(``length``, ``samples``, ``seed``) as keyword arguments.
"""

from __future__ import annotations

import numpy as np
import torch
from torch import nn
from torch.utils.data import Dataset

CLASSES = ("sine", "square", "sawtooth")


def waves(n: int, length: int, rng: np.random.Generator, band: tuple[float, float]) -> tuple[np.ndarray, np.ndarray]:
    """``n`` waves of ``length`` points, a random class each, frequency (cycles per sequence) drawn from
    ``band``, random phase and amplitude, plus Gaussian noise."""
    y = rng.integers(0, len(CLASSES), size=n)
    freq = rng.uniform(*band, size=(n, 1))
    phase = rng.uniform(0, 1, size=(n, 1))
    amp = rng.uniform(0.5, 1.5, size=(n, 1))
    t = np.arange(length)[None, :] / length
    cycle = (freq * t + phase) % 1.0  # position within the current cycle, 0..1
    sine = np.sin(2 * np.pi * cycle)
    square = np.where(cycle < 0.5, 1.0, -1.0)
    saw = 2 * cycle - 1
    x = np.choose(y[:, None], [sine, square, saw]) * amp + rng.normal(0, 0.3, size=(n, length))
    return x.astype(np.float32), y.astype(np.int64)


class Waves(Dataset):
    """Samples as dicts: ``{"signal": tensor (1, length), "label": tensor ()}``."""

    def __init__(self, x: np.ndarray, y: np.ndarray) -> None:
        self.x = torch.from_numpy(x).unsqueeze(1)  # one channel
        self.y = torch.from_numpy(y)

    def __len__(self) -> int:
        return len(self.y)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"signal": self.x[i], "label": self.y[i]}


def model(length: int = 64, samples: int = 120, seed: int = 0) -> nn.Module:
    """Two 1-D convolutions, global average pooling, a linear head (Opacus can train every layer)."""
    return nn.Sequential(
        nn.Conv1d(1, 16, 5, padding=2), nn.ReLU(), nn.MaxPool1d(2),
        nn.Conv1d(16, 32, 5, padding=2), nn.ReLU(),
        nn.AdaptiveAvgPool1d(1), nn.Flatten(),
        nn.Linear(32, len(CLASSES)),
    )


def _band(partition_id: int, num_partitions: int) -> tuple[float, float]:
    lo = 1.0 + 3.0 * partition_id / max(1, num_partitions)  # client 0: 1-2.5 cycles, the last ~4-5.5
    return lo, lo + 1.5


def load_data(partition_id: int, num_partitions: int, length: int = 64, samples: int = 120, seed: int = 0):
    """Client ``partition_id``: ``samples`` waves to train on and a quarter as many to test on."""
    rng = np.random.default_rng([seed, partition_id])
    band = _band(partition_id, num_partitions)
    train = Waves(*waves(samples, length, rng, band))
    test = Waves(*waves(max(1, samples // 4), length, rng, band))
    return train, test


def load_centralized(length: int = 64, samples: int = 120, seed: int = 0):
    """The server's evaluation set: 300 waves over every client's band."""
    return Waves(*waves(300, length, np.random.default_rng([seed, 10**6]), (1.0, 5.5)))


def loss(model: nn.Module, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    return nn.functional.cross_entropy(model(batch["signal"]), batch["label"])


@torch.no_grad()
def evaluate(model: nn.Module, loader) -> dict[str, float]:
    """Mean cross-entropy (``loss``) and ``accuracy`` over the loader's batches of dicts."""
    model.eval()
    device = next(model.parameters()).device
    total, correct, n = 0.0, 0, 0
    for batch in loader:
        x, y = batch["signal"].to(device), batch["label"].to(device)
        logits = model(x)
        total += float(nn.functional.cross_entropy(logits, y, reduction="sum"))
        correct += int((logits.argmax(1) == y).sum())
        n += len(y)
    if n == 0:
        raise ValueError("evaluate: the loader yielded no samples")
    return {"loss": total / n, "accuracy": correct / n}
