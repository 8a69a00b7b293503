"""Reports rendered from a real MLflow store filled by a smoke sweep."""
from __future__ import annotations

import math

import numpy as np
import pandas as pd
import pytest
from mlflow.tracking import MlflowClient

import benchmarks.runner as runner
from benchmarks.report import spread, write_report
from benchmarks.runner import run_sweep
from benchmarks.suite import cell_id, load_suite
from benchmarks.tracking import Tracker
from pfl_core.federation import DivergenceError
from conftest import store, tiny_suite_dict, write_suite

FAIL_CELL = {"setting": "iid", "method": "fedavg_ft"}
FAIL_SEED = 1
EXPECTED_COLUMNS = ["setting", "method", "n_seeds", "expected_seeds", "failed", "mean", "std", "pm",
                    "published_mean", "published_pm", "published_pm_kind", "published_source", "diff",
                    "failure_reason", "profile", "metric"]


def quiet(*_args, **_kwargs):
    pass


@pytest.fixture(scope="module")
def reported(tmp_path_factory):
    """Smoke sweep of the tiny suite (one run made to diverge), then its report."""
    root = tmp_path_factory.mktemp("report")
    real = runner.run_experiment

    def one_fails(cfg, **kwargs):
        if (cfg.method.name, cfg.data.partition["name"], cfg.seed) == ("fedavg_ft", "iid", FAIL_SEED):
            raise DivergenceError("injected: non-finite training loss (nan) in round 1")
        return real(cfg, **kwargs)

    with pytest.MonkeyPatch.context() as mp:
        mp.delenv("MLFLOW_TRACKING_URI", raising=False)
        mp.chdir(root)
        mp.setattr(runner, "run_experiment", one_fails)
        path = write_suite(root / "mini.yaml", tiny_suite_dict())
        suite = load_suite(path)
        uri, art = store(root / "store")
        tracker = Tracker(uri, art)
        summary = run_sweep(suite, suite.expand("smoke"), tracker, device="cpu", echo=quiet)
        md, csv, table = write_report(suite, tracker, "smoke", out_dir=root / "reports")
    assert summary.failed == 1
    return {"root": root, "path": path, "suite": suite, "tracker": tracker, "uri": uri,
            "md": md, "csv": csv, "table": table, "text": md.read_text(), "frame": pd.read_csv(csv)}


@pytest.fixture(autouse=True)
def _isolated(isolated):
    return isolated


def md_rows(text: str, n_axes: int = 2) -> dict[tuple, list[str]]:
    """Table rows of the report keyed by their axis labels."""
    rows = {}
    lines = text.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith("| setting | method |"))
    for line in lines[start + 2:]:
        if not line.startswith("|"):
            break
        cells = [c.strip() for c in line.strip("|").split("|")]
        assert tuple(cells[:n_axes]) not in rows, f"duplicate row {line}"
        rows[tuple(cells[:n_axes])] = cells[n_axes:]
    return rows


def mlflow_values(uri: str, suite, profile: str) -> dict[str, list[float]]:
    """metric x scale of the FINISHED runs of ``profile``, per cell, read straight from MLflow."""
    client = MlflowClient(tracking_uri=uri)
    exp = client.get_experiment_by_name(suite.key)
    runs = client.search_runs([exp.experiment_id],
                              f"tags.profile = '{profile}' and attributes.status = 'FINISHED'")
    values: dict[str, list[float]] = {}
    for run in runs:
        values.setdefault(run.data.tags["cell"], []).append(
            run.data.metrics[suite.metric["key"]] * suite.metric["scale"])
    return values


def test_report_files_written_under_out_dir(reported):
    suite = reported["suite"]
    assert reported["md"] == reported["root"] / "reports" / suite.paper / f"{suite.name}.md"
    assert reported["csv"] == reported["root"] / "reports" / suite.paper / f"{suite.name}.csv"
    assert reported["md"].is_file() and reported["csv"].is_file()


def test_markdown_header_caption_and_notice(reported):
    suite, text = reported["suite"], reported["text"]
    assert text.startswith(f"# {suite.raw['table']} ({suite.key})")
    assert suite.raw["caption"].strip() in text
    notice = [line for line in text.splitlines() if "Not comparable" in line]
    assert len(notice) == 1
    assert "`smoke` profile" in notice[0] and "offline data" in notice[0]
    assert f"`{suite.metric['key']}`" in text and suite.metric["label"] in text
    assert f"ddof={suite.metric['ddof']}" in text


def test_markdown_one_row_per_cell_with_seed_counts(reported):
    suite = reported["suite"]
    rows = md_rows(reported["text"])
    assert set(rows) == {tuple(c.values()) for c in suite.cells()}
    n = len(tiny_suite_dict()["profiles"]["smoke"]["seeds"])
    for key, cells in rows.items():
        if key == tuple(FAIL_CELL.values()):
            assert cells[0] == f"{n - 1}/{n} (1 failed)"
        else:
            assert cells[0] == f"{n}/{n}"


