"""IFCA's cluster choice pass: one forward of the whole train split (models whose samples do not
interact) gives the per-batch loop's summed per-batch mean losses; BatchNorm models keep the loop;
models whose rows are independent otherwise (CGPFL's CIFAR-10 CNN) get the loop's bits from chunked
forwards and kept per-row logits (pfl_core/algorithms/_lib/cluster_pass.py)."""
from __future__ import annotations

import copy

import pytest
import torch
from torch import nn
from torch.utils._pytree import tree_flatten

from pfl_core.algorithms import METHODS, ifca
from pfl_core.algorithms._lib import cluster_pass
from pfl_core.algorithms._lib.cluster_pass import SplitLogits
from pfl_core.engine.contract import ClientContext
from pfl_core.algorithms.ifca import cluster_losses
from pfl_core.batching import BatchStream
from pfl_core.config import FederationConfig
from pfl_core.data.federated import ArrayDataset, Client, FederatedData
from pfl_core.engine import Executor
from pfl_core.evaluation import EvalConfig
from pfl_core.evaluation.clients import SeenClients
from pfl_core.federation import run_federation
from pfl_core.models import build_model
from pfl_core.models.per_sample import per_sample, rows_independent
from pfl_core.models.pooling import MaxPool2d
from pfl_core.seeding import RunStreams
from pfl_core.training import batch_loss, model_params
from tests.helpers import one_thread  # noqa: F401 (fixture)

pytestmark = pytest.mark.usefixtures("one_thread")  # small models: threads only contend


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


# ---------------------------------------------------------------- the chunked pass (rows independent)

def _conv_model(dtype):
    """Conv -> ReLU -> the project's max-pool -> Linear: rows independent, but not per_sample."""
    return nn.Sequential(nn.Conv2d(3, 4, 3), nn.ReLU(), MaxPool2d(2), nn.Flatten(), nn.Linear(36, 5)).to(dtype)


def _images(n=90, classes=5, dtype=torch.uint8, seed=0) -> ArrayDataset:
    gen = torch.Generator().manual_seed(seed)
    x = torch.randint(0, 256, (n, 3, 8, 8), generator=gen, dtype=torch.uint8)
    return ArrayDataset("img", x if dtype == torch.uint8 else x.to(dtype) / 255,
                        torch.randint(0, classes, (n,), generator=gen), classes)


def _image_client(data, rows, batch=5, seed=1, drop_last=False, reshuffle=False) -> ClientContext:
    stream = BatchStream(rows, batch, torch.Generator().manual_seed(seed), reshuffle=reshuffle, drop_last=drop_last)
    return ClientContext(Client(0, {"train": rows}), data, {"train": stream}, {}, None)


def _clusters(make, k=3):
    out = []
    for seed in range(k):
        torch.manual_seed(seed)
        out.append(model_params(make()))
    return out


def _reference(model, clusters, ctx):
    """The loop over the batches the context's stream yields now (a copy: the stream is not advanced)."""
    return _loop(model, clusters, copy.deepcopy(ctx))


@pytest.fixture
def small_chunks(monkeypatch):
    """Chunks of 4 batches of 5: several chunks and a padded last one on 60-70 rows."""
    monkeypatch.setattr(cluster_pass, "CHUNK_ROWS", 20)


@pytest.mark.usefixtures("small_chunks")
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("n,drop_last", [(67, False), (67, True), (60, False), (3, False)])
def test_chunked_pass_gives_the_loops_bits(dtype, n, drop_last):
    """67 rows in batches of 5: a partial last batch of 2 (forwarded alone) or dropped; 3 rows: one short batch."""
    data = _images(dtype=torch.float32 if dtype == torch.float32 else dtype)
    model = _conv_model(dtype)
    assert rows_independent(model) and not per_sample(model)
    clusters = _clusters(lambda: _conv_model(dtype))
    ctx = _image_client(data, torch.randperm(90, generator=torch.Generator().manual_seed(n))[:n], drop_last=drop_last)
    expected = _reference(model, clusters, ctx)
    assert torch.equal(cluster_losses(model, clusters, ctx), expected)


