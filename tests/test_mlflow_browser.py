"""The MLflow UI in a real browser: a smoke sweep of the demo suite and a two-trial tuning study of
one of its cells, `mlflow server` on 127.0.0.1 and headless Chromium (system Chromium driven by the
`playwright` package; `make browser` installs it). What a researcher reads: short run names shown
whole, the sweep's runs nested under its parent run in the default view (the link `pflbench run`
prints), the trials nested under their study's run, each described.

Skipped when Playwright or Chromium is absent. ``PFL_CHROMIUM`` names another Chromium binary;
``PFL_UI_SCREENSHOTS=DIR`` saves the pages it checks as PNGs; ``PFL_UI_PROFILE=paper`` sweeps the
demo's default profile, the runs `make demo` makes (CI: ``smoke``; the study is tuned at ``smoke``
either way). reports/ui/*.png were made with
``PFL_UI_PROFILE=paper PFL_UI_SCREENSHOTS=reports/ui pytest tests/test_mlflow_browser.py``.
"""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from benchmarks.store import mlflow_ui as ui
from benchmarks.cli import main
from benchmarks.suite.spec import load_suite
from benchmarks.store.tracking import Tracker
from conftest import REPO_ROOT, free_port, wait_for

sync_api = pytest.importorskip("playwright.sync_api", reason="pip install -e '.[dev]' (playwright)")
CHROMIUM = Path(os.environ.get("PFL_CHROMIUM", "/usr/bin/chromium"))
if not CHROMIUM.exists():
    pytest.skip(f"no Chromium at {CHROMIUM} (`make browser`, or PFL_CHROMIUM=/path)", allow_module_level=True)

pytestmark = pytest.mark.slow
CHROMIUM_ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                 "--disable-background-networking", "--disable-component-update", "--disable-sync"]
"""Without the networking flags Chromium's own background connections are refused on a machine
without internet, which stalls page loads."""
WAIT_MS = 180_000  # a loaded 2-core machine renders the UI slowly
DEMO = REPO_ROOT / "suites" / "demo" / "offline.yaml"
PROFILE = os.environ.get("PFL_UI_PROFILE", "smoke")
TUNED_CELL = ("fedavg", "setting=synthetic-seen")  # the MLR cell: seconds per trial
NAME_CELL = '[col-id="attributes.`Run Name`"]'


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    """A store filled by `pflbench run suites/demo/offline.yaml --profile $PFL_UI_PROFILE` (smoke),
    served by `mlflow server`."""
    root = tmp_path_factory.mktemp("ui")
    uri = f"sqlite:///{root}/store/mlflow.db"
    (root / "store").mkdir()
    with pytest.MonkeyPatch.context() as mp:
        mp.delenv("MLFLOW_TRACKING_URI", raising=False)
        mp.chdir(root)
        assert main(["run", str(DEMO), "--profile", PROFILE, "--device", "cpu", "--tracking-uri", uri]) == 0
        assert main(["tune", str(DEMO), "--method", TUNED_CELL[0], "--cell", TUNED_CELL[1], "--trials", "2",
                     "--profile", "smoke", "--storage", f"sqlite:///{root}/optuna.db", "--tracking-uri", uri,
                     "--device", "cpu", "--no-write"]) == 0
    tracker = Tracker(uri)
    port = free_port()
    log = (root / "server.log").open("w")
    proc = subprocess.Popen([sys.executable, "-m", "mlflow", "server", "--backend-store-uri", uri, "--host", "127.0.0.1",
                             "--port", str(port), "--workers", "1"], stdout=log, stderr=subprocess.STDOUT, cwd=root)
    try:
        wait_for(f"http://127.0.0.1:{port}/health", proc)
        yield {"base": f"http://127.0.0.1:{port}", "tracker": tracker, "key": "demo/offline",
               "experiment": tracker.experiment_id("demo/offline", create=False),
               "tuning": tracker.experiment_id("demo/offline/tuning", create=False)}
    finally:
        proc.terminate()
        proc.wait(timeout=60)
        log.close()


@pytest.fixture(scope="module")
def page(tmp_path_factory):
    with sync_api.sync_playwright() as pw:
        context = pw.chromium.launch_persistent_context(
            str(tmp_path_factory.mktemp("chromium-profile")), executable_path=str(CHROMIUM), args=CHROMIUM_ARGS,
            headless=True, viewport={"width": 1600, "height": 1000})
        tab = context.new_page()
        tab.set_default_timeout(WAIT_MS)
        yield tab
        context.close()


