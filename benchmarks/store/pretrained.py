"""The worker side of the two-stage pipeline: stage-2 runs read the stage-1 states the parent
resolved (:mod:`benchmarks.running.stages`), by the stage-1 config hash, and never train one.

Kept free of MLflow (a worker imports it when it unpickles the provider, see
:mod:`benchmarks.running.worker`).
"""
from __future__ import annotations

import functools
from dataclasses import dataclass

import torch

from benchmarks.suite.spec import config_hash
from pfl_core.config import RunConfig
from pfl_core.pretrained import PretrainedState


@dataclass(frozen=True)
class StoredState:
    """One resolved stage 1: its MLflow run and where its state is (a local file for workers on
    this machine, the state itself for Ray tasks), or why it has none (the stage-1 run failed)."""

    config_hash: str
    run_id: str
    path: str | None = None
    state: PretrainedState | None = None
    error: str | None = None


@functools.lru_cache(maxsize=4)
def _load(path: str) -> PretrainedState:
    return torch.load(path, map_location="cpu", weights_only=True)


@dataclass(frozen=True)
class StoredPretraining:
    """A :data:`pfl_core.pretrained.Provider` over the stage-1 states of one sweep (picklable)."""

    states: dict[str, StoredState]

    def _stored(self, stage1: RunConfig) -> StoredState:
        wanted = config_hash(stage1.to_dict())
        stored = self.states.get(wanted)
        if stored is None:
            raise RuntimeError(f"model.pretrained: stage 1 (config hash {wanted}) was not resolved before this run; "
                               "stage-2 runs start only from stored stage-1 runs (benchmarks.running.stages)")
        if stored.error is not None:
            raise RuntimeError(f"model.pretrained: stage 1 (config hash {wanted}, pretraining run {stored.run_id}) "
                               f"failed: {stored.error}")
        return stored

    def __call__(self, stage1: RunConfig) -> PretrainedState:
        stored = self._stored(stage1)
        return stored.state if stored.state is not None else _load(stored.path)

    def provenance(self, stage1: RunConfig) -> dict:
        """The stage-1 config hash and MLflow run a stage-2 run starts from (its ``run_info.json``
        and tags ``pretrained.*``)."""
        stored = self._stored(stage1)
        return {"config_hash": stored.config_hash, "run_id": stored.run_id}