def test_csv_columns_and_means_match_mlflow(reported):
    suite, frame = reported["suite"], reported["frame"]
    assert list(frame.columns) == EXPECTED_COLUMNS
    assert len(frame) == len(suite.cells())
    assert set(frame["profile"]) == {"smoke"} and set(frame["metric"]) == {suite.metric["key"]}
    values = mlflow_values(reported["uri"], suite, "smoke")
    for _, row in frame.iterrows():
        key = cell_id({"setting": row["setting"], "method": row["method"]})
        mine = values[key]
        assert row["n_seeds"] == len(mine)
        assert row["expected_seeds"] == len(tiny_suite_dict()["profiles"]["smoke"]["seeds"])
        assert row["mean"] == pytest.approx(np.mean(mine))
        assert 0 <= row["mean"] <= suite.metric["scale"]


def test_spread_convention_matches_numpy(reported, tmp_path):
    suite, frame = reported["suite"], reported["frame"]
    values = mlflow_values(reported["uri"], suite, "smoke")
    ddof = suite.metric["ddof"]
    checked = 0
    for _, row in frame.iterrows():
        mine = np.array(values[cell_id({"setting": row["setting"], "method": row["method"]})])
        if len(mine) < 2:
            assert math.isnan(row["pm"]) and math.isnan(row["std"])
            continue
        assert row["std"] == pytest.approx(np.std(mine, ddof=1))
        assert row["pm"] == pytest.approx(np.std(mine, ddof=ddof))
        checked += 1
    assert checked >= len(suite.cells()) - 1
    # the same store under an SEM (ddof=1) convention: same experiment, same config hashes
    data = tiny_suite_dict()
    data["metric"].update(pm="sem", ddof=1)
    sem_suite = load_suite(write_suite(tmp_path / "sem.yaml", data))
    _, _, table = write_report(sem_suite, reported["tracker"], "smoke", out_dir=tmp_path / "sem")
    for _, row in table.iterrows():
        mine = np.array(values[cell_id({"setting": row["setting"], "method": row["method"]})])
        if len(mine) >= 2:
            assert row["pm"] == pytest.approx(np.std(mine, ddof=1) / np.sqrt(len(mine)))
    assert "mean ± sem (ddof=1)" in (tmp_path / "sem" / "tiny" / "mini.md").read_text()


def test_spread_helper_edge_cases():
    values = pd.Series([1.0, 2.0, 4.0])
    assert spread(values, "std", 0) == pytest.approx(np.std(values.to_numpy(), ddof=0))
    assert spread(values, "sem", 1) == pytest.approx(np.std(values.to_numpy(), ddof=1) / np.sqrt(3))
    assert math.isnan(spread(values, "none", 0))
    assert math.isnan(spread(pd.Series([3.0]), "std", 0))


def test_published_values_and_signed_differences(reported):
    suite, frame = reported["suite"], reported["frame"]
    rows = md_rows(reported["text"])
    published = {tuple(p["cell"][a.name] for a in suite.axes): p for p in suite.published}
    assert published
    for _, row in frame.iterrows():
        key = (row["setting"], row["method"])
        ours, paper, diff = rows[key][1:4]
        assert ours.startswith(f"{row['mean']:.2f}")
        if key in published:
            pub = published[key]
            assert row["published_mean"] == pub["mean"]
            assert row["published_pm"] == pub["pm"]
            assert row["published_source"] == pub["source"]
            assert row["diff"] == pytest.approx(row["mean"] - pub["mean"])
            assert paper == f"{pub['mean']:.2f} ± {pub['pm']:.2f}"
            expected = row["mean"] - pub["mean"]
            assert diff == f"{expected:+.2f}"
            assert diff[0] in "+-"
        else:
            assert math.isnan(row["published_mean"]) and math.isnan(row["diff"])
            assert paper == "—" and diff == "—"


def test_failed_run_counted_with_reason(reported):
    frame, text = reported["frame"], reported["text"]
    failed = frame[frame["failed"] > 0]
    assert list(zip(failed["setting"], failed["method"])) == [tuple(FAIL_CELL.values())]
    assert failed.iloc[0]["failed"] == 1
    assert "injected" in failed.iloc[0]["failure_reason"] and "diverged" in failed.iloc[0]["failure_reason"]
    assert (frame.loc[frame["failed"] == 0, "failure_reason"].fillna("") == "").all()
    assert "Failed runs:" in text
    assert f"- {FAIL_CELL['setting']}/{FAIL_CELL['method']}: diverged: injected" in text


