"""The Optuna dashboard (`make optuna-dashboard`, extra `dashboard`) serves a study made by `pflbench tune`,
with its name and the user attributes benchmarks/tuning/tune.py sets; checked through the dashboard's own
WSGI app (the server `make optuna-dashboard` starts runs this app)."""
from __future__ import annotations

import io
import json
import os
import shutil
import signal
import subprocess
import sys
from contextlib import contextmanager
from pathlib import Path
from wsgiref.util import setup_testing_defaults

import pytest

from benchmarks.tuning.tune import tune
from benchmarks.tuning.study import TuneOptions
from conftest import REPO_ROOT, free_port, store, tiny_suite_dict, wait_for, write_suite

pytestmark = pytest.mark.slow  # `optuna-dashboard` and `make` servers in subprocesses

optuna_dashboard = pytest.importorskip("optuna_dashboard", reason="pip install -e '.[dashboard]'")


def get(app, path: str) -> tuple[str, bytes]:
    environ = {"PATH_INFO": path, "REQUEST_METHOD": "GET", "wsgi.input": io.BytesIO()}
    setup_testing_defaults(environ)
    status = []
    body = b"".join(app(environ, lambda s, headers, exc=None: status.append(s)))
    return status[0], body


@pytest.fixture(scope="module")
def dashboard(tmp_path_factory):
    root = tmp_path_factory.mktemp("dashboard")
    data = tiny_suite_dict()
    data["base"]["federation"]["batch_size"] = 100  # one batch per local epoch
    suite = write_suite(root / "suites" / "tiny" / "mini.yaml", data)
    storage = f"sqlite:///{root}/optuna.db"
    uri, _ = store(root / "mlflow")
    opts = TuneOptions(profile="smoke", trials=2, storage=storage, seeds=(1000,), device="cpu",
                       tracking_uri=uri, echo=None, write=False)
    (result,) = tune(suite, ["fedavg"], {"setting": ["iid"]}, opts)
    return optuna_dashboard.wsgi(storage), result, storage, uri


def test_dashboard_lists_the_study_by_its_name(dashboard):
    app, result, _, _ = dashboard
    status, body = get(app, "/api/studies")
    assert status.startswith("200")
    studies = json.loads(body)["study_summaries"]
    assert [s["study_name"] for s in studies] == ["tiny/mini|setting=iid,method=fedavg|fedavg|smoke"]
    assert result.study_name == studies[0]["study_name"]


def test_dashboard_shows_the_tuning_user_attributes_and_trials(dashboard):
    app, result, _, _ = dashboard
    study_id = json.loads(get(app, "/api/studies")[1])["study_summaries"][0]["study_id"]
    status, body = get(app, f"/api/studies/{study_id}")
    assert status.startswith("200")
    detail = json.loads(body)
    attrs = {a["key"]: a["value"] for a in detail["user_attrs"]}
    assert {"objective", "suite", "cell", "method", "profile", "budget", "budget_history", "created"} <= set(attrs)
    assert (attrs["suite"], attrs["cell"], attrs["method"], attrs["profile"]) == \
        ("tiny/mini", "setting=iid,method=fedavg", "fedavg", "smoke")
    assert '"n_trials": 2' in attrs["budget"]
    assert len(detail["trials"]) == 2
    params = {p["name"] for t in detail["trials"] for p in t["params"]}
    assert "method.params.lr" in params
    finished = [t for t in detail["trials"] if t["state"] == "Complete"]
    assert {a["key"] for a in finished[0]["user_attrs"]} >= {"seed_values"}


def test_dashboard_page_is_served(dashboard):
    app, _, _, _ = dashboard
    status, body = get(app, "/dashboard")
    assert status.startswith("200") and b"<html" in body.lower()


def test_tuning_experiment_opens_as_model_training_with_its_view(dashboard):
    """The MLflow experiment of the trials (`<suite>/tuning`) is tagged and described like a suite's."""
    from benchmarks.store import mlflow_ui as ui
    from benchmarks.store.tracking import Tracker

    *_, uri = dashboard
    tracker = Tracker(uri)
    exp = tracker.client.get_experiment(tracker.experiment_id("tiny/mini/tuning", create=False))
    assert exp.tags[ui.EXPERIMENT_KIND_TAG] == ui.TRAINING_KIND
    assert exp.tags[ui.NOTE_TAG].startswith("**tiny/mini/tuning**")
    state = json.loads(json.loads(exp.tags[ui.SAVED_VIEW_PREFIX + ui.VIEW_ID])["state"])
    assert state["selectedColumns"][:3] == ["metrics.`value`", "tags.`method`", "tags.`cell`"]
    assert len(tracker.runs("tiny/mini/tuning", status=None)) == 2  # one run per trial


@contextmanager
def make_optuna_dashboard(db: Path, log_dir: Path):
    """`make optuna-dashboard` on study store ``db`` and a free port (the venv of this interpreter;
    ``STAMP=`` skips the install step, which `make setup` covers); yields the dashboard's URL."""
    if shutil.which("make") is None:
        pytest.skip("no make")
    venv = Path(sys.executable).parent.parent
    port = free_port()
    log = (log_dir / "make.log").open("w")
    proc = subprocess.Popen(["make", "-C", str(REPO_ROOT), "optuna-dashboard", "STAMP=", f"VENV={venv}",
                             f"PORT={port}", f"OPTUNA_DB={db}"], stdout=log, stderr=subprocess.STDOUT,
                            start_new_session=True)
    try:
        yield f"http://127.0.0.1:{port}", proc
    finally:
        os.killpg(proc.pid, signal.SIGTERM)  # make and the dashboard it started
        proc.wait(timeout=30)
        log.close()


def test_make_optuna_dashboard_serves_the_study(dashboard, tmp_path):
    _, result, storage, _ = dashboard
    with make_optuna_dashboard(Path(storage[len("sqlite:///"):]), tmp_path) as (url, proc):
        body = wait_for(f"{url}/api/studies", proc)
    assert [s["study_name"] for s in json.loads(body)["study_summaries"]] == [result.study_name]


def test_make_optuna_dashboard_on_a_fresh_machine_without_studies(tmp_path):
    db = tmp_path / "results" / "optuna.db"  # neither the folder nor the file exists yet
    with make_optuna_dashboard(db, tmp_path) as (url, proc):
        body = wait_for(f"{url}/api/studies", proc)
    assert json.loads(body)["study_summaries"] == []
