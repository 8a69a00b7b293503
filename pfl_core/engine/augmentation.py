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

``speech`` (Speech Commands): the FedL2P code's ``PartitionedSPEECHCOMMANDS.__getitem__`` applies a
time shift and a background-noise blend to every item of a training split
(``src/data/speech_commands.py`` L263-265, :class:`pfl_core.data.audio.SpeechAugment`), in stage 1
and in meta-training alike. Its draws (:class:`~pfl_core.data.audio.SpeechDraws`, one per clip)
come from a numpy generator seeded by the client's ``augment`` generator, one seed per batch; the
augmented clips then become fbank images (``ArrayDataset.to_inputs``).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

import numpy as np

from pfl_core.data.audio import SpeechAugment, SpeechDraws
from pfl_core.data.augment.crop_flip import CropFlip, draw_crop_flip
from pfl_core.engine.plans import CROP_PADDING, Plan

#: ``data.augment`` values: none, per-sample RandomCrop(H x W, padding 4) + horizontal flip, or the
#: Speech Commands time shift + background noise (module docstring)
AUGMENTATIONS = ("none", "crop_flip", "speech")

Draws = dict[str, list[CropFlip | SpeechDraws]]


@dataclass
class TrainAugment:
    """A client's per-sample augmentation of its training batches: the generator of its draws and,
    for ``speech``, the dataset's :class:`~pfl_core.data.audio.SpeechAugment`."""

    generator: torch.Generator
    speech: SpeechAugment | None = None

    def draw(self, n: int) -> CropFlip | SpeechDraws:
        if self.speech is None:
            return draw_crop_flip(n, self.generator, padding=CROP_PADDING)
        seed = int(torch.randint(0, 2**62, (1,), generator=self.generator))
        return self.speech.draw(n, np.random.default_rng(seed))


def make_train_augment(augment: str, generator_factory, dataset=None) -> TrainAugment | None:
    """The client's :class:`TrainAugment` for ``data.augment`` (None for ``none``);
    ``generator_factory()`` makes the client's generator (only called when augmenting);
    ``dataset`` (``speech``) holds the background noise in its ``extras``."""
    if augment not in AUGMENTATIONS:
        raise ValueError(f"data.augment must be one of {AUGMENTATIONS}, got {augment!r}")
    if augment == "none":
        return None
    speech = SpeechAugment(dataset.extras["noise"], dataset.extras["noise_lengths"]) if augment == "speech" else None
    return TrainAugment(generator_factory(), speech)


def check_augmentable(augment: str, input_shape: tuple[int, ...], algorithm, dataset=None) -> None:
    """Reject ``data.augment`` where it cannot apply: ``crop_flip`` on inputs that are not stored
    images (Speech Commands' rows are clips: flipping their fbank image would reverse the mel
    axis), ``speech`` on a dataset without background noise, or a method that does not name its
    training streams (``train_streams``)."""
    if augment == "none":
        return
    stored_images = dataset is None or dataset.inputs is None
    if augment == "speech" and (dataset is None or "noise" not in dataset.extras):
        raise ValueError("data.augment 'speech' shifts clips and blends them with background noise: this dataset "
                         f"({getattr(dataset, 'name', None)!r}) has none (speech_commands only)")
    if augment == "crop_flip" and not stored_images:
        raise ValueError(f"data.augment 'crop_flip' crops and flips stored images; dataset {dataset.name!r} stores "
                         "rows that become inputs later (audio clips): use data.augment: speech or none")
    if augment == "crop_flip" and len(input_shape) != 3:
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
