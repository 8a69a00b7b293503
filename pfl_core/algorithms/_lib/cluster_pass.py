"""IFCA's cluster-choice pass in large forwards, with the per-batch loop's numbers bit for bit.

The reference (:func:`loop_losses`, the CAFeMe code's ``compute_best_model``) forwards every
cluster model over the client's train split one batch at a time (batches of 20 for CGPFL's
CIFAR-10 CNN) and sums the per-batch mean cross-entropies; the argmin picks the cluster. A run
with ``eval_every: 1`` does it twice a round per client: before training (``carry_in``) and at the
evaluation (``predictor``), the second on the aggregated clusters, which the next round's first
pass sees again, over another order of the same rows (the evaluation's streams).

:func:`exact_losses` computes the same losses from per-row logits:

* the split's rows are forwarded once per cluster in chunks of whole batches (at most
  :data:`CHUNK_ROWS` rows, the last chunk padded with repeated rows to a whole number of batches),
  and kept (:class:`SplitLogits`) for the next pass over the same cluster tensors;
* each batch of the pass takes its rows' logits from there, a batch of another size (the last,
  partial one) is forwarded on its own as in the loop, and ``F.cross_entropy`` of each batch and
  the sum over batches are the loop's own calls.

A batch's logits are then the loop's bits exactly when a row's logits do not depend on the rows
beside it, on its position, or on the batch size. Mathematically they do not for models of
per-row layers (:func:`~pfl_core.models.per_sample.rows_independent`); in floating point a kernel
may pick another code path for another shape. So each shape is checked once per process before it
is used (:func:`verified`): a chunk's logits against its batches forwarded one by one, and a batch
against its rows rolled by one position, with ``torch.equal``. The kernels choose their path by
shape, dtype, device and thread count (the key), not by values; a shape that fails keeps the loop.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from pfl_core.training import Params, batch_loss, forward

#: rows per forward of the chunked pass (harness choice: CGPFL's CNN on one CPU thread runs 1.25x
#: faster per row at 500 rows than at 20, and a few MB of activations per chunk)
CHUNK_ROWS = 512

_VERIFIED: dict[tuple, bool] = {}
"""Per shape key (:func:`shape_key`): whether the chunked forward gave the loop's bits."""


def loop_losses(model: nn.Module, clusters: list[Params], batches: list[tuple[torch.Tensor, torch.Tensor]]
                ) -> torch.Tensor:
    """The reference: per cluster, the sum over ``batches`` of each batch's mean CE (k-vector)."""
    return torch.stack([torch.stack([batch_loss(model, params, x, y) for x, y in batches]).sum()
                        for params in clusters])


def shape_key(model: nn.Module, params: Params, rows: int, batch: int) -> tuple:
    """What a kernel's choice of code path may depend on: the model, dtype, device, threads, shapes."""
    first = next(iter(params.values()))
    return (repr(model), first.dtype, str(first.device), torch.get_num_threads(), rows, batch)


def verified(model: nn.Module, params: Params, chunk: torch.Tensor, batch: int) -> torch.Tensor | None:
    """The logits of ``chunk`` (a whole number of batches of ``batch`` rows) in one forward, or
    None when this shape does not give the per-batch forwards' bits (checked on first use)."""
    key = shape_key(model, params, chunk.shape[0], batch)
    if _VERIFIED.get(key) is False:
        return None
    logits = forward(model, params, chunk)
    if key not in _VERIFIED:
        pieces = [forward(model, params, chunk[i:i + batch]) for i in range(0, chunk.shape[0], batch)]
        rolled = forward(model, params, chunk[:batch].roll(1, 0))
        _VERIFIED[key] = torch.equal(logits, torch.cat(pieces)) and torch.equal(rolled, pieces[0].roll(1, 0))
    return logits if _VERIFIED[key] else None


