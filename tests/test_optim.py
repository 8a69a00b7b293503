"""The functional optimisers against torch's own, per-client state across rounds."""
import pytest
import torch

from pfl_core.algorithms._lib.optim import client_optimizer_state, init_optimizer_state, optimizer_step


def test_adam_state_persists_across_rounds_while_values_are_reloaded():
    state = {}
    p0 = {"w": torch.tensor([1.0, -2.0]), "b": torch.tensor([0.3])}
    ref = [torch.nn.Parameter(p0[k].clone()) for k in ("w", "b")]
    ref_opt = torch.optim.Adam(ref, lr=0.1)
    gen = torch.Generator().manual_seed(0)
    for _ in range(3):  # three "rounds": values reloaded from p0, Adam moments carried over
        adam = client_optimizer_state(state, "adam", "adam", p0)
        params = p0
        for _ in range(2):
            g = {k: torch.randn(v.shape, generator=gen) for k, v in p0.items()}
            params, adam = optimizer_step("adam", params, g, adam, lr=0.1)
            for r, k in zip(ref, ("w", "b")):
                r.grad = g[k].clone()
            ref_opt.step()
        state["adam"] = adam
        for r, k in zip(ref, ("w", "b")):
            assert torch.allclose(params[k], r.detach(), atol=1e-7)
            with torch.no_grad():
                r.copy_(p0[k])
    assert int(state["adam"]["step"]) == 6


def test_non_persistent_optimizer_restarts_every_round():
    state = {}
    p0, g = {"w": torch.tensor([1.0])}, {"w": torch.tensor([2.0])}
    first, _ = optimizer_step("adam", p0, g, client_optimizer_state(state, "adam", "adam", p0, persist=False), 0.1)
    second, _ = optimizer_step("adam", p0, g, client_optimizer_state(state, "adam", "adam", p0, persist=False), 0.1)
    assert torch.equal(first["w"], second["w"]) and "adam" not in state
    # a fresh Adam's first step moves each coordinate by lr (bias-corrected m/sqrt(v) = 1)
    assert torch.allclose(first["w"], torch.tensor([0.9]))


def test_sgd_and_partial_updates():
    p0 = {"w": torch.tensor([1.0, 2.0]), "frozen": torch.tensor([5.0])}
    new, state = optimizer_step("sgd", p0, {"w": torch.tensor([1.0, -1.0])}, init_optimizer_state("sgd", p0), 0.5)
    assert torch.equal(new["w"], torch.tensor([0.5, 2.5])) and new["frozen"] is p0["frozen"] and state == {}
    adam = init_optimizer_state("adam", {"w": p0["w"]})
    new, adam = optimizer_step("adam", p0, {"w": torch.tensor([1.0, -1.0])}, adam, 0.1)
    assert new["frozen"] is p0["frozen"] and set(adam["exp_avg"]) == {"w"}


def test_unknown_optimizer_is_rejected():
    with pytest.raises(ValueError, match="unknown optimizer"):
        init_optimizer_state("lbfgs", {"w": torch.zeros(1)})


def test_adam_weight_decay_is_torchs_coupled_l2():
    """``weight_decay`` adds wd * p to the gradient before the moments, as
    ``torch.optim.Adam(weight_decay=...)`` (not AdamW; the MetaVers code's CIFAR-10 server)."""
    p0 = {"w": torch.tensor([1.0, -2.0, 0.5])}
    ref = torch.nn.Parameter(p0["w"].clone())
    ref_opt = torch.optim.Adam([ref], lr=0.01, weight_decay=0.1)
    params, state = p0, init_optimizer_state("adam", p0)
    gen = torch.Generator().manual_seed(1)
    for _ in range(5):
        g = torch.randn(3, generator=gen)
        params, state = optimizer_step("adam", params, {"w": g}, state, 0.01, weight_decay=0.1)
        ref.grad = g.clone()
        ref_opt.step()
    torch.testing.assert_close(params["w"], ref.detach())
    plain, _ = optimizer_step("adam", p0, {"w": torch.ones(3)}, init_optimizer_state("adam", p0), 0.01)
    assert not torch.allclose(plain["w"], params["w"])


def test_clipped_sgd_with_momentum_and_weight_decay_equals_torch():
    """pFedHN / pFedGP's optimiser: clip_grad_norm_(50 here 1.0) then SGD(momentum, weight_decay)."""
    from pfl_core.algorithms._lib.optim import clip_grad_norm, sgd_momentum_step

    gen = torch.Generator().manual_seed(0)
    p0 = {"w": torch.randn(3, 2, generator=gen, dtype=torch.float64), "b": torch.randn(2, generator=gen, dtype=torch.float64)}
    ref = [torch.nn.Parameter(p0[k].clone()) for k in ("w", "b")]
    opt = torch.optim.SGD(ref, lr=0.05, momentum=0.9, weight_decay=1e-3)
    params, buffers = p0, {k: torch.zeros_like(v) for k, v in p0.items()}
    for step in range(4):
        g = {k: (3.0 if step % 2 else 0.1) * torch.randn(v.shape, generator=gen, dtype=torch.float64)
             for k, v in p0.items()}  # odd steps exceed the clipping norm, even steps do not
        for r, k in zip(ref, ("w", "b")):
            r.grad = g[k].clone()
        torch.nn.utils.clip_grad_norm_(ref, 1.0)
        opt.step()
        params, buffers = sgd_momentum_step(params, clip_grad_norm(g, 1.0), buffers, 0.05, 0.9, 1e-3)
        for r, k in zip(ref, ("w", "b")):
            torch.testing.assert_close(params[k], r.detach(), rtol=1e-12, atol=1e-12)
    assert clip_grad_norm({"w": torch.tensor([3.0, 4.0])}, 0)["w"].tolist() == [3.0, 4.0]
    assert clip_grad_norm({"w": torch.tensor([3.0, 4.0])}, 1.0)["w"] == pytest.approx([0.6, 0.8], rel=1e-5)
