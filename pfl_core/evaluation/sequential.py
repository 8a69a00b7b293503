"""The reference evaluation path: one client after the other, on the host's batch order."""
from __future__ import annotations

import torch

from pfl_core.engine.contract import ClientContext, ClientProgram
from pfl_core.evaluation.adaptation import AdaptationBatches
from pfl_core.evaluation.config import EvalConfig
from pfl_core.evaluation.results import ClientResult
from pfl_core.training import Params


@torch.no_grad()
def evaluate_params(algorithm: ClientProgram, params: Params, ctx: ClientContext, cfg: EvalConfig) -> tuple[float, float]:
    """(accuracy, mean loss) of ``params`` on the client's evaluation split, batched in the
    split's fixed order (BatchNorm uses each evaluation batch's statistics). With the
    ``batch_mean`` reduction, batches of one sample are skipped, as in the CAFeMe code."""
    correct, seen, batch_accs, loss_sum = 0, 0, [], 0.0
    for index in ctx.streams[cfg.split].epoch():
        if cfg.reduction == "batch_mean" and index.numel() == 1:
            continue
        x, y = ctx.dataset.batch(index)
        logits = algorithm.logits(params, x, ctx)
        hits = (logits.argmax(1) == y).sum()
        loss_sum += float(torch.nn.functional.cross_entropy(logits, y, reduction="sum"))
        n = y.numel()
        correct += int(hits)
        seen += n
        if n > 1:
            batch_accs.append(float(hits) / n)
    if cfg.reduction == "sample" or not batch_accs:
        acc = correct / max(seen, 1)
    else:
        acc = sum(batch_accs) / len(batch_accs)
    return acc, loss_sum / max(seen, 1)


def personalize_and_evaluate(
    algorithm: ClientProgram, params: Params, ctx: ClientContext, cfg: EvalConfig, steps: int,
    evaluated_round: int = 1,
) -> ClientResult:
    """Evaluate, then take one SGD step on the next fine-tuning batch (the next train batch by
    default; :class:`pfl_core.evaluation.adaptation.AdaptationBatches`), ``steps`` times; evaluate
    last. ``evaluated_round``: the round after which the model is evaluated (1-based)."""
    batches = AdaptationBatches(ctx, cfg, steps, evaluated_round)
    accs, losses = [], []
    for step in range(steps + 1):
        acc, loss = evaluate_params(algorithm, params, ctx, cfg)
        accs.append(acc)
        losses.append(loss)
        if step < steps:
            x, y = ctx.dataset.batch(batches.index(step))
            params = algorithm.finetune_step(params, x, y, cfg.lr_at(step), ctx)
    return ClientResult(ctx.cid, ctx.num_samples(cfg.split), accs, losses)
