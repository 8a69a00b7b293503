"""FedL2P and L2P (pfl_core/algorithms/fedl2p.py): ClientFit's plan and meta-gradients, the server
loop (|val|-weighted mean, best lambda, patience), the Table 5 / Table 8 switches and L2P's local
lambda. Tiny ResNets (width 4) on 3x6x6 images in float64, few steps."""
from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from pfl_core.algorithms import METHODS
from pfl_core.engine.contract import ClientUpdate
from pfl_core.algorithms.fedavg import FedAvg
from pfl_core.algorithms.fedl2p import FedL2P
from pfl_core.algorithms._lib.meta_augment import augment_batch
from pfl_core.data.augment.crop_flip import CropFlip, crop_flip
from pfl_core.algorithms.l2p import l2p_outer_epochs
from pfl_core.config import FederationConfig
from pfl_core.engine import Executor
from pfl_core.evaluation import EvalConfig
from pfl_core.evaluation.clients import SeenClients
from pfl_core.federation import make_contexts, run_federation
from pfl_core.models.kld_bn import bn_names, forward_bn, bn_mode, set_betas
from pfl_core.seeding import RunStreams
from pfl_core.training import model_params
from pfl_core.engine.executor import start_client
from tests.helpers import l2p_federation, one_thread, tiny_resnet  # noqa: F401 (fixture)

pytestmark = pytest.mark.usefixtures("one_thread")

#: one inner epoch, one outer epoch, visible meta steps
FAST = {"inner_epochs": 1, "outer_epochs": 1, "lr_bnnet": 0.1, "lr_lrnet": 0.1, "lr_eta": 0.01}


def make(method="fedl2p", seed=0, **hp):
    torch.manual_seed(seed)
    model = tiny_resnet().double()
    cls = METHODS.get(method)
    algorithm = cls(model, cls.hyper_class.from_dict({**FAST, **hp}))
    algorithm.seed = 5
    return algorithm, model


def contexts(fed, batch_size=4, seed=0):
    cfg = FederationConfig(batch_size=batch_size, reshuffle=True, drop_last=False)
    return make_contexts(fed, fed.train_clients, cfg, RunStreams(seed), "batches", 50)


def one_outer_step(algorithm, server, ctx):
    """(carry, inner steps, val batch, L_T batch) of a client's first outer step."""
    carry, plan, _ = start_client(algorithm, server, ctx, 0)
    batch = ctx.dataset.batch
    inner = len(plan["inner"]) // len(plan["val"])
    steps = [batch(i) for i in plan["inner"][:inner]]
    ltrain = batch(plan["ltrain"][0]) if plan["ltrain"] else None
    return carry, steps, batch(plan["val"][0]), ltrain


# ------------------------------------------------------------------ ClientFit's plan

def test_plan_cycles_one_train_stream_across_outer_steps_as_the_code():
    """40 train / 10 val at B = 32, e = 15, K = 3 epochs of val: 30 inner steps of 32, 8, 32, ...
    then the L_T batch from the same stream, so the next outer step starts mid-epoch (spec
    "Implementation details" 2); every epoch is a permutation of the train split."""
    fed = l2p_federation(sizes=(40,), val=10)
    algorithm, _ = make(inner_epochs=15, outer_epochs=3)
    ctx = contexts(fed, batch_size=32)[0]
    plan = algorithm.draw(ctx, 0).plan
    sizes = [len(b) for b in plan["inner"]]
    assert len(plan["val"]) == 3 and [len(b) for b in plan["val"]] == [10] * 3
    assert len(plan["ltrain"]) == 3 and len(sizes) == 90
    assert sizes[:30] == [32, 8] * 15 and len(plan["ltrain"][0]) == 32 and sizes[30] == 8
    # the stream in consumption order, cut into epochs, holds each train sample once per epoch
    stream = []
    for k in range(3):
        stream += plan["inner"][30 * k:30 * (k + 1)] + [plan["ltrain"][k]]
    train = set(fed.clients[0].splits["train"].tolist())
    for e in range(0, len(stream) - 1, 2):
        assert sorted(torch.cat(stream[e:e + 2]).tolist()) == sorted(train)
    assert set(torch.cat(plan["val"]).tolist()) == set(fed.clients[0].splits["val"].tolist())
    fomaml, _ = make(hypergradient="fomaml", inner_epochs=15, outer_epochs=3)
    assert [len(b) for b in fomaml.draw(contexts(fed, batch_size=32)[0], 0).plan["inner"]] == [32, 8] * 45
    assert fomaml.draw(contexts(fed, batch_size=32)[0], 0).plan["ltrain"] == []