def chunk_rows(rows: int, batch: int) -> list[int]:
    """The row counts of the chunked forwards over ``rows`` rows: whole batches of ``batch`` rows,
    at most :data:`CHUNK_ROWS` a chunk, the last padded to a whole batch."""
    padded, step = -(-rows // batch) * batch, max(batch, CHUNK_ROWS // batch * batch)
    return [min(step, padded - start) for start in range(0, padded, step)]


def split_logits(model: nn.Module, clusters: list[Params], x: torch.Tensor, batch: int) -> torch.Tensor | None:
    """[k, rows, classes] logits of every cluster over the rows ``x`` in verified chunks of whole
    batches (:func:`chunk_rows`; None: a chunk shape failed its check)."""
    rows, sizes = x.shape[0], chunk_rows(x.shape[0], batch)
    if sum(sizes) > rows:  # repeated rows complete the last batch (their logits are dropped)
        x = torch.cat([x, x[torch.arange(sum(sizes) - rows, device=x.device) % rows]])
    out = []
    for params in clusters:
        chunks, start = [], 0
        for size in sizes:
            chunks.append(verified(model, params, x[start:start + size], batch))
            if chunks[-1] is None:
                return None
            start += size
        out.append(torch.cat(chunks)[:rows])
    return torch.stack(out)


def known_to_fail(model: nn.Module, params: Params, rows: int, batch: int) -> bool:
    """Whether a chunk shape of a pass over ``rows`` rows already failed its check (the pass then
    takes the loop without gathering the split)."""
    return any(_VERIFIED.get(shape_key(model, params, size, batch)) is False for size in chunk_rows(rows, batch))


class SplitLogits:
    """The per-row logits of one set of cluster tensors, per client split, until the clusters change.

    An entry is valid while every cluster tensor is the same object at the same version (an
    aggregation makes new tensors; an in-place update bumps the version); a new set drops them all."""

    def __init__(self) -> None:
        self._clusters: list[torch.Tensor] = []
        self._versions: list[int] = []
        self._entries: dict[tuple[int, int, int], tuple] = {}

    def _same_clusters(self, tensors: list[torch.Tensor]) -> bool:
        return (len(tensors) == len(self._clusters) and all(a is b for a, b in zip(tensors, self._clusters))
                and [t._version for t in tensors] == self._versions)

    def get(self, model: nn.Module, clusters: list[Params], dataset, index: torch.Tensor) -> tuple | None:
        """What :func:`exact_losses` kept for this model, clusters and split: (the split's rows
        sorted, their positions in ``index``, the logits [k, rows, classes] in ``index`` order)."""
        entry = self._entries.get((id(model), id(dataset), id(index)))
        if entry is None or not self._same_clusters(_tensors(clusters)):
            return None
        if entry[0] is not model or entry[1] is not dataset or entry[2] is not index:
            return None
        return entry[3]

    def put(self, model: nn.Module, clusters: list[Params], dataset, index: torch.Tensor, kept: tuple) -> None:
        tensors = _tensors(clusters)
        if not self._same_clusters(tensors):
            self._clusters, self._versions, self._entries = tensors, [t._version for t in tensors], {}
        self._entries[(id(model), id(dataset), id(index))] = (model, dataset, index, kept)


def _tensors(clusters: list[Params]) -> list[torch.Tensor]:
    return [t for params in clusters for t in params.values()]


def exact_losses(model: nn.Module, clusters: list[Params], dataset, index: torch.Tensor,
                 batches: list[torch.Tensor], cache: SplitLogits) -> torch.Tensor | None:
    """:func:`loop_losses` over the index ``batches`` (rows of ``dataset`` from the split ``index``),
    computed from the split's per-row logits (module docstring); None when a chunk shape failed its
    check or the dataset maps rows to inputs (the caller runs the loop). No host read."""
    if not batches or dataset.inputs is not None:
        return None
    batch = batches[0].numel()
    kept = cache.get(model, clusters, dataset, index)
    if kept is None:
        if known_to_fail(model, clusters[0], index.numel(), batch):
            return None
        logits = split_logits(model, clusters, dataset.batch(index)[0], batch)
        if logits is None:
            return None
        sorted_rows, order = torch.sort(index)
        kept = (sorted_rows, order, logits)
        cache.put(model, clusters, dataset, index, kept)
    sorted_rows, order, logits = kept
    rows = torch.cat(batches)
    taken = logits[:, order[torch.searchsorted(sorted_rows, rows)]]  # a repeated row: its first copy, same input
    labels = dataset.y[rows]
    losses, start = [], 0
    for b in batches:
        end = start + b.numel()
        if b.numel() == batch:
            losses.append([F.cross_entropy(taken[k, start:end], labels[start:end]) for k in range(len(clusters))])
        else:  # another size (the partial last batch): forwarded at its own size, as the loop does
            x, y = dataset.batch(b)
            losses.append([batch_loss(model, params, x, y) for params in clusters])
        start = end
    return torch.stack([torch.stack([per_batch[k] for per_batch in losses]).sum() for k in range(len(clusters))])
