"""Evaluation protocols, separate from the algorithms (DESIGN.md, "Evaluation protocols").

* ``unseen``: held-out clients that never trained start from the method's predictor and, for
  methods that fine-tune at evaluation, take N SGD steps on their train (personalization) split
  with lr_k = lr * gamma ** floor(k / decay_every), evaluating on their test split before every
  step: an accuracy curve over steps 0..N (CAFeMe spec, "Evaluation protocol").
* ``seen``: the training clients, each with its personalized predictor, evaluated on its test
  split (the same fine-tuning applies if ``steps`` > 0).

Every protocol keeps per-client results, and summarises each step both as the unweighted mean over
clients and as the sample-weighted accuracy.
"""
from __future__ import annotations

from dataclasses import dataclass, field, replace

import torch
from pfl_core.algorithms.base import Algorithm, ClientContext, HyperParams, ServerState
from pfl_core.data.federated import FederatedData
from pfl_core.registry import Registry
from pfl_core.training import Params

PROTOCOLS: Registry = Registry("evaluation protocol")


@dataclass
class EvalConfig(HyperParams):
    """Settings of an evaluation protocol (both protocols share them)."""

    steps: int = 0
    """Personalization steps at evaluation for methods that fine-tune (CAFeMe: 50)."""
    lr: float = 0.01
    """Fine-tuning learning rate (CAFeMe: ``lr_ft`` for baselines, ``lr_ft_pfl`` for CAFeMe)."""
    gamma: float = 0.8
    """Multiplicative learning-rate decay (CAFeMe: 0.8)."""
    decay_every: int = 5
    """Decay the learning rate after every this many steps (CAFeMe: 5)."""
    batch_size: int = 0
    """Evaluation batch size; 0 = the federation's training batch size."""
    reduction: str = "batch_mean"
    """Client accuracy: ``batch_mean`` = unweighted mean of per-batch accuracies, batches of size 1
    skipped (CAFeMe code); ``sample`` = correct predictions / samples."""
    split: str = "test"
    """The client split evaluated on."""

    def __post_init__(self) -> None:
        if self.reduction not in ("batch_mean", "sample"):
            raise ValueError(f"reduction must be 'batch_mean' or 'sample', got {self.reduction!r}")

    def lr_at(self, step: int) -> float:
        return self.lr * self.gamma ** (step // self.decay_every)


@dataclass
class ClientResult:
    """One client's evaluation: accuracy and loss after 0..steps personalization steps."""

    cid: int
    num_samples: int
    acc: list[float]
    loss: list[float]


@dataclass
class EvalResult:
    clients: list[ClientResult]
    summary: dict[str, float] = field(default_factory=dict)
    curve_mean: list[float] = field(default_factory=list)
    curve_weighted: list[float] = field(default_factory=list)


@torch.no_grad()
def evaluate_params(algorithm: Algorithm, params: Params, ctx: ClientContext, cfg: EvalConfig) -> tuple[float, float]:
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
    algorithm: Algorithm, params: Params, ctx: ClientContext, cfg: EvalConfig, steps: int
) -> ClientResult:
    """Evaluate, then take one SGD step on the next train batch, ``steps`` times; evaluate last."""
    accs, losses = [], []
    for step in range(steps + 1):
        acc, loss = evaluate_params(algorithm, params, ctx, cfg)
        accs.append(acc)
        losses.append(loss)
        if step < steps:
            x, y = ctx.next_batch("train")
            params = algorithm.finetune_step(params, x, y, cfg.lr_at(step), ctx)
    return ClientResult(ctx.cid, ctx.num_samples(cfg.split), accs, losses)


def summarise(results: list[ClientResult]) -> EvalResult:
    """Per-step unweighted client mean and sample-weighted mean, plus scalar summaries:
    ``acc`` / ``acc_weighted`` at the last step and ``acc_last3`` / ``acc_last3_weighted``, the
    mean of the last three steps (CAFeMe's table statistic, per seed)."""
    steps = len(results[0].acc)
    total = sum(r.num_samples for r in results)
    mean = [sum(r.acc[k] for r in results) / len(results) for k in range(steps)]
    weighted = [sum(r.acc[k] * r.num_samples for r in results) / total for k in range(steps)]
    loss = sum(r.loss[-1] for r in results) / len(results)
    summary = {
        "acc": mean[-1],
        "acc_weighted": weighted[-1],
        "acc_last3": sum(mean[-3:]) / len(mean[-3:]),
        "acc_last3_weighted": sum(weighted[-3:]) / len(weighted[-3:]),
        "acc_step0": mean[0],
        "eval_loss": loss,
    }
    return EvalResult(results, summary, mean, weighted)


class Protocol:
    """Evaluates a method's predictors on a set of clients (chosen by subclasses).

    ``target="validation"`` is for tuning: it evaluates validation clients or ``val`` splits and
    never reads a test client or a test split.
    """

    def __init__(self, cfg: EvalConfig, target: str = "test"):
        if target not in ("test", "validation"):
            raise ValueError(f"evaluation target must be 'test' or 'validation', got {target!r}")
        self.cfg = cfg
        self.target = target

    def client_ids(self, fed: FederatedData) -> list[int]:
        raise NotImplementedError

    def evaluate(self, algorithm: Algorithm, server: ServerState, contexts: dict[int, ClientContext]) -> EvalResult:
        steps = self.cfg.steps if algorithm.finetune_at_eval else 0
        results = [
            personalize_and_evaluate(algorithm, algorithm.predictor(server, ctx), ctx, self.cfg, steps)
            for ctx in contexts.values()
        ]
        return summarise(results)


@PROTOCOLS.register("unseen")
class UnseenClients(Protocol):
    """Held-out clients that never trained (CAFeMe's 20 new clients); validation clients when
    tuning."""

    def client_ids(self, fed: FederatedData) -> list[int]:
        ids = fed.validation_clients if self.target == "validation" else fed.unseen_clients
        if not ids:
            what = "data.validation_fraction" if self.target == "validation" else "data.unseen_fraction"
            raise ValueError(f"the 'unseen' protocol needs held-out clients: set {what} > 0")
        return ids


@PROTOCOLS.register("seen")
class SeenClients(Protocol):
    """The training clients, each with its personalized predictor, on their test split (their
    ``val`` split when tuning)."""

    def __init__(self, cfg: EvalConfig, target: str = "test"):
        if target == "validation":
            cfg = replace(cfg, split="val")
        super().__init__(cfg, target)

    def client_ids(self, fed: FederatedData) -> list[int]:
        missing = [c for c in fed.train_clients if self.cfg.split not in fed.clients[c].splits]
        if missing:
            raise ValueError(f"client {missing[0]} has no {self.cfg.split!r} split: add it to "
                             f"data.client_splits (e.g. {{{self.cfg.split}: 0.1}})")
        return fed.train_clients