def test_the_client_starts_from_the_pretrained_state_with_reset_running_stats():
    algorithm, model = make()
    names = bn_names(model)
    params = model_params(model)
    stats = {f"{n}.running_mean": torch.full((m.num_features,), 0.3, dtype=torch.float64)
             for n, m in model.named_modules() if n in names}
    stats.update({f"{n}.running_var": torch.full((m.num_features,), 2.0, dtype=torch.float64)
                  for n, m in model.named_modules() if n in names})
    algorithm.pretrained = {"params": {k: v + 1.0 for k, v in params.items()}, "buffers": stats}
    server = algorithm.init_server(params)
    assert all(torch.equal(server["params"][k], params[k] + 1.0) for k in params)
    layer = names[3]
    assert torch.all(server["buffers"][f"{layer}.init_running_mean"] == 0.3)
    assert torch.all(server["buffers"][f"{layer}.init_running_var"] == 2.0)
    assert torch.all(server["buffers"][f"{layer}.running_mean"] == 0.0)
    assert torch.all(server["buffers"][f"{layer}.running_var"] == 1.0)
    assert server["pretrained"] is algorithm.pretrained
    # lambda: BNNet 20 -> 20 and LRNet 82 -> 62 at any width, eta-tilde = eta_init
    lam = server["lambda"]
    assert sum(t.numel() for t in lam.values()) == 38_944
    assert torch.all(lam["eta_tilde"] == 1e-3) and lam["eta_tilde"].shape == (62,)


def test_meta_training_batches_share_one_crop_and_flip_with_black_padding():
    """augment_batch on normalized images = crop/flip of the [0, 1] images (zero padding), then
    Normalize, with one draw for the whole batch (the code's jit_augment)."""
    fed = l2p_federation(sizes=(8,))
    data = fed.dataset
    data.mean, data.std = (0.4914, 0.4822, 0.4465), (0.2023, 0.1994, 0.2010)
    index = torch.arange(5)
    draws = {"top": torch.tensor([0, 7]), "left": torch.tensor([3, 1]), "flip": torch.tensor([False, True])}
    pad = data.normalize(torch.zeros(1, 3, 6, 6, dtype=torch.float64))
    got = augment_batch(data.batch(index)[0], draws, 1, pad, 4)
    shared = CropFlip(torch.full((5,), 7), torch.full((5,), 1), torch.full((5,), True))
    expected = data.normalize(crop_flip(data.raw_batch(index)[0], shared, 4))
    torch.testing.assert_close(got, expected)
    assert torch.equal(augment_batch(got, None, 0, pad, 4), got)


def test_client_fit_augments_inner_and_l_t_batches_with_one_draw_per_batch():
    fed = l2p_federation(sizes=(8,))
    algorithm, model = make()
    server = algorithm.init_server(model_params(model))
    ctx = contexts(fed)[0]
    carry, plan, _ = start_client(algorithm, server, ctx, 0)
    assert carry["augment"]["inner"]["top"].shape == (len(plan["inner"]),)
    assert carry["augment"]["ltrain"]["flip"].shape == (len(plan["ltrain"]),)
    seen = []
    algorithm.meta_gradient = lambda lam, c, steps, val, ltrain: seen.append((steps, val, ltrain)) or (
        {n: torch.zeros_like(t) for n, t in lam.items()}, torch.tensor(1.0, dtype=torch.float64), torch.tensor(True))
    from pfl_core.engine.plans import gather, make_buckets

    batches, masks = gather([ctx.dataset], [plan], make_buckets([plan], (), 0.0)[0], stacked=False)
    algorithm.local_update(carry, batches, masks)
    (steps, val, ltrain), = seen
    draws, pad = carry["augment"], carry["augment"]["pad"]
    for i, (x, _) in enumerate(steps):
        torch.testing.assert_close(x, augment_batch(ctx.dataset.batch(plan["inner"][i])[0], draws["inner"], i, pad, 4))
    torch.testing.assert_close(ltrain[0], augment_batch(ctx.dataset.batch(plan["ltrain"][0])[0], draws["ltrain"], 0,
                                                       pad, 4))
    assert torch.equal(val[0], ctx.dataset.batch(plan["val"][0])[0])  # val: Normalize only
    assert not torch.equal(steps[0][0], ctx.dataset.batch(plan["inner"][0])[0])
    none, _ = make(meta_augment="none")
    assert "augment" not in start_client(none, none.init_server(model_params(model)), contexts(fed)[0], 0)[0]


