"""The built-in data sets and models as a task (``task:`` unset): the same interface as a user's.

``builtin_functions(data_cfg, model_cfg, seed)`` (made into a :class:`~fedasync.task.interface.Task`
by :func:`fedasync.task.interface.builtin_task`; this module does not import the interface) wraps :mod:`fedasync.task.data` (the federation of
``(data, seed)``, cached per process) and :mod:`fedasync.task.models` (``model.name``):

- ``model()``: ``build_model(model_cfg, input_shape, num_classes)``, the shape and class count from
  the data (or from ``input_shape``/``num_classes`` when given: a device builds the model from what
  the server sent, without the federation's data);
- ``load_data(partition_id, num_partitions, data_path=None)``: the client's partition and the
  held-out test set (x float32, y int64; the partition a ``TensorDataset``, the test set read on
  access); with ``data_path`` a device's own
  ``.npz`` (``data.normalize`` applied; its shape and labels checked against the model), and no test set;
- ``load_centralized()``: the held-out test set;
- ``load_validation()`` (only with ``data.val_fraction > 0``): the validation set carved out of the
  training pool before partitioning (no client's partition holds any of it);
- the default loss (cross-entropy) and metrics (loss, accuracy); no ``train`` override.

Its ``digest`` is the sha256 of the data and model sections and the seed (what the task is made of;
``data.val_fraction`` counts only when set, so a run without it keeps the digest it had before the key).
"""

from __future__ import annotations

import hashlib
import json
from typing import Any

import numpy as np
import torch
from torch.utils.data import Dataset


def check_device_data(path: str, x: np.ndarray, y: np.ndarray, shape: tuple[int, ...], num_classes: int) -> None:
    """A device's own data must fit the federation's model: the same sample size, labels 0-(C-1)."""
    if int(np.prod(x.shape[1:])) != int(np.prod(shape)):
        raise ValueError(f"data.path: {path}: samples of shape {tuple(x.shape[1:])}, but the federation's model "
                         f"takes samples of shape {tuple(shape)}")
    if len(y) and int(np.max(y)) >= num_classes:
        raise ValueError(f"data.path: {path}: label {int(np.max(y))}, but the federation has {num_classes} "
                         f"classes (labels 0-{num_classes - 1})")


class ArrayDataset(Dataset):
    """``(x[i], y[i])`` as float32/int64 tensors, read on access (no copy of the whole arrays)."""

    def __init__(self, x: np.ndarray, y: np.ndarray) -> None:
        self.x, self.y = x, y

    def __len__(self) -> int:
        return len(self.y)

    def __getitem__(self, i: int):
        return (torch.from_numpy(np.array(self.x[i], dtype=np.float32, copy=True)),
                torch.tensor(int(self.y[i]), dtype=torch.int64))


def data_dump(data_cfg: Any) -> dict[str, Any]:
    """``data_cfg`` as JSON-able dict; ``val_fraction`` left out when 0 (the default), so the setup a
    client is sent and the task's digest are those of before the key existed."""
    out = data_cfg.model_dump(mode="json")
    if not out.get("val_fraction"):
        out.pop("val_fraction", None)
    return out


def builtin_functions(data_cfg: Any, model_cfg: Any, seed: int, input_shape: tuple[int, ...] | None = None,
                      num_classes: int | None = None) -> dict[str, Any]:
    """The built-in task's ``fns`` (model, load_data, load_centralized), ``digest`` and ``num_classes``
    (``None`` until known: the data's) for ``data_cfg`` / ``model_cfg`` / ``seed`` (see the module docstring)."""
    from fedasync.task.data import load_federated

    seed = int(seed)
    shape_known = input_shape is not None and num_classes is not None

    def fed():
        return load_federated(data_cfg, seed)

    def shape_classes() -> tuple[tuple[int, ...], int]:
        if shape_known:
            return tuple(int(d) for d in input_shape), int(num_classes)
        f = fed()
        return tuple(f.input_shape), int(f.num_classes)

    def model():
        from fedasync.task.models import build_model

        shape, classes = shape_classes()
        return build_model(model_cfg, shape, classes)

    def load_data(partition_id: int, num_partitions: int, data_path: str | None = None):
        if data_path:
            from fedasync.task.data import load_npz, normalize

            x, y = load_npz(data_path)
            x = normalize(x, data_cfg.normalize)
            shape, classes = shape_classes()
            check_device_data(str(data_path), x, y, shape, classes)
            return (x, y), ArrayDataset(x[:0], y[:0])
        f = fed()
        if not 0 <= partition_id < len(f.partitions):
            raise ValueError(f"task builtin: load_data: partition {partition_id} is outside "
                            f"0-{len(f.partitions) - 1} (data.num_clients {len(f.partitions)})")
        return f.partitions[partition_id], ArrayDataset(f.x_test, f.y_test)

    def load_centralized():
        f = fed()
        return f.x_test, f.y_test

    fns = {"model": model, "load_data": load_data, "load_centralized": load_centralized}
    if getattr(data_cfg, "val_fraction", 0):
        def load_validation():
            f = fed()
            return f.x_val, f.y_val
        fns["load_validation"] = load_validation
    spec = {"data": data_dump(data_cfg), "model": model_cfg.model_dump(mode="json"), "seed": seed}
    digest = hashlib.sha256(json.dumps(spec, sort_keys=True).encode()).hexdigest()
    return {"fns": fns, "digest": digest, "num_classes": int(num_classes) if num_classes is not None else None}
