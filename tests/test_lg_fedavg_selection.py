"""LG-FedAvg's FedAvg stage is not LG-FedAvg (issue 28 item 9): the evaluations up to round
``pretrain_rounds`` score the FedAvg model, so best-validation selection (the report) and early
stopping (the federation) leave them out; the run records the stage as the metric
``pretraining_rounds``."""
from __future__ import annotations

import pytest
import torch

from benchmarks.reporting.collect import PRETRAINING_ROUNDS, run_value
from benchmarks.reporting.metric import MetricSpec
from benchmarks.reporting.stats import best_val_round
from pfl_core.config import FederationConfig, RunConfig
from pfl_core.early_stopping import stop_round
from pfl_core.engine import Executor
from pfl_core.experiment import run_experiment
from pfl_core.federation import Federation, lockstep_round, run_lockstep
from pfl_core.seeding import RunStreams
from pfl_core.training import model_params
from tests.helpers import TinyLeNet, make_method, one_thread, tiny_federation  # noqa: F401
from tests.test_early_stopping import Scripted

pytestmark = pytest.mark.usefixtures("one_thread")

# validation peaks inside the FedAvg stage (rounds 1-2), LG-FedAvg's own best is round 4
VAL = {1: 0.9, 2: 0.8, 3: 0.5, 4: 0.7, 5: 0.6}
TEST = {1: 0.11, 2: 0.22, 3: 0.33, 4: 0.44, 5: 0.55}
BEST_VAL = MetricSpec(key="round/acc_weighted", label="acc", scale=100, averaging="", pm="sem", ddof=0,
                      aggregate="best_val_round", select_metric="round/val_acc_weighted")


def test_best_val_round_skips_the_rounds_of_a_pretraining_stage():
    assert best_val_round(VAL, TEST).round == 1  # no stage: the plain rule
    pick = best_val_round(VAL, TEST, after=2)
    assert (pick.round, pick.val, pick.test) == (4, 0.7, 0.44)
    assert best_val_round(VAL, TEST, after=5) is None  # nothing after the stage


def test_the_report_reads_the_stage_from_the_run_metric():
    histories = {"round/val_acc_weighted": VAL, "round/acc_weighted": TEST}
    assert run_value(BEST_VAL, {PRETRAINING_ROUNDS: 2.0}, histories) == pytest.approx(44.0)
    assert run_value(BEST_VAL, {}, histories) == pytest.approx(11.0)  # a method without a stage


def test_up_to_pretrain_rounds_every_client_predicts_with_the_fedavg_model():
    """The boundary ``pretraining_rounds`` names: after round ``pretrain_rounds`` no client has a
    body of its own (every predictor is the server's model); after the next round a trained one has."""
    torch.manual_seed(0)
    net, fed = TinyLeNet(features=3), tiny_federation(sizes=(6, 6, 6))
    algorithm = make_method("lg_fedavg", net, lr=0.5, pretrain_rounds=2, local_steps=1)
    cfg = FederationConfig(rounds=3, clients_per_round=3, batch_size=6, eval_every=0)
    federation = Federation(algorithm, fed, model_params(net), cfg, Scripted([0.0] * 3), RunStreams(0))
    same_as_server = []
    for round_idx in range(3):
        lockstep_round([federation], Executor("sequential"), round_idx)
        server = federation.server
        same_as_server.append(all(
            all(torch.equal(algorithm.predictor(server, ctx)[k], server["params"][k]) for k in server["params"])
            for ctx in federation.contexts.values()))
    assert same_as_server == [True, True, False]
    assert algorithm.pretraining_rounds() == 2 == same_as_server.index(False)
    assert make_method("fedavg", TinyLeNet(features=3), lr=0.1).pretraining_rounds() == 0


def test_early_stopping_counts_only_the_evaluations_after_the_fedavg_stage():
    """no_best, patience 1, every 5 rounds, stage of 10 rounds: 0.9 and 0.8 (rounds 5, 10) are
    FedAvg's; LG-FedAvg improves to round 25, then two evaluations without a new best stop it at
    35. Counting the stage would stop at 15 (0.8 and 0.5 after the best 0.9)."""
    script = [0.9, 0.8, 0.5, 0.6, 0.7, 0.4, 0.3, 0.2, 0.1]
    fed = tiny_federation(sizes=(6, 6, 6))
    torch.manual_seed(0)
    net = TinyLeNet(features=3)
    cfg = FederationConfig(rounds=45, clients_per_round=2, batch_size=6, eval_every=5, early_stopping=True,
                           patience=1, patience_rule="no_best", early_stopping_after=0)
    algorithm = make_method("lg_fedavg", net, lr=0.1, pretrain_rounds=10, local_steps=1)
    result = run_lockstep([Federation(algorithm, fed, model_params(net), cfg, Scripted(script), RunStreams(0))],
                          Executor("sequential"))[0]
    rows = [(5 * (k + 1), v) for k, v in enumerate(script)]
    assert stop_round(rows, "no_best", 1, 0, 5) == 15
    assert result.stopped_round == stop_round([r for r in rows if r[0] > 10], "no_best", 1, 0, 5) == 35


def test_a_run_records_its_pretraining_rounds_and_a_run_without_a_stage_does_not():
    def run(method: dict) -> dict:
        cfg = RunConfig.from_dict({
            "data": {"dataset": "digits28", "num_clients": 4, "unseen_fraction": 0.0, "subsample": 200,
                     "client_splits": {"test": 0.2, "val": 0.2}, "partition": {"name": "iid"}},
            "model": {"name": "dnn", "params": {"hidden": 8}}, "method": method,
            "federation": {"rounds": 3, "clients_per_round": 2, "batch_size": 16, "eval_every": 1},
            "evaluation": {"protocol": "seen", "params": {"val_split": "val", "reduction": "sample"}}})
        return run_experiment(cfg, device="cpu").metrics

    params = {"lr": 0.05, "local_steps": 1, "head_prefixes": ["3."]}
    assert run({"name": "lg_fedavg", "params": {**params, "pretrain_rounds": 2}})[PRETRAINING_ROUNDS] == 2.0
    assert PRETRAINING_ROUNDS not in run({"name": "fedavg", "params": {"lr": 0.05, "local_epochs": 1}})

