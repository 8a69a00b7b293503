"""Shared helpers for the harness tests (suite files, MLflow stores in tmp_path)."""
from __future__ import annotations

import copy
import os
import socket
import subprocess
import textwrap
import time
import urllib.request
from pathlib import Path

import pytest
import yaml

REPO_ROOT = Path(__file__).resolve().parents[1]


def pytest_configure(config):
    """Under pytest-xdist (``make test``: ``-n auto``) each worker process runs one torch thread, so
    that N workers on N cores do not oversubscribe them (each test that wants threads sets its own).
    A fresh MLflow SQLite store opened in a test process replays a migrated schema instead of
    migrating (``tests/mlflow_schema.py``; ``PFL_TEST_REAL_MIGRATIONS=1`` turns that off)."""
    if os.environ.get("PYTEST_XDIST_WORKER"):
        import torch

        torch.set_num_threads(1)
    import mlflow_schema

    mlflow_schema.install()


def module_fixture_group(item) -> str | None:
    """The xdist group of a test that uses a module-scoped fixture of its own module (its module's
    name), else None. pytest-xdist sets such a fixture up once per worker that runs one of the module's
    tests: a store swept or a server started twice on two workers is the same work done twice."""
    info = getattr(item, "_fixtureinfo", None)
    module = getattr(item, "module", None)
    if info is None or module is None:
        return None
    for defs in info.name2fixturedefs.values():
        if any(d.scope == "module" and getattr(d.func, "__module__", None) == module.__name__ for d in defs):
            return module.__name__
    return None


@pytest.hookimpl(tryfirst=True)  # before pytest-xdist's own hook reads the xdist_group marks (--dist loadgroup)
def pytest_collection_modifyitems(config, items):
    """``gpu``-marked tests skip without a CUDA device (``make gpu-check`` runs them on one). Under
    pytest-xdist the ``slow`` tests are handed out first (a stable sort, the same in every worker):
    the longest tests start while the short ones can still fill the other workers, instead of one
    worker running the last long test while the others wait; and the tests of a module that share a
    module-scoped fixture run on one worker (:func:`module_fixture_group`), unless already grouped."""
    if os.environ.get("PYTEST_XDIST_WORKER"):
        items.sort(key=lambda item: item.get_closest_marker("slow") is None)
        for item in items:
            group = module_fixture_group(item)
            if group and item.get_closest_marker("xdist_group") is None:
                item.add_marker(pytest.mark.xdist_group(group))
    gpu = [item for item in items if item.get_closest_marker("gpu")]
    if not gpu:
        return
    import torch

    if not torch.cuda.is_available():
        for item in gpu:
            item.add_marker(pytest.mark.skip(reason="needs a CUDA device (make gpu-check)"))


def tiny_suite_dict() -> dict:
    """A tiny suite in the layout of suites/demo/offline.yaml: digits28, 10 clients, MLR,
    2 settings x 3 methods, seeds [0, 1]; ``smoke`` (2 rounds) and ``quick`` (1 seed) profiles."""
    return {
        "paper": "tiny",
        "name": "mini",
        "table": "Tiny table",
        "caption": "Tiny caption: digits28 with ten clients, for the harness tests.",
        "metric": {"key": "acc_last3", "label": "test accuracy (%)", "scale": 100,
                   "averaging": "Unweighted mean over clients.", "pm": "std", "ddof": 0},
        "base": {
            "data": {"dataset": "digits28", "num_clients": 10, "unseen_fraction": 0.2,
                     "client_splits": {"test": 0.2},
                     "partition": {"name": "dirichlet", "alpha": 0.5, "min_size": 20}},
            "model": {"name": "mlr"},
            "method": {"params": {"lr": 0.05, "local_epochs": 1}},
            "federation": {"rounds": 3, "clients_per_round": 3, "batch_size": 30},
            "evaluation": {"protocol": "unseen", "params": {"steps": 3, "lr": 0.05}},
        },
        "grid": [
            {"name": "setting", "values": [
                {"label": "dir", "set": {"data.partition": {"name": "dirichlet", "alpha": 0.5, "min_size": 20}}},
                {"label": "iid", "set": {"data.partition": {"name": "iid"}}},
            ]},
            {"name": "method", "key": "method.name", "values": ["local", "fedavg", "fedavg_ft"]},
        ],
        "seeds": [0, 1],
        "profiles": {
            "smoke": {"description": "tests", "seeds": [0, 1],
                      "set": {"federation.rounds": 2, "evaluation.params.steps": 2}},
            "quick": {"seeds": [0], "set": {"federation.rounds": 1}},
        },
        "published": [
            {"cell": {"setting": "dir", "method": "fedavg"}, "mean": 50.0, "pm": 1.5,
             "pm_kind": "std", "runs": 5, "source": "Table 1"},
            {"cell": {"setting": "iid", "method": "local"}, "mean": 30.0, "pm": 2.0,
             "pm_kind": "std", "runs": 5, "source": "Table 1"},
        ],
    }


