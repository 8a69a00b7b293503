"""Offline datasets: generated or bundled with an installed package, never downloaded.

They are *not* the benchmark datasets of the papers (except Synthetic, which is generated exactly as
in the pFedMe code) and are marked ``offline=True`` so reports can say so.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F

from pfl_core.fields import NonNegativeFloat, NonNegativeInt, PositiveInt
from pfl_core.data.federated import ArrayDataset


@dataclass
class SyntheticDraws:
    """Everything drawn by :func:`synthetic_draws`: samples and per-user parameters."""

    x: np.ndarray  # (N, D) float64, users concatenated in order
    y: np.ndarray  # (N,) int64
    sizes: np.ndarray  # n_k per user
    u: np.ndarray  # mean of W_k and b_k per user
    b_mean: np.ndarray  # B_k, mean of v_k per user
    v: np.ndarray  # (U, D) mean of X_k
    w: np.ndarray  # (U, D, C)
    b: np.ndarray  # (U, C)


def synthetic_draws(
    alpha: float = 0.5,
    beta: float = 0.5,
    num_users: int = 100,
    num_features: int = 60,
    num_classes: int = 10,
    seed: int = 0,
) -> SyntheticDraws:
    """FedProx/pFedMe Synthetic(alpha, beta) (cgpfl.md, "pFedMe Synthetic(α=0.5, β=0.5)").

    One legacy ``RandomState(seed)``, draws in this order: sizes n_k = (floor(LogNormal(4, 2)) + 50)*5;
    u_k ~ N(0, alpha); B_k ~ N(0, beta); v_k ~ N(B_k, 1)^D for all users; then per user
    W_k ~ N(u_k, 1)^{D x C}, b_k ~ N(u_k, 1)^C, X_k ~ N(v_k, diag(j^-1.2)), y = argmax(X_k W_k + b_k).
    alpha and beta are standard deviations, as in the FedProx/pFedMe code.
    """
    rs = np.random.RandomState(seed)
    sizes = (rs.lognormal(4, 2, num_users).astype(np.int64) + 50) * 5
    u = rs.normal(0, alpha, num_users)
    b_mean = rs.normal(0, beta, num_users)
    v = np.stack([rs.normal(b_mean[k], 1, num_features) for k in range(num_users)])
    cov = np.diag(np.arange(1, num_features + 1, dtype=np.float64) ** -1.2)
    xs, ys, ws, bs = [], [], [], []
    for k in range(num_users):
        ws.append(rs.normal(u[k], 1, (num_features, num_classes)))
        bs.append(rs.normal(u[k], 1, num_classes))
        xs.append(rs.multivariate_normal(v[k], cov, sizes[k]))
        ys.append(np.argmax(xs[-1] @ ws[-1] + bs[-1], axis=1))
    return SyntheticDraws(
        x=np.concatenate(xs), y=np.concatenate(ys).astype(np.int64), sizes=sizes, u=u,
        b_mean=b_mean, v=v, w=np.stack(ws), b=np.stack(bs),
    )


def synthetic(
    alpha: NonNegativeFloat = 0.5,
    beta: NonNegativeFloat = 0.5,
    num_users: PositiveInt = 100,
    num_features: PositiveInt = 60,
    num_classes: PositiveInt = 10,
    seed: NonNegativeInt = 0,
) -> ArrayDataset:
    """Synthetic(alpha, beta) of :func:`synthetic_draws` as float32 features (N, D).

    ``groups`` holds the user id of every sample, so the natural partition gives one client per user.
    """
    draws = synthetic_draws(alpha, beta, num_users, num_features, num_classes, seed)
    return ArrayDataset(
        name="synthetic",
        x=torch.from_numpy(draws.x.astype(np.float32)),
        y=torch.from_numpy(draws.y),
        num_classes=num_classes,
        groups=torch.from_numpy(np.repeat(np.arange(num_users, dtype=np.int64), draws.sizes)),
        offline=True,
        description=(
            f"offline Synthetic(alpha={alpha}, beta={beta}) generated as in the pFedMe code "
            f"(seed {seed}, {num_users} users, {num_features} features, {num_classes} classes)"
        ),
    )


def digits28(size: PositiveInt = 28) -> ArrayDataset:
    """scikit-learn's bundled 8x8 digits (1,797 images, values 0..16) as uint8 1 x size x size.

    Values are scaled to 0..255, resized with bilinear interpolation (align_corners=False), rounded
    and clipped. This is NOT MNIST: it only lets CNN code paths run without any download.
    """
    from sklearn.datasets import load_digits  # imported here: scikit-learn is slow to import

    bunch = load_digits()
    images = torch.from_numpy(bunch.images.astype(np.float32) * (255.0 / 16.0)).unsqueeze(1)
    resized = F.interpolate(images, size=(size, size), mode="bilinear", align_corners=False)
    return ArrayDataset(
        name="digits28",
        x=resized.round().clamp(0, 255).to(torch.uint8),
        y=torch.from_numpy(bunch.target.astype(np.int64)),
        num_classes=10,
        offline=True,
        description=(
            f"offline scikit-learn 8x8 digits (1,797 images) upsampled to {size}x{size}; "
            "NOT MNIST, for offline smoke runs only"
        ),
    )
