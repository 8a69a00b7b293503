"""Run artifacts cut short on disk (issue 38, item 5): a FINISHED run's ``config.json``,
``clients.json``, ``run_info.json``, analysis arrays (``*.npz``) or stage-1 state (``*.pt``) that a
full disk, a crash or a bad copy truncated.

Each file is checked by its own format, so no record of its size is needed and runs logged before
this check are covered too: a JSON file must parse (``json.dumps`` output ends with its closing
bracket, so any cut breaks it), a ``.npz`` or ``.pt`` file is a zip archive whose directory sits at
its end. Artifacts in a local folder (a SQLite store's ``mlartifacts/``, a ``file:`` artifact root)
are checked; those of a tracking server's remote artifact store are not. A run's curves and round
metrics live in the store's database, not in files (a damaged SQLite file:
:mod:`benchmarks.store.faults`).

``pflbench run`` marks such a run FAILED (tag ``failure_reason``) and recomputes it, in one line;
``pflbench report`` and ``pflbench snapshot`` refuse, in one line naming the run, the file and the fix.
"""
from __future__ import annotations

import json
import zipfile
from pathlib import Path
from urllib.parse import unquote, urlsplit

from benchmarks.store.location import StoreError

CHECKED = (".json", ".npz", ".pt")


class ArtifactError(StoreError):
    """A run's artifact is cut short; the message is one line naming the run, the file and the fix."""


def artifact_folder(run) -> Path | None:
    """The local folder of ``run``'s artifacts, None when they are not on this machine's disk."""
    uri = getattr(run.info, "artifact_uri", None) or ""  # a snapshot's run has none
    parts = urlsplit(uri)
    if parts.scheme == "file":
        folder = Path(unquote(parts.path))
    elif parts.scheme == "" and uri.startswith("/"):
        folder = Path(uri)
    else:
        return None
    return folder if folder.is_dir() else None


def file_fault(path: Path) -> str | None:
    """Why ``path`` is cut short or unreadable, None when it reads whole."""
    size = path.stat().st_size
    try:
        if path.suffix == ".json":
            json.loads(path.read_text())
        else:
            with zipfile.ZipFile(path) as archive:
                archive.infolist()
    except (ValueError, zipfile.BadZipFile, OSError):
        kind = "JSON" if path.suffix == ".json" else "zip archive"
        return f"cut short ({size} bytes, not a complete {kind})"
    return None


def damaged_artifacts(run) -> list[tuple[Path, str]]:
    """(file, fault) of every checked artifact of ``run`` that does not read whole."""
    folder = artifact_folder(run)
    if folder is None:
        return []
    found = []
    for path in sorted(folder.rglob("*")):
        if path.suffix in CHECKED and path.is_file():
            fault = file_fault(path)
            if fault:
                found.append((path, fault))
    return found


def describe(run, damaged: list[tuple[Path, str]]) -> str:
    """``run <id> (<cell> seed=<seed>): artifact <file> cut short (...)``, naming the first file."""
    tags = run.data.tags
    path, fault = damaged[0]
    more = f" (and {len(damaged) - 1} more file(s))" if len(damaged) > 1 else ""
    return (f"run {run.info.run_id} ({tags.get('cell', '?')} seed={tags.get('seed', '?')}): artifact "
            f"{path.name} {fault}: {path}{more}")


def refuse_damaged(runs, suite_path: str | Path, profile: str) -> None:
    """Raise :class:`ArtifactError` naming the first of ``runs`` with a damaged artifact, with the fix."""
    bad = [(run, found) for run in runs if (found := damaged_artifacts(run))]
    if not bad:
        return
    run, found = bad[0]
    more = f"; {len(bad) - 1} more run(s) too" if len(bad) > 1 else ""
    raise ArtifactError(f"{describe(run, found)}{more}; run `pflbench run {suite_path} --profile {profile}` "
                        f"again: it marks such runs FAILED and recomputes them")


def mark_damaged(client, run, damaged: list[tuple[Path, str]]) -> str:
    """Mark FINISHED ``run`` FAILED (its end time kept) with the fault as ``failure_reason``; return
    the line to print."""
    line = describe(run, damaged)
    client.set_tag(run.info.run_id, "failure_reason", f"{line}; recomputed by the next sweep")
    client.set_terminated(run.info.run_id, status="FAILED", end_time=run.info.end_time)
    return f"{line}; marked FAILED, recomputing it"
