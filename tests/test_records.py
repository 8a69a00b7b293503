"""Run records (benchmarks/store/records.py) and the GPU lend's command (benchmarks/running/gpu_lend.py) against a
real MLflow SQLite store: a recorded run imports exactly as the sweep logs it, a finished hash is
skipped, a damaged or foreign record is refused in one line, and the lend's command on the CPU
records whole runs only and stops at its deadline."""
from __future__ import annotations

import json
import tarfile
from pathlib import Path

import pytest

from benchmarks.running import gpu_lend
from benchmarks.store.records import RecordError, import_records, read_record, record_path, recorded_hashes, write_record
from benchmarks.suite.spec import load_suite
from benchmarks.store.tracking import Tracker, read_json_artifact
from benchmarks.running.worker import execute_specs
from conftest import store, tiny_suite_dict, write_suite

GIT = ("0123456789abcdef0123456789abcdef01234567", False)
META = {"paper": "tiny", "table": "Tiny table"}
COMMAND = "gpu_lend.py --suite tiny/mini"
#: what differs between two loggings of one run by design: timestamps and the run's own ids
VOLATILE = {"mlflow.user"}


@pytest.fixture(scope="module")
def ran(tmp_path_factory):
    """Two runs of the tiny suite's smoke profile (one cell, seeds 0 and 1, lockstep) and their outcomes."""
    root = tmp_path_factory.mktemp("records")
    suite = load_suite(write_suite(root / "suites" / "tiny" / "mini.yaml", tiny_suite_dict()))
    specs = suite.expand("smoke", only={"setting": ["dir"], "method": ["fedavg"]})
    outcomes = execute_specs(specs, "cpu", None, execution="batched")
    assert all("error" not in o for o in outcomes)
    return {"root": root, "suite": suite, "specs": specs, "outcomes": outcomes}


def _logged(tracker: Tracker, suite_key: str) -> dict:
    """Each FINISHED run of the suite as (tags, params, metrics with their steps, artifacts), by hash."""
    out = {}
    for run in tracker.runs(suite_key):
        client, rid = tracker.client, run.info.run_id
        metrics = {k: [(m.step, m.value) for m in sorted(client.get_metric_history(rid, k), key=lambda m: m.step)]
                   for k in run.data.metrics}
        artifacts = {name: read_json_artifact(client, rid, name) for name in ("config.json", "clients.json",
                                                                              "run_info.json")}
        tags = {k: v for k, v in run.data.tags.items() if k not in VOLATILE}
        out[run.data.tags["config_hash"]] = (tags, dict(run.data.params), metrics, artifacts,
                                             (run.info.start_time, run.info.end_time, run.info.status))
    return out


def test_an_imported_record_is_the_run_the_store_would_have_logged(ran, tmp_path):
    direct = Tracker(*store(tmp_path / "direct"))
    for spec, outcome in zip(ran["specs"], ran["outcomes"]):
        direct.log(spec, META, outcome, GIT, command=COMMAND)
        write_record(tmp_path / "records", spec, META, outcome, GIT, COMMAND)
    imported = Tracker(*store(tmp_path / "imported"))
    counts = import_records(imported, [tmp_path / "records"], echo=lambda _: None)
    assert counts == {"imported": 2, "skipped": 0, "refused": 0}
    assert _logged(imported, "tiny/mini") == _logged(direct, "tiny/mini")
    assert set(_logged(imported, "tiny/mini")) == {s.config_hash for s in ran["specs"]}


def test_a_record_reads_back_whole(ran, tmp_path):
    spec, outcome = ran["specs"][0], ran["outcomes"][0]
    path = write_record(tmp_path, spec, META, outcome, GIT, COMMAND)
    assert path == record_path(tmp_path, spec) == tmp_path / "tiny" / "mini" / f"{spec.config_hash}.json"
    record = read_record(path)
    assert record.spec == spec and record.git == GIT and record.command == COMMAND
    assert record.outcome["history"] == json.loads(json.dumps(outcome["history"]))
    assert record.outcome["metrics"] == pytest.approx(outcome["metrics"])
    data = json.loads(path.read_text())
    assert data["tags"]["config_hash"] == spec.config_hash and data["tags"]["device"] == "cpu"
    assert recorded_hashes(tmp_path, "tiny/mini") == {spec.config_hash}


def test_a_hash_already_finished_is_skipped_and_said_so(ran, tmp_path):
    for spec, outcome in zip(ran["specs"], ran["outcomes"]):
        write_record(tmp_path / "records", spec, META, outcome, GIT, COMMAND)
    tracker = Tracker(*store(tmp_path / "store"))
    import_records(tracker, [tmp_path / "records"], echo=lambda _: None)
    said: list[str] = []
    assert import_records(tracker, [tmp_path / "records"], echo=said.append) == {"imported": 0, "skipped": 2,
                                                                                  "refused": 0}
    assert all(line.startswith("skipped:") and "already FINISHED" in line for line in said)
    assert len(tracker.runs("tiny/mini")) == 2


