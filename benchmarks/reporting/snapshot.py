"""Curated snapshots of reproduced tables: a suite's finished runs, exported from the MLflow store to
one JSON file that is committed (``reports/reproduced/<paper>/<suite>.snapshot.json``) and rendered
later by the same report code, with no store and no rerun.

A snapshot holds, per run, its tags (config hash, git commit, device, data provenance, ...), its
final metrics and the metric histories its report reads, plus ``provenance``: what the exporter
says about the whole (machine, command, wall-clock, data). :class:`SnapshotTracker` reads it back and
answers the two questions the report asks of a :class:`benchmarks.store.tracking.Tracker` (the suite's
runs; a run's metric history), so a snapshot renders exactly as the store it came from.
"""
from __future__ import annotations

import base64
import json
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from types import SimpleNamespace

from benchmarks.reporting.metric import metric_spec
from pfl_core.atomic_file import write_text
from benchmarks.suite.schema import SuiteError
from benchmarks.suite.spec import Suite
from benchmarks.store.run_tags import WALL_BEFORE_RESUME_TAG
from benchmarks.store.tracking import DATA_PROVENANCE_TAG, Tracker

FORMAT = 1


def history_keys(suite: Suite) -> list[str]:
    """The metric histories a suite's reports read (:func:`benchmarks.reporting.collect.collect_runs`),
    over every profile (a profile's ``metric`` may aggregate otherwise)."""
    keys = []
    for profile in suite.profiles:
        metric = metric_spec(suite, profile)
        keys += [*metric.history_keys, *metric.figure_histories]
    return list(dict.fromkeys(keys))


def artifact_names(suite: Suite) -> list[str]:
    """The run artifacts a suite's qualitative figures draw (``dlg``: the attacked image and its
    reconstruction; ``tsne``: the embeddings), over every profile: a snapshot carries them (a few KB
    each) so the figure renders without the store."""
    from benchmarks.reporting.qualitative import KINDS

    figures = {metric_spec(suite, profile).figure for profile in suite.profiles}
    return [f"{KINDS[f][0]}.npz" for f in sorted(figures) if f in KINDS]


def _selected(run, profiles: list[str] | None, only: dict[str, list[str]] | None) -> bool:
    """Whether a store run belongs in the export: a result (FINISHED or FAILED, never a claim or a run
    in progress), of one of ``profiles`` (its ``profile`` tag) and of the cells ``only`` names (its
    ``cell.<axis>`` tags, as ``pflbench run --only`` selects them)."""
    tags = run.data.tags
    return (run.info.status in ("FINISHED", "FAILED") and (not profiles or tags.get("profile") in profiles)
            and all(tags.get(f"cell.{axis}") in values for axis, values in (only or {}).items()))


def _selected_runs(suite: Suite, tracker: Tracker, profiles: list[str] | None,
                   only: dict[str, list[str]] | None) -> list:
    """The store's runs of the suite that :func:`_selected` keeps (tags only: nothing fetched yet)."""
    return [run for run in tracker.runs(suite.key, status=None) if _selected(run, profiles, only)]


def _record(suite_keys: tuple[list[str], list[str]], tracker: Tracker, run) -> dict:
    """One store run as a snapshot record: tags, final metrics, and the histories and artifacts
    (``suite_keys``: :func:`history_keys`, :func:`artifact_names`) the suite's reports read."""
    keys, wanted = suite_keys
    finished = run.info.status == "FINISHED"
    histories = {k: [[m.step, m.value, m.timestamp] for m in tracker.client.get_metric_history(run.info.run_id, k)]
                 for k in keys} if finished else {}
    record = {"run_id": run.info.run_id, "status": run.info.status, "end_time": run.info.end_time,
              "tags": {k: v for k, v in run.data.tags.items() if not k.startswith("mlflow.")},
              "metrics": dict(run.data.metrics), "histories": histories}
    artifacts = _artifacts(tracker, run.info.run_id, wanted) if finished else {}
    if artifacts:
        record["artifacts"] = artifacts
    return record


def _write(path: Path, suite_key: str, provenance: dict, runs: list[dict]) -> None:
    runs.sort(key=lambda r: (r["tags"].get("cell", ""), r["tags"].get("seed", ""), r["end_time"] or 0))
    payload = {"format": FORMAT, "suite": suite_key, "provenance": provenance, "runs": runs}
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    write_text(path, json.dumps(payload, indent=1, sort_keys=True) + "\n")


def export_snapshot(suite: Suite, tracker: Tracker, path: Path, provenance: dict | None = None,
                    profiles: list[str] | None = None, only: dict[str, list[str]] | None = None) -> int:
    """Write the suite's cell runs (failed ones too, with their reasons) to ``path``: every profile's,
    or those of ``profiles`` (the runs' ``profile`` tag), of every cell or those ``only`` names;
    returns how many finished."""
    suite_keys = history_keys(suite), artifact_names(suite)
    runs = [_record(suite_keys, tracker, run) for run in _selected_runs(suite, tracker, profiles, only)]
    _write(path, suite.key, provenance or {}, runs)
    return sum(r["status"] == "FINISHED" for r in runs)