def test_flip_rotate_meta_augmentation_is_one_flip_and_angle_per_batch_on_the_raw_image():
    """Office/DomainNet: RandomHorizontalFlip + RandomRotation(+-30) shared by the batch, applied
    before Normalize (the rotation's zero fill is black), as pfl_core.data.augment.flip_rotate does it."""
    from pfl_core.data.augment.flip_rotate import FlipRotate, flip_rotate

    fed = l2p_federation(sizes=(8,))
    algorithm, model = make(meta_augment="flip_rotate")
    server = algorithm.init_server(model_params(model))
    ctx = contexts(fed)[0]
    carry, plan, _ = start_client(algorithm, server, ctx, 0)
    draws = carry["augment"]
    assert set(draws["inner"]) == {"flip", "angle"} and draws["inner"]["angle"].shape == (len(plan["inner"]),)
    assert bool((draws["inner"]["angle"].abs() <= 30).all())
    x = ctx.dataset.batch(plan["inner"][1])[0]
    pad = draws["pad"]
    got = augment_batch(x, draws["inner"], 1, pad, 4)
    n = x.shape[0]
    shared = FlipRotate(draws["inner"]["flip"][1].expand(n), draws["inner"]["angle"][1].expand(n))
    torch.testing.assert_close(got, flip_rotate(x - pad, shared) + pad)
    assert not torch.equal(got, x)


# ------------------------------------------------------------------ meta-gradients

def test_the_meta_gradient_reaches_eta_tilde_only_through_the_last_inner_step():
    """An outer step of S inner steps gives the same meta-gradient as one that starts at the
    weights and statistics of step S-1 and runs the last step alone: the earlier steps (their
    learning rates included) carry no gradient."""
    fed = l2p_federation(sizes=(12,))
    algorithm, _ = make(inner_epochs=1)
    server = algorithm.init_server(model_params(algorithm.model))
    carry, steps, val, ltrain = one_outer_step(algorithm, server, contexts(fed)[0])
    assert len(steps) == 3
    full, loss_full, _ = algorithm.meta_gradient(server["lambda"], carry, steps, val, ltrain)
    w, g, buffers = algorithm.inner_loop(server["lambda"], carry, steps[:-1])
    lrs = algorithm.lr_tree(algorithm.betas_and_lrs(server["lambda"], carry["xi"], carry["x"])[1])
    late = {**carry, "params": {n: w[n] - lrs[n] * g[n] for n in w}, "buffers": buffers}
    last, loss_last, _ = algorithm.meta_gradient(server["lambda"], late, steps[-1:], val, ltrain)
    assert float(loss_full) == pytest.approx(float(loss_last), rel=1e-10)
    assert any(float(full[n].abs().max()) > 0 for n in full)
    for n in full:
        torch.testing.assert_close(full[n], last[n], rtol=1e-8, atol=1e-12)


def reference_meta_gradient(algorithm, lam, carry, steps, val, ltrain, q=3, psi=0.1):
    """ClientFit's outer step the way the authors' code computes it: eager autograd on tensors,
    the last inner step kept in the graph, double-backward Hessian-vector products
    (``client_utils.Hypergrad``), BNNet's direct term added."""
    model, names = algorithm.model, bn_names(algorithm.model)
    meta = {n: t.detach().clone().requires_grad_(True) for n, t in lam.items()}
    betas, lrs = torch.func.functional_call(algorithm.meta_nets, meta, (carry["xi"], carry["x"]))
    w, buffers = dict(carry["params"]), set_betas(carry["buffers"], names, betas.detach())
    with bn_mode(model, "train"):
        for j, (x, y) in enumerate(steps):
            leaves = {n: p.detach().requires_grad_(True) for n, p in w.items()}
            logits, buffers = forward_bn(model, leaves, buffers, x)
            loss = torch.nn.functional.cross_entropy(logits, y)
            g = torch.autograd.grad(loss, list(leaves.values()))
            if loss > 100:
                g = [t.clamp(-0.5, 0.5) for t in g]
            buffers = {k: v.detach() for k, v in buffers.items()}
            last = j == len(steps) - 1
            w = {n: leaves[n].detach() - (lrs[i] if last else lrs[i].detach()) * g[i] for i, n in enumerate(leaves)}
    with bn_mode(model, "eval"):
        mixed = set_betas(buffers, names, betas)
        val_loss = torch.nn.functional.cross_entropy(forward_bn(model, w, mixed, val[0])[0], val[1])
        train_loss = torch.nn.functional.cross_entropy(forward_bn(model, w, mixed, ltrain[0])[0], ltrain[1])
    params, metas = list(w.values()), list(meta.values())
    v = torch.autograd.grad(val_loss, params, retain_graph=True)
    d_train = torch.autograd.grad(train_loss, params, create_graph=True)
    p = v
    for _ in range(q):
        hv = torch.autograd.grad(d_train, params, grad_outputs=v, retain_graph=True)
        v = [a - psi * b for a, b in zip(v, hv)]
        p = [a + b for a, b in zip(p, v)]
    grads = {n: -t for n, t in zip(meta, torch.autograd.grad(d_train, metas, grad_outputs=p, retain_graph=True))}
    bn = [n for n in meta if n.startswith("bn_net.")]
    for n, t in zip(bn, torch.autograd.grad(val_loss, [meta[n] for n in bn])):
        grads[n] = grads[n] + t
    return grads


