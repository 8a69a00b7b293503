import torch

from pfl_core.optim import client_optimizer


def test_adam_state_persists_across_rounds_while_values_are_reloaded():
    state = {}
    p0 = {"w": torch.tensor([1.0, -2.0])}
    g = {"w": torch.tensor([0.5, 0.5])}
    ref = torch.nn.Parameter(p0["w"].clone())
    ref_opt = torch.optim.Adam([ref], lr=0.1)
    for _ in range(3):  # three "rounds": values reloaded from p0, Adam moments carried over
        opt = client_optimizer(state, "adam", p0, lr=0.1)
        new = opt.step(g)
        with torch.no_grad():
            ref.copy_(p0["w"])
        ref.grad = g["w"].clone()
        ref_opt.step()
        assert torch.allclose(new["w"], ref.detach())
    assert state["adam"].optimizer.state[state["adam"].leaves["w"]]["step"] == 3


def test_non_persistent_optimizer_restarts_every_round():
    state = {}
    p0, g = {"w": torch.tensor([1.0])}, {"w": torch.tensor([2.0])}
    first = client_optimizer(state, "adam", p0, persist=False, lr=0.1).step(g)
    second = client_optimizer(state, "adam", p0, persist=False, lr=0.1).step(g)
    assert torch.equal(first["w"], second["w"]) and "adam" not in state
    # a fresh Adam's first step moves each coordinate by lr (bias-corrected m/sqrt(v) = 1)
    assert torch.allclose(first["w"], torch.tensor([0.9]))
