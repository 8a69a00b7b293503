"""Independent random streams derived from one run seed (docs/running-suites.md, "Paired
comparisons").

Each purpose (partition, model init, client sampling, batch order, evaluation, ...) gets its own
stream, derived from ``(seed, purpose)`` alone. Changing the method, or how many numbers another
purpose consumes, therefore never changes the partition or the sequence of sampled clients.
"""
from __future__ import annotations

import hashlib

import numpy as np
import torch

PURPOSES = ("partition", "split", "unseen", "init", "sampling", "batches", "train", "eval")


def _purpose_key(purpose: str) -> int:
    return int.from_bytes(hashlib.sha256(purpose.encode()).digest()[:4], "little")


class RunStreams:
    """Factory of per-purpose generators for one run seed.

    ``streams.numpy("partition")`` and ``streams.torch("init")`` return fresh generators; calling
    twice with the same purpose returns generators in the same initial state. Use a sub-key
    (``streams.numpy("batches", client_id)``) for per-client streams.
    """

    def __init__(self, seed: int):
        self.seed = int(seed)

    def _sequence(self, purpose: str, *sub: int) -> np.random.SeedSequence:
        return np.random.SeedSequence([self.seed, _purpose_key(purpose), *map(int, sub)])

    def numpy(self, purpose: str, *sub: int) -> np.random.Generator:
        return np.random.default_rng(self._sequence(purpose, *sub))

    def seed_int(self, purpose: str, *sub: int) -> int:
        """A 63-bit integer seed for libraries that take an int (torch, scikit-learn)."""
        return int(self._sequence(purpose, *sub).generate_state(2, np.uint64)[0] >> np.uint64(1))

    def torch(self, purpose: str, *sub: int, device: str | torch.device = "cpu") -> torch.Generator:
        gen = torch.Generator(device=device)
        gen.manual_seed(self.seed_int(purpose, *sub))
        return gen


CUBLAS_WORKSPACE = ":4096:8"
"""``CUBLAS_WORKSPACE_CONFIG`` that makes cuBLAS deterministic (PyTorch "Reproducibility" notes)."""


def use_deterministic(enabled: bool = True) -> bool:
    """Ask PyTorch for deterministic kernels in this process (``pflbench run --deterministic``):
    ``torch.use_deterministic_algorithms`` (an op without a deterministic implementation raises),
    cuDNN autotuning off, and ``CUBLAS_WORKSPACE_CONFIG`` set unless already set (it must be set
    before the process's first cuBLAS call, so a run sets it before touching CUDA). How a run is
    computed, not what: never part of the config hash. Returns the resulting state.

    A process that already initialised CUDA without the variable (a reused Ray worker, a notebook)
    gets it too late for cuBLAS: it is still set, with a warning saying so and how to fix it
    (``pflbench run --deterministic`` sets it in the parent, before any CUDA call, for its workers)."""
    if enabled:
        import os
        import warnings

        if "CUBLAS_WORKSPACE_CONFIG" not in os.environ and torch.cuda.is_initialized():
            warnings.warn(f"--deterministic: CUBLAS_WORKSPACE_CONFIG is set after this process initialised "
                          f"CUDA, too late for cuBLAS, whose matmuls may stay nondeterministic here; export "
                          f"CUBLAS_WORKSPACE_CONFIG={CUBLAS_WORKSPACE} before starting the process", RuntimeWarning,
                          stacklevel=2)
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", CUBLAS_WORKSPACE)
    torch.use_deterministic_algorithms(enabled)
    torch.backends.cudnn.benchmark = False
    return torch.are_deterministic_algorithms_enabled()
