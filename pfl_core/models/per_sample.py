"""Whether a model's output for one sample depends on that sample alone.

A model built only from layers that act on each sample independently (no BatchNorm, which
normalises with the statistics of the batch, and no Dropout, which draws random numbers per call)
gives every sample the same logits whether it is passed alone, in its batch, or with other
batches: a loss pass over many batches can then be one forward (a harness speed-up, e.g.
:func:`pfl_core.algorithms.ifca.cluster_losses`). Unknown layer types count as dependent.
"""
from __future__ import annotations

from torch import nn

#: layer types whose output row i depends on input row i alone (harness choice: the layers the
#: flat-feature and small conv models of the suites use)
PER_SAMPLE_LAYERS = (nn.Sequential, nn.Linear, nn.Flatten, nn.ReLU, nn.Identity, nn.Conv2d, nn.MaxPool2d,
                     nn.AvgPool2d, nn.Tanh, nn.Sigmoid)


def per_sample(model: nn.Module) -> bool:
    """True when every module of ``model`` (itself included) is one of :data:`PER_SAMPLE_LAYERS`
    (exact types: a subclass may change what ``forward`` does)."""
    return all(type(m) in PER_SAMPLE_LAYERS for m in model.modules())
