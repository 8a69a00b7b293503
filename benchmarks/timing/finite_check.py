"""The cost of the federation's per-round check that the server state is finite
(:func:`pfl_core.federation._check_finite`), on pFedHN's server state for MetaVers' CIFAR-10 cells
(the hypernetwork that generates its LeNet, and its momentum: 24.5M float32 values), to be timed
from outside:

    farm-bench -n 5 --vs 'python -m benchmarks.timing.finite_check --elementwise' \\
        -- python -m benchmarks.timing.finite_check

``--elementwise`` is the previous check (``isfinite(t).all()`` per tensor, the baseline); the
default is the check runs use (each tensor's sum, the element-wise check only when a sum is not
finite). Both pass on the same state; ``--checks`` checks are timed (one per round in a run).
"""
from __future__ import annotations

import argparse
import time

import torch

from pfl_core.algorithms.pfedhn import HyperNetwork
from pfl_core.federation import _check_finite, elementwise_finite
from pfl_core.models import build_model


def server_state(clients: int = 50) -> dict:
    """pFedHN's server state for a 50-client CIFAR-10 cell (its defaults: hidden 100, 3 hidden
    layers, embedding 1 + U / 4)."""
    torch.manual_seed(0)
    target = build_model("lenet", (3, 32, 32), 10)
    shapes = {name: p.shape for name, p in target.named_parameters()}
    hnet = HyperNetwork(shapes, clients, int(1 + clients / 4), 100, 3)
    params = {k: v.detach() for k, v in hnet.named_parameters()}
    return {"hnet": params, "hnet_momentum": {k: torch.randn_like(v) for k, v in params.items()}}


def elementwise(server: dict) -> bool:
    """The previous check: every tensor's element-wise finite flags, reduced, read once (the
    federation's own fallback, :func:`pfl_core.federation.elementwise_finite`)."""
    return elementwise_finite([t for d in server.values() for t in d.values()])


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--elementwise", action="store_true", help="the previous check (the baseline)")
    parser.add_argument("--checks", type=int, default=200)
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    server = server_state()
    values = sum(t.numel() for d in server.values() for t in d.values())
    start = time.perf_counter()
    for _ in range(args.checks):
        if args.elementwise:
            assert elementwise(server)
        else:
            _check_finite(server, 0)
    took = time.perf_counter() - start
    print(f"{args.checks} checks of {values:,} values: {1e3 * took / args.checks:.2f} ms each "
          f"({'element-wise' if args.elementwise else 'sum first'})")


if __name__ == "__main__":
    main()