@pytest.mark.usefixtures("small_chunks")
def test_the_kept_logits_serve_another_order_of_the_same_rows_and_not_other_clusters():
    """The evaluation's pass (its own stream order) leaves the logits; the next pass over the same
    clusters reads them with the loop's bits; a changed or replaced cluster tensor is recomputed."""
    data, model = _images(), _conv_model(torch.float32)
    clusters = _clusters(lambda: _conv_model(torch.float32))
    rows = torch.arange(10, 77)
    cache = SplitLogits()
    first = _image_client(data, rows, seed=1)
    assert torch.equal(cluster_losses(model, clusters, first, cache), _reference(model, clusters, first))
    second = _image_client(data, rows, seed=2)  # another order, another partial batch
    expected = _reference(model, clusters, second)
    assert not torch.equal(expected, _reference(model, clusters, first))  # the sums do differ
    assert cache.get(model, clusters, data, rows) is not None
    assert torch.equal(cluster_losses(model, clusters, second, cache), expected)
    with torch.no_grad():
        clusters[1]["0.weight"].mul_(1.5)  # in place: the version moves
    assert cache.get(model, clusters, data, rows) is None
    assert torch.equal(cluster_losses(model, clusters, second, cache), _reference(model, clusters, second))
    clusters[2] = {k: v * 0.5 for k, v in clusters[2].items()}  # new tensors
    assert cache.get(model, clusters, data, rows) is None
    assert torch.equal(cluster_losses(model, clusters, second, cache), _reference(model, clusters, second))


@pytest.mark.usefixtures("small_chunks")
def test_a_partial_batch_is_forwarded_at_its_own_size():
    """A kernel may round a batch of 2 rows otherwise than the same rows among 20 (a CPU does, for
    CGPFL's CNN): a hook plays such a kernel; the partial batch must come from its own forward."""
    data, model = _images(), _conv_model(torch.float32)
    model[4].register_forward_hook(lambda module, inputs, out: out * 1.01 if out.shape[0] < 5 else out)
    clusters = _clusters(lambda: _conv_model(torch.float32))
    ctx = _image_client(data, torch.arange(67))  # 13 batches of 5 and one of 2
    assert torch.equal(cluster_losses(model, clusters, ctx), _reference(model, clusters, ctx))


@pytest.mark.usefixtures("small_chunks")
@pytest.mark.parametrize("rows,k", [(67, 3), (13, 1)])  # several chunk shapes; one chunk, one cluster
def test_a_shape_that_fails_its_check_takes_the_loop(monkeypatch, rows, k):
    data, model = _images(), _conv_model(torch.float32)
    clusters = _clusters(lambda: _conv_model(torch.float32), k)
    ctx = _image_client(data, torch.arange(rows))
    monkeypatch.setattr(cluster_pass, "_VERIFIED", {})
    real_forward = cluster_pass.forward

    def skewed(model, params, x):  # a kernel whose big shapes round differently
        out = real_forward(model, params, x)
        return out * 1.01 if x.shape[0] > 5 else out

    monkeypatch.setattr(cluster_pass, "forward", skewed)
    cache = SplitLogits()
    assert torch.equal(cluster_losses(model, clusters, ctx, cache), _reference(model, clusters, ctx))
    assert set(cluster_pass._VERIFIED.values()) == {False}
    assert cache.get(model, clusters, data, ctx.streams["train"].index) is None


