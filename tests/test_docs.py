"""The documentation site builds with warnings as errors (`make docs`, ``mkdocs build --strict``)."""

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def test_docs_site_builds_strict(tmp_path):
    """A broken link, a missing anchor or a page left out of the nav fails the build.

    Not ``--quiet``: MkDocs counts the warnings it logs, and a quiet build logs none, so it passes
    in strict mode whatever is broken."""
    pytest.importorskip("mkdocs")
    pytest.importorskip("material")
    proc = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict",
         "--config-file", str(ROOT / "mkdocs.yml"), "--site-dir", str(tmp_path / "site")],
        cwd=ROOT, capture_output=True, text=True, timeout=300,
        env={**os.environ, "NO_MKDOCS_2_WARNING": "1"})
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert (tmp_path / "site" / "index.html").exists()


PAPER_TEMPLATE = ["Setup", "Suites and what each reproduces", "Every code-vs-paper switch",
                  "Reproduced so far", "Notes"]
PAPERS = ["cafeme", "cgpfl", "metavers", "fedl2p"]


def _pages():
    return sorted((ROOT / "docs").rglob("*.md")) + [ROOT / "README.md"]


@pytest.mark.parametrize("paper", PAPERS)
def test_paper_page_follows_the_template(paper):
    """One page per paper with suites, its ``##`` sections exactly the template's, in order."""
    assert (ROOT / "suites" / paper).is_dir()
    text = (ROOT / "docs" / "papers" / f"{paper}.md").read_text()
    assert re.findall(r"^## (.+)$", text, flags=re.M) == PAPER_TEMPLATE


def test_docs_carry_no_ticket_references_or_change_log():
    """Facts only: no "(issue 14)", "issue #5", "this session", "last turn"."""
    bad = re.compile(r"\bissue\s*#?\d+|\bthis session\b|\blast turn\b|\bone turn ago\b", re.I)
    hits = [f"{p.relative_to(ROOT)}:{m.group(0)}" for p in _pages() for m in bad.finditer(p.read_text())]
    assert not hits


def test_paths_the_docs_cite_exist():
    """Every source path the docs name in backticks exists (files move; the docs must follow).

    Outputs (`reports/`, `results/`) are left out: a fresh checkout has not written them yet."""
    cited = re.compile(r"`((?:pfl_core|benchmarks|tests|suites|docs)/[\w./-]+)`")
    missing = [f"{p.relative_to(ROOT)}: {m}" for p in _pages() for m in cited.findall(p.read_text())
               if not (ROOT / m.rstrip("/")).exists()]
    assert not missing


def _sources():
    for pattern in ("pfl_core/**/*.py", "benchmarks/**/*.py", "suites/*/*.yaml", "suites/*/_*.yml"):
        yield from sorted(ROOT.glob(pattern))


def test_sources_cite_no_document_that_does_not_ship():
    """Docstrings and suite comments cite the paper, the authors' code or a page under docs/."""
    unshipped = re.compile(r"DESIGN\.md|ENGINE-NOTES|shared/specs|\.\./shared|published-numbers\.md")
    hits = [f"{p.relative_to(ROOT)}: {m.group(0)}" for p in _sources() for m in unshipped.finditer(p.read_text())]
    assert not hits
    pages = re.compile(r"\bdocs/[\w/-]+\.md")
    missing = [f"{p.relative_to(ROOT)}: {m}" for p in _sources() for m in pages.findall(p.read_text())
               if not (ROOT / m).exists()]
    assert not missing
