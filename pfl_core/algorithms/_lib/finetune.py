"""Fine-tune-then-test of one client from the pretrained model (docs/papers/fedl2p.md,
steps 2-5), the per-client recipe that says how, and the meta-net inputs a recipe may read.

A method personalizes the pretrained model through a :class:`FinetuneRecipe` (its
``finetune_recipe(server, pretrained, inputs, client)``): the KLD-BN mixing ratios beta (one per BN layer),
the learning rates (one per parameter tensor, or one for all), where the client's running statistics
start and whether the test normalises with running (eval mode) or batch statistics (train mode).

Per client (:func:`plan_client` draws everything on the host, :func:`finetune` and
:func:`score_test` are pure tensor code):

1. the client's fine-tuning data (the protocol's ``finetune_splits``) is shuffled every epoch and
   cut into batches of 32 (the last one short), ``ceil(n/32) * e`` steps; every sample is augmented
   on its own (per-sample crop/flip, docs/papers/fedl2p.md, evaluation path) by the protocol's augmentation;
2. ``finetune``: manual SGD w_j <- w_j - eta_j g_j in train mode (KLD-BN: batch statistics mixed
   with the pretrained ones by beta, running statistics updated with momentum 0.1);
3. ``score_test``: the client's test split in a fixed order, batches of 50, in eval mode (train
   mode, batch statistics, for BN I); correct predictions and summed loss.

:func:`finetune_clients` runs many clients: one after the other (``batched=False``, the
reference) or vmapped over stacks of clients whose batch shapes are equal (the pretrained
parameters are passed once, unbatched; each client's buffers, betas and lrs are stacked). Clients
of different sizes are bucketed by their batch shapes rather than padded and masked: a padded
sample would enter the batch statistics of every BN layer.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable, Literal, Sequence

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn
from torch.func import vmap

from pfl_core.batching import epoch_order
from pfl_core.algorithms._lib.meta_inputs import meta_inputs
from pfl_core.models.kld_bn import bn_mode, bn_names, forward_bn, load_pretrained, set_betas
from pfl_core.training import Params, value_and_grad

#: ``{"params": Params, "buffers": {"<bn>.running_mean": ..., "<bn>.running_var": ...}}`` (stage 1)
PretrainedState = dict
Buffers = dict[str, torch.Tensor]
#: per-sample augmented model inputs and labels of dataset rows ``(dataset, index, generator)``,
#: the random draws taken from ``generator`` on the host
Augment = Callable[[object, torch.Tensor, torch.Generator], tuple[torch.Tensor, torch.Tensor]]


@dataclass
class FinetuneRecipe:
    """How one client personalizes the pretrained model (FedL2P contract, "The recipe interface")."""

    betas: torch.Tensor
    """[num_bn] KLD-BN mixing ratios, BN layers in registration order: 1 = client/batch
    statistics, 0 = pretrained statistics (paper Eq. 2)."""
    lrs: list[torch.Tensor] | float | None
    """One learning rate per parameter tensor (``named_parameters`` order; FedL2P's eta = LRNet(x) *
    eta-tilde), one for all, or None: the protocol's ``lr`` (the baselines' FT lr, docs/papers/fedl2p.md)."""
    running_init: Literal["reset", "pretrained"] = "reset"
    """Where the client's running statistics start: ``reset`` = (0, 1), the KLD-BN client of the
    authors' code (docs/papers/fedl2p.md); ``pretrained`` = the pretrained statistics, the plain FT client."""
    test_mode: Literal["eval", "train"] = "eval"
    """``eval``: test with the (beta-mixed) running statistics; ``train``: with each test batch's
    own statistics (FT (BN I), docs/papers/fedl2p.md)."""
    finetune: bool = True
    """False: test the pretrained model without any fine-tuning step (Global Accuracy, Tables 2, 4)."""
    skip_nonfinite: bool = False
    """True: a step whose loss is NaN/inf leaves the parameters as they are (its train-mode forward
    has moved the running statistics already), as the FedL2P client's evaluation does; the plain
    FT client does not skip (docs/papers/fedl2p.md)."""


@dataclass
class MetaInputs:
    """A client's meta-net inputs, computed once on its fine-tuning data (docs/papers/fedl2p.md)."""

    xi: torch.Tensor
    """[num_bn] BNNet input: per BN layer, the channel mean of the symmetric KL divergence between
    the client's and the pretrained feature statistics (paper Eq. 3)."""
    lr_stats: torch.Tensor
    """[2M] LRNet input: mean and SD of each learnable module's input (paper Eq. 4)."""


