"""A shared store as a lab runs one (issue 30, item 4): a PostgreSQL server (Debian's package, started
and stopped by the test in a temporary folder) behind ``mlflow server``, two ``pflbench run``
processes and a Ray sweep on it at once. Each configuration is computed exactly once, and the
report is the one a SQLite store gives for the same suite run alone.

Skips, with its reason, when PostgreSQL's server binaries are absent (``make postgres`` installs
them with apt-get) or cannot start here."""
from __future__ import annotations

import csv
import glob
import os
import pwd
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest
from mlflow.tracking import MlflowClient

from benchmarks.suite.spec import load_suite
from conftest import free_port, tiny_suite_dict, wait_for, write_suite

pytestmark = [pytest.mark.slow, pytest.mark.xdist_group("ray")]  # its Ray sweep: one Ray instance at a time (tests/test_ray.py)


def postgres_bin() -> Path | None:
    """The folder of ``initdb``/``pg_ctl``: $PFL_PG_BIN, else Debian's newest /usr/lib/postgresql/<ver>/bin."""
    found = [os.environ["PFL_PG_BIN"]] if os.environ.get("PFL_PG_BIN") else \
        sorted(glob.glob("/usr/lib/postgresql/*/bin"), key=lambda p: [int(v) for v in re.findall(r"\d+", p)])
    folder = Path(found[-1]) if found else None
    return folder if folder and (folder / "initdb").is_file() and (folder / "pg_ctl").is_file() else None


def as_server_user(cmd: list) -> list[str]:
    """PostgreSQL refuses to run as root: as root, run ``cmd`` as the ``postgres`` user of the package."""
    cmd = [str(c) for c in cmd]
    return ["runuser", "-u", "postgres", "--", *cmd] if os.geteuid() == 0 else cmd


def has_user(name: str) -> bool:
    try:
        pwd.getpwnam(name)
        return True
    except KeyError:
        return False


@pytest.fixture
def postgres():
    """A throw-away PostgreSQL cluster on 127.0.0.1 (trust authentication, test only) holding an empty
    database ``mlflow``; yields its SQLAlchemy URI and stops and deletes the cluster afterwards."""
    pg_bin = postgres_bin()
    if pg_bin is None:
        pytest.skip("PostgreSQL server binaries not found (/usr/lib/postgresql/*/bin; `make postgres` installs them)")
    if os.geteuid() == 0 and not has_user("postgres"):
        pytest.skip("running as root, and no `postgres` user to run PostgreSQL's server as (Debian's package creates it)")
    pytest.importorskip("psycopg", reason="psycopg (the dev extra's PostgreSQL driver for MLflow) is not installed")
    root = Path(tempfile.mkdtemp(prefix="pflbench-pg-"))  # not under tmp_path: the postgres user must reach it
    if os.geteuid() == 0:
        shutil.chown(root, "postgres")
    data, port, log = root / "data", free_port(), root / "server.log"
    pg_ctl = [pg_bin / "pg_ctl", "-D", data, "-l", log]
    try:
        init = subprocess.run(as_server_user([pg_bin / "initdb", "-D", data, "-U", "pflbench", "-A", "trust",
                                              "--no-sync", "-E", "UTF8"]), capture_output=True, text=True)
        if init.returncode != 0:
            pytest.skip(f"PostgreSQL's initdb cannot run here: {(init.stderr or init.stdout).strip()[-300:]}")
        options = f"-p {port} -k {root} -c listen_addresses=127.0.0.1 -c fsync=off"
        start = subprocess.run(as_server_user([*pg_ctl, "-w", "-o", options, "start"]), capture_output=True, text=True)
        if start.returncode != 0:
            why = log.read_text() if log.exists() else start.stderr or start.stdout
            pytest.skip(f"PostgreSQL's server cannot start here: {why.strip()[-300:]}")
        subprocess.run([pg_bin / "createdb", "-h", "127.0.0.1", "-p", str(port), "-U", "pflbench", "mlflow"],
                       check=True, capture_output=True)
        yield f"postgresql://pflbench@127.0.0.1:{port}/mlflow"
    finally:
        if (data / "postmaster.pid").exists():
            subprocess.run(as_server_user([*pg_ctl, "-m", "fast", "-w", "stop"]), capture_output=True)
        shutil.rmtree(root, ignore_errors=True)


