"""MetaVers tests aimed at single-line bugs that the behaviour tests let through (issue 28 item 6):
each test below failed with its bug planted (named in its docstring) and passes without it."""
from __future__ import annotations

import pytest
import torch

from pfl_core.algorithms.metavers import MetaVersUpdate
from pfl_core.config import FederationConfig
from pfl_core.data.datasets import METAVERS_MEAN_STD
from pfl_core.early_stopping import stop_round
from pfl_core.algorithms._lib.episodes import draw_episode
from pfl_core.evaluation import EvalConfig
from pfl_core.algorithms._lib.margin_losses import prototypical_ce
from pfl_core.evaluation import PROTOCOLS
from pfl_core.training import embed, model_params
from tests.helpers import make_method
from tests.test_metavers import LinearEmbedding, episode_batch, pools_of


def test_a_regular_episode_samples_its_images_not_the_first_of_each_class():
    """Bug: each class's first K+Q images (no permutation) in every episode."""
    gen = torch.Generator().manual_seed(0)
    seen = set()
    for _ in range(10):
        ep = draw_episode(pools_of([30, 40]), shot=2, query=3, generator=gen)
        seen |= set(torch.cat([ep.support, ep.query]).tolist())
    assert len(seen) > 2 * (2 + 3) + 10  # many more images than one fixed episode holds
    assert not seen <= {*range(5), *range(100, 105)}


def test_the_fallback_batch_is_a_new_shuffled_batch_every_round():
    """Bug: the R* batch drawn identically every round (a fixed seed or no shuffle)."""
    gen = torch.Generator().manual_seed(0)
    draws = [draw_episode(pools_of([3, 40, 40]), shot=2, query=2, generator=gen, batch_size=20) for _ in range(4)]
    assert all(ep.fallback for ep in draws)
    batches = {tuple(sorted(torch.cat([ep.support, ep.query]).tolist())) for ep in draws}
    assert len(batches) == 4


@pytest.mark.parametrize("update", ["fedsgd_adam", "local_sgd"])
def test_the_server_takes_the_uniform_mean_of_the_uploads_whatever_their_sample_counts(update):
    """Bug: uploads weighted by their clients' sample counts (``trainer.py:424-427`` scales the
    summed gradients by 1/|sampled clients|)."""
    torch.manual_seed(0)
    alg = make_method("metavers", LinearEmbedding().double(), update=update)
    server = alg.init_server({"w": torch.zeros(2, dtype=torch.float64)})
    uploads = [torch.tensor([1.0, 0.0], dtype=torch.float64), torch.tensor([0.0, 3.0], dtype=torch.float64)]
    updates = [MetaVersUpdate({"w": g}, n, torch.tensor(0.0), torch.tensor(1.0), True)
               for g, n in zip(uploads, (1, 99))]
    new = alg.aggregate(server, updates)["params"]["w"]
    if update == "local_sgd":
        torch.testing.assert_close(new, torch.tensor([0.5, 1.5], dtype=torch.float64))
    else:  # Adam's first step moves every coordinate with a nonzero mean gradient by -lr sign(g)
        uniform = alg.aggregate(server, [MetaVersUpdate({"w": g}, 1, torch.tensor(0.0), torch.tensor(1.0), True)
                                         for g in uploads])["params"]["w"]
        torch.testing.assert_close(new, uniform)
        state = alg.aggregate(server, updates)["adam"]
        first_moment = next(v for k, v in state.items() if isinstance(v, dict) and "w" in v)["w"]
        torch.testing.assert_close(first_moment / first_moment.abs().max(),
                                   torch.tensor([1 / 3, 1.0], dtype=torch.float64))


def test_the_metavers_normalisation_constants_are_the_codes_literals():
    """Bug: a typo in a constant (the data test reads the same table as the loader);
    MetaVers ``datasets.py`` Normalize values written out."""
    assert METAVERS_MEAN_STD["cifar10"] == ((0.4914, 0.4822, 0.4465), (0.2023, 0.1994, 0.2010))
    assert METAVERS_MEAN_STD["cifar100"] == ((0.5071, 0.4865, 0.4409), (0.2673, 0.2564, 0.2762))


def test_early_stopping_patience_is_ten_as_the_code():
    """Bug: patience 9 (``trainer.py``: ``--patience`` default 10; stop when the counter exceeds it)."""
    assert FederationConfig().patience == 10
    drops = [(k + 1, 1.0 - 0.01 * k) for k in range(20)]  # every evaluation after the first a drop
    assert stop_round(drops, after=0) == 12  # counter 11 > 10 at the 12th evaluation
    assert stop_round(drops, patience=9, after=0) == 11


def test_the_novel_class_test_split_is_not_evaluated_on_a_validation_tie(monkeypatch):
    """Bug: test classes evaluated when validation equals the best so far (the code: ``>``)."""
    protocol = PROTOCOLS.get("novel_class")(EvalConfig(groups_val=2, groups_test=2, users=2))
    calls = []
    monkeypatch.setattr(protocol, "_split", lambda role, *a: calls.append(role) or (0.5, 0.0))
    alg = make_method("metavers", LinearEmbedding().double())
    server = alg.init_server({"w": torch.zeros(2, dtype=torch.float64)})
    tie = protocol.evaluate(alg, server, {}, None, [{"val_acc": 0.5, "acc": 0.7, "acc_ci95": 0.0}]).summary
    assert calls == ["val"] and "acc" not in tie and tie["test_at_best_val"] == 0.7
    better = protocol.evaluate(alg, server, {}, None, [{"val_acc": 0.4}]).summary
    assert calls == ["val", "val", "test"] and better["acc"] == 0.5


@pytest.mark.parametrize("first_round, expected", [(0, (1.0, 0.0)), (1, (0.5, 0.5))])
def test_first_round_reaches_the_loss_weights(first_round, expected):
    """Bug: the loss weights read the round index, not tau = round + first_round (W = 1, round 1:
    tau 1 is still warm-up in ``trainer.py``, tau 2 is not in ``trainer_novel_class.py``)."""
    alg = make_method("metavers", LinearEmbedding().double(), warmup=1, first_round=first_round)
    server = alg.init_server({"w": torch.zeros(2, dtype=torch.float64)})
    carry = alg.carry_in(server, None, 1)
    assert (float(carry["w_s"]), float(carry["w_t"])) == expected


def test_the_support_set_makes_the_prototypes_and_the_query_is_classified():
    """Bug: support and query swapped in the client program (K = Q, so no shape changes)."""
    torch.manual_seed(0)
    alg = make_method("metavers", LinearEmbedding().double(), loss="ce", shot=2, query=2)
    xs, ys, xq, yq = episode_batch(ways=3, shot=2, query=2)
    xq = xq * 3.0 + 1.0  # make the two sets differ in spread
    params = model_params(alg.model)
    carry = {"params": params, **{k: torch.tensor(v, dtype=torch.float64)
                                  for k, v in (("m_global", 0.0), ("w_s", 1.0), ("w_t", 0.0))}}
    _, loss = alg.local_update(carry, {"support": (xs[None], ys[None]), "query": (xq[None], yq[None])}, {})
    onehot = torch.nn.functional.one_hot(yq - 4, 3).double()
    es, eq = embed(alg.model, params, xs), embed(alg.model, params, xq)
    assert float(loss) == pytest.approx(float(prototypical_ce(es, eq, onehot, shot=2)))
    assert float(loss) != pytest.approx(float(prototypical_ce(eq, es, onehot, shot=2)))
