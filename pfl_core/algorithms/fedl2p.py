"""FedL2P: federated learning of meta-nets that personalize a pretrained model (paper Algorithms 1-2;
docs/papers/fedl2p.md).

lambda = {BNNet, LRNet, eta-tilde} (:class:`pfl_core.models.metanets.MetaNets`) is what the server
federates; the pretrained backbone (contract "Pretrained state") is fixed and never sent back.

**ClientFit** (one sampled client, :meth:`FedL2P.local_update`), exactly as the code:

1. xi and x (:func:`pfl_core.algorithms._lib.meta_inputs.meta_inputs`) once, on the client's train data.
2. K = ``outer_epochs`` x ceil(|val| / B) outer steps. Each restarts from the pretrained weights
   with the client's BN running statistics at (0, 1) (docs/papers/fedl2p.md), sets beta = BNNet(xi)
   on the KLD-BN layers and eta = LRNet(x) * eta-tilde.
3. Inner loop: S = ``inner_epochs`` x ceil(|train| / B) plain-SGD steps in train mode on one train
   stream, reshuffled every epoch, cycled and running on across the outer steps (docs/papers/fedl2p.md: 40
   samples give batches of 32, 8, 32, ...), each batch augmented
   with ONE crop offset and flip for all its images (``meta_augment``, the code's ``jit_augment``;
   the meta-net inputs too, val batches never). Only the last step keeps
   the graph, through eta (its gradient is detached); a step whose loss exceeds 100 has its
   gradient clamped to +-0.5.
4. Eval mode: L_V on the next val batch, L_T on the next (fresh) train batch.
5. Meta-gradient: ``ift`` - the Neumann implicit term (:mod:`pfl_core.algorithms._lib.hypergradient`) for every
   part of lambda, plus the direct dL_V/dlambda for BNNet only (through beta); ``fomaml`` (FOMAML+,
   paper Table 8 / Appendix: FOMAML extended with the Eq. 9-10 trick so that learning rates get a
   gradient) - dL_V/dlambda through beta and the last inner step alone, no L_T batch drawn (the
   code's ``outer_loss.backward()``).
6. Each meta-gradient clamped to [-1, 1], one plain SGD step (lrs 1e-3 BNNet, 1e-3 LRNet, 1e-4
   eta-tilde). A step whose L_V or L_T is not finite is skipped (the code's ``continue``).
7. Upload lambda with n = |val| and L_V averaged over the K steps (weighted by batch size).

**Server** (:meth:`FedL2P.aggregate`): lambda <- the |val|-weighted mean (``weighting``); the round's
loss is the unweighted client mean of L_V (``round/val_loss``); the lambda of the round with the
lowest loss is kept as ``best_lambda`` (paper: "we save the lambda value that leads to the lowest
validation loss"), and training stops once ``round - best_round >= patience`` (the code). The
predictor of the evaluation (:meth:`FedL2P.finetune_recipe`) uses the best lambda.

**L2P** (:mod:`pfl_core.algorithms.l2p`, code switch ``federated_learning: false``): the same client
program, but each client keeps its own lambda in its state and uploads nothing.

The pretrained state: :attr:`Algorithm.pretrained` (set by the experiment from ``model.pretrained``),
else the model's initial parameters and BN statistics (tests, runs without a stage 1).
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Annotated, ClassVar, Literal

import torch
import torch.nn.functional as F
from torch.func import functional_call

from pfl_core.algorithms import METHODS
from pfl_core.algorithms.base import Algorithm
from pfl_core.batching import cycled_batches, epoch_order
from pfl_core.engine.contract import ClientContext, ClientUpdate, ServerState
from pfl_core.engine.plans import Drawn, augmented_rows
from pfl_core.fields import HyperParams, Tune
from pfl_core.fields import NonNegativeFloat, NonNegativeInt, PositiveFloat, PositiveInt, Probability
from pfl_core.algorithms._lib.finetune import FinetuneRecipe
from pfl_core.algorithms._lib.hypergradient import NeumannScaling, implicit_hypergradient, tree_detach
from pfl_core.algorithms._lib.meta_augment import augment_batch, draw_shared
from pfl_core.algorithms._lib.meta_inputs import meta_inputs
from pfl_core.models.kld_bn import (bn_mode, bn_names, forward_bn, load_pretrained, model_buffers,
                                    running_stats, set_betas)
from pfl_core.models.metanets import MetaNets
from pfl_core.models.resnet import learnable_modules
from pfl_core.training import Params


META_LR = Tune(1e-5, 1e-1, log=True)
"""Tuning range of FedL2P's meta-net SGD learning rates (harness choice around the paper's BNNet
and LRNet 1e-3; eta-tilde's range, around 1e-4, is a decade lower)."""


