"""The batched path gives the sequential path's numbers (docs/speed.md).

Every method with a client program is run twice on the same data, seed and batches - clients one
at a time, then vmapped over stacks - in float64, and the server state, every client's
persistent state, the per-round losses and the final evaluation must agree to float tolerance.
The clients have equal train sizes so that the batched path really stacks them (a test below
checks that it does), plus one run with unequal sizes and padding.
"""
from __future__ import annotations

import warnings

import pytest
import torch
from torch import nn
from torch.utils._pytree import tree_flatten

from pfl_core.algorithms import METHODS
from pfl_core.algorithms.base import Algorithm
from pfl_core.algorithms.l2sgd import coin_counts
from pfl_core.config import FederationConfig
from pfl_core.data.federated import ArrayDataset, Client, FederatedData
from pfl_core.engine import Executor
from pfl_core.engine.plans import make_buckets
from pfl_core.evaluation import EvalConfig
from pfl_core.evaluation.clients import SeenClients
from pfl_core.federation import run_federation
from pfl_core.models.cafeme import ModulatedCNN
from pfl_core.models.cnn import BaseCNN, conv_block, dense_block
from pfl_core.models.pooling import MaxPool2d
from pfl_core.seeding import RunStreams
from pfl_core.training import model_params
from tests.helpers import TinyLeNet, l2p_federation, one_thread, tiny_resnet  # noqa: F401 (fixture)

pytestmark = pytest.mark.usefixtures("one_thread")  # tiny models: threads only contend (FedL2P's ResNet 10x)

# float64: a real mismatch is O(lr); Adam on the (mathematically zero) gradient of a bias before a
# BatchNorm turns 1e-17 noise into O(lr) steps in either path, hence the absolute slack
TOL = dict(rtol=1e-6, atol=1e-8)


def flat_federation(sizes, features=6, classes=3, test=4, seed=0) -> FederatedData:
    """float64 features; client k holds ``sizes[k]`` train and ``test`` test samples."""
    gen = torch.Generator().manual_seed(seed)
    total = sum(sizes) + test * len(sizes)
    x = torch.randn(total, features, generator=gen, dtype=torch.float64)
    y = torch.randint(0, classes, (total,), generator=gen)
    return _federation(ArrayDataset("flat", x, y, classes), sizes, test)


def image_federation(sizes, classes=3, test=4, seed=0, shape=(1, 6, 6), name="img") -> FederatedData:
    gen = torch.Generator().manual_seed(seed)
    total = sum(sizes) + test * len(sizes)
    x = torch.rand(total, *shape, generator=gen, dtype=torch.float64)
    y = torch.randint(0, classes, (total,), generator=gen)
    return _federation(ArrayDataset(name, x, y, classes), sizes, test)


def rgb_federation(sizes, classes=3, test=4, seed=0) -> FederatedData:
    """3x8x8 float64 images (the tiny KLD-BN ResNets of FedL2P's stage 1)."""
    return image_federation(sizes, classes, test, seed, shape=(3, 8, 8), name="rgb")


def _federation(dataset, sizes, test) -> FederatedData:
    clients, start = [], 0
    for cid, n in enumerate(sizes):
        clients.append(Client(cid, {"train": torch.arange(start, start + n),
                                    "test": torch.arange(start + n, start + n + test)}))
        start += n + test
    return FederatedData(dataset, clients, list(range(len(sizes))))


def dnn(features=6, classes=3):
    return nn.Sequential(nn.Flatten(), nn.Linear(features, 5), nn.ReLU(), nn.Linear(5, classes))


def tiny_cnn(classes=3):
    """conv -> BN (batch statistics) -> ReLU -> pool, dense block, output: BaseCNN's shape."""
    return BaseCNN(nn.Sequential(conv_block(1, 4, 3, 1)), nn.Sequential(dense_block(36, 8), nn.Linear(8, classes)))