def test_cgpfl_cnn_choice_is_the_argmin_of_the_loop():
    """CGPFL's CIFAR-10 CNN (float32, batches of 20, a last batch of one or two rows, whose logits a
    CPU may compute otherwise than in a batch of 20: forwarded at their own size): the same losses
    bit for bit and the same chosen cluster, which is not the argmax."""
    gen = torch.Generator().manual_seed(3)
    data = ArrayDataset("cifar", torch.randint(0, 256, (300, 3, 32, 32), generator=gen, dtype=torch.uint8),
                        torch.randint(0, 10, (300,), generator=gen), 10)
    torch.manual_seed(0)
    model = build_model("cgpfl_cnn", (3, 32, 32), 10)
    assert rows_independent(model) and not per_sample(model)
    alg = METHODS.get("ifca")(model, METHODS.get("ifca").hyper_class.from_dict({"num_clusters": 4}))
    server = alg.init_server(model_params(model))
    for rows in (torch.arange(7, 289, 2), torch.arange(22)):  # 7 x 20 + 1 and 20 + 2 rows
        ctx = _image_client(data, rows, batch=20)
        expected = _reference(model, server["clusters"], ctx)
        assert torch.equal(cluster_losses(model, server["clusters"], ctx), expected)
        assert int(expected.argmin()) != int(expected.argmax())
        assert alg.choose_cluster(server, ctx) == int(expected.argmin())
        assert alg.choose_cluster(server, ctx) == int(expected.argmin())  # again, from the kept logits


def _run(execution, sizes=(23, 14, 31, 9), rounds=3):
    """IFCA with 3 clusters on the conv model, float32 images, batches of 5 with partial last batches,
    an evaluation after every round (whose passes leave the logits for the next round's)."""
    gen = torch.Generator().manual_seed(5)
    total = sum(sizes) + 4 * len(sizes)
    data = ArrayDataset("img", torch.randint(0, 256, (total, 3, 8, 8), generator=gen, dtype=torch.uint8),
                        torch.randint(0, 5, (total,), generator=gen), 5)
    clients, start = [], 0
    for cid, n in enumerate(sizes):
        clients.append(Client(cid, {"train": torch.arange(start, start + n), "test": torch.arange(start + n, start + n + 4)}))
        start += n + 4
    fed = FederatedData(data, clients, list(range(len(sizes))))
    torch.manual_seed(0)
    model = _conv_model(torch.float32)
    cls = METHODS.get("ifca")
    algorithm = cls(model, cls.hyper_class.from_dict({"lr": 0.3, "local_epochs": 1, "num_clusters": 3}))
    cfg = FederationConfig(rounds=rounds, clients_per_round=3, batch_size=5, drop_last=False, eval_every=1)
    return run_federation(algorithm, fed, model_params(model), cfg, SeenClients(EvalConfig(steps=0)),
                          RunStreams(0), executor=Executor(execution))


@pytest.mark.usefixtures("small_chunks")
@pytest.mark.parametrize("execution", ["sequential", "batched"])
def test_runs_with_an_evaluation_every_round_keep_the_loops_numbers(monkeypatch, execution):
    """Whole runs: server, client states (the chosen clusters), history and curves bit for bit as
    with the per-batch loop, while most training passes read the logits the evaluation left."""
    computed = []
    real = cluster_pass.split_logits
    monkeypatch.setattr(cluster_pass, "split_logits", lambda *a: computed.append(1) or real(*a))
    fast = _run(execution)
    monkeypatch.setattr(ifca, "rows_independent", lambda model: False)  # the loop, as before the chunked pass
    loop = _run(execution)
    assert len(computed) == 3 * 4 + 3  # one per evaluated client and round, plus the first round's 3
    leaves = lambda run: tree_flatten((run.server, {c: x.state for c, x in run.contexts.items()}))[0]
    assert all(torch.equal(a, b) if isinstance(a, torch.Tensor) else a == b for a, b in zip(leaves(fast), leaves(loop)))
    assert fast.history == loop.history and fast.sampled == loop.sampled
    assert [r.acc + r.loss for r in fast.final.clients] == [r.acc + r.loss for r in loop.final.clients]
    assert len({x.state["cluster"] for x in fast.contexts.values()}) > 1  # the clients do not all pick one cluster
