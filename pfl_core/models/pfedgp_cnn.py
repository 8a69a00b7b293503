"""pFedGP's backbone (``experiments/backbone.py`` ``CNNTarget`` of IdanAchituve/pFedGP): the LeNet
trunk of :mod:`pfl_core.models.lenet`, ReLU(fc2), then ``Linear(84 -> 84)``. Its output is the
feature vector the per-client Gaussian process classifies, and also its embedding (the ``-Proto``
evaluation's layer for pFedGP: docs/papers/metavers.md)."""
from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

from pfl_core.models import MODELS
from pfl_core.models.lenet import EMBEDDING_DIM, LeNetTrunk, _check_input


class PFedGPBackbone(LeNetTrunk):
    """conv1, conv2, fc1, fc2 (LeNet) -> ReLU -> ``embed_dim`` Linear(84, 84) (the code's name)."""

    def __init__(self):
        super().__init__()
        self.embed_dim = nn.Linear(EMBEDDING_DIM, EMBEDDING_DIM)

    def forward(self, x: torch.Tensor, embed: bool = False) -> torch.Tensor:
        return self.embed_dim(F.relu(self.trunk(x)))


@MODELS.register("pfedgp_cnn")
def pfedgp_cnn(input_shape: tuple[int, ...], num_classes: int) -> nn.Module:
    """pFedGP's 84-d feature extractor (``num_classes`` unused: the GP classifies)."""
    _check_input("pfedgp_cnn", input_shape)
    return PFedGPBackbone()
