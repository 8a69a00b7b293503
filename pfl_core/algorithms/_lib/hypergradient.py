"""Implicit-function hypergradients with a truncated Neumann series (FedL2P paper Algorithm 2,
after Lorraine et al. 2020; docs/papers/fedl2p.md).

The learner weights ``w = W(lam)`` depend on the hyperparameters ``lam`` (FedL2P: through the
last inner SGD step, whose learning rates come from ``lam``); the training loss ``L_T(w, lam)``
may also depend on ``lam`` directly (FedL2P: through the BN mixing ratios beta). With
``v = dL_V/dw`` the implicit hypergradient is

    -(d/dlam <grad_w L_T(W(lam), lam), p>),   p held constant,

where ``p`` approximates the inverse-Hessian-vector product by the Neumann series
``p = sum_{j=0..Q} (I - psi H_T)^j v`` (``H_T`` the Hessian of L_T in w). The paper and the
authors' code (``client_utils.Hypergrad``) do **not** multiply ``p`` by ``psi``
(``scaling="paper"``), so their implicit term is ``1/psi`` (10x) the textbook estimate
``psi * sum_j (I - psi H)^j v ~ H^-1 v`` (``scaling="textbook"``).

Hessian-vector products are forward-over-reverse (``torch.func.jvp`` of ``torch.func.grad``):
exact, and they compose with ``vmap`` over stacked clients. Every function here is pure tensor
code on pytrees (dicts) of tensors.
"""
from __future__ import annotations

from typing import Any, Callable, Literal

import torch
from torch.utils._pytree import tree_flatten, tree_map

Tree = Any
NeumannScaling = Literal["paper", "textbook"]


def tree_dot(a: Tree, b: Tree) -> torch.Tensor:
    """Sum of the elementwise products of two pytrees of the same structure (a 0-d tensor)."""
    leaves_a, _ = tree_flatten(a)
    leaves_b, _ = tree_flatten(b)
    return sum((x * y).sum() for x, y in zip(leaves_a, leaves_b))


def tree_detach(tree: Tree) -> Tree:
    return tree_map(lambda t: t.detach(), tree)


def neumann_series(hvp: Callable[[Tree], Tree], v: Tree, steps: int = 3, psi: float = 0.1,
                   scaling: NeumannScaling = "paper") -> Tree:
    """``p = sum_{j=0..steps} (I - psi H)^j v`` (Algorithm 2 lines 2-6: ``v <- v - psi H v;
    p <- p + v``), times ``psi`` when ``scaling="textbook"`` (then ``p -> H^-1 v`` as the steps
    grow, for ``0 < psi < 2 / ||H||``)."""
    p = v
    for _ in range(steps):
        hv = hvp(v)
        v = tree_map(lambda a, b: a - psi * b, v, hv)
        p = tree_map(torch.add, p, v)
    return tree_map(lambda t: psi * t, p) if scaling == "textbook" else p


def implicit_hypergradient(train_loss: Callable[[Tree, Tree], torch.Tensor],
                           weights: Callable[[Tree], Tree], lam: Tree, v: Tree, steps: int = 3,
                           psi: float = 0.1, scaling: NeumannScaling = "paper") -> Tree:
    """The implicit term ``-(d/dlam <grad_w L_T(W(lam), lam), p>)`` with ``p`` the Neumann
    estimate of ``H_T^-1 v`` (see the module docstring).

    Args:
        train_loss: ``L_T(w, lam)``.
        weights: ``W(lam)``, the learner weights as a function of the hyperparameters (a
            constant function when ``w`` does not depend on ``lam``).
        lam: the hyperparameters (a pytree of tensors).
        v: ``dL_V/dw`` at ``W(lam)``.
        steps, psi, scaling: Q, psi and the scaling of :func:`neumann_series`.
    """
    lam_now = tree_detach(lam)
    w = tree_detach(weights(lam_now))
    grad_w = torch.func.grad(train_loss, argnums=0)

    def hvp(tangent: Tree) -> Tree:
        return torch.func.jvp(lambda w_: grad_w(w_, lam_now), (w,), (tangent,))[1]

    p = tree_detach(neumann_series(hvp, v, steps, psi, scaling))
    mixed = torch.func.grad(lambda l: tree_dot(grad_w(weights(l), l), p))(lam_now)
    return tree_map(torch.neg, mixed)
