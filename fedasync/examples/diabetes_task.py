"""A regression task for fedasync: scikit-learn's diabetes data set (442 patients, 10 features,
a disease-progression score), a small MLP, mean squared error, and RMSE as the metric.

Written as a user writes a task: plain torch, numpy and scikit-learn, nothing from fedasync.
``examples/diabetes.yaml`` names it (``task: diabetes_task``) and sets the server's target to
``{metric: rmse, mode: min}``.  The data ships with scikit-learn, so nothing is downloaded.

The functions fedasync calls (``model``, ``load_data`` and ``load_centralized`` also receive the
YAML's ``task_args``, ``hidden`` and ``seed``, as keyword arguments):

* ``model()`` - the network to train;
* ``load_data(partition_id, num_partitions)`` - this client's (train, test) Datasets;
* ``load_centralized()`` - the server's evaluation set;
* ``loss(model, batch)`` - mean squared error (the default would be cross-entropy);
* ``evaluate(model, loader)`` - ``rmse`` in the target's own units, and ``loss`` (the MSE on the
  standardized target that training minimizes).
"""

from __future__ import annotations

import numpy as np
import torch
from torch import nn
from torch.utils.data import TensorDataset

TEST_FRACTION = 0.2  # held out for the server, the same patients for every client and every run
# the target's mean and standard deviation over the whole data set: the model learns (y - mean) / std,
# and evaluate maps its errors back, so rmse is in the units of the disease score
Y_MEAN, Y_STD = 152.13348416289594, 77.00574586945044


def _arrays(seed: int):
    """Standardized features and target, split once into (train, test) by a seeded permutation."""
    from sklearn.datasets import load_diabetes

    x, y = load_diabetes(return_X_y=True)
    order = np.random.default_rng(seed).permutation(len(y))
    n_test = int(round(TEST_FRACTION * len(y)))
    test, train = order[:n_test], order[n_test:]
    mean, std = x[train].mean(0), x[train].std(0)
    x = ((x - mean) / std).astype(np.float32)
    y = ((y - Y_MEAN) / Y_STD).astype(np.float32)  # the model learns a standardized target
    return (x[train], y[train]), (x[test], y[test])



def _dataset(x: np.ndarray, y: np.ndarray) -> TensorDataset:
    return TensorDataset(torch.from_numpy(x), torch.from_numpy(y))


def model(hidden: int = 32, seed: int = 0) -> nn.Module:
    """10 features -> ``hidden`` -> ``hidden`` -> one output (the standardized score)."""
    return nn.Sequential(nn.Linear(10, hidden), nn.ReLU(), nn.Linear(hidden, hidden), nn.ReLU(),
                         nn.Linear(hidden, 1))


def load_data(partition_id: int, num_partitions: int, hidden: int = 32, seed: int = 0):
    """Client ``partition_id`` of ``num_partitions``: an equal share of the training patients,
    80 % to train on and 20 % to test on locally."""
    (x, y), _ = _arrays(seed)
    part = np.array_split(np.arange(len(y)), num_partitions)[partition_id]
    n_local_test = max(1, len(part) // 5)
    local_test, local_train = part[:n_local_test], part[n_local_test:]
    return _dataset(x[local_train], y[local_train]), _dataset(x[local_test], y[local_test])


def load_centralized(hidden: int = 32, seed: int = 0):
    """The held-out patients, on which the server evaluates every model version."""
    _, (x, y) = _arrays(seed)
    return _dataset(x, y)


def loss(model: nn.Module, batch) -> torch.Tensor:
    """Mean squared error on the standardized target."""
    x, y = batch
    return nn.functional.mse_loss(model(x).squeeze(-1), y)


@torch.no_grad()
def evaluate(model: nn.Module, loader) -> dict[str, float]:
    """``loss``: MSE on the standardized target; ``rmse``: root mean squared error of the score."""
    model.eval()
    device = next(model.parameters()).device
    squared, n = 0.0, 0
    for x, y in loader:
        x, y = x.to(device), y.to(device)
        squared += float(((model(x).squeeze(-1) - y) ** 2).sum())
        n += len(y)
    if n == 0:
        raise ValueError("evaluate: the loader yielded no samples")
    mse = squared / n
    return {"loss": mse, "rmse": float(np.sqrt(mse)) * Y_STD}
