"""Image models of the literature, registered in :data:`fedasync.task.registry.MODELS`.

* ``fedavg_cnn`` - the CNN of McMahan et al. 2017 ("Communication-efficient learning of deep
  networks from decentralized data"): two 5x5 convolutions (32 and 64 channels, "same" padding),
  each followed by ReLU and 2x2 max-pooling, a 512-unit dense layer with ReLU and a softmax output
  (logits here; the loss applies the softmax).  1,663,370 parameters on 28x28x1 with 10 classes.
* ``resnet20`` - the CIFAR ResNet-20 of He et al. 2016 (3 stages of 3 basic blocks, 16/32/64
  channels, global average pooling) with GroupNorm instead of BatchNorm, so Opacus' per-sample
  gradients apply (BatchNorm mixes samples of a batch).  ~0.27M parameters.
* ``dp_cnn`` - the small tanh CNN that DP-SGD is usually run with on MNIST (Papernot et al. 2021,
  "Tempered sigmoid activations for deep learning with differential privacy"; the model of Opacus'
  MNIST example): 16 8x8 filters with stride 2, 2x2 max-pooling with stride 1, 32 4x4 filters with
  stride 2, the same pooling, a 32-unit dense layer, tanh throughout.  26,010 parameters on
  28x28x1.  DP-SGD's noise grows with the number of coordinates (its norm with their square root),
  so at a fixed epsilon a model 64x smaller than ``fedavg_cnn`` keeps far more of its signal.

All take any image-like input through :func:`fedasync.task.registry.conv_layout` (flat square
vectors, ``(H, W)``, ``(H, W, C)`` or ``(C, H, W)``).
"""

from __future__ import annotations

import torch
from torch import nn

from fedasync.config import ModelConfig
from fedasync.task.registry import conv_layout, register


class _Image(nn.Module):
    """Reshapes a batch to ``(N, C, H, W)`` from the data's sample shape."""

    def __init__(self, input_shape: tuple[int, ...], name: str) -> None:
        super().__init__()
        try:
            channels, spatial, self.channels_last = conv_layout(input_shape)
        except ValueError:
            spatial = ()
        if len(spatial) != 2:
            raise ValueError(f"model.name {name}: needs 2-D images, the data's samples have shape "
                             f"{tuple(input_shape)} (set data.shape, e.g. [28, 28])")
        self.channels, self.spatial = channels, spatial
        self.view_shape = (channels, *spatial) if not self.channels_last else (*spatial, channels)

    def image(self, x: torch.Tensor) -> torch.Tensor:
        x = x.reshape(x.shape[0], *self.view_shape)
        return x.permute(0, 3, 1, 2) if self.channels_last else x


class FedAvgCNN(_Image):
    def __init__(self, input_shape: tuple[int, ...], num_classes: int) -> None:
        super().__init__(input_shape, "fedavg_cnn")
        h, w = self.spatial
        self.features = nn.Sequential(
            nn.Conv2d(self.channels, 32, 5, padding=2),
            nn.ReLU(),
            nn.MaxPool2d(2) if min(h, w) >= 2 else nn.Identity(),
            nn.Conv2d(32, 64, 5, padding=2),
            nn.ReLU(),
            nn.MaxPool2d(2) if min(h, w) >= 4 else nn.Identity(),
        )
        for _ in range(2):
            h, w = (h // 2, w // 2) if min(h, w) >= 2 else (h, w)
        self.head = nn.Sequential(nn.Linear(64 * h * w, 512), nn.ReLU(), nn.Linear(512, num_classes))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(torch.flatten(self.features(self.image(x)), 1))


def _norm(channels: int) -> nn.GroupNorm:
    return nn.GroupNorm(min(8, channels), channels)


class BasicBlock(nn.Module):
    def __init__(self, c_in: int, c_out: int, stride: int) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(c_in, c_out, 3, stride=stride, padding=1, bias=False)
        self.norm1 = _norm(c_out)
        self.conv2 = nn.Conv2d(c_out, c_out, 3, padding=1, bias=False)
        self.norm2 = _norm(c_out)
        self.act = nn.ReLU()
        self.shortcut = nn.Identity()
        if stride != 1 or c_in != c_out:
            self.shortcut = nn.Sequential(nn.Conv2d(c_in, c_out, 1, stride=stride, bias=False), _norm(c_out))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.act(self.norm1(self.conv1(x)))
        out = self.norm2(self.conv2(out))
        return self.act(out + self.shortcut(x))


class ResNet20(_Image):
    def __init__(self, input_shape: tuple[int, ...], num_classes: int, blocks: int = 3) -> None:
        super().__init__(input_shape, "resnet20")
        self.stem = nn.Sequential(nn.Conv2d(self.channels, 16, 3, padding=1, bias=False), _norm(16), nn.ReLU())
        layers, c_in = [], 16
        for i, c_out in enumerate((16, 32, 64)):
            for j in range(blocks):
                layers.append(BasicBlock(c_in, c_out, 2 if (i > 0 and j == 0) else 1))
                c_in = c_out
        self.layers = nn.Sequential(*layers)
        self.pool = nn.AdaptiveAvgPool2d(1)
        self.head = nn.Linear(64, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.layers(self.stem(self.image(x)))
        return self.head(torch.flatten(self.pool(x), 1))


class DPCNN(_Image):
    def __init__(self, input_shape: tuple[int, ...], num_classes: int) -> None:
        super().__init__(input_shape, "dp_cnn")
        h, w = self.spatial
        if min(h, w) < 14:
            raise ValueError(f"model.name dp_cnn: needs images of at least 14x14, the data's are {h}x{w}")
        self.features = nn.Sequential(
            nn.Conv2d(self.channels, 16, 8, stride=2, padding=3), nn.Tanh(), nn.MaxPool2d(2, 1),
            nn.Conv2d(16, 32, 4, stride=2), nn.Tanh(), nn.MaxPool2d(2, 1),
        )
        with torch.no_grad():
            flat = self.features(torch.zeros(1, self.channels, h, w)).numel()
        self.head = nn.Sequential(nn.Linear(flat, 32), nn.Tanh(), nn.Linear(32, num_classes))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(torch.flatten(self.features(self.image(x)), 1))


@register("fedavg_cnn")
def _fedavg_cnn(cfg: ModelConfig, input_shape: tuple[int, ...], num_classes: int) -> nn.Module:
    return FedAvgCNN(input_shape, num_classes)


@register("dp_cnn")
def _dp_cnn(cfg: ModelConfig, input_shape: tuple[int, ...], num_classes: int) -> nn.Module:
    return DPCNN(input_shape, num_classes)


@register("resnet20")
def _resnet20(cfg: ModelConfig, input_shape: tuple[int, ...], num_classes: int) -> nn.Module:
    return ResNet20(input_shape, num_classes)