@pytest.fixture
def mlflow_server(postgres, tmp_path):
    """``mlflow server`` on the PostgreSQL store, artifacts served from a tmp folder; yields its URL."""
    port = free_port()
    log = open(tmp_path / "mlflow-server.log", "w")
    proc = subprocess.Popen([Path(sys.executable).parent / "mlflow", "server", "--backend-store-uri", postgres,
                             "--artifacts-destination", tmp_path / "server-artifacts", "--host", "127.0.0.1",
                             "--port", str(port), "--workers", "2"], cwd=tmp_path, stdout=log, stderr=log)
    url = f"http://127.0.0.1:{port}"
    try:
        wait_for(f"{url}/health", proc)
        yield url
    finally:
        proc.terminate()
        proc.wait(timeout=60)
        log.close()


def pflbench(*args, cwd: Path) -> subprocess.Popen:
    env = {k: v for k, v in os.environ.items() if not k.startswith("MLFLOW_")}
    env.update(PFL_DOWNLOAD="0", PFLBENCH_RESULTS_DIR=str(cwd / "results"), PYTHONUNBUFFERED="1")
    return subprocess.Popen([sys.executable, "-m", "benchmarks.cli", *map(str, args)], cwd=cwd, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def finish(proc: subprocess.Popen) -> str:
    out = proc.communicate(timeout=900)[0]
    assert proc.returncode == 0, out[-4000:]
    return out


def computed(out: str) -> int:
    """The runs a sweep computed itself, from its summary line ("N finished, 0 failed, M skipped ...")."""
    return int(re.search(r"(\d+) finished, 0 failed", out).group(1))


def cell_runs(uri: str, key: str) -> list:
    client = MlflowClient(tracking_uri=uri)
    exp = client.get_experiment_by_name(key)
    return [r for r in client.search_runs([exp.experiment_id]) if r.data.tags.get("run_kind") != "sweep"] if exp else []


def test_two_runners_and_a_ray_sweep_share_a_postgres_server_and_report_as_sqlite(mlflow_server, tmp_path):
    pytest.importorskip("ray")
    suite_path = write_suite(tmp_path / "suites" / "tiny" / "mini.yaml", tiny_suite_dict())
    suite = load_suite(suite_path)
    specs = suite.expand("smoke")
    run = ["run", suite_path, "--profile", "smoke", "--device", "cpu"]
    started = time.monotonic()
    # the Ray sweep first, until it holds a claim (so it computes some runs itself), then two plain runners
    ray_sweep = pflbench(*run, "--tracking-uri", mlflow_server, "--executor", "ray", "--jobs", "2", cwd=tmp_path)
    while ray_sweep.poll() is None and not any(r.info.status == "RUNNING" for r in cell_runs(mlflow_server, suite.key)):
        assert time.monotonic() - started < 300, "the Ray sweep claimed no run in 300 s"
        time.sleep(0.5)
    runners = [pflbench(*run, "--tracking-uri", mlflow_server, cwd=tmp_path) for _ in range(2)]
    outs = [finish(p) for p in (ray_sweep, *runners)]
    counts = [computed(out) for out in outs]
    assert counts[0] >= 1 and sum(counts) == len(specs), counts  # split between the three, none twice

    runs = cell_runs(mlflow_server, suite.key)
    assert {r.info.status for r in runs} <= {"FINISHED", "KILLED"}  # lost claims are KILLED, none left RUNNING
    finished = sorted(r.data.tags["config_hash"] for r in runs if r.info.status == "FINISHED")
    assert finished == sorted(s.config_hash for s in specs)  # every configuration exactly once

    # the same suite alone on a SQLite store: the same report, Markdown and CSV, byte for byte
    sqlite_uri = f"sqlite:///{tmp_path}/sqlite/mlflow.db"
    (tmp_path / "sqlite").mkdir()
    assert computed(finish(pflbench(*run, "--tracking-uri", sqlite_uri, cwd=tmp_path))) == len(specs)
    for uri, out in ((mlflow_server, "from-postgres"), (sqlite_uri, "from-sqlite")):
        finish(pflbench("report", suite_path, "--profile", "smoke", "--tracking-uri", uri, "--out", out, cwd=tmp_path))
    for ext in ("md", "csv"):
        shared, alone = (tmp_path / out / "tiny" / f"mini.{ext}" for out in ("from-postgres", "from-sqlite"))
        assert shared.read_text() == alone.read_text(), ext
    with open(tmp_path / "from-postgres" / "tiny" / "mini.csv") as table:
        rows = list(csv.DictReader(table))
    assert len(rows) == 6 and all(r["n_seeds"] == r["expected_seeds"] == "2" and r["mean"] for r in rows)
    print(f"postgres store test: {time.monotonic() - started:.0f} s")
