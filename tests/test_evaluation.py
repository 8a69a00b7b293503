import pytest
import torch

from pfl_core.algorithms import METHODS
from pfl_core.engine.contract import ClientContext
from pfl_core.batching import BatchStream
from pfl_core.config import FederationConfig
from pfl_core.evaluation import PROTOCOLS, ClientResult, EvalConfig, summarise
from pfl_core.evaluation.sequential import evaluate_params, personalize_and_evaluate
from pfl_core.federation import run_federation
from pfl_core.models import build_model
from pfl_core.seeding import RunStreams
from pfl_core.training import batch_loss, model_params
from tests.helpers import tiny_federation
from tests.test_training import _mlr_grad


def _context(fed, cid, batch_size, seed=0):
    client = fed.clients[cid]
    streams = {name: BatchStream(idx, batch_size, torch.Generator().manual_seed(seed + k),
                                 drop_last=name == "train")
               for k, (name, idx) in enumerate(sorted(client.splits.items()))}
    return ClientContext(client, fed.dataset, streams)


def test_learning_rate_decays_by_gamma_every_five_steps():
    cfg = EvalConfig(lr=0.05, gamma=0.8, decay_every=5)
    assert [cfg.lr_at(k) for k in (0, 4, 5, 9, 10, 49)] == pytest.approx(
        [0.05, 0.05, 0.04, 0.04, 0.032, 0.05 * 0.8**9])


def test_fine_tuning_curve_matches_a_hand_computed_schedule():
    fed = tiny_federation(sizes=(8,), test=4)
    model = build_model("mlr", (3,), 3)
    params = model_params(model)
    cfg = EvalConfig(steps=7, lr=0.5, gamma=0.5, decay_every=3, reduction="sample")
    alg = METHODS.get("fedavg_ft")(model, METHODS.get("fedavg_ft").hyper_class())
    result = personalize_and_evaluate(alg, params, _context(fed, 0, 4), cfg, cfg.steps)
    assert len(result.acc) == len(result.loss) == 8

    ctx = _context(fed, 0, 4)  # same seed: same batch order
    x_test, y_test = fed.dataset.batch(fed.clients[0].splits["test"])
    W, b = params["1.weight"].clone(), params["1.bias"].clone()
    for step in range(8):
        expected = float(batch_loss(model, {"1.weight": W, "1.bias": b}, x_test, y_test))
        assert result.loss[step] == pytest.approx(expected, rel=1e-5)
        x, y = fed.dataset.batch(ctx.streams["train"].next())
        gW, gb = _mlr_grad(W, b, x, y)
        lr = 0.5 * 0.5 ** (step // 3)
        W, b = W - lr * gW, b - lr * gb


def test_batch_mean_accuracy_skips_batches_of_one_and_sample_accuracy_does_not():
    fed = tiny_federation(sizes=(4,), test=5)
    test_idx = fed.clients[0].splits["test"]
    model = build_model("mlr", (3,), 3)
    params = {"1.weight": torch.zeros(3, 3), "1.bias": torch.tensor([5.0, 0.0, 0.0])}  # always class 0
    fed.dataset.y[test_idx] = torch.tensor([0, 1, 0, 0, 1])
    ctx = _context(fed, 0, 2)
    order = torch.cat(ctx.streams["test"].epoch())
    labels = fed.dataset.y[order]
    batch_accs = [float((labels[i:i + 2] == 0).float().mean()) for i in (0, 2)]  # last batch has 1
    alg = METHODS.get("fedavg")(model, METHODS.get("fedavg").hyper_class())
    acc, _ = evaluate_params(alg, params, ctx, EvalConfig(reduction="batch_mean"))
    assert acc == pytest.approx(sum(batch_accs) / 2)
    acc, _ = evaluate_params(alg, params, ctx, EvalConfig(reduction="sample"))
    assert acc == pytest.approx(3 / 5)


def test_summary_has_unweighted_and_sample_weighted_means():
    results = [ClientResult(0, 10, [0.1, 0.2, 0.3, 0.4], [1, 1, 1, 1]),
               ClientResult(1, 30, [0.5, 0.6, 0.7, 0.8], [1, 1, 1, 1])]
    summary = summarise(results)
    assert summary.curve_mean == pytest.approx([0.3, 0.4, 0.5, 0.6])
    assert summary.curve_weighted == pytest.approx([0.4, 0.5, 0.6, 0.7])
    assert summary.summary["acc"] == pytest.approx(0.6)
    assert summary.summary["acc_weighted"] == pytest.approx(0.7)
    assert summary.summary["acc_last3"] == pytest.approx(0.5)
    assert summary.summary["acc_step0"] == pytest.approx(0.3)


def _evaluate(method, protocol, unseen=(), steps=4):
    fed = tiny_federation(sizes=(6, 6, 6, 6), unseen=unseen)
    model = build_model("mlr", (3,), 3)
    cls = METHODS.get(method)
    alg = cls(model, cls.hyper_class(lr=0.1, local_steps=1))
    proto = PROTOCOLS.get(protocol)(EvalConfig(steps=steps))
    cfg = FederationConfig(rounds=2, clients_per_round=0, batch_size=3)
    return run_federation(alg, fed, model_params(model), cfg, proto, RunStreams(0)).final


def test_only_fine_tuning_methods_get_personalization_steps():
    assert all(len(r.acc) == 1 for r in _evaluate("fedavg", "unseen", unseen=(3,)).clients)
    assert all(len(r.acc) == 5 for r in _evaluate("fedavg_ft", "unseen", unseen=(3,)).clients)


def test_unseen_protocol_evaluates_only_held_out_clients():
    assert [r.cid for r in _evaluate("fedavg", "unseen", unseen=(1, 3)).clients] == [1, 3]
    assert [r.cid for r in _evaluate("fedavg", "seen", unseen=(1,)).clients] == [0, 2, 3]


def test_unseen_protocol_without_held_out_clients_is_an_error():
    with pytest.raises(ValueError, match="unseen_fraction"):
        _evaluate("fedavg", "unseen")
