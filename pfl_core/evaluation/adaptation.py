"""Which batches an evaluation's fine-tuning steps take (``EvalConfig.adapt_split`` and
``EvalConfig.adapt_batches``), for both execution paths (:mod:`.sequential`, :mod:`.batched`).

The default (``train``, ``restart``) draws the next ``steps`` batches of the client's train stream:
the evaluation contexts are built afresh at every evaluation, so every evaluation starts from the
first batches of the same fixed order. The other settings reproduce the pFedMe code's Per-FedAvg
evaluation (docs/papers/cgpfl.md, code conventions): batches of the evaluated split itself (a
leak), and a position that moves on by ``steps`` every round.
"""
from __future__ import annotations

import torch

from pfl_core.engine.contract import ClientContext
from pfl_core.evaluation.config import EvalConfig


def adaptation_order(ctx: ClientContext, cfg: EvalConfig) -> list[torch.Tensor]:
    """The fixed cyclic order of fine-tuning index batches: the train stream's batches, or the
    evaluated split's fixed order cut into batches of the train batch size (the last one short, as
    a DataLoader without ``drop_last``)."""
    train = ctx.streams["train"]
    if cfg.adapt_split == "train":
        if train.reshuffle:
            raise ValueError("evaluation adapt_batches: continue needs a fixed train order "
                             "(federation.reshuffle: false)")
        return train.epoch()
    order = torch.cat(ctx.streams[cfg.split].epoch())
    return list(torch.split(order, train.batch_size))


class AdaptationBatches:
    """The index batches of the ``steps`` fine-tuning steps of one client's evaluation of the model
    after round ``evaluated_round`` (1-based; ``continue`` starts at position steps * round).
    :meth:`index` is called once per step, in order: the default draws the train stream's next
    batch at that call, as the evaluation loop always has."""

    def __init__(self, ctx: ClientContext, cfg: EvalConfig, steps: int, evaluated_round: int = 1):
        self.ctx, self.drawn = ctx, None
        if steps and not (cfg.adapt_split == "train" and cfg.adapt_batches == "restart"):
            order = adaptation_order(ctx, cfg)
            start = steps * evaluated_round if cfg.adapt_batches == "continue" else 0
            self.drawn = [order[(start + k) % len(order)] for k in range(steps)]

    def index(self, step: int) -> torch.Tensor:
        return self.ctx.next_index("train") if self.drawn is None else self.drawn[step]