@dataclass(frozen=True)
class Merged:
    """What :func:`merge_into_snapshot` did: records added, selected records the file already held,
    and the file's records afterwards."""

    added: list[dict]
    already: int
    total: int


def merge_into_snapshot(suite: Suite, tracker: Tracker, path: Path, notes: dict | None = None,
                        profiles: list[str] | None = None, only: dict[str, list[str]] | None = None) -> Merged:
    """Add the store's selected runs (as :func:`export_snapshot` selects them) that committed snapshot
    ``path`` does not hold yet (by run id) to it, keeping every record it has; each of ``notes``
    extends the provenance entry of its key ("old; new") or starts one. The way a table grows by a
    column or a profile run later, without re-exporting (and so re-dating) the runs already there."""
    if not Path(path).exists():
        raise SuiteError(f"snapshot --into {path}: no such file; export it first with --out {path}")
    data = json.loads(Path(path).read_text())
    if data.get("format") != FORMAT:
        raise SuiteError(f"{path}: snapshot format {data.get('format')!r}, this version writes {FORMAT}")
    if data["suite"] != suite.key:
        raise SuiteError(f"snapshot --into {path}: it holds {data['suite']}, not {suite.key}; name that suite")
    have = {r["run_id"] for r in data["runs"]}
    selected = _selected_runs(suite, tracker, profiles, only)
    suite_keys = history_keys(suite), artifact_names(suite)  # histories fetched for new runs only
    added = [_record(suite_keys, tracker, run) for run in selected if run.info.run_id not in have]
    provenance = dict(data.get("provenance") or {})
    for key, value in (notes or {}).items():
        provenance[key] = f"{provenance[key]}; {value}" if provenance.get(key) else value
    if added or notes:
        _write(path, suite.key, provenance, data["runs"] + added)
    return Merged(added, len(selected) - len(added), len(data["runs"]) + len(added))


def _artifacts(tracker: Tracker, run_id: str, names: list[str]) -> dict[str, str]:
    """name -> the artifact's bytes in base64, for each of ``names`` the run logged."""
    if not names:
        return {}
    logged = {f.path for f in tracker.client.list_artifacts(run_id)}
    out = {}
    with tempfile.TemporaryDirectory() as tmp:
        for name in names:
            if name in logged:
                out[name] = base64.b64encode(Path(tracker.client.download_artifacts(run_id, name, tmp)).read_bytes()).decode()
    return out


@dataclass
class _Metric:
    step: int
    value: float
    timestamp: int


@dataclass
class SnapshotTracker:
    """A read-only stand-in for :class:`benchmarks.store.tracking.Tracker` over one snapshot file."""

    suite_key: str
    provenance: dict
    records: list[dict] = field(repr=False)
    by_id: dict[str, dict] = field(init=False, repr=False)

    def __post_init__(self):
        self.by_id = {r["run_id"]: r for r in self.records}

    @classmethod
    def load(cls, path: Path) -> "SnapshotTracker":
        data = json.loads(Path(path).read_text())
        if data.get("format") != FORMAT:
            raise ValueError(f"{path}: snapshot format {data.get('format')!r}, this version reads {FORMAT}")
        return cls(data["suite"], data.get("provenance") or {}, data["runs"])

    @property
    def client(self) -> "SnapshotTracker":
        return self

    def runs(self, suite_key: str, status: str | None = "FINISHED", kind: str | None = None) -> list:
        if suite_key != self.suite_key:
            return []
        return [_as_run(r) for r in self.records if status is None or r["status"] == status]

    def get_metric_history(self, run_id: str, key: str) -> list[_Metric]:
        return [_Metric(*m) for m in self.by_id[run_id]["histories"].get(key, [])]

    def get_run(self, run_id: str) -> SimpleNamespace:
        return _as_run(self.by_id[run_id])

    def list_artifacts(self, run_id: str) -> list[SimpleNamespace]:
        return [SimpleNamespace(path=name) for name in self.by_id[run_id].get("artifacts", {})]

    def download_artifacts(self, run_id: str, path: str, dst_path: str) -> str:
        """Write the carried artifact ``path`` under ``dst_path`` (as MLflow's client does); its path."""
        out = Path(dst_path) / path
        out.write_bytes(base64.b64decode(self.by_id[run_id]["artifacts"][path]))
        return str(out)


def _as_run(record: dict) -> SimpleNamespace:
    """A snapshot record in the shape of an MLflow run (``info``, ``data``), as the report reads it."""
    return SimpleNamespace(info=SimpleNamespace(run_id=record["run_id"], status=record["status"],
                                                end_time=record["end_time"]),
                           data=SimpleNamespace(tags=record["tags"], metrics=record["metrics"]))


