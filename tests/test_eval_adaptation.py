"""The evaluation's fine-tuning switches that reproduce the pFedMe code's Per-FedAvg evaluation
(``EvalConfig.step_lrs``, ``adapt_split``, ``adapt_batches``; docs/papers/cgpfl.md, code
conventions): each against a hand computation, and the batched path against the sequential one.

The pFedMe code (CharlieDinh/pFedMe, ``FLAlgorithms/users/userperavg.py`` L73-88) takes one SGD
step at its learning rate and one at beta, each on the client's next *test* batch of the training
batch size, from an iterator that persists across rounds.
"""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch.func import functional_call

from pfl_core.algorithms import METHODS
from pfl_core.batching import BatchStream
from pfl_core.config import FederationConfig
from pfl_core.engine import Executor
from pfl_core.engine.contract import ClientContext
from pfl_core.evaluation import EvalConfig
from pfl_core.evaluation.clients import SeenClients
from pfl_core.evaluation.sequential import personalize_and_evaluate
from pfl_core.federation import make_contexts, run_federation
from pfl_core.models import build_model
from pfl_core.seeding import RunStreams
from pfl_core.training import model_params
from tests.helpers import tiny_federation
from tests.test_evaluation_batched import EVAL_CASES, assert_same_curves, evaluate, trained

ALPHA, BETA = 0.3, 0.7
TRAIN_BATCH, EVAL_BATCH = 2, 4  # the test split's passes use 4, its adaptation batches 2


def grad(model, params, x, y):
    leaves = {k: v.detach().clone().requires_grad_(True) for k, v in params.items()}
    loss = F.cross_entropy(functional_call(model, leaves, (x,)), y)
    return dict(zip(leaves, torch.autograd.grad(loss, list(leaves.values()))))


def sgd(model, params, dataset, index, lr):
    x, y = dataset.batch(index)
    g = grad(model, params, x, y)
    return {k: p - lr * g[k] for k, p in params.items()}


def loss_on_test(model, params, fed, cid=0):
    x, y = fed.dataset.batch(fed.clients[cid].splits["test"])
    return float(F.cross_entropy(functional_call(model, params, (x,)), y))


def setup(test=9):
    """One client (7 train, ``test`` test samples), an MLR and Per-FedAvg's fine-tuning step."""
    fed = tiny_federation(sizes=(7,), test=test)
    torch.manual_seed(0)
    model = build_model("mlr", (3,), 3)
    alg = METHODS.get("perfedavg")(model, METHODS.get("perfedavg").hyper_class())
    return fed, model, alg, model_params(model)


def context(fed, seed=3):
    client = fed.clients[0]
    streams = {name: BatchStream(idx, TRAIN_BATCH if name == "train" else EVAL_BATCH,
                                 torch.Generator().manual_seed(seed + k), drop_last=False)
               for k, (name, idx) in enumerate(sorted(client.splits.items()))}
    return ClientContext(client, fed.dataset, streams)


def test_step_lrs_take_one_step_at_alpha_then_one_at_beta():
    """steps 2, step_lrs [alpha, beta], on the train split: two explicit SGD steps on the train
    stream's first two batches (userperavg.py L81: MySGD at lr; L88: at beta)."""
    fed, model, alg, params = setup()
    cfg = EvalConfig(steps=2, step_lrs=[ALPHA, BETA], reduction="sample")
    result = personalize_and_evaluate(alg, params, context(fed), cfg, cfg.steps)
    train = context(fed).streams["train"]  # the same seed: the same order
    one = sgd(model, params, fed.dataset, train.next(), ALPHA)
    two = sgd(model, one, fed.dataset, train.next(), BETA)
    assert result.loss == pytest.approx([loss_on_test(model, p, fed) for p in (params, one, two)], rel=1e-6)


def test_step_lrs_must_cover_every_step():
    with pytest.raises(ValueError, match="fewer rates"):
        EvalConfig(steps=3, step_lrs=[0.1, 0.2])
    with pytest.raises(ValueError, match="positive"):
        EvalConfig(steps=1, step_lrs=[0.0])
    assert [EvalConfig(steps=2, lr=0.5, step_lrs=[0.1, 0.2]).lr_at(k) for k in (0, 1)] == [0.1, 0.2]


def test_adapt_split_evaluated_steps_on_the_test_order_in_train_sized_batches():
    """adapt_split evaluated: the batches are the test split's fixed order (its stream's) cut into
    batches of the train batch size, from the start (adapt_batches restart)."""
    fed, model, alg, params = setup()
    cfg = EvalConfig(steps=2, step_lrs=[ALPHA, BETA], reduction="sample", adapt_split="evaluated")
    result = personalize_and_evaluate(alg, params, context(fed), cfg, cfg.steps, evaluated_round=4)
    order = torch.cat(context(fed).streams["test"].epoch())
    assert not torch.equal(order, fed.clients[0].splits["test"])  # a shuffled order: the stream's matters
    one = sgd(model, params, fed.dataset, order[0:2], ALPHA)
    two = sgd(model, one, fed.dataset, order[2:4], BETA)
    assert result.loss == pytest.approx([loss_on_test(model, p, fed) for p in (params, one, two)], rel=1e-6)


