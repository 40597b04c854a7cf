"""Models (plain torch, no BatchNorm so Opacus can train them), their registry, and parameter helpers.

The registry maps ``model.name`` to a function ``(cfg, input_shape, num_classes) -> nn.Module``;
adding a model is one function decorated with ``@register("name")`` (and its name in
``ModelConfig.name``).  Input shape and number of classes come from the data.  ``mlp`` and ``cnn``
live here, ``fedavg_cnn`` and ``resnet20`` in :mod:`fedasync.task.models_cnn`.

Parameters travel as ``dict[str, np.ndarray]`` (float32 copies of the ``state_dict``, in its key
order).  ``set_params`` is strict: a missing or extra key, or a wrong shape, raises ``ValueError``
naming it.
"""

from __future__ import annotations

import math
from collections import OrderedDict

import numpy as np
import torch
from torch import nn

from fedasync.config import ModelConfig
from fedasync.task.registry import MODELS, conv_layout, register

__all__ = ["MODELS", "register", "conv_layout", "build_model", "init_params", "get_params", "set_params",
           "num_params", "Params", "MLP", "CNN"]

Params = dict[str, np.ndarray]


class MLP(nn.Module):
    def __init__(self, in_features: int, hidden: int, num_classes: int) -> None:
        super().__init__()
        self.net = nn.Sequential(
            nn.Flatten(),
            nn.Linear(in_features, hidden),
            nn.ReLU(),
            nn.Linear(hidden, hidden),
            nn.ReLU(),
            nn.Linear(hidden, num_classes),
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)


class CNN(nn.Module):
    """Conv(16, 3, pad 1) ReLU Conv(32, 3, pad 1) ReLU MaxPool(2) Linear; 1-D or 2-D from input_shape."""

    def __init__(self, input_shape: tuple[int, ...], num_classes: int) -> None:
        super().__init__()
        channels, spatial, self.channels_last = conv_layout(input_shape)
        self.view_shape = (channels, *spatial) if not self.channels_last else (*spatial, channels)
        two_d = len(spatial) == 2
        conv = nn.Conv2d if two_d else nn.Conv1d
        pool = nn.MaxPool2d if two_d else nn.MaxPool1d
        pooled = [max(1, s // 2) for s in spatial]
        self.features = nn.Sequential(
            conv(channels, 16, 3, padding=1),
            nn.ReLU(),
            conv(16, 32, 3, padding=1),
            nn.ReLU(),
            pool(2) if min(spatial) >= 2 else nn.Identity(),
        )
        if min(spatial) < 2:
            pooled = list(spatial)
        self.head = nn.Linear(32 * math.prod(pooled), num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x.reshape(x.shape[0], *self.view_shape)
        if self.channels_last:
            x = x.permute(0, 3, 1, 2)
        return self.head(torch.flatten(self.features(x), 1))


@register("mlp")
def _mlp(cfg: ModelConfig, input_shape: tuple[int, ...], num_classes: int) -> nn.Module:
    return MLP(math.prod(int(s) for s in input_shape), cfg.hidden, num_classes)


@register("cnn")
def _cnn(cfg: ModelConfig, input_shape: tuple[int, ...], num_classes: int) -> nn.Module:
    return CNN(tuple(input_shape), num_classes)


def build_model(cfg: ModelConfig, input_shape: tuple[int, ...], num_classes: int) -> nn.Module:
    """A fresh model; its initial weights come from torch's global RNG (seed it first)."""
    import fedasync.task.models_cnn  # noqa: F401  (registers fedavg_cnn, resnet20, dp_cnn)

    if num_classes < 2:
        raise ValueError(f"num_classes: {num_classes} (need at least 2)")
    fn = MODELS.get(cfg.name)
    if fn is None:
        raise ValueError(f"model.name: unknown model {cfg.name!r} (known: {', '.join(sorted(MODELS))})")
    return fn(cfg, tuple(int(s) for s in input_shape), int(num_classes))


def init_params(cfg: ModelConfig, input_shape: tuple[int, ...], num_classes: int, seed: int) -> Params:
    """Initial parameters for ``seed``; leaves torch's global RNG state as it was."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = build_model(cfg, input_shape, num_classes)
    return get_params(model)


def get_params(model: nn.Module) -> Params:
    """``state_dict`` as float32 numpy copies, key order preserved."""
    return OrderedDict(
        (k, v.detach().to("cpu", torch.float32).numpy().copy()) for k, v in model.state_dict().items()
    )


def set_params(model: nn.Module, params: Params) -> None:
    """Load ``params`` into ``model`` in place; strict about keys and shapes."""
    state = model.state_dict()
    missing = [k for k in state if k not in params]
    extra = [k for k in params if k not in state]
    if missing or extra:
        parts = []
        if missing:
            parts.append(f"missing key(s) {missing}")
        if extra:
            parts.append(f"unexpected key(s) {extra}")
        raise ValueError(f"set_params: {'; '.join(parts)}")
    with torch.no_grad():
        for k, t in state.items():
            v = np.asarray(params[k])
            if tuple(v.shape) != tuple(t.shape):
                raise ValueError(
                    f"set_params: shape mismatch for {k!r}: got {tuple(v.shape)}, model has {tuple(t.shape)}"
                )
            if not (v.flags.writeable and v.flags.c_contiguous):
                v = np.array(v, order="C")  # torch.from_numpy warns on read-only arrays
            t.copy_(torch.from_numpy(v).to(t.dtype))


def num_params(params: Params) -> int:
    return int(sum(v.size for v in params.values()))
