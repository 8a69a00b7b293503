"""Suite ``marks``: a note attached to chosen cells (MetaVers' baseline cells whose hyperparameters
come from the baseline's own paper), checked at load time and shown by every rendering of the
report: the Markdown/PDF table (mark after the cell's label, legend line), the CSV column, the
LaTeX table (mark after the method, legend in the caption)."""
from __future__ import annotations

import pandas as pd
import pytest
from pypdf import PdfReader

from benchmarks.reporting import render_paper
from benchmarks.suite.spec import load_suite
from benchmarks.suite.schema import SuiteError
from benchmarks.store.tracking import Tracker
from conftest import store, write_suite

TEXT = "hyperparameters from the baseline's own paper"


@pytest.fixture(autouse=True)
def _isolated(isolated):
    return isolated


def marked(suite_data: dict, marks) -> dict:
    suite_data["marks"] = marks
    return suite_data


def test_marks_attach_to_the_matching_cells_only(tmp_path, suite_data):
    path = write_suite(tmp_path / "s.yaml", marked(suite_data, [
        {"when": {"method": ["local", "fedavg"]}, "mark": "‡", "text": TEXT},
        {"when": {"setting": "iid", "method": "local"}, "mark": "*", "text": "second note"}]))
    suite = load_suite(path)
    got = {(c["setting"], c["method"]): [m for m, _ in suite.marks(c)] for c in suite.cells()}
    assert got == {("dir", "local"): ["‡"], ("dir", "fedavg"): ["‡"], ("dir", "fedavg_ft"): [],
                   ("iid", "local"): ["‡", "*"], ("iid", "fedavg"): ["‡"], ("iid", "fedavg_ft"): []}
    assert suite.marks({"setting": "dir", "method": "local"}) == [("‡", TEXT)]


@pytest.mark.parametrize("marks, key", [
    ([{"when": {"method": "nope"}, "mark": "‡", "text": TEXT}], "marks[0].when.method"),
    ([{"when": {"axis": "x"}, "mark": "‡", "text": TEXT}], "marks[0].when"),
    ([{"when": {"method": "local"}, "mark": "", "text": TEXT}], "marks[0].mark"),
    ([{"when": {"method": "local"}, "mark": "‡", "text": 3}], "marks[0].text"),
    ([{"when": {"method": "local"}, "mark": "‡"}], "marks[0]"),
    ({"when": {"method": "local"}}, "marks"),
])
def test_bad_marks_are_rejected_naming_file_and_key(tmp_path, suite_data, marks, key):
    path = write_suite(tmp_path / "bad.yaml", marked(suite_data, marks))
    with pytest.raises(SuiteError) as err:
        load_suite(path)
    assert str(path) in str(err.value) and key in str(err.value)


def test_report_shows_marks_in_markdown_csv_latex_and_pdf(tmp_path, suite_data):
    path = write_suite(tmp_path / "suites" / "tiny" / "mini.yaml",
                       marked(suite_data, [{"when": {"method": ["local", "fedavg"]}, "mark": "‡", "text": TEXT}]))
    suite = load_suite(path)
    uri, artifacts = store(tmp_path / "store")
    done = render_paper("tiny", [suite], Tracker(uri, artifacts), "paper", tmp_path / "reports")
    rendered = done.suites[0]
    md = rendered.md.read_text()
    for setting in ("dir", "iid"):
        assert f"| {setting} | local ‡ |" in md and f"| {setting} | fedavg ‡ |" in md
        assert f"| {setting} | fedavg_ft |" in md
    assert f"- **‡**: {TEXT} (4 cells)" in md
    frame = pd.read_csv(rendered.csv, keep_default_na=False)
    assert dict(zip(frame["setting"] + "/" + frame["method"], frame["marks"])) == {
        "dir/local": "‡", "dir/fedavg": "‡", "dir/fedavg_ft": "", "iid/local": "‡", "iid/fedavg": "‡",
        "iid/fedavg_ft": ""}
    tex = rendered.tex.read_text()
    assert "local\\textsuperscript{‡}" in tex and "fedavg\\textsuperscript{‡}" in tex
    assert "fedavg\\_ft &" in tex  # no mark on the unmarked method
    assert f"‡: {TEXT} (4 cells)." in tex
    pdf = " ".join(" ".join(page.extract_text().split()) for page in PdfReader(done.pdf).pages)
    assert TEXT in pdf and "(4 cells)" in pdf
