"""Early stopping (MetaVers spec, "Early stopping"): the rule on scripted validation sequences
(exact stop rounds), inside the federation loop (alone and in lockstep), recorded in the run."""
from __future__ import annotations

import pytest
import torch

from pfl_core.config import FederationConfig
from pfl_core.early_stopping import stop_round
from pfl_core.engine import Executor
from pfl_core.evaluation import EvalConfig, EvalResult, Protocol
from pfl_core.federation import Federation, run_federation, run_lockstep
from pfl_core.models import build_model
from pfl_core.seeding import RunStreams
from pfl_core.training import model_params
from tests.helpers import make_method, one_thread, tiny_federation  # noqa: F401

pytestmark = pytest.mark.usefixtures("one_thread")

# best 0.6 at the 2nd evaluation; then drops (+1 each), a rise that is no new best (+0), drops
SCRIPT = [0.5, 0.6, 0.55, 0.54, 0.53, 0.52, 0.56, 0.51, 0.50, 0.49, 0.48, 0.47, 0.46, 0.45,
          0.44, 0.43, 0.42, 0.41, 0.40, 0.39, 0.38, 0.37, 0.36, 0.35, 0.34]
# counters after each evaluation: 0 0 1 2 3 4 4 5 6 7 8 9 10 11 (14th evaluation) 12 13 ...


def evaluations(every):
    return [(every * (k + 1), v) for k, v in enumerate(SCRIPT)]


def test_drop_rule_counts_drops_from_the_previous_evaluation_and_resets_at_a_new_best():
    assert stop_round(evaluations(50), every=50) == 700  # 14th evaluation: counter 11 > 10, 750 > 101
    # counter > 10 at round 70, but the code stops only at a round > 101: the evaluations due at
    # 75..100 still happen (the counter keeps growing), and none follows the one at 100
    assert stop_round(evaluations(5), every=5) == 100
    assert stop_round(evaluations(5), every=5, after=0) == 70
    assert stop_round(evaluations(50), patience=11, every=50) == 750
    assert stop_round([(50, 0.5), (100, 0.7), (150, 0.6), (200, 0.8)] + [(250 + 50 * k, 0.8 - 0.01 * k)
                                                                         for k in range(10)]) is None  # reset at 0.8


def test_no_best_rule_counts_every_evaluation_without_a_new_best():
    # after the best at the 2nd evaluation, every one counts: counter 11 at the 13th
    assert stop_round(evaluations(500), rule="no_best", after=0) == 6500
    flat = [(k, 0.5) for k in range(1, 20)]
    assert stop_round(flat, rule="no_best", after=0) == 12  # equal values are no new best
    assert stop_round(flat, rule="drop", after=0) is None    # ... nor a drop
    assert stop_round([(1, 0.0)], rule="no_best", patience=0, after=0) == 1  # the best starts at 0, as the code


class Scripted(Protocol):
    """Returns the next validation value of ``script`` at every evaluation (no client evaluated)."""

    def __init__(self, script, key="val_acc_weighted"):
        super().__init__(EvalConfig())
        self.script, self.key = list(script), key

    def client_ids(self, fed):
        return []

    def evaluate(self, algorithm, server, contexts, executor=None, history=None):
        k = sum(1 for row in history if self.key in row)
        return EvalResult([], {self.key: self.script[k], "acc": float(k)})


def federation(script, early_stopping=True, rounds=200, **kw):
    fed = tiny_federation()
    model = build_model("mlr", (3,), 3)
    cfg = FederationConfig(rounds=rounds, clients_per_round=2, batch_size=4, eval_every=5,
                           early_stopping=early_stopping, **kw)
    return Federation(make_method("fedavg", model, lr=0.1), fed, model_params(model), cfg, Scripted(script),
                      RunStreams(0))


def test_the_federation_stops_at_the_rule_round_and_keeps_that_evaluation():
    result = run_lockstep([federation(SCRIPT)], Executor("sequential"))[0]
    assert result.stopped_round == 100
    assert len(result.history) == 100 and result.history[-1]["round"] == 100
    assert result.final.summary["acc"] == 19.0  # the 20th evaluation, the one at round 100
    assert len(result.sampled) == 100


def test_early_stopping_is_off_by_default_and_runs_every_round():
    result = run_lockstep([federation(SCRIPT, early_stopping=False, rounds=120)], Executor("sequential"))[0]
    assert result.stopped_round is None and len(result.history) == 120


def test_runs_in_lockstep_stop_each_at_its_own_round():
    never = [0.1 * k for k in range(1, 40)]
    stops, goes_on = run_lockstep([federation(SCRIPT, rounds=150), federation(never, rounds=150)],
                                  Executor("sequential"))
    assert (stops.stopped_round, len(stops.history)) == (100, 100)
    assert (goes_on.stopped_round, len(goes_on.history)) == (None, 150)
    alone = run_lockstep([federation(never, rounds=150)], Executor("sequential"))[0]
    assert goes_on.sampled == alone.sampled  # the other run's stop changes nothing of this one


def test_a_missing_key_names_the_switch():
    fed = federation(SCRIPT, early_stopping_key="val_avg_acc")
    with pytest.raises(ValueError, match="federation.early_stopping_key"):
        run_lockstep([fed], Executor("sequential"))


def test_run_federation_with_a_real_protocol_stops_by_its_val_history():
    from pfl_core.evaluation import PROTOCOLS

    fed = tiny_federation(sizes=(8, 8, 8))
    for client in fed.clients:
        client.splits["val"] = client.splits["test"]
    model = build_model("mlr", (3,), 3)
    cfg = FederationConfig(rounds=60, clients_per_round=2, batch_size=4, eval_every=2, early_stopping=True,
                           patience=1, patience_rule="no_best", early_stopping_after=0)
    protocol = PROTOCOLS.get("seen")(EvalConfig(val_split="val", reduction="sample"))
    result = run_federation(make_method("fedavg", model, lr=0.5), fed, model_params(model), cfg, protocol,
                            RunStreams(0))
    rows = [(row["round"], row["val_acc_weighted"]) for row in result.history if "val_acc_weighted" in row]
    assert [r for r, _ in rows] == list(range(2, len(result.history) + 1, 2))
    assert result.stopped_round == stop_round(rows, "no_best", 1, 0, 2) == len(result.history) < 60


def test_a_run_resumed_after_its_stop_keeps_the_stop_and_its_final_evaluation():
    from pfl_core.checkpoint import federation_state, load_federation_state

    original = federation(SCRIPT)
    done = run_lockstep([original], Executor("sequential"))[0]
    # a checkpoint of the stopped run: its history ends with the stopping evaluation
    resumed = federation(SCRIPT)
    load_federation_state(resumed, federation_state(original), torch.device("cpu"))
    result = run_lockstep([resumed], Executor("sequential"), start_round=len(original.result.history))[0]
    assert result.stopped_round == done.stopped_round == 100
    assert result.history == done.history
    assert result.final.summary == done.final.summary  # evaluated again from the saved server