def tiny_pool_cnn(classes=3):
    """conv -> ReLU -> the project's max-pool -> output: rows independent but not ``per_sample``
    (IFCA's chunked cluster-choice pass, pfl_core/algorithms/_lib/cluster_pass.py)."""
    return nn.Sequential(nn.Conv2d(1, 3, 3), nn.ReLU(), MaxPool2d(2), nn.Flatten(), nn.Linear(12, classes))


def tiny_modulated(classes=3):
    trunk = nn.Sequential(conv_block(1, 4, 3, 1))
    return ModulatedCNN(tiny_cnn(classes), trunk, [36, 6], classes)


def balanced_image_federation(sizes, classes=3, test=4, seed=0) -> FederatedData:
    """``image_federation`` whose clients hold their classes in turn (equal episode shapes)."""
    fed = image_federation(sizes, classes, test, seed)
    fed.dataset.y = torch.arange(len(fed.dataset.y)) % classes
    return fed


class TinyEmbedding(nn.Module):
    """An embedding network (``embed`` flag, as the LeNet family) for 1x6x6 images; ``batchnorm``
    makes the episode's forward passes differ (MetaVers ``ce_forward``)."""

    def __init__(self, batchnorm=False):
        super().__init__()
        self.features = conv_block(1, 2, 3, 1, batchnorm=batchnorm)
        self.fc = nn.Linear(18, 4)

    def forward(self, x, embed=False):
        return self.fc(self.features(x).flatten(1))


#: MetaVers episodes: K = 1 shot, Q = 1 query; W = 0 so that rounds 1-2 mix in the triplet loss
METAVERS = {"shot": 1, "query": 1, "warmup": 0, "gamma": 0.4, "lr": 0.01}

#: pFedMe / CGPFL local training: R = 2 local rounds of K = 2 inner steps
PROX = {"lr": 0.05, "personal_lr": 0.1, "lam": 5.0, "inner_steps": 2, "local_rounds": 2}

