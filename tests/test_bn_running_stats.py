"""BatchNorm running statistics of ``conv4``/``conv4_frl`` (issue 28 item 1): the layers keep them,
MetaVers updates them in the code's passes (``trainer_novel_class.py``: ``meta_update_frl`` and
``triplet_update_frl`` per client, in client order), and the novel-class protocol embeds with them in
eval mode, so an embedding does not depend on the other rows of its batch."""
from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from pfl_core.algorithms.metavers import MetaVersUpdate
from pfl_core.algorithms._lib.bn_passes import replay_passes
from pfl_core.config import FederationConfig
from pfl_core.data.federated import ArrayDataset
from pfl_core.engine import Executor
from pfl_core.evaluation import EvalConfig, PROTOCOLS
from pfl_core.evaluation.clients import SeenClients
from pfl_core.federation import run_federation
from pfl_core.models import build_model
from pfl_core.models.kld_bn import KLDBatchNorm2d
from pfl_core.seeding import RunStreams
from pfl_core.training import initial_bn_state, model_params
from tests.helpers import make_method, one_thread  # noqa: F401
from tests.test_metavers import image_data

pytestmark = pytest.mark.usefixtures("one_thread")
NOVEL = dict(shot=2, query=2, warmup=1, margin_update="client", first_round=1, ce_forward="joint")


def torch_reference(model: nn.Module) -> nn.Module:
    """The same network with ``torch.nn.BatchNorm2d`` (the code's layer), state copied."""
    ref = copy.deepcopy(model)
    for block in ref.blocks:
        old = block[1]
        block[1] = nn.BatchNorm2d(old.num_features)
        block[1].load_state_dict({k: v for k, v in old.state_dict().items() if not k.startswith(("init_", "beta"))})
    return ref


def trained_buffers(model: nn.Module, x: torch.Tensor) -> dict:
    """Running statistics after three train-mode passes of the reference layer on ``x``."""
    ref = torch_reference(model).train()
    for chunk in x.split(3):
        ref(chunk)
    return {k: v for k, v in ref.state_dict().items() if "running" in k or "num_batches" in k}


@pytest.mark.parametrize("name", ["conv4", "conv4_frl"])
def test_the_backbones_keep_torch_batchnorm_running_statistics(name):
    torch.manual_seed(0)
    model = build_model(name, (3, 16, 16), 5)
    assert all(isinstance(b[1], KLDBatchNorm2d) and b[1].momentum == 0.1 and b[1].eps == 1e-5 for b in model.blocks)
    x = torch.randn(9, 3, 16, 16)
    buffers = trained_buffers(model, x)
    ref = torch_reference(model)
    ref.load_state_dict({**ref.state_dict(), **buffers})
    params = model_params(model)
    model.eval()
    out = torch.func.functional_call(model, {**params, **buffers}, (x[:2],))
    torch.testing.assert_close(out, ref.eval()(x[:2]))  # eval mode: the running statistics


@pytest.mark.parametrize("name", ["conv4", "conv4_frl"])
def test_novel_class_embeddings_do_not_depend_on_row_order(name):
    torch.manual_seed(0)
    model = build_model(name, (3, 16, 16), 5)
    x, y = torch.randn(12, 3, 16, 16), torch.arange(4).repeat_interleave(3)  # class-sorted rows
    algorithm = make_method("fedavg", model)
    server = {**algorithm.init_server(model_params(model)), "buffers": trained_buffers(model, torch.randn(9, 3, 16, 16))}
    protocol = PROTOCOLS.get("novel_class")(EvalConfig(batch_size=4))
    params = {**server["params"], **server["buffers"]}
    order = torch.randperm(12)
    sorted_rows = protocol._embed(algorithm, params, ArrayDataset("s", x, y, 4))
    shuffled = protocol._embed(algorithm, params, ArrayDataset("s", x[order], y[order], 4))
    torch.testing.assert_close(shuffled, sorted_rows[order])
    ref = torch_reference(model)
    ref.load_state_dict({**ref.state_dict(), **server["buffers"]})
    torch.testing.assert_close(sorted_rows, ref.eval()(x))  # with the server's statistics


