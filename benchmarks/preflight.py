"""The sweep's pre-flight (issue 29, item 1): every cell of the sweep resolved as far as it can be
without training, before the first run is computed and on ``--dry-run``, so a cell that cannot run
fails the command in one line (file, key, cell, fix) instead of failing runs one by one.

Checked per run configuration: local training that would be empty (``local_epochs`` and
``local_steps`` both 0). Checked per distinct (data configuration, seed): the dataset's files are
present and sound (:mod:`pfl_core.data.integrity`), the partition can be drawn for the dataset's
sizes, and the evaluation protocol finds its clients in the resulting split (e.g. ``unseen`` with
``unseen_fraction: 0`` has none). The data step builds each federation exactly as the run will
(:func:`pfl_core.experiment.run_data`); ``--no-data-check`` (a harness switch) skips it.
"""
from __future__ import annotations

import json

from benchmarks.suite import RunSpec, Suite
from benchmarks.suite_schema import SuiteError

_DATA_FIX = {
    "DatasetNotFoundError": ("data.dataset", ""),
    "DatasetFileError": ("data.dataset", "; use sound files or another --data-dir"),
}


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
        partition_fix = "; use a feasible partition, e.g. fewer clients or a smaller min_size"
        key, fix = _DATA_FIX.get(type(err).__name__, ("data.partition", partition_fix))
        raise _fail(suite, spec, key, f"{err}{fix}") from None
    protocol = PROTOCOLS.get(cfg.evaluation.protocol)(EvalConfig.from_dict(cfg.evaluation.params),
                                                      target=cfg.evaluation.target)
    try:
        clients = protocol.client_ids(fed)
    except ValueError as err:
        raise _fail(suite, spec, "evaluation.protocol", f"{err}; or use another protocol, e.g. seen") from None
    if not clients:
        raise _fail(suite, spec, "evaluation.protocol", f"protocol {cfg.evaluation.protocol!r} finds no client "
                                                        f"to evaluate; use another protocol or data split")


def preflight(suite: Suite, specs: list[RunSpec], data_dir: str | None = None, data: bool = True) -> None:
    """Every check above for every run of ``specs``; the first failure raises :class:`SuiteError`."""
    seen = set()
    for spec in specs:
        check_local_training(suite, spec)
        key = json.dumps([spec.config["data"], spec.config["evaluation"], spec.seed,
                          spec.config["federation"]["batch_size"]], sort_keys=True, default=str)
        if data and spec.stage != "pretrain" and key not in seen:
            seen.add(key)
            check_data(suite, spec, data_dir)
    if data:
        from pfl_core.experiment import _cached_dataset, _cached_sources

        _cached_dataset.cache_clear(), _cached_sources.cache_clear()  # the workers load their own
