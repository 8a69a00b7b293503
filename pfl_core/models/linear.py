"""Models on flat features: multinomial logistic regression and a one-hidden-layer DNN
(docs/papers/cgpfl.md; pFedMe's MLR/DNN)."""
from __future__ import annotations

import math

import torch.nn as nn

from pfl_core.models import MODELS


def _flat_size(input_shape: tuple[int, ...]) -> int:
    return math.prod(input_shape)


@MODELS.register("mlr")
def mlr(input_shape: tuple[int, ...], num_classes: int) -> nn.Module:
    """Multinomial logistic regression: flatten -> Linear(d -> classes); softmax is in the loss."""
    return nn.Sequential(nn.Flatten(), nn.Linear(_flat_size(input_shape), num_classes))


@MODELS.register("dnn")
def dnn(input_shape: tuple[int, ...], num_classes: int, hidden: int = 128) -> nn.Module:
    """One hidden layer: flatten -> Linear(d -> hidden) -> ReLU -> Linear(hidden -> classes).

    ``hidden=128`` is the CGPFL paper's width; pFedMe's code used 100 (a named switch).
    """
    return nn.Sequential(
        nn.Flatten(),
        nn.Linear(_flat_size(input_shape), hidden),
        nn.ReLU(),
        nn.Linear(hidden, num_classes),
    )