@dataclass
class SnapshotSet:
    """Several snapshots, one per suite (a paper's committed tables), read as one tracker: ``pflbench
    report --from-snapshot A --from-snapshot B`` renders them into one PDF."""

    snapshots: dict[str, SnapshotTracker]

    @classmethod
    def load(cls, paths: list[Path]) -> "SnapshotSet":
        snapshots: dict[str, SnapshotTracker] = {}
        for path in paths:
            snapshot = SnapshotTracker.load(Path(path))
            if snapshot.suite_key in snapshots:
                raise SuiteError(f"{path}: a second snapshot of {snapshot.suite_key}; give one file per suite")
            snapshots[snapshot.suite_key] = snapshot
        return cls(snapshots)

    @property
    def client(self) -> "SnapshotSet":
        return self

    def runs(self, suite_key: str, status: str | None = "FINISHED", kind: str | None = None) -> list:
        snapshot = self.snapshots.get(suite_key)
        return snapshot.runs(suite_key, status, kind) if snapshot else []

    def _of(self, run_id: str) -> SnapshotTracker:
        for snapshot in self.snapshots.values():
            if run_id in snapshot.by_id:
                return snapshot
        raise KeyError(f"run {run_id} is in none of the snapshots")

    def get_metric_history(self, run_id: str, key: str) -> list[_Metric]:
        return self._of(run_id).get_metric_history(run_id, key)

    def get_run(self, run_id: str) -> SimpleNamespace:
        return self._of(run_id).get_run(run_id)

    def list_artifacts(self, run_id: str) -> list[SimpleNamespace]:
        return self._of(run_id).list_artifacts(run_id)

    def download_artifacts(self, run_id: str, path: str, dst_path: str) -> str:
        return self._of(run_id).download_artifacts(run_id, path, dst_path)


def data_copies(records: list[dict]) -> dict[str, int]:
    """Each data copy that is not the official archive (tag ``data_provenance``) -> its runs."""
    out: dict[str, int] = {}
    for r in records:
        text = r["tags"].get(DATA_PROVENANCE_TAG, "")
        if text:
            out[text] = out.get(text, 0) + 1
    return out


def resumed_without_seconds(records: list[dict]) -> int:
    """Runs resumed from a checkpoint whose earlier processes' seconds are not in their ``wall_s``
    (a checkpoint older than ``elapsed_s``, or a run logged before the tag existed)."""
    return sum(1 for r in records if r["tags"].get("resumed_from_round")
               and r["tags"].get(WALL_BEFORE_RESUME_TAG, "unknown") == "unknown")


def provenance_markdown(tracker: SnapshotTracker, rendered_md: Path) -> str:
    """The snapshot's provenance as a short Markdown page beside its rendered table."""
    lines = [f"# {tracker.suite_key}: reproduced runs (snapshot)", "",
             f"Rendered from `{rendered_md.name.replace('.md', '.snapshot.json')}` by `pflbench report "
             "--from-snapshot`, without rerunning anything; the table is "
             f"[{rendered_md.name}]({rendered_md.name}).", ""]
    for key, value in tracker.provenance.items():
        lines.append(f"- **{key}**: {value}")
    commits = sorted({r["tags"].get("git_commit", "unknown") for r in tracker.records})
    devices = sorted({r["tags"].get("device", "") for r in tracker.records})
    # a lockstep group's runs each record the group's wall-clock: count it once
    wall = sum(r["metrics"].get("wall_s", 0.0) / max(1, int(r["tags"].get("lockstep_runs", "1") or 1))
               for r in tracker.records)
    finished = sum(r["status"] == "FINISHED" for r in tracker.records)
    partial = resumed_without_seconds(tracker.records)
    lines += [f"- **runs**: {finished} finished, {len(tracker.records) - finished} failed",
              f"- **code commits of the runs**: {', '.join(commits)}",
              f"- **devices**: {', '.join(d for d in devices if d) or 'unknown'}",
              f"- **compute time**: {wall / 3600:.2f} h ({wall:.0f} s), the runs' processes summed (a lockstep "
              "group of seeds counted once); parallel workers overlap it"
              + (f"; {partial} run(s) resumed from a checkpoint that did not keep its earlier seconds count "
                 "their last process only (tag wall_s_before_resume: unknown)" if partial else "")]
    lines += [f"- **data provenance** ({n} of {len(tracker.records)} runs): {text}"
              for text, n in data_copies(tracker.records).items()]
    return "\n".join(lines) + "\n"


def snapshot_note(tracker: SnapshotTracker, path: Path) -> str:
    """One line for page 1 of a report that shows the snapshot beside other tables: what it is,
    where it came from, and that nothing was rerun."""
    finished = [r for r in tracker.records if r["status"] == "FINISHED"]
    commits = sorted({r["tags"].get("git_commit", "unknown")[:7] for r in finished})
    data = tracker.provenance.get("data", "").split(" (")[0]
    copies = "".join(f" Data provenance: {text} ({n} runs)." for text, n in data_copies(finished).items())
    return (f"{tracker.suite_key}: a COMMITTED SNAPSHOT of {len(finished)} runs this harness computed earlier "
            f"(code {', '.join(commits) or 'unknown'}{'; data: ' + data if data else ''}), rendered from "
            f"{Path(path).name} without rerunning anything; its verdicts compare it with the published numbers."
            + copies)
