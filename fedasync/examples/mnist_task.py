"""MNIST as a user task: the CNN of McMahan et al. 2017 on an ``.npz`` of images, IID clients.

Written as a user writes a task: plain torch and numpy, nothing from fedasync.
``examples/mnist_task.yaml`` names it (``task: mnist_task``).  It is the same learning problem as
the built-in path (``examples/mnist.yaml`` with ``data.partitioner: iid``, ``model.name:
fedavg_cnn``): the same network, layer for layer, the same pixel scaling and the same IID split
(contiguous equal shares, as flwr-datasets' ``IidPartitioner`` cuts them), so for the same seed
and config both paths train the same model, bit for bit (tests/test_examples_tasks.py checks the
final model's sha256).

``task_args``: ``path`` (an ``.npz`` with ``x_train``, ``y_train``, ``x_test``, ``y_test``; the
file ``benchmarks/mnist.py`` writes), ``side`` (image side, 28) and ``num_classes`` (10).  On a
device, ``fedasync client --data FILE`` reaches ``load_data`` as ``data_path``: an ``.npz`` with
``x`` and ``y``, which is then that device's whole training data.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch
from torch import nn
from torch.utils.data import TensorDataset

DEFAULT_PATH = "~/.cache/fedasync/mnist.npz"


class FedAvgCNN(nn.Module):
    """Two 5x5 convolutions (32, 64 channels, "same" padding), each with ReLU and 2x2 max-pooling,
    a 512-unit dense layer with ReLU, and the logits (1,663,370 parameters on 28x28 with 10 classes)."""

    def __init__(self, side: int, num_classes: int) -> None:
        super().__init__()
        self.side = side
        self.features = nn.Sequential(
            nn.Conv2d(1, 32, 5, padding=2), nn.ReLU(), nn.MaxPool2d(2),
            nn.Conv2d(32, 64, 5, padding=2), nn.ReLU(), nn.MaxPool2d(2),
        )
        pooled = side // 2 // 2
        self.head = nn.Sequential(nn.Linear(64 * pooled * pooled, 512), nn.ReLU(), nn.Linear(512, num_classes))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x.reshape(x.shape[0], 1, self.side, self.side)  # flat or (H, W) images alike
        return self.head(torch.flatten(self.features(x), 1))


def _pixels(x: np.ndarray) -> np.ndarray:
    """float32 images; 0-255 integer pixels are divided by 255."""
    scale = np.issubdtype(x.dtype, np.integer) and x.size and 1 < int(x.max()) <= 255 and int(x.min()) >= 0
    x = x.astype(np.float32)
    return x / np.float32(255.0) if scale else x


def _load(path: str, split: str) -> TensorDataset:
    with np.load(Path(path).expanduser()) as f:
        x, y = f[f"x_{split}"], f[f"y_{split}"]
    return TensorDataset(torch.from_numpy(_pixels(x)), torch.from_numpy(y.astype(np.int64)))


def model(path: str = DEFAULT_PATH, side: int = 28, num_classes: int = 10) -> nn.Module:
    return FedAvgCNN(side, num_classes)


def load_data(partition_id: int, num_partitions: int, path: str = DEFAULT_PATH, side: int = 28,
              num_classes: int = 10, data_path: str | None = None):
    """This client's (train, test): its contiguous share of the training images (IID: the file's order),
    and its share of the test images.  With ``data_path`` (a device's own file): that file's images."""
    if data_path is not None:
        with np.load(Path(data_path).expanduser()) as f:
            x, y = _pixels(f["x"]), f["y"].astype(np.int64)
        own = TensorDataset(torch.from_numpy(x), torch.from_numpy(y))
        return own, own
    train, test = _load(path, "train"), _load(path, "test")
    mine = np.array_split(np.arange(len(train)), num_partitions)[partition_id]
    theirs = np.array_split(np.arange(len(test)), num_partitions)[partition_id]
    return (TensorDataset(*(t[mine] for t in train.tensors)),
            TensorDataset(*(t[theirs] for t in test.tensors)))


def load_centralized(path: str = DEFAULT_PATH, side: int = 28, num_classes: int = 10):
    """Every test image: the server's evaluation set."""
    return _load(path, "test")