def pretrained_state(server: dict, model: nn.Module) -> PretrainedState:
    """The stage-1 state a stage-2 run personalizes: ``server["pretrained"]`` when the run was
    given one (``model.pretrained``), else the server's parameters with the model's own BN running
    statistics (a run without a stage 1: its freshly built model)."""
    if "pretrained" in server:
        return server["pretrained"]
    buffers = {name: b.detach().clone() for name, b in model.named_buffers()
               if name.rsplit(".", 1)[-1] in ("running_mean", "running_var")}
    return {"params": server["params"], "buffers": buffers}


def client_meta_inputs(model: nn.Module, state: PretrainedState, batches: Sequence[torch.Tensor],
                       start: tuple[Params, Buffers] | None = None) -> MetaInputs:
    """The meta-net inputs of one client's ``batches`` on the pretrained model (init mode,
    :func:`pfl_core.algorithms._lib.meta_inputs.meta_inputs`); ``start``: ``load_pretrained(model, state)`` if
    already at hand (many clients)."""
    params, buffers = start or load_pretrained(model, state)
    with torch.no_grad():
        xi, x = meta_inputs(model, params, buffers, batches)
    return MetaInputs(xi, x)


def lr_tree(recipe: FinetuneRecipe, params: Params, default_lr: float) -> Params:
    """The recipe's learning rates as one 0-d tensor per parameter name."""
    lrs = default_lr if recipe.lrs is None else recipe.lrs
    like = next(iter(params.values()))
    if isinstance(lrs, (int, float)):
        return {name: torch.tensor(float(lrs), dtype=like.dtype, device=like.device) for name in params}
    lrs = list(lrs)
    if len(lrs) != len(params):
        raise ValueError(f"FinetuneRecipe.lrs has {len(lrs)} learning rates; the model has {len(params)} "
                         "parameter tensors (one lr per tensor, in named_parameters order)")
    return {name: torch.as_tensor(lr, dtype=like.dtype, device=like.device).reshape(())
            for name, lr in zip(params, lrs)}


# -- the pure part --------------------------------------------------------------------------------
def finetune(model: nn.Module, params: Params, buffers: Buffers, lrs: Params,
             xs: Sequence[torch.Tensor], ys: Sequence[torch.Tensor],
             skip_nonfinite: bool = False) -> tuple[Params, Buffers]:
    """One SGD step per batch of ``xs``/``ys``, in train mode: w_j <- w_j - lrs[j] g_j; the BN
    running statistics follow each batch (momentum 0.1). ``skip_nonfinite``: a step whose loss is
    not finite keeps the parameters (:attr:`FinetuneRecipe.skip_nonfinite`). Pure: runs under ``vmap``."""

    def loss_fn(p, b, x, y):
        logits, new_buffers = forward_bn(model, p, b, x)
        return F.cross_entropy(logits, y), new_buffers

    with bn_mode(model, "train"):
        for x, y in zip(xs, ys):
            grads, (loss, buffers) = value_and_grad(loss_fn, params, buffers, x, y, has_aux=True)
            new = {name: p - lrs[name] * grads[name] for name, p in params.items()}
            if skip_nonfinite:
                ok = torch.isfinite(loss)
                new = {name: torch.where(ok, new[name], p) for name, p in params.items()}
            params = new
    return params, buffers


@torch.no_grad()
def score_test(model: nn.Module, params: Params, buffers: Buffers, xs: Sequence[torch.Tensor],
                ys: Sequence[torch.Tensor], test_mode: str = "eval") -> tuple[torch.Tensor, torch.Tensor]:
    """(correct predictions, summed cross-entropy) over the test batches; ``test_mode`` ``train``
    normalises each batch with its own statistics (the running statistics are left as they are)."""
    correct = torch.zeros((), dtype=torch.int64, device=ys[0].device)
    loss = torch.zeros((), dtype=torch.float64, device=ys[0].device)
    with bn_mode(model, test_mode):
        for x, y in zip(xs, ys):
            logits, _ = forward_bn(model, params, buffers, x)
            correct = correct + (logits.argmax(-1) == y).sum()
            loss = loss + F.cross_entropy(logits, y, reduction="sum").double()
    return correct, loss


