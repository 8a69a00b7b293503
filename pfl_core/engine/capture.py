"""Step capture: the batched client step (one vmapped ``local_update`` over a stack of clients)
recorded once per stack shape as a CUDA graph and replayed (``--capture-step cuda_graphs``;
docs/speed.md "Step capture").

A small model's step is thousands of tiny kernels, each paying Python, dispatch and launch costs
larger than its arithmetic; a replayed graph launches them all at once. The graph runs the same
kernels on the same inputs, so capture changes no number (``tests/test_gpu_paths.py`` checks every
engine case captured against uncaptured on a GPU).

What capture needs is what the client-program contract already asks of ``local_update``: no host
syncs (``tests/test_gpu_guard.py`` holds every method to that), no random numbers (they are drawn
in ``draw``), no Python branching on tensor values, and nothing read but its arguments and tensors
fixed when the method was built (a graph keeps the addresses it was recorded with).

How: one graph per key (the program, the pytree structure, every leaf's shape, dtype and device,
the stacking dims). The first call of a key runs the step eagerly on a side stream (its result is
returned, so nothing is computed twice) and then records the graph on static copies of its inputs.
Each later call copies its inputs into those buffers, replays, and returns copies of the graph's
outputs (the next replay overwrites them). At most ``max_graphs`` graphs are kept (least recently
used dropped first; a harness choice, each graph holds its own memory pool).

A program whose step cannot be recorded (an operation CUDA refuses while capturing, such as the host
check of ``torch.linalg.cholesky`` in pFedGP's GP solve, seen on an H200) falls back to the eager
batched step for the rest of the run: its warm-up result is used (nothing computed twice or lost),
the refusal is kept in :attr:`CapturedSteps.refused` and the run's ``step_capture`` tag says so.
"""
from __future__ import annotations

from collections import OrderedDict
from typing import Any, Callable

import torch
from torch.utils._pytree import tree_flatten, tree_unflatten

#: ``--capture-step`` values
CAPTURES = ("off", "cuda_graphs")

#: graphs kept per executor (harness choice: a round rarely has more bucket shapes than this)
MAX_GRAPHS = 16


class CudaGraphs:
    """The CUDA backend: eager warm-up on a side stream, then ``torch.cuda.graph`` recording."""

    def warm_up(self, fn: Callable, leaves: list) -> Any:
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            out = fn(*leaves)
        torch.cuda.current_stream().wait_stream(side)
        return out

    def record(self, fn: Callable, leaves: list) -> tuple[Callable[[], None], Any]:
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out = fn(*leaves)
        return graph.replay, out


class CapturedSteps:
    """Graphs of a step function, keyed by what fixes their kernels and addresses."""

    def __init__(self, backend=None, max_graphs: int = MAX_GRAPHS):
        self.backend = backend or CudaGraphs()
        self.max_graphs = max_graphs
        self.graphs: OrderedDict[tuple, tuple[Any, list, Callable[[], None], list, Any]] = OrderedDict()
        """key -> (owner, kept so that its id is not reused; static inputs; replay; static output
        leaves and their tree structure)"""
        self.recorded = 0
        """How many graphs were recorded (a key seen again after eviction is recorded again)."""
        self.replayed = 0
        """How many calls replayed a recorded graph (the calls capture paid for)."""
        self.refused: dict[str, str] = {}
        """Program class name -> why its step could not be recorded (it runs eagerly from then on)."""

    def summary(self) -> str:
        """The run's ``step_capture`` tag: graphs recorded, replays, and each eager fallback."""
        text = f"cuda_graphs: {self.recorded} graph(s) recorded, {self.replayed} replay(s)"
        for name, why in self.refused.items():
            text += f"; {name} fell back to the eager batched step ({why})"
        return text

    def __call__(self, owner: Any, step: Callable, *args, variant: tuple = ()) -> Any:
        """``step(*args)``, through the graph of ``owner`` (the program) for these arguments' shapes;
        ``variant``: whatever else fixes the step's kernels (the stacking dims of a vmapped step)."""
        if type(owner).__name__ in self.refused:
            return step(*args)
        leaves, spec = tree_flatten(args)
        key = (id(owner), variant, spec, tuple(_leaf_key(leaf) for leaf in leaves))
        entry = self.graphs.get(key)
        if entry is None:
            flat_step = lambda *xs: step(*tree_unflatten(list(xs), spec))  # noqa: E731
            out = self.backend.warm_up(flat_step, leaves)
            static = [leaf.clone() if isinstance(leaf, torch.Tensor) else leaf for leaf in leaves]
            try:
                replay, static_out = self.backend.record(flat_step, static)
            except RuntimeError as err:  # torch.AcceleratorError is one
                self.refused[type(owner).__name__] = str(err).strip().splitlines()[0][:200]
                return out
            self.graphs[key] = (owner, static, replay, *tree_flatten(static_out))
            self.recorded += 1
            if len(self.graphs) > self.max_graphs:
                self.graphs.popitem(last=False)
            return out
        self.graphs.move_to_end(key)
        _, static, replay, out_leaves, out_spec = entry
        for buffer, leaf in zip(static, leaves):
            if isinstance(leaf, torch.Tensor):
                buffer.copy_(leaf)
        replay()
        self.replayed += 1
        return tree_unflatten([x.clone() if isinstance(x, torch.Tensor) else x for x in out_leaves], out_spec)


def _leaf_key(leaf: Any) -> tuple:
    if isinstance(leaf, torch.Tensor):
        return ("tensor", tuple(leaf.shape), leaf.dtype, str(leaf.device), leaf.requires_grad)
    return ("value", leaf)
