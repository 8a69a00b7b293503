"""Whether a model's output for one sample depends on that sample alone.

A model built only from layers that act on each sample independently (no BatchNorm, which
normalises with the statistics of the batch, and no Dropout, which draws random numbers per call)
gives every sample the same logits whether it is passed alone, in its batch, or with other
batches: a loss pass over many batches can then be one forward (a harness speed-up, e.g.
:func:`pfl_core.algorithms.ifca.cluster_losses`). Unknown layer types count as dependent.
"""
from __future__ import annotations

from torch import nn

from pfl_core.models.pooling import MaxPool2d

#: layer types whose output row i depends on input row i alone (harness choice: the layers the
#: flat-feature and small conv models of the suites use)
PER_SAMPLE_LAYERS = (nn.Sequential, nn.Linear, nn.Flatten, nn.ReLU, nn.Identity, nn.Conv2d, nn.MaxPool2d,
                     nn.AvgPool2d, nn.Tanh, nn.Sigmoid)


def per_sample(model: nn.Module) -> bool:
    """True when every module of ``model`` (itself included) is one of :data:`PER_SAMPLE_LAYERS`
    (exact types: a subclass may change what ``forward`` does)."""
    return all(type(m) in PER_SAMPLE_LAYERS for m in model.modules())


#: :data:`PER_SAMPLE_LAYERS` and the project's max-pool (:mod:`pfl_core.models.pooling`: per sample
#: too, but listed apart so that :func:`per_sample` and the one-forward pass it selects stay as they were)
ROW_LAYERS = PER_SAMPLE_LAYERS + (MaxPool2d,)


def rows_independent(model: nn.Module) -> bool:
    """True when every module of ``model`` is one of :data:`ROW_LAYERS` (exact types): row i of the
    output is a function of input row i alone (CGPFL's CIFAR-10 CNN, which :func:`per_sample` leaves
    out). IFCA's loop-exact chunked pass relies on it (:mod:`pfl_core.algorithms._lib.cluster_pass`)."""
    return all(type(m) in ROW_LAYERS for m in model.modules())
