"""The conv blocks' CPU kernels against the textbook blocks, in one run.

    python -m benchmarks.timing.block_timing --threads 2

Models A and B (CAFeMe) and MetaVers' LeNet are built twice with the same initialisation: as the
project builds them (``relu_then_pool``: Conv -> BN -> MaxPool -> ReLU, the max-pool's forward on the
channels-last kernel, :mod:`pfl_core.models.pooling`; LeNet without BN) and with textbook blocks
(Conv -> BN -> ``nn.ReLU`` -> ``nn.MaxPool2d``; LeNet: Conv -> ReLU -> ``F.max_pool2d``). Their SGD steps on one random batch alternate, ``--reps`` times, so the machine's
drift hits both alike; the table gives the median milliseconds per step of each, the median of the
paired ratios, and whether both end with bit-identical parameters (they must). Nothing is asserted.
"""
from __future__ import annotations

import argparse
import statistics
import time
import types

import torch
import torch.nn as nn
import torch.nn.functional as F

from pfl_core.models import build_model
from pfl_core.models.lenet import LeNetTrunk
from pfl_core.training import model_params, sgd_step

MODELS = [("cafeme_cnn_a", (1, 28, 28), 30, 10), ("cafeme_cnn_b", (3, 32, 32), 50, 3), ("lenet", (3, 32, 32), 64, 10)]
"""(model, input shape, batch size, steps per timed block): the RMNIST and CIFAR-10 cells' shapes of
CAFeMe, and MetaVers' CIFAR-10 LeNet (pFedHN's target network) at its training batch."""


def _textbook_lenet_trunk(self, x: torch.Tensor) -> torch.Tensor:
    x = F.max_pool2d(F.relu(self.conv1(x)), 2)
    x = F.max_pool2d(F.relu(self.conv2(x)), 2)
    return self.fc2(F.relu(self.fc1(x.flatten(1))))


def textbook(model: nn.Module) -> nn.Module:
    """``model`` with each conv block rebuilt as Conv -> BN -> nn.ReLU -> nn.MaxPool2d(2, 2); a LeNet
    with its trunk as Conv -> ReLU -> ``F.max_pool2d``."""
    if isinstance(model, LeNetTrunk):
        model.trunk = types.MethodType(_textbook_lenet_trunk, model)
        return model
    for i, block in enumerate(model.features):
        model.features[i] = nn.Sequential(block[0], block[1], nn.ReLU(), nn.MaxPool2d(2, 2))
    return model


def compare(name: str, shape: tuple[int, ...], batch: int, steps: int, reps: int) -> dict:
    models = {}
    for label, build in (("textbook", textbook), ("project", lambda m: m)):
        torch.manual_seed(0)
        models[label] = build(build_model(name, shape, 10))
    params = {label: model_params(m) for label, m in models.items()}
    x, y = torch.randn(batch, *shape), torch.randint(0, 10, (batch,))
    times: dict[str, list[float]] = {label: [] for label in models}
    for _ in range(reps + 1):  # the first block of each warms up and is dropped
        for label, model in models.items():
            p, started = params[label], time.perf_counter()
            for _ in range(steps):
                p, _ = sgd_step(model, p, x, y, 0.01)
            times[label].append((time.perf_counter() - started) / steps * 1e3)
            params[label] = p
    ours, theirs = times["project"][1:], times["textbook"][1:]
    return {"model": name, "batch": batch, "textbook_ms": statistics.median(theirs),
            "project_ms": statistics.median(ours),
            "paired_ratio": statistics.median(a / b for a, b in zip(ours, theirs)),
            "bit_identical": all(torch.equal(params["project"][k], params["textbook"][k]) for k in params["project"])}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--threads", type=int, default=0, help="torch CPU threads (0: torch's default)")
    parser.add_argument("--reps", type=int, default=12, help="timed blocks per variant")
    args = parser.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    print(f"CPU, torch {torch.__version__}, {torch.get_num_threads()} thread(s); ms per SGD step, median of {args.reps}")
    print(f"{'model':14s} {'batch':>5s} {'textbook':>9s} {'project':>9s} {'ratio':>6s}  bit-identical")
    for name, shape, batch, steps in MODELS:
        r = compare(name, shape, batch, steps, args.reps)
        print(f"{name:14s} {batch:5d} {r['textbook_ms']:9.2f} {r['project_ms']:9.2f} {r['paired_ratio']:6.3f}  "
              f"{r['bit_identical']}", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
