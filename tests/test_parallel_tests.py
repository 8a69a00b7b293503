"""How the tests themselves run (docs/tests.md): `make test` on every core with pytest-xdist, one torch
thread per worker, the Ray tests on one worker, `make test-fast` without the tests marked slow."""
from __future__ import annotations

import os
import shlex
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import conftest
from conftest import make_dry_run


def pytest_command(target: str) -> list[str]:
    """The arguments after ``python -m pytest`` of what ``make TARGET`` runs."""
    (line,) = [line for line in make_dry_run(target).splitlines() if " -m pytest " in line]
    argv = shlex.split(line)
    return argv[argv.index("pytest") + 1:]


def test_make_test_runs_on_every_core_and_prints_the_25_slowest():
    argv = pytest_command("test")
    assert argv[argv.index("-n") + 1] == "auto"
    assert argv[argv.index("--dist") + 1] == "loadgroup"  # keeps an xdist_group on one worker
    assert "--durations=25" in argv and "-m" not in argv  # every test, none deselected


def test_make_test_fast_leaves_out_the_slow_tests_on_every_core():
    argv = pytest_command("test-fast")
    assert argv[argv.index("-m") + 1] == "not slow"
    assert argv[argv.index("-n") + 1] == "auto" and argv[argv.index("--dist") + 1] == "loadgroup"


def test_an_xdist_worker_runs_one_torch_thread(monkeypatch):
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        monkeypatch.delenv("PYTEST_XDIST_WORKER", raising=False)
        conftest.pytest_configure(None)  # not a worker (pytest without -n): threads left alone
        assert torch.get_num_threads() == 2
        monkeypatch.setenv("PYTEST_XDIST_WORKER", "gw1")
        conftest.pytest_configure(None)
        assert torch.get_num_threads() == 1
    finally:
        torch.set_num_threads(before)


def test_the_ray_tests_share_one_xdist_group():
    """Each starts a local Ray instance, which ``--address auto`` of another would join."""
    test_ray = pytest.importorskip("test_ray")
    (mark,) = [m for m in [test_ray.pytestmark] if m.name == "xdist_group"]
    assert mark.args == ("ray",)


class _Item:
    def __init__(self, name: str, slow: bool):
        self.name, self.slow = name, slow

    def get_closest_marker(self, name: str):
        return pytest.mark.slow.mark if name == "slow" and self.slow else None


@pytest.mark.parametrize("worker", [None, "gw0"])
def test_xdist_workers_hand_out_the_slow_tests_first_in_their_order(monkeypatch, worker):
    if worker:
        monkeypatch.setenv("PYTEST_XDIST_WORKER", worker)
    else:
        monkeypatch.delenv("PYTEST_XDIST_WORKER", raising=False)
    items = [_Item("a", False), _Item("b", True), _Item("c", False), _Item("d", True)]
    conftest.pytest_collection_modifyitems(None, items)
    assert [i.name for i in items] == (["b", "d", "a", "c"] if worker else ["a", "b", "c", "d"])


SHARED_FIXTURE_MODULE = '''
import os, pytest

@pytest.fixture(scope="module")
def shared():
    with open(os.environ["SETUPS"], "a") as f:
        f.write(os.environ["PYTEST_XDIST_WORKER"] + "\\n")

@pytest.mark.parametrize("i", range(6))
def test_uses_it(shared, i):
    pass

@pytest.mark.parametrize("i", range(6))
def test_alone(i):
    pass
'''


@pytest.mark.slow
def test_a_module_scoped_fixture_is_set_up_once_under_make_tests_xdist(tmp_path):
    """`make test`'s pytest-xdist (2 workers, --dist loadgroup, this conftest as a plugin): the tests
    that share a module-scoped fixture run on one worker, so the fixture is set up once, not once per
    worker; the module's other tests still spread."""
    (tmp_path / "test_shared_fixture.py").write_text(SHARED_FIXTURE_MODULE)
    setups = tmp_path / "setups.txt"
    env = {**os.environ, "SETUPS": str(setups), "PYTHONPATH": str(Path(conftest.__file__).parent)}
    proc = subprocess.run([sys.executable, "-m", "pytest", "-v", "-n", "2", "--dist", "loadgroup", "-p", "conftest",
                           "-p", "no:cacheprovider", str(tmp_path)],
                          cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "12 passed" in proc.stdout
    assert len(setups.read_text().split()) == 1, setups.read_text()
    lines = [line.strip() for line in proc.stdout.splitlines() if "PASSED" in line]
    shared = [line for line in lines if "test_uses_it" in line]
    assert len(shared) == 6 and all(line.endswith("@test_shared_fixture") for line in shared), shared
    assert len({line.split()[0] for line in shared}) == 1  # [gwN]: one worker
    assert not any("@" in line for line in lines if "test_alone" in line)