def finetune_and_test(model: nn.Module, params: Params, buffers: Buffers, lrs: Params, train, test,
                      recipe: FinetuneRecipe) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`finetune` on ``train`` = (xs, ys), then :func:`score_test` on ``test`` = (xs, ys),
    as ``recipe`` says (its test mode and non-finite rule; betas and lrs are in ``buffers``, ``lrs``)."""
    params, buffers = finetune(model, params, buffers, lrs, *train, skip_nonfinite=recipe.skip_nonfinite)
    return score_test(model, params, buffers, *test, test_mode=recipe.test_mode)


# -- the host part --------------------------------------------------------------------------------
def _seed(*key: int) -> int:
    return int(np.random.SeedSequence(list(key)).generate_state(1)[0])


def epoch_batches(index: torch.Tensor, batch_size: int, generator: torch.Generator,
                  weights: torch.Tensor | None = None) -> list[torch.Tensor]:
    """One shuffled pass over ``index`` in batches of ``batch_size``, the last one short; with
    ``weights`` len(index) draws with replacement (:func:`pfl_core.batching.epoch_order`)."""
    return list(epoch_order(index, generator, weights).split(batch_size))


@dataclass
class ClientPlan:
    """Every index batch of one client's evaluation, drawn before any compute: ``meta`` (one
    shuffled epoch for the meta-net inputs), ``train`` (the fine-tuning steps), ``test`` (fixed
    order), and the seeds of the augmentation of the meta pass and of the fine-tuning batches.
    Inputs are gathered (and augmented) per stack of clients by :meth:`inputs`, never all at once."""

    cid: int
    meta: list[torch.Tensor]
    train: list[torch.Tensor]
    test: list[torch.Tensor]
    augment_seeds: tuple[int, int]
    group: str = ""

    @property
    def shape(self) -> tuple:
        """The batch sizes of the plan: clients with equal shapes share one vmapped computation."""
        return tuple(b.numel() for b in self.train), tuple(b.numel() for b in self.test)

    @property
    def num_test(self) -> int:
        return sum(b.numel() for b in self.test)

    def inputs(self, dataset, part: str, augment: Augment | None = None) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """(inputs, labels) of every batch of ``part`` (meta, train, test); meta and train batches
        augmented by ``augment`` from their own seeded generator (the same draws on every call)."""
        if augment is None or part == "test":
            batches = [dataset.batch(index) for index in getattr(self, part)]
        else:
            generator = torch.Generator().manual_seed(self.augment_seeds[part == "train"])
            batches = [augment(dataset, index, generator) for index in getattr(self, part)]
        return [x for x, _ in batches], [y for _, y in batches]


def plan_client(cid: int, finetune_index: torch.Tensor, test_index: torch.Tensor, epochs: int, batch_size: int,
                test_batch_size: int, seed: int, group: str = "", weights: torch.Tensor | None = None) -> ClientPlan:
    """The client's batches (module docstring, step 1), from its own streams of ``seed`` (the run's
    evaluation seed) and its id, so every method sees the same batches: one epoch for the meta-net
    inputs, then ``epochs`` epochs of fine-tuning, each shuffled anew (``weights``: class-balanced
    draws with replacement, evaluation ``balanced``)."""
    generator = torch.Generator().manual_seed(_seed(seed, cid))
    meta = epoch_batches(finetune_index, batch_size, generator, weights)
    train = [b for _ in range(epochs) for b in epoch_batches(finetune_index, batch_size, generator, weights)]
    test = list(test_index.split(test_batch_size))
    return ClientPlan(cid, meta, train, test, (_seed(seed, cid, 1), _seed(seed, cid, 2)), group)


@dataclass
class ClientOutcome:
    cid: int
    correct: int
    total: int
    loss: float
    group: str = ""


class _Starts:
    """The clients' start states: the pretrained parameters once per ``running_init`` (shared by
    every client, never copied per client) and each client's buffers with its own betas."""

    def __init__(self, model: nn.Module, state: PretrainedState):
        self.model, self.state, self.base = model, state, {}
        self.names = bn_names(model)

    def __call__(self, recipe: FinetuneRecipe) -> tuple[Params, Buffers]:
        if recipe.running_init not in self.base:
            self.base[recipe.running_init] = load_pretrained(self.model, self.state, recipe.running_init)
        params, buffers = self.base[recipe.running_init]
        betas = torch.as_tensor(recipe.betas).reshape(-1)
        if betas.numel() != len(self.names):
            raise ValueError(f"FinetuneRecipe.betas has {betas.numel()} values; the model has {len(self.names)} "
                             "BN layers")
        like = next(iter(params.values()))
        return params, set_betas(buffers, self.names, betas.to(device=like.device, dtype=like.dtype))


