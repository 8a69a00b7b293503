"""``pflbench report`` and ``pflbench snapshot``: render suites from the store or from a committed
snapshot (with other snapshots beside them), and export a snapshot (:mod:`benchmarks.reporting`)."""
from __future__ import annotations

from pathlib import Path

from benchmarks.suite.packaged import suite_file
from benchmarks.suite.spec import load_suite, parse_only
from benchmarks.suite.schema import SuiteError


def _tracker(args):
    from benchmarks.store.tracking import Tracker  # MLflow is slow to import; only when needed

    return Tracker(args.tracking_uri)


def report_files(rendered: list, suite_key: str) -> list[Path]:
    """The files rendered for suite ``suite_key``: its tables, CSV, figures and its paper's PDF."""
    files = []
    for done in rendered:
        for part in done.suites:
            if part.report.suite.key == suite_key:
                files += [done.pdf, part.md, part.tex, part.csv, *part.pngs]
    return files


def cmd_report(args, rendered: list | None = None) -> int:
    """Tables and figures of each named suite (or of every suite of ``--paper``), then one PDF
    per paper covering every suite of that paper's folder (each paper's
    :class:`~benchmarks.reporting.build.RenderedPaper` appended to ``rendered`` if given)."""
    from benchmarks.reporting import paper_suites, sibling_suites
    from benchmarks.reporting.snapshot import SnapshotSet

    paths = list(args.suites or [])
    snapshot = None
    if getattr(args, "from_snapshot", None):
        snapshot = SnapshotSet.load([Path(f) for f in args.from_snapshot])
        paths = paths or [str(suite_file(key)) for key in snapshot.snapshots]
    if getattr(args, "paper", None):
        found = paper_suites(args.paper)
        if not found:
            raise SuiteError(f"--paper {args.paper}: no suite file under suites/{args.paper}/ here nor a packaged "
                             f"suite {args.paper}/<name>; `pflbench list suites` lists them")
        paths += [str(p) for p in found]
    if not paths:
        raise SuiteError("report: name suite files or --paper PAPER")
    named = [load_suite(p) for p in dict.fromkeys(paths)]
    if snapshot is not None:  # snapshots render their own suites alone: the other suites have no runs there
        papers = {}
        for suite in named:
            if suite.key not in snapshot.snapshots:
                raise SuiteError(f"report --from-snapshot: no snapshot of {suite.key} given; add --from-snapshot "
                                 f"<its .snapshot.json> or leave the suite out")
            papers.setdefault(suite.paper, []).append(suite)
        return _render(args, papers, named, snapshot, rendered)
    papers: dict[str, list] = {}
    loaded = {s.path.resolve(): s for s in named}
    for suite in named:
        for member in sibling_suites(suite, loaded):
            bucket = papers.setdefault(member.paper, [])
            if all(member.key != m.key for m in bucket):
                bucket.append(member)
    return _render(args, papers, named, _tracker(args), rendered)


def _render(args, papers: dict[str, list], named: list, tracker, rendered: list | None) -> int:
    """Render every paper of ``papers`` from ``tracker`` (the store, or a snapshot)."""
    from benchmarks.reporting import render_paper
    from benchmarks.reporting.snapshot import SnapshotSet, provenance_markdown
    from pfl_core.atomic_file import write_text

    beside, note = beside_snapshots(getattr(args, "beside_snapshot", None) or [])
    for paper, suites in papers.items():
        done = render_paper(paper, suites, tracker, args.profile, Path(args.out), beside, note)
        if rendered is not None:
            rendered.append(done)
        for part in done.suites:
            if any(part.report.suite.key == s.key for s in named):
                runs = int(part.report.table["n_seeds"].sum())
                print(f"{part.report.suite.key} [{args.profile}]: {runs} finished runs -> {part.md}, {part.csv}")
                own = tracker.snapshots.get(part.report.suite.key) if isinstance(tracker, SnapshotSet) else None
                if own is not None:
                    write_text(part.md.with_name(f"{part.md.stem}.provenance.md"), provenance_markdown(own, part.md))
        print(f"{paper} [{args.profile}]: {len(suites)} suite(s), {len(done.pages)} pages -> {done.pdf} "
              f"({done.seconds:.1f}s)")
    return 0


def beside_snapshots(files: list[str]) -> tuple[list, str]:
    """(suite, snapshot) pairs of committed snapshots to render beside a report, and page 1's note
    saying which tables are which."""
    from benchmarks.reporting.snapshot import SnapshotTracker, snapshot_note

    pairs = []
    for file in files:
        snapshot = SnapshotTracker.load(Path(file))
        pairs.append((load_suite(suite_file(snapshot.suite_key)), snapshot))
    notes = [snapshot_note(t, Path(f)) for (_, t), f in zip(pairs, files)]
    if notes:
        notes.append("Every other table was computed just now by this command; its own notice says what it is.")
    return pairs, "\n".join(notes)


def cmd_snapshot(args) -> int:
    """Export the suite's finished runs with the provenance notes to a new file (``--out``), or add the
    runs a committed snapshot lacks to it (``--into``) (benchmarks.reporting.snapshot)."""
    from benchmarks.reporting.snapshot import export_snapshot, merge_into_snapshot

    notes = {}
    for note in args.note:
        key, sep, value = note.partition("=")
        if not sep or not key:
            raise SuiteError(f"--note {note!r}: expected KEY=VALUE")
        notes[key.strip()] = value.strip()
    suite = load_suite(args.suite)
    only = parse_only(args.only)
    suite.check_only(only, labels=True)
    which = f" of profile {', '.join(args.profile)}" if args.profile else ""
    which += "".join(f", {axis}={','.join(values)}" for axis, values in only.items())
    if args.into:
        merged = merge_into_snapshot(suite, _tracker(args), Path(args.into), notes, profiles=args.profile, only=only)
        finished = sum(r["status"] == "FINISHED" for r in merged.added)
        print(f"{suite.key}: {len(merged.added)} run(s){which} added ({finished} finished), {merged.already} "
              f"already there -> {args.into} ({merged.total} runs)")
        return 0 if merged.added else 1
    count = export_snapshot(suite, _tracker(args), Path(args.out), notes, profiles=args.profile, only=only)
    print(f"{suite.key}: {count} finished runs{which} -> {args.out}")
    return 0 if count else 1
