"""The conv4 / conv4_frl backbones (MetaVers spec, "Models"): shapes, layers, initialisation."""
import math

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from pfl_core.models import build_model, count_parameters
from pfl_core.training import embed, forward, model_params

# conv1 (3*64*9 + 64) + BN (128), then 3 x [conv (64*64*9 + 64) + BN (128)]
CONV4_PARAMETERS = 3 * 64 * 9 + 64 + 128 + 3 * (64 * 64 * 9 + 64 + 128)


@pytest.mark.parametrize("name,shape,dim", [("conv4", (3, 32, 32), 256), ("conv4", (3, 84, 84), 1600),
                                            ("conv4_frl", (3, 32, 32), 4096)])
def test_embedding_sizes_of_the_spec(name, shape, dim):
    model = build_model(name, shape, 5)
    params = model_params(model)
    x = torch.randn(3, *shape)
    out = forward(model, params, x)
    assert out.shape == (3, dim) and count_parameters(model) == CONV4_PARAMETERS == 113_088
    torch.testing.assert_close(embed(model, params, x), out)  # the output is the embedding
    assert {n.rsplit(".", 1)[1] for n, _ in model.named_buffers()} >= {"running_mean", "running_var"}  # as the code


def _reference(params: dict, x: torch.Tensor, pools: tuple[bool, ...]) -> torch.Tensor:
    """The blocks written out (train mode): conv3x3 (padding 1) -> batch-statistics BN -> ReLU [-> maxpool 2]."""
    for i, pool in enumerate(pools):
        x = F.conv2d(x, params[f"blocks.{i}.0.weight"], params[f"blocks.{i}.0.bias"], padding=1)
        mean, var = x.mean((0, 2, 3), keepdim=True), x.var((0, 2, 3), unbiased=False, keepdim=True)
        x = (x - mean) / torch.sqrt(var + 1e-5)
        x = x * params[f"blocks.{i}.1.weight"].view(1, -1, 1, 1) + params[f"blocks.{i}.1.bias"].view(1, -1, 1, 1)
        x = F.relu(x)
        x = F.max_pool2d(x, 2) if pool else x
    return x.flatten(1)


@pytest.mark.parametrize("name,pools", [("conv4", (True,) * 4), ("conv4_frl", (True, True, False, False))])
def test_layers_in_the_code_order(name, pools):
    torch.manual_seed(0)
    model = build_model(name, (3, 32, 32), 5)
    params = model_params(model)
    x = torch.randn(4, 3, 32, 32)
    torch.testing.assert_close(forward(model, params, x), _reference(params, x, pools), rtol=1e-4, atol=1e-4)


def test_conv4_has_learn2learn_init_and_conv4_frl_pytorch_defaults():
    torch.manual_seed(0)
    l2l = build_model("conv4", (3, 84, 84), 5)
    frl = build_model("conv4_frl", (3, 32, 32), 5)
    for block in l2l.blocks:
        conv, norm = block[0], block[1]
        fan_in, fan_out = conv.in_channels * 9, conv.out_channels * 9
        bound = math.sqrt(6 / (fan_in + fan_out))  # Xavier-uniform, gain 1
        assert conv.weight.abs().max() <= bound and conv.weight.abs().max() > 0.9 * bound
        assert (conv.bias == 0).all()
        assert (norm.weight >= 0).all() and (norm.weight <= 1).all() and norm.weight.std() > 0.1  # U(0, 1)
        assert (norm.bias == 0).all()
    for block in frl.blocks:
        conv, norm = block[0], block[1]
        assert conv.weight.abs().max() <= 1 / math.sqrt(conv.in_channels * 9)  # kaiming_uniform(a=sqrt 5)
        assert (conv.bias != 0).any()
        assert (norm.weight == 1).all() and (norm.bias == 0).all()
    pooled = [any(isinstance(m, nn.MaxPool2d) for m in block) for block in frl.blocks]
    assert pooled == [True, True, False, False]


def test_conv4_runs_stacked_under_vmap():
    model = build_model("conv4", (3, 32, 32), 5)
    params = model_params(model)
    stacked = {k: torch.stack([v, v + 0.01]) for k, v in params.items()}
    x = torch.randn(2, 6, 3, 32, 32)
    out = torch.func.vmap(lambda p, xb: forward(model, p, xb))(stacked, x)
    torch.testing.assert_close(out[1], forward(model, {k: v[1] for k, v in stacked.items()}, x[1]))


def test_too_small_inputs_are_rejected():
    with pytest.raises(ValueError, match=r"model 'conv4' expects .* at least 16x16"):
        build_model("conv4", (3, 8, 8), 5)
