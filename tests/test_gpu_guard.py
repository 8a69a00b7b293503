"""The GPU path, guarded on a CPU (issue 26, item 1).

Engine cases of ``tests/test_engine_equivalence.py`` and tiny end-to-end runs are run in float32
on a stand-in device (:mod:`tests.device_guard`: CPU tensors that report another device, every
operation checked). A run fails on an operation mixing device and host tensors, on a host
synchronisation inside a client step (``local_update``), and on float64 work; each case's host
synchronisations per round are held to :data:`SYNC_BUDGET`, so a new sync is a failing test.
"""
from __future__ import annotations

import contextlib
import dataclasses

import pytest
import torch
from torch.utils._pytree import tree_map

from pfl_core.algorithms import METHODS
from pfl_core.config import FederationConfig, RunConfig
from pfl_core.engine import Executor
from pfl_core.evaluation import EvalConfig
from pfl_core.evaluation.clients import SeenClients
from pfl_core.experiment import run_experiment
from pfl_core.federation import Federation, lockstep_round
from pfl_core.seeding import RunStreams
from pfl_core.training import model_params
from tests.device_guard import STAND_IN, DeviceGuard, StandInTensor, to_host
from tests.helpers import one_thread  # noqa: F401 (fixture)
from tests.test_engine_equivalence import CASES

pytestmark = pytest.mark.usefixtures("one_thread")

ROUNDS = 2

#: host synchronisations per training round (the most of any round; evaluation apart) and per
#: evaluation, measured on this commit with ``ROUNDS`` rounds of 3 of 5 equal clients, for the
#: sequential and the batched path. A change that adds a sync fails here; one that removes syncs
#: (issue 26, item 2) lowers its number here.
SYNC_BUDGET = {
    # case: {path: (syncs per round, syncs per evaluation)}. A round's two common reads: the mean
    # training loss and the one fused finite check of the server state (pfl_core.federation; one
    # read per server tensor before: fedavg 5, ditto 9, cafeme-fo 21, metavers 26, ifca 16,
    # pfedgp 36, fedavg-bn 123 per round); pFedGP's per-class split of a client's train split is
    # drawn on the host (two copies per client, was 28 reads per round). The sequential evaluation
    # reads three scalars per batch.
    "fedavg-steps": {"sequential": (2, 15), "batched": (2, 3)},
    "fedavg_ft": {"sequential": (2, 45), "batched": (2, 3)},
    "ditto": {"sequential": (2, 45), "batched": (2, 3)},
    "cafeme-fo": {"sequential": (2, 45), "batched": (2, 3)},
    "metavers": {"sequential": (9, 20), "batched": (9, 20)},
    "pfedme": {"sequential": (2, 15), "batched": (2, 3)},
    "ifca": {"sequential": (5, 20), "batched": (5, 8)},
    "l2sgd": {"sequential": (2, 15), "batched": (2, 3)},
    "apfl": {"sequential": (2, 15), "batched": (2, 3)},
    "pfedgp": {"sequential": (11, 20), "batched": (11, 20)},
    "fedavg-bn": {"sequential": (2, 15), "batched": (2, 3)},  # tiny ResNet-18: 122 server tensors
}
SLOW = {"fedavg-bn"}


def _as(fed, dtype):
    dataset = fed.dataset
    x = dataset.x.to(dtype) if dataset.x.is_floating_point() else dataset.x
    return dataclasses.replace(fed, dataset=dataclasses.replace(dataset, x=x))


def run_case(name: str, execution: str, device=torch.device("cpu"), dtype=torch.float32,
             guard: DeviceGuard | None = None, plant=None, capture: str = "off"):
    """Case ``name`` in ``dtype`` on ``device`` for ``ROUNDS`` rounds of 3 of 5 equal clients, then
    one evaluation; on the stand-in device under ``guard``, each round and the evaluation a phase of
    its own, ``plant`` (a test's wrapper) around the method's ``local_update``, ``capture`` the
    executor's step capture. Returns (server
    state on the host, round losses, evaluation accuracies)."""
    method, hp, model_fn, data_fn = CASES[name]
    fed = _as(data_fn((8, 8, 8, 8, 8)), dtype)
    torch.manual_seed(0)
    model = model_fn().to(dtype)
    cfg = FederationConfig(rounds=ROUNDS + 1, clients_per_round=3, batch_size=4)
    protocol = SeenClients(EvalConfig(steps=2, lr=0.1, reduction="sample"))
    executor = Executor(execution, capture=capture)
    guard = guard or DeviceGuard(dtype)
    with guard if device == STAND_IN else contextlib.nullcontext():
        fed, model = fed.to(device), model.to(device)
        cls = METHODS.get(method)
        algorithm = cls(model, cls.hyper_class.from_dict(hp))
        algorithm.seed = 11
        algorithm.local_update = guard.client_step(plant(algorithm.local_update) if plant else algorithm.local_update)
        federation = Federation(algorithm, fed, model_params(model), cfg, protocol, RunStreams(0))
        for round_idx in range(ROUNDS):
            with guard.phase(f"round {round_idx}"):
                lockstep_round([federation], executor, round_idx)
        with guard.phase("evaluation"):
            evaluation = federation.evaluate(executor)
    host = tree_map(lambda x: x.cpu() if isinstance(x, torch.Tensor) else x, to_host(federation.server))
    accuracies = [acc for client in evaluation.clients for acc in client.acc]
    return host, [row["train_loss"] for row in federation.result.history], accuracies


