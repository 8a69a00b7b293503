"""pFedGP (Achituve et al., NeurIPS 2021): a shared feature extractor trained federatedly, with a
Gaussian-process classifier per client on its features (code: IdanAchituve/pFedGP,
``experiments/heterogeneous_class_dist/trainer.py``, pFedGP-Full).

Training, as the code does it, per sampled client (5 per round, the federation's default):
the global backbone is copied, and ``inner_steps`` times the client embeds its **whole** train
split, evaluates the GP objective on those features and takes one SGD step (momentum, weight
decay, gradient norm clipped at 50) on the backbone; the server takes the plain mean of the
uploaded backbones. The GP's kernel hyperparameters are fixed (the code rebuilds its GPs every
round and never optimises them): outputscale 8, RBF lengthscale 1 on L2-normalised features.
At evaluation a client's GP is conditioned on its whole train split (features from the current
backbone) and classifies among the client's own classes.

**The GP head (switch ``gp_head``).** ``tree_pg`` (default) is the paper's: a binary tree of GP
classifiers over the client's classes (:mod:`pfl_core.algorithms._lib.gp_tree`; classes split by k-means on their
mean features), each node a logistic GP with Polya-Gamma augmentation whose posterior comes from
parallel Gibbs chains (20 x 5 sweeps in training, 30 x 5 at test), trained by the
``predictive_likelihood`` objective. One deviation, named: Polya-Gamma variables are drawn by the
truncated sum-of-gammas series (``pg_terms`` terms, tail replaced by its mean), not by
``pypolyagamma``'s exact sampler. The tree's shape depends on each client's data, so this head runs
on the sequential path (``batched_fallback``); the Gibbs noise comes from a seed drawn from the
client's own stream each step (and, at evaluation, from the run seed and the client id).
``label_regression`` is a simplification (closed form, vmappable, batched path): one exact GP
regression per class on the one-hot labels with Gaussian noise ``noise``, predicting the largest
posterior mean; its numbers are not the paper's pFedGP. Runs record the head (``run_info``:
``pfedgp_gp_head``).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Annotated, Literal

import torch

from pfl_core.algorithms._lib import gp
from pfl_core.algorithms._lib.gp_tree import GibbsSettings, TreeGP, build_tree
from pfl_core.algorithms import METHODS
from pfl_core.algorithms.base import Algorithm, Weighting
from pfl_core.engine.contract import ClientContext, ClientUpdate, ServerState
from pfl_core.engine.plans import Drawn
from pfl_core.fields import HyperParams, SGD_LR, Tune
from pfl_core.fields import Fraction, NonNegativeFloat, PositiveFloat, PositiveInt
from pfl_core.algorithms._lib.optim import clip_grad_norm, sgd_momentum_step
from pfl_core.training import Params, forward, value_and_grad

#: logit of a class the client never saw in training (finite, so the evaluation loss stays finite)
ABSENT_CLASS_SCORE = -1e9


@dataclass
class PFedGPHyper(HyperParams):
    gp_head: Literal["tree_pg", "label_regression"] = "tree_pg"
    """The GP classifier: ``tree_pg`` the paper's tree of Polya-Gamma GP classifiers (sequential
    path); ``label_regression`` exact GP regression of the one-hot labels per class (a
    simplification, batched path). See the module docstring."""
    objective: Literal["predictive_likelihood", "marginal_likelihood"] = "predictive_likelihood"
    """Training objective (code ``--objective``, default ``predictive_likelihood``): condition the
    GP on part of the client's data and score the predictive likelihood of the rest; or
    (``label_regression`` only) the marginal likelihood of all of it."""
    predict_ratio: Fraction = 0.5
    """Share of each class held out and predicted by the ``predictive_likelihood`` objective,
    drawn afresh at every step (code ``--predict-ratio`` 0.5, ``int(n_c * ratio)`` per class)."""
    inner_steps: PositiveInt = 1
    """Backbone SGD steps per client per round, each on the whole train split (code
    ``--inner-steps`` default 1; its CIFAR-10 script passes 3)."""
    lr: Annotated[PositiveFloat, SGD_LR] = 5e-2
    """Client SGD learning rate (code ``--lr`` 5e-2)."""
    momentum: NonNegativeFloat = 0.9
    """Client SGD momentum (code: 0.9, a fresh optimiser per client and round)."""
    weight_decay: NonNegativeFloat = 1e-3
    """Client SGD weight decay (code ``--wd`` 1e-3)."""
    grad_clip: NonNegativeFloat = 50.0
    """Gradient norm clipping of each step (code: 50); 0: none."""
    outputscale: Annotated[PositiveFloat, Tune(1.0, 32.0, log=True, order=1)] = 8.0
    """Kernel output scale (code ``--outputscale`` 8, fixed)."""
    lengthscale: PositiveFloat = 1.0
    """RBF length scale on L2-normalised features (code ``--lengthscale`` 1, fixed)."""
    jitter: PositiveFloat = 1e-3
    """``tree_pg``: added to the kernel's diagonal (code ``GPModel`` jitter 1e-3)."""
    gibbs_draws_train: PositiveInt = 20
    """``tree_pg``: parallel Gibbs chains in training (code ``--num-gibbs-draws-train`` 20)."""
    gibbs_steps_train: PositiveInt = 5
    """``tree_pg``: Gibbs sweeps in training (code ``--num-gibbs-steps-train`` 5)."""
    gibbs_draws_test: PositiveInt = 30
    """``tree_pg``: parallel Gibbs chains at evaluation (code ``--num-gibbs-draws-test`` 30)."""
    gibbs_steps_test: PositiveInt = 5
    """``tree_pg``: Gibbs sweeps at evaluation (code ``--num-gibbs-steps-test`` 5)."""
    pg_terms: PositiveInt = 200
    """``tree_pg``: terms of the truncated sum-of-gammas Polya-Gamma sampler (its tail replaced by
    its expectation); the code draws exact samples with ``pypolyagamma`` (deviation)."""
    noise: PositiveFloat = 1e-3
    """``label_regression``: Gaussian noise variance, the code's diagonal jitter 1e-3 (the code's
    likelihood is logistic and has no noise term; harness choice)."""
    weighting: Weighting = "uniform"
    """Server aggregation: ``uniform`` = plain mean of the sampled clients' backbones (code)."""


