"""The batched evaluation path: :func:`personalize_and_evaluate_batched` runs all evaluated
clients together, with the same batches and the same curves as :mod:`.sequential`.

Their predictors are stacked (one parameter set per client; a tensor shared by all clients is
passed once) and every per-batch computation is ``torch.func.vmap``-ed over clients, never over
samples: an evaluation batch stays exactly the sequential path's batch (BatchNorm uses its own
statistics). At each batch position of the evaluation split, the clients whose batches there have
the same size run as one call (all clients at the positions of full batches; last partial batches
of equal size together, a lone one without vmap); each fine-tuning step is
:meth:`ClientProgram.finetune_step` vmapped over the clients with equal train batch sizes. The
batches are the sequential path's: the same draws, in the same order, from each client's own
streams. Hits and losses are summed on the device (float64, in the sequential order) and read
once at the end.

Inside vmap, :meth:`ClientProgram.logits` and :meth:`ClientProgram.finetune_step` get
``client=None``: they must be pure tensor functions of their arguments. A method whose hooks read
the client sets ``eval_batched_fallback`` (a reason) and is evaluated sequentially; CAFeMe with a
label-conditioned modulator does (:func:`batched_evaluation_fallback`).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch
import torch.nn.functional as F
from torch.func import vmap
from torch.utils._pytree import tree_map

from pfl_core.engine.contract import ClientContext, ClientProgram
from pfl_core.engine.plans import gather_rows
from pfl_core.engine.trees import stack_trees
from pfl_core.evaluation.adaptation import AdaptationBatches
from pfl_core.evaluation.config import EvalConfig
from pfl_core.evaluation.results import ClientResult
from pfl_core.training import Params


def batched_evaluation_fallback(algorithm: ClientProgram) -> str | None:
    """None when the batched path can evaluate ``algorithm``; else why it runs sequentially."""
    if algorithm.eval_batched_fallback:
        return algorithm.eval_batched_fallback
    if getattr(algorithm, "context_labels", False):
        return ("label-conditioned modulator (context_labels): logits reads each client's labelled "
                "context batch from the client on the host")
    return None


@dataclass
class _Call:
    """One computation of the batched path: ``members`` (client positions, ascending) on one
    equal-sized index batch each, ``rows`` ``[members, B]``; either the evaluation batch at
    ``position`` of step ``step``, or the fine-tuning step ``step`` (``position`` None)."""

    step: int
    position: int | None
    members: list[int]
    rows: torch.Tensor


def group_calls(step: int, position: int | None, batches: dict[int, torch.Tensor]) -> list[_Call]:
    """The clients of ``batches`` (client position -> index batch) grouped by batch size."""
    groups: dict[int, list[int]] = {}
    for i, batch in batches.items():
        groups.setdefault(int(batch.numel()), []).append(i)
    return [_Call(step, position, members, torch.stack([batches[i] for i in members]))
            for members in groups.values()]


def _plan(contexts: list[ClientContext], cfg: EvalConfig, steps: int, evaluated_round: int = 1) -> list[_Call]:
    """Every batch of the run, drawn on the host before any compute, from each client's streams
    (per client: evaluation pass, fine-tuning batch, evaluation pass, ...; the fine-tuning batches
    are the sequential path's, :class:`pfl_core.evaluation.adaptation.AdaptationBatches`; clients
    draw from their own streams, so the order across clients does not matter)."""
    tuning = [AdaptationBatches(ctx, cfg, steps, evaluated_round) for ctx in contexts]
    calls = []
    for step in range(steps + 1):
        passes = [ctx.streams[cfg.split].epoch() for ctx in contexts]
        for position in range(max(len(p) for p in passes)):
            batches = {i: p[position] for i, p in enumerate(passes) if position < len(p)}
            if cfg.reduction == "batch_mean":  # batches of one sample are skipped (CAFeMe code)
                batches = {i: b for i, b in batches.items() if b.numel() > 1}
            calls += group_calls(step, position, batches)
        if step < steps:
            calls += group_calls(step, None, {i: tuning[i].index(step) for i in range(len(contexts))})
    return calls


def _to_device(tensors: list[torch.Tensor], device: torch.device) -> list[torch.Tensor]:
    """``tensors`` (int64, host) moved with one transfer."""
    if not tensors:
        return []
    flat = torch.cat([t.reshape(-1) for t in tensors]).to(device)
    return [part.view(t.shape) for part, t in zip(flat.split([t.numel() for t in tensors]), tensors)]


class ClientStack:
    """The evaluated clients' parameters, stacked (``dims`` None: one tensor shared by all)."""

    def __init__(self, params: list[Params], contexts: list[ClientContext]):
        self.contexts, self.count = contexts, len(contexts)
        self.params, self.dims = stack_trees(params)

    def select(self, members: list[int], index: torch.Tensor) -> Params:
        """The parameters of ``members`` (device positions ``index``); all clients: no copy."""
        if len(members) == self.count:
            return self.params
        return {k: v if self.dims[k] is None else v.index_select(0, index) for k, v in self.params.items()}

    def call(self, fn: Callable, members: list[int], index: torch.Tensor, x: torch.Tensor, y: torch.Tensor):
        """``fn(params, x, y, client)`` of ``members`` (``x``, ``y`` stacked over them), outputs
        stacked over them: vmapped over two or more (``client`` None), a plain call for one."""
        if len(members) == 1:
            i = members[0]
            params = {k: v if self.dims[k] is None else v[i] for k, v in self.params.items()}
            out = fn(params, x[0], y[0], self.contexts[i])
            return tree_map(lambda v: v.unsqueeze(0), out)
        in_dims = (self.dims, 0, 0)
        return vmap(lambda p, x, y: fn(p, x, y, None), in_dims=in_dims)(self.select(members, index), x, y)

    def update(self, new: list[tuple[torch.Tensor, Params]]) -> None:
        """Replace the parameters of the clients at ``index`` by ``params`` for every
        ``(index, params)`` of ``new`` (together, they cover every client once)."""
        if len(new) == 1:
            self.params = new[0][1]
        else:
            full = {k: (v.expand(self.count, *v.shape) if self.dims[k] is None else v).clone()
                    for k, v in self.params.items()}
            for index, params in new:
                for k in full:
                    full[k].index_copy_(0, index, params[k])
            self.params = full
        self.dims = {k: 0 for k in self.params}


