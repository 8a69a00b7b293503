"""The CAFeMe base CNNs (docs/papers/cafeme.md): model A for 1x28x28, model B for 3x32x32.

BatchNorm never tracks running statistics: it normalises with the current batch's statistics in
training and evaluation alike, as in the authors' code.
"""
from __future__ import annotations

import torch.nn as nn

from pfl_core.models import MODELS
from pfl_core.models.pooling import relu_then_pool


def conv_block(c_in: int, c_out: int, kernel: int, padding: int | str, batchnorm: bool = True) -> nn.Sequential:
    """Conv -> BN (batch statistics only) -> ReLU -> MaxPool(2, 2); ``batchnorm=False`` drops the BN.
    ReLU and pool are computed pool first (:func:`~pfl_core.models.pooling.relu_then_pool`)."""
    norm = [nn.BatchNorm2d(c_out, track_running_stats=False)] if batchnorm else []
    return nn.Sequential(nn.Conv2d(c_in, c_out, kernel, padding=padding), *norm, *relu_then_pool())


def dense_block(d_in: int, d_out: int) -> nn.Sequential:
    """Linear -> BN1d (batch statistics only) -> ReLU."""
    return nn.Sequential(
        nn.Linear(d_in, d_out), nn.BatchNorm1d(d_out, track_running_stats=False), nn.ReLU()
    )


class BaseCNN(nn.Module):
    """Conv blocks, flatten, hidden dense blocks, linear output (``features`` then ``fc``).

    The split into ``features`` (body) and ``fc`` (head) is the one FedRep uses in the CAFeMe code.
    """

    def __init__(self, features: nn.Sequential, fc: nn.Sequential):
        super().__init__()
        self.features = features
        self.fc = fc

    def forward(self, x):
        return self.fc(self.features(x).flatten(1))


def _check_shape(name: str, input_shape: tuple[int, ...], expected: tuple[int, ...]) -> None:
    if tuple(input_shape) != expected:
        raise ValueError(f"model {name!r} expects inputs of shape {expected}, got {tuple(input_shape)}")


@MODELS.register("cafeme_cnn_a")
def cafeme_cnn_a(input_shape: tuple[int, ...], num_classes: int) -> nn.Module:
    """Model A (``SimpleCNNModule``): 2 x [conv5x5 -> BN -> ReLU -> pool] (32, 64 filters),
    Linear(1024 -> 512) -> BN -> ReLU, Linear(512 -> classes). 583,242 parameters for 10 classes."""
    _check_shape("cafeme_cnn_a", input_shape, (1, 28, 28))
    features = nn.Sequential(conv_block(1, 32, 5, 0), conv_block(32, 64, 5, 0))
    fc = nn.Sequential(dense_block(1024, 512), nn.Linear(512, num_classes))
    return BaseCNN(features, fc)


@MODELS.register("cafeme_cnn_b")
def cafeme_cnn_b(input_shape: tuple[int, ...], num_classes: int) -> nn.Module:
    """Model B (``CNNModule``): 3 x [conv3x3 same -> BN -> ReLU -> pool] (64 filters),
    Linear(1024 -> 576) -> BN -> ReLU, Linear(576 -> 576) -> BN -> ReLU, Linear(576 -> classes).
    1,006,858 parameters for 10 classes."""
    _check_shape("cafeme_cnn_b", input_shape, (3, 32, 32))
    features = nn.Sequential(
        conv_block(3, 64, 3, "same"), conv_block(64, 64, 3, "same"), conv_block(64, 64, 3, "same")
    )
    fc = nn.Sequential(dense_block(1024, 576), dense_block(576, 576), nn.Linear(576, num_classes))
    return BaseCNN(features, fc)
