"""The ResNet-18 backbones of FedL2P (docs/papers/fedl2p.md), every BatchNorm a KLD-BatchNorm.

torchvision's ResNet-18 (BasicBlocks [2, 2, 2, 2], global average pool, fc), with torchvision's
module names and initialisation (conv weights Kaiming-normal, fan_out; BN weight 1, bias 0; fc as
``nn.Linear``), so torchvision's ImageNet weights load by name. Three stems:

| model | stem | maxpool | parameters at width 64 (10 / 12 classes) |
|---|---|---|---|
| ``resnet18_cifar`` | Conv 3x3, stride 1, padding 1 | none | 11,173,962 |
| ``resnet18_audio`` | Conv 7x7 on 1 channel, stride 2, padding 3 | none | 11,176,396 |
| ``resnet18_imagenet`` | Conv 7x7, stride 2, padding 3 | 3x3, stride 2 | 11,181,642 |

Each has 20 BN layers, 20 convolutions (no bias) and one linear layer: 41 learnable modules and 62
parameter tensors, the sizes of FedL2P's meta-nets (:mod:`pfl_core.models.metanets`).

Why not ``torchvision.models.resnet18`` itself: its stage widths are fixed at 64..512, and the CPU
profiles and tests need narrow copies (``width``: the first stage's channels, stages width x
{1, 2, 4, 8}); the module names and shapes at width 64 are torchvision's (tested).
"""
from __future__ import annotations

from typing import Literal

import torch
import torch.nn as nn
import torch.nn.functional as F

from pfl_core.models import MODELS
from pfl_core.models.kld_bn import KLDBatchNorm2d, keeps_bn_state
from pfl_core.models.pooling import MaxPool2d


class BasicBlock(nn.Module):
    """Two 3x3 convolutions with a residual connection (torchvision's ``BasicBlock``)."""

    def __init__(self, c_in: int, c_out: int, stride: int):
        super().__init__()
        self.conv1 = nn.Conv2d(c_in, c_out, 3, stride=stride, padding=1, bias=False)
        self.bn1 = KLDBatchNorm2d(c_out)
        self.conv2 = nn.Conv2d(c_out, c_out, 3, stride=1, padding=1, bias=False)
        self.bn2 = KLDBatchNorm2d(c_out)
        self.downsample = None
        if stride != 1 or c_in != c_out:
            self.downsample = nn.Sequential(nn.Conv2d(c_in, c_out, 1, stride=stride, bias=False), KLDBatchNorm2d(c_out))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = F.relu(self.bn1(self.conv1(x)))
        out = self.bn2(self.conv2(out))
        identity = x if self.downsample is None else self.downsample(x)
        return F.relu(out + identity)


class ResNet18(nn.Module):
    """ResNet-18 with a configurable stem; ``forward(x, embed=True)`` gives the pooled features."""

    def __init__(self, stem: nn.Conv2d, maxpool: nn.Module, num_classes: int, width: int):
        super().__init__()
        self.conv1 = stem
        self.bn1 = KLDBatchNorm2d(width)
        self.maxpool = maxpool
        widths = [width, 2 * width, 4 * width, 8 * width]
        c_in = width
        for i, (c_out, stride) in enumerate(zip(widths, (1, 2, 2, 2))):
            self.add_module(f"layer{i + 1}", nn.Sequential(BasicBlock(c_in, c_out, stride), BasicBlock(c_out, c_out, 1)))
            c_in = c_out
        self.fc = nn.Linear(widths[-1], num_classes)
        for m in self.modules():
            if isinstance(m, nn.Conv2d):
                nn.init.kaiming_normal_(m.weight, mode="fan_out", nonlinearity="relu")

    def forward(self, x: torch.Tensor, embed: bool = False) -> torch.Tensor:
        x = self.maxpool(F.relu(self.bn1(self.conv1(x))))
        x = self.layer4(self.layer3(self.layer2(self.layer1(x))))
        features = x.mean(dim=(2, 3))
        return features if embed else self.fc(features)


def learnable_modules(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """The modules that own parameters (convolutions, BN layers, the fc), in registration order:
    LRNet's 41 input positions (docs/papers/fedl2p.md)."""
    return [(n, m) for n, m in model.named_modules() if any(True for _ in m.parameters(recurse=False))]


def _check(name: str, input_shape: tuple[int, ...], channels: int, width: int) -> None:
    if len(input_shape) != 3 or input_shape[0] != channels:
        raise ValueError(f"model {name!r} expects ({channels}, H, W) inputs, got {tuple(input_shape)}")
    if width < 1:
        raise ValueError(f"model {name!r}: width must be >= 1, got {width}")


@MODELS.register("resnet18_cifar")
@keeps_bn_state
def resnet18_cifar(input_shape: tuple[int, ...], num_classes: int, width: int = 64) -> nn.Module:
    """CIFAR-10 / CIFAR-10-C: 3x3 stem, stride 1, no maxpool."""
    _check("resnet18_cifar", input_shape, 3, width)
    return ResNet18(nn.Conv2d(3, width, 3, stride=1, padding=1, bias=False), nn.Identity(), num_classes, width)


@MODELS.register("resnet18_audio")
@keeps_bn_state
def resnet18_audio(input_shape: tuple[int, ...], num_classes: int, width: int = 64) -> nn.Module:
    """Speech Commands (1-channel 224x224 fbank images): 7x7 stride-2 stem, no maxpool."""
    _check("resnet18_audio", input_shape, 1, width)
    return ResNet18(nn.Conv2d(1, width, 7, stride=2, padding=3, bias=False), nn.Identity(), num_classes, width)


@MODELS.register("resnet18_imagenet")
@keeps_bn_state
def resnet18_imagenet(input_shape: tuple[int, ...], num_classes: int, width: int = 64,
                      weights: Literal["none", "imagenet"] = "none") -> nn.Module:
    """Office-Caltech-10 / DomainNet: torchvision's ImageNet stem (7x7 stride 2, maxpool 3x3 stride 2).

    ``weights: imagenet`` (width 64) loads torchvision's ``ResNet18_Weights.IMAGENET1K_V1`` into the
    trunk, BN running statistics included, cached in the data directory
    (:mod:`pfl_core.models.imagenet_weights`); the head keeps its own init (the run's init seed)."""
    _check("resnet18_imagenet", input_shape, 3, width)
    model = ResNet18(nn.Conv2d(3, width, 7, stride=2, padding=3, bias=False),
                     MaxPool2d(kernel_size=3, stride=2, padding=1), num_classes, width)
    if weights == "imagenet":
        from pfl_core.models.imagenet_weights import load_imagenet

        return load_imagenet(model)
    if weights != "none":
        raise ValueError(f"model 'resnet18_imagenet': weights must be 'none' or 'imagenet', got {weights!r}")
    return model
