"""The post-run analysis registry and its runner.

A run configuration asks for analyses as ``evaluation.analyses: [{name: <analysis>, <param>:
<value>, ...}, ...]``. Each registered analysis is a class with a ``params`` dataclass (validated
like a method's hyperparameters, errors naming ``evaluation.analyses[i].<key>``) and a method
``run(setup, result) -> AnalysisOutput`` that reads the finished run (its :class:`RunSetup` and
:class:`FederationResult`) and never changes it.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, ClassVar

import numpy as np
import torch

from pfl_core.fields import ConfigError
from pfl_core.federation import make_contexts
from pfl_core.registry import Registry, UnknownNameError

ANALYSES: Registry = Registry("post-run analysis")

#: the final metrics analyses may log (a suite's ``metric.key`` may name them)
ANALYSIS_METRICS = ("embeddings_logged", "dlg_psnr", "dlg_ssim", "dlg_gradient_distance",
                    "ari_xi", "ari_beta", "ari_x", "ari_eta", "lr_sparsity")


@dataclass
class AnalysisOutput:
    metrics: dict[str, float] = field(default_factory=dict)
    arrays: dict[str, dict[str, np.ndarray]] = field(default_factory=dict)
    """artifact name -> arrays (logged as ``<artifact name>.npz``)."""

    def merge(self, other: "AnalysisOutput") -> "AnalysisOutput":
        clash = (set(self.metrics) & set(other.metrics)) | (set(self.arrays) & set(other.arrays))
        if clash:
            raise ConfigError(f"evaluation.analyses: two analyses write {sorted(clash)}; list each once",
                              "evaluation.analyses")
        return AnalysisOutput({**self.metrics, **other.metrics}, {**self.arrays, **other.arrays})


class Analysis:
    """Base class: ``params_class`` is a :class:`pfl_core.algorithms.base.HyperParams` dataclass."""

    params_class: ClassVar[type]

    def __init__(self, params):
        self.params = params

    def run(self, setup, result) -> AnalysisOutput:
        raise NotImplementedError


def parse_analyses(entries: Any) -> list[Analysis]:
    """``evaluation.analyses`` -> analysis objects; a bad entry raises :class:`ConfigError` naming it."""
    if not isinstance(entries, list):
        raise ConfigError(f"evaluation.analyses: expected a list of {{name: ..., ...}}, got {entries!r}",
                          "evaluation.analyses")
    out = []
    for i, entry in enumerate(entries):
        where = f"evaluation.analyses[{i}]"
        if not isinstance(entry, dict) or "name" not in entry:
            raise ConfigError(f"{where}: expected {{name: <analysis>, ...}} with name one of "
                              f"{ANALYSES.names()}, got {entry!r}", where)
        try:
            cls = ANALYSES.get(entry["name"])
        except UnknownNameError as err:
            raise ConfigError(f"{where}.name: {err}", f"{where}.name") from None
        params = {k: v for k, v in entry.items() if k != "name"}
        try:
            out.append(cls(cls.params_class.from_dict(params, where=f"{where} ({entry['name']}): ",
                                                      path=f"{where}.")))
        except ConfigError as err:  # a rule between fields (__post_init__) names the field alone
            if err.key is None or err.key.startswith(where):
                raise
            raise ConfigError(f"{where} ({entry['name']}): {err}", f"{where}.{err.key}") from None
    return out


def run_analyses(analyses: list[Analysis], setup, result) -> AnalysisOutput:
    """Every analysis of a finished run, merged (an analysis's names must not clash with another's)."""
    out = AnalysisOutput()
    for analysis in analyses:
        out = out.merge(analysis.run(setup, result))
    return out


def evaluated_contexts(setup, result, purpose: str) -> dict:
    """A context per client the run's protocol evaluates, carrying the client's final state (as
    the protocol's own evaluation does), so ``algorithm.predictor`` gives the evaluated model."""
    ids = setup.protocol.client_ids(setup.fed)
    states = {cid: ctx.state for cid, ctx in result.contexts.items()}
    cfg = setup.cfg.federation
    return make_contexts(setup.fed, ids, cfg, setup.streams, purpose, cfg.batch_size, states)


def to_pixels(dataset, x):
    """Undo the dataset's input normalisation (``ArrayDataset.batch``): model inputs -> pixels."""
    if dataset.mean is None:
        return x
    if isinstance(dataset.mean, torch.Tensor):
        return x * dataset.std.to(x.device) + dataset.mean.to(x.device)
    shape = (1, -1) + (1,) * (x.dim() - 2)
    mean = torch.tensor(dataset.mean, device=x.device, dtype=x.dtype).view(shape)
    std = torch.tensor(dataset.std, device=x.device, dtype=x.dtype).view(shape)
    return x * std + mean