def test_ift_meta_gradient_equals_the_codes_double_backward_computation():
    fed = l2p_federation(sizes=(8,))
    algorithm, model = make()
    server = algorithm.init_server(model_params(model))
    carry, steps, val, ltrain = one_outer_step(algorithm, server, contexts(fed)[0])
    ours = algorithm.meta_gradient(server["lambda"], carry, steps, val, ltrain)[0]
    theirs = reference_meta_gradient(algorithm, server["lambda"], carry, steps, val, ltrain)
    assert set(ours) == set(theirs)
    for n in ours:
        torch.testing.assert_close(ours[n], theirs[n], rtol=1e-7, atol=1e-13)
    assert all(float(t.abs().max()) > 0 for t in ours.values() if t.dim() == 1 and t.numel() > 1)


def test_fomaml_gives_eta_tilde_the_last_step_gradient_by_hand():
    """FOMAML+: d L_V / d eta-tilde_j = -m_j <dL_V/dw_j, g_j> with w = w_{S-1} - eta g (Eq. 9-10)."""
    fed = l2p_federation(sizes=(8,))
    algorithm, model = make(hypergradient="fomaml")
    server = algorithm.init_server(model_params(model))
    carry, steps, val, _ = one_outer_step(algorithm, server, contexts(fed)[0])
    grads, _, _ = algorithm.meta_gradient(server["lambda"], carry, steps, val, None)
    w, g, buffers = algorithm.inner_loop(server["lambda"], carry, steps)
    betas, lrs = algorithm.betas_and_lrs(server["lambda"], carry["xi"], carry["x"])
    w_last = {n: w[n] - lrs[j] * g[n] for j, n in enumerate(w)}

    def val_loss(weights):
        with bn_mode(model, "eval"):
            logits, _ = forward_bn(model, weights, set_betas(buffers, bn_names(model), betas), val[0])
        return torch.nn.functional.cross_entropy(logits, val[1])

    v = torch.func.grad(val_loss)(w_last)
    m = lrs / server["lambda"]["eta_tilde"]
    expected = torch.stack([-m[j] * (v[n] * g[n]).sum() for j, n in enumerate(w)])
    torch.testing.assert_close(grads["eta_tilde"], expected, rtol=1e-8, atol=1e-14)
    assert float(expected.abs().max()) > 0


def test_ift_scales_the_implicit_term_and_adds_the_direct_term_to_bnnet_only():
    """paper scaling = 10 x textbook for the implicit term (p not scaled by psi); LRNet and
    eta-tilde get the implicit term alone, BNNet also the direct dL_V/dlambda (= FOMAML+'s BNNet
    gradient, as the weights do not depend on BNNet)."""
    fed = l2p_federation(sizes=(8,))
    first, model = make()
    server = first.init_server(model_params(model))
    carry, steps, val, ltrain = one_outer_step(first, server, contexts(fed)[0])
    runs = {}
    for name, hp in {"paper": {}, "textbook": {"neumann_scaling": "textbook"},
                     "fomaml": {"hypergradient": "fomaml"}}.items():
        algorithm, _ = make(**hp)
        # the same batches for all three, without L_T for FOMAML+
        runs[name] = algorithm.meta_gradient(server["lambda"], carry, steps, val,
                                             None if name == "fomaml" else ltrain)[0]
    paper, textbook, direct = runs["paper"], runs["textbook"], runs["fomaml"]
    for n in paper:
        if n.startswith("bn_net."):
            implicit = (paper[n] - textbook[n]) / 9
            torch.testing.assert_close(textbook[n] - implicit, direct[n], rtol=1e-6, atol=1e-12)
        else:
            torch.testing.assert_close(paper[n], 10 * textbook[n], rtol=1e-8, atol=1e-14)
    assert float(direct["bn_net.net.4.bias"].abs().max()) > 0
    assert float((paper["eta_tilde"] - direct["eta_tilde"]).abs().max()) > 0


