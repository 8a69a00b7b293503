"""Exact Gaussian-process regression pieces for pFedGP's ``label_regression`` head.

Pure tensor functions (no host syncs, no branching on values), so they run under
``torch.func.vmap`` and differentiate through the features. The kernel follows the pFedGP code's
``GPModel``: inputs L2-normalised, ``outputscale * exp(-||a - b||^2 / (2 lengthscale^2))``
(gpytorch's ``ScaleKernel(RBFKernel)``). Each class is a GP regression of its one-hot column with
zero prior mean and Gaussian noise variance ``noise``.
"""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F


def rbf_kernel(a: torch.Tensor, b: torch.Tensor, outputscale: float, lengthscale: float) -> torch.Tensor:
    """[n, m] kernel between the rows of ``a`` [n, d] and ``b`` [m, d] after L2 normalisation.
    Squared distances by expansion (2 - 2 a.b on unit vectors, clamped at 0), so large client sets
    need no [n, m, d] difference tensor."""
    a, b = F.normalize(a, dim=-1), F.normalize(b, dim=-1)
    sq = (2.0 - 2.0 * a @ b.T).clamp_min(0.0)
    return outputscale * torch.exp(-0.5 * sq / lengthscale ** 2)


def one_hot_targets(y: torch.Tensor, num_classes: int, dtype: torch.dtype) -> torch.Tensor:
    """[n, num_classes] one-hot rows (by comparison, not ``F.one_hot``, which reads values: vmap)."""
    return (y.unsqueeze(-1) == torch.arange(num_classes, device=y.device)).to(dtype)


def posterior(k_train: torch.Tensor, k_cross: torch.Tensor, k_test_diag: torch.Tensor, targets: torch.Tensor,
              noise: float) -> tuple[torch.Tensor, torch.Tensor]:
    """GP regression posterior at test points: mean [m, C] = K_*^T (K + noise I)^-1 Y and latent
    variance [m] = k_** - diag(K_*^T (K + noise I)^-1 K_*), from K = ``k_train`` [n, n], K_* =
    ``k_cross`` [n, m], diag(k_**) = ``k_test_diag`` [m] and Y = ``targets`` [n, C]."""
    eye = torch.eye(k_train.shape[-1], dtype=k_train.dtype, device=k_train.device)
    chol = torch.linalg.cholesky(k_train + noise * eye)
    mean = k_cross.T @ torch.cholesky_solve(targets, chol)
    var = k_test_diag - (k_cross * torch.cholesky_solve(k_cross, chol)).sum(0)
    return mean, var


def predictive_nll(mean: torch.Tensor, var: torch.Tensor, targets: torch.Tensor, noise: float,
                   class_mask: torch.Tensor) -> torch.Tensor:
    """Mean over test points of -sum_c mask_c log N(y_c | mean_c, var + noise): the Gaussian
    predictive likelihood of held-out one-hot targets, over the classes in ``class_mask``."""
    var_y = (var + noise).unsqueeze(-1)
    log_density = -0.5 * ((targets - mean) ** 2 / var_y + torch.log(2 * math.pi * var_y))
    return -(log_density * class_mask).sum(-1).mean()


def marginal_nll(k_train: torch.Tensor, targets: torch.Tensor, noise: float, class_mask: torch.Tensor) -> torch.Tensor:
    """-sum_c mask_c log N(y_c | 0, K + noise I) divided by the number of points (the code's
    ``marginal_likelihood`` objective is averaged per sample too)."""
    n = k_train.shape[-1]
    eye = torch.eye(n, dtype=k_train.dtype, device=k_train.device)
    chol = torch.linalg.cholesky(k_train + noise * eye)
    alpha = torch.cholesky_solve(targets, chol)
    per_class = 0.5 * (targets * alpha).sum(0) + torch.log(torch.diagonal(chol)).sum() + 0.5 * n * math.log(2 * math.pi)
    return (per_class * class_mask).sum() / n
