"""An experiment belongs to one suite file (issue 29, item 6), on a real MLflow SQLite store."""
from __future__ import annotations

import copy

import pytest

from benchmarks import cli
from benchmarks.store.ownership import SUITE_FILES_TAG, admitted_files, check_owner, suite_file_id
from benchmarks.suite.spec import load_suite
from benchmarks.suite.schema import SuiteError
from benchmarks.store.tracking import Tracker
from conftest import store, tiny_suite_dict, write_suite


@pytest.fixture(autouse=True)
def _isolated(isolated):
    return isolated


def two_suites(tmp_path):
    """Two suite files with the same paper/name (tiny/mini) in two folders."""
    first = write_suite(tmp_path / "suites" / "tiny" / "mini.yaml", tiny_suite_dict())
    second = write_suite(tmp_path / "suites" / "copy" / "mini.yaml", copy.deepcopy(tiny_suite_dict()))
    return load_suite(first), load_suite(second)


def test_a_suite_file_is_named_from_its_suites_folder(tmp_path):
    assert suite_file_id(tmp_path / "a" / "suites" / "p" / "t.yaml") == "suites/p/t.yaml"
    assert suite_file_id(tmp_path / "t.yaml") == str((tmp_path / "t.yaml").resolve())


def test_the_first_file_owns_the_experiment_a_second_is_refused_unless_shared(tmp_path):
    first, second = two_suites(tmp_path)
    tracker = Tracker(*store(tmp_path / "store"))
    check_owner(tracker, first)
    check_owner(tracker, first)  # its own experiment, again
    exp = tracker.experiment_id(first.key, create=False)
    assert admitted_files(tracker, exp) == ["suites/tiny/mini.yaml"]
    with pytest.raises(SuiteError) as refused:
        check_owner(tracker, second)
    message = str(refused.value)
    assert "\n" not in message and str(second.path) in message and "suites/tiny/mini.yaml" in message
    assert "--share-experiment" in message and "name:" in message
    check_owner(tracker, second, share=True)  # asked for explicitly: admitted from then on
    check_owner(tracker, second)
    assert admitted_files(tracker, exp) == ["suites/tiny/mini.yaml", "suites/copy/mini.yaml"]


def test_an_experiment_made_before_owners_were_recorded_is_adopted(tmp_path):
    first, second = two_suites(tmp_path)
    tracker = Tracker(*store(tmp_path / "store"))
    exp = tracker.experiment_id(first.key)  # no SUITE_FILES_TAG
    check_owner(tracker, second)
    assert tracker.client.get_experiment(exp).tags[SUITE_FILES_TAG] == '["suites/copy/mini.yaml"]'


def test_dry_run_reads_only(tmp_path):
    first, second = two_suites(tmp_path)
    tracker = Tracker(*store(tmp_path / "store"))
    check_owner(tracker, first, write=False)
    assert tracker.experiment_id(first.key, create=False) is None  # nothing created


def test_the_command_line_refuses_the_second_suite_in_one_line_before_any_run(tmp_path, capsys):
    first, second = two_suites(tmp_path)
    uri, _ = store(tmp_path / "store")
    only = ["--only", "setting=iid", "--only", "method=local", "--seeds", "0", "--profile", "smoke"]
    assert cli.main(["run", str(first.path), "--tracking-uri", uri, "--device", "cpu", *only]) == 0
    capsys.readouterr()
    for extra in (["--dry-run"], []):
        assert cli.main(["run", str(second.path), "--tracking-uri", uri, *only, *extra]) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and "--share-experiment" in err[0] and "Traceback" not in err[0]
    tracker = Tracker(uri)
    runs = tracker.runs(first.key, status=None, kind=None)
    assert len(runs) == 2  # the first suite's cell run and its sweep's parent: nothing of the second
    assert cli.main(["run", str(second.path), "--tracking-uri", uri, *only, "--share-experiment"]) == 0
    assert "0 finished" in capsys.readouterr().out  # shared: the same configuration is FINISHED already
