"""Reuse across suites (issue 25, item 3) on a real MLflow SQLite store: two tiny suites share one
cell; the second sweep computes only its new cell and its report holds the reused one."""
from __future__ import annotations

import copy

import pytest

import benchmarks.running.sweep as runner
from benchmarks.reporting.table import build_suite_report
from benchmarks.reporting.text import render_markdown
from benchmarks.store.reuse import REUSED_TAG, SOURCE_EXPERIMENT, SOURCE_EXPERIMENT_ID, SOURCE_RUN
from benchmarks.running.sweep import run_sweep
from benchmarks.suite.spec import load_suite
from benchmarks.store.tracking import Tracker, flatten
from conftest import store, tiny_suite_dict, write_suite

SOURCE_GIT = ("1111111111111111111111111111111111111111", False)
LATER_GIT = ("2222222222222222222222222222222222222222", True)


def quiet(*_args, **_kwargs):
    pass


def suite_file(root, name: str, methods: list[str]):
    """The tiny suite cut to one setting (dir), one seed and ``methods`` (2 rounds, MLR, digits28)."""
    data = copy.deepcopy(tiny_suite_dict())
    data["name"] = name
    data["grid"][0]["values"] = data["grid"][0]["values"][:1]
    data["grid"][1]["values"] = methods
    data["profiles"]["smoke"]["seeds"] = [0]
    data["published"] = [p for p in data["published"] if p["cell"] == {"setting": "dir", "method": "fedavg"}
                         and "fedavg" in methods]
    return load_suite(write_suite(root / f"{name}.yaml", data))


@pytest.fixture(scope="module")
def shared(tmp_path_factory):
    """Suite A (local, fedavg) swept, then suite B (fedavg, fedavg_ft) with reuse, counting the
    runs each sweep computes."""
    root = tmp_path_factory.mktemp("reuse")
    computed: list[str] = []
    real = runner.execute_specs

    def counting(specs, *args):
        computed.extend(f"{s.suite}:{s.cell_id}" for s in specs)
        return real(specs, *args)

    with pytest.MonkeyPatch.context() as mp:
        mp.delenv("MLFLOW_TRACKING_URI", raising=False)
        mp.chdir(root)
        mp.setattr(runner, "execute_specs", counting)
        tracker = Tracker(*store(root / "store"))
        a, b = suite_file(root, "a", ["local", "fedavg"]), suite_file(root, "b", ["fedavg", "fedavg_ft"])
        mp.setattr(runner, "git_state", lambda: SOURCE_GIT)
        first = run_sweep(a, a.expand("smoke"), tracker, device="cpu", echo=quiet)
        computed_a = list(computed)
        mp.setattr(runner, "git_state", lambda: LATER_GIT)
        second = run_sweep(b, b.expand("smoke"), tracker, device="cpu", echo=quiet)
    return {"tracker": tracker, "a": a, "b": b, "first": first, "second": second, "root": root,
            "computed_a": computed_a, "computed_b": computed[len(computed_a):]}


@pytest.fixture(autouse=True)
def _isolated(isolated):
    return isolated


def by_method(tracker: Tracker, suite) -> dict:
    return {r.data.tags["method"]: r for r in tracker.runs(suite.key)}


def test_second_suite_computes_only_its_new_cell(shared):
    a, b = shared["a"], shared["b"]
    assert shared["computed_a"] == [f"{a.key}:setting=dir,method=local", f"{a.key}:setting=dir,method=fedavg"]
    assert shared["computed_b"] == [f"{b.key}:setting=dir,method=fedavg_ft"]
    second = shared["second"]
    assert (second.total, second.skipped, second.finished, second.failed, second.reused) == (2, 0, 1, 0, 1)
    sweep = shared["tracker"].client.get_run(second.parent_run_id)
    assert sweep.data.metrics["runs_reused"] == 1 and sweep.data.metrics["runs_finished"] == 1


