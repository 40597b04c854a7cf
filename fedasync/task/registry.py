"""The model registry: ``model.name`` -> ``(cfg, input_shape, num_classes) -> nn.Module``.

Adding a model is one function decorated with ``@register("name")`` (plus its name in
``ModelConfig.name``); :func:`fedasync.task.models.build_model` looks it up.  ``conv_layout`` is
how the convolutional models read a sample's shape.
"""

from __future__ import annotations

import math
from typing import Any, Callable

#: model.name -> (cfg, input_shape, num_classes) -> a fresh nn.Module
MODELS: dict[str, Callable[[Any, tuple[int, ...], int], Any]] = {}


def register(name: str):
    """Decorator: ``@register("name")`` on ``def build(cfg, input_shape, num_classes) -> nn.Module``."""

    def deco(fn):
        MODELS[name] = fn
        return fn

    return deco


def conv_layout(input_shape: tuple[int, ...]) -> tuple[int, tuple[int, ...], bool]:
    """How the CNN sees a sample: ``(channels, spatial dims, channels_last)``.

    * ``(n,)`` with ``n`` a perfect square >= 16 (digits: 64) -> 1 x 8 x 8, Conv2d;
    * ``(n,)`` otherwise (mnist1d: 40) -> 1 x n, Conv1d;
    * ``(H, W)`` -> 1 x H x W;
    * ``(H, W, C)`` with C in 1, 3, 4 and H > 4 -> channels-last image (Hugging Face), permuted;
    * ``(C, H, W)`` otherwise.
    """
    shape = tuple(int(s) for s in input_shape)
    if len(shape) == 1:
        n = shape[0]
        side = math.isqrt(n)
        if n >= 16 and side * side == n:
            return 1, (side, side), False
        return 1, (n,), False
    if len(shape) == 2:
        return 1, shape, False
    if len(shape) == 3:
        if shape[2] in (1, 3, 4) and shape[0] > 4:
            return shape[2], (shape[0], shape[1]), True
        return shape[0], (shape[1], shape[2]), False
    raise ValueError(f"model.name cnn: unsupported input shape {shape}")
