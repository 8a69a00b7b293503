"""FedL2P's foundation: ResNet-18 variants, KLD-BatchNorm, meta-nets and meta-net inputs
(FedL2P spec, "Models", "KLD-BatchNorm", "Meta-nets", "Meta-net inputs")."""
from __future__ import annotations

import math

import pytest
import torch
import torch.nn as nn
from torch.func import functional_call, vmap

from pfl_core.algorithms._lib.meta_inputs import meta_inputs, symmetric_kl
from pfl_core.models import build_model, count_parameters
from pfl_core.models.kld_bn import (KLDBatchNorm2d, bn_mode, bn_names, forward_bn, load_pretrained,
                                    model_buffers, set_betas)
from pfl_core.models.metanets import MetaNets, ste_clamp
from pfl_core.models.resnet import learnable_modules
from pfl_core.training import model_params


@pytest.mark.parametrize("name,shape,classes,count", [
    ("resnet18_cifar", (3, 32, 32), 10, 11_173_962),
    ("resnet18_audio", (1, 224, 224), 12, 11_176_396),
    ("resnet18_imagenet", (3, 64, 64), 10, 11_181_642),
])
def test_resnet18_sizes_of_the_spec(name, shape, classes, count):
    model = build_model(name, shape, classes)
    assert count_parameters(model) == count
    assert len(bn_names(model)) == 20
    assert len(learnable_modules(model)) == 41
    assert len(list(model.parameters())) == 62
    assert sum(isinstance(m, nn.Conv2d) for m in model.modules()) == 20


def test_resnet18_imagenet_has_torchvision_names_and_shapes():
    from torchvision.models import resnet18

    ours = build_model("resnet18_imagenet", (3, 64, 64), 1000).state_dict()
    theirs = resnet18().state_dict()
    extra = {k for k in ours if k.rsplit(".", 1)[-1] in ("init_running_mean", "init_running_var", "beta")}
    assert set(ours) - extra == set(theirs)
    assert all(ours[k].shape == theirs[k].shape for k in theirs)
    modules = [n for n, _ in learnable_modules(build_model("resnet18_cifar", (3, 32, 32), 10, width=4))]
    assert modules[:8] == ["conv1", "bn1", "layer1.0.conv1", "layer1.0.bn1", "layer1.0.conv2", "layer1.0.bn2",
                           "layer1.1.conv1", "layer1.1.bn1"]
    assert modules[-1] == "fc" and "layer2.0.downsample.0" in modules and "layer2.0.downsample.1" in modules


def _bn_pair(beta: float, seed: int = 0):
    torch.manual_seed(seed)
    ours, ref = KLDBatchNorm2d(3).double(), nn.BatchNorm2d(3).double()
    with torch.no_grad():
        for m in (ours, ref):
            m.weight.copy_(torch.tensor([1.5, 0.5, -1.0]))
            m.bias.copy_(torch.tensor([0.1, -0.2, 0.3]))
        ours.init_running_mean.copy_(torch.tensor([0.5, -1.0, 2.0]))
        ours.init_running_var.copy_(torch.tensor([2.0, 0.5, 3.0]))
        ours.beta.fill_(beta)
    return ours, ref


def test_kld_bn_beta_one_in_training_is_batchnorm_with_its_running_stats():
    ours, ref = _bn_pair(1.0)
    x = torch.randn(6, 3, 4, 5, dtype=torch.float64) * 3 + 1
    params, buffers = model_params(ours), model_buffers(ours)
    before = {k: v.clone() for k, v in buffers.items()}
    ours.train(), ref.train()
    out, new = forward_bn(ours, params, buffers, x)
    assert torch.allclose(out, ref(x))
    assert torch.allclose(new["running_mean"], ref.running_mean)
    assert torch.allclose(new["running_var"], ref.running_var)  # unbiased batch variance, momentum 0.1
    assert int(new["num_batches_tracked"]) == 1
    assert all(torch.equal(before[k], buffers[k]) for k in buffers)  # nothing updated in place
    ours.eval(), ref.eval()  # eval with beta 1: the client's running statistics
    out, same = forward_bn(ours, params, new, x)
    assert torch.allclose(out, ref(x)) and same["running_mean"] is new["running_mean"]


