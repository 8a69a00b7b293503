"""Evaluation protocols, separate from the algorithms (DESIGN.md, "Evaluation protocols").

* ``unseen``: held-out clients that never trained start from the method's predictor and, for
  methods that fine-tune at evaluation, take N SGD steps on their train (personalization) split
  with lr_k = lr * gamma ** floor(k / decay_every), evaluating on their test split before every
  step: an accuracy curve over steps 0..N (CAFeMe spec, "Evaluation protocol").
* ``seen``: the training clients, each with its personalized predictor, evaluated on its test
  split (the same fine-tuning applies if ``steps`` > 0).

Every protocol keeps per-client results, and summarises each step both as the unweighted mean over
clients and as the sample-weighted accuracy.

Two paths, chosen like training by the executor's ``execution`` (issue 10):

* ``sequential`` (the reference): one client after the other, :func:`personalize_and_evaluate`.
* ``batched``: :func:`personalize_and_evaluate_batched` runs all evaluated clients together. Their
  predictors are stacked (one parameter set per client; a tensor shared by all clients is passed
  once) and every per-batch computation is ``torch.func.vmap``-ed over clients, never over
  samples: an evaluation batch stays exactly the sequential path's batch (BatchNorm uses its own
  statistics). At each batch position of the evaluation split, the clients whose batches there
  have the same size run as one call (all clients at the positions of full batches; last
  partial batches of equal size together, a lone one without vmap); each fine-tuning step is
  :meth:`Algorithm.finetune_step` vmapped over the clients with equal train batch sizes (all of
  them but short splits). The batches are the sequential path's: the same draws, in the same
  order, from each client's own streams. Hits and losses are summed on the device (float64, in
  the sequential order) and read once at the end.

  Inside vmap, :meth:`Algorithm.logits` and :meth:`Algorithm.finetune_step` get ``client=None``:
  they must be pure tensor functions of their arguments. A method whose hooks read the client
  sets ``eval_batched_fallback`` (a reason) and is evaluated sequentially; CAFeMe with a
  label-conditioned modulator does (see :func:`batched_evaluation_fallback`).
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Callable, Literal

import torch
import torch.nn.functional as F
from torch.func import vmap
from torch.utils._pytree import tree_map

from pfl_core.algorithms.base import Algorithm, ClientContext, HyperParams, ServerState
from pfl_core.data.federated import FederatedData
from pfl_core.engine.plans import _rows
from pfl_core.config import NonNegativeInt, PositiveFloat, PositiveInt
from pfl_core.engine.trees import stack_trees
from pfl_core.errors import DivergenceError
from pfl_core.registry import Registry
from pfl_core.training import Params

if TYPE_CHECKING:
    from pfl_core.engine import Executor

PROTOCOLS: Registry = Registry("evaluation protocol")


@dataclass
class EvalConfig(HyperParams):
    """Settings of an evaluation protocol (both protocols share them)."""

    steps: NonNegativeInt = 0
    """Personalization steps at evaluation for methods that fine-tune (CAFeMe: 50)."""
    lr: PositiveFloat = 0.01
    """Fine-tuning learning rate (CAFeMe: ``lr_ft`` for baselines, ``lr_ft_pfl`` for CAFeMe)."""
    gamma: PositiveFloat = 0.8
    """Multiplicative learning-rate decay (CAFeMe: 0.8)."""
    decay_every: PositiveInt = 5
    """Decay the learning rate after every this many steps (CAFeMe: 5)."""
    batch_size: NonNegativeInt = 0
    """Evaluation batch size; 0 = the federation's training batch size."""
    reduction: Literal["batch_mean", "sample"] = "batch_mean"
    """Client accuracy: ``batch_mean`` = unweighted mean of per-batch accuracies, batches of size 1
    skipped (CAFeMe code); ``sample`` = correct predictions / samples."""
    split: str = "test"
    """The client split evaluated on."""
    val_split: str = ""
    """Also evaluate this client split at every evaluation (e.g. ``val``), its summary keys
    prefixed ``val_`` (``val_acc``, ``val_avg_acc``, ...): the per-round validation history that
    best-validation selection (MetaVers spec, "Model selection") and early stopping read. Empty:
    the evaluated split only. Ignored when tuning (``target: validation`` evaluates ``val``)."""
    nvar: bool = False
    """Protocol ``proto``: also log ``nvar`` of the test embeddings (MetaVers Table 4; spec
    "Evaluation protocol", harness default: :func:`pfl_core.proto_eval.nvar`)."""
    novel_val_split: str = "val"
    """Protocol ``novel_class``: the dataset split holding the validation classes (Table 6)."""
    novel_test_split: str = "test"
    """Protocol ``novel_class``: the dataset split holding the test classes."""
    ways: PositiveInt = 5
    """Protocol ``novel_class``: classes per group (MetaVers code: 5)."""
    users: PositiveInt = 10
    """Protocol ``novel_class``: users per group, one fold of every class each (code: 10)."""
    groups_val: PositiveInt = 500
    """Protocol ``novel_class``: groups per validation evaluation (code: 500)."""
    groups_test: PositiveInt = 1000
    """Protocol ``novel_class``: groups per test evaluation (code: 1000)."""
    epochs: NonNegativeInt = 15
    """Protocol ``finetune_pretrained``: fine-tuning epochs e (FedL2P: 15, and 5 for Tables 2 and 4)."""
    finetune_splits: list[str] = field(default_factory=lambda: ["train"])
    """Protocol ``finetune_pretrained``: the client splits fine-tuned on, joined (FedL2P CIFAR-10:
    ``[train, val]``, all 50 samples, spec diff 7; other datasets ``[train]``)."""
    test_batch_size: PositiveInt = 50
    """Protocol ``finetune_pretrained``: test batch size (FedL2P code: 50)."""
    augment: bool = True
    """Protocol ``finetune_pretrained``: per-sample augmentation of the fine-tuning batches and of
    the meta-net input pass (spec "Data": evaluation path)."""
    clients: Literal["seen", "unseen"] = "seen"
    """Protocol ``finetune_pretrained``: which clients are evaluated, the training clients
    (``seen``) or the held-out ones (``unseen``: Speech Commands' unseen speaker pool, Table 4)."""
    stack_size: NonNegativeInt = 64
    """Protocol ``finetune_pretrained``, batched path: clients per vmapped stack (0: all clients of
    equal batch shapes at once). Memory only (the numbers do not depend on it): a stack trains
    ``stack_size`` x ``batch_size`` images per step and holds their inputs for all its steps."""

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
    arrays: dict[str, dict] = field(default_factory=dict)
    """Per-client arrays by artifact name (numpy arrays; logged as ``<name>.npz`` with the run)."""


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