# method, hyperparameters, model factory, data factory
CASES = {
    "fedavg-steps": ("fedavg", {"lr": 0.3, "local_steps": 3}, dnn, flat_federation),
    "fedavg-epochs": ("fedavg", {"lr": 0.3, "local_epochs": 2}, dnn, flat_federation),
    "fedavg_ft": ("fedavg_ft", {"lr": 0.3, "local_steps": 2}, dnn, flat_federation),
    "local": ("local", {"lr": 0.3, "local_steps": 2}, dnn, flat_federation),
    "ifca": ("ifca", {"lr": 0.3, "local_epochs": 1, "num_clusters": 2}, dnn, flat_federation),
    "ifca-pool": ("ifca", {"lr": 0.3, "local_epochs": 1, "num_clusters": 3}, tiny_pool_cnn, image_federation),
    "ditto": ("ditto", {"lr": 0.2, "personal_steps": 2, "global_steps": 2, "global_lr": 0.05}, dnn, flat_federation),
    "ditto-sgd-global-anchor": ("ditto", {"lr": 0.2, "personal_steps": 1, "global_steps": 2, "global_lr": 0.1,
                                          "global_optimizer": "sgd", "anchor": "global"}, dnn, flat_federation),
    "ditto-interleaved": ("ditto", {"lr": 0.2, "personal_steps": 2, "global_steps": 2, "global_lr": 0.1,
                                    "global_optimizer": "sgd", "anchor": "global", "schedule": "interleaved",
                                    "weighting": "samples"}, dnn, flat_federation),
    "fedrep": ("fedrep", {"lr": 0.05, "head_steps": 2, "head_prefixes": ["fc."]}, tiny_cnn, image_federation),
    "fedrep-personal-head": ("fedrep", {"lr": 0.05, "head_steps": 1, "personal_head": True,
                                        "persist_optimizer": False, "head_prefixes": ["fc."]}, tiny_cnn,
                             image_federation),
    "perfedavg-hf-fd": ("perfedavg", {"local_steps": 2, "alpha": 0.1, "beta": 0.05}, dnn, flat_federation),
    "perfedavg-hf-exact": ("perfedavg", {"local_steps": 2, "alpha": 0.1, "beta": 0.05, "hvp": "exact"}, dnn,
                           flat_federation),
    "perfedavg_fo": ("perfedavg_fo", {"local_steps": 2, "alpha": 0.1, "beta": 0.05}, dnn, flat_federation),
    "cafeme-fo": ("cafeme", {"adapt_steps": 2, "query_batches": 2, "inner_lr": 0.1, "outer_lr": 0.01},
                  tiny_modulated, image_federation),
    "cafeme-so": ("cafeme", {"adapt_steps": 2, "query_batches": 2, "inner_lr": 0.1, "outer_lr": 0.01,
                             "first_order": False}, tiny_modulated, image_federation),
    "pfedme": ("pfedme", {**PROX, "beta": 1.0}, dnn, flat_federation),
    "pfedme-theta-persists": ("pfedme", {**PROX, "predictor": "theta", "theta_start": "persist"}, dnn,
                              flat_federation),
    "pfedme-local-predictor": ("pfedme", {**PROX, "beta": 2.0, "hidden_l2": 0.001, "predictor": "local",
                                          "weighting": "uniform"}, dnn, flat_federation),
    "cgpfl": ("cgpfl", {**PROX, "num_clusters": 2}, dnn, flat_federation),
    "cgpfl-literal": ("cgpfl", {**PROX, "num_clusters": 2, "alpha": 0.5, "omega_update": "paper_literal"}, dnn,
                      flat_federation),
    # 3 uploads per round: max_clusters lifts K_max above N/2 = 1; this mu picks K = 2 (checked below)
    "cgpfl_heur": ("cgpfl_heur", {**PROX, "mu": 100.0, "max_clusters": 2}, dnn, flat_federation),
    "apfl": ("apfl", {"lr": 0.2, "local_steps": 3}, dnn, flat_federation),
    "apfl-fixed-alpha": ("apfl", {"lr": 0.2, "local_steps": 2, "adaptive_alpha": False, "mix_with": "local"}, dnn,
                         flat_federation),
    "apfl-fedtorch": ("apfl", {"lr": 0.2, "local_steps": 3, "alpha_update": "once_a_round", "alpha_penalty": 0.02,
                               "step_order": "w_first"}, dnn, flat_federation),
    # clients_per_round 0: the federation's 3 (pFedHN's own default is 1, which never stacks)
    "pfedhn": ("pfedhn", {"inner_steps": 2, "inner_lr": 0.1, "clients_per_round": 0, "embed_dim": 3,
                          "hidden_dim": 8, "n_hidden": 1}, dnn, flat_federation),
    # pFedGP's default head (tree_pg) has a batched_fallback: the label_regression head is the program
    "pfedgp": ("pfedgp", {"gp_head": "label_regression", "inner_steps": 2, "lr": 0.1}, dnn, flat_federation),
    # the paper's tree of GP heads, its Gibbs-sampler seeds drawn from the client's train stream
    "pfedgp-tree": ("pfedgp", {"gp_head": "tree_pg", "inner_steps": 2, "lr": 0.1}, dnn, flat_federation),
    "pfedgp-marginal": ("pfedgp", {"gp_head": "label_regression", "objective": "marginal_likelihood", "lr": 0.1},
                        dnn, flat_federation),
    # the run's coin flips (seed 11): L = 0 (loss only), 3, then 2 local steps
    "l2sgd": ("l2sgd", {"lr": 0.1, "lam": 1.0, "p": 0.3}, dnn, flat_federation),
    "metavers": ("metavers", METAVERS, lambda: TinyEmbedding(batchnorm=True), balanced_image_federation),
    # random labels: short classes take the R* fallback, episodes of several shapes in one round
    "metavers-fallback": ("metavers", {**METAVERS, "shot": 2, "weight_decay": 0.01}, TinyEmbedding, image_federation),
    "metavers-novel": ("metavers", {**METAVERS, "margin_update": "client", "first_round": 1, "ce_forward": "joint",
                                    "margin_window": 4, "lr_step": 2}, lambda: TinyEmbedding(batchnorm=True),
                       balanced_image_federation),
    "l2sgd-mean-regularized": ("l2sgd", {"variant": "mean_regularized", "lr": 0.1, "lam": 1.0, "local_steps": 2},
                               dnn, flat_federation),
    # MetaVers baselines (issue 13): lenet-shaped model, head fc3.
    "fedper": ("fedper", {"lr": 0.1, "local_steps": 3}, TinyLeNet, flat_federation),
    "lg_fedavg": ("lg_fedavg", {"lr": 0.1, "local_steps": 2, "pretrain_rounds": 1}, TinyLeNet, flat_federation),
    "fedbabu": ("fedbabu", {"lr": 0.1, "local_steps": 3, "weight_decay": 0.01}, TinyLeNet, flat_federation),
    "fedper-epochs": ("fedper", {"lr": 0.1, "local_steps": 0, "local_epochs": 2}, TinyLeNet, flat_federation),
    "knn_per": ("knn_per", {"lr": 0.1, "local_steps": 2, "k": 3}, TinyLeNet, flat_federation),
    "fedproto": ("fedproto", {"lr": 0.1, "local_epochs": 2}, TinyLeNet, flat_federation),
    "fedproto-keep-head": ("fedproto", {"lr": 0.1, "local_steps": 3, "keep_missing_protos": True,
                                        "predict": "head"}, TinyLeNet, flat_federation),
    # FedL2P (issue 14): width-4 ResNet-18, 2 inner steps, 1 outer step (val 3), visible meta lrs
    "fedl2p": ("fedl2p", {"inner_epochs": 1, "outer_epochs": 1, "lr_bnnet": 0.1, "lr_lrnet": 0.1, "lr_eta": 0.01},
               tiny_resnet, l2p_federation),
    "l2p-fomaml-lrnet": ("l2p", {"inner_epochs": 1, "outer_epochs": 1, "hypergradient": "fomaml", "bn_net": False,
                                 "fixed_beta": 1.0, "lr_lrnet": 0.1, "lr_eta": 0.01}, tiny_resnet, l2p_federation),
    # FedL2P's stage-2 baselines train nothing (a round leaves the server as it is); their
    # batched == sequential fine-tuning is tests/test_finetune.py's
    "global_model": ("global_model", {}, dnn, flat_federation),
    "ft_bn_c": ("ft_bn_c", {}, dnn, flat_federation),
    "ft_bn_g": ("ft_bn_g", {}, dnn, flat_federation),
    "ft_bn_i": ("ft_bn_i", {}, dnn, flat_federation),
    # FedL2P stage 1 (issue 14): BN running statistics in the carry and the server, round lr schedules
    "fedavg-bn": ("fedavg", {"lr": 0.1, "local_steps": 2, "lr_milestones": [1, 2]}, tiny_resnet, rgb_federation),
    "fedavg-bn-epochs": ("fedavg", {"lr": 0.1, "local_epochs": 1, "lr_decay": 0.5}, tiny_resnet, rgb_federation),
    "fedbabu-bn": ("fedbabu", {"lr": 0.1, "local_steps": 2, "momentum": 0.0, "weight_decay": 0.0,
                               "head_prefixes": ["fc."], "lr_milestones": [2]}, tiny_resnet, rgb_federation),
    "perfedavg-bn-fd": ("perfedavg", {"local_steps": 1, "alpha": 0.05, "beta": 0.05}, tiny_resnet, rgb_federation),
    "perfedavg-bn-exact": ("perfedavg", {"local_steps": 1, "alpha": 0.05, "beta": 0.05, "hvp": "exact"},
                           tiny_resnet, rgb_federation),
}


