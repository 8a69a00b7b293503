"""FedL2P's meta-augmentation (``meta_augment``, the code's ``jit_augment``): ONE crop offset and
flip (or flip and rotation) drawn per batch and shared by all its images, applied to the normalized
batch with the padding black before Normalize."""
from __future__ import annotations

import torch

from pfl_core.data.augment.crop_flip import CropFlip, crop_flip, draw_crop_flip
from pfl_core.data.augment.flip_rotate import FlipRotate, draw_flip_rotate, flip_rotate


def draw_shared(kind: str, count: int, generator: torch.Generator, padding: int) -> dict[str, torch.Tensor]:
    """``count`` shared draws of ``kind`` (``crop_flip``: ``top``, ``left``, ``flip``;
    ``flip_rotate``: ``flip``, ``angle``), one per batch, from ``generator``."""
    if kind == "flip_rotate":
        return dict(zip(("flip", "angle"), draw_flip_rotate(count, generator)))
    return dict(zip(("top", "left", "flip"), draw_crop_flip(count, generator, padding=padding)))


def augment_batch(x: torch.Tensor, draws: dict | None, i: int, pad: torch.Tensor, padding: int) -> torch.Tensor:
    """Batch ``x`` (normalized) cropped and flipped with draw ``i`` of ``draws`` shared by all its
    images; ``pad`` is the normalized image of zeros, so the padding is black before Normalize, as
    in the code (exact for per-channel normalization). ``draws`` None: ``x`` unchanged."""
    if draws is None:
        return x
    n = x.shape[0]
    if "angle" in draws:  # flip + rotation (Office, DomainNet): the zero fill is black before Normalize too
        return flip_rotate(x - pad, FlipRotate(*(draws[k][i].expand(n) for k in ("flip", "angle")))) + pad
    shared = CropFlip(*(draws[k][i].expand(n) for k in ("top", "left", "flip")))
    return crop_flip(x - pad, shared, padding) + pad
