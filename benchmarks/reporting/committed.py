"""Re-render every committed report from its committed snapshots (``make committed-reports``).

The repository keeps, per paper, ``reports/<kind>/<paper>/<suite>.snapshot.json`` (kind ``reproduced``
at the ``paper`` profile, ``quick`` at the ``quick`` profile) with the tables, figures and the paper's
PDF rendered from them. This renders each paper folder's suite snapshots into one PDF again
(``pflbench report --from-snapshot`` once per file), so a report-code change shows as a diff of the
committed tables. A suite's snapshot is the file named after the suite (``table1.snapshot.json`` for
``cgpfl/table1``); other snapshot files of a folder (``table1.profiles.snapshot.json``, read by
:mod:`benchmarks.reporting.profiles_side`) are not tables of their own.

    python -m benchmarks.reporting.committed [--root reports] [--out reports]
"""
from __future__ import annotations

import argparse
import json
from dataclasses import dataclass
from pathlib import Path

KIND_PROFILES = {"reproduced": "paper", "quick": "quick"}


@dataclass(frozen=True)
class CommittedPaper:
    """One paper folder of committed snapshots: where it is, its profile and its suites' files."""

    kind: str
    paper: str
    profile: str
    snapshots: tuple[Path, ...]


def committed_papers(root: Path) -> list[CommittedPaper]:
    """Every ``<root>/<kind>/<paper>/`` holding at least one suite snapshot, in name order."""
    found = []
    for kind, profile in KIND_PROFILES.items():
        for folder in sorted(p for p in (root / kind).glob("*") if p.is_dir()):
            files = tuple(p for p in sorted(folder.glob("*.snapshot.json"))
                          if f"{folder.name}/{p.name}" == json.loads(p.read_text())["suite"] + ".snapshot.json")
            if files:
                found.append(CommittedPaper(kind, folder.name, profile, files))
    return found


def render_committed(root: Path, out: Path) -> list[CommittedPaper]:
    """Render each committed paper into ``out/<kind>/`` (``out`` = ``root``: in place)."""
    from benchmarks.reporting.commands import cmd_report

    papers = committed_papers(root)
    for paper in papers:  # what `pflbench report --profile P --out OUT --from-snapshot F ...` does
        cmd_report(argparse.Namespace(suites=[], paper=None, profile=paper.profile, out=str(out / paper.kind),
                                      from_snapshot=[str(f) for f in paper.snapshots], beside_snapshot=None,
                                      tracking_uri=None))
    return papers


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--root", default="reports", help="the committed reports (default reports/)")
    parser.add_argument("--out", default=None, help="where to render (default: --root, in place)")
    args = parser.parse_args(argv)
    root = Path(args.root)
    papers = render_committed(root, Path(args.out) if args.out else root)
    print(f"re-rendered {len(papers)} committed paper report(s): "
          + ", ".join(f"{p.kind}/{p.paper} ({len(p.snapshots)} table(s))" for p in papers))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