@dataclass
class FedL2PHyper(HyperParams):
    bn_net: bool = True
    """Learn BNNet (beta = BNNet(xi)); False: beta = ``fixed_beta`` (Table 5, "+FedL2P (LRNet)")."""
    lr_net: bool = True
    """Learn LRNet and eta-tilde (eta = LRNet(x) * eta-tilde); False: every tensor's lr is
    ``inner_lr`` (Table 5, "+FedL2P (BNNet)")."""
    fixed_beta: Probability | None = None
    """beta of every BN layer when ``bn_net`` is False (Table 5: 1 or 0; code ``fixed_beta``)."""
    hypergradient: Literal["ift", "fomaml"] = "ift"
    """``ift``: paper Algorithm 2 (Neumann IFT). ``fomaml``: FOMAML+ of Table 8 (module docstring)."""
    neumann_scaling: NeumannScaling = "paper"
    """``paper``: p = sum_j (I - psi H)^j v as Algorithm 2 and the code; ``textbook``: times psi
    (docs/papers/fedl2p.md: the paper's implicit term is 1/psi = 10x the textbook estimate)."""
    neumann_steps: NonNegativeInt = 3
    """Q, Neumann terms (paper Algorithm 2, code ``truncate_iter``)."""
    neumann_psi: PositiveFloat = 0.1
    """psi, the Neumann step (code ``Hypergrad.learning_rate``)."""
    inner_epochs: PositiveInt = 15
    """e: inner steps = e x ceil(|train| / B) (the suites' per-dataset values: 15; Speech Commands 5)."""
    outer_epochs: PositiveInt = 3
    """K = outer_epochs x ceil(|val| / B) outer steps: three epochs of the val set (docs/papers/fedl2p.md)."""
    lr_bnnet: Annotated[PositiveFloat, META_LR] = 1e-3
    """Plain SGD lr of BNNet (code ``bn_net_lr``)."""
    lr_lrnet: Annotated[PositiveFloat, META_LR.at(1)] = 1e-3
    """Plain SGD lr of LRNet (code ``lr_net_lr``)."""
    lr_eta: Annotated[PositiveFloat, Tune(META_LR.low / 10, META_LR.high / 10, log=True, order=2)] = 1e-4
    """Plain SGD lr of eta-tilde (hard-coded 1e-4 in the code's client)."""
    eta_init: float = 1e-3
    """eta-tilde's initial value: 1e-3 CIFAR-10/10-C, 1e-2 Office, DomainNet, Speech Commands."""
    inner_lr: PositiveFloat = 1e-3
    """The fixed inner/fine-tuning lr when ``lr_net`` is False (code ``start_inner_lr`` = the FT lr)."""
    meta_clip: NonNegativeFloat = 1.0
    """Clamp every meta-gradient elementwise to [-meta_clip, meta_clip] (code
    ``clamp_outer_gradients``: 1); 0 turns it off."""
    inner_loss_threshold: PositiveFloat = 100.0
    """An inner step whose loss exceeds this has its gradient clamped (the code's "hotfix")."""
    inner_grad_clip: PositiveFloat = 0.5
    """... elementwise to [-inner_grad_clip, inner_grad_clip]."""
    meta_augment: Literal["crop_flip", "flip_rotate", "none"] = "crop_flip"
    """Meta-training augmentation of train batches, one draw shared by the whole batch (the code's
    ``jit_augment``): ``crop_flip`` = RandomCrop(padding ``augment_padding``) + RandomHorizontalFlip
    (CIFAR-10/10-C, docs/papers/fedl2p.md); ``flip_rotate`` = RandomHorizontalFlip + RandomRotation(+-30)
    (Office-Caltech-10, DomainNet: docs/papers/fedl2p.md, :mod:`pfl_core.data.augment.flip_rotate`);
    ``none`` (Speech Commands, whose ``jit_augment`` is the identity, ``src/data/commands_dataset.py``
    L30-31: its per-item time shift and noise are ``data.augment: speech``)."""
    augment_padding: PositiveInt = 4
    """Zero padding (in [0, 1] pixel space) of the random crop."""
    weighting: Literal["val", "uniform"] = "val"
    """Server mean of lambda weighted by |val| (the code, docs/papers/fedl2p.md) or uniform."""
    patience: NonNegativeInt = 50
    """Stop once round - best_round >= patience (code; CIFAR-10 50, CIFAR-10-C 100); 0: never."""