def test_report_of_a_profile_without_runs(reported, tmp_path):
    _, _, table = write_report(reported["suite"], reported["tracker"], "paper", out_dir=tmp_path)
    assert (table["n_seeds"] == 0).all() and table["mean"].isna().all()
    text = (tmp_path / "tiny" / "mini.md").read_text()
    n = len(tiny_suite_dict()["seeds"])
    assert all(cells[0] == f"0/{n}" and cells[1] == "—" for cells in md_rows(text).values())


def test_rerun_after_failure_replaces_the_failed_run(tmp_path, tiny_suite, monkeypatch):
    suite = load_suite(tiny_suite)
    specs = suite.expand("smoke", only={"setting": ["iid"], "method": ["local"]})
    tracker = Tracker(*store(tmp_path / "store"))
    real = runner.run_experiment

    def seed1_fails(cfg, **kwargs):
        if cfg.seed == 1:
            raise DivergenceError("injected")
        return real(cfg, **kwargs)

    monkeypatch.setattr(runner, "run_experiment", seed1_fails)
    run_sweep(suite, specs, tracker, device="cpu", echo=quiet)
    _, _, before = write_report(suite, tracker, "smoke", out_dir=tmp_path / "r1")
    row = before[(before["setting"] == "iid") & (before["method"] == "local")].iloc[0]
    assert (row["n_seeds"], row["failed"]) == (len(specs) - 1, 1)

    monkeypatch.setattr(runner, "run_experiment", real)
    run_sweep(suite, specs, tracker, device="cpu", echo=quiet)
    _, _, after = write_report(suite, tracker, "smoke", out_dir=tmp_path / "r2")
    row = after[(after["setting"] == "iid") & (after["method"] == "local")].iloc[0]
    assert (row["n_seeds"], row["failed"], row["failure_reason"]) == (len(specs), 0, "")
    values = mlflow_values(tracker.uri, suite, "smoke")["setting=iid,method=local"]
    assert row["mean"] == pytest.approx(np.mean(values))


def test_report_ignores_runs_of_an_edited_suite(tmp_path, suite_data):
    only = {"setting": ["iid"], "method": ["fedavg"]}
    tracker = Tracker(*store(tmp_path / "store"))
    old = load_suite(write_suite(tmp_path / "v1.yaml", suite_data))
    run_sweep(old, old.expand("smoke", only=only), tracker, device="cpu", echo=quiet)
    suite_data["base"]["method"]["params"]["lr"] = 0.2  # the suite is edited: same paper/name
    new = load_suite(write_suite(tmp_path / "v2.yaml", suite_data))
    new_specs = new.expand("smoke", only=only)
    run_sweep(new, new_specs, tracker, device="cpu", echo=quiet)
    _, _, table = write_report(new, tracker, "smoke", out_dir=tmp_path / "rep")
    row = table[(table["setting"] == "iid") & (table["method"] == "fedavg")].iloc[0]
    current = {s.config_hash for s in new_specs}
    values = [r.data.metrics["acc_last3"] * 100 for r in tracker.runs(new.key)
              if r.data.tags["config_hash"] in current]
    assert row["n_seeds"] == len(new_specs)
    assert row["mean"] == pytest.approx(np.mean(values))


def test_report_counts_runs_shared_with_another_profile(tmp_path, suite_data):
    suite_data["profiles"]["fewer"] = {"seeds": [0]}  # same configs as `paper`, fewer seeds
    suite = load_suite(write_suite(tmp_path / "s.yaml", suite_data))
    only = {"setting": ["iid"], "method": ["local"]}
    tracker = Tracker(*store(tmp_path / "store"))
    run_sweep(suite, suite.expand("fewer", only=only), tracker, device="cpu", echo=quiet)
    paper = suite.expand("paper", only=only)
    summary = run_sweep(suite, paper, tracker, device="cpu", echo=quiet)
    assert summary.skipped == 1  # seed 0 is reused: identical config
    _, _, table = write_report(suite, tracker, "paper", out_dir=tmp_path / "rep")
    row = table[(table["setting"] == "iid") & (table["method"] == "local")].iloc[0]
    assert row["n_seeds"] == len(paper)


def test_published_cell_key_order_does_not_matter(tmp_path, suite_data, reported):
    suite_data["published"] = [{"cell": {"method": "fedavg", "setting": "dir"}, "mean": 50.0}]
    suite = load_suite(write_suite(tmp_path / "order.yaml", suite_data))
    _, _, table = write_report(suite, reported["tracker"], "smoke", out_dir=tmp_path / "rep")
    row = table[(table["setting"] == "dir") & (table["method"] == "fedavg")].iloc[0]
    assert row["published_mean"] == 50.0