def guarded_run(name: str, execution: str, guard: DeviceGuard | None = None, plant=None):
    """:func:`run_case` in float32 on the stand-in device under ``guard`` (None: on the CPU)."""
    device = STAND_IN if guard is not None else torch.device("cpu")
    return run_case(name, execution, device, torch.float32, guard, plant)


def budget_of(guard: DeviceGuard) -> tuple[int, int]:
    return max(guard.syncs[f"round {r}"] for r in range(ROUNDS)), guard.syncs["evaluation"]


GUARDED = [pytest.param(name, marks=pytest.mark.slow) if name in SLOW else name for name in sorted(SYNC_BUDGET)]


@pytest.mark.parametrize("execution", ["sequential", "batched"])
@pytest.mark.parametrize("name", GUARDED)
def test_the_gpu_path_has_no_mismatch_no_client_sync_and_its_sync_budget(name, execution):
    guard = DeviceGuard(torch.float32)
    server, losses, accuracies = guarded_run(name, execution, guard)
    assert guard.violations == [], guard.violations
    sites = "\n".join(f"  {n} x {phase}: {where}" for (phase, where), n in sorted(guard.sync_sites.items()))
    assert budget_of(guard) == SYNC_BUDGET[name][execution], (
        f"{name} ({execution}): host syncs (per round, per evaluation) changed; where they are:\n{sites}")
    reference, reference_losses, reference_accuracies = guarded_run(name, execution)  # the same run on the CPU
    assert losses == pytest.approx(reference_losses, rel=1e-5)
    assert accuracies == pytest.approx(reference_accuracies, abs=1e-6)
    for key in ("params",):
        if key in reference:
            for k, v in reference[key].items():
                torch.testing.assert_close(server[key][k], v)


def test_a_sync_planted_in_a_client_step_fails_the_guard():
    def plant(local_update):
        def with_sync(carry, batches, masks):
            out, loss = local_update(carry, batches, masks)
            float(loss)  # the planted host read
            return out, loss
        return with_sync

    guard = DeviceGuard(torch.float32)
    guarded_run("fedavg-steps", "sequential", guard, plant)
    assert [kind for kind, *_ in guard.violations] == ["sync in client step"] * 3 * ROUNDS


def test_a_host_tensor_planted_in_a_client_step_fails_the_guard():
    def plant(local_update):
        def with_host_tensor(carry, batches, masks):
            out, loss = local_update(carry, batches, masks)
            return out, (loss * torch.ones(1)).squeeze(0)  # the planted host tensor
        return with_host_tensor

    guard = DeviceGuard(torch.float32)
    guarded_run("fedavg-steps", "sequential", guard, plant)
    assert {kind for kind, *_ in guard.violations} == {"mismatch"}


def test_float64_work_in_a_float32_run_fails_the_guard():
    guard = DeviceGuard(torch.float32)
    with guard:
        x = torch.ones(3, device=STAND_IN)
        (x.double() * 2).sum()
    assert {kind for kind, *_ in guard.violations} == {"float64"}


def test_the_stand_in_reports_its_device_and_counts_host_reads():
    guard = DeviceGuard(torch.float32)
    with guard:
        x = torch.arange(4.0).to(STAND_IN)
        assert isinstance(x, StandInTensor) and x.device == STAND_IN
        float(x.sum()), x.tolist(), bool(x[0] > 1), x[x > 1], x.cpu()
        x[torch.tensor([0, 1])] + torch.tensor(1.0)  # host index tensor, CUDA's 0-d CPU scalar: allowed
    assert guard.violations == []
    assert guard.syncs["setup"] == 5


# ------------------------------------------------------------------ end to end

def _config(method: str, params: dict) -> RunConfig:
    return RunConfig.from_dict({
        "data": {"dataset": "digits28", "num_clients": 8, "unseen_fraction": 0.25,
                 "partition": {"name": "dirichlet", "alpha": 0.5, "min_size": 20}},
        "model": {"name": "mlr"},
        "method": {"name": method, "params": params},
        "federation": {"rounds": 2, "clients_per_round": 3, "batch_size": 10},
        "evaluation": {"protocol": "unseen", "params": {"steps": 2, "lr": 0.05}},
        "seed": 0,
    })


@pytest.mark.parametrize("method, params, execution", [
    ("fedavg_ft", {"lr": 0.05, "local_steps": 2}, "batched"),
    ("ditto", {"lr": 0.05, "personal_steps": 2, "global_steps": 2}, "sequential")])
def test_an_end_to_end_run_on_the_stand_in_device(method, params, execution, monkeypatch):
    guard = DeviceGuard(torch.float32)
    cls = METHODS.get(method)
    monkeypatch.setattr(cls, "local_update", guard.client_step(cls.local_update))
    cfg = _config(method, params)
    with guard:
        result = run_experiment(cfg, device=str(STAND_IN), execution=execution)
    assert guard.violations == []
    assert result.info["device"] == "meta"
    reference = run_experiment(cfg, device="cpu", execution=execution)
    assert result.metrics == pytest.approx(reference.metrics, rel=1e-5, abs=1e-6)
