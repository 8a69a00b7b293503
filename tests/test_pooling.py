"""The channels-last max-pool forward (pfl_core.models.pooling) gives F.max_pool2d's numbers bit
for bit: values, indices, gradients and second derivatives, ties and NaN included."""
import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from pfl_core.models import build_model
from pfl_core.models.pooling import MaxPool2d, max_pool2d
from pfl_core.training import gradients, model_params

GEOMETRIES = [  # (kernel, stride, padding): conv_block / LeNet, defaults, ResNet's ImageNet stem
    (2, 2, 0), (2, None, 0), (3, 2, 1)]


def activations(shape, dtype, seed=0):
    """ReLU'd values on a coarse grid: many exact ties (zeros and equal maxima) in each window."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randint(-3, 4, shape, generator=gen).to(dtype).relu()
    return x + 0.5 * (torch.rand(shape, generator=gen, dtype=dtype) < 0.3).to(dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("kernel,stride,padding", GEOMETRIES)
@pytest.mark.parametrize("shape", [(3, 4, 12, 12), (2, 3, 9, 7)])
def test_forward_and_gradient_equal_max_pool2d(dtype, kernel, stride, padding, shape):
    x = activations(shape, dtype)
    ours_in, ref_in = x.clone().requires_grad_(), x.clone().requires_grad_()
    ours = max_pool2d(ours_in, kernel, stride, padding)
    ref = F.max_pool2d(ref_in, kernel, stride, padding)
    assert ours.shape == ref.shape and ours.is_contiguous()
    assert torch.equal(ours, ref)
    weights = torch.randn(ref.shape, generator=torch.Generator().manual_seed(1), dtype=dtype)
    (ours * weights).sum().backward()
    (ref * weights).sum().backward()
    assert torch.equal(ours_in.grad, ref_in.grad)
    # the tie rule picked the same element: the gradient lands on exactly one input per window
    assert int((ref_in.grad != 0).sum()) <= ref.numel()


def test_channels_last_kernel_picks_the_same_indices():
    """What the module relies on: both CPU kernels return the same flat indices under ties."""
    x = activations((4, 8, 16, 16), torch.float32, seed=3)
    _, nchw = F.max_pool2d(x, 2, 2, return_indices=True)
    _, channels_last = F.max_pool2d(x.contiguous(memory_format=torch.channels_last), 2, 2, return_indices=True)
    assert torch.equal(nchw, channels_last.contiguous())


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("kernel,stride,padding", GEOMETRIES)
def test_values_without_gradient_equal_max_pool2d(dtype, kernel, stride, padding):
    """The no-gradient forward (no autograd.Function, no index copy): the same bits, NaN included."""
    x = activations((3, 5, 11, 12), dtype, seed=4)
    x[0, 0, 0, 0] = float("nan")
    ref = F.max_pool2d(x, kernel, stride, padding)
    for ours in (max_pool2d(x, kernel, stride, padding), _no_grad_pool(x.requires_grad_(), kernel, stride, padding)):
        assert ours.is_contiguous() and not ours.requires_grad
        assert torch.equal(ours.isnan(), ref.isnan()) and torch.equal(ours.nan_to_num(), ref.nan_to_num())


def _no_grad_pool(x, kernel, stride, padding):
    with torch.no_grad():
        return max_pool2d(x, kernel, stride, padding)


def test_nan_and_infinities_propagate_as_in_max_pool2d():
    x = activations((2, 3, 8, 8), torch.float64)
    x[0, 0, 0, 0] = float("nan")
    x[0, 1, 2, 3] = float("inf")
    x[1, 2] = float("-inf")
    ours_in, ref_in = x.clone().requires_grad_(), x.clone().requires_grad_()
    ours, ref = max_pool2d(ours_in, 2), F.max_pool2d(ref_in, 2)
    assert torch.equal(ours.isnan(), ref.isnan())
    assert torch.equal(ours.nan_to_num(), ref.nan_to_num())
    ours.sum().backward()
    ref.sum().backward()
    assert torch.equal(ours_in.grad, ref_in.grad)


def test_second_derivative_equals_max_pool2d():
    """Meta-gradients differentiate through a step: the backward itself must be differentiable."""
    x = activations((2, 3, 8, 8), torch.float64) + torch.rand(2, 3, 8, 8, dtype=torch.float64)
    v = torch.randn(2, 3, 4, 4, dtype=torch.float64)

    def second(pool):
        inp = x.clone().requires_grad_()
        out = pool(inp, 2, 2, 0)
        (g,) = torch.autograd.grad((out ** 3 * v).sum(), inp, create_graph=True)
        (gg,) = torch.autograd.grad((g ** 2).sum(), inp)
        return g.detach(), gg

    ours, ref = second(max_pool2d), second(F.max_pool2d)
    assert torch.equal(ours[0], ref[0]) and torch.equal(ours[1], ref[1])
    assert ref[1].abs().sum() > 0


def test_gradcheck_against_finite_differences():
    x = torch.rand(2, 2, 6, 6, dtype=torch.float64, requires_grad=True)  # distinct values: no ties
    assert torch.autograd.gradcheck(lambda t: max_pool2d(t, 2), (x,))
    assert torch.autograd.gradgradcheck(lambda t: max_pool2d(t, 3, 2, 1), (x,))


def test_inside_torch_func_transforms_equals_max_pool2d():
    """The batched path (vmap over clients, grad inside) takes F.max_pool2d and agrees."""
    xs = activations((3, 2, 4, 8, 8), torch.float64)
    loss = lambda pool: (lambda t: pool(t, 2, 2, 0).pow(2).sum())
    ours = torch.func.vmap(torch.func.grad(loss(max_pool2d)))(xs)
    ref = torch.func.vmap(torch.func.grad(loss(F.max_pool2d)))(xs)
    assert torch.equal(ours, ref)


def test_module_matches_nn_maxpool_in_a_model_step():
    """Model A's gradient equals the one of its textbook blocks (Conv -> BN -> ReLU ->
    ``nn.MaxPool2d``) swapped back in."""
    torch.manual_seed(0)
    model = build_model("cafeme_cnn_a", (1, 28, 28), 10)
    pools = [m for m in model.modules() if isinstance(m, MaxPool2d)]
    assert len(pools) == 2
    params = model_params(model)
    x, y = torch.rand(6, 1, 28, 28), torch.randint(0, 10, (6,))
    ours, loss = gradients(model, params, x, y)
    from benchmarks.timing.block_timing import textbook  # the blocks the speed benchmark compares against

    ref, ref_loss = gradients(textbook(model), params, x, y)
    assert torch.equal(loss, ref_loss)
    assert all(torch.equal(ours[k], ref[k]) for k in ref)


def _conv_block(batchnorm):
    from pfl_core.models.cnn import conv_block

    return conv_block(3, 8, 3, "same", batchnorm)


def _conv4_block(_batchnorm):
    from pfl_core.models.conv4 import _block

    return _block(3, pool=True)


@pytest.mark.parametrize("make_block,batchnorm,size", [
    (_conv_block, True, 10), (_conv_block, False, 10), (_conv4_block, True, 11)])  # 11: floor mode drops a row
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_blocks_pool_before_relu_with_the_textbook_numbers(make_block, batchnorm, size, dtype):
    """``conv_block`` and the conv4 block run Conv -> BN -> MaxPool -> ReLU (``relu_then_pool``):
    outputs and every gradient equal the textbook Conv -> BN -> ReLU -> MaxPool bit for bit, ties
    and all-negative windows included."""
    torch.manual_seed(0)
    ours = make_block(batchnorm).to(dtype)
    assert [type(m).__name__ for m in ours][-2:] == ["MaxPool2d", "ReLU"]
    textbook = nn.Sequential(*[m for m in ours if not isinstance(m, (nn.ReLU, nn.MaxPool2d))],
                             nn.ReLU(), nn.MaxPool2d(2, 2))
    x = activations((5, 3, size, size), dtype, seed=4) - 1.0  # many negative and tied pre-activations
    out_shape = (5, 8 if make_block is _conv_block else 64, size // 2, size // 2)
    weights = torch.randn(out_shape, generator=torch.Generator().manual_seed(5), dtype=dtype)
    results = []
    for block in (ours, textbook):
        block.zero_grad()
        inp = x.clone().requires_grad_()
        out = block(inp)
        (out * weights).sum().backward()
        results.append((out.detach(), inp.grad, [p.grad.clone() for p in block.parameters()]))
    (out_a, gx_a, gp_a), (out_b, gx_b, gp_b) = results
    assert torch.equal(out_a, out_b) and torch.equal(gx_a, gx_b)
    assert all(torch.equal(a, b) for a, b in zip(gp_a, gp_b))
    assert (out_a == 0).any() and (out_a > 0).any()


def test_block_timing_benchmark_compares_bit_identical_models(capsys):
    """benchmarks/timing/block_timing.py (the speed claim of the two changes above) runs and finds the
    project's blocks and the textbook blocks at the same parameters after its steps."""
    from benchmarks.timing import block_timing

    result = block_timing.compare("cafeme_cnn_a", (1, 28, 28), batch=4, steps=2, reps=1)
    assert result["bit_identical"] is True
    assert result["textbook_ms"] > 0 and result["project_ms"] > 0 and result["paired_ratio"] > 0
    assert block_timing.main(["--reps", "1", "--threads", "1"]) == 0
    assert "cafeme_cnn_b" in capsys.readouterr().out


