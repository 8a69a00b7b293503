"""Deep Leakage from Gradients (Zhu, Liu & Han, NeurIPS 2019): rebuild a client's input from the
gradient it shared, by optimising dummy inputs until their gradient matches it.

The attacker rehearses the client's loss on dummy *unknowns* (the image, and whatever else it does
not know: the label, MetaVers' prototypes) and minimises the gradient distance
``sum_l ||grad_l(dummies) - shared_l||^2`` (DLG Eq. 4, summed over every parameter tensor) with
L-BFGS. MetaVers Figure 3 runs it 300 iterations at learning rate 1 (docs/papers/metavers.md)
against two gradients:

* :func:`classifier_gradient_target`: FedAvg's gradient of a classifier's cross-entropy on one
  image (``lenet``);
* :func:`prototype_gradient_target`: MetaVers' gradient of its embedding network
  (``le_embedding``) on a single-image episode loss, the attacker knowing the client's
  prototypes (*prototype leakage*) or having to guess them as further unknowns.

Everything here is a pure function of its arguments and a seed; nothing is logged.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Literal, Mapping

import torch
import torch.nn.functional as F
from torch import nn

from pfl_core.prototypes import prototype_logits
from pfl_core.training import embed, forward

Params = Mapping[str, torch.Tensor]
#: (params, dummies) -> the rehearsed loss whose parameter gradient is matched
RehearsedLoss = Callable[[Params, dict[str, torch.Tensor]], torch.Tensor]
#: (model, params, image [1, ...], label [1], prototypes [N, d]) -> MetaVers' single-image loss
EpisodeLoss = Callable[[nn.Module, Params, torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]
LabelMode = Literal["dlg", "idlg", "known"]


@dataclass(frozen=True)
class DLGConfig:
    """The attack's settings; defaults: Zhu et al.'s code, as MetaVers Figure 3 states them."""

    iterations: int = 300
    """L-BFGS ``step`` calls (MetaVers Figure 3: "300 iterations"; DLG's ``for iters in range(300)``)."""
    lr: float = 1.0
    """L-BFGS learning rate (MetaVers Figure 3: 1; PyTorch's default)."""
    max_iter: int = 20
    """Inner L-BFGS iterations per ``step`` (DLG's code keeps PyTorch's default, 20)."""
    label: LabelMode = "dlg"
    """How the attacker gets the label. ``dlg``: joint optimisation of dummy label logits with a
    soft cross-entropy (DLG, Algorithm 1). ``idlg``: read it from the sign of the last layer's bias
    gradient (Zhao et al. 2020, iDLG; classifier targets only). ``known``: the true label (an upper
    bound on the attacker)."""
    seed: int = 0
    """Seed of the dummy initialisation (``torch.randn``, as DLG's code)."""


@dataclass
class GradientTarget:
    """What the attacker sees and rehearses: the shared gradient, the loss it rehearses on its
    dummies, and the dummies' initial values (``image`` first; others: ``label_logits``,
    ``prototypes``)."""

    shared: dict[str, torch.Tensor]
    loss: RehearsedLoss
    dummies: dict[str, torch.Tensor]


@dataclass
class DLGResult:
    reconstruction: torch.Tensor
    """The dummy image after the attack, [1, C, H, W]."""
    gradient_distance: list[float] = field(default_factory=list)
    """The matched distance at the start and after each L-BFGS step (iterations + 1 values; a NaN
    stops the attack early)."""
    dummies: dict[str, torch.Tensor] = field(default_factory=dict)


def gradient_distance(grads: Mapping[str, torch.Tensor], shared: Mapping[str, torch.Tensor]) -> torch.Tensor:
    """DLG Eq. 4: the sum over parameter tensors of the squared Euclidean differences."""
    return sum(((grads[k] - shared[k]) ** 2).sum() for k in shared)


def parameter_gradient(loss_fn: RehearsedLoss, params: Params, dummies: dict[str, torch.Tensor],
                       create_graph: bool = False) -> dict[str, torch.Tensor]:
    """d loss_fn(params, dummies) / d params (kept differentiable in the dummies with ``create_graph``)."""
    leaves = {k: v.detach().requires_grad_(True) for k, v in params.items()}
    with torch.enable_grad():
        loss = loss_fn(leaves, dummies)
        grads = torch.autograd.grad(loss, list(leaves.values()), create_graph=create_graph)
    return dict(zip(leaves, grads if create_graph else [g.detach() for g in grads]))


def dlg_attack(target: GradientTarget, params: Params, cfg: DLGConfig = DLGConfig()) -> DLGResult:
    """Optimise ``target.dummies`` with L-BFGS so that their rehearsed gradient matches
    ``target.shared`` (DLG, Algorithm 1). The model's parameters are not changed."""
    dummies = {k: v.detach().clone().requires_grad_(True) for k, v in target.dummies.items()}
    optimiser = torch.optim.LBFGS(list(dummies.values()), lr=cfg.lr, max_iter=cfg.max_iter)
    frozen = {k: v.detach() for k, v in params.items()}

    def closure() -> torch.Tensor:
        optimiser.zero_grad()
        grads = parameter_gradient(target.loss, frozen, dummies, create_graph=True)
        distance = gradient_distance(grads, target.shared)
        distance.backward()
        return distance

    history = []
    for _ in range(cfg.iterations):
        value = float(optimiser.step(closure).detach())  # the distance where this step started
        history.append(value)
        if value != value:  # NaN: L-BFGS cannot recover; keep the last image
            break
    done = {k: v.detach() for k, v in dummies.items()}
    if history and history[-1] == history[-1]:
        history.append(float(gradient_distance(parameter_gradient(target.loss, frozen, done), target.shared)))
    return DLGResult(done["image"], history, done)


def _dummy(shape, generator: torch.Generator, like: torch.Tensor) -> torch.Tensor:
    return torch.randn(shape, generator=generator, dtype=like.dtype).to(like.device)


def soft_cross_entropy(logits: torch.Tensor, label_logits: torch.Tensor) -> torch.Tensor:
    """Cross-entropy against the soft label softmax(label_logits) (DLG's dummy label)."""
    return -(F.softmax(label_logits, -1) * F.log_softmax(logits, -1)).sum(-1).mean()


def infer_label_idlg(shared: Mapping[str, torch.Tensor], bias: str) -> torch.Tensor:
    """iDLG (Zhao et al. 2020): with softmax cross-entropy on one image, the last layer's bias
    gradient is p - onehot(y), negative only at the true class."""
    if bias not in shared or shared[bias].dim() != 1:
        raise ValueError(f"iDLG label inference needs the last layer's bias gradient; {bias!r} is "
                         f"not a 1-d parameter of the model (parameters: {sorted(shared)})")
    return shared[bias].argmin().reshape(1)


def _labelled_loss(logits_fn: Callable[[Params, dict], torch.Tensor], label: torch.Tensor, mode: LabelMode,
                   num_classes: int, generator: torch.Generator, image: torch.Tensor,
                   shared: Mapping[str, torch.Tensor], bias: str | None):
    """The rehearsed loss and the label dummies for one labelling mode."""
    if mode == "dlg":
        return (lambda p, d: soft_cross_entropy(logits_fn(p, d), d["label_logits"]),
                {"label_logits": _dummy((1, num_classes), generator, image)})
    if mode == "idlg":
        if bias is None:
            raise ValueError("label 'idlg' reads the classifier's bias gradient; this target has no "
                             "classifier layer: use label 'dlg' or 'known'")
        label = infer_label_idlg(shared, bias).to(image.device)
    elif mode != "known":
        raise ValueError(f"DLG label mode {mode!r}; allowed: dlg, idlg, known")
    return (lambda p, d: F.cross_entropy(logits_fn(p, d), label)), {}


def classifier_gradient_target(model: nn.Module, params: Params, image: torch.Tensor, label: torch.Tensor,
                               cfg: DLGConfig = DLGConfig(), bias: str | None = None) -> GradientTarget:
    """FedAvg's shared gradient: cross-entropy of the classifier on one image ``[1, C, H, W]``
    with ``label`` ``[1]``; ``bias``: the last layer's bias (iDLG; default: the last 1-d parameter)."""
    shared = parameter_gradient(lambda p, d: F.cross_entropy(forward(model, p, d["image"]), label),
                                params, {"image": image})
    if bias is None:
        bias = [k for k, v in params.items() if v.dim() == 1][-1]
    num_classes = params[bias].shape[0]
    generator = torch.Generator().manual_seed(cfg.seed)
    dummies = {"image": _dummy(image.shape, generator, image)}
    loss, extra = _labelled_loss(lambda p, d: forward(model, p, d["image"]), label, cfg.label, num_classes,
                                 generator, image, shared, bias)
    return GradientTarget(shared, loss, {**dummies, **extra})


def prototypical_loss(model: nn.Module, params: Params, image: torch.Tensor, label: torch.Tensor,
                      prototypes: torch.Tensor) -> torch.Tensor:
    """MetaVers' L_S (Eq. 2, squared distances) of one query image against fixed prototypes."""
    return F.cross_entropy(prototype_logits(embed(model, params, image), prototypes), label)


def _prototype_logits_fn(model: nn.Module, known: torch.Tensor | None):
    def logits(p: Params, d: dict) -> torch.Tensor:
        protos = known if known is not None else d["prototypes"]
        return prototype_logits(embed(model, p, d["image"]), protos)
    return logits


def prototype_gradient_target(model: nn.Module, params: Params, image: torch.Tensor, label: torch.Tensor,
                              prototypes: torch.Tensor, leakage: bool, cfg: DLGConfig = DLGConfig(),
                              episode_loss: EpisodeLoss = prototypical_loss) -> GradientTarget:
    """MetaVers' shared gradient of the embedding network on a single-image episode: ``episode_loss``
    of ``image`` (label ``label``, an index into ``prototypes`` [N, d]); the prototypes are
    constants of the episode (computed from the client's other images). With ``leakage`` the
    attacker knows them; without, they are dummies too (N x d, ``randn``) and the attacker must
    estimate them (MetaVers §4.1, "Robustness to Gradient-based Attack").

    ``episode_loss`` makes the client's loss pluggable (default :func:`prototypical_loss`, L_S);
    the attacker rehearses the same loss on its dummies: with ``label='dlg'`` through its
    prototype logits against a soft dummy label, otherwise ``episode_loss`` itself."""
    protos = prototypes.detach()
    shared = parameter_gradient(lambda p, d: episode_loss(model, p, d["image"], label, protos), params,
                                {"image": image})
    generator = torch.Generator().manual_seed(cfg.seed)
    dummies = {"image": _dummy(image.shape, generator, image)}
    if not leakage:
        dummies["prototypes"] = _dummy(protos.shape, generator, protos)
    known = protos if leakage else None
    if cfg.label == "dlg":
        loss, extra = _labelled_loss(_prototype_logits_fn(model, known), label, "dlg", protos.shape[0],
                                     generator, image, shared, None)
    elif cfg.label == "known":
        extra = {}
        loss = (lambda p, d: episode_loss(model, p, d["image"], label,
                                          known if known is not None else d["prototypes"]))
    else:
        raise ValueError(f"label {cfg.label!r} for a prototype target; allowed: dlg, known (iDLG needs a "
                         "classifier's bias gradient)")
    return GradientTarget(shared, loss, {**dummies, **extra})