def synthetic_suite_head(rounds: int, base_extra: str = "") -> str:
    """The opening of a tiny suite file on synthetic data (paper, name, metric, base), for tests
    that write a suite as YAML text and append their own seeds, grid and profiles."""
    return ("paper: demo\nname: t\nmetric: {key: acc}\nbase:\n"
            "  data: {dataset: synthetic, num_clients: 6, params: {alpha: 0.5, beta: 0.5}, partition: {name: natural},\n"
            "         client_splits: {test: 0.2}}\n"
            f"  federation: {{rounds: {rounds}, clients_per_round: 3, batch_size: 8}}\n"
            "  model: {name: mlr}\n" + base_extra)


def write_dedented(folder: Path, name: str, text: str) -> Path:
    """``folder/name`` holding ``text`` dedented (suite files written as YAML text in tests)."""
    path = folder / name
    path.write_text(textwrap.dedent(text))
    return path


def expanded_runs(suite) -> dict:
    """profile -> [(cell, seed, config hash, config)] of every run: two suites that load alike agree here."""
    return {p: [(s.cell_id, s.seed, s.config_hash, s.config) for s in suite.expand(p)] for p in suite.profiles}


def write_suite(path: Path, data: dict) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(yaml.safe_dump(data, sort_keys=False))
    return path


@pytest.fixture
def suite_data() -> dict:
    """A fresh (mutable) copy of the tiny suite mapping."""
    return copy.deepcopy(tiny_suite_dict())


@pytest.fixture
def tiny_suite(tmp_path) -> Path:
    """Path of the tiny suite written into tmp_path."""
    return write_suite(tmp_path / "suites" / "tiny" / "mini.yaml", tiny_suite_dict())


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on now."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def wait_for(url: str, proc: subprocess.Popen, timeout: float = 180.0) -> bytes:
    """GET ``url`` until it answers 200 (a server ``proc`` starting up); fails if ``proc`` exits."""
    deadline = time.monotonic() + timeout
    while True:
        if proc.poll() is not None:
            raise AssertionError(f"{proc.args[0]} exited with {proc.returncode} before serving {url}")
        try:
            with urllib.request.urlopen(url, timeout=10) as answer:
                return answer.read()
        except OSError:
            if time.monotonic() > deadline:
                raise
            time.sleep(1.0)


def store(root: Path) -> tuple[str, Path]:
    """(tracking URI, artifact root) of an MLflow SQLite store under ``root``."""
    root.mkdir(parents=True, exist_ok=True)
    return f"sqlite:///{root}/mlflow.db", root / "mlartifacts"


@pytest.fixture
def isolated(tmp_path, monkeypatch):
    """cwd = tmp_path (keeps relative reports/ out of the repo), default stores under
    tmp_path/results (PFLBENCH_RESULTS_DIR), no MLFLOW_TRACKING_URI."""
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    monkeypatch.setenv("PFLBENCH_RESULTS_DIR", str(tmp_path / "results"))
    monkeypatch.chdir(tmp_path)
    return tmp_path


def make_dry_run(target: str) -> str:
    """``make -n TARGET`` at the repository root (quick profile, 2 jobs): the commands a target runs."""
    import shutil
    import subprocess

    if shutil.which("make") is None:
        pytest.skip("needs make")
    proc = subprocess.run(["make", "-n", "-o", ".venv/.installed", target, "PROFILE=quick", "JOBS=2"],
                          cwd=REPO_ROOT, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    return proc.stdout


@pytest.fixture
def dead_and_live_pids():
    """(pid of a process that has exited, pid of a running one): the writers of planted temporary
    files, one killed mid-write and one still writing."""
    done = subprocess.Popen(["true"])
    done.wait()
    live = subprocess.Popen(["sleep", "120"])
    yield done.pid, live.pid
    live.kill()
    live.wait()
