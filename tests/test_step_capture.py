"""Step capture's bookkeeping on the CPU (:mod:`pfl_core.engine.capture`): a stand-in backend with a
CUDA graph's semantics - a recorded step reads only its static input buffers and writes its static
output buffers in place on every replay - so that a call that forgot to copy its inputs in, or
returned the graph's buffers instead of copies, or reused a graph across shapes, gives different
numbers from the eager batched path. The real backend is checked on a GPU
(``tests/test_gpu_paths.py``, ``pflbench gpu-check``)."""
from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch
from torch.utils._pytree import tree_leaves, tree_map

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from pfl_core.algorithms import METHODS  # noqa: E402
from pfl_core.engine.capture import CapturedSteps  # noqa: E402
from pfl_core.engine.executor import Executor  # noqa: E402
from pfl_core.experiment import execution_info, make_executor  # noqa: E402
from tests.test_engine_equivalence import CASES, assert_same_run, run_path  # noqa: E402


class HostGraphs:
    """A graph stand-in: ``record`` runs the step once on the static inputs; ``replay`` runs it
    again on them and copies the result into the recorded outputs, in place."""

    def __init__(self):
        self.replays = 0

    def warm_up(self, fn, leaves):
        return fn(*leaves)

    def record(self, fn, leaves):
        # dense buffers, as a graph's outputs live in its own memory (a broadcast result cannot be written)
        out = tree_map(lambda x: x.clone(memory_format=torch.contiguous_format) if isinstance(x, torch.Tensor) else x,
                       fn(*leaves))

        def replay():
            self.replays += 1
            for buffer, new in zip(tree_leaves(out), tree_leaves(fn(*leaves))):
                if isinstance(buffer, torch.Tensor):
                    buffer.copy_(new)
        return replay, out


def captured_executor(backend, **kw) -> Executor:
    executor = Executor("batched", capture="cuda_graphs")
    executor.captured = CapturedSteps(backend, **kw)
    return executor


#: cases whose stacks keep their shapes across rounds, so that later rounds replay (L2SGD's coin
#: flips change its step counts every round; pFedGP's tree_pg runs sequentially)
REPLAYING = ["fedavg-steps", "fedavg-bn", "ditto", "cafeme-so", "metavers-novel", "perfedavg-hf-exact", "pfedme", "ifca"]


@pytest.mark.parametrize("name", REPLAYING)
def test_captured_steps_give_the_eager_batched_numbers(name):
    backend = HostGraphs()
    executor = captured_executor(backend)
    captured = run_path(CASES[name], "batched", rounds=4, executor=executor)
    assert_same_run(run_path(CASES[name], "batched", rounds=4), captured)
    assert backend.replays >= 2 and executor.captured.recorded >= 1  # later rounds replayed recorded graphs
    assert executor.captured.replayed == backend.replays
    info = execution_info(executor, METHODS.get(CASES[name][0]))  # the run's tags
    assert info["step_capture"] == (f"cuda_graphs: {executor.captured.recorded} graph(s) recorded, "
                                    f"{backend.replays} replay(s)")


def test_a_graph_is_recorded_once_per_stack_shape_and_the_oldest_is_dropped_past_the_limit():
    steps = CapturedSteps(HostGraphs(), max_graphs=2)
    owner = object()
    double = lambda x: (2 * x,)  # noqa: E731
    for n in (3, 3, 4, 3, 5, 3, 4):
        x = torch.arange(float(n))
        (y,) = steps(owner, double, x)
        torch.testing.assert_close(y, 2 * x)
    # shapes 3, 4 recorded; 3 replayed; 5 recorded (4 dropped); 3 replayed; 4 recorded again
    assert steps.recorded == 4 and len(steps.graphs) == 2


def test_a_replayed_result_is_a_copy_that_the_next_replay_leaves_alone():
    steps = CapturedSteps(HostGraphs())
    owner, double = object(), (lambda x: (2 * x,))
    steps(owner, double, torch.ones(2))
    (first,) = steps(owner, double, torch.full((2,), 3.0))
    (second,) = steps(owner, double, torch.full((2,), 5.0))
    assert first.tolist() == [6.0, 6.0] and second.tolist() == [10.0, 10.0]


def test_capture_is_asked_for_by_name_and_refused_off_cuda():
    with pytest.raises(ValueError, match="capture must be one of"):
        Executor("batched", capture="graphs")
    with pytest.raises(ValueError, match="needs a CUDA device"):
        make_executor("batched", torch.device("cpu"), capture="cuda_graphs")
    assert make_executor("batched", torch.device("cpu")).captured is None


class RefusingGraphs(HostGraphs):
    """A backend that refuses to record, as CUDA refuses an operation while capturing."""

    def record(self, fn, leaves):
        raise RuntimeError("CUDA error: operation not permitted when stream is capturing\nmore text")


def test_a_step_that_cannot_be_recorded_falls_back_to_the_eager_step_and_says_so():
    name = "fedavg-steps"
    backend = RefusingGraphs()
    executor = captured_executor(backend)
    captured = run_path(CASES[name], "batched", rounds=3, executor=executor)
    assert_same_run(run_path(CASES[name], "batched", rounds=3), captured)  # the warm-up result is used
    assert executor.captured.recorded == 0 and executor.captured.replayed == 0 and not executor.captured.graphs
    program = METHODS.get(CASES[name][0]).__name__
    info = execution_info(executor, METHODS.get(CASES[name][0]))
    assert info["step_capture"] == ("cuda_graphs: 0 graph(s) recorded, 0 replay(s); "
                                    f"{program} fell back to the eager batched step "
                                    "(CUDA error: operation not permitted when stream is capturing)")
