"""Model registry: ``build_model(name, input_shape, num_classes, **params)``.

Every model is a plain ``nn.Module`` whose BatchNorm layers (if any) keep no running statistics
(``track_running_stats=False``), so a model is fully described by its parameters and can be
trained through ``torch.func.functional_call`` on a dict of tensors.
"""
from __future__ import annotations

import torch.nn as nn

from pfl_core.registry import Registry

MODELS: Registry = Registry("model")


def build_model(name: str, input_shape: tuple[int, ...], num_classes: int, **params) -> nn.Module:
    """Instantiate the registered model ``name`` for inputs of ``input_shape`` (without batch)."""
    return MODELS.get(name)(tuple(input_shape), num_classes, **params)


def count_parameters(model: nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())


from pfl_core.models import cnn, linear  # noqa: E402,F401  (registers the models)