def _integer_lenet(name: str) -> nn.Module:
    """A LeNet whose conv weights, biases and inputs are small integers: many exact ties and
    all-negative windows in every pool."""
    torch.manual_seed(0)
    model = build_model(name, (3, 32, 32), 10)
    gen = torch.Generator().manual_seed(7)
    with torch.no_grad():
        for conv in (model.conv1, model.conv2):
            conv.weight.copy_(torch.randint(-1, 2, conv.weight.shape, generator=gen).float())
            conv.bias.copy_(torch.randint(-2, 2, conv.bias.shape, generator=gen).float())
    return model


@pytest.mark.parametrize("name", ["lenet", "le_embedding"])
def test_lenet_pools_before_relu_with_the_textbook_numbers(name):
    """MetaVers' LeNet trunk runs Conv -> MaxPool -> ReLU: its outputs, every parameter gradient, a
    second derivative (Per-FedAvg's Hessian-vector products) and the batched path's vmapped
    gradients equal the textbook Conv -> ReLU -> F.max_pool2d bit for bit."""
    from benchmarks.timing.block_timing import textbook

    ours, ref = _integer_lenet(name), textbook(_integer_lenet(name))
    x = torch.randint(-2, 3, (6, 3, 32, 32), generator=torch.Generator().manual_seed(3)).float()
    y = torch.randint(0, 10, (6,), generator=torch.Generator().manual_seed(4))
    target = (lambda out, yb: F.cross_entropy(out, yb)) if name == "lenet" else (lambda out, yb: out.pow(2).mean())
    results = []
    for model in (ours, ref):
        params = {k: v.detach().requires_grad_() for k, v in model_params(model).items()}
        out = torch.func.functional_call(model, params, (x,))
        grads = torch.autograd.grad(target(out, y), list(params.values()), create_graph=True)
        vector = [torch.ones_like(g) for g in grads]
        hvp = torch.autograd.grad(grads, list(params.values()), vector, allow_unused=True)
        per_client = torch.func.vmap(torch.func.grad(
            lambda p, xb, yb: target(torch.func.functional_call(model, p, (xb,)), yb)), in_dims=(None, 0, 0))(
            {k: v.detach() for k, v in params.items()}, x.view(2, 3, 3, 32, 32), y.view(2, 3))
        results.append((out.detach(), [g.detach() for g in grads], hvp, per_client))
    (out_a, g_a, h_a, v_a), (out_b, g_b, h_b, v_b) = results
    pooled = F.max_pool2d(ours.conv1(x), 2)
    assert (pooled < 0).any() and (pooled == 0).any()  # all-negative windows and ties were exercised
    assert torch.equal(out_a, out_b)
    assert all(torch.equal(a, b) for a, b in zip(g_a, g_b))
    assert all((a is None and b is None) or torch.equal(a, b) for a, b in zip(h_a, h_b))
    assert all(torch.equal(v_a[k], v_b[k]) for k in v_a)
