"""Secrets and servers (issue 15, item 7), against a real ``mlflow server`` on 127.0.0.1 with a
SQLite backend started by the test: a password in the tracking URI never shows (store line,
MLflow's "View run" lines, tracebacks), an unreachable server fails at once in one line, and
``make mlflow-ui`` serves MLFLOW_TRACKING_URI or the results folder, never the current directory."""
from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import requests
from mlflow.tracking import MlflowClient

from benchmarks.store.location import mask_uri, split_credentials
from conftest import REPO_ROOT, tiny_suite_dict, write_suite

SECRET = "s3cret-Pa55"


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    """``mlflow server`` on a free port of 127.0.0.1, SQLite backend and artifacts in a tmp folder."""
    root = tmp_path_factory.mktemp("mlflow-server")
    port = _free_port()
    mlflow = Path(sys.executable).parent / "mlflow"
    proc = subprocess.Popen([str(mlflow), "server", "--backend-store-uri", f"sqlite:///{root}/server.db",
                             "--artifacts-destination", str(root / "artifacts"), "--host", "127.0.0.1",
                             "--port", str(port), "--workers", "1"],
                            cwd=root, stdout=subprocess.DEVNULL, stderr=open(root / "server.log", "w"))
    url = f"http://127.0.0.1:{port}"
    for _ in range(240):
        try:
            if requests.get(f"{url}/health", timeout=1).ok:
                break
        except requests.RequestException:
            pass
        if proc.poll() is not None:
            pytest.fail(f"mlflow server exited: {(root / 'server.log').read_text()[-2000:]}")
        time.sleep(0.5)
    else:
        proc.terminate()
        pytest.fail("mlflow server did not answer /health")
    yield url
    proc.terminate()
    proc.wait(timeout=30)


def _pflbench(args: list[str], cwd: Path, timeout: int = 600) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if not k.startswith("MLFLOW_")}
    env.update(PFL_DOWNLOAD="0", PFLBENCH_RESULTS_DIR=str(cwd / "results"), GIT_OPTIONAL_LOCKS="0")
    return subprocess.run([sys.executable, "-m", "benchmarks.cli", *args], cwd=cwd, env=env, text=True,
                          capture_output=True, timeout=timeout)


def test_mask_and_split_credentials():
    assert mask_uri(f"store: http://alice:{SECRET}@h:5000/x, postgresql://bob:pw@db/optuna") == \
        "store: http://alice:***@h:5000/x, postgresql://bob:***@db/optuna"
    assert mask_uri("sqlite:////tmp/a.db http://h:5000") == "sqlite:////tmp/a.db http://h:5000"
    assert split_credentials(f"https://alice:{SECRET}@h:8443/mlflow") == ("https://h:8443/mlflow", "alice", SECRET)
    assert split_credentials("postgresql://bob:pw@db/x") == ("postgresql://bob:pw@db/x", None, None)


@pytest.mark.slow
def test_a_sweep_on_a_tracking_server_never_prints_the_password(server, tmp_path):
    suite = write_suite(tmp_path / "suites" / "tiny" / "mini.yaml", tiny_suite_dict())
    uri = server.replace("http://", f"http://alice:{SECRET}@")
    done = _pflbench(["run", str(suite), "--profile", "smoke", "--only", "setting=dir", "--only", "method=fedavg",
                      "--seeds", "0", "--tracking-uri", uri, "--strict"], tmp_path)
    output = done.stdout + done.stderr
    assert done.returncode == 0, output[-3000:]
    assert SECRET not in output
    assert "View run" in output  # MLflow's own line is printed, without the password
    assert f"store: {server}" in output
    runs = MlflowClient(server).search_runs([MlflowClient(server).get_experiment_by_name("tiny/mini").experiment_id])
    kinds = sorted((r.data.tags.get("run_kind"), r.info.status) for r in runs)
    assert kinds == [("cell", "FINISHED"), ("sweep", "FINISHED")]  # the run and its sweep's parent run


@pytest.mark.slow
def test_an_unreachable_server_fails_at_once_in_one_line(tmp_path):
    suite = write_suite(tmp_path / "mini.yaml", tiny_suite_dict())
    uri = f"http://alice:{SECRET}@127.0.0.1:{_free_port()}"  # nothing listens there
    done = _pflbench(["run", str(suite), "--profile", "smoke", "--tracking-uri", uri], tmp_path, timeout=120)
    assert done.returncode == 2
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and "unreachable" in lines[0] and "--tracking-uri" in lines[0], done.stderr
    assert SECRET not in done.stdout + done.stderr


@pytest.mark.slow
def test_a_traceback_does_not_show_the_password(tmp_path):
    """A store URI MLflow refuses (a misspelt scheme) ends in MLflow's traceback, whose message
    quotes the URI: with the password masked."""
    suite = write_suite(tmp_path / "mini.yaml", tiny_suite_dict())
    uri = f"postgress://bob:{SECRET}@127.0.0.1:{_free_port()}/mlflow"
    done = _pflbench(["run", str(suite), "--profile", "smoke", "--tracking-uri", uri], tmp_path, timeout=300)
    assert done.returncode != 0
    assert "Traceback" in done.stderr and "bob:***@" in done.stderr
    assert SECRET not in done.stdout + done.stderr


@pytest.mark.parametrize("env,expected", [
    ({}, "--backend-store-uri sqlite:///{results}/mlflow.db"),
    ({"MLFLOW_TRACKING_URI": "sqlite:////srv/shared/mlflow.db"}, "--backend-store-uri sqlite:////srv/shared/mlflow.db"),
    ({"MLFLOW_TRACKING_URI": f"http://alice:{SECRET}@tracking:5000"}, "serves its own UI: open http://alice:***@tracking:5000"),
])
def test_make_mlflow_ui_honours_the_tracking_uri_and_the_results_folder(tmp_path, env, expected):
    fake = tmp_path / "bin"
    fake.mkdir()
    (fake / "mlflow").write_text('#!/bin/sh\necho "mlflow $*"\n')
    (fake / "mlflow").chmod(0o755)
    base = {k: v for k, v in os.environ.items() if not k.startswith(("MLFLOW_", "MAKE", "MFLAGS"))}
    base.update(PFLBENCH_RESULTS_DIR=str(tmp_path / "results"), **env)
    done = subprocess.run(["make", "-s", "-C", str(REPO_ROOT), "-o", ".venv/.installed", "mlflow-ui", f"BIN={fake}"],
                          env=base, text=True, capture_output=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert expected.format(results=tmp_path / "results") in done.stdout
    assert SECRET not in done.stdout + done.stderr