def _damage_cut(path: Path) -> None:
    path.write_text(path.read_text()[: len(path.read_text()) // 2])


def _damage_edit(path: Path) -> None:
    path.write_text(path.read_text().replace('"acc_last3":', '"acc_last3":0.99,"was":', 1))


def _foreign(path: Path) -> None:
    path.write_text(json.dumps({"run": "someone else's", "acc": 0.9}))


def _renamed(path: Path) -> None:
    path.rename(path.with_name("0000000000000000.json"))


@pytest.mark.parametrize("damage, words", [(_damage_cut, "damaged record (not readable JSON"),
                                           (_damage_edit, "damaged record (its digest does not match"),
                                           (_foreign, "not a pflbench run record"),
                                           (_renamed, "the file name is not the run's config hash")])
def test_a_damaged_or_foreign_record_is_refused_in_one_line(ran, tmp_path, damage, words):
    spec, outcome = ran["specs"][0], ran["outcomes"][0]
    damage(write_record(tmp_path / "records", spec, META, outcome, GIT, COMMAND))
    (path,) = (tmp_path / "records").rglob("*.json")
    with pytest.raises(RecordError, match=words.replace("(", r"\(")) as err:
        read_record(path)
    assert "\n" not in str(err.value) and str(path) in str(err.value)
    said: list[str] = []
    tracker = Tracker(*store(tmp_path / "store"))
    assert import_records(tracker, [tmp_path / "records"], echo=said.append)["refused"] == 1
    assert said == [f"refused: {err.value}"] and tracker.runs("tiny/mini") == []
    assert recorded_hashes(tmp_path / "records", "tiny/mini") == set()  # a lend computes it again


def test_a_stage1_run_is_not_recorded(ran, tmp_path):
    from dataclasses import replace

    spec = replace(ran["specs"][0], stage="pretrain")
    with pytest.raises(RecordError, match="keeps model weights"):
        write_record(tmp_path, spec, META, ran["outcomes"][0], GIT, COMMAND)


def _lend(root: Path, *extra: str) -> Path:
    suite = write_suite(root / "suites" / "tiny" / "mini.yaml", tiny_suite_dict())
    out = root / "out"
    gpu_lend.main([f"--suite={suite}", "--profile=smoke", "--skip-check", "--jobs=1", "--device=cpu",
                   f"--records-dir={root / 'committed'}", f"--out={out}", "--git-commit=" + GIT[0], *extra])
    return out


def _unpacked(out: Path, into: Path) -> list[Path]:
    with tarfile.open(out / "records.tar.gz") as tar:
        tar.extractall(into, filter="data")
    return sorted(into.rglob("*.json"))


def test_the_lend_records_its_runs_skipping_those_already_committed_and_they_import_with_their_hashes(
        tmp_path, ran):
    suite, specs = ran["suite"], ran["specs"]
    committed = tmp_path / "committed"
    for spec, outcome in zip(specs, ran["outcomes"]):  # the dir/fedavg cell is already in the repository
        write_record(committed, spec, META, outcome, GIT, COMMAND)
    out = _lend(tmp_path, "--budget-s=600", "--min-start-s=0", "--only=setting=dir")
    files = _unpacked(out, tmp_path / "records")
    wanted = [s for s in suite.expand("smoke", only={"setting": ["dir"]}) if s.method != "fedavg"]
    assert sorted(p.stem for p in files) == sorted(s.config_hash for s in wanted)  # 4 runs, fedavg's 2 skipped
    tracker = Tracker(*store(tmp_path / "store"))
    assert import_records(tracker, [tmp_path / "records"], echo=lambda _: None)["imported"] == 4
    assert tracker.finished_hashes("tiny/mini") == {s.config_hash for s in wanted}
    summary = (out / "lend.md").read_text()
    assert "6 run(s) selected (setting=dir), 2 already recorded, 4 finished here, 0 failed" in summary


def test_the_lend_stops_at_its_deadline_with_no_half_written_record(tmp_path):
    data = tiny_suite_dict()
    data["profiles"]["smoke"]["set"]["federation.rounds"] = 100_000  # far longer than the budget
    write_suite(tmp_path / "suites" / "tiny" / "mini.yaml", data)
    suite = tmp_path / "suites" / "tiny" / "mini.yaml"
    out = tmp_path / "out"
    gpu_lend.main([f"--suite={suite}", "--profile=smoke", "--skip-check", "--jobs=1", "--device=cpu",
                   "--records-dir=none", f"--out={out}", "--budget-s=20", "--min-start-s=0",
                   "--only=setting=dir", "--only=method=fedavg"])
    assert _unpacked(out, tmp_path / "records") == []
    assert "| setting=dir,method=fedavg | stopped at the deadline | - |" in (out / "lend.md").read_text()
    assert not [p for p in out.rglob("*") if p.name.startswith(".")]  # no temporary file left behind


def test_the_lend_runs_only_the_seeds_it_is_given(tmp_path):
    """``--seeds``: a column whose seed 0 ran elsewhere (on a CPU) sends only its other seeds to a lend."""
    out = _lend(tmp_path, "--budget-s=600", "--min-start-s=0", "--only=setting=dir", "--only=method=fedavg",
                "--seeds", "1")
    suite = load_suite(tmp_path / "suites" / "tiny" / "mini.yaml")
    wanted = suite.expand("smoke", seeds=[1], only={"setting": ["dir"], "method": ["fedavg"]})
    assert [s.seed for s in wanted] == [1]
    files = _unpacked(out, tmp_path / "records")
    assert [p.stem for p in files] == [wanted[0].config_hash]
    assert "1 run(s) selected (setting=dir method=fedavg, seeds 1), 0 already recorded, 1 finished here" in (
        out / "lend.md").read_text()
