"""Run records: one run written as one self-contained JSON file, without MLflow, and loaded into any
MLflow store as if it had run there (``pflbench import RECORDS``).

A machine without MLflow (a lent GPU, :mod:`benchmarks.running.gpu_lend`) writes records; so can a lab that
moves results between machines. A record holds the run's resolved config and hash, the tags the
store would get (:func:`benchmarks.store.run_tags.run_tags`: device, torch/CUDA/cuDNN versions, TF32,
execution path, step capture, ...), its metrics, per-round history and curves, its clients and
``run_info.json``, and the post-run analyses' arrays. It holds no model weights (a stage-1 run, whose
final state stage 2 loads, is refused: run it where the store is).

File: ``<root>/<suite key>/<config hash>.json`` (``reports/reproduced/records/cafeme/table1/...``).
A ``digest`` (SHA-256 of the rest) makes a cut or edited file a *damaged* record; a file without
this module's ``format`` is a *foreign* one; both are refused by :func:`read_record` in one line.
Written atomically (:mod:`pfl_core.atomic_file`): a kill leaves the old file or the new one.
"""
from __future__ import annotations

import base64
import hashlib
import io
import json
from dataclasses import asdict
from pathlib import Path
from typing import Callable, NamedTuple

import numpy as np

from benchmarks import __version__
from benchmarks.store.run_tags import run_tags
from benchmarks.suite.spec import RunSpec, config_hash
from pfl_core.atomic_file import write_text

FORMAT = "pflbench-run-record"
VERSION = 1
OUTCOME_KEYS = ("started", "ended", "metrics", "history", "clients", "curve_mean", "curve_weighted", "info",
                "error", "traceback")


class RecordError(ValueError):
    """A record that cannot be imported: the message is one line naming the file and why."""


class Record(NamedTuple):
    """What :meth:`benchmarks.store.tracking.Tracker.log` takes, read back from a record."""

    spec: RunSpec
    suite_meta: dict
    outcome: dict
    git: tuple[str, bool]
    command: str
    path: Path


def record_path(root: str | Path, spec: RunSpec) -> Path:
    return Path(root) / spec.suite / f"{spec.config_hash}.json"


def _digest(body: dict) -> str:
    return hashlib.sha256(json.dumps(body, sort_keys=True, default=str).encode()).hexdigest()


def _pack_arrays(arrays: dict) -> dict:
    """Post-run analyses (``{name: {key: ndarray}}``) as base64 ``.npz`` bytes per name."""
    packed = {}
    for name, content in (arrays or {}).items():
        buffer = io.BytesIO()
        np.savez_compressed(buffer, **content)
        packed[name] = base64.b64encode(buffer.getvalue()).decode()
    return packed


def _unpack_arrays(packed: dict) -> dict:
    out = {}
    for name, text in packed.items():
        with np.load(io.BytesIO(base64.b64decode(text))) as data:
            out[name] = {k: data[k] for k in data.files}
    return out


def write_record(root: str | Path, spec: RunSpec, suite_meta: dict, outcome: dict, git: tuple[str, bool],
                 command: str) -> Path:
    """Write one run's record under ``root`` (atomically) and return its path."""
    if spec.stage or outcome.get("state") is not None:
        raise RecordError(f"{spec.cell_id} seed {spec.seed}: a stage-1 run keeps model weights, which records "
                          "do not hold; run it where the MLflow store is")
    body = {
        "format": FORMAT, "version": VERSION, "pflbench": __version__,
        "spec": asdict(spec),
        "suite_meta": {"paper": suite_meta["paper"], "table": suite_meta.get("table", "")},
        "git": [git[0], bool(git[1])], "command": command,
        "tags": run_tags(spec, suite_meta, outcome, git, None, command),  # for readers; import recomputes them
        "outcome": {k: outcome[k] for k in OUTCOME_KEYS if k in outcome},
        "arrays": _pack_arrays(outcome.get("arrays")),
    }
    body = json.loads(json.dumps(body, default=str))  # what is written is what the digest covers
    path = record_path(root, spec)
    path.parent.mkdir(parents=True, exist_ok=True)
    write_text(path, json.dumps({**body, "digest": _digest(body)}, indent=None, separators=(",", ":")) + "\n")
    return path