def run_path(case, execution, sizes=(8, 8, 8, 8, 8), rounds=3, per_round=3, batch_size=4, pad_tolerance=0.0,
             seed=0, stack_limit=0, executor=None):
    method, hp, model_fn, data_fn = case
    fed = data_fn(sizes)
    torch.manual_seed(seed)
    model = model_fn().double()
    cls = METHODS.get(method)
    algorithm = cls(model, cls.hyper_class.from_dict(hp))
    algorithm.seed = 11
    cfg = FederationConfig(rounds=rounds, clients_per_round=per_round, batch_size=batch_size)
    protocol = SeenClients(EvalConfig(steps=2, lr=0.1, reduction="sample"))
    with warnings.catch_warnings():  # a missing vmap batching rule would silently loop per model
        warnings.filterwarnings("error", message=".*performance drop.*")
        return run_federation(algorithm, fed, model_params(model), cfg, protocol, RunStreams(seed),
                              executor=executor or Executor(execution, pad_tolerance, stack_limit))


def assert_same_run(a, b):
    leaves_a, spec_a = tree_flatten((a.server, {c: x.state for c, x in a.contexts.items()}))
    leaves_b, spec_b = tree_flatten((b.server, {c: x.state for c, x in b.contexts.items()}))
    assert spec_a == spec_b
    for x, y in zip(leaves_a, leaves_b):
        if isinstance(x, torch.Tensor):
            torch.testing.assert_close(y, x, **TOL)
        elif isinstance(x, float):  # host-side statistics (e.g. CGPFL-Heur's distances): float noise only
            assert y == pytest.approx(x, rel=1e-9, abs=1e-12)
        else:
            assert x == y
    assert a.sampled == b.sampled
    for ra, rb in zip(a.history, b.history):
        assert ra.keys() == rb.keys()
        for key in ra:
            assert rb[key] == pytest.approx(ra[key], rel=1e-6, abs=1e-8), key
    curves = lambda run: [acc for r in run.final.clients for acc in r.acc + r.loss]
    assert curves(b) == pytest.approx(curves(a), rel=1e-6, abs=1e-8)


