"""Prototype primitives shared by prototypical methods and evaluations (docs/papers/metavers.md and
"Evaluation protocol"; FedProto).

Distances are **squared** Euclidean, as in the MetaVers code's logits, hinge and ``proto_eval``.
All functions are pure tensor code (no host syncs), so they run under ``torch.func.vmap``.
"""
from __future__ import annotations

import torch


def squared_distances(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """[n, m] matrix of ||a_i - b_j||^2 for a: [n, d], b: [m, d] (exact differences, no
    expansion trick, so it is exactly 0 on identical rows)."""
    return (a.unsqueeze(1) - b.unsqueeze(0)).pow(2).sum(-1)


def class_prototypes(embeddings: torch.Tensor, labels: torch.Tensor, num_classes: int) -> torch.Tensor:
    """[num_classes, d] mean embedding per class label 0..num_classes-1 (a class without samples
    gets a zero row; callers mask such classes out)."""
    classes = torch.arange(num_classes, device=labels.device)
    onehot = (labels.unsqueeze(1) == classes).to(embeddings.dtype)  # [n, C]; F.one_hot fails under vmap
    counts = onehot.sum(0).clamp_min(1.0)
    return (onehot.T @ embeddings) / counts.unsqueeze(1)


def prototype_logits(embeddings: torch.Tensor, prototypes: torch.Tensor) -> torch.Tensor:
    """Logits -||f(x) - c_k||^2 (MetaVers Eq. 2 as the code computes it)."""
    return -squared_distances(embeddings, prototypes)


def nearest_prototype(embeddings: torch.Tensor, prototypes: torch.Tensor,
                      allowed: torch.Tensor | None = None) -> torch.Tensor:
    """Index of the nearest prototype per row; ``allowed`` (bool [C]) restricts the choice to a
    client's own classes (``proto_eval``)."""
    logits = prototype_logits(embeddings, prototypes)
    if allowed is not None:
        logits = logits.masked_fill(~allowed, float("-inf"))
    return logits.argmax(1)
