"""The tags of a run, computed without MLflow: what :class:`benchmarks.store.tracking.Tracker` logs and what
a run record (:mod:`benchmarks.store.records`) holds, so that a machine without MLflow (a lent GPU) writes
the same tags a store would get.
"""
from __future__ import annotations

import json
import shlex
import subprocess
import sys
from pathlib import Path

from benchmarks.store import mlflow_ui as ui
from benchmarks.suite.spec import RunSpec, stage1_hash
from pfl_core.bn_support import evaluation_bn_mode
from pfl_core.config import EvaluationConfig

STAGE_TAG = "stage"
DATA_PROVENANCE_TAG = "data_provenance"
"""Set on a run whose dataset is not the official archive (run info ``data_provenance``, e.g. the
CIFAR-10 reconstruction, :mod:`pfl_core.data.cifar_files`): one line saying which copy it used."""

WALL_BEFORE_RESUME_TAG = "wall_s_before_resume"
"""Set on a run resumed from a checkpoint: the seconds its earlier processes spent up to that
checkpoint (included in its ``wall_s``), or ``unknown`` (a checkpoint older than the field: its
``wall_s`` counts the last process only)."""

BN_EVALUATION_TAG = "bn_evaluation"
"""How the run's evaluation treats the BatchNorm of a model with running statistics (KLD-BN):
``train``, ``eval`` or ``recipe`` (:data:`pfl_core.evaluation.protocol.Protocol.bn_mode`); absent
for a model without BN state."""
TRAIN_MODE_LABEL = "BN train-mode evaluation"
"""Added to the name of a stage-1 run evaluated with BatchNorm in train mode."""
TRAIN_MODE_NOTE = ("its accuracies are a BN train-mode evaluation (each test batch normalised with its own "
                   "statistics, not the running statistics stage 2 starts from), not the paper's Global "
                   "Accuracy (method global_model)")
"""Added to the description of a stage-1 run evaluated with BatchNorm in train mode."""


def bn_evaluation(config: dict) -> str | None:
    """The run's :data:`BN_EVALUATION_TAG` value from its config (None: no BN state, or no model
    named); an unnamed protocol is the default one (:class:`pfl_core.config.EvaluationConfig`)."""
    model = (config.get("model") or {}).get("name")
    if model is None:
        return None
    protocol = (config.get("evaluation") or {}).get("protocol") or EvaluationConfig.protocol
    return evaluation_bn_mode(model, protocol)


def stage_tags(spec: RunSpec, info: dict) -> dict[str, str]:
    """The two-stage pipeline's tags: ``stage=pretrain`` on a stage-1 run; on a run that starts
    from one, its stage-1 config hash (``pretrained.config_hash``) and, once it ran, the stage-1
    MLflow run it loaded (``pretrained.run_id``), or ``pretrained.source`` (imagenet)."""
    if spec.stage:
        return {STAGE_TAG: spec.stage}
    tags, used = {}, info.get("pretrained") or {}
    wanted = stage1_hash(spec.config)
    if wanted:
        tags["pretrained.config_hash"] = wanted
    for key in ("run_id", "source"):
        if key in used:
            tags[f"pretrained.{key}"] = str(used[key])
    return tags

def git_state() -> tuple[str, bool]:
    """(commit, dirty) of the working tree the harness runs from; ("unknown", True) outside git."""
    try:
        commit = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True,
                                check=True).stdout.strip()
        status = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"],
                                capture_output=True, text=True, check=True).stdout
        return commit, bool(status.strip())
    except (OSError, subprocess.CalledProcessError):
        return "unknown", True


def flatten(config: dict, prefix: str = "") -> dict[str, str]:
    """Nested config -> {"data.num_clients": "100", ...} (MLflow params are strings)."""
    flat = {}
    for key, value in config.items():
        name = f"{prefix}{key}"
        if isinstance(value, dict) and value:
            flat.update(flatten(value, name + "."))
        else:
            flat[name] = json.dumps(value) if isinstance(value, (dict, list)) else str(value)
    return flat