@pytest.mark.parametrize("name", [pytest.param(n, marks=pytest.mark.slow) if n == "fedl2p" else n for n in sorted(CASES)])
def test_batched_path_equals_sequential_path(name):
    assert_same_run(run_path(CASES[name], "sequential"), run_path(CASES[name], "batched"))


@pytest.mark.parametrize("name", ["fedavg-epochs", "ifca", "ifca-pool", "fedper-epochs", "fedproto", "fedavg-bn-epochs"])
def test_padded_stacks_of_unequal_clients_equal_the_sequential_path(name):
    sizes = (8, 5, 12, 9, 4)  # 2, 1, 3, 2, 1 batches per epoch at batch size 4
    sequential = run_path(CASES[name], "sequential", sizes=sizes, per_round=5)
    padded = run_path(CASES[name], "batched", sizes=sizes, per_round=5, pad_tolerance=10.0)
    assert_same_run(sequential, padded)


@pytest.mark.parametrize("name", ["fedavg-bn", "fedbabu-bn", "perfedavg-bn-fd"])
def test_the_bn_cases_carry_trained_running_statistics(name):
    """The BN cases really compare trained statistics: every layer's counter is the rounds' steps
    (averaged over equal clients) and the statistics moved away from (0, 1)."""
    run = run_path(CASES[name], "batched")
    buffers = run.server["buffers"]
    forwards = {"fedavg-bn": 2, "fedbabu-bn": 2, "perfedavg-bn-fd": 4}[name]  # per client and round
    assert {int(v) for k, v in buffers.items() if k.endswith("num_batches_tracked")} == {3 * forwards}
    assert not torch.allclose(buffers["layer1.0.bn1.running_var"], torch.ones(4, dtype=torch.float64))


