"""The training stack limit (pfl_core/engine/memory.py): a bucket is cut into stacks of at most N
clients with the same numbers, N follows a memory budget and the model's counted step size, and an
out-of-memory error of a stack names the setting that fixes it. All on the CPU."""
from __future__ import annotations

import pytest
import torch

import pfl_core.engine.executor as executor_module
from pfl_core.engine.memory import PARAMETER_COPIES, client_step_bytes, stack_limit
from pfl_core.models import build_model
from tests.test_engine_equivalence import CASES, assert_same_run, run_path


REAL_VMAP = executor_module.vmap


def _stacks(monkeypatch, limit, case="fedavg-steps", per_round=5):
    """A two-round run with ``limit`` and the number of clients of every vmapped call."""
    sizes = []
    real = REAL_VMAP

    def counting(fn, in_dims):
        def call(carry, batches, masks):
            sizes.append(next(t for t in torch.utils._pytree.tree_leaves(batches)).shape[0])
            return real(fn, in_dims=in_dims)(carry, batches, masks)
        return call

    monkeypatch.setattr(executor_module, "vmap", counting)
    return run_path(CASES[case], "batched", rounds=2, per_round=per_round, stack_limit=limit), sizes


@pytest.mark.parametrize("case", ["fedavg-steps", "pfedme"])
def test_a_limited_stack_gives_the_numbers_of_the_whole_bucket(monkeypatch, case):
    whole, whole_sizes = _stacks(monkeypatch, 0, case)
    cut, cut_sizes = _stacks(monkeypatch, 2, case)
    assert whole_sizes == [5, 5] and cut_sizes == [2, 2, 2, 2]  # per round: 2 + 2 stacked, the fifth alone
    assert_same_run(whole, cut)


def test_client_step_bytes_counts_activations_and_parameter_copies():
    mlr, dnn = build_model("mlr", (784,), 10), build_model("dnn", (784,), 10)
    weights = sum(p.numel() * 4 for p in mlr.parameters())
    small, large = client_step_bytes(mlr, (784,), 20), client_step_bytes(mlr, (784,), 200)
    assert small > PARAMETER_COPIES * weights and large - small >= 180 * 784 * 4  # the inputs saved for the backward
    assert client_step_bytes(dnn, (784,), 20) > small


def test_the_limit_follows_the_budget_and_the_user_setting(monkeypatch):
    model = build_model("dnn", (784,), 10)
    per_client = client_step_bytes(model, (784,), 20)
    monkeypatch.delenv("PFL_STACK_LIMIT", raising=False)
    monkeypatch.delenv("PFL_STACK_MEMORY_MB", raising=False)
    assert stack_limit(model, (784,), 20, torch.device("cpu"))[0] == 0  # a CPU without a budget
    monkeypatch.setenv("PFL_STACK_MEMORY_MB", str(per_client * 7.5 / 2 ** 20))
    limit, why = stack_limit(model, (784,), 20, torch.device("cpu"))
    assert limit == 7 and "MiB per stacked client" in why
    monkeypatch.setenv("PFL_STACK_MEMORY_MB", "0.001")
    assert stack_limit(model, (784,), 20, torch.device("cpu"))[0] == 1  # never below one client
    monkeypatch.setenv("PFL_STACK_LIMIT", "3")
    assert stack_limit(model, (784,), 20, torch.device("cpu")) == (3, "set: PFL_STACK_LIMIT=3")


def test_an_out_of_memory_stack_names_the_setting(monkeypatch):
    real = executor_module.vmap

    def oom(fn, **kw):
        def call(*args):
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")
        return call

    monkeypatch.setattr(executor_module, "vmap", oom)
    with pytest.raises(torch.OutOfMemoryError, match=r"--stack-limit 1 \(PFL_STACK_LIMIT\)"):
        run_path(CASES["fedavg-steps"], "batched", rounds=1, per_round=3)
    assert real is not None