def test_a_round_clamps_meta_gradients_and_steps_each_part_with_its_lr():
    """One outer step: lambda moves by lr x clamp(grad, -1, 1), BNNet/LRNet at their lrs and
    eta-tilde at 1e-4 (here: huge meta lrs make the clamp visible)."""
    fed = l2p_federation(sizes=(8,))
    algorithm, model = make(lr_bnnet=0.5, lr_lrnet=0.25, lr_eta=0.125, meta_clip=1e-6)
    server = algorithm.init_server(model_params(model))
    ctx = contexts(fed)[0]
    carry, plan, _ = start_client(algorithm, server, ctx, 0)
    assert len(plan["val"]) == 1
    from pfl_core.engine.plans import gather, make_buckets

    batches, masks = gather([ctx.dataset], [plan], make_buckets([plan], (), 0.0)[0], stacked=False)
    out, loss = algorithm.local_update(carry, batches, masks)
    for n, before in server["lambda"].items():
        step = (before - out["lambda"][n]).abs()
        lr = {"bn_net": 0.5, "lr_net": 0.25, "eta_tilde": 0.125}[n.split(".")[0]]
        assert float(step.max()) <= lr * 1e-6 * (1 + 1e-9)
    assert float((server["lambda"]["eta_tilde"] - out["lambda"]["eta_tilde"]).abs().max()) == pytest.approx(0.125e-6)
    assert math.isfinite(float(loss))


def test_an_inner_loss_above_100_clamps_that_steps_gradient_to_half():
    fed = l2p_federation(sizes=(8,))
    algorithm, model = make()
    server = algorithm.init_server(model_params(model))
    carry, steps, _, _ = one_outer_step(algorithm, server, contexts(fed)[0])
    loud = {**carry, "params": {**carry["params"], "fc.bias": carry["params"]["fc.bias"] + torch.tensor([1e3, 0, 0])}}
    y = torch.ones_like(steps[0][1])  # every label away from the class with the huge bias: loss ~ 1000
    _, g, _ = algorithm.inner_loop(server["lambda"], loud, [(steps[0][0], y)])
    assert float(g["fc.bias"].abs().max()) == pytest.approx(0.5)  # d CE / d bias is -1 and +1 before the clamp
    _, g_quiet, _ = algorithm.inner_loop(server["lambda"], carry, [(steps[0][0], y)])
    assert all(float(t.abs().max()) <= 0.5 for t in g.values())
    assert not torch.equal(g_quiet["fc.bias"], g["fc.bias"])


def test_an_outer_step_with_a_non_finite_val_loss_is_skipped():
    """The code's ``continue``: lambda unchanged and the step left out of the mean L_V."""
    fed = l2p_federation(sizes=(8,))
    algorithm, model = make()
    server = algorithm.init_server(model_params(model))
    ctx = contexts(fed)[0]
    ctx.dataset.x[fed.clients[0].splits["val"][0]] = float("nan")
    carry, plan, _ = start_client(algorithm, server, ctx, 0)
    from pfl_core.engine.plans import gather, make_buckets

    batches, masks = gather([ctx.dataset], [plan], make_buckets([plan], (), 0.0)[0], stacked=False)
    out, loss = algorithm.local_update(carry, batches, masks)
    assert all(torch.equal(out["lambda"][n], t) for n, t in server["lambda"].items())
    assert math.isnan(float(loss))  # no step counted: 0 / 0


# ------------------------------------------------------------------ server loop

def fake_updates(algorithm, server, values, losses, sizes):
    return [ClientUpdate({n: torch.full_like(t, v) for n, t in server["lambda"].items()}, s, torch.tensor(l))
            for v, l, s in zip(values, losses, sizes)]


