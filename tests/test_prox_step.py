"""The fused proximal step of pFedMe / CGPFL (two passes: lerp, then the gradient) is the
pFedMe optimizer's formula up to float rounding, alone and vmapped over clients that share their
start (theta and anchor broadcast, gradients stacked); the fused pull is ``w - rate (w - theta)``."""
from __future__ import annotations

import pytest
import torch
from torch.func import vmap

from pfl_core.algorithms.pfedme import prox_update, pull_toward

TOL = {torch.float32: dict(rtol=1e-5, atol=1e-6), torch.float64: dict(rtol=1e-12, atol=1e-13)}


def _reference(p, grad, anchor, lr, lam, hidden_l2):
    return p - lr * (grad + lam * (p - anchor) + hidden_l2 * p)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("hidden_l2", [0.0, 0.001])
@pytest.mark.parametrize("lr,lam", [(0.09, 12.0), (0.005, 15.0)])  # lerp weight above and below 1/2
def test_prox_update_is_the_pfedme_step(dtype, hidden_l2, lr, lam):
    gen = torch.Generator().manual_seed(0)
    p, grad, anchor = (torch.randn(4, 257, generator=gen, dtype=dtype) for _ in range(3))
    torch.testing.assert_close(prox_update(p, grad, anchor, lr, lam, hidden_l2),
                               _reference(p, grad, anchor, lr, lam, hidden_l2), **TOL[dtype])
    shared = vmap(lambda g: prox_update(p[0], g, anchor[0], lr, lam, hidden_l2))(grad)
    torch.testing.assert_close(shared, torch.stack([_reference(p[0], g, anchor[0], lr, lam, hidden_l2)
                                                    for g in grad]), **TOL[dtype])
    torch.testing.assert_close(pull_toward({"w": p}, {"w": anchor}, 0.06)["w"], p - 0.06 * (p - anchor),
                               **TOL[dtype])


def test_prox_update_batched_equals_one_client_at_a_time():
    """The vmapped stack and the per-client loop give the same bits (one definition, two paths)."""
    gen = torch.Generator().manual_seed(1)
    p, grad, anchor = (torch.randn(5, 33, generator=gen) for _ in range(3))
    stacked = vmap(lambda a, b, c: prox_update(a, b, c, 0.1, 12.0, 0.001))(p, grad, anchor)
    assert torch.equal(stacked, torch.stack([prox_update(a, b, c, 0.1, 12.0, 0.001)
                                             for a, b, c in zip(p, grad, anchor)]))
