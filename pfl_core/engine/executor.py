"""Running the sampled clients of a round: one at a time, or vmapped over stacks of clients.

A method that writes its client update as a *program* (docs/speed.md; the init / step /
final split of FedJAX) gets both paths from the one definition:

* :meth:`ClientProgram.draw` (host side, first): every random number of the client's round - the
  index batches it consumes, in order, and any other draw (:class:`~pfl_core.engine.plans.Drawn`);
  then, with ``data.augment``, the per-sample augmentation of its training streams, drawn on the
  host (:mod:`pfl_core.engine.augmentation`);
* :meth:`ClientProgram.carry_in` (host side): the client's start values from the server state, its
  own persistent state (parameters, optimiser moments, ...) and the round's non-index draws, a
  pytree of tensors;
* :meth:`ClientProgram.local_update`: a pure tensor function ``(carry, batches, masks) -> (carry,
  loss)`` - called on one client by the sequential path, vmapped over a stack by the batched path;
* :meth:`ClientProgram.carry_out` (host side): writes the client's state, returns its upload.

``sequential`` runs every client alone (the reference). ``batched`` groups the round's clients
into buckets of equal plan shape (:mod:`pfl_core.engine.plans`) and runs each bucket of two or more
clients as one ``torch.func.vmap`` call; a bucket of one runs as in the sequential path. Several
runs (the seeds of a cell) can pass their clients together: :meth:`Executor.run_many`.
"""
from __future__ import annotations

from dataclasses import dataclass, replace

import torch
from torch.func import vmap
from torch.utils._pytree import tree_leaves

from pfl_core.engine.augmentation import augment_draws
from pfl_core.engine.capture import CAPTURES, CapturedSteps
from pfl_core.engine.plans import Plan, gather, make_buckets, split_draw
from pfl_core.engine.trees import stack_trees, unstack_tree
from pfl_core.engine.contract import ClientContext, ClientProgram, ClientUpdate, ServerState
from pfl_core.engine.memory import out_of_memory_hint

EXECUTIONS = ("sequential", "batched")


@dataclass
class WorkItem:
    """One sampled client of one run in one round."""

    algorithm: ClientProgram
    server: ServerState
    client: ClientContext
    round_idx: int


def start_client(algorithm: ClientProgram, server, client, round_idx: int) -> tuple[dict, Plan, dict | None]:
    """(carry, plan, augmentation draws) of one client's round, in the engine's order: ``draw``
    (all the round's random numbers), the ``data.augment`` draws, then ``carry_in`` with the
    draw's non-index values."""
    plan, values = split_draw(algorithm.draw(client, round_idx))
    draws = augment_draws(algorithm, client, plan)
    return algorithm.carry_in(server, client, round_idx, values), plan, draws


def run_program(algorithm: ClientProgram, server, client, round_idx: int) -> ClientUpdate:
    """The sequential path of a program: one client, no vmap."""
    carry, plan, draws = start_client(algorithm, server, client, round_idx)
    bucket = make_buckets([plan], (), 0.0)[0]
    batches, masks = gather([client.dataset], [plan], bucket, stacked=False, draws=[draws])
    out, loss = algorithm.local_update(carry, batches, masks)
    return algorithm.carry_out(server, client, out, loss)


class Executor:
    """Runs work items and returns their updates in order.

    Args:
        execution: ``sequential`` or ``batched``.
        pad_tolerance: batched path only; clients whose maskable streams differ only in their
            number of batches share a vmap call when the padded work stays within
            ``1 + pad_tolerance`` of the real work (0: equal step counts only, no wasted compute).
        stack_limit: batched path only; at most this many clients per vmapped call (0: a whole
            bucket; :mod:`pfl_core.engine.memory` chooses it per run). Changes no number.
        capture: batched path only; ``cuda_graphs`` replays each vmapped step shape as a CUDA
            graph (:mod:`pfl_core.engine.capture`); ``off``: eager. Changes no number.
    """

    def __init__(self, execution: str = "batched", pad_tolerance: float = 0.0, stack_limit: int = 0,
                 capture: str = "off"):
        if execution not in EXECUTIONS:
            raise ValueError(f"execution must be one of {EXECUTIONS}, got {execution!r}")
        if stack_limit < 0:
            raise ValueError(f"stack_limit must be >= 0, got {stack_limit}")
        if capture not in CAPTURES:
            raise ValueError(f"capture must be one of {CAPTURES}, got {capture!r}")
        self.captured: CapturedSteps | None = CapturedSteps() if capture == "cuda_graphs" else None
        """The recorded graphs of the batched step (None: ``capture`` off, eager)."""
        self.execution = execution
        self.pad_tolerance = pad_tolerance
        self.stack_limit = stack_limit
        self.stack_reason: str | None = None
        """How the stack limit was chosen (:func:`pfl_core.engine.memory.stack_limit`)."""
        self.choice: str | None = None
        """Why ``--execution auto`` chose this path (:mod:`pfl_core.engine.choice`); None: asked for."""

    def uses_batched(self, algorithm: ClientProgram) -> bool:
        return self.execution == "batched" and algorithm.batched_fallback is None

    def run_many(self, items: list[WorkItem]) -> list[ClientUpdate]:
        """Updates of ``items`` (possibly from several runs of one cell) in their order."""
        if not items:
            return []
        head = items[0].algorithm
        if not self.uses_batched(head):
            return [i.algorithm.client_update(i.server, i.client, i.round_idx) for i in items]
        if any(type(i.algorithm) is not type(head) or i.algorithm.hp != head.hp for i in items):
            raise ValueError("run_many needs one method with one set of hyperparameters")
        carries, plans, draws = map(list, zip(*(start_client(i.algorithm, i.server, i.client, i.round_idx)
                                                for i in items)))
        outputs: list = [None] * len(items)
        for bucket in self.stacks(make_buckets(plans, head.maskable_streams, self.pad_tolerance)):
            stacked = len(bucket.members) > 1
            batches, masks = gather([i.client.dataset for i in items], plans, bucket, stacked, draws)
            if not stacked:
                k = bucket.members[0]
                outputs[k] = head.local_update(carries[k], batches, masks)
                continue
            carry, dims = stack_trees([carries[k] for k in bucket.members])
            step = vmap(head.local_update, in_dims=(dims, 0, 0))
            try:
                if self.captured is None:
                    out, loss = step(carry, batches, masks)
                else:
                    out, loss = self.captured(head, step, carry, batches, masks, variant=tuple(tree_leaves(dims)))
            except torch.OutOfMemoryError as err:
                raise torch.OutOfMemoryError(f"{err}\n{out_of_memory_hint(len(bucket.members), self.stack_limit)}") from err
            for k, (o, l) in zip(bucket.members, zip(unstack_tree(out, len(bucket.members)), loss)):
                outputs[k] = (o, l)
        return [i.algorithm.carry_out(i.server, i.client, *outputs[k]) for k, i in enumerate(items)]

    def stacks(self, buckets: list) -> list:
        """``buckets`` cut into consecutive pieces of at most ``stack_limit`` members (same steps)."""
        if not self.stack_limit:
            return buckets
        return [replace(b, members=b.members[i:i + self.stack_limit])
                for b in buckets for i in range(0, len(b.members), self.stack_limit)]
