"""Per-client batch streams drawn by indexing resident tensors (no DataLoader in the loop).

The default order reproduces the CAFeMe code's FedLab ``SubsetSampler(shuffle=True)``: a client's
indices are shuffled **once** and then iterated in that fixed order every epoch
(docs/papers/cafeme.md). ``reshuffle=True`` draws a fresh permutation at every epoch instead.
"""
from __future__ import annotations

from typing import Iterator

import torch


def balanced_weights(labels: torch.Tensor) -> torch.Tensor:
    """Per-sample weights n / count(class of the sample), float64 on the CPU: the FedL2P code's
    class-balanced sampler of Speech Commands training loaders (``get_balanced_sampler``,
    ``src/data/speech_commands.py`` L121-142)."""
    labels = labels.cpu()
    return labels.numel() / torch.bincount(labels)[labels].double()


def epoch_order(index: torch.Tensor, generator: torch.Generator, weights: torch.Tensor | None = None) -> torch.Tensor:
    """One epoch's order of ``index``: a permutation, or with ``weights`` len(index) draws with
    replacement in proportion to them (``WeightedRandomSampler(w, len(w))``, which draws with
    ``torch.multinomial(w, len(w), replacement=True)``)."""
    if weights is None:
        draw = torch.randperm(index.numel(), generator=generator)
    else:
        draw = torch.multinomial(weights, index.numel(), replacement=True, generator=generator)
    return index[draw.to(index.device)]


class BatchStream:
    """Batches of one client split: a cyclic ``next()`` iterator and fresh full passes.

    Args:
        index: int64 indices of the split into the dataset.
        batch_size: batch size B.
        generator: the stream's own RNG (derived from the run seed and client id).
        reshuffle: draw a new permutation every epoch (else shuffle once, fixed order).
        drop_last: drop the last incomplete batch. Ignored when the split holds fewer than B
            samples, where it would leave no batch at all (the CAFeMe code's crash; see
            docs/papers/cafeme.md): such a split yields one short batch, and ``short`` is True.
        weights: per-sample weights of ``index`` (:func:`balanced_weights`): every order is drawn
            with replacement in proportion to them (:func:`epoch_order`); None: permutations.
    """

    def __init__(
        self,
        index: torch.Tensor,
        batch_size: int,
        generator: torch.Generator,
        reshuffle: bool = False,
        drop_last: bool = True,
        weights: torch.Tensor | None = None,
    ):
        if index.numel() == 0:
            raise ValueError("a batch stream needs at least one sample")
        self.index = index
        self.batch_size = int(batch_size)
        self.generator = generator
        self.reshuffle = reshuffle
        self.weights = weights
        self.short = index.numel() < self.batch_size
        self.drop_last = drop_last and not self.short
        self._reorder()
        self._cursor = 0

    def _permutation(self) -> torch.Tensor:
        return epoch_order(self.index, self.generator, self.weights)

    def _reorder(self) -> None:
        """Draw a new order and cut it into batches once (not at every ``next()``)."""
        chunks = list(torch.split(self._permutation(), self.batch_size))
        if self.drop_last and chunks[-1].numel() < self.batch_size:
            chunks.pop()
        self._batches = chunks

    @property
    def batches_per_epoch(self) -> int:
        n, b = self.index.numel(), self.batch_size
        return n // b if self.drop_last else -(-n // b)

    def epoch(self) -> list[torch.Tensor]:
        """One full pass from the start of the order (a new ``for batch in loader`` loop)."""
        if self.reshuffle:
            self._reorder()
        return list(self._batches)

    def fresh_batch(self) -> torch.Tensor:
        """The first batch of a fresh permutation, leaving the cyclic order alone: a new
        ``next(iter(loader))`` of a shuffling DataLoader (the pFedHN code's inner steps)."""
        return self._permutation()[: self.batch_size]

    def next(self) -> torch.Tensor:
        """The next batch of the cyclic iterator; restarts (reshuffled if asked) when exhausted."""
        if self._cursor >= len(self._batches):
            if self.reshuffle:
                self._reorder()
            self._cursor = 0
        batch = self._batches[self._cursor]
        self._cursor += 1
        return batch


def cycled_batches(index: torch.Tensor, batch_size: int, generator: torch.Generator,
                   weights: torch.Tensor | None = None) -> Iterator[torch.Tensor]:
    """A shuffling DataLoader (no drop_last) cycled for ever: a fresh permutation each epoch
    (the FedL2P code's ``cycle(loader)``, re-iterating the loader), or with ``weights`` a fresh
    class-balanced draw with replacement (``data.balanced_sampler``, :func:`epoch_order`)."""
    while True:
        yield from torch.split(epoch_order(index, generator, weights), batch_size)