def test_server_averages_lambda_by_val_size_and_keeps_the_best_round():
    algorithm, model = make(patience=2)
    server = algorithm.init_server(model_params(model))
    rounds = [([1.0, 4.0], [2.0, 4.0]), ([2.0, 5.0], [1.0, 1.5]), ([0.0, 3.0], [2.0, 2.0]), ([0.0, 6.0], [3.0, 1.0])]
    stops = []
    for values, losses in rounds:
        server = algorithm.aggregate(server, fake_updates(algorithm, server, values, losses, sizes=[1, 2]))
        stops.append(algorithm.stop_after_round(server))
    # the last round: (1 x 0 + 2 x 6) / 3 = 4; best = round 2 (unweighted loss 1.25)
    four = torch.full((62,), 4.0, dtype=torch.float64)
    torch.testing.assert_close(server["lambda"]["eta_tilde"], four)
    assert server["best_round"] == 2 and server["best_loss"] == pytest.approx(1.25)
    torch.testing.assert_close(server["best_lambda"]["eta_tilde"], four)  # (2 + 2 x 5) / 3
    assert algorithm.round_metrics(server)["val_loss"] == pytest.approx(2.0)
    assert stops == [False, False, False, True]  # rnd - best_rnd >= 2 at round 4
    uniform, _ = make(weighting="uniform")
    s = uniform.aggregate(server, fake_updates(uniform, server, [1.0, 4.0], [1.0, 1.0], sizes=[1, 2]))
    torch.testing.assert_close(s["lambda"]["lr_net.net.0.bias"], torch.full((100,), 2.5, dtype=torch.float64))


def test_a_method_stop_ends_the_federation_with_a_final_evaluation():
    class StopsAtTwo(FedAvg):
        def stop_after_round(self, server):
            return len(self.rounds_seen) == 2

        def aggregate(self, server, updates):
            self.rounds_seen.append(1)
            return super().aggregate(server, updates)

    fed = l2p_federation(sizes=(6, 6))
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Flatten(), torch.nn.Linear(108, 3)).double()
    algorithm = StopsAtTwo(model, StopsAtTwo.hyper_class.from_dict({"lr": 0.1, "local_steps": 1}))
    algorithm.rounds_seen = []
    cfg = FederationConfig(rounds=5, clients_per_round=2, batch_size=4)
    result = run_federation(algorithm, fed, model_params(model), cfg,
                            SeenClients(EvalConfig(steps=0, lr=0.1, reduction="sample")), RunStreams(0))
    assert result.stopped_round == 2 and len(result.history) == 2 and result.final is not None


def test_fedl2p_runs_end_to_end_and_personalizes_with_the_best_lambda():
    fed = l2p_federation(sizes=(8, 8))
    algorithm, model = make()
    cfg = FederationConfig(rounds=2, clients_per_round=2, batch_size=4)
    result = run_federation(algorithm, fed, model_params(model), cfg,
                            SeenClients(EvalConfig(steps=0, lr=0.1, reduction="sample")), RunStreams(0))
    server = result.server
    assert [r["val_loss"] for r in result.history] == pytest.approx([r["train_loss"] for r in result.history])
    best = server["best_round"]
    assert result.history[best - 1]["val_loss"] == min(r["val_loss"] for r in result.history)
    ctx = result.contexts[0]
    xi, x = algorithm.client_inputs(server, ctx)
    out = algorithm.meta_outputs(server["best_lambda"], xi, x)
    betas, lrs = algorithm.betas_and_lrs(server["best_lambda"], xi, x)
    torch.testing.assert_close(out["beta"], betas)
    torch.testing.assert_close(out["eta"], lrs)
    assert out["beta"].shape == (20,) and out["eta"].shape == (62,) and out["x"].shape == (82,)
    assert float(out["beta"].min()) >= 0 and float(out["beta"].max()) <= 1


def test_finetune_recipe_returns_the_best_lambdas_betas_and_lrs():
    from pfl_core.algorithms._lib.finetune import MetaInputs

    fed = l2p_federation(sizes=(8,))
    algorithm, model = make()
    server = algorithm.init_server(model_params(model))
    server["best_lambda"] = {n: t * 1.5 for n, t in server["lambda"].items()}
    xi, x = algorithm.client_inputs(server, contexts(fed)[0])
    recipe = algorithm.finetune_recipe(server, server["pretrained"], MetaInputs(xi, x))
    betas, lrs = algorithm.betas_and_lrs(server["best_lambda"], xi, x)
    torch.testing.assert_close(recipe.betas, betas)
    torch.testing.assert_close(torch.stack(list(recipe.lrs)), lrs)
    assert recipe.running_init == "reset" and recipe.test_mode == "eval" and recipe.skip_nonfinite
    bn_only, _ = make(lr_net=False, inner_lr=0.01)
    lam = bn_only.init_server(model_params(model))["lambda"]
    assert bn_only.finetune_recipe({"best_lambda": lam}, None, (xi, x)).lrs == 0.01