def client_start(model: nn.Module, state: PretrainedState, recipe: FinetuneRecipe) -> tuple[Params, Buffers]:
    """The pretrained parameters and the client's BN buffers: running statistics per
    ``recipe.running_init``, pretrained statistics as ``init_running_*``, each BN's ``beta``."""
    return _Starts(model, state)(recipe)


def finetune_clients(model: nn.Module, state: PretrainedState, dataset, plans: list[ClientPlan],
                     recipes: list[FinetuneRecipe], default_lr: float, augment: Augment | None = None,
                     batched: bool = False, stack_size: int = 0) -> list[ClientOutcome]:
    """Fine-tune and test every client of ``plans`` with its recipe (module docstring). The batched
    path groups the clients whose plans have equal batch shapes and recipes equal ``running_init``,
    ``test_mode``, ``finetune`` and ``skip_nonfinite``, and vmaps :func:`finetune_and_test` over stacks of at most
    ``stack_size`` of them (0: the whole group), the pretrained parameters passed once; a stack's
    inputs are gathered when it runs. Counts are read from the device once, at the end."""
    starts = _Starts(model, state)
    counts: list[tuple[torch.Tensor, torch.Tensor] | None] = [None] * len(plans)

    def data(k: int) -> tuple:
        recipe = recipes[k]
        train = plans[k].inputs(dataset, "train", augment) if recipe.finetune else ([], [])
        return train, plans[k].inputs(dataset, "test")

    def run(members: list[int]) -> None:
        recipe = recipes[members[0]]  # a group shares all of its recipe but betas and lrs
        params = starts(recipe)[0]
        if len(members) == 1 or not batched:
            for k in members:
                buffers = starts(recipes[k])[1]
                counts[k] = finetune_and_test(model, params, buffers, lr_tree(recipes[k], params, default_lr),
                                              *data(k), recipe)
            return
        stack = lambda trees: {key: torch.stack([t[key] for t in trees]) for key in trees[0]}
        buffers = stack([starts(recipes[k])[1] for k in members])
        lrs = stack([lr_tree(recipes[k], params, default_lr) for k in members])
        per_client = [data(k) for k in members]
        # [part][xs|ys][batch] -> stacked over the members
        train, test = ([[torch.stack(column) for column in zip(*(c[part][j] for c in per_client))] for j in (0, 1)]
                       for part in (0, 1))
        fn = lambda b, lr, tr, te: finetune_and_test(model, params, b, lr, tr, te, recipe)
        correct, loss = vmap(fn)(buffers, lrs, train, test)
        for pos, k in enumerate(members):
            counts[k] = (correct[pos], loss[pos])

    groups: dict[tuple, list[int]] = {}
    for i, (plan, recipe) in enumerate(zip(plans, recipes)):
        key = (plan.shape, recipe.running_init, recipe.test_mode, recipe.finetune, recipe.skip_nonfinite)
        groups.setdefault(key, []).append(i)
    for members in groups.values():
        size = stack_size or len(members)
        for start in range(0, len(members), size):
            run(members[start:start + size])
    read = torch.stack([torch.stack([c.double(), l]) for c, l in counts]).cpu()  # one host read
    return [ClientOutcome(p.cid, int(read[i, 0]), p.num_test, float(read[i, 1]), p.group)
            for i, p in enumerate(plans)]


def pooled_accuracy(outcomes: list[ClientOutcome]) -> float:
    """100 * sum of correct / sum of test samples over clients (the number the paper reports)."""
    return 100.0 * sum(o.correct for o in outcomes) / max(sum(o.total for o in outcomes), 1)


def mean_accuracy(outcomes: list[ClientOutcome]) -> float:
    """The unweighted mean over clients of 100 * correct / test samples."""
    return sum(100.0 * o.correct / o.total for o in outcomes) / len(outcomes) if outcomes else math.nan