def read_record(path: str | Path) -> Record:
    """The record at ``path``; :class:`RecordError` (one line) when it is foreign or damaged."""
    path = Path(path)
    try:
        data = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as err:
        raise RecordError(f"{path}: damaged record (not readable JSON: {str(err).splitlines()[0]}); "
                          "copy it again from the machine that ran it") from None
    if not isinstance(data, dict) or data.get("format") != FORMAT:
        raise RecordError(f"{path}: not a pflbench run record (no format {FORMAT!r}); only files written by "
                          "pflbench's records (benchmarks/store/records.py) can be imported")
    if data.get("version") != VERSION:
        raise RecordError(f"{path}: record version {data.get('version')!r}, this pflbench reads version {VERSION}; "
                          "import it with the pflbench that wrote it")
    digest = data.pop("digest", None)
    if digest != _digest(data):
        raise RecordError(f"{path}: damaged record (its digest does not match its content: cut or edited); "
                          "copy it again from the machine that ran it")
    try:
        spec = RunSpec(**data["spec"])
        outcome = dict(data["outcome"])
        outcome["arrays"] = _unpack_arrays(data.get("arrays") or {})
        git, command, meta = (data["git"][0], bool(data["git"][1])), data["command"], data["suite_meta"]
    except (KeyError, TypeError, ValueError) as err:
        raise RecordError(f"{path}: damaged record (missing or malformed {err}); "
                          "copy it again from the machine that ran it") from None
    if config_hash(spec.config) != spec.config_hash:
        raise RecordError(f"{path}: its config hashes to {config_hash(spec.config)}, not the recorded "
                          f"{spec.config_hash} (edited, or written by a pflbench with another CONFIG_VERSION)")
    if path.stem != spec.config_hash:
        raise RecordError(f"{path}: the file name is not the run's config hash {spec.config_hash}; rename it back")
    return Record(spec, meta, outcome, git, command, path)


def record_files(paths: list[str | Path]) -> list[Path]:
    """Every ``*.json`` under the given folders, and the given files, in a stable order."""
    files: list[Path] = []
    for given in map(Path, paths):
        files += sorted(given.rglob("*.json")) if given.is_dir() else [given]
    return files


def recorded_hashes(root: str | Path | None, suite_key: str) -> set[str]:
    """Config hashes of the FINISHED runs recorded under ``root`` for one suite (a record that does not
    read is left out here, so its run is computed again; the import names it)."""
    if root is None or not (Path(root) / suite_key).is_dir():
        return set()
    done = set()
    for path in sorted((Path(root) / suite_key).glob("*.json")):
        try:
            record = read_record(path)
        except RecordError:
            continue
        if "error" not in record.outcome:
            done.add(record.spec.config_hash)
    return done


def import_records(tracker, paths: list[str | Path], echo: Callable = print) -> dict[str, int]:
    """Log every record under ``paths`` into ``tracker``'s store as :meth:`Tracker.log` would have
    (same tags, params, metrics, artifacts); a hash already FINISHED there is skipped and said so, a
    foreign or damaged record is refused in one line. Returns the counts."""
    counts = {"imported": 0, "skipped": 0, "refused": 0}
    finished: dict[str, set[str]] = {}
    for path in record_files(paths):
        try:
            record = read_record(path)
        except RecordError as err:
            echo(f"refused: {err}")
            counts["refused"] += 1
            continue
        spec = record.spec
        done = finished.setdefault(spec.suite, tracker.finished_hashes(spec.suite))
        if spec.config_hash in done:
            echo(f"skipped: {spec.suite} {spec.cell_id} seed {spec.seed} ({spec.config_hash}): already FINISHED "
                 "in this store")
            counts["skipped"] += 1
            continue
        tracker.log(spec, record.suite_meta, record.outcome, record.git, command=record.command)
        if "error" not in record.outcome:
            done.add(spec.config_hash)
        echo(f"imported: {spec.suite} {spec.cell_id} seed {spec.seed} ({spec.config_hash})"
             + (" FAILED" if "error" in record.outcome else ""))
        counts["imported"] += 1
    return counts