# ------------------------------------------------------------------ switches

def test_ablation_switches_shape_lambda_and_betas():
    bn_only, model = make(lr_net=False, inner_lr=0.01)
    server = bn_only.init_server(model_params(model))
    assert {n.split(".")[0] for n in server["lambda"]} == {"bn_net"}
    xi, x = torch.rand(20, dtype=torch.float64), torch.rand(82, dtype=torch.float64)
    out = bn_only.meta_outputs(server["lambda"], xi, x)
    assert torch.all(out["eta"] == 0.01)
    lr_only, model = make(bn_net=False, fixed_beta=0.0)
    lam = lr_only.init_server(model_params(model))["lambda"]
    assert {n.split(".")[0] for n in lam} == {"lr_net", "eta_tilde"}
    assert torch.all(lr_only.meta_outputs(lam, xi, x)["beta"] == 0.0)
    for bad, words in [({"bn_net": False, "lr_net": False, "fixed_beta": 1.0}, "nothing to learn"),
                       ({"bn_net": False}, "needs fixed_beta"), ({"fixed_beta": 1.0}, "only with bn_net: false")]:
        with pytest.raises(ValueError, match=words):
            make(**bad)
    with pytest.raises(ValueError, match="KLD-BatchNorm"):
        FedL2P(torch.nn.Linear(3, 2), FedL2P.hyper_class())


def test_bn_only_ablation_trains_with_the_fixed_lr():
    """BNNet only: every inner step uses inner_lr (code ``start_inner_lr``): the last step's
    weights are w - inner_lr g."""
    fed = l2p_federation(sizes=(8,))
    algorithm, model = make(lr_net=False, inner_lr=0.05)
    server = algorithm.init_server(model_params(model))
    carry, steps, val, ltrain = one_outer_step(algorithm, server, contexts(fed)[0])
    w1, g1, _ = algorithm.inner_loop(server["lambda"], carry, steps[:1])
    w2, _, _ = algorithm.inner_loop(server["lambda"], carry, steps[:2])
    for n in w1:
        torch.testing.assert_close(w2[n], w1[n] - 0.05 * g1[n])
    grads, _, ok = algorithm.meta_gradient(server["lambda"], carry, steps, val, ltrain)
    assert bool(ok) and set(grads) == set(server["lambda"])


def test_l2p_keeps_lambda_local_and_the_server_unchanged():
    fed = l2p_federation(sizes=(8, 8))
    algorithm, model = make("l2p", outer_epochs=1)
    server = algorithm.init_server(model_params(model))
    ctxs = contexts(fed)
    updates = [algorithm.client_update(server, ctxs[c], 0) for c in (0, 1)]
    assert all(u.params is None for u in updates) and [u.num_samples for u in updates] == [3, 3]
    after = algorithm.aggregate(server, updates)
    assert all(torch.equal(after["lambda"][n], server["lambda"][n]) for n in server["lambda"])
    local = ctxs[0].state["lambda"]
    assert any(not torch.equal(local[n], server["lambda"][n]) for n in local)
    assert any(not torch.equal(local[n], ctxs[1].state["lambda"][n]) for n in local)
    assert algorithm.personal_lambda(after, ctxs[0]) is local
    xi, x = algorithm.client_inputs(after, ctxs[0])
    recipe = algorithm.finetune_recipe(after, after["pretrained"], (xi, x), ctxs[0])
    torch.testing.assert_close(recipe.betas, algorithm.betas_and_lrs(local, xi, x)[0])
    # a second participation continues from the client's own lambda
    assert start_client(algorithm, after, ctxs[0], 1)[0]["lambda"] is local
    with pytest.raises(ValueError, match="not been trained"):
        algorithm.personal_lambda(after, contexts(fed)[1])