def test_the_passes_rule_of_the_novel_class_trainer():
    alg = make_method("metavers", build_model("conv4", (3, 16, 16), 4), **NOVEL)
    assert [alg.bn_passes(ways, tau) for ways, tau in [(1, 1), (2, 1), (1, 2), (2, 2), (3, 5)]] == [2, 2, 1, 2, 2]


def test_a_round_replays_each_clients_passes_in_client_order_as_the_code():
    torch.manual_seed(0)
    model = build_model("conv4", (3, 16, 16), 4)
    alg = make_method("metavers", model, **NOVEL)
    server = alg.init_server(model_params(model))
    episodes = [torch.randn(4, 3, 16, 16) + shift for shift in (0.0, 2.0)]
    updates = []
    for x, passes in zip(episodes, (1, 2)):
        carry = {"params": server["params"], "m_global": torch.tensor(0.0), "w_s": torch.tensor(1.0),
                 "w_t": torch.tensor(0.0)}
        y = torch.tensor([0, 1, 0, 1])
        batches = {"support": (x[None, :2], y[None, :2]), "query": (x[None, 2:], y[None, 2:])}
        out, loss = alg.local_update(carry, batches, {})
        updates.append(MetaVersUpdate(out["upload"], 4, loss, out["margin"], True, out["bn_stats"], passes))
    after = alg.aggregate(server, updates)["buffers"]
    ref = torch_reference(model).train()  # the code: one model in train mode, clients in order
    for x, passes in zip(episodes, (1, 2)):
        for _ in range(passes):
            ref(x)
    for k, v in ref.state_dict().items():
        if "running" in k or "num_batches" in k:
            torch.testing.assert_close(after[k], v.to(after[k].dtype), msg=k)


def test_metavers_runs_keep_the_same_statistics_on_both_paths():
    """One round (later rounds start from parameters that Adam's step on the conv bias, whose
    gradient is 0 under BatchNorm up to rounding, makes differ between the paths)."""
    fed = image_data(num_clients=3)
    results = []
    for execution in ("sequential", "batched"):
        torch.manual_seed(0)
        model = build_model("conv4", (3, 32, 32), 4)
        alg = make_method("metavers", model, **NOVEL)
        results.append(run_federation(alg, fed, model_params(model), FederationConfig(rounds=1, clients_per_round=3,
                                      batch_size=4, eval_every=0), SeenClients(EvalConfig(reduction="sample")),
                                      RunStreams(0), executor=Executor(execution)).server["buffers"])
    initial = initial_bn_state(model)
    assert all(not torch.equal(results[0][k], initial[k]) for k in initial)
    for k in initial:
        torch.testing.assert_close(results[1][k], results[0][k], msg=k)


def test_metavers_with_bn_state_needs_the_joint_passes():
    with pytest.raises(ValueError, match="joint"):
        make_method("metavers", build_model("conv4", (3, 16, 16), 4), **{**NOVEL, "ce_forward": "split"})


def test_the_novel_class_protocol_embeds_with_the_servers_statistics(monkeypatch):
    """The server's running statistics reach the embedding (not the module's initial 0 / 1)."""
    torch.manual_seed(0)
    model = build_model("conv4", (3, 16, 16), 5)
    algorithm = make_method("fedavg", model)
    server = {**algorithm.init_server(model_params(model)), "buffers": trained_buffers(model, torch.randn(9, 3, 16, 16))}
    protocol = PROTOCOLS.get("novel_class")(EvalConfig(groups_val=2, groups_test=2, users=2, ways=2))
    x, y = torch.randn(16, 3, 16, 16), torch.arange(4).repeat_interleave(4)
    protocol.bind({"val": ArrayDataset("v", x, y, 4), "test": ArrayDataset("t", x, y, 4)})
    seen = []
    real = protocol._embed
    monkeypatch.setattr(protocol, "_embed", lambda alg, params, ds: seen.append(params) or real(alg, params, ds))
    protocol.evaluate(algorithm, server, {}, None, [])
    assert seen and all(params[k] is server["buffers"][k] for params in seen for k in server["buffers"])