@pytest.mark.parametrize("evaluated_round,positions", [(1, (2, 3)), (2, (4, 0)), (7, (4, 0))])
def test_adapt_batches_continue_moves_on_by_steps_every_round(evaluated_round, positions):
    """adapt_batches continue: after round R the batches at positions 2R, 2R + 1 of the cyclic
    order (9 test samples in batches of 2: 5 batches, the last of one sample), as the code's
    persistent test iterator drawn twice before every round's training (userbase.py L134-142)."""
    fed, model, alg, params = setup()
    cfg = EvalConfig(steps=2, step_lrs=[ALPHA, BETA], reduction="sample", adapt_split="evaluated",
                     adapt_batches="continue")
    result = personalize_and_evaluate(alg, params, context(fed), cfg, cfg.steps, evaluated_round)
    chunks = torch.cat(context(fed).streams["test"].epoch()).split(TRAIN_BATCH)
    assert len(chunks) == 5
    one = sgd(model, params, fed.dataset, chunks[positions[0]], ALPHA)
    two = sgd(model, one, fed.dataset, chunks[positions[1]], BETA)
    assert result.loss[-1] == pytest.approx(loss_on_test(model, two, fed), rel=1e-6)


def test_adapt_batches_continue_on_the_train_split():
    """continue on the train split: the train stream's fixed batches from position steps * R."""
    fed, model, alg, params = setup()
    cfg = EvalConfig(steps=2, step_lrs=[ALPHA, BETA], reduction="sample", adapt_batches="continue")
    result = personalize_and_evaluate(alg, params, context(fed), cfg, cfg.steps, evaluated_round=1)
    batches = context(fed).streams["train"].epoch()  # 7 samples: [2, 2, 2, 1]
    one = sgd(model, params, fed.dataset, batches[2], ALPHA)
    two = sgd(model, one, fed.dataset, batches[3], BETA)
    assert result.loss[-1] == pytest.approx(loss_on_test(model, two, fed), rel=1e-6)
    reshuffled = context(fed)
    reshuffled.streams["train"].reshuffle = True
    with pytest.raises(ValueError, match="reshuffle"):
        personalize_and_evaluate(alg, params, reshuffled, cfg, cfg.steps)


def test_a_federation_adapts_each_round_on_the_next_test_batches():
    """In a run evaluated every round, the evaluation after round R fine-tunes on test batches
    2R and 2R + 1 (the protocol reads R from the history): what the pFedMe code draws."""
    fed = tiny_federation(sizes=(6, 5), test=7)
    torch.manual_seed(0)
    model = build_model("mlr", (3,), 3)
    alg = METHODS.get("perfedavg")(model, METHODS.get("perfedavg").hyper_class.from_dict(
        {"alpha": 0.1, "beta": 0.05, "local_steps": 1, "skip_logging_batch": False}))
    seen = []
    real = alg.finetune_step

    def recording(params, x, y, lr, client):
        seen.append((client.cid, lr, x.clone()))
        return real(params, x, y, lr, client)

    alg.finetune_step = recording
    cfg = FederationConfig(rounds=3, clients_per_round=0, batch_size=TRAIN_BATCH, eval_every=1)
    protocol = SeenClients(EvalConfig(steps=2, step_lrs=[ALPHA, BETA], reduction="sample", batch_size=EVAL_BATCH,
                                      adapt_split="evaluated", adapt_batches="continue"))
    run_federation(alg, fed, model_params(model), cfg, protocol, RunStreams(5))
    contexts = make_contexts(fed, fed.train_clients, cfg, RunStreams(5), "eval", EVAL_BATCH)
    expected = []
    for rnd in (1, 2, 3):
        for cid in fed.train_clients:
            chunks = torch.cat(contexts[cid].streams["test"].epoch()).split(TRAIN_BATCH)  # 4 batches
            expected += [(cid, lr, fed.dataset.batch(chunks[(2 * rnd + k) % len(chunks)])[0])
                         for k, lr in enumerate((ALPHA, BETA))]
    assert [(c, lr) for c, lr, _ in seen] == [(c, lr) for c, lr, _ in expected]
    assert all(torch.equal(x, want) for (_, _, x), (_, _, want) in zip(seen, expected))


SWITCHES = {
    "two-steps-train": dict(step_lrs=[0.1, 0.05]),
    "evaluated-restart": dict(step_lrs=[0.1, 0.05], adapt_split="evaluated"),
    "evaluated-continue": dict(step_lrs=[0.1, 0.05], adapt_split="evaluated", adapt_batches="continue"),
    "train-continue": dict(adapt_batches="continue"),
}


@pytest.mark.parametrize("switches", sorted(SWITCHES))
@pytest.mark.parametrize("name", ["fedavg_ft-mlp", "local-personal"])
def test_batched_evaluation_takes_the_same_fine_tuning_batches(name, switches):
    """Both execution paths fine-tune on the same batches under every switch (unequal test
    splits: last adaptation batches of unequal sizes)."""
    cfg = EvalConfig(steps=2, lr=0.1, reduction="sample", **SWITCHES[switches])
    setup_ = trained(EVAL_CASES[name])
    history = [{}] * 4  # the model after round 5
    protocol = SeenClients(cfg)
    sequential = protocol.evaluate(*_args(setup_, protocol, "sequential"), history=history)
    batched = protocol.evaluate(*_args(setup_, protocol, "batched"), history=history)
    assert_same_curves(sequential, batched)
    assert sequential.summary != evaluate(setup_, SeenClients(EvalConfig(steps=2, lr=0.1, reduction="sample")),
                                          "sequential").summary or switches == "train-continue"


def _args(setup_, protocol, execution):
    algorithm, result, fed, cfg, streams = setup_
    states = {cid: ctx.state for cid, ctx in result.contexts.items()}
    contexts = make_contexts(fed, protocol.client_ids(fed), cfg, streams, "eval", 3, states)
    return algorithm, result.server, contexts, Executor(execution)
