"""The in-place proximal step of pFedMe / CGPFL is the out-of-place formula bit for bit, alone and
vmapped over clients that share their start (theta and anchor broadcast, gradients stacked)."""
from __future__ import annotations

import pytest
import torch
from torch.func import vmap

from pfl_core.algorithms.pfedme import _prox_step, pull_toward


def _reference(p, grad, anchor, lr, lam, hidden_l2):
    g = grad + lam * (p - anchor)
    if hidden_l2:
        g = g + hidden_l2 * p
    return lr * g


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("hidden_l2", [0.0, 0.001])
def test_prox_step_is_bit_identical_to_the_formula(dtype, hidden_l2):
    gen = torch.Generator().manual_seed(0)
    p, grad, anchor = (torch.randn(4, 257, generator=gen, dtype=dtype) for _ in range(3))
    assert torch.equal(_prox_step(p, grad, anchor, 0.09, 12.0, hidden_l2), _reference(p, grad, anchor, 0.09, 12.0, hidden_l2))
    shared = vmap(lambda g: _prox_step(p[0], g, anchor[0], 0.09, 12.0, hidden_l2))(grad)
    assert torch.equal(shared, torch.stack([_reference(p[0], g, anchor[0], 0.09, 12.0, hidden_l2) for g in grad]))
    assert torch.equal(pull_toward({"w": p}, {"w": anchor}, 0.06)["w"], p - 0.06 * (p - anchor))