# -- the batched path -------------------------------------------------------------------------------
def batched_evaluation_fallback(algorithm: Algorithm) -> str | None:
    """None when the batched path can evaluate ``algorithm``; else why it runs sequentially."""
    reason = getattr(algorithm, "eval_batched_fallback", None)
    if reason:
        return reason
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


def _group(step: int, position: int | None, batches: dict[int, torch.Tensor]) -> list[_Call]:
    """The clients of ``batches`` (client position -> index batch) grouped by batch size."""
    groups: dict[int, list[int]] = {}
    for i, batch in batches.items():
        groups.setdefault(int(batch.numel()), []).append(i)
    return [_Call(step, position, members, torch.stack([batches[i] for i in members]))
            for members in groups.values()]


def _plan(contexts: list[ClientContext], cfg: EvalConfig, steps: int) -> list[_Call]:
    """Every batch of the run, drawn on the host before any compute, from each client's streams
    in the sequential path's order (per client: evaluation pass, train batch, evaluation pass,
    ...; clients draw from their own streams, so the order across clients does not matter)."""
    calls = []
    for step in range(steps + 1):
        passes = [ctx.streams[cfg.split].epoch() for ctx in contexts]
        for position in range(max(len(p) for p in passes)):
            batches = {i: p[position] for i, p in enumerate(passes) if position < len(p)}
            if cfg.reduction == "batch_mean":  # batches of one sample are skipped (CAFeMe code)
                batches = {i: b for i, b in batches.items() if b.numel() > 1}
            calls += _group(step, position, batches)
        if step < steps:
            calls += _group(step, None, {i: ctx.next_index("train") for i, ctx in enumerate(contexts)})
    return calls


def _to_device(tensors: list[torch.Tensor], device: torch.device) -> list[torch.Tensor]:
    """``tensors`` (int64, host) moved with one transfer."""
    if not tensors:
        return []
    flat = torch.cat([t.reshape(-1) for t in tensors]).to(device)
    return [part.view(t.shape) for part, t in zip(flat.split([t.numel() for t in tensors]), tensors)]