def test_l2p_budget_is_the_average_fedl2p_outer_epochs():
    assert l2p_outer_epochs(500, 100, 1000) == 150  # CIFAR-10 (spec "Baselines: L2P")
    assert l2p_outer_epochs(500, 25, 250) == 150  # CIFAR-10-C
    assert l2p_outer_epochs(100, 15, 150) == 30  # DomainNet
    assert l2p_outer_epochs(10, 3, 7) == 13  # ceil(90 / 7)
    assert METHODS.get("l2p").hyper_class().outer_epochs == 150


def test_batched_and_sequential_paths_give_the_same_lambda_after_a_round():
    fed = l2p_federation(sizes=(8, 8, 8))
    runs = []
    for execution in ("sequential", "batched"):
        algorithm, model = make()
        cfg = FederationConfig(rounds=1, clients_per_round=3, batch_size=4)
        runs.append(run_federation(algorithm, fed, model_params(model), cfg,
                                   SeenClients(EvalConfig(steps=0, lr=0.1, reduction="sample")), RunStreams(0),
                                   executor=Executor(execution)).server)
    for n, t in runs[0]["lambda"].items():
        torch.testing.assert_close(runs[1]["lambda"][n], t, rtol=1e-7, atol=1e-12)
    assert runs[0]["val_loss"] == pytest.approx(runs[1]["val_loss"], rel=1e-10)
    init, _ = make()
    start = init.init_server(model_params(tiny_resnet().double()))["lambda"]
    assert any(not torch.equal(runs[0]["lambda"][n], start[n]) for n in start)


# ------------------------------------------------------------------ end to end

@pytest.mark.parametrize("method,federation", [("fedl2p", {"rounds": 2, "clients_per_round": 2}),
                                               ("l2p", {"rounds": 1, "clients_per_round": 0})])
def test_fedl2p_and_l2p_run_through_the_experiment_and_finetune_pretrained(tmp_path, monkeypatch, method, federation):
    """CIFAR-10-format files, 2 clients (15 train / 5 val / 5 test), a width-2 ResNet: the run
    trains lambda, then the protocol fine-tunes every client with the recipe of the best (L2P: its
    own) lambda; the per-client arrays hold BNNet's betas and LRNet's lrs."""
    from fake_data import write_cifar10
    from pfl_core.config import RunConfig
    from pfl_core.experiment import run_experiment

    write_cifar10(tmp_path, 10, monkeypatch)
    monkeypatch.setenv("PFL_DOWNLOAD", "0")
    cfg = RunConfig.from_dict({
        "data": {"dataset": "cifar10", "num_clients": 2, "partition": {"name": "iid"},
                 "client_splits": {"val": 0.2, "test": 0.2}},
        "model": {"name": "resnet18_cifar", "params": {"width": 2}},
        "method": {"name": method, "params": FAST},
        "federation": {**federation, "batch_size": 32},
        "evaluation": {"protocol": "finetune_pretrained",
                       "params": {"epochs": 1, "finetune_splits": ["train", "val"], "augment": False, "lr": 0.05}},
        "seed": 0,
    })
    result = run_experiment(cfg, device="cpu", data_dir=str(tmp_path), execution="sequential")
    arrays = result.arrays["personalization"]
    assert arrays["beta"].shape == (2, 20) and ((arrays["beta"] >= 0) & (arrays["beta"] <= 1)).all()
    assert not (arrays["beta"] == 1).all()  # BNNet's, not BN C's
    assert arrays["eta"].shape == (2, 62) and np.isfinite(arrays["eta"]).all()  # eta-tilde may turn negative
    assert not np.allclose(arrays["eta"], 0.05)  # not the protocol's FT lr
    assert 0 <= result.metrics["acc_pooled"] <= 100


def test_stage_two_training_reads_no_federation_reshuffle():
    """FedL2P's clients cycle their own reshuffled streams, so ``federation.reshuffle`` (false in the
    stage-2 blocks of Tables 1-2, true in other settings) moves no number (docs/papers/fedl2p.md)."""
    runs = []
    for reshuffle in (False, True):
        fed = l2p_federation(sizes=(8, 8))
        algorithm, model = make()
        cfg = FederationConfig(rounds=2, clients_per_round=2, batch_size=3, reshuffle=reshuffle, drop_last=False)
        runs.append(run_federation(algorithm, fed, model_params(model), cfg,
                                   SeenClients(EvalConfig(steps=0, lr=0.1, reduction="sample")), RunStreams(0)))
    assert runs[0].history == runs[1].history
    for key, value in runs[0].server["lambda"].items():
        assert torch.equal(runs[1].server["lambda"][key], value)