def test_kld_bn_beta_zero_is_batchnorm_with_the_pretrained_statistics():
    ours, ref = _bn_pair(0.0)
    with torch.no_grad():
        ref.running_mean.copy_(ours.init_running_mean)
        ref.running_var.copy_(ours.init_running_var)
    ref.eval()
    x = torch.randn(6, 3, 4, 5, dtype=torch.float64)
    for mode in ("train", "eval", "init"):
        with bn_mode(ours, mode):
            assert torch.allclose(ours(x), ref(x)), mode


def test_kld_bn_mixes_by_beta_paper_eq2():
    ours, _ = _bn_pair(0.3)
    x = torch.randn(8, 3, 2, 2, dtype=torch.float64)
    mu_b, var_b = x.mean((0, 2, 3)), x.var((0, 2, 3), unbiased=False)
    mu = 0.7 * ours.init_running_mean + 0.3 * mu_b
    var = 0.7 * ours.init_running_var + 0.3 * var_b
    expected = (x - mu[None, :, None, None]) / torch.sqrt(var + 1e-5)[None, :, None, None]
    expected = expected * ours.weight[None, :, None, None] + ours.bias[None, :, None, None]
    ours.train()
    assert torch.allclose(ours(x), expected)
    with torch.no_grad():
        ours.running_mean.fill_(0.25)
        ours.running_var.fill_(4.0)
    ours.eval()
    mu = 0.7 * ours.init_running_mean + 0.3 * 0.25
    var = 0.7 * ours.init_running_var + 0.3 * 4.0
    expected = (x - mu[None, :, None, None]) / torch.sqrt(var + 1e-5)[None, :, None, None]
    expected = expected * ours.weight[None, :, None, None] + ours.bias[None, :, None, None]
    assert torch.allclose(ours(x), expected)


def _tiny(seed: int = 0):
    torch.manual_seed(seed)
    return build_model("resnet18_cifar", (3, 8, 8), 10, width=2).double()


def test_beta_gradient_matches_finite_differences():
    model = _tiny()
    params, buffers = model_params(model), model_buffers(model)
    names = bn_names(model)
    x, y = torch.randn(4, 3, 8, 8, dtype=torch.float64), torch.tensor([0, 1, 2, 3])
    pre = {k: torch.rand_like(v) + 0.5 if k.endswith("init_running_var") else
           (torch.randn_like(v) if k.endswith("init_running_mean") else v) for k, v in buffers.items()}

    def loss(betas):
        with bn_mode(model, "train"):
            out, _ = forward_bn(model, params, set_betas(pre, names, betas), x)
        return nn.functional.cross_entropy(out, y)

    betas = torch.full((len(names),), 0.4, dtype=torch.float64, requires_grad=True)
    (grad,) = torch.autograd.grad(loss(betas), betas)
    for j in (0, 7, 19):
        e = torch.zeros_like(betas)
        e[j] = 1e-6
        numeric = (loss(betas.detach() + e) - loss(betas.detach() - e)) / 2e-6
        assert math.isclose(float(grad[j]), float(numeric), rel_tol=1e-5, abs_tol=1e-9)


def test_forward_bn_vmapped_over_clients_equals_each_client_alone():
    model = _tiny()
    params, buffers = model_params(model), model_buffers(model)
    xs = torch.randn(3, 4, 3, 8, 8, dtype=torch.float64)
    betas = torch.tensor([[1.0], [0.5], [0.0]], dtype=torch.float64).expand(3, 20)
    names = bn_names(model)
    stacked = {k: v.expand(3, *v.shape).clone() for k, v in buffers.items()}
    with bn_mode(model, "train"):
        outs, news = vmap(lambda b, s, x: forward_bn(model, params, set_betas(s, names, b), x))(betas, stacked, xs)
        for c in range(3):
            out, new = forward_bn(model, params, set_betas(buffers, names, betas[c]), xs[c])
            assert torch.allclose(outs[c], out)
            assert all(torch.allclose(news[k][c], new[k]) for k in new)
    assert not torch.equal(news["layer1.0.bn1.running_mean"][0], buffers["layer1.0.bn1.running_mean"])


