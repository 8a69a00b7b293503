"""The Neumann implicit hypergradient (pfl_core/algorithms/_lib/hypergradient.py) against closed forms on a
quadratic problem: L_T(w, lam) = 1/2 w^T A w - w^T B lam, L_V(w) = 1/2 |w - c|^2, whose best
response w*(lam) = A^-1 B lam gives the exact hypergradient dL_V/dlam = B^T A^-1 v."""
from __future__ import annotations

import pytest
import torch

from pfl_core.algorithms._lib.hypergradient import implicit_hypergradient, neumann_series, tree_dot


def problem(seed=0, n=5, m=3):
    gen = torch.Generator().manual_seed(seed)
    q = torch.linalg.qr(torch.randn(n, n, generator=gen, dtype=torch.float64))[0]
    a = q @ torch.diag(torch.linspace(0.5, 4.0, n, dtype=torch.float64)) @ q.T  # SPD, ||A|| = 4
    b = torch.randn(n, m, generator=gen, dtype=torch.float64)
    c = torch.randn(n, generator=gen, dtype=torch.float64)
    lam = {"h": torch.randn(m, generator=gen, dtype=torch.float64)}
    train_loss = lambda w, l: 0.5 * w["w"] @ a @ w["w"] - w["w"] @ b @ l["h"]
    w_star = {"w": torch.linalg.solve(a, b @ lam["h"])}
    v = {"w": w_star["w"] - c}  # dL_V/dw at w*
    return a, b, lam, train_loss, w_star, v


def exact(a, b, v):
    return b.T @ torch.linalg.solve(a, v["w"])


def neumann_partial_sum(a, v, steps, psi):
    m = torch.eye(len(a), dtype=torch.float64) - psi * a
    return sum(torch.linalg.matrix_power(m, j) @ v["w"] for j in range(steps + 1))


def test_textbook_scaling_converges_to_the_exact_implicit_hypergradient():
    a, b, lam, train_loss, w_star, v = problem()
    errors = []
    for steps in (3, 10, 40, 600):
        got = implicit_hypergradient(train_loss, lambda l: w_star, lam, v, steps=steps, psi=0.1,
                                     scaling="textbook")["h"]
        errors.append(float((got - exact(a, b, v)).norm()))
    assert errors == sorted(errors, reverse=True) and errors[0] > 1e-2  # Q = 3 is still rough
    assert errors[-1] < 1e-8


def test_paper_scaling_is_the_unscaled_neumann_sum_of_algorithm_2():
    """Q = 3, psi = 0.1: B^T sum_{j=0..3} (I - psi A)^j v, i.e. 1/psi times the textbook value."""
    a, b, lam, train_loss, w_star, v = problem(seed=1)
    paper = implicit_hypergradient(train_loss, lambda l: w_star, lam, v, steps=3, psi=0.1)["h"]
    torch.testing.assert_close(paper, b.T @ neumann_partial_sum(a, v, 3, 0.1))
    textbook = implicit_hypergradient(train_loss, lambda l: w_star, lam, v, steps=3, psi=0.1,
                                      scaling="textbook")["h"]
    torch.testing.assert_close(paper, 10 * textbook)
    long = implicit_hypergradient(train_loss, lambda l: w_star, lam, v, steps=600, psi=0.1)["h"]
    torch.testing.assert_close(long, 10 * exact(a, b, v))


def test_the_mixed_term_follows_weights_that_depend_on_the_hyperparameters():
    """W(lam) = w0 - lam * g (an SGD step with learnable lrs, as FedL2P's last inner step) and
    L_T(w) = 1/2 w^T A w: d/dlam <A W(lam), p> = -g * (A p), so the result is g * (A p)."""
    a, _, _, _, _, v = problem(seed=2)
    gen = torch.Generator().manual_seed(3)
    w0, g = (torch.randn(5, generator=gen, dtype=torch.float64) for _ in range(2))
    lam = {"eta": torch.rand(5, generator=gen, dtype=torch.float64)}
    train_loss = lambda w, l: 0.5 * w["w"] @ a @ w["w"]
    weights = lambda l: {"w": w0 - l["eta"] * g}
    got = implicit_hypergradient(train_loss, weights, lam, v, steps=3, psi=0.1)["eta"]
    torch.testing.assert_close(got, g * (a @ neumann_partial_sum(a, v, 3, 0.1)))


def test_neumann_series_and_tree_dot_on_pytrees():
    a = torch.diag(torch.tensor([1.0, 2.0]))
    v = {"x": torch.tensor([1.0, 1.0]), "y": [torch.tensor(2.0)]}
    hvp = lambda t: {"x": a @ t["x"], "y": [3.0 * t["y"][0]]}
    p = neumann_series(hvp, v, steps=2, psi=0.5)
    # x: (1 + 0.5 + 0.25, 1 + 0 + 0); y: (1 - 1.5) multiplies 2 each step: 2 - 1 + 0.5
    torch.testing.assert_close(p["x"], torch.tensor([1.75, 1.0]))
    assert float(p["y"][0]) == pytest.approx(1.5)
    assert float(tree_dot(p, v)) == pytest.approx(1.75 + 1.0 + 1.5 * 2)
