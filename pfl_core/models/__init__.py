"""Model registry: ``build_model(name, input_shape, num_classes, **params)``.

Every model is a plain ``nn.Module`` trained through ``torch.func.functional_call`` on a dict of
tensors. Its BatchNorm layers keep no running statistics (``track_running_stats=False``), except
where the reference code evaluates with them: FedL2P's ResNets and MetaVers' ``conv4``/``conv4_frl``
use :class:`~pfl_core.models.kld_bn.KLDBatchNorm2d`, whose statistics are functional state carried
beside the parameters (``server["buffers"]``), never updated in place.
"""
from __future__ import annotations

import torch.nn as nn

from pfl_core.registry import Registry, import_package_modules

MODELS: Registry = Registry("model")


def build_model(name: str, input_shape: tuple[int, ...], num_classes: int, **params) -> nn.Module:
    """Instantiate the registered model ``name`` for inputs of ``input_shape`` (without batch)."""
    return MODELS.get(name)(tuple(input_shape), num_classes, **params)


def model_keeps_bn_state(name: str) -> bool:
    """Whether registered model ``name`` keeps BatchNorm running statistics (KLD-BN layers; its
    builder is marked with :func:`pfl_core.models.kld_bn.keeps_bn_state`), known without building it."""
    return bool(getattr(MODELS.get(name), "keeps_bn_state", False))


def count_parameters(model: nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())


import_package_modules(__name__, __path__)  # every module of this package registers its models on import