def screenshot(page, name: str) -> None:
    folder = os.environ.get("PFL_UI_SCREENSHOTS")
    if folder:
        Path(folder).mkdir(parents=True, exist_ok=True)
        page.wait_for_timeout(3000)  # let the charts finish drawing
        page.screenshot(path=str(Path(folder) / name))


def open_page(page, url: str, ready: str) -> None:
    page.goto(url, wait_until="commit", timeout=WAIT_MS)
    page.get_by_text(ready, exact=True).first.wait_for()


def read_until(page, read, done, timeout_ms: int = 30_000):
    """``read()`` every 0.5 s until ``done`` holds for what it read, or the deadline; returns the last
    read. The UI draws in steps (rows, columns, charts) that take seconds on a loaded machine, so a
    fixed wait can read a half-drawn page (CI, stop 43); a wrong page still fails after the deadline."""
    waited = 0
    while True:
        value = read()
        if done(value) or waited >= timeout_ms:
            return value
        page.wait_for_timeout(500)
        waited += 500


def top_level_rows(page) -> list[str]:
    """The run ids of the table's rows (one list per row, the pinned left part)."""
    return page.locator(".ag-pinned-left-cols-container [row-id]").evaluate_all(
        "els => els.map(e => e.getAttribute('row-id'))")


def expand(page, parent_id: str, child_ids: list[str]) -> None:
    """Check that the runs table holds ``child_ids`` under the collapsed parent row ``parent_id``
    (the only top-level row), then open it: the children appear after it, indented."""
    page.locator(f'[row-id="{parent_id}"] {NAME_CELL}').first.wait_for()
    rows = read_until(page, lambda: top_level_rows(page), lambda r: r == [parent_id])
    assert rows == [parent_id]  # the children are nested, not listed beside it
    page.locator(f'.ag-pinned-left-cols-container [row-id="{parent_id}"] {NAME_CELL} button').click()  # its expander
    page.locator(f'[row-id="{child_ids[-1]}"]').first.wait_for()
    assert set(top_level_rows(page)) == {parent_id, *child_ids}
    assert top_level_rows(page)[0] == parent_id

    def name_x(run_id: str) -> float:
        return page.locator(f'[row-id="{run_id}"] {NAME_CELL} a[href*="{run_id}"]').first.bounding_box()["x"]

    assert all(name_x(c) > name_x(parent_id) + 10 for c in child_ids)  # indented under it


def shown_whole(page, run) -> None:
    """The run's name is in its row's name cell, not cut by an ellipsis."""
    link = page.locator(f'[row-id="{run.info.run_id}"] {NAME_CELL} a[href*="{run.info.run_id}"]').first
    assert link.inner_text() == run.data.tags["mlflow.runName"]
    assert link.evaluate("e => [...e.querySelectorAll('*'), e].every(x => x.scrollWidth <= x.clientWidth)"), \
        run.data.tags["mlflow.runName"]


def test_runs_table_nests_the_sweeps_short_named_runs_with_method_and_metric(served, page):
    tracker = served["tracker"]
    runs = tracker.runs(served["key"])
    (sweep,) = tracker.runs(served["key"], kind=ui.SWEEP)
    assert len(runs) == len(load_suite(DEMO).expand(PROFILE))  # 6 at smoke, 12 as `make demo`
    for run in runs:  # method first, the other cell labels, the seed; the whole cell in tags
        tags = run.data.tags
        assert tags["mlflow.runName"] == f"{tags['cell.method']} · {tags['cell.setting']} · s{tags['seed']}"
    open_page(page, ui.experiment_url(served["base"], served["experiment"]), sweep.data.tags["mlflow.runName"])
    assert "workflowType=machine_learning" in page.url
    # the UI renders only the columns that fit the window: the view puts the metric and method first
    headers = read_until(page, lambda: page.locator("[role=columnheader]").all_inner_texts(),
                         lambda h: {"Run Name", "acc_last3", "method"} <= set(h))
    assert {"Run Name", "acc_last3", "method"} <= set(headers), headers
    expand(page, sweep.info.run_id, [r.info.run_id for r in runs])
    for run in [*runs, sweep]:
        cells = page.locator(f'[row-id="{run.info.run_id}"]')
        text = " | ".join(cells.all_inner_texts())
        shown_whole(page, run)
        if run is not sweep:
            assert f"| {run.data.tags['method']}" in text.replace("\n", " | ")
            value = run.data.metrics["acc_last3"]  # the metric column, as MLflow prints it (1.0 as "1")
            assert repr(value) in text or (value.is_integer() and f"\n{int(value)}\n" in text), text
            assert run.data.tags["cell"] in text
    body = page.inner_text("body")
    assert "pflbench: results" in body  # the saved view is the one shown
    assert "No data available" not in body  # not the GenAI overview
    screenshot(page, "experiment.png")