@METHODS.register("fedl2p")
class FedL2P(Algorithm):
    """FedL2P on a model with KLD-BN layers (``resnet18_cifar``, ``resnet18_audio``, ``resnet18_imagenet``)."""

    hyper_class = FedL2PHyper
    keeps_bn_state = True
    #: False: each client learns its own lambda (L2P)
    federated: ClassVar[bool] = True
    #: streams augmented per item by ``data.augment`` (the code's Speech Commands train loader,
    #: ``src/data/speech_commands.py`` L263-265; val batches never: its "validation" subset)
    train_streams = ("inner", "ltrain")

    def __init__(self, model, hp):
        super().__init__(model, hp)
        name = type(self).__name__
        if not hp.bn_net and not hp.lr_net:
            raise ValueError(f"{name}: bn_net and lr_net are both off: nothing to learn (set one true)")
        if not hp.bn_net and hp.fixed_beta is None:
            raise ValueError(f"{name}: bn_net: false needs fixed_beta (1: client statistics, 0: pretrained)")
        if hp.bn_net and hp.fixed_beta is not None:
            raise ValueError(f"{name}: fixed_beta applies only with bn_net: false (BNNet gives beta)")
        self.bn_layers = bn_names(model)
        if not self.bn_layers:
            raise ValueError(f"{name} needs a model with KLD-BatchNorm layers (resnet18_cifar, resnet18_audio, "
                             "resnet18_imagenet)")
        self.param_names = [n for n, _ in model.named_parameters()]
        with torch.random.fork_rng(devices=[]):  # the template must not move the run's global RNG
            self.meta_nets = MetaNets(len(self.bn_layers), len(learnable_modules(model)), len(self.param_names),
                                      hp.eta_init, hp.bn_net, hp.lr_net)

    # -- server ---------------------------------------------------------------------------------
    def init_lambda(self, like: torch.Tensor) -> Params:
        """lambda's initial tensors (docs/papers/fedl2p.md: xavier_normal gain 0.1, biases 0.5 / 1.0,
        eta-tilde = eta_init), drawn from the method's own seed."""
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(self.seed)
            nets = MetaNets(len(self.bn_layers), len(learnable_modules(self.model)), len(self.param_names),
                            self.hp.eta_init, self.hp.bn_net, self.hp.lr_net)
        lam = {n: p.detach().to(like) for n, p in nets.named_parameters()}
        if "eta_tilde" in lam:  # exactly eta_init in the run's dtype
            lam["eta_tilde"] = torch.full_like(lam["eta_tilde"], self.hp.eta_init)
        return lam

    def init_server(self, params: Params) -> ServerState:
        state = self.pretrained
        if state is None:
            state = {"params": params, "buffers": running_stats(self.model, model_buffers(self.model))}
        start_params, start_buffers = load_pretrained(self.model, state, "reset")
        lam = self.init_lambda(next(iter(start_params.values())))
        return {"params": start_params, "buffers": start_buffers, "pretrained": state, "lambda": lam,
                "best_lambda": lam, "best_loss": math.inf, "best_round": 0, "round": 0, "val_loss": math.nan}

    def aggregation_weights(self, updates: list[ClientUpdate]) -> list[float]:
        return [float(u.num_samples) if self.hp.weighting == "val" else 1.0 for u in updates]

    def aggregate(self, server: ServerState, updates: list[ClientUpdate]) -> ServerState:
        """lambda's weighted mean; the round's loss (unweighted client mean of L_V) and the best
        lambda so far."""
        average = self.average_uploads(updates)
        lam = server["lambda"] if average is None else average
        loss = float(torch.stack([u.loss for u in updates]).mean())
        rnd = server["round"] + 1
        new = {**server, "lambda": lam, "round": rnd, "val_loss": loss}
        if loss < server["best_loss"]:
            new.update(best_lambda=lam, best_loss=loss, best_round=rnd)
        return new

    def round_metrics(self, server: ServerState) -> dict[str, float]:
        return {"val_loss": server["val_loss"], "best_round": float(server["best_round"])}

    def stop_after_round(self, server: ServerState) -> bool:
        """The code's early stopping: ``rnd - best_rnd >= patience`` at the end of each round."""
        return self.hp.patience > 0 and server["round"] - server["best_round"] >= self.hp.patience

    def run_info(self, server: ServerState) -> dict:
        return {"best_round": server["best_round"], "best_val_loss": server["best_loss"]}

    # -- meta-nets ------------------------------------------------------------------------------
    def betas_and_lrs(self, lam: Params, xi: torch.Tensor, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        """(beta per BN layer, eta per parameter tensor or None = ``inner_lr`` for all)."""
        betas, lrs = functional_call(self.meta_nets, lam, (xi, x))
        if betas is None:
            betas = torch.full((len(self.bn_layers),), float(self.hp.fixed_beta), dtype=xi.dtype, device=xi.device)
        return betas, lrs

    def input_draws(self, client: ClientContext) -> list[tuple[torch.Tensor, object]]:
        """The random part of :meth:`client_inputs`: the train split in batches of B, in split
        order (the statistics do not depend on the order; with ``data.balanced_sampler`` one
        class-balanced draw), each with its items' ``data.augment`` draw (Speech Commands; None
        without)."""
        stream = client.streams["train"]
        index = client.client.splits["train"]
        if stream.weights is not None:  # the code's balanced train loader (client L251: precompute_kld)
            index = epoch_order(index, stream.generator, stream.weights)
        parts = torch.split(index, stream.batch_size)
        # data.augment: the code's per-item transform of its train loader (client L246-251)
        return [(i, None if client.augment is None else client.augment.draw(i.numel())) for i in parts]

    def client_inputs(self, server: ServerState, client: ClientContext, augment: dict | None = None,
                      inputs: list | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """(xi, x) of the client's train split: the batches of ``inputs`` (:meth:`input_draws`;
        drawn here when not given, as analyses do), batch i augmented with the shared draw i of
        ``augment["inputs"]`` (``meta_augment``)."""
        parts = self.input_draws(client) if inputs is None else inputs
        batches = [client.dataset.batch(i)[0] if item is None else augmented_rows(client.dataset, i, item)[0]
                   for i, item in parts]
        if augment is not None:
            batches = [augment_batch(x, augment["inputs"], i, augment["pad"], self.hp.augment_padding)
                       for i, x in enumerate(batches)]
        with torch.no_grad():
            return meta_inputs(self.model, server["params"], server["buffers"], batches)

    def meta_outputs(self, lam: Params, xi: torch.Tensor, x: torch.Tensor) -> dict[str, torch.Tensor]:
        """A client's ``xi``, ``x``, ``beta`` and ``eta`` (one per parameter tensor; ``inner_lr``
        everywhere without LRNet) under ``lam``: the arrays of Table 6 and Figures 2-5."""
        with torch.no_grad():
            betas, lrs = self.betas_and_lrs(lam, xi, x)
            if lrs is None:
                lrs = torch.full((len(self.param_names),), self.hp.inner_lr, dtype=xi.dtype, device=xi.device)
        return {"xi": xi, "x": x, "beta": betas, "eta": lrs}

    def personal_lambda(self, server: ServerState, client: ClientContext | None) -> Params:
        """The lambda a client personalizes with: the best round's (FedL2P)."""
        return server["best_lambda"]

    def finetune_recipe(self, server: ServerState, pretrained, inputs, client: ClientContext | None = None):
        """The contract's recipe: betas = BNNet(xi), lrs = LRNet(x) * eta-tilde of the best lambda
        (L2P: the client's own; ``inputs``: ``MetaInputs(xi, lr_stats)`` or a tuple ``(xi, x)``);
        running statistics reset to (0, 1), eval-mode test, NaN/inf fine-tuning steps skipped as
        the FedL2P client does (docs/papers/fedl2p.md)."""

        xi, x = (inputs.xi, inputs.lr_stats) if hasattr(inputs, "xi") else inputs
        lam = self.personal_lambda(server, client)
        out = self.meta_outputs(lam, xi, x)
        lrs = list(out["eta"]) if self.hp.lr_net else self.hp.inner_lr
        return FinetuneRecipe(betas=out["beta"], lrs=lrs, running_init="reset", test_mode="eval", skip_nonfinite=True)

    # -- the client program ---------------------------------------------------------------------
    def steps(self, client: ClientContext) -> tuple[int, int, int]:
        """(B, S inner steps, K outer steps) of the client."""
        if "val" not in client.client.splits:
            raise ValueError(f"{type(self).__name__} needs a val split per client (client {client.cid} has "
                             f"{sorted(client.client.splits)}): set data.client_val_fraction (FedL2P: 0.2)")
        b = client.streams["train"].batch_size
        inner = self.hp.inner_epochs * math.ceil(client.num_samples("train") / b)
        outer = self.hp.outer_epochs * math.ceil(client.num_samples("val") / b)
        return b, inner, outer

    def start_lambda(self, server: ServerState, client: ClientContext) -> Params:
        return server["lambda"]

    def carry_in(self, server: ServerState, client: ClientContext, round_idx: int,
                 drawn: dict | None = None) -> dict:
        augment = drawn["augment"]
        if augment is not None:  # the normalized black image of the crop padding
            like = next(iter(server["params"].values()))
            pad = torch.zeros(1, *client.dataset.input_shape, dtype=like.dtype, device=like.device)
            augment = {**augment, "pad": client.dataset.normalize(pad)}
        xi, x = self.client_inputs(server, client, augment, drawn["inputs"])
        carry = {"lambda": self.start_lambda(server, client), "params": server["params"],
                 "buffers": server["buffers"], "xi": xi, "x": x}
        if augment is not None:
            carry["augment"] = {k: augment[k] for k in ("inner", "ltrain", "pad")}
        return carry

    def draw_augment(self, client: ClientContext) -> dict | None:
        """Host-side crop/flip (or flip/rotation) draws, one per batch, from the client's train-stream
        generator: ``inputs`` (meta-net input batches), ``inner`` (K x S) and ``ltrain`` (K).
        None with ``meta_augment: none``."""
        if self.hp.meta_augment == "none":
            return None
        b, inner, outer = self.steps(client)
        counts = {"inputs": math.ceil(client.num_samples("train") / b), "inner": outer * inner,
                  "ltrain": outer if self.hp.hypergradient == "ift" else 0}
        return {name: draw_shared(self.hp.meta_augment, count, client.streams["train"].generator,
                                  self.hp.augment_padding) for name, count in counts.items()}

    def draw(self, client: ClientContext, round_idx: int) -> Drawn:
        """Per outer step: S inner batches and (IFT) one L_T batch from one cycled train stream,
        one val batch from a cycled val stream; both streams start a fresh epoch each round. Drawn
        before them from the same train generator, in this order (the pinned numbers depend on it):
        the ``meta_augment`` draws, then the meta-net input batches; both reach ``carry_in``."""
        augment, inputs = self.draw_augment(client), self.input_draws(client)
        b, inner, outer = self.steps(client)
        stream = client.streams["train"]  # class-balanced with data.balanced_sampler; val never (the code)
        train = cycled_batches(client.client.splits["train"], b, stream.generator, stream.weights)
        val = cycled_batches(client.client.splits["val"], b, client.streams["val"].generator)
        plan: dict[str, list[torch.Tensor]] = {"inner": [], "ltrain": [], "val": []}
        for _ in range(outer):
            plan["inner"] += [next(train) for _ in range(inner)]
            if self.hp.hypergradient == "ift":
                plan["ltrain"].append(next(train))
            plan["val"].append(next(val))
        return Drawn(plan, {"augment": augment, "inputs": inputs})

    def local_update(self, carry, batches, masks):
        xs, ys = batches["inner"]
        vx, vy = batches["val"]
        tx, ty = batches["ltrain"]
        outer = len(vy)
        inner = len(ys) // outer
        lam = carry["lambda"]
        draws = carry.get("augment", {})
        aug = lambda x, stream, i: augment_batch(x, draws.get(stream), i, draws.get("pad"), self.hp.augment_padding)
        loss_sum = count = 0.0
        for k in range(outer):
            steps = [(aug(xs[i], "inner", i), ys[i]) for i in range(k * inner, (k + 1) * inner)]
            ltrain = (aug(tx[k], "ltrain", k), ty[k]) if self.hp.hypergradient == "ift" else None
            grads, val_loss, ok = self.meta_gradient(lam, carry, steps, (vx[k], vy[k]), ltrain)
            lam = {n: torch.where(ok, t - self.meta_lr(n) * self.clip(grads[n]), t) for n, t in lam.items()}
            n = vy[k].shape[-1]
            loss_sum = loss_sum + torch.where(ok, val_loss * n, torch.zeros_like(val_loss))
            count = count + torch.where(ok, torch.full_like(val_loss, n), torch.zeros_like(val_loss))
        return {"lambda": lam}, loss_sum / count

    def carry_out(self, server: ServerState, client: ClientContext, carry, loss) -> ClientUpdate:
        if self.federated:
            return ClientUpdate(carry["lambda"], client.num_samples("val"), loss)
        client.state["lambda"] = carry["lambda"]
        return ClientUpdate(None, client.num_samples("val"), loss)

    # -- ClientFit's pieces (pure tensor code) --------------------------------------------------
    def meta_lr(self, name: str) -> float:
        """The plain-SGD lr of lambda's tensor ``name`` (by its part)."""
        part = name.split(".", 1)[0]
        return {"bn_net": self.hp.lr_bnnet, "lr_net": self.hp.lr_lrnet, "eta_tilde": self.hp.lr_eta}[part]

    def clip(self, grad: torch.Tensor) -> torch.Tensor:
        """A meta-gradient clamped elementwise to [-meta_clip, meta_clip] (0: unclamped)."""
        c = self.hp.meta_clip
        return grad.clamp(-c, c) if c > 0 else grad

    def inner_loop(self, lam: Params, carry: dict, steps: list) -> tuple[Params, Params, Params]:
        """Train-mode SGD from the pretrained weights with beta and eta of ``lam`` held fixed:
        (weights before the last step, the last step's detached gradient, BN buffers after it)."""
        betas, lrs = self.betas_and_lrs(tree_detach(lam), carry["xi"], carry["x"])
        lrs = self.lr_tree(lrs)
        buffers = set_betas(carry["buffers"], self.bn_layers, betas)
        w = dict(carry["params"])

        def loss_fn(p, b, x, y):
            logits, new_buffers = forward_bn(self.model, p, b, x)
            return F.cross_entropy(logits, y), new_buffers

        grads = None
        with bn_mode(self.model, "train"):
            for x, y in steps:
                if grads is not None:
                    w = {n: w[n] - lrs[n] * grads[n] for n in w}
                grads, (loss, buffers) = torch.func.grad_and_value(loss_fn, has_aux=True)(w, buffers, x, y)
                buffers = tree_detach(buffers)
                clip = self.hp.inner_grad_clip
                big = loss.detach() > self.hp.inner_loss_threshold
                grads = {n: torch.where(big, g.clamp(-clip, clip), g).detach() for n, g in grads.items()}
        return tree_detach(w), grads, buffers

    def lr_tree(self, lrs: torch.Tensor | None) -> dict:
        """Per-parameter learning rates by name: eta's entries, or ``inner_lr`` without LRNet."""
        if lrs is None:
            return {n: self.hp.inner_lr for n in self.param_names}
        return {n: lrs[..., j] for j, n in enumerate(self.param_names)}

    def meta_gradient(self, lam: Params, carry: dict, steps: list, val: tuple, ltrain: tuple | None):
        """(dL/dlambda, L_V, whether the step counts) of one outer step (module docstring, 3-5)."""
        w_prev, g, buffers = self.inner_loop(lam, carry, steps)
        xi, x = carry["xi"], carry["x"]

        def weights(l: Params) -> Params:
            """The last inner step as a function of lambda (paper Eq. 9-10): w - eta(lambda) g."""
            lrs = self.lr_tree(self.betas_and_lrs(l, xi, x)[1])
            return {n: w_prev[n] - lrs[n] * g[n] for n in w_prev}

        def eval_loss(w: Params, l: Params, batch: tuple) -> torch.Tensor:
            with bn_mode(self.model, "eval"):
                logits, _ = forward_bn(self.model, w, set_betas(buffers, self.bn_layers,
                                                                self.betas_and_lrs(l, xi, x)[0]), batch[0])
            return F.cross_entropy(logits, batch[1])

        direct, val_loss = torch.func.grad_and_value(lambda l: eval_loss(weights(l), l, val))(lam)
        if ltrain is None:  # FOMAML+: dL_V/dlambda through beta and the last step
            return direct, val_loss, torch.isfinite(val_loss)
        lam_now = tree_detach(lam)
        w_now = weights(lam_now)
        v = torch.func.grad(lambda w: eval_loss(w, lam_now, val))(w_now)
        implicit = implicit_hypergradient(lambda w, l: eval_loss(w, l, ltrain), weights, lam_now, v,
                                          self.hp.neumann_steps, self.hp.neumann_psi, self.hp.neumann_scaling)
        grads = {n: implicit[n] + direct[n] if n.startswith("bn_net.") else implicit[n] for n in lam}
        ok = torch.isfinite(val_loss) & torch.isfinite(eval_loss(w_now, lam_now, ltrain))
        return grads, val_loss, ok
