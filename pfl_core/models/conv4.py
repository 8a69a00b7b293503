"""The four-block conv backbones of MetaVers (docs/papers/metavers.md), embedding networks whose
output *is* the embedding (``num_classes`` is unused: prototypes classify), like ``le_embedding``.

``conv4``: learn2learn's ``CNN4Backbone`` as the MetaVers code builds it (``Convnet``: 3 channels,
``max_pool=True``): 4 x [Conv3x3(64, padding 1) -> BatchNorm -> ReLU -> MaxPool(2)], flattened;
256-d on 32x32 inputs, 1600-d on 84x84 (mini-ImageNet). learn2learn's initialisation: conv weights
Xavier-uniform (gain 1) with bias 0, BatchNorm gamma ~ U(0, 1) and beta 0.

``conv4_frl``: the code's ``conv4_FRL`` (CIFAR-100 novel classes): 4 x [Conv3x3(64, padding 1) ->
BatchNorm -> ReLU], MaxPool(2) after the first two blocks only; 64 x 8 x 8 = 4096-d on 32x32.
PyTorch's default initialisation.

BatchNorm with running statistics, as the code's ``nn.BatchNorm2d`` (PyTorch defaults: momentum
0.1, eps 1e-5; MetaVers ``model.py`` ``conv_block``, learn2learn ``ConvBlock``): the layers are
:class:`~pfl_core.models.kld_bn.KLDBatchNorm2d` at beta = 1, i.e. plain BatchNorm whose running
statistics are functional state beside the parameters (``server["buffers"]``). Train mode normalises
each pass with its batch statistics; eval mode with the running statistics, which the methods
update in the code's passes (:mod:`pfl_core.algorithms._lib.bn_passes` for MetaVers, the averaged client statistics
for FedAvg). The novel-class protocol embeds in eval mode with them (``util_novel_class.evaluation``
runs after ``model.eval()``), so an embedding does not depend on the other rows of its batch.
"""
from __future__ import annotations

import torch
import torch.nn as nn

from pfl_core.models import MODELS
from pfl_core.models.kld_bn import KLDBatchNorm2d, keeps_bn_state
from pfl_core.models.pooling import relu_then_pool

WIDTH = 64


def _block(c_in: int, pool: bool) -> nn.Sequential:
    """Conv3x3 -> BN -> ReLU [-> MaxPool(2)], ReLU and pool computed pool first (``relu_then_pool``)."""
    return nn.Sequential(nn.Conv2d(c_in, WIDTH, 3, padding=1), KLDBatchNorm2d(WIDTH),
                         *(relu_then_pool() if pool else [nn.ReLU()]))


def _learn2learn_init(block: nn.Sequential) -> None:
    """learn2learn's ``ConvBlock`` initialisation: Xavier-uniform conv weights, bias 0, BN gamma ~ U(0, 1)."""
    conv, norm = block[0], block[1]
    nn.init.xavier_uniform_(conv.weight, gain=1.0)
    nn.init.zeros_(conv.bias)
    nn.init.uniform_(norm.weight)


class Conv4(nn.Module):
    """Four conv blocks, flattened; ``pools`` says which blocks end with MaxPool(2)."""

    def __init__(self, channels: int, pools: tuple[bool, bool, bool, bool], learn2learn_init: bool):
        super().__init__()
        self.blocks = nn.Sequential(*(_block(channels if i == 0 else WIDTH, pool) for i, pool in enumerate(pools)))
        if learn2learn_init:
            for block in self.blocks:
                _learn2learn_init(block)

    def forward(self, x: torch.Tensor, embed: bool = False) -> torch.Tensor:
        return self.blocks(x).flatten(1)


def _check_input(name: str, input_shape: tuple[int, ...], pooled: int) -> None:
    if len(input_shape) != 3 or min(input_shape[1:]) < 2 ** pooled:
        raise ValueError(f"model {name!r} expects (channels, H, W) inputs of at least {2 ** pooled}x{2 ** pooled} "
                         f"pixels, got {tuple(input_shape)}")


@MODELS.register("conv4")
@keeps_bn_state
def conv4(input_shape: tuple[int, ...], num_classes: int) -> nn.Module:
    """learn2learn CNN4 backbone (MetaVers ``Convnet``): 256-d on 32x32, 1600-d on 84x84."""
    _check_input("conv4", input_shape, 4)
    return Conv4(input_shape[0], (True, True, True, True), learn2learn_init=True)


@MODELS.register("conv4_frl")
@keeps_bn_state
def conv4_frl(input_shape: tuple[int, ...], num_classes: int) -> nn.Module:
    """MetaVers ``conv4_FRL``: pooling after blocks 1 and 2 only; 4096-d on 32x32."""
    _check_input("conv4_frl", input_shape, 2)
    return Conv4(input_shape[0], (True, True, False, False), learn2learn_init=False)
