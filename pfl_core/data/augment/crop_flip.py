"""CIFAR augmentation as host-side draws plus pure tensor functions (docs/papers/fedl2p.md).

The FedL2P code trains with RandomCrop(32, padding=4) + RandomHorizontalFlip + Normalize:

* per sample (:func:`draw_crop_flip` with ``shared=False``): each image its own crop offset and
  flip, as torchvision's transforms in a DataLoader do; the evaluation's fine-tuning and the
  pretraining use it;
* batch-shared (``shared=True``): ONE crop offset and ONE flip decision for the whole batch, as the
  code's ``jit_augment`` (the same transforms applied on the GPU to a batch tensor) does during
  meta-training.

Randomness is drawn on the host from a ``torch.Generator`` (:func:`draw_crop_flip`); the crop and
flip are applied by :func:`crop_flip`, pure tensor code (no ``.item()``, no branching on values), so
it runs under ``torch.func.vmap`` over stacked clients. Augment un-normalised [0, 1] images
(``ArrayDataset.raw_batch``), then :func:`normalize`: the code pads with black before Normalize.
The draws do not reproduce torchvision's consumption of the global RNG (a DataLoader's workers draw
per item); only the distribution of offsets and flips is the code's.
"""
from __future__ import annotations

from typing import NamedTuple, Sequence

import torch
import torch.nn.functional as F

FEDL2P_CIFAR_MEAN = (0.4914, 0.4822, 0.4465)
FEDL2P_CIFAR_STD = (0.2023, 0.1994, 0.2010)
"""Normalize constants of the FedL2P code's CIFAR-10 / CIFAR-10-C transforms."""


class CropFlip(NamedTuple):
    """The random part of RandomCrop + RandomHorizontalFlip for n images (tensors of length n)."""

    top: torch.Tensor
    """int64 row offset of the crop in the padded image, in [0, 2 * padding]."""
    left: torch.Tensor
    """int64 column offset, in [0, 2 * padding]."""
    flip: torch.Tensor
    """bool: mirror the cropped image left-right."""


def draw_crop_flip(n: int, generator: torch.Generator, *, shared: bool = False, padding: int = 4) -> CropFlip:
    """Draw crop offsets and flips for ``n`` images on the CPU from ``generator``: one per image, or
    with ``shared`` one for the whole batch repeated n times (the code's meta-training batches)."""
    count = 1 if shared else n
    top = torch.randint(0, 2 * padding + 1, (count,), generator=generator)
    left = torch.randint(0, 2 * padding + 1, (count,), generator=generator)
    flip = torch.rand(count, generator=generator) < 0.5
    if shared:
        top, left, flip = top.expand(n), left.expand(n), flip.expand(n)
    return CropFlip(top.contiguous(), left.contiguous(), flip.contiguous())


def stack_draws(draws: Sequence[CropFlip]) -> CropFlip:
    """Several clients' draws (each of n images) stacked to [clients, n], for a vmapped apply; any
    tuple of tensors of one type (:class:`CropFlip`, ``pfl_core.data.audio.SpeechDraws``)."""
    return type(draws[0])(*(torch.stack(field) for field in zip(*draws)))


def crop_flip(x: torch.Tensor, draws: CropFlip, padding: int = 4) -> torch.Tensor:
    """RandomCrop(H x W, padding, fill 0) then RandomHorizontalFlip of ``x`` [n, C, H, W] with the
    given draws: zero-pad, then gather the crop rows and the (mirrored where ``flip``) columns."""
    n, channels, height, width = x.shape
    padded = F.pad(x, (padding, padding, padding, padding))
    top, left, flip = (t.to(x.device) for t in draws)
    rows = top[:, None] + torch.arange(height, device=x.device)
    steps = torch.arange(width, device=x.device)
    cols = left[:, None] + torch.where(flip[:, None], width - 1 - steps, steps)
    rows = rows[:, None, :, None].expand(n, channels, height, padded.shape[3])
    picked = torch.gather(padded, 2, rows)
    cols = cols[:, None, None, :].expand(n, channels, height, width)
    return torch.gather(picked, 3, cols)


def normalize(x: torch.Tensor, mean: Sequence[float] | torch.Tensor, std: Sequence[float] | torch.Tensor) -> torch.Tensor:
    """Per-channel (x - mean) / std of ``x`` [..., C, H, W] (torchvision's Normalize)."""
    shape = (-1, 1, 1)
    mean = torch.as_tensor(mean, dtype=x.dtype, device=x.device).view(shape)
    std = torch.as_tensor(std, dtype=x.dtype, device=x.device).view(shape)
    return (x - mean) / std


def augment(x: torch.Tensor, draws: CropFlip, mean: Sequence[float] | torch.Tensor = FEDL2P_CIFAR_MEAN,
            std: Sequence[float] | torch.Tensor = FEDL2P_CIFAR_STD, padding: int = 4) -> torch.Tensor:
    """The code's training transform on un-normalised [0, 1] images: crop, flip, then Normalize."""
    return normalize(crop_flip(x, draws, padding), mean, std)
