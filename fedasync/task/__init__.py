"""The learning task: the task interface (a user's module, or the built-in data sets and models),
federated data, models and local training.

Names are imported lazily, so ``fedasync.task.data`` can be used without importing torch.
"""

from __future__ import annotations

import importlib
from typing import Any

_EXPORTS = {
    # data
    "FederatedData": "data",
    "load_federated": "data",
    "load_partition": "data",
    "load_test": "data",
    "load_npz": "data",
    "save_partitions_npz": "data",
    # models
    "build_model": "models",
    "init_params": "models",
    "get_params": "models",
    "set_params": "models",
    "num_params": "models",
    "Params": "models",
    # train
    "pick_device": "train",
    "TrainResult": "train",
    "local_train": "train",
    "evaluate": "train",
    "evaluate_task": "train",
    "gradient": "train",
    "steps_for": "train",
    # the task interface
    "Task": "interface",
    "TaskError": "interface",
    "load_task": "interface",
    "task_from_config": "interface",
    "builtin_task": "interface",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    mod = _EXPORTS.get(name)
    if mod is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(f"{__name__}.{mod}"), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
