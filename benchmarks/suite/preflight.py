"""The sweep's pre-flight (issue 29, item 1): every cell of the sweep resolved as far as it can be
without training, before the first run is computed and on ``--dry-run``, so a cell that cannot run
fails the command in one line (file, key, cell, fix) instead of failing runs one by one.

Checked per run configuration: local training that would be empty (``local_epochs`` and
``local_steps`` both 0). Checked per distinct (data configuration, seed): the dataset's files are
present and sound (:mod:`pfl_core.data.integrity`), the partition can be drawn for the dataset's
sizes, and the evaluation protocol finds its clients in the resulting split (e.g. ``unseen`` with
``unseen_fraction: 0`` has none). The data step builds each federation exactly as the run will
(:func:`pfl_core.experiment.run_data`); ``--no-data-check`` (a harness switch) skips it.

On ``--dry-run`` (issue 37, item 2) nothing is downloaded (``PFL_DOWNLOAD=0`` for the data step)
and a dataset that is not there, only partly there or failing its checksum does not stop the
command: :func:`preflight` returns one :class:`DataGap` per dataset and problem, which the dry run
lists after the plan; every other check still fails as before.
"""
from __future__ import annotations

import contextlib
import json
from dataclasses import dataclass

from benchmarks.suite.spec import RunSpec, Suite
from benchmarks.suite.schema import SuiteError


def _data_fix(err: Exception) -> tuple[str, str]:
    """(key, fix) of a data step's error: a dataset's files (not found, partial, checksum, damaged),
    else the partition."""
    from pfl_core.data import DatasetFileError, DatasetNotFoundError

    if isinstance(err, DatasetNotFoundError):
        return "data.dataset", ""
    if isinstance(err, DatasetFileError):
        return "data.dataset", "" if _is_gap(err) else "; use sound files or another --data-dir"
    return "data.partition", "; use a feasible partition, e.g. fewer clients or a smaller min_size"


def _is_gap(err: Exception) -> bool:
    """Whether ``err`` says the data is not (all, or not verifiably) there: what a dry run lists
    instead of failing (not found, partial, checksum failed)."""
    from pfl_core.data import DatasetNotFoundError
    from pfl_core.data.errors import DatasetChecksumError

    return isinstance(err, (DatasetNotFoundError, DatasetChecksumError))


@dataclass
class DataGap:
    """A dataset a dry run found missing, partial or failing its checksum, and the runs that need it."""

    dataset: str
    kind: str
    """``missing``, ``partial`` or ``checksum failed``."""
    message: str
    """The loader's one line: the path expected and the fix."""
    runs: int = 0

    def line(self) -> str:
        return f"  {self.dataset}: {self.kind} ({self.runs} run{'s' * (self.runs != 1)}): {self.message}"


def _gap_kind(err: Exception) -> str:
    from pfl_core.data.errors import DatasetChecksumError, DatasetPartialError

    if isinstance(err, DatasetPartialError):
        return "partial"
    return "checksum failed" if isinstance(err, DatasetChecksumError) else "missing"


def _fail(suite: Suite, spec: RunSpec, key: str, problem: str) -> SuiteError:
    return SuiteError(f"{suite.path}: cell {spec.cell_id}, seed {spec.seed}, profile {spec.profile}: {key}: "
                      f"{' '.join(problem.split())}")


def check_local_training(suite: Suite, spec: RunSpec) -> None:
    """Reject a method whose local training is empty: ``local_epochs`` and ``local_steps`` both 0."""
    from pfl_core.algorithms import METHODS

    hp = METHODS.get(spec.method).hyper_class.from_dict(spec.config["method"].get("params") or {})
    if getattr(hp, "local_epochs", None) == 0 and getattr(hp, "local_steps", 0) == 0:
        raise _fail(suite, spec, "method.params.local_epochs", "0 local epochs and 0 local steps train nothing; "
                                                               "use local_epochs >= 1 or local_steps >= 1")


def check_data(suite: Suite, spec: RunSpec, data_dir: str | None) -> None:
    """Build the run's federation (load, partition, split) and find the protocol's clients in it."""
    from pfl_core.config import RunConfig
    from pfl_core.evaluation import EvalConfig
    from pfl_core.experiment import run_data
    from pfl_core.evaluation import PROTOCOLS
    from pfl_core.seeding import RunStreams

    cfg = RunConfig.from_dict(spec.config)
    try:
        _, fed = run_data(cfg, RunStreams(cfg.seed), data_dir)
    except (FileNotFoundError, ValueError) as err:
        key, fix = _data_fix(err)
        raise _fail(suite, spec, key, f"{err}{fix}") from err
    protocol = PROTOCOLS.get(cfg.evaluation.protocol)(EvalConfig.from_dict(cfg.evaluation.params),
                                                      target=cfg.evaluation.target)
    try:
        clients = protocol.client_ids(fed)
    except ValueError as err:
        raise _fail(suite, spec, "evaluation.protocol", f"{err}; or use another protocol, e.g. seen") from None
    if not clients:
        raise _fail(suite, spec, "evaluation.protocol", f"protocol {cfg.evaluation.protocol!r} finds no client "
                                                        f"to evaluate; use another protocol or data split")


def preflight(suite: Suite, specs: list[RunSpec], data_dir: str | None = None, data: bool = True,
              dry_run: bool = False) -> list[DataGap]:
    """Every check above for every run of ``specs``; the first failure raises :class:`SuiteError`.
    ``dry_run``: no download, and a dataset that is missing, partial or failing its checksum is
    returned as a :class:`DataGap` (its runs' data checks skipped) instead of failing; [] otherwise."""
    from pfl_core.data.datasets import no_downloads

    seen: dict[str, DataGap | None] = {}
    gaps: dict[tuple[str, str], DataGap] = {}
    with no_downloads() if dry_run else contextlib.nullcontext():
        for spec in specs:
            check_local_training(suite, spec)
            if not data or spec.stage == "pretrain":
                continue
            key = json.dumps([spec.config["data"], spec.config["evaluation"], spec.seed,
                              spec.config["federation"]["batch_size"]], sort_keys=True, default=str)
            if key not in seen:
                seen[key] = None
                try:
                    check_data(suite, spec, data_dir)
                except SuiteError as failed:
                    if not (dry_run and _is_gap(failed.__cause__)):
                        raise
                    err = failed.__cause__
                    found = DataGap(spec.config["data"]["dataset"], _gap_kind(err), " ".join(str(err).split()))
                    seen[key] = gaps.setdefault((found.dataset, found.message), found)
            if seen[key] is not None:
                seen[key].runs += 1
    if data:
        from pfl_core.experiment import _cached_dataset, _cached_sources

        _cached_dataset.cache_clear(), _cached_sources.cache_clear()  # the workers load their own
    return list(gaps.values())
