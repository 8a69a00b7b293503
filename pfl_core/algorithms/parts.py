"""Splitting a model's parameters into a head and a body, and training only one part.

Shared by the methods that treat the classifier and the feature extractor differently: FedRep
(head steps, then body steps), FedPer (personal head), LG-FedAvg (personal body), FedBABU (frozen
head). The head is every parameter whose name starts with one of ``head_prefixes`` (``fc3.`` for
``lenet``, the pFedHN/pFedGP target LeNet; ``fc.`` for the CAFeMe CNNs).
"""
from __future__ import annotations

import torch
from torch import nn

from pfl_core.training import Params, batch_loss, value_and_grad


def split_names(model: nn.Module, prefixes: list[str], method: str) -> tuple[list[str], list[str]]:
    """(head names, body names) of ``model``'s parameters; both must be non-empty."""
    names = [name for name, _ in model.named_parameters()]
    head = [n for n in names if n.startswith(tuple(prefixes))]
    body = [n for n in names if not n.startswith(tuple(prefixes))]
    if not head or not body:
        raise ValueError(
            f"{method}: head_prefixes {list(prefixes)} must split the model into a non-empty head and "
            f"body; its parameters are {names}. Set method.params.head_prefixes."
        )
    return head, body


def partial_gradients(model, params: Params, trainable: list[str], x, y) -> tuple[Params, torch.Tensor]:
    """(d loss / d params[trainable], loss): the other parameters enter as constants."""
    frozen = {k: v for k, v in params.items() if k not in set(trainable)}
    return value_and_grad(lambda part, x, y: batch_loss(model, {**frozen, **part}, x, y),
                          {k: params[k] for k in trainable}, x, y)
