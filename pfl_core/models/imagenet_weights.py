"""torchvision's ImageNet ResNet-18 weights for ``resnet18_imagenet`` (fedl2p.md, "Pretraining the
global model", Office / DomainNet).

``weights: imagenet`` loads ``torchvision.models.ResNet18_Weights.IMAGENET1K_V1``
(``resnet18-f37072fd.pth``) through torchvision's weights API, cached where ``TORCH_HOME=<data
dir>/torch`` would put it: ``<data dir>/torch/hub/checkpoints/resnet18-f37072fd.pth`` (the data
directory of the run: ``--data-dir``, else ``$PFL_DATA_DIR``, else ``~/.cache/pfl-data``). The
file is downloaded (hash checked) only when missing and ``PFL_DOWNLOAD`` is not ``0``; otherwise a
clear error says where to put it. Every weight of the trunk is torchvision's, names and shapes
alike, and the BN running statistics become ImageNet's (the pretrained statistics mu_pt, sigma2_pt
of :func:`pfl_core.models.kld_bn.load_pretrained`). The 10-way head is not in the file: it keeps the
model's own initialisation, drawn once from the run's ``init`` seed and shared by every client
(fedl2p.md difference 13: the code re-draws each client's head; :func:`redraw_head` is that draw).
"""
from __future__ import annotations

import math
from pathlib import Path

import torch
import torch.nn as nn

from pfl_core.data.datasets import DatasetNotFoundError, _download_default, resolve_data_dir

HEAD = "fc"
"""The layer torchvision's ImageNet weights have 1000 outputs for; replaced by the task's head."""


def weights_enum():
    """``torchvision.models.ResNet18_Weights.IMAGENET1K_V1`` (torchvision imported on first use)."""
    from torchvision.models import ResNet18_Weights

    return ResNet18_Weights.IMAGENET1K_V1


def checkpoint_path(data_dir: str | Path | None = None) -> Path:
    """Where the weights file is cached: ``<data dir>/torch/hub/checkpoints/resnet18-f37072fd.pth``."""
    return resolve_data_dir(data_dir) / "torch" / "hub" / "checkpoints" / Path(weights_enum().url).name


def imagenet_state_dict(data_dir: str | Path | None = None, download: bool | None = None) -> dict[str, torch.Tensor]:
    """torchvision's ImageNet ResNet-18 state dict, read from (or downloaded into) the cache."""
    path = checkpoint_path(data_dir)
    download = _download_default() if download is None else download
    fix = (f"put torchvision's {path.name} ({weights_enum().url}) at {path}, or set PFL_DATA_DIR / --data-dir "
           "to the data directory that holds torch/hub/checkpoints/")
    if not path.is_file() and not download:
        raise DatasetNotFoundError(f"ImageNet ResNet-18 weights not found (PFL_DOWNLOAD=0): {fix}")
    try:
        return weights_enum().get_state_dict(model_dir=str(path.parent), progress=False, check_hash=True,
                                             map_location="cpu", weights_only=True)
    except Exception as err:  # offline, unreachable, a damaged file
        raise DatasetNotFoundError(f"ImageNet ResNet-18 weights could not be loaded from {path} "
                                   f"({' '.join(str(err).split())[:200]}): {fix}") from err


def load_imagenet(model: nn.Module, data_dir: str | Path | None = None) -> nn.Module:
    """``model`` (a width-64 ``resnet18_imagenet``) with torchvision's ImageNet weights and BN running
    statistics everywhere but the head; returns it."""
    state = imagenet_state_dict(data_dir)
    own = model.state_dict()
    trunk = {k: v for k, v in state.items() if not k.startswith(f"{HEAD}.")}
    wrong = [k for k, v in trunk.items() if k not in own or own[k].shape != v.shape]
    missing = [k for k in own if k not in trunk and not k.startswith(f"{HEAD}.")
               and not k.rsplit(".", 1)[-1] in ("init_running_mean", "init_running_var", "beta")]
    if wrong or missing:
        raise ValueError(f"ImageNet weights do not fit this resnet18_imagenet (width must be 64): unexpected "
                         f"or misshapen {wrong[:3]}, missing {missing[:3]}")
    model.load_state_dict(trunk, strict=False)
    return model


def redraw_head(params: dict[str, torch.Tensor], generator: torch.Generator) -> dict[str, torch.Tensor]:
    """``params`` with a fresh ``fc`` drawn as ``nn.Linear`` initialises it (weight Kaiming-uniform
    with a = sqrt(5), i.e. U(-1/sqrt(fan_in), 1/sqrt(fan_in)), and bias U(-1/sqrt(fan_in),
    1/sqrt(fan_in))) from ``generator``: the FedL2P code's per-client head (difference 13)."""
    weight = params[f"{HEAD}.weight"]
    bound = 1.0 / math.sqrt(weight.shape[1])

    def uniform(like: torch.Tensor) -> torch.Tensor:
        draw = torch.rand(like.shape, generator=generator, dtype=like.dtype, device=generator.device)
        return ((2 * draw - 1) * bound).to(like.device)

    return {**params, f"{HEAD}.weight": uniform(weight), f"{HEAD}.bias": uniform(params[f"{HEAD}.bias"])}
