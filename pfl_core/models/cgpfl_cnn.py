"""CGPFL's CIFAR-10 CNN, "two convolutional layers and two fully connected layers" (docs/papers/cgpfl.md,
harness default: the exact shapes are not published).

Conv(3->6, 5x5) -> ReLU -> MaxPool 2 -> Conv(6->16, 5x5) -> ReLU -> MaxPool 2 -> flatten (400) ->
Linear(400->120) -> ReLU -> Linear(120->10): 52,202 parameters for 10 classes. It is the pFedMe
authors' CNNCifar with its middle 120->100 layer removed.
"""
from __future__ import annotations

import torch.nn as nn

from pfl_core.models import MODELS
from pfl_core.models.pooling import MaxPool2d


@MODELS.register("cgpfl_cnn")
def cgpfl_cnn(input_shape: tuple[int, ...], num_classes: int) -> nn.Module:
    if tuple(input_shape) != (3, 32, 32):
        raise ValueError(f"model 'cgpfl_cnn' expects inputs of shape (3, 32, 32), got {tuple(input_shape)}")
    return nn.Sequential(
        nn.Conv2d(3, 6, 5), nn.ReLU(), MaxPool2d(2),
        nn.Conv2d(6, 16, 5), nn.ReLU(), MaxPool2d(2),
        nn.Flatten(),
        nn.Linear(16 * 5 * 5, 120), nn.ReLU(),
        nn.Linear(120, num_classes),
    )
