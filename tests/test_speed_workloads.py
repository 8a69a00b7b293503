"""The speed benchmark's workloads (issue 25): the small-model cells are there, and ``auto``
stacks the small models and runs the large conv models one client at a time on a CPU."""
from __future__ import annotations

import torch

from benchmarks.timing.speed import WORKLOADS, auto_choice


def test_the_small_model_workloads_and_their_auto_paths():
    by_name = {w.name: w for w in WORKLOADS}
    cpu = torch.device("cpu")
    for name in ("cgpfl-mlr", "cgpfl-mnist", "pfedme-synthetic", "cgpfl-cifar10"):
        assert "<= 100 on cpu" in auto_choice(by_name[name], cpu, 1), name
    for name in ("metavers-lenet", "fedavg-rmnist", "fedavg-cifar10"):
        assert "> 100 on cpu" in auto_choice(by_name[name], cpu, 1), name