def test_tuning_trials_nest_under_their_study_with_a_description(served, page):
    tracker = served["tracker"]
    trials = sorted(tracker.runs("demo/offline/tuning", status=None), key=lambda r: int(r.data.tags["trial"]))
    (study,) = tracker.runs("demo/offline/tuning", status=None, kind=ui.STUDY)
    assert len(trials) == 2 and study.data.tags["mlflow.runName"] == "study fedavg · synthetic-seen"
    open_page(page, ui.experiment_url(served["base"], served["tuning"]), study.data.tags["mlflow.runName"])
    expand(page, study.info.run_id, [r.info.run_id for r in trials])
    for run in [study, *trials]:
        shown_whole(page, run)
    screenshot(page, "tuning.png")
    trial = trials[-1]
    open_page(page, ui.run_url(served["base"], served["tuning"], trial.info.run_id, tab=None),
              trial.data.tags["mlflow.runName"])
    note = trial.data.tags[ui.NOTE_TAG]
    first = note.splitlines()[0]
    assert first.startswith(f"fedavg | setting=synthetic-seen,method=fedavg | trial {trial.data.tags['trial']}: ")
    page.get_by_text(first).first.wait_for()
    page.get_by_text(study.data.tags["mlflow.runName"], exact=True).first.wait_for()  # "Parent run", fetched late
    body = page.inner_text("body")
    assert "method.params.lr" in body and "maximise" in body  # its parameters and the objective
    screenshot(page, "trial-overview.png")


def plotted(traces: list[dict], history) -> bool:
    """Whether one plotted line is the logged history, step by step."""
    xs, ys = [m.step for m in history], [m.value for m in history]
    return any(t["x"] == xs and t["y"] == pytest.approx(ys) for t in traces)


def plotted_until(page, history, timeout_ms: int = 60_000) -> list[dict]:
    """The page's plotly traces once one of them is `history`, or at the deadline. The UI first draws a
    metric's latest value as a one-bar chart and the line once its history has arrived, which takes
    seconds on a loaded machine (a fixed 3 s wait once read the bar: CI, stop 43)."""
    return read_until(page, lambda: page.locator(".js-plotly-plot").evaluate_all(
        "els => els.flatMap(e => (e.data || []).map(t => ({x: t.x, y: t.y})))"),
        lambda traces: plotted(traces, history), timeout_ms)


def test_run_page_plots_the_fine_tuning_and_round_curves(served, page):
    tracker = served["tracker"]
    run = min((r for r in tracker.runs(served["key"])  # its first seed (the demo's default profile has two)
               if r.data.tags["method"] == "fedavg_ft" and r.data.tags["cell.setting"] == "digits28-unseen"),
              key=lambda r: int(r.data.tags["seed"]))
    curve = tracker.client.get_metric_history(run.info.run_id, "curve/acc")
    losses = tracker.client.get_metric_history(run.info.run_id, "round/train_loss")
    if PROFILE == "smoke":
        assert len(curve) == 3 and len(losses) == 2  # smoke: fine-tuning steps 0..2, rounds 1..2
    assert len(curve) >= 3 and len(losses) >= 2
    open_page(page, ui.run_url(served["base"], served["experiment"], run.info.run_id), "curve")
    page.locator(".js-plotly-plot").first.wait_for()
    traces = plotted_until(page, curve)
    assert plotted(traces, curve), traces
    page.get_by_placeholder("Search metric charts").fill("train_loss")  # round/train_loss is below the fold
    traces = plotted_until(page, losses)
    assert plotted(traces, losses), traces
    page.get_by_placeholder("Search metric charts").fill("")
    page.locator(".js-plotly-plot").first.wait_for()
    screenshot(page, "run-metrics.png")


def test_run_overview_shows_description_and_command(served, page):
    tracker = served["tracker"]
    run = tracker.runs(served["key"])[0]
    open_page(page, ui.run_url(served["base"], served["experiment"], run.info.run_id, tab=None),
              run.data.tags["mlflow.runName"])
    page.get_by_text(run.data.tags[ui.NOTE_TAG]).first.wait_for()
    body = page.inner_text("body")
    assert run.data.tags[ui.NOTE_TAG] in body  # paper, table, cell, seed, profile
    command = run.data.tags[ui.SOURCE_NAME_TAG]
    assert command.startswith("pflbench run ") and str(DEMO) in command
    assert command in body
    (sweep,) = tracker.runs(served["key"], kind=ui.SWEEP)
    page.get_by_text(sweep.data.tags["mlflow.runName"], exact=True).first.wait_for()  # its "Parent run"
    screenshot(page, "run-overview.png")
