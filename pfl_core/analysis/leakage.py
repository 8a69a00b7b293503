"""``dlg``: Deep Leakage from Gradients against the run's final model (MetaVers Figure 3).

One training image of one evaluated client (``client``-th evaluated client, ``sample``-th image of
its train split) is attacked through the gradient that client would share for it
(:mod:`pfl_core.attacks.dlg`):

* ``target: classifier``: FedAvg's cross-entropy gradient of the classifier (``lenet``);
* ``target: prototypes``: MetaVers' single-image episode gradient of the embedding network
  (``le_embedding``): the image's prototypical cross-entropy L_S against the client's class
  prototypes (the mean embedding per class of its whole train split, labels = the class's rank
  among the client's classes). **[harness default]** The paper does not describe its episode; the
  prototypes are constants of the shared gradient, and with ``leakage: true`` the attacker knows
  them (MetaVers' "prototype leakage"), with ``false`` it optimises them as dummies too.

The model attacked is the one the client receives (``algorithm.predictor``); with
``federation.rounds: 0`` it is the initial model, as in Zhu et al.'s experiments. PSNR and SSIM
are computed in pixel space (the dataset's normalisation undone) against the original.
Logged: metrics ``dlg_psnr``, ``dlg_ssim``, ``dlg_gradient_distance`` (the final matched
distance) and ``dlg.npz`` (``original``, ``reconstruction`` [C, H, W] pixels, ``gradient_distance``
at the start and after each L-BFGS step, ``label``).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import numpy as np
import torch

from pfl_core.fields import HyperParams
from pfl_core.analysis.base import ANALYSES, Analysis, AnalysisOutput, evaluated_contexts, to_pixels
from pfl_core.attacks.dlg import (DLGConfig, classifier_gradient_target, dlg_attack,
                                  prototype_gradient_target)
from pfl_core.attacks.quality import reconstruction_quality
from pfl_core.fields import ConfigError, NonNegativeInt, PositiveFloat, PositiveInt
from pfl_core.prototypes import class_prototypes
from pfl_core.training import embed


@dataclass
class LeakageAttack(HyperParams):
    target: Literal["classifier", "prototypes"] = "classifier"
    """Whose shared gradient: FedAvg's classifier (``classifier``) or MetaVers' embedding network
    on a single-image episode (``prototypes``)."""
    leakage: bool = False
    """``prototypes`` only: the attacker knows the client's prototypes (MetaVers Figure 3's
    "MetaVers with prototype leakage")."""
    client: NonNegativeInt = 0
    """Which evaluated client (its position in the protocol's client list)."""
    sample: NonNegativeInt = 0
    """Which image of that client's train split."""
    iterations: PositiveInt = 300
    """L-BFGS steps (MetaVers Figure 3: 300)."""
    lr: PositiveFloat = 1.0
    """L-BFGS learning rate (MetaVers Figure 3: 1)."""
    max_iter: PositiveInt = 20
    """Inner L-BFGS iterations per step (DLG's code: PyTorch's default 20)."""
    label: Literal["dlg", "idlg", "known"] = "dlg"
    """How the attacker gets the label (:class:`pfl_core.attacks.dlg.DLGConfig`); DLG's own joint
    optimisation by default."""

    def __post_init__(self):
        if self.target == "prototypes" and self.label == "idlg":
            raise ConfigError("label 'idlg' reads a classifier's bias gradient; target 'prototypes' has "
                              "no classifier: use label dlg or known", "label")
        if self.target == "classifier" and self.leakage:
            raise ConfigError("leakage: true applies to target 'prototypes' only (a classifier's "
                              "gradient has no prototypes to leak)", "leakage")


def client_prototypes(model, params, ctx, label: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(prototypes [N, d] of the client's classes from its whole train split, the rank of
    ``label`` among those classes)."""
    x, y = ctx.dataset.batch(ctx.client.splits["train"])
    classes = torch.unique(y)  # sorted
    with torch.no_grad():
        protos = class_prototypes(embed(model, params, x), torch.searchsorted(classes, y), len(classes))
    return protos, torch.searchsorted(classes, label)


@ANALYSES.register("dlg")
class GradientLeakage(Analysis):
    params_class = LeakageAttack

    def run(self, setup, result) -> AnalysisOutput:
        p = self.params
        contexts = evaluated_contexts(setup, result, "analysis-dlg")
        ids = list(contexts)
        if p.client >= len(ids):
            raise ValueError(f"analysis 'dlg': client {p.client} but the protocol evaluates {len(ids)} clients")
        ctx = contexts[ids[p.client]]
        train = ctx.client.splits["train"]
        if p.sample >= len(train):
            raise ValueError(f"analysis 'dlg': sample {p.sample} but client {ctx.cid} has {len(train)} train images")
        params = {k: v.detach() for k, v in setup.algorithm.predictor(result.server, ctx).items()}
        x, y = ctx.dataset.batch(train[p.sample:p.sample + 1])
        cfg = DLGConfig(p.iterations, p.lr, p.max_iter, p.label, setup.streams.seed_int("analysis-dlg"))
        if p.target == "classifier":
            target = classifier_gradient_target(setup.model, params, x, y, cfg)
        else:
            protos, rank = client_prototypes(setup.model, params, ctx, y)
            target = prototype_gradient_target(setup.model, params, x, rank, protos, p.leakage, cfg)
        attacked = dlg_attack(target, params, cfg)
        original, recon = to_pixels(ctx.dataset, x)[0], to_pixels(ctx.dataset, attacked.reconstruction)[0]
        quality = reconstruction_quality(original, recon)
        arrays = {"original": original.float().cpu().numpy(), "reconstruction": recon.float().cpu().numpy(),
                  "gradient_distance": np.asarray(attacked.gradient_distance), "label": y.cpu().numpy()}
        last = attacked.gradient_distance[-1] if attacked.gradient_distance else float("nan")
        return AnalysisOutput({"dlg_psnr": quality["psnr"], "dlg_ssim": quality["ssim"],
                               "dlg_gradient_distance": last}, {"dlg": arrays})