def command_line(argv: list[str] | None = None) -> str:
    """The command that runs now, as a shell line (``pflbench run suites/... --profile smoke``)."""
    argv = sys.argv if argv is None else argv
    return shlex.join([Path(argv[0]).name, *argv[1:]]) if argv else ""


def run_tags(spec: RunSpec, suite_meta: dict, outcome: dict, git: tuple[str, bool],
             parent: str | None = None, command: str | None = None) -> dict[str, str]:
    """The tags of a run (``outcome`` empty for a claim made before the run computes), nested
    under the sweep's ``parent`` run, with ``command`` as its source."""
    info = outcome.get("info", {})
    tags = {
        "paper": suite_meta["paper"], "table": suite_meta.get("table", ""),
        "suite": spec.suite, "cell": spec.cell_id, "method": spec.method,
        "seed": str(spec.seed), "profile": spec.profile, "config_hash": spec.config_hash,
        "git_commit": git[0], "git_dirty": str(git[1]).lower(),
        "device": info.get("device", ""),
        "partition_digest": info.get("partition_digest", ""),
        "sampling_digest": info.get("sampling_digest", ""),
        # how the run was computed (never part of the config hash): sequential/batched, lockstep group size
        "execution": info.get("execution", ""),
        "lockstep_runs": str(info.get("lockstep_runs", "")),
        "execution_choice": info.get("execution_choice", ""),  # why auto chose the path (empty: asked for)
        "torch_threads": str(info.get("torch_threads", "")),
        "deterministic": str(bool(info.get("deterministic", False))).lower(),
        # what GPU numbers depend on (pfl_core.engine.device.device_info)
        "device_name": str(info.get("device_name", "")),
        "torch_version": str(info.get("torch_version", "")),
        "cuda_version": str(info.get("cuda_version", "")),
        "cudnn_version": str(info.get("cudnn_version", "")),
        "allow_tf32": str(bool(info.get("allow_tf32", False))).lower(),
        "cpu_capability": str(info.get("cpu_capability", "")),  # ATen's CPU kernels: moves CPU rounding
        "mlflow.runName": ui.run_name(spec.cell, spec.method, spec.seed),  # for reading; found by tags
        ui.RUN_KIND_TAG: ui.CELL,
        ui.NOTE_TAG: ui.run_description(suite_meta["paper"], suite_meta.get("table", ""), spec.cell_id,
                                        spec.seed, spec.profile),
        ui.SOURCE_NAME_TAG: command or command_line(), ui.SOURCE_TYPE_TAG: ui.SOURCE_TYPE,
        **{f"cell.{k}": v for k, v in spec.cell.items()},
        **getattr(spec, "tags", {}),  # tuned=true|false and tuned.* provenance (benchmarks.tuning.tune)
    }
    if parent:
        tags[ui.PARENT_TAG] = parent
    tags.update(stage_tags(spec, info))
    bn = bn_evaluation(spec.config)
    if bn:
        tags[BN_EVALUATION_TAG] = bn
        if spec.stage and bn == "train":  # a FedL2P stage 1: its accuracies are not Global Accuracy
            tags["mlflow.runName"] += f" ({TRAIN_MODE_LABEL})"
            tags[ui.NOTE_TAG] += f" | {TRAIN_MODE_NOTE}"
    if info.get("dataset_offline"):
        tags["offline_data"] = "true"
    if info.get("data_provenance"):  # a copy that is not the official archive (issue 37)
        tags[DATA_PROVENANCE_TAG] = str(info["data_provenance"])[:5000]
    if info.get("resumed_from_round"):
        tags["resumed_from_round"] = str(info["resumed_from_round"])
        before = info.get("wall_s_before_resume")
        tags[WALL_BEFORE_RESUME_TAG] = "unknown" if before is None else f"{before:.1f}"
    if "error" in outcome:
        tags["failure_reason"] = outcome["error"][:5000]
    return tags
