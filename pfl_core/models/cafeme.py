"""CAFeMe's model: a base CNN modulated by a Federated Modulator (docs/papers/cafeme.md; paper Sec. 4,
Eq. 4.4).

The FM has its own convolutional trunk. Per sample it maps features to a 200-d vector, averages
over the batch (the context), and maps the mean to modulation parameters zeta, which are split
into one vector per modulated layer. The base network's activations are gated by sigmoid(zeta)
after every conv block (after the pool), after the flatten, and after every hidden dense block
(after BN + ReLU), never on the logits.

Switches (named keyword arguments of the registered factories):

* ``modulation``: ``"sigmoid"`` (h * sigmoid(zeta), the final experiments) or ``"film"``
  (h * zeta_a + zeta_b, the paper's unstable ablation; doubles the FM output).
* ``context_labels``: False (the code: the FM sees images only) or True (the paper:
  one-hot labels concatenated to the FM's image features).
* ``fm_batchnorm`` (``cafeme_a`` only): True (the released code, commit 32a76fd: BatchNorm in the
  FM's conv trunk) or False (the results-era code, commit 8ef6145, ``SimpleFNNModuleWithTE``: its
  ``TaskEncoder`` trunk is Conv -> ReLU -> pool, the BN line commented out; 192 fewer
  parameters). Issue 11's paper-scale A/B on RMNIST found no difference (shards 98.41 vs 98.44,
  Dir 0.3 94.86 vs 94.64), so the default stays True.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from pfl_core.models import MODELS
from pfl_core.models.cnn import BaseCNN, _check_shape, cafeme_cnn_a, cafeme_cnn_b, conv_block


class FederatedModulator(nn.Module):
    """trunk -> per-sample MLP -> batch mean -> MLP -> zeta (one vector of size ``sum(sizes)``)."""

    def __init__(self, trunk: nn.Sequential, per_sample: list[int], sizes: list[int],
                 num_classes: int, context_labels: bool, outputs_per_unit: int):
        super().__init__()
        self.trunk = trunk
        self.num_classes = num_classes
        self.context_labels = context_labels
        widths = [per_sample[0] + (num_classes if context_labels else 0), *per_sample[1:]]
        layers: list[nn.Module] = []
        for d_in, d_out in zip(widths[:-1], widths[1:]):
            layers += [nn.Linear(d_in, d_out), nn.ReLU()]
        self.per_sample = nn.Sequential(*layers)
        self.head = nn.Sequential(nn.Linear(widths[-1], 200), nn.ReLU(),
                                  nn.Linear(200, outputs_per_unit * sum(sizes)))

    def forward(self, x: torch.Tensor, y: torch.Tensor | None = None) -> torch.Tensor:
        h = self.trunk(x).flatten(1)
        if self.context_labels:
            if y is None:
                raise ValueError("this modulator conditions on labels: pass the context labels")
            h = torch.cat([h, F.one_hot(y, self.num_classes).to(h.dtype)], dim=1)
        return self.head(self.per_sample(h).mean(0))


class ModulatedCNN(nn.Module):
    """A :class:`BaseCNN` whose conv blocks, flatten and hidden dense blocks are modulated.

    ``forward(x, context_x=None, context_y=None)``: the context defaults to the batch being
    classified (the code's behaviour, docs/papers/cafeme.md).
    """

    def __init__(self, base: BaseCNN, fm_trunk: nn.Sequential, per_sample: list[int],
                 num_classes: int, modulation: str = "sigmoid", context_labels: bool = False):
        super().__init__()
        if modulation not in ("sigmoid", "film"):
            raise ValueError(f"modulation must be 'sigmoid' or 'film', got {modulation!r}")
        self.base = base
        self.modulation = modulation
        conv_sizes = [block[0].out_channels for block in base.features]
        dense_sizes = [block[0].out_features for block in base.fc[:-1]]
        self.sizes = [*conv_sizes, base.fc[0][0].in_features, *dense_sizes]
        self.fm = FederatedModulator(fm_trunk, per_sample, self.sizes, num_classes, context_labels,
                                     2 if modulation == "film" else 1)

    def _modulate(self, h: torch.Tensor, zeta: torch.Tensor) -> torch.Tensor:
        shape = (1, -1) + (1,) * (h.dim() - 2)
        if self.modulation == "sigmoid":
            return h * torch.sigmoid(zeta).view(shape)
        scale, shift = zeta.chunk(2)
        return h * scale.view(shape) + shift.view(shape)

    def forward(self, x: torch.Tensor, context_x: torch.Tensor | None = None,
                context_y: torch.Tensor | None = None) -> torch.Tensor:
        zeta = self.fm(x if context_x is None else context_x, context_y)
        per_unit = 2 if self.modulation == "film" else 1
        zetas = iter(torch.split(zeta, [per_unit * s for s in self.sizes]))
        h = x
        for block in self.base.features:
            h = self._modulate(block(h), next(zetas))
        h = self._modulate(h.flatten(1), next(zetas))
        for block in self.base.fc[:-1]:
            h = self._modulate(block(h), next(zetas))
        return self.base.fc[-1](h)


@MODELS.register("cafeme_a")
def cafeme_a(input_shape: tuple[int, ...], num_classes: int, modulation: str = "sigmoid",
             context_labels: bool = False, fm_batchnorm: bool = True) -> nn.Module:
    """Model A + FM for 1x28x28 (RMNIST, FEMNIST): FM trunk 2 conv blocks, per-sample
    1024->100->200, D = 1632. 1,126,462 parameters for 10 classes (sigmoid, images only);
    ``fm_batchnorm=False``: the results-era FM trunk without BatchNorm (module docstring)."""
    _check_shape("cafeme_a", input_shape, (1, 28, 28))
    trunk = nn.Sequential(conv_block(1, 32, 5, 0, fm_batchnorm), conv_block(32, 64, 5, 0, fm_batchnorm))
    return ModulatedCNN(cafeme_cnn_a(input_shape, num_classes), trunk, [1024, 100, 200],
                        num_classes, modulation, context_labels)


@MODELS.register("cafeme_b")
def cafeme_b(input_shape: tuple[int, ...], num_classes: int, modulation: str = "sigmoid",
             context_labels: bool = False) -> nn.Module:
    """Model B + FM for 3x32x32 (CIFAR-10, Meta-Dataset): FM trunk 3 conv blocks, per-sample
    1024->100->100->200, D = 2368. 1,731,858 parameters for 10 classes (sigmoid, images only)."""
    _check_shape("cafeme_b", input_shape, (3, 32, 32))
    trunk = nn.Sequential(conv_block(3, 64, 3, "same"), conv_block(64, 64, 3, "same"),
                          conv_block(64, 64, 3, "same"))
    return ModulatedCNN(cafeme_cnn_b(input_shape, num_classes), trunk, [1024, 100, 100, 200],
                        num_classes, modulation, context_labels)