def personalize_and_evaluate_batched(algorithm: ClientProgram, params: list[Params],
                                     contexts: list[ClientContext], cfg: EvalConfig,
                                     steps: int, evaluated_round: int = 1) -> list[ClientResult]:
    """:func:`personalize_and_evaluate` of every client of ``contexts`` (starting from
    ``params[i]``) at once: the same batches and the same curves, computed client-stacked (module
    docstring). Every index batch is drawn first and moved to the device at once; the hits and
    losses are summed on the device (float64, in the sequential order) and read once at the end."""
    if not contexts:
        return []
    count = len(contexts)
    clients = ClientStack(params, contexts)
    device = next(iter(clients.params.values())).device
    calls = _plan(contexts, cfg, steps, evaluated_round)
    rows = _to_device([c.rows for c in calls], contexts[0].dataset.x.device)
    members = _to_device([torch.tensor(c.members) for c in calls], device)

    correct = torch.zeros(steps + 1, count, dtype=torch.int64, device=device)
    loss_sum = torch.zeros(steps + 1, count, dtype=torch.float64, device=device)
    batch_acc = torch.zeros(steps + 1, count, dtype=torch.float64, device=device)
    seen = [[0] * count for _ in range(steps + 1)]
    kept = [[0] * count for _ in range(steps + 1)]  # batches of more than one sample

    def scores(params, x, y, client):
        logits = algorithm.logits(params, x, client)
        return (logits.argmax(1) == y).sum(), F.cross_entropy(logits, y, reduction="sum")

    pending: list[tuple[torch.Tensor, Params]] = []  # this step's fine-tuned groups, so far
    tuned = 0
    for call, index, at in zip(calls, rows, members):
        x, y = gather_rows([contexts[i].dataset for i in call.members], index)
        if call.position is None:
            def tune(p, x, y, client, lr=cfg.lr_at(call.step)):
                return algorithm.finetune_step(p, x, y, lr, client)

            pending.append((at, clients.call(tune, call.members, at, x, y)))
            tuned += len(call.members)
            if tuned == count:  # every client took this step: the next evaluation uses the new stack
                clients.update(pending)
                pending, tuned = [], 0
            continue
        with torch.no_grad():
            hits, losses = clients.call(scores, call.members, at, x, y)
        n = index.shape[1]
        correct[call.step].index_add_(0, at, hits.to(torch.int64))
        loss_sum[call.step].index_add_(0, at, losses.to(torch.float64))
        if n > 1:
            batch_acc[call.step].index_add_(0, at, hits.to(torch.float64) / n)
        for i in call.members:
            seen[call.step][i] += n
            kept[call.step][i] += n > 1

    correct, loss_sum, batch_acc = (t.T.tolist() for t in (correct, loss_sum, batch_acc))  # one read
    results = []
    for i, ctx in enumerate(contexts):
        accs, losses = [], []
        for step in range(steps + 1):
            if cfg.reduction == "sample" or not kept[step][i]:
                accs.append(correct[i][step] / max(seen[step][i], 1))
            else:
                accs.append(batch_acc[i][step] / kept[step][i])
            losses.append(loss_sum[i][step] / max(seen[step][i], 1))
        results.append(ClientResult(ctx.cid, ctx.num_samples(cfg.split), accs, losses))
    return results
