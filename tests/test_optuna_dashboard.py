"""The Optuna dashboard (`make optuna-dashboard`, extra `dashboard`) serves a study made by `pflbench tune`,
with its name and the user attributes benchmarks/tuning.py sets; checked through the dashboard's own
WSGI app (the server `make optuna-dashboard` starts runs this app)."""
from __future__ import annotations

import io
import json
import subprocess
import sys
from pathlib import Path
from wsgiref.util import setup_testing_defaults

import pytest

from benchmarks.tuning import TuneOptions, tune
from conftest import free_port, store, tiny_suite_dict, wait_for, write_suite

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
    return optuna_dashboard.wsgi(storage), result, storage


def test_dashboard_lists_the_study_by_its_name(dashboard):
    app, result, _ = dashboard
    status, body = get(app, "/api/studies")
    assert status.startswith("200")
    studies = json.loads(body)["study_summaries"]
    assert [s["study_name"] for s in studies] == ["tiny/mini|setting=iid,method=fedavg|fedavg|smoke"]
    assert result.study_name == studies[0]["study_name"]


def test_dashboard_shows_the_tuning_user_attributes_and_trials(dashboard):
    app, result, _ = dashboard
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
    app, _, _ = dashboard
    status, body = get(app, "/dashboard")
    assert status.startswith("200") and b"<html" in body.lower()


def test_the_command_make_runs_serves_the_study(dashboard, tmp_path_factory):
    """`make optuna-dashboard` runs `optuna-dashboard sqlite:///... --host 127.0.0.1 --port PORT`."""
    _, result, storage = dashboard
    exe = Path(sys.executable).with_name("optuna-dashboard")
    if not exe.exists():
        pytest.skip(f"no {exe}")
    port = free_port()
    log = (tmp_path_factory.mktemp("dashlog") / "server.log").open("w")
    proc = subprocess.Popen([str(exe), storage, "--host", "127.0.0.1", "--port", str(port)],
                            stdout=log, stderr=subprocess.STDOUT)
    try:
        body = wait_for(f"http://127.0.0.1:{port}/api/studies", proc)
        assert [s["study_name"] for s in json.loads(body)["study_summaries"]] == [result.study_name]
    finally:
        proc.terminate()
        proc.wait(timeout=30)
