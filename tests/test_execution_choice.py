"""``--execution auto`` decides from a counted cost of one client step, never from timings."""
from __future__ import annotations

import pytest

from pfl_core.engine.choice import CPU_BATCHED_MAX_MFLOP, choose_execution, step_flops
from pfl_core.models import build_model


def test_a_small_mlr_is_batched_and_a_large_conv_model_sequential_on_a_cpu():
    mlr = step_flops(build_model("mlr", (1, 28, 28), 10), (1, 28, 28), 20)  # CGPFL MNIST-MLR, batch 20
    conv = step_flops(build_model("cafeme_cnn_b", (3, 32, 32), 10), (3, 32, 32), 50)  # CAFeMe CIFAR-10
    assert mlr == pytest.approx(2 * 2 * 20 * 784 * 10, rel=0.05)  # forward + weight-gradient matmul
    assert choose_execution("cpu", mlr, 40)[0] == "batched"
    assert choose_execution("cpu", conv, 5)[0] == "sequential"
    assert choose_execution("cuda", conv, 5)[0] == "batched"


def test_the_threshold_and_the_edge_cases():
    limit = CPU_BATCHED_MAX_MFLOP * 1e6
    assert choose_execution("cpu", limit, 2)[0] == "batched"
    assert choose_execution("cpu", limit * 1.01, 2)[0] == "sequential"
    assert choose_execution("cpu", limit * 1.01, 2, threshold_mflop=CPU_BATCHED_MAX_MFLOP * 2)[0] == "batched"
    assert choose_execution("cpu", 1.0, 1)[0] == "sequential"  # nothing to stack
    assert choose_execution("cpu", None, 8)[0] == "sequential"  # unknown cost: the device decides
    assert choose_execution("cuda", None, 8)[0] == "batched"


def test_the_environment_switch(monkeypatch):
    monkeypatch.setenv("PFLBENCH_AUTO_BATCHED_MFLOP", "0.1")
    assert choose_execution("cpu", 1e6, 40)[0] == "sequential"
