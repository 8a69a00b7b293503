"""MetaVers' episode losses as pure tensor code (docs/papers/metavers.md; paper Eq. 2-4).

The episode's embeddings arrive in class blocks (:mod:`pfl_core.algorithms._lib.episodes`): ``support`` holds K
rows per class, and every row of the episode has a one-hot class row. Class sizes may differ
(the "R*" fallback), so every mean is taken through masks, never through shapes: two clients
whose episodes have the same sizes share one ``vmap`` call whatever their class split.

Defaults are the authors' code; each paper variant is an argument (the switches of
:class:`pfl_core.algorithms.metavers.MetaVersHyper`).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from pfl_core.prototypes import squared_distances

def safe_sqrt(sq: torch.Tensor) -> torch.Tensor:
    """sqrt of non-negative ``sq`` whose gradient is 0, not NaN, where ``sq`` is exactly 0 (two
    coinciding class means, or a row and its own one-row class mean; the code's ``** 0.5`` would
    turn the whole update into NaN there). Equal to ``sq.sqrt()`` everywhere."""
    positive = sq > 0
    return torch.where(positive, torch.where(positive, sq, torch.ones_like(sq)).sqrt(), torch.zeros_like(sq))


def distances(a: torch.Tensor, b: torch.Tensor, squared: bool) -> torch.Tensor:
    """[n, m] squared (the code) or Euclidean (the paper, Eq. 8) distances."""
    sq = squared_distances(a, b)
    return sq if squared else safe_sqrt(sq)


def class_means(embeddings: torch.Tensor, onehot: torch.Tensor) -> torch.Tensor:
    """[N, d] mean embedding per class column of ``onehot`` [rows, N] (vmap-safe: no
    ``one_hot`` of label values)."""
    return (onehot.T @ embeddings) / onehot.sum(0).unsqueeze(1)


def prototypical_ce(support: torch.Tensor, query: torch.Tensor, query_onehot: torch.Tensor, shot: int,
                    squared: bool = True) -> torch.Tensor:
    """L_S (Eq. 2): prototypes c_k = mean of the K support rows of class k, logits -d(f(x), c_k),
    cross-entropy averaged over all queries."""
    ways = query_onehot.shape[1]
    prototypes = support.reshape(ways, shot, -1).mean(1)
    return F.cross_entropy(-distances(query, prototypes, squared), query_onehot.argmax(1))


def local_margin(embeddings: torch.Tensor, onehot: torch.Tensor, eq3_scale: bool = False) -> torch.Tensor:
    """d (Eq. 3): class means a_c over support and query, then the mean over class pairs i < j of
    the non-squared ||a_i - a_j|| (the code); ``eq3_scale`` multiplies by N/(N-1), the paper's
    1/(N-1)^2 sum over ordered pairs. Keeps its gradient. 0 for a one-class episode."""
    ways = onehot.shape[1]
    if ways < 2:
        return embeddings.sum() * 0.0
    means = class_means(embeddings, onehot)
    i, j = torch.triu_indices(ways, ways, 1, device=embeddings.device)
    pairs = safe_sqrt((means[i] - means[j]).pow(2).sum(-1))
    return pairs.mean() * (ways / (ways - 1) if eq3_scale else 1.0)


def centroid_triplet(embeddings: torch.Tensor, onehot: torch.Tensor, margin: torch.Tensor,
                     squared: bool = True, negative_from: str = "anchor", reduction: str = "mean") -> torch.Tensor:
    """L_T (Eq. 4), one triplet group per class c: anchor a_c (the class mean), positives all rows
    of c, negatives all rows of the other classes; hinge max(0, m + d(a_c, p) - d(a_c, n)).

    ``negative_from="positive"``: the paper's d(p, n) instead of the code's d(a_c, n).
    ``reduction``: ``mean`` over (p, n) pairs, then over classes (the code); ``sum`` over all
    (the paper). Distances squared (the code) or Euclidean. 0 for a one-class episode."""
    ways = onehot.shape[1]
    if ways < 2:
        return embeddings.sum() * 0.0
    anchors = class_means(embeddings, onehot)
    to_anchor = distances(anchors, embeddings, squared)  # [N, M]: d(a_c, x)
    if negative_from == "anchor":
        negative = to_anchor.unsqueeze(1)  # [N, 1, M]: d(a_c, n)
    else:
        negative = distances(embeddings, embeddings, squared).unsqueeze(0)  # [1, M, M]: d(p, n)
    hinge = F.relu(margin + to_anchor.unsqueeze(2) - negative)  # [N, M(p), M(n)]
    positive = onehot.T  # [N, M]
    pair_mask = positive.unsqueeze(2) * (1 - positive).unsqueeze(1)
    per_class = (hinge * pair_mask).sum((1, 2))
    if reduction == "sum":
        return per_class.sum()
    pairs = positive.sum(1) * (1 - positive).sum(1)
    return (per_class / pairs).mean()
