"""The pFedHN/pFedGP LeNet family used by MetaVers (docs/papers/metavers.md).

``lenet``: pFedHN's target network (``CNNTarget``), conv5x5(16) -> ReLU -> pool, conv5x5(32) ->
ReLU -> pool, Linear(800 -> 120) -> ReLU, Linear(120 -> 84) -> ReLU, Linear(84 -> classes). Its
embedding (:func:`pfl_core.training.embed`) is ReLU(fc2), the 84-d input of the classifier (a
harness choice for the ``-Proto`` evaluation of Table 3).

``le_embedding``: MetaVers' ``LeEmbedding``, the same trunk without the classifier and without
the ReLU after fc2; its output *is* the 84-d embedding. 120,332 parameters.

Both take 3x32x32 inputs and use PyTorch's default initialisation.
"""
from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

from pfl_core.models import MODELS
from pfl_core.models.pooling import max_pool2d

EMBEDDING_DIM = 84


def _check_input(name: str, input_shape: tuple[int, ...]) -> None:
    if tuple(input_shape) != (3, 32, 32):
        raise ValueError(f"model {name!r} expects inputs of shape (3, 32, 32), got {tuple(input_shape)}")


class LeNetTrunk(nn.Module):
    """conv1, conv2, fc1, fc2 (parameter names as in pFedHN's ``CNNTarget``)."""

    def __init__(self):
        super().__init__()
        self.conv1 = nn.Conv2d(3, 16, 5)
        self.conv2 = nn.Conv2d(16, 32, 5)
        self.fc1 = nn.Linear(800, 120)
        self.fc2 = nn.Linear(120, EMBEDDING_DIM)

    def trunk(self, x: torch.Tensor) -> torch.Tensor:
        """fc2's output, before any activation. Each conv's ReLU -> 2x2 max-pool is computed pool
        first: the textbook order's outputs and gradients bit for bit, ReLU on a quarter of the
        elements (:func:`~pfl_core.models.pooling.relu_then_pool`; ``tests/test_pooling.py``)."""
        x = F.relu(max_pool2d(self.conv1(x), 2))
        x = F.relu(max_pool2d(self.conv2(x), 2))
        return self.fc2(F.relu(self.fc1(x.flatten(1))))


class LeEmbedding(LeNetTrunk):
    """MetaVers' embedding network: the output is fc2's (no final ReLU)."""

    def forward(self, x: torch.Tensor, embed: bool = False) -> torch.Tensor:
        return self.trunk(x)


class LeNet(LeNetTrunk):
    """pFedHN's LeNet classifier; ``embed=True`` returns ReLU(fc2), the classifier's input."""

    def __init__(self, num_classes: int):
        super().__init__()
        self.fc3 = nn.Linear(EMBEDDING_DIM, num_classes)

    def forward(self, x: torch.Tensor, embed: bool = False) -> torch.Tensor:
        features = F.relu(self.trunk(x))
        return features if embed else self.fc3(features)


@MODELS.register("le_embedding")
def le_embedding(input_shape: tuple[int, ...], num_classes: int) -> nn.Module:
    """MetaVers ``LeEmbedding`` (84-d output; ``num_classes`` is unused: prototypes classify)."""
    _check_input("le_embedding", input_shape)
    return LeEmbedding()


@MODELS.register("lenet")
def lenet(input_shape: tuple[int, ...], num_classes: int) -> nn.Module:
    """pFedHN's target LeNet (``CNNTarget``) with a ``num_classes`` classifier ``fc3``."""
    _check_input("lenet", input_shape)
    return LeNet(num_classes)
