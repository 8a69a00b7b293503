"""Per-sample augmentation of training batches in the engine (``data.augment``).

FedL2P pretrains with the CIFAR-10 training transform RandomCrop(32, padding 4) +
RandomHorizontalFlip, then Normalize, drawn per image by the DataLoader (docs/papers/fedl2p.md;
``cifar10Transformation(augment=True)``). Here the random part is drawn on the host,
after a method's :meth:`~pfl_core.algorithms.base.Algorithm.draw`: for each of the method's
``train_streams`` in plan order, each batch in order, one crop offset and one flip per image
(:func:`pfl_core.data.augment.crop_flip.draw_crop_flip`) from the client's own generator (stream ``augment``,
seeded by run seed and client). :func:`pfl_core.engine.plans.gather` then crops and flips the
[0, 1] images and normalises them (:func:`pfl_core.data.augment.crop_flip.crop_flip`), so the sequential and the
batched path train on identical images. Evaluation batches are never augmented here.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from pfl_core.data.augment.crop_flip import CropFlip, draw_crop_flip
from pfl_core.engine.plans import CROP_PADDING, Plan

#: ``data.augment`` values: none, or per-sample RandomCrop(H x W, padding 4) + horizontal flip
AUGMENTATIONS = ("none", "crop_flip")

Draws = dict[str, list[CropFlip]]


@dataclass
class TrainAugment:
    """A client's per-sample augmentation of its training batches: the generator of its draws."""

    generator: torch.Generator

    def draw(self, n: int) -> CropFlip:
        return draw_crop_flip(n, self.generator, padding=CROP_PADDING)


def make_train_augment(augment: str, generator_factory) -> TrainAugment | None:
    """The client's :class:`TrainAugment` for ``data.augment`` (None for ``none``);
    ``generator_factory()`` makes the client's generator (only called when augmenting)."""
    if augment not in AUGMENTATIONS:
        raise ValueError(f"data.augment must be one of {AUGMENTATIONS}, got {augment!r}")
    return None if augment == "none" else TrainAugment(generator_factory())


def check_augmentable(augment: str, input_shape: tuple[int, ...], algorithm) -> None:
    """Reject ``data.augment`` where it cannot apply: inputs that are not images, or a method that
    does not name its training streams (``train_streams``)."""
    if augment == "none":
        return
    if len(input_shape) != 3:
        raise ValueError(f"data.augment {augment!r} crops and flips images (C, H, W); this dataset's inputs "
                         f"are {tuple(input_shape)}: set data.augment: none")
    if not algorithm.train_streams:
        raise ValueError(f"data.augment {augment!r}: method {type(algorithm).__name__} does not say which of "
                         "its batch streams are training batches (train_streams), so none would be "
                         "augmented: set data.augment: none")


def augment_draws(algorithm, client, plan: Plan) -> Draws | None:
    """The crop/flip draws of ``plan``'s training streams (``algorithm.train_streams``, an
    :class:`~pfl_core.algorithms.base.Algorithm`), in plan order, from the generator of ``client``
    (a :class:`~pfl_core.algorithms.base.ClientContext`); None when its batches are not augmented."""
    if client.augment is None:
        return None
    return {name: [client.augment.draw(int(index.numel())) for index in batches]
            for name, batches in plan.items() if name in algorithm.train_streams}
