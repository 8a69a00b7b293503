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


# -- Polya-Gamma augmented binary GP classification (pFedGP's ``tree_pg`` nodes) -------------------
# These run on the host path only (pFedGP's tree head is sequential): the Gibbs sampler draws from a
# ``torch.Generator`` that the method seeds from the client's own stream.

GAUSS_HERMITE_LOCATIONS = 20
"""Quadrature points of E_q[log sigmoid(f)] (gpytorch ``GaussHermiteQuadrature1D`` default)."""


def gauss_hermite_expectation(fn, mean: torch.Tensor, var: torch.Tensor,
                              num_locs: int = GAUSS_HERMITE_LOCATIONS) -> torch.Tensor:
    """E_{f ~ N(mean, var)}[fn(f)] elementwise by Gauss-Hermite quadrature:
    sum_i w_i fn(sqrt(2 var) x_i + mean) / sqrt(pi)."""
    import numpy as np

    locs, weights = (torch.as_tensor(a, dtype=mean.dtype, device=mean.device)
                     for a in np.polynomial.hermite.hermgauss(num_locs))
    shifted = torch.sqrt(2.0 * var).unsqueeze(-1) * locs + mean.unsqueeze(-1)
    return (fn(shifted) * weights).sum(-1) / math.sqrt(math.pi)


def polya_gamma_mean(c: torch.Tensor) -> torch.Tensor:
    """E[PG(1, c)] = tanh(c / 2) / (2 c) (1/4 at c = 0)."""
    small = c.abs() < 1e-6
    safe = torch.where(small, torch.ones_like(c), c)
    return torch.where(small, torch.full_like(c, 0.25), torch.tanh(safe / 2) / (2 * safe))


def sample_polya_gamma(c: torch.Tensor, generator: torch.Generator, terms: int) -> torch.Tensor:
    """Draws of PG(1, c) elementwise by the truncated sum-of-gammas representation
    (Polson, Scott & Windle 2013, Eq. 1): omega = 1/(2 pi^2) sum_k g_k / ((k - 1/2)^2 + c^2/(4 pi^2)),
    g_k ~ Exp(1), cut at ``terms`` and completed by the tail's expectation, so that E[omega] is
    exact. (The pFedGP code draws exact samples with ``pypolyagamma``.)"""
    k = torch.arange(1, terms + 1, dtype=c.dtype, device=c.device)
    denom = (k - 0.5) ** 2 + (c.unsqueeze(-1) / (2 * math.pi)) ** 2
    gammas = torch.empty(denom.shape, dtype=c.dtype).exponential_(generator=generator).to(c.device)
    head = (gammas / denom).sum(-1) / (2 * math.pi ** 2)
    tail = polya_gamma_mean(c) - (1.0 / denom).sum(-1) / (2 * math.pi ** 2)
    return head + tail.clamp_min(0.0)


def safe_cholesky(a: torch.Tensor, tries: int = 4) -> torch.Tensor:
    """Cholesky factor of ``a``, adding 1e-6 (float64: 1e-8) x 10^t to the diagonal when it is
    only positive semi-definite numerically (the pFedGP code's ``psd_safe_cholesky``)."""
    chol, info = torch.linalg.cholesky_ex(a)
    jitter = 1e-8 if a.dtype == torch.float64 else 1e-6
    eye = torch.eye(a.shape[-1], dtype=a.dtype, device=a.device)
    for _ in range(tries):
        if not bool((info > 0).any()):
            return chol
        chol, info = torch.linalg.cholesky_ex(a + jitter * eye)
        jitter *= 10
    if bool((info > 0).any()):
        raise ValueError("safe_cholesky: the matrix is not positive definite even with jitter")
    return chol


def pg_gibbs(k_train: torch.Tensor, kappa: torch.Tensor, draws: int, steps: int, generator: torch.Generator,
             terms: int) -> torch.Tensor:
    """Final Polya-Gamma variables omega [draws, N] of ``draws`` parallel Gibbs chains of ``steps``
    sweeps for a zero-mean GP with prior covariance ``k_train`` and kappa = y - 1/2 (the pFedGP
    code's ``gibbs_sample``): f from the prior, omega | f ~ PG(1, f), then ``steps`` times
    f | omega ~ N(Sigma kappa, Sigma) with Sigma = K - K (K + Omega^-1)^-1 K, omega | f. No gradient
    flows through omega (the code draws it in numpy)."""
    with torch.no_grad():
        n = k_train.shape[-1]
        noise = torch.randn((draws, n, 1), generator=generator, dtype=k_train.dtype).to(k_train.device)
        f = (safe_cholesky(k_train) @ noise).squeeze(-1)
        omega = sample_polya_gamma(f, generator, terms)
        for _ in range(steps):
            chol_noisy = safe_cholesky(k_train + torch.diag_embed(1.0 / omega.clamp_min(1e-32)))
            sigma = k_train - k_train @ torch.cholesky_solve(k_train.expand(draws, n, n), chol_noisy)
            mean = (sigma @ kappa.unsqueeze(-1)).squeeze(-1)
            eps = torch.randn((draws, n, 1), generator=generator, dtype=k_train.dtype).to(k_train.device)
            f = mean + (safe_cholesky(sigma) @ eps).squeeze(-1)
            omega = sample_polya_gamma(f, generator, terms)
        return omega


def pg_posterior_factor(k_train: torch.Tensor, kappa: torch.Tensor, omega: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per Gibbs draw: the Cholesky factor of K + Omega^-1 [draws, N, N] and
    alpha = (K + Omega^-1)^-1 kappa / omega [draws, N, 1] (zero prior mean)."""
    omega = omega.clamp_min(1e-16)
    chol = safe_cholesky(k_train + torch.diag_embed(1.0 / omega))
    return chol, torch.cholesky_solve((kappa / omega).unsqueeze(-1), chol)


def pg_predict(k_cross: torch.Tensor, k_test_diag: torch.Tensor, chol: torch.Tensor, alpha: torch.Tensor) -> torch.Tensor:
    """P(y* = class 0) at M test points from :func:`pg_posterior_factor`: the mean over draws of
    exp(E_q[log sigmoid(f*)]), q = N(K_*^T alpha, k_** - diag(K_*^T (K + Omega^-1)^-1 K_*)) (the
    code's ``predictive_dist`` and Gauss-Hermite quadrature)."""
    mean = (k_cross.T @ alpha).squeeze(-1)  # [draws, M]
    solved = torch.cholesky_solve(k_cross.expand(chol.shape[0], *k_cross.shape), chol)
    var = k_test_diag - (k_cross * solved).sum(-2)
    return torch.exp(gauss_hermite_expectation(F.logsigmoid, mean, var.clamp_min(1e-12))).mean(0)


def pg_predictive_probs(k_all: torch.Tensor, n: int, kappa: torch.Tensor, omega: torch.Tensor) -> torch.Tensor:
    """:func:`pg_predict` from the joint kernel ``k_all`` over N train then M test points
    (differentiable in it; ``omega`` enters as a constant, as in the code)."""
    chol, alpha = pg_posterior_factor(k_all[:n, :n], kappa, omega)
    return pg_predict(k_all[:n, n:], torch.diagonal(k_all[n:, n:]), chol, alpha)
