"""Every malformed input of the probe (tests/bad_inputs.py, issue 15 item 4) is rejected before
any run, in one line naming the file (or flag), the key and a fix."""
from __future__ import annotations

import pytest

from bad_inputs import CASES, base_suite, classify


def test_the_probe_has_every_case_of_the_issue_and_at_least_40():
    names = {c.name for c in CASES}
    assert len(CASES) >= 40 and len(names) == len(CASES)
    for issue_case in ("negative rounds", "num_clients 0", "negative dirichlet alpha", "batch size 0",
                       "${sed} placeholder", "NaN learning rate", "--device gpu", "seeds: '42'", "empty grid",
                       "duplicate axis", "duplicate axis values", "negative learning rate", "metric.key typo",
                       "seeds: 1", "string published number"):
        assert issue_case in names


def test_the_unmutated_suite_is_valid(tmp_path):
    from benchmarks.suite.spec import load_suite
    from conftest import write_suite

    suite = load_suite(write_suite(tmp_path / "ok.yaml", base_suite()))
    assert len(suite.expand()) == 4


@pytest.mark.parametrize("case", CASES, ids=[c.name for c in CASES])
def test_rejected_well_before_any_run(case, tmp_path, monkeypatch):
    """Rejected by a dry run; a case a dry run only lists (missing data) by a real run's pre-flight."""
    monkeypatch.chdir(tmp_path)
    verdict, message = classify(case, tmp_path, run=case.dry_run_lists)
    assert verdict == "well", message


def test_a_dry_run_lists_missing_data_instead_of_failing(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (case,) = [c for c in CASES if c.dry_run_lists]
    assert classify(case, tmp_path, run=False)[0] == "accepted"
