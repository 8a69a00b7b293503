"""``--execution auto``: the path chosen per run from a cost model of one client step.

The sequential path pays a fixed host cost per client step (Python, ``functional_call``,
autograd: about 0.5-1 ms on the development CPU, docs/speed.md); the batched path pays it once
per step of a whole stack of clients, but on a CPU it streams the stacked parameters through
memory at every elementwise update. So on a CPU, stacking pays when a client step's arithmetic is
small next to that fixed cost (CGPFL's MLR and DNN at batch 20: 0.6 and 8 MFLOP per step) and loses when
the arithmetic already keeps the cores busy (CAFeMe's conv model A at batch 30: 740 MFLOP per step).
On a GPU one eager step of any suite model is bound by Python and kernel launches: batched.

The cost of a step is counted, not timed (:func:`step_flops`: matmul and convolution FLOPs of one
forward and backward at the run's batch shape, ``torch.utils.flop_counter``), so the choice is
deterministic; it is recorded with the run (tag ``execution_choice``).
"""
from __future__ import annotations

import copy
import os

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.flop_counter import FlopCounterMode

#: On a CPU, batched when a client step costs at most this many MFLOP (harness choice, about the
#: geometric middle of the two workloads of docs/speed.md that bracket it: CGPFL DNN, 8 MFLOP per
#: step, batched 1.6x faster; CAFeMe model A, 740 MFLOP, batched 0.64x). Switch: the environment
#: variable PFLBENCH_AUTO_BATCHED_MFLOP.
CPU_BATCHED_MAX_MFLOP = 100.0


def cpu_threshold_mflop() -> float:
    """:data:`CPU_BATCHED_MAX_MFLOP`, or the environment's ``PFLBENCH_AUTO_BATCHED_MFLOP``."""
    return float(os.environ.get("PFLBENCH_AUTO_BATCHED_MFLOP", CPU_BATCHED_MAX_MFLOP))


def step_flops(model: nn.Module, input_shape: tuple[int, ...], batch_size: int) -> float:
    """Matmul and convolution FLOPs of one training step (forward, cross-entropy, backward) of
    ``model`` on a batch of ``batch_size`` inputs of ``input_shape``, counted on a copy of the
    model on the ``meta`` device (shapes only: nothing is computed, the model is not touched)."""
    template, params, x, y = meta_step_inputs(model, input_shape, batch_size)
    with FlopCounterMode(display=False) as counter:
        logits = torch.func.functional_call(template, params, (x,))
        torch.autograd.grad(F.cross_entropy(logits, y), list(params.values()), allow_unused=True)
    return float(counter.get_total_flops())


def meta_step_inputs(model: nn.Module, input_shape: tuple[int, ...], batch_size: int):
    """(a float copy of ``model`` on the ``meta`` device, its parameters requiring grad, a batch
    of inputs, labels): one training step's shapes, for counting without computing."""
    template = copy.deepcopy(model).float().to("meta")
    params = {k: v.detach().requires_grad_(True) for k, v in template.named_parameters()}
    x = torch.zeros(batch_size, *input_shape, device="meta")
    return template, params, x, torch.zeros(batch_size, dtype=torch.long, device="meta")


def choose_execution(device_type: str, flops_per_step: float | None, clients_per_call: int,
                     threshold_mflop: float | None = None) -> tuple[str, str]:
    """(``sequential`` or ``batched``, why) for a run on ``device_type`` whose client step costs
    ``flops_per_step`` (None: unknown) and whose executor calls hold ``clients_per_call`` clients (clients per
    round x runs in lockstep). ``threshold_mflop``: the CPU threshold (default
    :func:`cpu_threshold_mflop`)."""
    if clients_per_call < 2:
        return "sequential", f"auto: {clients_per_call} client per round, nothing to stack"
    if flops_per_step is None:  # a model the counter cannot run alone: the device decides
        return ("batched" if device_type == "cuda" else "sequential"), f"auto: step cost unknown, {device_type}"
    mflop = flops_per_step / 1e6
    if device_type == "cuda":
        return "batched", f"auto: {device_type}, stacked clients ({mflop:.3g} MFLOP per client step)"
    limit = cpu_threshold_mflop() if threshold_mflop is None else threshold_mflop
    if mflop <= limit:
        return "batched", f"auto: {mflop:.3g} MFLOP per client step <= {limit:g} on {device_type}: per-step overhead dominates"
    return "sequential", f"auto: {mflop:.3g} MFLOP per client step > {limit:g} on {device_type}: arithmetic dominates"
