"""Splitting a model's parameters into a head and a body, and training only one part.

Shared by the methods that treat the classifier and the feature extractor differently: FedRep
(head steps, then body steps), FedPer (personal head), LG-FedAvg (personal body), FedBABU (frozen
head). The head is every parameter whose name starts with one of ``head_prefixes`` (``fc3.`` for
``lenet``, the pFedHN/pFedGP target LeNet; ``fc.`` for the CAFeMe CNNs).
"""
from __future__ import annotations

from torch import nn


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
