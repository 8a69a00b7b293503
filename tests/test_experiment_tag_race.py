"""Two runners describing one experiment at once: MLflow's read-then-insert of an experiment tag
can lose to the other runner's insert (a unique-constraint error); the tracker writes it again."""
from __future__ import annotations

import pytest
from sqlalchemy.exc import IntegrityError

from benchmarks.tracking import Tracker
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