class _ClientStack:
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


def personalize_and_evaluate_batched(algorithm: Algorithm, params: list[Params],
                                     contexts: list[ClientContext], cfg: EvalConfig,
                                     steps: int) -> list[ClientResult]:
    """:func:`personalize_and_evaluate` of every client of ``contexts`` (starting from
    ``params[i]``) at once: the same batches and the same curves, computed client-stacked (module
    docstring). Every index batch is drawn first and moved to the device at once; the hits and
    losses are summed on the device (float64, in the sequential order) and read once at the end."""
    if not contexts:
        return []
    count = len(contexts)
    clients = _ClientStack(params, contexts)
    device = next(iter(clients.params.values())).device
    calls = _plan(contexts, cfg, steps)
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
        x, y = _rows([contexts[i].dataset for i in call.members], index)
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


def check_finite_results(results: list[ClientResult]) -> None:
    """Raise :class:`DivergenceError` at the first client and step whose evaluation loss is not
    finite (NaN parameters give a finite accuracy from argmax, so the loss is the witness)."""
    for result in results:
        for step, loss in enumerate(result.loss):
            if not math.isfinite(loss):
                raise DivergenceError(f"non-finite evaluation loss ({loss}) of client {result.cid} after "
                                      f"fine-tuning step {step} (0 = before fine-tuning)")


#: the scalar summaries of an evaluation (:func:`summarise`), logged per evaluation round and at the end
SUMMARY_KEYS = ("acc", "acc_weighted", "acc_last3", "acc_last3_weighted", "acc_step0", "eval_loss")


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

    seed: int = 0
    """The run's evaluation seed (stream ``evaluation``), set by :func:`pfl_core.experiment.prepare_run`,
    for protocols that draw (``finetune_pretrained``, ``novel_class``)."""

    def __init__(self, cfg: EvalConfig, target: str = "test"):
        if target not in ("test", "validation"):
            raise ValueError(f"evaluation target must be 'test' or 'validation', got {target!r}")
        self.cfg = cfg
        self.target = target

    def client_ids(self, fed: FederatedData) -> list[int]:
        raise NotImplementedError

    def evaluate(self, algorithm: Algorithm, server: ServerState, contexts: dict[int, ClientContext],
                 executor: "Executor | None" = None, history: list[dict] | None = None) -> EvalResult:
        """Every client's curve; ``executor.execution`` picks the path (default: sequential).
        A non-finite loss at any step (a diverging fine-tuning) raises :class:`DivergenceError`.
        With ``cfg.val_split`` that split is evaluated too, after the test split (whose numbers
        are thus those of a run without it), its summary keys prefixed ``val_``. ``history`` (the
        run's rows so far) is for protocols that depend on it."""
        result = self._evaluate(algorithm, server, contexts, executor)
        if self.cfg.val_split and self.target == "test":
            val = type(self)(replace(self.cfg, split=self.cfg.val_split, val_split=""), self.target)
            val.seed = self.seed  # the same evaluation streams
            after = val._evaluate(algorithm, server, contexts, executor)
            result.summary.update({f"val_{k}": v for k, v in after.summary.items()})
        return result

    def _evaluate(self, algorithm: Algorithm, server: ServerState, contexts: dict[int, ClientContext],
                  executor: "Executor | None") -> EvalResult:
        steps = self.cfg.steps if algorithm.finetune_at_eval else 0
        batched = executor is not None and executor.execution == "batched"
        if batched and batched_evaluation_fallback(algorithm) is None:
            clients = list(contexts.values())
            params = [algorithm.predictor(server, ctx) for ctx in clients]
            results = personalize_and_evaluate_batched(algorithm, params, clients, self.cfg, steps)
        else:
            results = [
                personalize_and_evaluate(algorithm, algorithm.predictor(server, ctx), ctx, self.cfg, steps)
                for ctx in contexts.values()
            ]
        check_finite_results(results)
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
        for split in filter(None, (self.cfg.split, self.target == "test" and self.cfg.val_split)):
            missing = [c for c in fed.train_clients if split not in fed.clients[c].splits]
            if missing:
                raise ValueError(f"client {missing[0]} has no {split!r} split: add it to "
                                 f"data.client_splits (e.g. {{{split}: 0.1}})")
        return fed.train_clients

