"""An experiment belongs to one suite file (issue 29, item 6).

A suite's experiment is named by its ``paper/name`` (:attr:`benchmarks.suite.spec.Suite.key`), so two
suite files with the same ``paper:`` and ``name:`` would write into one experiment, and the report
and resume of each would read the other's runs. The experiment therefore records the suite files
it admits (experiment tag :data:`SUITE_FILES_TAG`, a JSON list); a sweep of another file is
refused before any run, in one line, unless ``--share-experiment`` (``share=True``) admits that
file too (a suite file that moved, or two files meant to share one table).

A suite file is named by its path from the last ``suites`` folder on its resolved path
(``suites/demo/offline.yaml``), so the same suite in two checkouts of the repository is one suite;
a file outside any ``suites`` folder is named by its resolved path (a harness choice).
"""
from __future__ import annotations

import json
from pathlib import Path

from benchmarks.suite.spec import Suite
from benchmarks.suite.schema import SuiteError

SUITE_FILES_TAG = "pflbench.suite_files"
SHARE_FLAG = "--share-experiment"


def suite_file_id(path: Path) -> str:
    """The suite file's name in the store: ``suites/<...>`` when it lies under a ``suites``
    folder, else its resolved path."""
    resolved = Path(path).resolve()
    parts = resolved.parts
    for index in range(len(parts) - 2, -1, -1):
        if parts[index] == "suites":
            return "/".join(parts[index:])
    return str(resolved)


def admitted_files(tracker, experiment_id: str) -> list[str]:
    """The suite files the experiment admits (empty: none recorded yet)."""
    raw = tracker.client.get_experiment(experiment_id).tags.get(SUITE_FILES_TAG)
    try:
        files = json.loads(raw) if raw else []
    except ValueError:
        files = []
    return [str(f) for f in files] if isinstance(files, list) else []


def refusal(suite: Suite, owners: list[str], store: str) -> str:
    """The one-line answer to a suite file writing into another suite file's experiment."""
    return (f"{suite.path}: name: experiment {suite.key!r} of store {store} belongs to suite file "
            f"{', '.join(owners)}; give this suite another `name:` (e.g. name: {suite.name}_2) or pass "
            f"{SHARE_FLAG} to write into it anyway")


def check_owner(tracker, suite: Suite, share: bool = False, write: bool = True) -> None:
    """Refuse (:class:`SuiteError`) a sweep of ``suite`` into an experiment that admits other suite
    files only; with ``write``, record the file as admitted (the experiment's first file, or a
    shared one with ``share``). ``write=False`` (``--dry-run``) only reads, creating nothing."""
    exp = tracker.experiment_id(suite.key, create=write)
    if exp is None:
        return
    me, files = suite_file_id(suite.path), admitted_files(tracker, exp)
    if me in files:
        return
    if files and not share:
        raise SuiteError(refusal(suite, files, tracker.public_uri))
    if write:  # the first file (or an experiment made before files were recorded), or shared on request
        tracker.set_experiment_tag(exp, SUITE_FILES_TAG, json.dumps([*files, me]))  # retried on a race
