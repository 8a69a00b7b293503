"""The tests' fresh-store shortcut (tests/mlflow_schema.py) gives the store MLflow's migrations give."""
from __future__ import annotations

import sqlite3

import mlflow.store.db.utils as db_utils
from mlflow.tracking import MlflowClient

import mlflow_schema


def clauses(sql: str | None) -> list[str]:
    """A CREATE statement's lines, each without its trailing comma, sorted: Alembic's batch mode
    rebuilds a table with its CHECK constraints in set order, so two real migrations can differ in
    clause order alone."""
    return sorted(line.strip().rstrip(",").strip() for line in (sql or "").splitlines())


def schema(path) -> tuple[list, list]:
    """(every table, index and trigger with its SQL clauses; the alembic_version rows) of a SQLite file."""
    with sqlite3.connect(path) as con:
        rows = con.execute("SELECT type, name, sql FROM sqlite_master ORDER BY type, name").fetchall()
        version = con.execute("SELECT * FROM alembic_version").fetchall()
    return [(kind, name, clauses(sql)) for kind, name, sql in rows], version


def test_shortcut_store_matches_a_migrated_one(tmp_path, monkeypatch):
    """The conftest installs the shortcut; a store opened through it has the very schema and Alembic
    head of one MLflow migrates itself, and MLflow uses it as a store (default experiment, a run)."""
    assert getattr(db_utils._initialize_tables, "_pfl_shortcut", False), "conftest did not install it"
    fast, real = tmp_path / "fast.db", tmp_path / "real.db"
    client = MlflowClient(tracking_uri=f"sqlite:///{fast}")
    experiment = client.create_experiment("x", artifact_location=str(tmp_path / "art"))
    run = client.create_run(experiment)
    client.log_metric(run.info.run_id, "acc", 0.5)
    assert client.get_metric_history(run.info.run_id, "acc")[0].value == 0.5
    assert [e.name for e in client.search_experiments()] == ["x", "Default"]

    monkeypatch.setattr(db_utils, "_initialize_tables", db_utils._initialize_tables.real)
    MlflowClient(tracking_uri=f"sqlite:///{real}").search_experiments()
    fast_objects, fast_version = schema(fast)
    real_objects, real_version = schema(real)
    assert fast_version == real_version and len(real_version) == 1
    assert fast_objects == real_objects and len(real_objects) > 20


def test_dump_is_of_the_function_given(tmp_path):
    """migrated_dump runs the function it is given on an empty file: a planted one-table 'migration'
    gives a one-table dump (so the shortcut replays whatever MLflow's own function made)."""
    from sqlalchemy import text

    def initialize(engine):
        with engine.begin() as con:
            con.execute(text("CREATE TABLE alembic_version (version_num VARCHAR(32) NOT NULL)"))
            con.execute(text("INSERT INTO alembic_version VALUES ('abc')"))

    dump = mlflow_schema.migrated_dump(initialize)
    assert "CREATE TABLE alembic_version" in dump and "'abc'" in dump and "experiments" not in dump
