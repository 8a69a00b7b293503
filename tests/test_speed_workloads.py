"""The speed benchmark's workloads (issue 25): the small-model cells are there, and ``auto``
stacks the small models and runs the large conv models one client at a time on a CPU."""
from __future__ import annotations

import pytest
import torch

from benchmarks.timing.speed import WORKLOADS, auto_choice


def test_the_small_model_workloads_and_their_auto_paths():
    by_name = {w.name: w for w in WORKLOADS}
    cpu = torch.device("cpu")
    for name in ("cgpfl-mlr", "cgpfl-mnist", "pfedme-synthetic", "cgpfl-cifar10"):
        assert "<= 100 on cpu" in auto_choice(by_name[name], cpu, 1), name
    for name in ("metavers-lenet", "fedavg-rmnist", "fedavg-cifar10"):
        assert "> 100 on cpu" in auto_choice(by_name[name], cpu, 1), name


def test_the_ifca_choice_workload_times_three_paths_with_their_flops():
    """The cluster-choice workload on a tiny copy of its shapes: the loop, the chunked pass and the
    pass from kept logits (which forwards only the partial batch: 45 rows = 2 x 20 + 5)."""
    from dataclasses import replace

    from benchmarks.timing.speed import time_choice

    w = replace({w.name: w for w in WORKLOADS}["ifca-choice-cifar10"], clients=2, per_round=2, train_size=45,
                test_size=2)
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        paths = {label: (seconds, gflop) for label, seconds, gflop in time_choice(w, torch.device("cpu"), 1)}
    finally:
        torch.set_num_threads(before)
    assert list(paths) == ["loop", "chunked", "kept"]
    loop, chunked, kept = (paths[k][1] for k in ("loop", "chunked", "kept"))
    assert loop < chunked <= loop * 65 / 45 * 1.001  # padded to 3 whole batches, the partial one again
    assert kept == pytest.approx(loop * 5 / 45)
