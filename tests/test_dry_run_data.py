"""A dry run never downloads and never fails for missing data (issue 37, item 2): it lists the plan,
then per dataset what is missing, partial or failing its checksum and where it is expected. Every
connection attempt is an error here (``no_network``), so a download would fail the test."""
from __future__ import annotations

import io
import os
import re
import socket
from contextlib import redirect_stderr, redirect_stdout

import pytest

from benchmarks.cli import main
from benchmarks.suite.packaged import suite_names
from benchmarks.suite.spec import load_suite
from pfl_core.data.cifar_files import ACCEPT_ENV

from conftest import REPO_ROOT
from fake_data import write_cifar10

RUN_LINE = re.compile(r" method=\S+ +seed=\d+ +hash=[0-9a-f]{16} ")


@pytest.fixture(scope="module")
def store(tmp_path_factory):
    """One MLflow store for the module's dry runs (a dry run only reads it; creating one costs seconds)."""
    return tmp_path_factory.mktemp("store")


@pytest.fixture
def no_network(monkeypatch):
    """Every connection attempt fails and is recorded (a loader would turn the failure into "not
    found"): the test asserts that none was made."""
    attempts = []

    def refuse(*args, **_kwargs):
        attempts.append(args)
        raise OSError("network refused by the test")

    monkeypatch.setattr(socket.socket, "connect", refuse)
    monkeypatch.setattr(socket, "create_connection", refuse)
    monkeypatch.delenv("PFL_DOWNLOAD", raising=False)  # downloads allowed: the dry run must still not try
    monkeypatch.delenv(ACCEPT_ENV, raising=False)
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    yield attempts
    assert not attempts, f"{len(attempts)} connection attempt(s), e.g. {attempts[0]}"


def dry_run(suite: str, data_dir, store, *extra: str) -> tuple[int, list[str], str]:
    out, err = io.StringIO(), io.StringIO()
    with redirect_stdout(out), redirect_stderr(err):
        rc = main(["run", suite, "--dry-run", "--data-dir", str(data_dir), "--tracking-uri",
                   f"sqlite:///{store}/mlflow.db", *extra])
    return rc, out.getvalue().splitlines(), err.getvalue()


def data_lines(lines: list[str]) -> dict[str, str]:
    """dataset -> its line under 'data not ready under ...'."""
    start = next((i for i, line in enumerate(lines) if line.startswith("data not ready under")), len(lines))
    return {line.split(":")[0].strip(): line for line in lines[start + 1:]}


def test_the_issue_s_command_lists_the_plan_and_what_is_missing(tmp_path, store, no_network):
    """``pflbench run suites/cafeme/table1.yaml --profile paper --dry-run`` on a machine with no data."""
    empty = tmp_path / "data"
    empty.mkdir()
    rc, lines, err = dry_run("cafeme/table1", empty, store, "--profile", "paper")
    assert rc == 0, err
    runs = len(load_suite("cafeme/table1").expand("paper"))
    assert sum(bool(RUN_LINE.search(line)) for line in lines) == runs
    assert f"{runs} runs (0 already FINISHED, {runs} to run)" in "\n".join(lines)
    assert lines[runs + 1] == f"data not ready under {empty} (a dry run downloads nothing):"
    gaps = data_lines(lines)
    assert set(gaps) == {"cifar10", "rmnist"}
    assert gaps["cifar10"].startswith(f"  cifar10: missing ({runs // 2} runs): CIFAR-10 not found under {empty} "
                                      f"(expected {empty / 'cifar-10-batches-py'})")
    assert "MNIST/raw/train-images-idx3-ubyte" in gaps["rmnist"]
    assert "PFL_DOWNLOAD=1" in gaps["cifar10"] and "PFL_DATA_DIR / --data-dir" in gaps["cifar10"]
    assert os.environ.get("PFL_DOWNLOAD") is None  # the dry run's no-download setting is undone
    assert not list(empty.iterdir())  # nothing was written there


def test_partial_and_checksum_failing_data_are_listed_each_its_way(tmp_path, store, no_network):
    """The same command with a CIFAR-10 folder that is partial, then one failing its checksum."""
    data = tmp_path / "data"
    write_cifar10(data, 2)  # md5s not patched in: a copy that fails torchvision's checksum
    rc, lines, err = dry_run("cafeme/table1", data, store, "--profile", "paper")
    assert rc == 0, err
    line = data_lines(lines)["cifar10"]
    assert f"cifar10: checksum failed (80 runs): CIFAR-10 checksum failed for {data / 'cifar-10-batches-py'}" in line
    assert line.endswith(f"{ACCEPT_ENV}=cifar10")
    (data / "cifar-10-batches-py" / "data_batch_4").unlink()
    rc, lines, err = dry_run("cafeme/table1", data, store, "--profile", "paper")
    line = data_lines(lines)["cifar10"]
    assert rc == 0 and f"cifar10: partial (80 runs): CIFAR-10 partial under {data / 'cifar-10-batches-py'}: 6 of 7 " \
                       "files there, missing data_batch_4;" in line


def test_a_real_run_still_stops_at_the_pre_flight(tmp_path, no_network, monkeypatch):
    """Only the dry run lists missing data: a run (downloads off) fails before any run, in one line."""
    monkeypatch.setenv("PFL_DOWNLOAD", "0")
    out, err = io.StringIO(), io.StringIO()
    with redirect_stdout(out), redirect_stderr(err):
        rc = main(["run", "cafeme/table1", "--profile", "paper", "--data-dir", str(tmp_path),
                   "--tracking-uri", f"sqlite:///{tmp_path}/mlflow.db", "--only", "dataset=cifar10"])
    assert rc == 2
    assert "data.dataset: CIFAR-10 not found under" in err.getvalue()


@pytest.mark.slow  # loads and expands every packaged suite (about 20 s on the 2-core dev machine)
def test_a_dry_run_without_any_dataset_lists_every_run_of_every_suite(tmp_path, store, no_network):
    """Every packaged suite, profile paper, one seed per cell (the shrink: the number of runs listed
    is checked, not their seeds), against an empty data directory: exit 0, every run of the plan
    listed, and a 'missing' line naming the empty directory for each dataset it needs (none for the
    demo's generated data). The per-dataset lines themselves are checked on cafeme/table1 above."""
    empty = tmp_path / "data"
    empty.mkdir()
    names = suite_names()
    assert names == sorted(p.relative_to(REPO_ROOT / "suites").with_suffix("").as_posix()
                           for p in (REPO_ROOT / "suites").glob("*/*.yaml"))  # 27 today
    for name in names:
        rc, lines, err = dry_run(name, empty, store, "--profile", "paper", "--seeds", "0")
        assert rc == 0, f"{name}: {err}"
        (total,) = [int(line.split()[0]) for line in lines if re.match(r"\d+ runs \(", line)]
        assert total > 0 and sum(bool(RUN_LINE.search(line)) for line in lines) == total, name
        gaps = data_lines(lines)
        assert bool(gaps) == (name != "demo/offline"), name  # the demo's data is generated
        assert all(" missing (" in line and str(empty) in line for line in gaps.values()), name
    assert not list(empty.iterdir())
