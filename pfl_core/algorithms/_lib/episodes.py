"""Few-shot training episodes drawn from one client's train split, host side
(docs/papers/metavers.md; the authors' ``trainer.py`` with learn2learn's ``NWays``/``KShots`` and
``util.meta_update``).

An episode is two index tensors into the dataset, both in class blocks: ``support`` holds K
images of each of its N classes (N = the client's classes), ``query`` the rest of each class.
Classes come in a random order (the code's label permutation, then the sort by label), images
in a random order within each class; the first K of a class are its support.

* **Regular episode**: K+Q images of every class, drawn without replacement.
* **Fallback ("R*")**: when a class has fewer than K+Q images (learn2learn's ``KShots`` raises,
  ``trainer.py:320-323``), or always with ``full_batch`` (CIFAR-100 with 500 clients,
  ``trainer.py:316-317``): one shuffled batch of up to ``batch_size`` (450) train images; if it
  holds more than (K+Q)N images, the first K+Q of each class are kept, else all of them. A class
  with fewer than K images there would make the code read uninitialised support rows; it is left
  out of the episode instead (documented here, never hit by the paper's settings).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class Episode:
    """Index tensors (on the dataset's device) of one episode, and whether it fell back."""

    support: torch.Tensor
    query: torch.Tensor
    ways: int
    fallback: bool


def class_pools(labels: torch.Tensor, index: torch.Tensor) -> list[torch.Tensor]:
    """The client's train indices grouped by class (ascending label), on the host:
    ``labels`` are the labels of ``index`` (both any device)."""
    labels, index = labels.cpu(), index.cpu()
    return [index[labels == c] for c in labels.unique().tolist()]


def draw_episode(pools: list[torch.Tensor], shot: int, query: int, generator: torch.Generator,
                 batch_size: int = 450, full_batch: bool = False, where: str = "") -> Episode:
    """One episode of ``shot`` support and ``query`` query images per class (module docstring)."""
    bound = shot + query
    ways = len(pools)
    fallback = full_batch or min(len(p) for p in pools) < bound
    order = torch.randperm(ways, generator=generator).tolist()  # the code's remapped labels
    if fallback:
        blocks = _fallback_blocks(pools, bound, batch_size, generator)
    else:
        blocks = [p[torch.randperm(len(p), generator=generator)[:bound]] for p in pools]
    blocks = [blocks[c] for c in order if len(blocks[c]) >= shot]
    support = torch.cat([b[:shot] for b in blocks]) if blocks else torch.empty(0, dtype=torch.long)
    rest = torch.cat([b[shot:] for b in blocks]) if blocks else torch.empty(0, dtype=torch.long)
    if not blocks or rest.numel() == 0:
        raise ValueError(f"{where}no episode with shot={shot}: the client's train classes have "
                         f"{[len(p) for p in pools]} images; lower method.params.shot")
    return Episode(support, rest, len(blocks), fallback)


def _fallback_blocks(pools: list[torch.Tensor], bound: int, batch_size: int,
                     generator: torch.Generator) -> list[torch.Tensor]:
    """Per class (ascending label), its images in one shuffled batch of the client's train split
    (``next(iter(loader))`` with ``shuffle=True``), cut to the first ``bound`` of each class when
    the batch holds more than ``bound * len(pools)`` images."""
    everything = torch.cat(pools)
    labels = torch.cat([torch.full((len(p),), c) for c, p in enumerate(pools)])
    batch = torch.randperm(len(everything), generator=generator)[:batch_size]
    keep_all = len(batch) <= bound * len(pools)
    blocks = []
    for c in range(len(pools)):
        rows = batch[labels[batch] == c]
        blocks.append(everything[rows if keep_all else rows[:bound]])
    return blocks
