"""How many clients the batched path stacks into one vmapped call (the training stack limit).

A stack of clients holds every client's activations of one step and several copies of its
parameters (parameters, gradients, optimiser state, the update) at once, so a round of 100 clients
of a ResNet-18 in one call needs tens of GiB. The limit is

* set by the user: ``pflbench run --stack-limit N`` (environment ``PFL_STACK_LIMIT``; 0 = no limit);
* otherwise, on a GPU, chosen from the free device memory divided among the runs that share it
  (``--jobs``, environment ``PFL_JOBS_PER_DEVICE``) and the model's per-client cost
  (:func:`client_step_bytes`, counted on the ``meta`` device: nothing is computed);
* on a CPU, no limit unless a budget is given (``PFL_STACK_MEMORY_MB``, which also overrides the
  free device memory on a GPU).

Splitting a bucket into stacks changes no number: each client's computation is its own.
"""
from __future__ import annotations

import os

import torch
import torch.nn.functional as F
from torch import nn

from pfl_core.engine.choice import meta_step_inputs

#: Copies of the parameters a stacked client holds besides its activations: the parameters, their
#: gradients, an optimiser moment and the update being formed (a harness estimate).
PARAMETER_COPIES = 4
#: Share of the free device memory the stacks may use (the rest: allocator slack, evaluation).
FREE_MEMORY_SHARE = 0.8


def client_step_bytes(model: nn.Module, input_shape: tuple[int, ...], batch_size: int) -> int:
    """Bytes one stacked client needs for one training step: the tensors autograd saves for the
    backward of a forward at ``batch_size`` (counted on a ``meta`` copy of the model) plus
    :data:`PARAMETER_COPIES` copies of its parameters."""
    template, params, x, y = meta_step_inputs(model, input_shape, batch_size)
    saved = [0]

    def pack(t: torch.Tensor) -> torch.Tensor:
        saved[0] += t.numel() * t.element_size()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        F.cross_entropy(torch.func.functional_call(template, params, (x,)), y)
    weights = sum(p.numel() * p.element_size() for p in params.values())
    return saved[0] + PARAMETER_COPIES * weights


def memory_budget(device: torch.device) -> int | None:
    """Bytes the stacks of this process may use: ``PFL_STACK_MEMORY_MB``, else on a GPU
    :data:`FREE_MEMORY_SHARE` of its free memory over ``PFL_JOBS_PER_DEVICE`` processes; None on a
    CPU without a budget."""
    if os.environ.get("PFL_STACK_MEMORY_MB"):
        return int(float(os.environ["PFL_STACK_MEMORY_MB"]) * 2 ** 20)
    if device.type != "cuda":
        return None
    free, _ = torch.cuda.mem_get_info(device)
    jobs = max(1, int(os.environ.get("PFL_JOBS_PER_DEVICE", "1")))
    return int(free * FREE_MEMORY_SHARE / jobs)


def stack_limit(model: nn.Module, input_shape: tuple[int, ...], batch_size: int,
                device: torch.device) -> tuple[int, str]:
    """(clients per vmapped call, 0 = no limit; why) for a run's model and batch shape."""
    if os.environ.get("PFL_STACK_LIMIT"):
        limit = int(os.environ["PFL_STACK_LIMIT"])
        return limit, f"set: PFL_STACK_LIMIT={limit}" if limit else "set: no limit"
    budget = memory_budget(device)
    if budget is None:
        return 0, "no limit (no memory budget on this device)"
    per_client = client_step_bytes(model, input_shape, batch_size)
    limit = max(1, budget // max(per_client, 1))
    return limit, (f"{limit} = {budget / 2 ** 20:.0f} MiB budget // {per_client / 2 ** 20:.1f} MiB per stacked "
                   f"client (activations of one step + {PARAMETER_COPIES} parameter copies)")


def out_of_memory_hint(stacked: int, limit: int) -> str:
    """The sentence an out-of-memory error of a stack of ``stacked`` clients ends with."""
    smaller = max(1, stacked // 2)
    return (f"{stacked} clients were stacked in one call (stack limit {limit or 'none'}): rerun with "
            f"--stack-limit {smaller} (PFL_STACK_LIMIT), fewer --jobs on this device, or a smaller "
            f"PFL_STACK_MEMORY_MB")
