"""``embeddings``: the finished model's feature embeddings of evaluation samples, for the t-SNE of
MetaVers Figure 2 ("t-SNE of CINIC-10 test embeddings"; docs/papers/metavers.md).

Each evaluated client's samples of the protocol's split are embedded by the model that client
evaluates with (``algorithm.predictor``: the global model of FedAvg or MetaVers, a Local client's
own model) through :func:`pfl_core.training.embed`, before any evaluation-time fine-tuning. At most
``samples`` of them, drawn without replacement from the pooled samples by the run's seed
(stream ``analysis-embeddings``), are logged as ``embeddings.npz`` with arrays ``embeddings``
[n, d] (float32), ``labels``, ``clients`` and ``index`` (the dataset rows) [n].
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from pfl_core.fields import HyperParams
from pfl_core.analysis.base import ANALYSES, Analysis, AnalysisOutput, evaluated_contexts
from pfl_core.fields import PositiveInt
from pfl_core.training import embed


@dataclass
class EmbeddingExport(HyperParams):
    samples: PositiveInt = 2000
    """At most this many samples, pooled over the evaluated clients (t-SNE costs O(n log n))."""
    batch_size: PositiveInt = 500
    """Samples embedded per forward pass (memory only; no effect on the numbers)."""


@ANALYSES.register("embeddings")
class Embeddings(Analysis):
    params_class = EmbeddingExport

    def run(self, setup, result) -> AnalysisOutput:
        split = getattr(setup.protocol.cfg, "split", "test")  # a protocol without a split setting: test
        contexts = evaluated_contexts(setup, result, "analysis-embeddings")
        pool = [(cid, i) for cid, ctx in contexts.items() if split in ctx.client.splits
                for i in range(ctx.client.size(split))]
        if not pool:
            raise ValueError(f"analysis 'embeddings': the evaluated clients have no {split!r} samples")
        rng = setup.streams.numpy("analysis-embeddings")
        keep = sorted(rng.choice(len(pool), size=min(self.params.samples, len(pool)), replace=False))
        chosen: dict[int, list[int]] = {}
        for k in keep:
            chosen.setdefault(pool[k][0], []).append(pool[k][1])
        vectors, labels, clients, rows_used = [], [], [], []
        with torch.no_grad():
            for cid, rows in chosen.items():
                ctx = contexts[cid]
                params = setup.algorithm.predictor(result.server, ctx)
                index = ctx.client.splits[split][torch.as_tensor(rows, device=ctx.client.splits[split].device)]
                for start in range(0, len(index), self.params.batch_size):
                    x, y = ctx.dataset.batch(index[start:start + self.params.batch_size])
                    vectors.append(embed(setup.model, params, x).float().cpu())
                    labels.append(y.cpu())
                    clients.append(torch.full((len(y),), cid))
                rows_used.append(index.cpu())
        arrays = {"embeddings": torch.cat(vectors).numpy(), "labels": torch.cat(labels).numpy(),
                  "clients": torch.cat(clients).numpy(), "index": torch.cat(rows_used).numpy()}
        return AnalysisOutput({"embeddings_logged": float(len(arrays["labels"]))}, {"embeddings": arrays})
