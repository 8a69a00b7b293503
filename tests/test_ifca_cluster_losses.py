"""IFCA's cluster choice pass: one forward of the whole train split (models whose samples do not
interact) gives the per-batch loop's summed per-batch mean losses; BatchNorm models keep the loop."""
from __future__ import annotations

import copy

import torch
from torch import nn

from pfl_core.engine.contract import ClientContext
from pfl_core.algorithms.ifca import cluster_losses
from pfl_core.batching import BatchStream
from pfl_core.data.federated import ArrayDataset, Client
from pfl_core.models import build_model
from pfl_core.models.per_sample import per_sample
from pfl_core.training import batch_loss, model_params


def _client(n=23, batch=5, features=7, classes=4) -> ClientContext:
    gen = torch.Generator().manual_seed(0)
    data = ArrayDataset("flat", torch.randn(n, features, generator=gen, dtype=torch.float64),
                        torch.randint(0, classes, (n,), generator=gen), classes)
    client = Client(0, {"train": torch.arange(n)})
    stream = BatchStream(torch.arange(n), batch, torch.Generator().manual_seed(1), reshuffle=True, drop_last=False)
    return ClientContext(client, data, {"train": stream}, {}, None)


def _loop(model, clusters, ctx):
    """The per-batch reference (the CAFeMe code's ``compute_best_model``)."""
    batches = list(ctx.epoch())
    with torch.no_grad():
        return torch.stack([torch.stack([batch_loss(model, p, x, y) for x, y in batches]).sum() for p in clusters])


def test_one_pass_equals_the_per_batch_loop_with_a_partial_last_batch():
    ctx = _client()  # 23 samples in batches of 5: a last batch of 3
    clusters = []
    for seed in range(3):
        torch.manual_seed(seed)
        model = build_model("dnn", (7,), 4, hidden=6).double()
        clusters.append(model_params(model))
    assert per_sample(model)
    expected = _loop(model, clusters, copy.deepcopy(ctx))
    torch.testing.assert_close(cluster_losses(model, clusters, ctx), expected, rtol=1e-12, atol=1e-12)


def test_batchnorm_models_keep_the_per_batch_loop():
    model = nn.Sequential(nn.Linear(7, 6), nn.BatchNorm1d(6, track_running_stats=False), nn.Linear(6, 4)).double()
    assert not per_sample(model)
    ctx = _client()
    clusters = [model_params(model)]
    expected = _loop(model, clusters, copy.deepcopy(ctx))
    torch.testing.assert_close(cluster_losses(model, clusters, ctx), expected, rtol=0, atol=0)
