"""A fresh MLflow SQLite store in milliseconds: the tests' shortcut past MLflow's schema migrations.

Opening an empty SQLite file, MLflow runs its whole Alembic history (``_initialize_tables``: about
60 migrations, 3-5 s on a CI core). Hundreds of tests each open a store of their own under tmp_path,
so that fixed cost was minutes of every CI run. :func:`install` replaces ``_initialize_tables``, for
SQLite only and in the test process only, with the replay of a dump of the same schema, made once per
process by the real function (this MLflow version, so it cannot drift): the same tables, indexes and
``alembic_version`` row, so MLflow then opens the file as an up-to-date store. Subprocesses (``pflbench``
commands, ``mlflow server``) still migrate for real, and ``PFL_TEST_REAL_MIGRATIONS=1`` turns the
shortcut off. ``tests/test_mlflow_schema.py`` checks a shortcut store against a migrated one.
"""
from __future__ import annotations

import os
import sqlite3
import tempfile
from pathlib import Path

_script: str | None = None


def migrated_dump(initialize) -> str:
    """The SQL dump of an empty SQLite store that ``initialize`` (MLflow's own function) migrated."""
    from sqlalchemy import create_engine

    with tempfile.TemporaryDirectory(prefix="mlflow-schema-") as folder:
        path = Path(folder) / "mlflow.db"
        engine = create_engine(f"sqlite:///{path}")
        try:
            initialize(engine)
        finally:
            engine.dispose()
        with sqlite3.connect(path) as con:
            return "\n".join(con.iterdump())


def install() -> None:
    """Patch ``mlflow.store.db.utils._initialize_tables`` in this process (no-op when switched off)."""
    if os.environ.get("PFL_TEST_REAL_MIGRATIONS") == "1":
        return
    import mlflow.store.db.utils as db_utils

    real = db_utils._initialize_tables
    if getattr(real, "_pfl_shortcut", False):
        return

    def initialize(engine):
        global _script
        if engine.dialect.name != "sqlite":
            return real(engine)
        if _script is None:
            _script = migrated_dump(real)
        raw = engine.raw_connection()
        try:
            raw.driver_connection.executescript(_script)
        finally:
            raw.close()

    initialize._pfl_shortcut = True
    initialize.real = real
    db_utils._initialize_tables = initialize
