"""Office-Caltech-10 / DomainNet augmentation as host-side draws plus a pure tensor function
(fedl2p.md, "Office-Caltech-10": RandomHorizontalFlip + RandomRotation(+-30 degrees)).

The same draw/apply shape as :mod:`pfl_core.data.augment.crop_flip` (CIFAR's crop/flip): :func:`draw_flip_rotate`
draws on the host from a ``torch.Generator``, per sample (the evaluation's per-sample DataLoader
transforms) or ``shared`` by the whole batch (the code's ``jit_augment``, an ``nn.Sequential`` of the
two transforms applied to a batch tensor during meta-training); :func:`flip_rotate` applies them,
pure tensor code that runs under ``torch.func.vmap``. Apply it to un-normalised [0, 1] images
(``ArrayDataset.raw_batch``) and normalise after, as the code's transforms do (rotation fills the
corners with black before Normalize).

The rotation is torchvision's ``rotate(img, angle)`` for tensors (nearest interpolation, no
expand, about the image centre, zero fill, positive angles counter-clockwise): the same inverse
affine grid sampled by ``grid_sample``, for every image at its own angle in one call.
"""
from __future__ import annotations

from typing import NamedTuple

import torch
import torch.nn.functional as F


class FlipRotate(NamedTuple):
    """The random part of RandomHorizontalFlip + RandomRotation for n images (tensors of length n)."""

    flip: torch.Tensor
    """bool: mirror the image left-right (before the rotation)."""
    angle: torch.Tensor
    """float degrees, U(-degrees, degrees); positive is counter-clockwise."""


def draw_flip_rotate(n: int, generator: torch.Generator, *, shared: bool = False,
                     degrees: float = 30.0) -> FlipRotate:
    """Draw flips and angles for ``n`` images on the CPU from ``generator``: one per image, or with
    ``shared`` one for the whole batch repeated n times (the code's meta-training batches)."""
    count = 1 if shared else n
    flip = torch.rand(count, generator=generator) < 0.5
    angle = torch.empty(count).uniform_(-degrees, degrees, generator=generator)
    if shared:
        flip, angle = flip.expand(n), angle.expand(n)
    return FlipRotate(flip.contiguous(), angle.contiguous())


def rotation_grid(angle: torch.Tensor, height: int, width: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """torchvision's sampling grid (n, H, W, 2) of a rotation by ``angle`` degrees about the centre:
    its inverse affine matrix (computed in double, then in ``dtype`` as torchvision casts it) applied
    to the pixel-centre base grid, rescaled to [-1, 1]."""
    rot = torch.deg2rad(-angle.to(torch.float64))
    cos, sin, zero = torch.cos(rot), torch.sin(rot), torch.zeros_like(rot)
    theta = torch.stack([torch.stack([cos, sin, zero], -1), torch.stack([-sin, cos, zero], -1)], 1).to(dtype)
    device = angle.device
    xs = torch.linspace(-width * 0.5 + 0.5, width * 0.5 - 0.5, width, dtype=dtype, device=device)
    ys = torch.linspace(-height * 0.5 + 0.5, height * 0.5 - 0.5, height, dtype=dtype, device=device)
    base = torch.stack([xs.expand(height, width), ys[:, None].expand(height, width),
                        torch.ones(height, width, dtype=dtype, device=device)], -1).reshape(1, height * width, 3)
    scaled = theta.transpose(1, 2) / torch.tensor([0.5 * width, 0.5 * height], dtype=dtype, device=device)
    return torch.bmm(base.expand(len(angle), -1, -1), scaled).reshape(-1, height, width, 2)


def flip_rotate(x: torch.Tensor, draws: FlipRotate) -> torch.Tensor:
    """RandomHorizontalFlip then RandomRotation of ``x`` [n, C, H, W] with the given draws."""
    flip, angle = (t.to(x.device) for t in draws)
    flipped = torch.where(flip[:, None, None, None], x.flip(-1), x)
    grid = rotation_grid(angle, x.shape[2], x.shape[3], x.dtype)
    return F.grid_sample(flipped, grid, mode="nearest", padding_mode="zeros", align_corners=False)

