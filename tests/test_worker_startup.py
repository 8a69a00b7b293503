"""What a worker process pays before its first run (issue 10, `make demo` time): the modules it
imports, and NumPy's BLAS threads held to the run's torch thread count."""
from __future__ import annotations

import hashlib
import subprocess
import sys

import numpy as np
import pytest
from threadpoolctl import threadpool_info, threadpool_limits

import benchmarks.running.worker as worker
from benchmarks.suite.spec import load_suite
from pfl_core.data.offline import synthetic_draws

from conftest import tiny_suite_dict, write_suite


@pytest.mark.slow
def test_a_worker_on_offline_data_imports_neither_mlflow_nor_torchvision():
    """A spawned worker imports benchmarks.running.worker (the pickled execute_specs) and loads offline
    data: MLflow (the parent's business) and torchvision (real datasets only) stay unimported."""
    probe = (
        "import sys; import benchmarks.running.worker; from pfl_core.data import load_dataset; "
        "load_dataset('digits28', split='train'); "
        "print(sorted(m for m in ('mlflow', 'torchvision', 'torch._dynamo', 'optuna') if m in sys.modules))"
    )
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]", out.stdout + out.stderr


def _blas_threads() -> list[int]:
    return [pool["num_threads"] for pool in threadpool_info() if pool["user_api"] == "blas"]


def test_execute_specs_holds_numpy_blas_to_the_run_threads(tmp_path, monkeypatch):
    suite = load_suite(write_suite(tmp_path / "suites" / "tiny" / "mini.yaml", tiny_suite_dict()))
    spec = suite.expand("smoke", seeds=[0])[0]
    seen = []
    real = worker.run_experiment

    def spy(cfg, **kwargs):
        seen.append(_blas_threads())
        return real(cfg, **kwargs)

    monkeypatch.setattr(worker, "run_experiment", spy)
    with threadpool_limits(2, user_api="blas"):  # as a 2-core machine's default
        outcome = worker.execute_specs([spec], device="cpu", data_dir=None, threads=1)[0]
        assert _blas_threads() and set(_blas_threads()) == {2}  # handed back afterwards
    assert "error" not in outcome, outcome
    assert seen and set(seen[0]) == {1}


def test_synthetic_draws_identical_under_one_and_two_blas_threads():
    """The generator's bytes do not depend on the BLAS thread count, so holding it to one thread
    moves no number."""
    def fingerprint(threads: int) -> str:
        with threadpool_limits(threads, user_api="blas"):
            d = synthetic_draws(num_users=8, seed=3)
        return hashlib.sha256(np.ascontiguousarray(d.x).tobytes() + d.y.tobytes()).hexdigest()

    assert fingerprint(1) == fingerprint(2)
