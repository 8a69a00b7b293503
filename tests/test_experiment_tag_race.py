"""Two runners describing one experiment at once: MLflow's read-then-insert of an experiment tag
can lose to the other runner's insert (a unique-constraint error); the tracker writes it again."""
from __future__ import annotations

import pytest
from sqlalchemy.exc import IntegrityError

from benchmarks.store.tracking import Tracker
from conftest import store


def test_a_lost_tag_insert_is_written_again_and_other_errors_are_not(tmp_path, monkeypatch):
    tracker = Tracker(*store(tmp_path / "store"))
    exp = tracker.experiment_id("demo/offline")
    real = tracker.client.set_experiment_tag
    calls = []

    def racing(exp_id, key, value):
        calls.append(key)
        if len(calls) == 1:  # the other runner inserted the same (experiment, key) first
            raise IntegrityError("INSERT INTO experiment_tags", {}, Exception(
                "UNIQUE constraint failed: experiment_tags.key, experiment_tags.experiment_id"))
        return real(exp_id, key, value)

    monkeypatch.setattr(tracker.client, "set_experiment_tag", racing)
    tracker.describe_experiment("demo/offline", "**demo/offline** the demo", ("method", "seed"), "acc")
    tags = tracker.client.get_experiment(exp).tags
    assert calls[0] == calls[1] and tags["mlflow.note.content"].startswith("**demo/offline**")

    def broken(exp_id, key, value):
        raise PermissionError("read-only store")

    monkeypatch.setattr(tracker.client, "set_experiment_tag", broken)
    with pytest.raises(PermissionError):
        tracker.describe_experiment("demo/offline", "**demo/offline** again", ("method",), "acc")


def test_admitting_a_suite_file_survives_the_same_race(tmp_path, monkeypatch):
    """check_owner's write of the admitted suite files (two runners starting one suite at once)."""
    from benchmarks.store.ownership import SUITE_FILES_TAG, admitted_files, check_owner, suite_file_id
    from benchmarks.suite.spec import load_suite
    from conftest import REPO_ROOT

    tracker = Tracker(*store(tmp_path / "store"))
    suite = load_suite(REPO_ROOT / "suites" / "demo" / "offline.yaml")
    real, lost = tracker.client.set_experiment_tag, []

    def racing(exp_id, key, value):
        if key == SUITE_FILES_TAG and not lost:
            lost.append(key)
            raise IntegrityError("INSERT INTO experiment_tags", {}, Exception(
                "UNIQUE constraint failed: experiment_tags.key, experiment_tags.experiment_id"))
        return real(exp_id, key, value)

    monkeypatch.setattr(tracker.client, "set_experiment_tag", racing)
    check_owner(tracker, suite)
    assert lost and admitted_files(tracker, tracker.experiment_id(suite.key)) == [suite_file_id(suite.path)]
