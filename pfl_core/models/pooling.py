"""Max pooling with a faster CPU forward and the same numbers (issue 10, CPU speed).

PyTorch's CPU ``max_pool2d`` forward on contiguous (NCHW) tensors is a scalar loop: on this
project's 2-core machine it takes about 1.6 ms for a [30, 32, 24, 24] activation (model A's first
block), 10x its channels-last kernel; it took 2.5 s of the 13.8 s of SGD steps of a ``make demo``
digits28 FedAvg run (cProfile). Both kernels scan each window in the same order with the same
rule (a later element wins only if it is greater, or NaN), so they pick the same element and
return the same values *and* the same flat indices. Where no gradient can flow (``torch.no_grad``, or
an input that does not require one: evaluation, IFCA's cluster choice) the values come from the same
channels-last kernel without the ``autograd.Function`` and the copy of its indices (about 0.25 ms less
per pooled CGPFL-CNN batch of 20 on one thread).

:func:`max_pool2d` on a CPU tensor therefore runs the forward on a channels-last copy and the
backward with PyTorch's own NCHW ``max_pool2d_with_indices_backward`` on those indices: the output,
the gradient and the second derivative are those of ``F.max_pool2d`` bit for bit
(``tests/test_pooling.py``). CUDA tensors, and any call inside a ``torch.func`` transform (the
batched path's ``vmap``/``grad``), take ``F.max_pool2d`` itself.

:func:`relu_then_pool` is ReLU followed by a 2x2 max-pool, computed pool first: max and ReLU
commute (ReLU is monotone), the gradient reaches the same element of each window (the first
maximum, which the textbook order also picks) and ReLU zeroes the same windows, so outputs and
gradients are those of the textbook order bit for bit, with ReLU on a quarter of the elements.
"""
from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.modules.utils import _pair


class _ChannelsLastForwardMaxPool(torch.autograd.Function):
    """y, indices = max_pool2d_with_indices(x) computed channels-last, returned contiguous."""

    @staticmethod
    def forward(x, kernel, stride, padding):
        y, indices = torch.ops.aten.max_pool2d_with_indices(
            x.contiguous(memory_format=torch.channels_last), kernel, stride, padding)
        return y.contiguous(), indices.contiguous()

    @staticmethod
    def setup_context(ctx, inputs, output):
        x, kernel, stride, padding = inputs
        ctx.save_for_backward(x, output[1])
        ctx.geometry = (kernel, stride, padding)
        ctx.mark_non_differentiable(output[1])

    @staticmethod
    def backward(ctx, grad_y, _grad_indices):
        x, indices = ctx.saved_tensors
        kernel, stride, padding = ctx.geometry
        grad_x = torch.ops.aten.max_pool2d_with_indices_backward(
            grad_y, x, kernel, stride, padding, [1, 1], False, indices)
        return grad_x, None, None, None


def max_pool2d(x: torch.Tensor, kernel_size, stride=None, padding=0) -> torch.Tensor:
    """``F.max_pool2d(x, kernel_size, stride, padding)`` (no dilation, floor mode), same numbers."""
    stride = kernel_size if stride is None or stride == [] else stride
    fast = (x.device.type == "cpu" and x.dim() == 4
            and torch._C._functorch.peek_interpreter_stack() is None)
    if not fast:
        return F.max_pool2d(x, kernel_size, stride, padding)
    kernel, stride, padding = (list(_pair(v)) for v in (kernel_size, stride, padding))
    if not (torch.is_grad_enabled() and x.requires_grad):  # no backward: the same kernel's values alone
        return torch.ops.aten.max_pool2d_with_indices(
            x.contiguous(memory_format=torch.channels_last), kernel, stride, padding)[0].contiguous()
    return _ChannelsLastForwardMaxPool.apply(x, kernel, stride, padding)[0]


class MaxPool2d(nn.MaxPool2d):
    """``nn.MaxPool2d`` through :func:`max_pool2d` (dilation 1, floor mode, no indices only)."""

    def __init__(self, kernel_size, stride=None, padding=0):
        super().__init__(kernel_size, stride, padding)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return max_pool2d(x, self.kernel_size, self.stride, self.padding)


def relu_then_pool() -> list[nn.Module]:
    """ReLU -> MaxPool(2, 2) as the layers MaxPool(2, 2) -> ReLU (the same numbers, module docstring)."""
    return [MaxPool2d(2, 2), nn.ReLU()]