@METHODS.register("pfedgp")
class PFedGP(Algorithm):
    """pFedGP; no client state (a client's GP is rebuilt from its data whenever it is used)."""

    hyper_class = PFedGPHyper
    eval_batched_fallback = ("the GP head conditions on the client's whole train split, which logits reads "
                             "from the client on the host")

    def __init__(self, model, hp):
        super().__init__(model, hp)
        self.num_classes = 0
        if hp.gp_head == "tree_pg":
            if hp.objective != "predictive_likelihood":
                raise ValueError("pfedgp: gp_head tree_pg trains with objective predictive_likelihood only; "
                                 "set method.params.objective or gp_head: label_regression")
            self.batched_fallback = ("gp_head tree_pg: each client's tree of GP classifiers has a data-dependent "
                                     "shape and is sampled by Gibbs chains on the host")
            self.tree = TreeGP(hp.outputscale, hp.lengthscale, hp.jitter,
                               GibbsSettings(hp.gibbs_draws_train, hp.gibbs_steps_train, hp.pg_terms),
                               GibbsSettings(hp.gibbs_draws_test, hp.gibbs_steps_test, hp.pg_terms),
                               hp.predict_ratio)

    def prepare(self, fed) -> None:
        self.num_classes = fed.dataset.num_classes

    def run_info(self, server: ServerState) -> dict:
        return {"pfedgp_gp_head": self.hp.gp_head}

    def class_mask(self, labels: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
        """1.0 for the classes present in ``labels``, else 0.0 ([num_classes])."""
        mask = torch.zeros(self.num_classes, dtype=like.dtype, device=like.device)
        return mask.index_fill(0, labels.unique().to(like.device), 1.0)

    # -- the GP on features -----------------------------------------------------------------------
    def kernel(self, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        return gp.rbf_kernel(a, b, self.hp.outputscale, self.hp.lengthscale)

    def gp_posterior_mean(self, train_z, train_y, test_z) -> torch.Tensor:
        """[m, num_classes] posterior means of the one-hot label regressions."""
        targets = gp.one_hot_targets(train_y, self.num_classes, train_z.dtype)
        k_diag = torch.full((test_z.shape[0],), self.hp.outputscale, dtype=test_z.dtype, device=test_z.device)
        mean, _ = gp.posterior(self.kernel(train_z, train_z), self.kernel(train_z, test_z), k_diag, targets,
                               self.hp.noise)
        return mean

    def gp_loss(self, params: Params, fit: tuple, held_out: tuple | None, mask: torch.Tensor) -> torch.Tensor:
        """The objective on the backbone's features of ``fit`` (and ``held_out``) samples."""
        hp = self.hp
        fit_z = forward(self.model, params, fit[0])
        fit_t = gp.one_hot_targets(fit[1], self.num_classes, fit_z.dtype)
        if held_out is None:
            return gp.marginal_nll(self.kernel(fit_z, fit_z), fit_t, hp.noise, mask)
        z = forward(self.model, params, held_out[0])
        k_diag = torch.full((z.shape[0],), hp.outputscale, dtype=z.dtype, device=z.device)
        mean, var = gp.posterior(self.kernel(fit_z, fit_z), self.kernel(fit_z, z), k_diag, fit_t, hp.noise)
        return gp.predictive_nll(mean, var, gp.one_hot_targets(held_out[1], self.num_classes, z.dtype), hp.noise, mask)

    def _step_loss(self, params: Params, mask, fit_x, fit_y, held_x=None, held_y=None) -> torch.Tensor:
        return self.gp_loss(params, (fit_x, fit_y), None if held_x is None else (held_x, held_y), mask)

    # -- the client program -----------------------------------------------------------------------
    def carry_in(self, server: ServerState, client: ClientContext, round_idx: int,
                 drawn: dict | None = None) -> dict:
        params = server["params"]
        momentum = {k: torch.zeros_like(v) for k, v in params.items()}
        if self.hp.gp_head == "tree_pg":  # the tree from the received backbone's features (code: build_tree)
            x, y = client.dataset.batch(client.client.splits["train"])
            with torch.no_grad():
                tree = build_tree(forward(self.model, params, x), y)
            return {"params": params, "momentum": momentum, "tree": tree, "seeds": drawn["seeds"]}
        labels = client.dataset.y[client.client.splits["train"]]
        return {"params": params, "momentum": momentum, "classes": self.class_mask(labels, next(iter(params.values())))}

    def draw(self, client: ClientContext, round_idx: int):
        """Per step: the whole train split, split per class into fit / held-out parts by the
        client's own stream (``predictive_likelihood``), or whole (``marginal_likelihood``, and
        ``gp_head: tree_pg`` with one Gibbs-sampler seed per step from the same stream)."""
        index = client.client.splits["train"]
        generator = client.streams["train"].generator
        if self.hp.gp_head == "tree_pg":  # one Gibbs-sampler seed per step, for carry_in
            seeds = [int(torch.randint(2 ** 62, (1,), generator=generator)) for _ in range(self.hp.inner_steps)]
            return Drawn({"fit": [index] * self.hp.inner_steps}, {"seeds": seeds})
        if self.hp.objective == "marginal_likelihood":
            return {"fit": [index] * self.hp.inner_steps}
        # split on the host: two copies per client and round, not a device read per class and step
        labels, index = client.dataset.y[index].cpu(), index.cpu()
        plan: dict = {"fit": [], "held_out": []}
        for _ in range(self.hp.inner_steps):
            fit, held = [], []
            for c in labels.unique().tolist():
                members = index[labels == c]
                members = members[torch.randperm(members.numel(), generator=generator)]
                k = int(members.numel() * self.hp.predict_ratio)
                held.append(members[:k])
                fit.append(members[k:])
            plan["fit"].append(torch.cat(fit))
            plan["held_out"].append(torch.cat(held))
            if plan["held_out"][-1].numel() == 0:
                raise ValueError(f"pfedgp: client {client.cid} has no class with enough train samples to hold out "
                                 f"(predict_ratio {self.hp.predict_ratio}); raise method.params.predict_ratio or "
                                 "use objective: marginal_likelihood")
        return plan

    def local_update(self, carry, batches, masks):
        if self.hp.gp_head == "tree_pg":
            return self._tree_update(carry, batches)
        hp = self.hp
        params, momentum, mask, losses = carry["params"], carry["momentum"], carry["classes"], []
        fit_x, fit_y = batches["fit"]
        held = batches.get("held_out")
        for step in range(len(fit_x)):
            held_step = () if held is None else (held[0][step], held[1][step])
            grads, loss = value_and_grad(self._step_loss, params, mask, fit_x[step], fit_y[step], *held_step)
            params, momentum = sgd_momentum_step(params, clip_grad_norm(grads, hp.grad_clip), momentum,
                                                 hp.lr, hp.momentum, hp.weight_decay)
            losses.append(loss)
        return {"params": params, "momentum": momentum, "classes": mask}, torch.stack(losses).mean()

    def _tree_update(self, carry, batches):
        """``tree_pg``: the sequential update (the tree is host data; Gibbs noise from the seeds)."""
        hp, (xs, ys) = self.hp, batches["fit"]
        params, momentum, losses = carry["params"], carry["momentum"], []
        for step in range(len(xs)):
            generator = torch.Generator().manual_seed(carry["seeds"][step])
            grads, loss = value_and_grad(
                lambda p: self.tree.loss(forward(self.model, p, xs[step]), ys[step], carry["tree"], generator), params)
            params, momentum = sgd_momentum_step(params, clip_grad_norm(grads, hp.grad_clip), momentum,
                                                 hp.lr, hp.momentum, hp.weight_decay)
            losses.append(loss)
        return {"params": params}, torch.stack(losses).mean()

    def carry_out(self, server: ServerState, client: ClientContext, carry, loss) -> ClientUpdate:
        return ClientUpdate(carry["params"], client.num_samples("train"), loss)

    # -- evaluation: the client's GP conditioned on its whole train split ---------------------------
    def forget_fits(self) -> None:
        """Drop the kept tree fits and Gibbs draws (the next evaluation fits every client afresh)."""
        self._tree_cache = self._gibbs_cache = None

    def _fitted_tree(self, params: Params, client: ClientContext) -> list[tuple]:
        """``tree_pg``: the client's tree and node GPs for ``params``, fitted once and reused for
        its further evaluation batches (the cache holds ``params`` itself, so a later dict cannot
        be mistaken for it); Gibbs noise seeded by the run seed and the client id.

        The Gibbs draws of every client evaluated with ``params`` are kept too (with the train
        features they were drawn on, a few hundred KB a client): an evaluation's second pass over
        the clients (``evaluation.params.val_split``, after the test split) then refits only the
        posterior factors. Its chains would draw the same values again (same seed, same features),
        so the numbers are those of a refit (``tests/test_pfedgp.py``)."""
        cached = getattr(self, "_tree_cache", None)
        if cached is not None and cached[0] is params and cached[1] == client.cid:
            return cached[2]
        draws = getattr(self, "_gibbs_cache", None)
        if draws is None or draws[0] is not params:
            draws = self._gibbs_cache = (params, {})
        train_x, train_y = client.dataset.batch(client.client.splits["train"])
        train_z = forward(self.model, params, train_x)
        tree = build_tree(train_z, train_y)
        known = draws[1].get(client.cid)
        if known is not None and torch.equal(known[0], train_z):
            omegas = known[1]
        else:
            generator = torch.Generator().manual_seed((self.seed * 1_000_003 + client.cid) % 2 ** 63)
            omegas = self.tree.gibbs_tree(train_z, train_y, tree, generator)
            draws[1][client.cid] = (train_z, omegas)
        fitted = self.tree.factor_tree(train_z, train_y, tree, omegas)
        self._tree_cache = (params, client.cid, fitted)
        return fitted

    def logits(self, params: Params, x: torch.Tensor, client: ClientContext) -> torch.Tensor:
        if client is None:
            raise ValueError("pfedgp: logits needs the client's train split (evaluate sequentially)")
        train_x, train_y = client.dataset.batch(client.client.splits["train"])
        with torch.no_grad():
            z = forward(self.model, params, x)
            if self.hp.gp_head == "tree_pg":
                return torch.log(self.tree.class_probs(self._fitted_tree(params, client), self.class_mask(train_y, z),
                                                       z) + 1e-12)
            train_z = forward(self.model, params, train_x)
            mean = self.gp_posterior_mean(train_z, train_y, z)
        present = self.class_mask(train_y, mean) > 0
        return mean.masked_fill(~present, ABSENT_CLASS_SCORE)
