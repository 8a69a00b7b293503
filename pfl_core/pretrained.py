"""Stage 1 of the two-stage pipeline (FedL2P, issue 14): the pretrained model a run starts from.

A run whose ``model.pretrained`` describes a stage-1 run (:meth:`pfl_core.config.RunConfig.stage1`)
asks a *provider* for that run's :data:`PretrainedState`: its final global parameters and the
BatchNorm running statistics of its model (FedL2P contract, "Pretrained state"). The state is
loaded into the stage-2 model before the method is built, so every method starts from it (its
initial global parameters), and the method gets it as ``algorithm.pretrained`` (KLD-BN methods turn
the running statistics into mu_pt / sigma2_pt with ``pfl_core.models.kld_bn.load_pretrained``).

Providers:

* :class:`pfl_core.experiment.InProcessPretraining` (the default of
  :func:`pfl_core.experiment.run_experiment`): runs stage 1 here, once per distinct stage-1
  configuration for the provider's lifetime.
* the harness's (:mod:`benchmarks.running.stages`): the state of the stage-1 MLflow run with the same
  config hash, trained once per sweep before any stage-2 run starts.
* :func:`untrained`: the stage-2 model's own initialisation stands in (timing projections).

``model.pretrained: {source: imagenet}`` needs no provider: the model is built with its ImageNet
weights (``model.params.weights: imagenet``) and its own state is the pretrained state.
"""
from __future__ import annotations

from typing import Callable, Mapping

import torch
from torch import nn

from pfl_core.config import RunConfig

PretrainedState = dict
"""``{"params": {name: tensor}, "buffers": {"<bn>.running_mean": ..., "<bn>.running_var": ...}}``
(torch-saveable; the FedL2P contract's name)."""
Provider = Callable[[RunConfig], "PretrainedState | None"]
"""Maps a stage-1 :class:`RunConfig` to its state (None: keep the stage-2 model's own initialisation)."""

#: the module buffers a pretrained state carries: BatchNorm running statistics
RUNNING_STATS = ("running_mean", "running_var")


def _is_running_stat(name: str) -> bool:
    return name.rsplit(".", 1)[-1] in RUNNING_STATS


def state_of(model: nn.Module, params: Mapping[str, torch.Tensor] | None = None,
             buffers: Mapping[str, torch.Tensor] | None = None) -> PretrainedState:
    """The pretrained state of ``model``: ``params`` (default: the module's) and the running
    statistics of ``buffers`` (a server's functional BN state, default: the module's), detached."""
    params = dict(model.named_parameters()) if params is None else params
    buffers = dict(model.named_buffers()) if buffers is None else buffers
    return {"params": {k: v.detach().clone() for k, v in params.items()},
            "buffers": {k: v.detach().clone() for k, v in buffers.items() if _is_running_stat(k)}}


def final_state(model: nn.Module, server: Mapping) -> PretrainedState:
    """A finished stage-1 run's state: the server's global ``params`` and the BN running statistics
    of its ``buffers`` (the functional BN state of BN-aware methods), else the module's own."""
    return state_of(model, server["params"], server.get("buffers"))


def to_device(state: PretrainedState, device: torch.device | str) -> PretrainedState:
    return {part: {k: v.to(device) for k, v in state[part].items()} for part in ("params", "buffers")}


def load_into(model: nn.Module, state: PretrainedState) -> None:
    """Copy ``state`` into ``model`` in place: every parameter (same names and shapes, else a clear
    error: stage 2 must use stage 1's architecture) and the running statistics it carries."""
    params, buffers = dict(model.named_parameters()), dict(model.named_buffers())
    if set(state["params"]) != set(params):
        missing, extra = sorted(set(params) - set(state["params"])), sorted(set(state["params"]) - set(params))
        raise ValueError(f"model.pretrained: the stage-1 model's parameters differ from this run's model "
                         f"(missing {missing[:5]}, unexpected {extra[:5]}); give model.pretrained.model the "
                         f"same name and params as model")
    unknown = sorted(set(state["buffers"]) - set(buffers))
    if unknown:
        raise ValueError(f"model.pretrained: running statistics {unknown[:5]} have no buffer in this run's model")
    with torch.no_grad():
        for part, own in (("params", params), ("buffers", buffers)):
            for name, value in state[part].items():
                if own[name].shape != value.shape:
                    raise ValueError(f"model.pretrained: {name} has shape {tuple(value.shape)} in the stage-1 "
                                     f"model, {tuple(own[name].shape)} here; use the same model params")
                own[name].copy_(value)


def untrained(stage1: RunConfig) -> None:
    """A provider that trains nothing: the stage-2 model's own initialisation stands in (for a
    timing projection, which needs the cost of stage 2, not its accuracy)."""
    return None


def resolve(cfg: RunConfig, model: nn.Module, provider: Provider) -> tuple[PretrainedState | None, dict]:
    """Load ``cfg``'s pretrained state into ``model`` (built with its own initialisation) and return
    it on the model's device (None without ``model.pretrained``) with its provenance (the
    provider's ``provenance(stage1)`` when it has one, for the run's record)."""
    source = cfg.pretrained_source()
    if source is not None:  # the model was built with these weights
        return state_of(model), {"source": source}
    stage1 = cfg.stage1()
    if stage1 is None:
        return None, {}
    state = provider(stage1)
    if state is not None:
        device = next(model.parameters()).device
        load_into(model, to_device(state, device))
    describe = getattr(provider, "provenance", None)
    return state_of(model), (describe(stage1) if describe is not None else {"source": "stage1"})
