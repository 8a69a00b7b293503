"""The committed snapshots (``reports/reproduced/``) stay the runs of their suites (issue 28 item 9,
the ``CONFIG_VERSION`` decision, docs/suites.md): every run of a snapshot is a run of its suite's
current expansion, by config hash, cell and profile. A bumped ``CONFIG_VERSION``, or a suite edit
that changes what a snapshot's cells compute, fails here until the snapshot is recomputed."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from benchmarks.suite.spec import config_hash, load_suite
from pfl_core.config import RunConfig

ROOT = Path(__file__).resolve().parents[1]
SNAPSHOTS = sorted((ROOT / "reports" / "reproduced").glob("*/*.snapshot.json"))


def test_there_is_a_committed_snapshot_to_check():
    assert SNAPSHOTS, "reports/reproduced/ holds no snapshot"


@pytest.mark.parametrize("path", SNAPSHOTS, ids=lambda p: p.name)
def test_every_run_of_a_committed_snapshot_is_a_run_of_its_suite_today(path):
    snapshot = json.loads(path.read_text())
    suite = load_suite(ROOT / "suites" / f"{snapshot['suite']}.yaml")
    current = {spec.config_hash: spec for profile in suite.profiles for spec in suite.expand(profile)}
    runs = [run for run in snapshot["runs"] if run["status"] == "FINISHED"]
    assert runs
    stale = [(run["tags"]["cell"], run["tags"]["seed"]) for run in runs if run["tags"]["config_hash"] not in current]
    assert not stale, (f"{path.name}: {len(stale)} run(s) no longer match {snapshot['suite']} (e.g. {stale[:3]}): "
                       "a CONFIG_VERSION bump or a suite edit changed their hashes; recompute and export again")
    for run in runs:
        spec = current[run["tags"]["config_hash"]]
        assert (spec.cell_id, str(spec.seed)) == (run["tags"]["cell"], run["tags"]["seed"])


def test_a_method_default_written_in_a_suite_moves_the_hash():
    """What the decision relies on instead of a bump: method parameters are hashed as written, so a
    suite that states a changed default (pFedMe's predictor and theta_start, L2SGD's variant, the
    CGPFL suites since 45e1ba8) no longer matches runs stored without it."""
    bare = RunConfig.from_dict({"method": {"name": "pfedme"}}).to_dict()
    stated = RunConfig.from_dict({"method": {"name": "pfedme", "params": {"predictor": "local"}}}).to_dict()
    assert config_hash(bare) != config_hash(stated)


PAPER_FOLDERS = sorted(p for kind in ("reproduced", "quick") for p in (ROOT / "reports" / kind).iterdir()
                       if p.is_dir() and list(p.glob("*.snapshot.json")))


@pytest.mark.parametrize("folder", PAPER_FOLDERS, ids=lambda p: f"{p.parent.name}/{p.name}")
def test_a_committed_paper_pdf_shows_every_committed_snapshot_beside_it(folder):
    """``reports/<kind>/<paper>.pdf`` holds every table committed in ``reports/<kind>/<paper>/`` (rendered
    with one ``--from-snapshot`` per file), not only the last one rendered."""
    from pypdf import PdfReader

    suites = {json.loads(p.read_text())["suite"] for p in folder.glob("*.snapshot.json")}
    pdf = folder.with_suffix(".pdf")
    assert pdf.exists(), f"{pdf.name} missing beside {folder.name}/"
    text = " ".join(page.extract_text() for page in PdfReader(pdf).pages)
    missing = sorted(s for s in suites if s not in text)
    assert not missing, (f"{pdf.relative_to(ROOT)} lacks {missing}: render it with one --from-snapshot per "
                         f"snapshot of {folder.relative_to(ROOT)}/ (docs/reports.md)")


@pytest.mark.slow
def test_the_committed_tables_are_what_their_snapshots_render_today(tmp_path):
    """``make committed-reports`` (benchmarks.reporting.committed) renders every committed paper folder from its
    snapshots; every Markdown, CSV and LaTeX table it writes equals the committed one, so a change of the
    report code that moves a committed table fails here until the tables are re-rendered."""
    from benchmarks.reporting.committed import render_committed

    papers = render_committed(ROOT / "reports", tmp_path)
    assert {(p.kind, p.paper) for p in papers} >= {("reproduced", "cgpfl"), ("quick", "fedl2p")}
    assert len(next(p for p in papers if (p.kind, p.paper) == ("reproduced", "cgpfl")).snapshots) == 4
    written = sorted(f for ext in ("md", "csv", "tex") for f in tmp_path.rglob(f"*.{ext}"))
    assert written
    stale = [str(f.relative_to(tmp_path)) for f in written
             if f.read_text() != (ROOT / "reports" / f.relative_to(tmp_path)).read_text()]
    assert not stale, f"committed tables differ from their snapshots' rendering today: {stale}; run `make committed-reports`"
    for p in papers:
        assert (tmp_path / p.kind / f"{p.paper}.pdf").exists()


def test_make_clean_results_leaves_the_committed_reports():
    """``make clean-results`` deletes the local store and the reports rendered from it, never the
    committed ``reports/reproduced`` and ``reports/quick`` (it used to remove ``reports/*/``)."""
    from conftest import make_dry_run

    commands = make_dry_run("clean-results")
    removed = commands.split()
    assert "reports/cgpfl" in removed and "reports/demo" in removed
    assert not any(word.startswith(("reports/reproduced", "reports/quick", "reports/*")) for word in removed), commands
