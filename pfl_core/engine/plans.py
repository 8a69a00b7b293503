"""Batch plans: the index batches a client consumes in a round, drawn on the host before any compute.

A method's :meth:`~pfl_core.engine.contract.ClientProgram.draw` returns ``{stream name: [index batch,
...]}`` in the order the sequential code consumed them (or a :class:`Drawn`, the plan with the
round's other draws), so both execution paths use exactly the same batches and the same random
numbers. The engine groups clients whose plans have the same
shape into buckets, pads a bucket's step counts where the method allows it (with a mask), and
gathers every batch of every client of a bucket with one indexing of the resident dataset.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from pfl_core.data.audio import SpeechAugment, SpeechDraws
from pfl_core.data.augment.crop_flip import CropFlip, crop_flip, stack_draws
from pfl_core.data.federated import ArrayDataset

#: RandomCrop's padding of the FedL2P CIFAR-10 training transform (data.augment crop_flip)
CROP_PADDING = 4

Plan = dict[str, list[torch.Tensor]]


@dataclass
class Drawn:
    """What a :meth:`~pfl_core.engine.contract.ClientProgram.draw` returns when it draws more than
    index batches: the ``plan``, and ``values``, its other host-side draws of the round (an
    episode, augmentation parameters, seeds), which the engine hands to ``carry_in``. A method
    that draws only index batches returns the plan itself."""

    plan: Plan
    values: dict


def split_draw(drawn: Plan | Drawn) -> tuple[Plan, dict]:
    """(plan, values) of a ``draw`` result; a bare plan has no values."""
    return (drawn.plan, drawn.values) if isinstance(drawn, Drawn) else (drawn, {})


def batch_sizes(plan: Plan) -> dict[str, tuple[int, ...]]:
    return {name: tuple(int(b.numel()) for b in batches) for name, batches in plan.items()}


def uniform_size(sizes: tuple[int, ...]) -> int | None:
    """The common batch size of a stream, or None when its batches differ in size."""
    return sizes[0] if sizes and all(s == sizes[0] for s in sizes) else None


@dataclass
class Bucket:
    """Clients (positions in the round's list) run together, with per-stream step counts."""

    members: list[int]
    steps: dict[str, int]
    """Padded number of batches per stream."""
    padded: frozenset[str] = frozenset()
    """Streams whose step counts differ within the bucket (masked)."""


def make_buckets(plans: list[Plan], maskable: tuple[str, ...], pad_tolerance: float) -> list[Bucket]:
    """Group clients with identical plan shapes; with ``pad_tolerance`` > 0, also clients whose
    ``maskable`` streams differ only in their number of batches, as long as the padded work stays
    within ``(1 + pad_tolerance)`` of the real work of the bucket."""
    exact: dict[tuple, list[int]] = {}
    for i, plan in enumerate(plans):
        sizes = batch_sizes(plan)
        key = tuple(sorted(
            (name, ("pad", uniform_size(s)) if name in maskable and uniform_size(s) and pad_tolerance > 0 else s)
            for name, s in sizes.items()))
        exact.setdefault(key, []).append(i)
    buckets = []
    for members in exact.values():
        counts = [{name: len(b) for name, b in plans[i].items()} for i in members]
        order = sorted(range(len(members)), key=lambda j: -sum(counts[j].values()))
        current: list[int] = []
        for j in order:
            trial = current + [j]
            padded = len(trial) * sum(max(counts[k][n] for k in trial) for n in counts[j])
            real = sum(sum(counts[k].values()) for k in trial)
            if current and padded > (1 + pad_tolerance) * real:
                buckets.append(_bucket([members[k] for k in current], [counts[k] for k in current]))
                trial = [j]
            current = trial
        buckets.append(_bucket([members[k] for k in current], [counts[k] for k in current]))
    return buckets


def _bucket(members: list[int], counts: list[dict[str, int]]) -> Bucket:
    steps = {name: max(c[name] for c in counts) for name in counts[0]}
    padded = frozenset(name for name in steps if any(c[name] != steps[name] for c in counts))
    return Bucket(members, steps, padded)


def _same_data(a: ArrayDataset, b: ArrayDataset) -> bool:
    return a is b or (a.x is b.x and a.y is b.y and a.mean is b.mean and a.std is b.std)


def augmented_rows(dataset: ArrayDataset, index: torch.Tensor,
                   draws: CropFlip | SpeechDraws) -> tuple[torch.Tensor, torch.Tensor]:
    """Model inputs of rows ``index`` (any shape) augmented per sample with ``draws`` (tensors
    shaped like ``index``). :class:`CropFlip`: cropped and flipped, then normalised (the [0, 1]
    images are padded with black before Normalize, as the FedL2P code's ``RandomCrop(32,
    padding=4)`` before ``ToTensor``/``Normalize``). :class:`SpeechDraws`: the clips shifted and
    blended with the dataset's background noise, then turned into their features
    (:class:`pfl_core.data.audio.SpeechAugment`)."""
    x, y = dataset.raw_batch(index.reshape(-1))
    flat = type(draws)(*(t.reshape(-1) for t in draws))
    if isinstance(flat, SpeechDraws):
        x = SpeechAugment(dataset.extras["noise"], dataset.extras["noise_lengths"]).apply(x, flat)
    else:
        x = crop_flip(x, flat, padding=CROP_PADDING)
    x = dataset.to_inputs(dataset.normalize(x))
    return x.reshape(*index.shape, *x.shape[1:]), y.reshape(index.shape)


def gather_rows(datasets: list[ArrayDataset], index: torch.Tensor,
          draws: CropFlip | SpeechDraws | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Rows ``index[k]`` of ``datasets[k]`` (``[clients, ...]`` indices); one indexing when the
    clients share their data (the clients of one run, or seeds without subsampling). ``draws``
    (tensors shaped like ``index``): augment each row (:mod:`pfl_core.engine.augmentation`)."""
    if all(_same_data(d, datasets[0]) for d in datasets[1:]):
        if draws is not None:
            return augmented_rows(datasets[0], index, draws)
        x, y = datasets[0].batch(index.reshape(-1))
        return x.reshape(*index.shape, *x.shape[1:]), y.reshape(index.shape)
    if draws is not None:
        parts = [augmented_rows(d, i, type(draws)(*(t[k] for t in draws)))
                 for k, (d, i) in enumerate(zip(datasets, index))]
    else:
        parts = [d.batch(i) for d, i in zip(datasets, index)]
    return torch.stack([p[0] for p in parts]), torch.stack([p[1] for p in parts])


def gather(datasets: list[ArrayDataset], plans: list[Plan], bucket: Bucket, stacked: bool,
           draws: list[dict | None] | None = None):
    """The bucket's batches as ``{stream: (xs, ys)}`` plus ``{stream: mask}`` for padded streams;
    ``datasets[i]`` holds the data of ``plans[i]``; ``draws[i]`` (optional) the per-sample
    augmentation draws of plan i's training streams (:func:`~pfl_core.engine.augmentation.augment_draws`).

    ``stacked``: tensors ``[clients, steps, B, ...]`` (vmapped). Otherwise one client's batches:
    ``[steps, B, ...]`` tensors when its batches share a size, else lists of batches.
    """
    batches, masks = {}, {}
    members = [datasets[i] for i in bucket.members]
    for name, steps in bucket.steps.items():
        rows, augmented = [], []
        for i in bucket.members:
            own = plans[i][name]
            rows.append(own + [own[-1]] * (steps - len(own)) if own else own)
            mine = draws[i].get(name) if draws is not None and draws[i] is not None else None
            augmented.append(mine + [mine[-1]] * (steps - len(mine)) if mine else None)
        if any(a is None for a in augmented):
            augmented = None
        if steps == 0:
            batches[name] = ([], [])
            continue
        if uniform_size(tuple(int(b.numel()) for b in rows[0])) is None:
            # batches of unequal sizes (bucketed by identical size sequences): one tensor per step
            per_step = [gather_rows(members, torch.stack(column),
                              None if augmented is None else stack_draws([a[j] for a in augmented]))
                        for j, column in enumerate(zip(*rows))]
            xs, ys = [x for x, _ in per_step], [y for _, y in per_step]
            batches[name] = (xs, ys) if stacked else ([x[0] for x in xs], [y[0] for y in ys])
            continue
        index = torch.stack([torch.stack(r) for r in rows])  # [clients, steps, B]
        stacked_draws = None if augmented is None else stack_draws([stack_draws(a) for a in augmented])
        x, y = gather_rows(members, index, stacked_draws)
        batches[name] = (x, y) if stacked else (x[0], y[0])
        if name in bucket.padded:
            lengths = torch.tensor([len(plans[i][name]) for i in bucket.members], device=index.device)
            mask = torch.arange(steps, device=index.device).unsqueeze(0) < lengths.unsqueeze(1)
            masks[name] = mask if stacked else mask[0]
    return batches, masks