def test_buckets_stack_equal_plans_and_pad_only_maskable_streams():
    plan = lambda n, b=4: {"train": [torch.arange(b)] * n}
    plans = [plan(2), plan(2), plan(3), plan(2, b=3)]
    exact = make_buckets(plans, ("train",), 0.0)
    assert sorted(b.members for b in exact) == [[0, 1], [2], [3]]
    assert all(not b.padded for b in exact)
    padded = make_buckets(plans, ("train",), 1.0)
    assert sorted(b.members for b in padded) == [[2, 0, 1], [3]]
    assert [b.padded for b in padded if len(b.members) == 3] == [frozenset({"train"})]
    assert sorted(b.members for b in make_buckets(plans, (), 1.0)) == [[0, 1], [2], [3]]


def test_the_batched_path_really_stacks_clients(monkeypatch):
    """Equal clients of a round run as one vmap call, not one by one."""
    import pfl_core.engine.executor as executor_module

    calls = []
    real = executor_module.vmap
    monkeypatch.setattr(executor_module, "vmap", lambda fn, **kw: calls.append(kw) or real(fn, **kw))
    run_path(CASES["fedavg-steps"], "batched", rounds=2, per_round=3)
    assert len(calls) == 2  # one call per round for the three sampled clients


def test_every_registered_method_is_a_client_program():
    """No registered method needs the sequential fallback: each writes its round as a program
    (none overrides client_update), and CASES runs each one (ifca_ft is IFCA's program)."""
    for name in METHODS.names():
        cls = METHODS.get(name)
        assert cls.batched_fallback is None, name
        assert cls.client_update is Algorithm.client_update, name
        assert cls.local_update is not Algorithm.local_update, name
    assert set(METHODS.names()) - {case[0] for case in CASES.values()} <= {"ifca_ft"}


def test_a_fallback_reason_sends_a_method_to_the_sequential_path():
    fedavg = METHODS.get("fedavg")
    no_program = type("NoProgram", (fedavg,), {"batched_fallback": "not written as a program"})
    model, hp = dnn().double(), fedavg.hyper_class()
    assert Executor("batched").uses_batched(fedavg(model, hp))
    assert not Executor("batched").uses_batched(no_program(model, hp))


def test_the_cases_reach_cgpfl_heur_contexts_and_l2sgd_rounds_without_local_steps():
    assert run_path(CASES["cgpfl_heur"], "sequential", rounds=1).server["num_clusters"] == 2
    assert [coin_counts((11, 0), t, 0.3)[0] for t in range(3)] == [0, 3, 2]  # run_path's seed is 11


# ------------------------------------------------------------------ seeds in lockstep

def _federation_for_seed(case, seed, sizes=(8, 8, 8, 8, 8)):
    from pfl_core.federation import Federation

    method, hp, model_fn, data_fn = case
    fed = data_fn(sizes, seed=seed)
    torch.manual_seed(seed)
    model = model_fn().double()
    cls = METHODS.get(method)
    algorithm = cls(model, cls.hyper_class.from_dict(hp))
    algorithm.seed = 11 + seed
    cfg = FederationConfig(rounds=3, clients_per_round=3, batch_size=4)
    protocol = SeenClients(EvalConfig(steps=2, lr=0.1, reduction="sample"))
    return Federation(algorithm, fed, model_params(model), cfg, protocol, RunStreams(seed))


@pytest.mark.parametrize("name", ["fedavg-steps", "cafeme-fo", "ditto"])
@pytest.mark.parametrize("execution", ["sequential", "batched"])
def test_seeds_in_lockstep_get_what_each_gets_alone(name, execution):
    from pfl_core.federation import run_lockstep

    alone = [run_lockstep([_federation_for_seed(CASES[name], seed)], Executor(execution))[0] for seed in (0, 1, 2)]
    together = run_lockstep([_federation_for_seed(CASES[name], seed) for seed in (0, 1, 2)], Executor(execution))
    for a, b in zip(alone, together):
        assert_same_run(a, b)
    assert alone[0].sampled != alone[1].sampled  # the seeds really differ