def test_reused_run_holds_the_source_results_and_names_it(shared):
    tracker, a, b = shared["tracker"], shared["a"], shared["b"]
    source, copy_ = by_method(tracker, a)["fedavg"], by_method(tracker, b)["fedavg"]
    assert copy_.info.experiment_id == tracker.experiment_id(b.key) != source.info.experiment_id
    tags = copy_.data.tags
    assert tags[SOURCE_RUN] == source.info.run_id
    assert tags[SOURCE_EXPERIMENT] == a.key
    assert tags[SOURCE_EXPERIMENT_ID] == source.info.experiment_id
    assert tags[REUSED_TAG] == "true"
    # this suite's identity, the source's computation
    assert (tags["suite"], tags["cell"], tags["cell.method"]) == (b.key, "setting=dir,method=fedavg", "fedavg")
    assert tags["config_hash"] == source.data.tags["config_hash"]
    assert tags["mlflow.parentRunId"] == shared["second"].parent_run_id
    assert (tags["git_commit"], tags["git_dirty"]) == (SOURCE_GIT[0], "false")
    for key in ("device", "partition_digest", "sampling_digest", "execution", "torch_threads", "offline_data"):
        assert tags[key] == source.data.tags[key], key
    assert copy_.data.metrics == source.data.metrics
    client = tracker.client
    for key in ("round/train_loss", "curve/acc"):
        history = sorted((m.step, m.value) for m in client.get_metric_history(copy_.info.run_id, key))
        assert history == sorted((m.step, m.value) for m in client.get_metric_history(source.info.run_id, key))
        assert history
    assert len(client.get_metric_history(copy_.info.run_id, "round/train_loss")) == 2  # both rounds
    spec = next(s for s in b.expand("smoke") if s.method == "fedavg")
    assert copy_.data.params == flatten(spec.config)
    names = lambda run: sorted(f.path for f in client.list_artifacts(run.info.run_id))  # noqa: E731
    assert names(copy_) == names(source) and "run_info.json" in names(copy_)


def test_report_of_the_second_suite_holds_the_reused_cell(shared):
    tracker, a, b = shared["tracker"], shared["a"], shared["b"]
    ours = build_suite_report(b, tracker, "smoke")
    source = build_suite_report(a, tracker, "smoke")
    runs = ours.runs.set_index("cell")
    assert set(runs.index) == {"setting=dir,method=fedavg", "setting=dir,method=fedavg_ft"}
    reused = runs.loc["setting=dir,method=fedavg"]
    assert reused["status"] == "FINISHED"
    assert reused["reused_from"] == by_method(tracker, a)["fedavg"].info.run_id
    assert reused["reused_from_experiment"] == a.key
    assert reused["value"] == source.runs.set_index("cell").loc["setting=dir,method=fedavg", "value"]
    assert runs.loc["setting=dir,method=fedavg_ft", "reused_from"] == ""
    text = render_markdown(ours)
    assert "**reused**: 1 of 2 runs" in text and f"1 from `{a.key}` (setting=dir,method=fedavg seed 0)" in text
    assert "**reused**" not in render_markdown(source)


def test_a_copy_of_a_copy_names_the_original_and_nothing_is_computed(shared, monkeypatch):
    """With the original deleted, suite C finds only suite B's copy: its provenance is A's run."""
    tracker, a = shared["tracker"], shared["a"]
    original = by_method(tracker, a)["fedavg"].info.run_id
    c = suite_file(shared["root"], "c", ["fedavg"])
    monkeypatch.setattr(runner, "execute_specs", lambda *_: pytest.fail("a reused run was computed"))
    tracker.client.delete_run(original)
    try:
        summary = run_sweep(c, c.expand("smoke"), tracker, device="cpu", echo=quiet)
    finally:
        tracker.client.restore_run(original)
    assert (summary.finished, summary.reused) == (0, 1)
    tags = by_method(tracker, c)["fedavg"].data.tags
    assert (tags[SOURCE_RUN], tags[SOURCE_EXPERIMENT]) == (original, a.key)


def test_no_reuse_computes_again(shared):
    tracker = shared["tracker"]
    d = suite_file(shared["root"], "d", ["fedavg"])
    summary = run_sweep(d, d.expand("smoke"), tracker, device="cpu", echo=quiet, reuse=False)
    assert (summary.finished, summary.reused) == (1, 0)
    run = by_method(tracker, d)["fedavg"]
    assert SOURCE_RUN not in run.data.tags and REUSED_TAG not in run.data.tags
    # deterministic: the recomputed run gives the reused numbers
    assert run.data.metrics["acc_last3"] == by_method(tracker, shared["a"])["fedavg"].data.metrics["acc_last3"]
