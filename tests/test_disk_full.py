"""A full disk while a sweep writes (issue 29, item 3): one line, exit 2, no run left RUNNING."""
from __future__ import annotations

import errno

import pytest
from mlflow.entities import ViewType
from mlflow.tracking import MlflowClient

from benchmarks import cli
from conftest import store


@pytest.fixture(autouse=True)
def _isolated(isolated):
    return isolated


def test_a_full_disk_while_a_run_is_written_leaves_no_run_running(tmp_path, tiny_suite, monkeypatch, capsys):
    uri, _ = store(tmp_path / "store")
    real = MlflowClient.log_artifact

    def full(self, run_id, local_path, artifact_path=None):
        if local_path.endswith("config.json"):  # a cell run's artifacts: the disk fills up there
            raise OSError(errno.ENOSPC, "No space left on device", local_path)
        return real(self, run_id, local_path, artifact_path)

    monkeypatch.setattr(MlflowClient, "log_artifact", full)
    argv = ["run", str(tiny_suite), "--tracking-uri", uri, "--device", "cpu", "--profile", "smoke",
            "--seeds", "0", "--only", "setting=iid", "--only", "method=local"]
    assert cli.main(argv) == 2
    err = capsys.readouterr().err
    answer = [line for line in err.splitlines() if line.startswith("pflbench:")]  # beside MLflow's and tqdm's lines
    assert "Traceback" not in err and len(answer) == 1
    assert "no space left on device" in answer[0] and "--tracking-uri" in answer[0]
    client = MlflowClient(tracking_uri=uri)
    exps = [e.experiment_id for e in client.search_experiments()]
    runs = client.search_runs(exps, "", ViewType.ALL)
    assert {r.info.status for r in runs} == {"FAILED"}  # the cell run and its sweep's parent
    cell = next(r for r in runs if r.data.tags.get("run_kind") == "cell")
    assert "OSError" in cell.data.tags["failure_reason"]


def test_a_full_sqlite_store_is_one_line_without_sqlalchemys_text(tmp_path, tiny_suite, monkeypatch, capsys):
    """A real SQLITE_FULL: after the store is created, every connection may not grow the database
    (``PRAGMA max_page_count``), as on a full disk. MLflow logs SQLAlchemy's SQL and traceback
    ("(Background on this error at ...)") before it raises; pflbench's one line is all the user sees."""
    import sqlite3

    from sqlalchemy import event
    from sqlalchemy.pool import Pool

    uri, _ = store(tmp_path / "store")
    db = tmp_path / "store" / "mlflow.db"
    MlflowClient(tracking_uri=uri).search_experiments()  # the tables exist: only the runs' writes fail
    with sqlite3.connect(db) as conn:
        conn.execute("VACUUM")  # no free page left inside the file either
        pages = conn.execute("PRAGMA page_count").fetchone()[0]

    def full(dbapi_conn, record, proxy):
        dbapi_conn.execute(f"PRAGMA max_page_count = {pages}")

    event.listen(Pool, "checkout", full)
    try:
        argv = ["run", str(tiny_suite), "--tracking-uri", uri, "--device", "cpu", "--profile", "smoke",
                "--seeds", "0", "--only", "setting=iid", "--only", "method=local"]
        assert cli.main(argv) == 2
    finally:
        event.remove(Pool, "checkout", full)
    err = capsys.readouterr().err
    answer = [line for line in err.splitlines() if "pflbench:" in line]
    assert len(answer) == 1 and "no space left on device" in answer[0], err
    for text in ("sqlalche.me", "[SQL:", "Traceback", "database or disk is full"):
        assert text not in err, err