def test_load_pretrained_moves_statistics_to_the_pretrained_slots():
    model = _tiny()
    stats = {f"{n}.{k}": torch.rand(m.num_features, dtype=torch.float64) + 0.1
             for n, m in model.named_modules() if isinstance(m, KLDBatchNorm2d) for k in ("running_mean", "running_var")}
    state = {"params": model_params(model), "buffers": stats}
    _, reset = load_pretrained(model, state, "reset")
    _, kept = load_pretrained(model, state, "pretrained")
    name = "layer2.0.downsample.1"
    assert torch.equal(reset[f"{name}.init_running_mean"], stats[f"{name}.running_mean"])
    assert torch.equal(reset[f"{name}.running_mean"], torch.zeros_like(stats[f"{name}.running_mean"]))
    assert torch.equal(reset[f"{name}.running_var"], torch.ones_like(stats[f"{name}.running_var"]))
    assert torch.equal(kept[f"{name}.running_var"], stats[f"{name}.running_var"])
    assert float(kept[f"{name}.beta"]) == 1.0 and int(kept[f"{name}.num_batches_tracked"]) == 0


def test_ste_clamp_clamps_forward_and_passes_gradient_through():
    x = torch.tensor([-2.0, 0.5, 3.0], requires_grad=True)
    y = ste_clamp(x, 0.0, 1.0)
    assert y.tolist() == [0.0, 0.5, 1.0]
    (y * torch.tensor([1.0, 2.0, 3.0])).sum().backward()
    assert x.grad.tolist() == [1.0, 2.0, 3.0]


def test_metanets_sizes_and_initial_outputs():
    torch.manual_seed(0)
    nets = MetaNets(20, 41, 62, eta_init=1e-3)
    assert count_parameters(nets.bn_net) == 14_220
    assert count_parameters(nets.lr_net) == 24_662
    assert count_parameters(nets) == 38_944
    with torch.no_grad():
        betas, lrs = nets(torch.randn(20), torch.randn(82))
    assert betas.shape == (20,) and torch.all((betas - 0.5).abs() < 0.25) and abs(float(betas.mean()) - 0.5) < 0.1
    assert lrs.shape == (62,) and torch.allclose(lrs, torch.full((62,), 1e-3), rtol=0.3)
    ablated = MetaNets(20, 41, 62, bn_net=False)
    assert ablated(torch.randn(20), torch.randn(82))[0] is None and ablated.eta_tilde is not None


def test_symmetric_kl_is_the_closed_form():
    assert float(symmetric_kl(torch.tensor(1.0), torch.tensor(2.0), torch.tensor(1.0), torch.tensor(2.0))) == 0.0
    mu_p, var_p, mu_q, var_q = 0.0, 1.0 - 1e-5, 1.0, 4.0 - 1e-5  # sigma_p = 1, sigma_q = 2
    kl_pq = math.log(2.0) + (1 + 1) / 8 - 0.5
    kl_qp = math.log(0.5) + (4 + 1) / 2 - 0.5
    got = symmetric_kl(*(torch.tensor(v, dtype=torch.float64) for v in (mu_p, var_p, mu_q, var_q)))
    assert math.isclose(float(got), 0.5 * kl_pq + 0.5 * kl_qp, rel_tol=1e-9)


def test_meta_inputs_equal_statistics_of_all_batches_at_once():
    model = _tiny()
    params = model_params(model)
    stats = {f"{n}.{k}": (torch.rand(m.num_features, dtype=torch.float64) + 0.5) for n, m in model.named_modules()
             if isinstance(m, KLDBatchNorm2d) for k in ("running_mean", "running_var")}
    _, buffers = load_pretrained(model, {"params": params, "buffers": stats})
    batches = [torch.randn(5, 3, 8, 8, dtype=torch.float64), torch.randn(3, 3, 8, 8, dtype=torch.float64)]
    xi, x = meta_inputs(model, params, buffers, batches)
    assert xi.shape == (20,) and x.shape == (82,)
    seen = {}
    hooks = [m.register_forward_pre_hook(lambda mod, a, n=n: seen.setdefault(n, a[0]))
             for n, m in learnable_modules(model)]
    with bn_mode(model, "init"):
        functional_call(model, {**params, **buffers}, (torch.cat(batches),))
    for h in hooks:
        h.remove()
    names = bn_names(model)
    expected_xi = torch.stack([
        symmetric_kl(seen[n].mean((0, 2, 3)), seen[n].var((0, 2, 3)), stats[f"{n}.running_mean"],
                     stats[f"{n}.running_var"]).mean() for n in names])
    assert torch.allclose(xi, expected_xi.flip(0))  # the code prepends: entry j is layer 19 - j
    expected_x = torch.stack([v for n, _ in learnable_modules(model)
                              for v in (seen[n].mean(), (seen[n].var() + 1e-5).sqrt())])
    assert torch.allclose(x, expected_x)
