"""MetaVers (issue 13 item 1; MetaVers spec "Algorithms"): episodes, losses against hand
computations and brute-force loops, the server's margin and Adam step, and every switch."""
from __future__ import annotations

import itertools
import math

import pytest
import torch
from torch import nn

from pfl_core.algorithms.metavers import MetaVersUpdate
from pfl_core.config import FederationConfig
from pfl_core.data.federated import ArrayDataset, Client, FederatedData
from pfl_core.algorithms._lib.episodes import class_pools, draw_episode
from pfl_core.engine.executor import start_client
from pfl_core.evaluation import EvalConfig
from pfl_core.evaluation.clients import SeenClients
from pfl_core.federation import run_federation
from pfl_core.algorithms._lib.margin_losses import centroid_triplet, local_margin, prototypical_ce
from pfl_core.models import build_model
from pfl_core.prototypes import class_prototypes, nearest_prototype
from pfl_core.seeding import RunStreams
from pfl_core.training import model_params
from tests.helpers import make_method, one_thread  # noqa: F401

pytestmark = pytest.mark.usefixtures("one_thread")


def pools_of(sizes: list[int]) -> list[torch.Tensor]:
    """Class c holds ``sizes[c]`` indices, numbered from 100 * c."""
    return [torch.arange(100 * c, 100 * c + n) for c, n in enumerate(sizes)]


def class_of(index: torch.Tensor) -> list[int]:
    return (index // 100).tolist()


# ------------------------------------------------------------------ episodes

def test_a_regular_episode_has_k_support_and_q_query_images_of_every_class():
    gen = torch.Generator().manual_seed(0)
    pools = pools_of([30, 40, 25])
    orders = set()
    for _ in range(20):
        ep = draw_episode(pools, shot=5, query=15, generator=gen)
        assert not ep.fallback and ep.ways == 3
        assert len(ep.support) == 3 * 5 and len(ep.query) == 3 * 15  # N(K+Q) images in all
        support_blocks = [class_of(ep.support[5 * b: 5 * b + 5]) for b in range(3)]
        assert all(len(set(block)) == 1 for block in support_blocks)  # K-blocks of one class
        order = [block[0] for block in support_blocks]
        assert sorted(order) == [0, 1, 2]
        assert class_of(ep.query) == [c for c in order for _ in range(15)]  # same class order
        everything = torch.cat([ep.support, ep.query])
        assert len(set(everything.tolist())) == 60  # without replacement
        orders.add(tuple(order))
    assert len(orders) > 1  # the class order (the code's label permutation) is random


def test_a_short_class_falls_back_to_one_batch_cut_to_k_plus_q_per_class():
    """R*: class 0 has 3 < K+Q = 4 images; the batch (all 23 <= 450) holds more than (K+Q)N = 8,
    so each class keeps its first K+Q: class 0 all 3 (2 support, 1 query), class 1 4 (2 + 2)."""
    gen = torch.Generator().manual_seed(1)
    ep = draw_episode(pools_of([3, 20]), shot=2, query=2, generator=gen)
    assert ep.fallback and ep.ways == 2
    assert len(ep.support) == 4 and len(ep.query) == 3
    assert sorted(class_of(ep.query)) == [0, 1, 1]
    blocks = [class_of(ep.support[:2]), class_of(ep.support[2:])]
    assert all(len(set(b)) == 1 for b in blocks) and {b[0] for b in blocks} == {0, 1}


def test_a_small_fallback_batch_keeps_all_its_images():
    """CIFAR-10 U = 500: every image of the batch (<= (K+Q)N) is kept; first K support."""
    gen = torch.Generator().manual_seed(2)
    ep = draw_episode(pools_of([35, 41]), shot=20, query=30, generator=gen)
    assert ep.fallback and len(ep.support) == 40 and len(ep.query) == 35 + 41 - 40
    ep = draw_episode(pools_of([35, 41]), shot=20, query=30, generator=gen, batch_size=50)
    assert len(ep.support) + len(ep.query) == 50  # one loader batch of at most 50 images


def test_full_batch_mode_always_uses_the_train_batch():
    gen = torch.Generator().manual_seed(3)
    ep = draw_episode(pools_of([8, 7, 9]), shot=3, query=15, generator=gen, full_batch=True)
    assert ep.fallback and len(ep.support) == 9 and len(ep.query) == 24 - 9
    regular = draw_episode(pools_of([30, 30]), shot=3, query=15, generator=gen, full_batch=True)
    assert regular.fallback and len(regular.support) + len(regular.query) == 36  # first K+Q of each


def test_classes_too_small_for_a_support_set_are_left_out_and_no_query_is_an_error():
    gen = torch.Generator().manual_seed(4)
    ep = draw_episode(pools_of([1, 6]), shot=2, query=4, generator=gen)
    assert ep.ways == 1 and set(class_of(torch.cat([ep.support, ep.query]))) == {1}
    with pytest.raises(ValueError, match="lower method.params.shot"):
        draw_episode(pools_of([2, 2]), shot=2, query=3, generator=gen, where="client 7: ")


def test_class_pools_group_a_clients_train_split_by_label():
    labels = torch.tensor([2, 0, 2, 5])
    pools = class_pools(labels, torch.tensor([10, 11, 12, 13]))
    assert [p.tolist() for p in pools] == [[11], [10, 12], [13]]


# ------------------------------------------------------------------ losses

def toy_episode():
    """3 classes (rows 0-1, 2-3, 4-5), 2-d embeddings; class means (1, 0), (0, 2), (3, 3)."""
    e = torch.tensor([[0.0, 0.0], [2.0, 0.0], [0.0, 1.0], [0.0, 3.0], [3.0, 2.0], [3.0, 4.0]], dtype=torch.float64)
    onehot = torch.tensor([[1, 0, 0], [1, 0, 0], [0, 1, 0], [0, 1, 0], [0, 0, 1], [0, 0, 1]], dtype=torch.float64)
    return e, onehot


def test_local_margin_equals_a_hand_computation_on_three_classes():
    e, onehot = toy_episode()
    pairs = [math.sqrt(1 + 4), math.sqrt(4 + 9), math.sqrt(9 + 1)]  # |a1-a2|, |a1-a3|, |a2-a3|
    assert float(local_margin(e, onehot)) == pytest.approx(sum(pairs) / 3)
    assert float(local_margin(e, onehot, eq3_scale=True)) == pytest.approx(sum(pairs) / 3 * 3 / 2)
    # Eq. 3 literally: 1/(N-1)^2 sum over ordered pairs k != l
    assert float(local_margin(e, onehot, eq3_scale=True)) == pytest.approx(2 * sum(pairs) / 4)
    assert float(local_margin(e[:2], onehot[:2, :1])) == 0.0  # one class: no margin


def brute_triplet(e, labels, margin, squared=True, negative_from="anchor", reduction="mean"):
    """The code's triplet_batch loops written out (util.py: for each class, each positive, each negative)."""
    dist = (lambda a, b: ((a - b) ** 2).sum()) if squared else (lambda a, b: ((a - b) ** 2).sum().sqrt())
    total, per_class = 0.0, []
    for c in sorted(set(labels)):
        rows = [i for i, l in enumerate(labels) if l == c]
        others = [i for i, l in enumerate(labels) if l != c]
        anchor = e[rows].mean(0)
        values = []
        for p in rows:
            for n in others:
                neg = dist(anchor, e[n]) if negative_from == "anchor" else dist(e[p], e[n])
                values.append(max(0.0, float(margin + dist(anchor, e[p]) - neg)))
        per_class.append(sum(values) / len(values))
        total += sum(values)
    return total if reduction == "sum" else sum(per_class) / len(per_class)


@pytest.mark.parametrize("squared,negative_from,reduction", list(itertools.product(
    [True, False], ["anchor", "positive"], ["mean", "sum"])))
@pytest.mark.parametrize("margin", [0.5, 4.0, 30.0])
def test_centroid_triplet_equals_a_brute_force_loop(squared, negative_from, reduction, margin):
    gen = torch.Generator().manual_seed(5)
    e = torch.randn(9, 4, generator=gen, dtype=torch.float64)
    labels = [0, 0, 0, 1, 1, 2, 2, 2, 2]  # unequal classes (the R* fallback)
    onehot = torch.nn.functional.one_hot(torch.tensor(labels), 3).double()
    value = centroid_triplet(e, onehot, torch.tensor(margin, dtype=torch.float64), squared, negative_from, reduction)
    assert float(value) == pytest.approx(brute_triplet(e, labels, margin, squared, negative_from, reduction))


def test_centroid_triplet_hand_value_on_the_toy_episode():
    """m = 5, hinge 5 + 1 - d(a, n) for positives at squared distance 1 from their anchor.
    Class 0: anchor (1, 0), negatives at 2, 10, 8, 20 -> hinges 4, 0, 0, 0: mean 1; class 1:
    anchor (0, 2), negatives at 4, 8, 9, 13 -> 2, 0, 0, 0: mean 1/2; class 2: anchor (3, 3),
    negatives at 18, 10, 13, 9 -> all 0."""
    e, onehot = toy_episode()
    value = centroid_triplet(e, onehot, torch.tensor(5.0, dtype=torch.float64))
    assert float(value) == pytest.approx((1.0 + 0.5 + 0.0) / 3)


def test_prototypical_ce_equals_the_formula():
    gen = torch.Generator().manual_seed(6)
    support, query = torch.randn(4, 3, generator=gen), torch.randn(3, 3, generator=gen)
    onehot = torch.tensor([[0.0, 1.0], [1.0, 0.0], [0.0, 1.0]])
    protos = torch.stack([support[:2].mean(0), support[2:].mean(0)])
    expected = 0.0
    for q, row in zip(query, onehot):
        logits = [-float(((q - p) ** 2).sum()) for p in protos]
        target = int(row.argmax())
        expected += -logits[target] + math.log(sum(math.exp(v) for v in logits))
    assert float(prototypical_ce(support, query, onehot, shot=2)) == pytest.approx(expected / 3, rel=1e-5)


# ------------------------------------------------------------------ the method on a linear embedding

class LinearEmbedding(nn.Module):
    """f(x) = W x + b on flat features (an ``embed`` flag like the LeNet family)."""

    def __init__(self, features=3, dim=2):
        super().__init__()
        self.fc = nn.Linear(features, dim)

    def forward(self, x, embed=False):
        return self.fc(x.flatten(1))


def metavers(**hp):
    torch.manual_seed(0)
    return make_method("metavers", LinearEmbedding().double(), **hp)


def episode_batch(seed=7, ways=3, shot=2, query=2):
    gen = torch.Generator().manual_seed(seed)
    xs = torch.randn(ways * shot, 3, generator=gen, dtype=torch.float64)
    xq = torch.randn(ways * query, 3, generator=gen, dtype=torch.float64)
    ys = torch.arange(ways).repeat_interleave(shot) + 4  # dataset labels 4, 5, 6
    yq = torch.arange(ways).repeat_interleave(query) + 4
    return xs, ys, xq, yq


def grads_of(alg, m_global, w_s=0.0, w_t=1.0, batch=None):
    from pfl_core.training import value_and_grad

    xs, ys, xq, yq = batch or episode_batch()
    scalar = lambda v: torch.tensor(v, dtype=torch.float64)
    grads, (loss, d) = value_and_grad(alg.episode_loss, model_params(alg.model), xs, ys, xq, yq,
                                      scalar(m_global), scalar(w_s), scalar(w_t), has_aux=True)
    return grads, float(loss), float(d)


def triplet_grads_with_margin(alg, margin_fn):
    """Gradient of L_T when the margin is ``margin_fn(d)`` (d with its gradient)."""
    from pfl_core.training import embed, value_and_grad

    xs, ys, xq, yq = episode_batch()
    onehot = torch.nn.functional.one_hot(torch.cat([ys, yq]) - 4, 3).double()

    def loss(params):
        e = embed(alg.model, params, torch.cat([xs, xq]))
        d = local_margin(e, onehot)
        return centroid_triplet(e, onehot, margin_fn(d))

    return value_and_grad(loss, model_params(alg.model))[0]


def assert_grads(a, b, equal=True):
    close = all(torch.allclose(a[k], b[k], rtol=1e-9, atol=1e-12) for k in a)
    assert close is equal


def test_the_select_margin_carries_gradient_only_when_d_reaches_m_global():
    alg = metavers(loss="triplet", shot=2, query=2)
    _, _, d = grads_of(alg, 0.0)
    above, _, _ = grads_of(alg, d * 0.5)  # d >= m_global: m = d, gradient through d
    assert_grads(above, triplet_grads_with_margin(alg, lambda dd: dd))
    assert_grads(above, triplet_grads_with_margin(alg, lambda dd: dd.detach()), equal=False)
    tie, _, _ = grads_of(alg, d)  # d == m_global: still d (the code's `if d < global_d` is False)
    assert_grads(tie, above)
    below, _, _ = grads_of(alg, d * 1.5)  # d < m_global: the constant m_global
    assert_grads(below, triplet_grads_with_margin(alg, lambda dd: torch.tensor(d * 1.5, dtype=torch.float64)))
    detached = metavers(loss="triplet", shot=2, query=2, margin_grad=False)
    no_grad, _, _ = grads_of(detached, d * 0.5)
    assert_grads(no_grad, triplet_grads_with_margin(alg, lambda dd: dd.detach()))


def test_the_fixed_margin_and_margin_hp_set_the_hinge():
    fixed = metavers(loss="triplet", shot=2, query=2, margin_from="fixed", fixed_margin=0.75, margin_hp=0.25)
    grads, loss, _ = grads_of(fixed, 123.0)  # m_global is ignored
    assert_grads(grads, triplet_grads_with_margin(fixed, lambda d: torch.tensor(1.0, dtype=torch.float64)))
    assert_grads(grads, triplet_grads_with_margin(fixed, lambda d: torch.tensor(0.75, dtype=torch.float64)),
                 equal=False)  # margin_hp is added


@pytest.mark.parametrize("switches", [{}, {"squared": False}, {"triplet_negative": "positive"},
                                      {"triplet_reduction": "sum"},
                                      {"squared": False, "triplet_negative": "positive", "triplet_reduction": "sum"}])
def test_the_methods_triplet_switches_reach_the_loss(switches):
    """L_T of the method (fixed margin 2) equals the brute-force loop with the same paper switches."""
    alg = metavers(loss="triplet", shot=2, query=2, margin_from="fixed", fixed_margin=2.0, **switches)
    _, loss, _ = grads_of(alg, 0.0)
    xs, ys, xq, yq = episode_batch()
    e = alg.model(torch.cat([xs, xq])).detach()
    labels = (torch.cat([ys, yq]) - 4).tolist()
    expected = brute_triplet(e, labels, 2.0, switches.get("squared", True),
                             switches.get("triplet_negative", "anchor"), switches.get("triplet_reduction", "mean"))
    assert expected > 0 and loss == pytest.approx(expected)


def test_the_loss_mixes_gamma_after_the_warmup_only():
    alg = metavers(shot=2, query=2, gamma=0.3, warmup=50)
    assert alg.loss_weights(0) == (1.0, 0.0) and alg.loss_weights(50) == (1.0, 0.0)
    assert alg.loss_weights(51) == pytest.approx((0.3, 0.7))
    _, mixed, d = grads_of(alg, 0.0, 0.3, 0.7)
    _, ce, _ = grads_of(alg, 0.0, 1.0, 0.0)
    _, triplet, _ = grads_of(alg, 0.0, 0.0, 1.0)
    assert mixed == pytest.approx(0.3 * ce + 0.7 * triplet)
    for loss, weights in (("ce", (1.0, 0.0)), ("triplet", (0.0, 1.0))):
        ablation = metavers(shot=2, query=2, loss=loss, warmup=50)
        assert ablation.w == -1 and ablation.loss_weights(0) == weights  # trainer.py:111-112
    assert metavers(w_role="interval", warmup=50, gamma=0.4).loss_weights(0) == pytest.approx((0.4, 0.6))
    novel = metavers(first_round=1, warmup=50)
    assert novel.loss_weights(novel.tau(49)) == (1.0, 0.0) and novel.loss_weights(novel.tau(50))[1] == 0.5


def test_squared_and_eq3_switches_change_the_losses_as_their_formulas_say():
    _, _, d = grads_of(metavers(loss="ce", shot=2, query=2), 0.0, 1.0, 0.0)
    _, _, d_eq3 = grads_of(metavers(loss="ce", shot=2, query=2, margin_scale="eq3"), 0.0, 1.0, 0.0)
    assert d_eq3 == pytest.approx(d * 3 / 2)
    xs, ys, xq, yq = episode_batch()
    alg = metavers(loss="ce", shot=2, query=2, squared=False)
    e = alg.model(torch.cat([xs, xq])).detach()
    protos = e[:6].reshape(3, 2, 2).mean(1)
    logits = -torch.cdist(e[6:], protos)
    expected = torch.nn.functional.cross_entropy(logits, yq - 4)
    _, loss, _ = grads_of(alg, 0.0, 1.0, 0.0)
    assert loss == pytest.approx(float(expected))


# ------------------------------------------------------------------ server

def fake_update(params, grad_value, margin, collects=True):
    grads = {k: torch.full_like(v, grad_value) for k, v in params.items()}
    return MetaVersUpdate(grads, 10, torch.tensor(0.0), torch.tensor(margin, dtype=torch.float64), collects)


def test_one_server_step_is_adam_on_the_averaged_gradient_with_coupled_weight_decay():
    alg = metavers(weight_decay=1e-3, lr=1e-3)
    params = {"w": torch.tensor([0.5, -2.0], dtype=torch.float64)}
    server = alg.init_server(params)
    updates = [MetaVersUpdate({"w": torch.tensor(g, dtype=torch.float64)}, 1, torch.tensor(0.0),
                              torch.tensor(1.0), True) for g in ([1.0, 3.0], [2.0, -1.0], [0.0, 4.0])]
    new = alg.aggregate(server, updates)["params"]["w"]
    # g = sum / 3 + wd * p = (1, 2) + 1e-3 * (0.5, -2); first Adam step: p - lr * g / (|g| + eps)
    g = [1.0 + 1e-3 * 0.5, 2.0 - 1e-3 * 2.0]
    expected = [0.5 - 1e-3 * g[0] / (abs(g[0]) + 1e-8), -2.0 - 1e-3 * g[1] / (abs(g[1]) + 1e-8)]
    assert new.tolist() == pytest.approx(expected, rel=1e-12)
    # against torch.optim.Adam(weight_decay) over several rounds of the persistent server state
    ref = torch.nn.Parameter(params["w"].clone())
    opt = torch.optim.Adam([ref], lr=1e-3, weight_decay=1e-3)
    gen = torch.Generator().manual_seed(0)
    for _ in range(4):
        grads = [torch.randn(2, generator=gen, dtype=torch.float64) for _ in range(5)]
        server = alg.aggregate(server, [MetaVersUpdate({"w": g}, 1, torch.tensor(0.0), torch.tensor(1.0), True)
                                        for g in grads])
        ref.grad = sum(grads) * (1 / 5)
        opt.step()
    torch.testing.assert_close(server["params"]["w"], ref.detach())


def test_the_step_lr_schedule_halves_the_server_learning_rate():
    alg = metavers(lr=0.1, lr_step=2, lr_gamma=0.5)
    server = alg.init_server({"w": torch.zeros(1, dtype=torch.float64)})
    moves = []
    for _ in range(4):  # Adam's first steps move by lr (m / sqrt(v) = 1 for a constant gradient)
        before = float(server["params"]["w"])
        server = alg.aggregate(server, [fake_update(server["params"], 1.0, 1.0)])
        moves.append(before - float(server["params"]["w"]))
    assert moves == pytest.approx([0.1, 0.1, 0.05, 0.05], rel=1e-6)


def test_the_paper_update_averages_locally_updated_parameters():
    alg = metavers(update="local_sgd", local_lr=0.1)
    params = {"w": torch.tensor([1.0], dtype=torch.float64)}
    server = alg.init_server(params)
    uploads = [MetaVersUpdate({"w": params["w"] - 0.1 * g}, 1, torch.tensor(0.0), torch.tensor(1.0), True)
               for g in (torch.tensor([2.0]), torch.tensor([4.0]))]
    assert server["adam"]["step"] == 0
    new = alg.aggregate(server, uploads)
    assert new["params"]["w"].tolist() == pytest.approx([1.0 - 0.1 * 3.0])  # Eq. 6: theta - eta * mean grad
    assert float(new["adam"]["step"]) == 0  # no server optimiser


def run_margins(alg, rounds, per_round=5):
    """Aggregate ``rounds`` rounds whose clients report d = 1, 2, 3, ...; m_global after each."""
    server = alg.init_server({"w": torch.zeros(1, dtype=torch.float64)})
    value, seen = 1.0, []
    for _ in range(rounds):
        updates = []
        for _ in range(per_round):
            updates.append(fake_update(server["params"], 0.0, value))
            value += 1
        server = alg.aggregate(server, updates)
        seen.append(server["m_global"])
    return seen, server


def test_the_global_margin_is_the_mean_of_the_last_250_local_margins_from_round_w():
    seen, server = run_margins(metavers(), rounds=60)
    assert seen[:50] == [0.0] * 50  # rounds 0..49 (< W = 50): --margin = 0.0
    # after round 50: 255 margins 1..255 collected, the last 250 are 6..255
    assert seen[50] == pytest.approx(sum(range(6, 256)) / 250)
    assert seen[59] == pytest.approx(sum(range(51, 301)) / 250)
    assert len(server["margins"]) == 250


def test_zero_margins_and_ce_clients_are_not_collected():
    alg = metavers(warmup=0)
    server = alg.init_server({"w": torch.zeros(1, dtype=torch.float64)})
    server = alg.aggregate(server, [fake_update(server["params"], 0.0, 0.0), fake_update(server["params"], 0.0, 3.0),
                                    fake_update(server["params"], 0.0, 7.0, collects=False)])
    assert server["margins"] == [3.0] and server["m_global"] == 3.0
    assert alg.round_metrics(server) == {"m_global": 3.0, "local_margin": 3.0}


def test_the_recursive_global_margin_follows_eq7():
    """W = 3: m^(t+1) = (m^(t-2) + m^(t-1) + mean d^(t)) / 3, from round W on."""
    seen, _ = run_margins(metavers(global_margin="recursive", warmup=3), rounds=6, per_round=2)
    means = [1.5 + 2 * t for t in range(6)]  # round t reports 2t+1, 2t+2
    in_effect = [0.0, 0.0, 0.0, 0.0]  # m used in rounds 0..3 (updates start after round 3)
    expected = []
    for t in range(3, 6):
        new = (in_effect[t - 2] + in_effect[t - 1] + means[t]) / 3
        expected.append(new)
        in_effect.append(new)
    assert seen[:3] == [0.0] * 3 and seen[3:] == pytest.approx(expected)


def test_the_interval_role_of_w_averages_the_last_w_rounds_from_the_first_round():
    seen, _ = run_margins(metavers(w_role="interval", warmup=2), rounds=4, per_round=2)
    assert seen == pytest.approx([1.5, 2.5, 4.5, 6.5])  # last 2 rounds x 2 clients, from round 0


# ------------------------------------------------------------------ whole runs

def image_data(num_clients=4, per_class=6, classes_per_client=2, classes=4, test=3, seed=0):
    gen = torch.Generator().manual_seed(seed)
    clients, xs, ys, start = [], [], [], 0
    for c in range(num_clients):
        own = [(c + k) % classes for k in range(classes_per_client)]
        labels = torch.tensor(own).repeat_interleave(per_class)
        test_labels = torch.tensor(own * test)[:test]
        n = len(labels) + len(test_labels)
        xs.append(torch.rand(n, 3, 32, 32, generator=gen))
        ys.append(torch.cat([labels, test_labels]))
        clients.append(Client(c, {"train": torch.arange(start, start + len(labels)),
                                  "test": torch.arange(start + len(labels), start + n)}))
        start += n
    return FederatedData(ArrayDataset("img", torch.cat(xs), torch.cat(ys), classes), clients, list(range(num_clients)))


def test_a_run_on_le_embedding_logs_the_margins_per_round_and_evaluates_by_prototypes():
    fed = image_data()
    torch.manual_seed(0)
    model = build_model("le_embedding", (3, 32, 32), 4)
    alg = make_method("metavers", model, shot=2, query=3, warmup=1)
    cfg = FederationConfig(rounds=3, clients_per_round=2, batch_size=4)
    result = run_federation(alg, fed, model_params(model), cfg, SeenClients(EvalConfig(reduction="sample")),
                            RunStreams(0))
    assert [set(r) >= {"m_global", "local_margin"} for r in result.history] == [True] * 3
    assert result.history[0]["m_global"] == 0.0 and result.history[1]["m_global"] > 0  # from round W = 1
    assert float(result.server["adam"]["step"]) == 3
    # logits: nearest prototype of the client's own train classes
    ctx = result.contexts[0]
    x, y = fed.dataset.batch(fed.clients[0].splits["test"])
    params = alg.predictor(result.server, ctx)
    train_x, train_y = fed.dataset.batch(fed.clients[0].splits["train"])
    emb = lambda v: model_embed(model, params, v)
    protos = class_prototypes(emb(train_x), train_y, 4)
    allowed = torch.bincount(train_y, minlength=4) > 0
    assert alg.logits(params, x, ctx).argmax(1).tolist() == nearest_prototype(emb(x), protos, allowed).tolist()
    with pytest.raises(ValueError, match="proto"):
        alg.logits(params, x, None)


def model_embed(model, params, x):
    from pfl_core.training import embed

    return embed(model, params, x)


def test_client_margin_update_reads_the_earlier_clients_of_the_same_round():
    """Novel-class trainer: after the warm-up, m_global is re-averaged before every client over a
    list that already holds this round's earlier d (trainer_novel_class.py:203-214)."""
    fed = image_data(num_clients=3)
    torch.manual_seed(0)
    model = build_model("le_embedding", (3, 32, 32), 4)
    alg = make_method("metavers", model, shot=2, query=3, warmup=0, margin_update="client", first_round=1)
    server = alg.init_server(model_params(model))
    from pfl_core.federation import make_contexts

    contexts = make_contexts(fed, [0, 1, 2], FederationConfig(batch_size=4), RunStreams(0), "batches", 4)
    carries, plans, _ = zip(*(start_client(alg, server, contexts[c], 0) for c in (0, 1, 2)))
    d = list(alg._round_margins)
    assert len(d) == 3 and float(carries[0]["m_global"]) == 0.0  # nothing collected yet
    assert float(carries[1]["m_global"]) == pytest.approx(d[0])
    assert float(carries[2]["m_global"]) == pytest.approx((d[0] + d[1]) / 2)
    assert all(len(p["support"][0]) == 4 for p in plans)  # one episode per client, drawn before carry_in


def test_coinciding_class_means_give_a_zero_not_a_nan_gradient():
    e = torch.tensor([[1.0, 2.0], [1.0, 2.0], [0.0, 0.0]], dtype=torch.float64, requires_grad=True)
    onehot = torch.eye(3, dtype=torch.float64)
    d = local_margin(e, onehot)
    d.backward()
    assert float(d.detach()) == pytest.approx((0 + 2 * math.sqrt(5)) / 3)
    assert torch.isfinite(e.grad).all()


def test_equal_episodes_of_a_round_run_as_one_vmap_call(monkeypatch):
    import pfl_core.engine.executor as executor_module
    from pfl_core.engine import Executor

    calls = []
    real = executor_module.vmap
    monkeypatch.setattr(executor_module, "vmap", lambda fn, **kw: calls.append(kw) or real(fn, **kw))
    fed = image_data(num_clients=4)
    torch.manual_seed(0)
    model = build_model("le_embedding", (3, 32, 32), 4)
    alg = make_method("metavers", model, shot=2, query=3)
    run_federation(alg, fed, model_params(model), FederationConfig(rounds=2, clients_per_round=3, batch_size=4),
                   SeenClients(EvalConfig(reduction="sample")), RunStreams(0), executor=Executor("batched"))
    assert len(calls) == 2  # one stacked call per round for its three equal episodes


def test_the_paper_update_uploads_theta_minus_eta_grad_and_the_code_uploads_the_gradient():
    xs, ys, xq, yq = episode_batch()
    batches = {"support": (xs.unsqueeze(0), ys.unsqueeze(0)), "query": (xq.unsqueeze(0), yq.unsqueeze(0))}
    code, paper = metavers(shot=2, query=2), metavers(shot=2, query=2, update="local_sgd", local_lr=0.1)
    server = code.init_server(model_params(code.model))
    carry = {
        "params": server["params"], "m_global": torch.tensor(0.0, dtype=torch.float64),
        "w_s": torch.tensor(1.0, dtype=torch.float64), "w_t": torch.tensor(0.0, dtype=torch.float64)}
    grads, ce, _ = grads_of(code, 0.0, 1.0, 0.0)
    out, loss = code.local_update(carry, batches, {})
    assert float(loss) == pytest.approx(ce)
    assert_grads(out["upload"], grads)
    out, _ = paper.local_update(carry, batches, {})
    assert_grads(out["upload"], {k: p - 0.1 * grads[k] for k, p in server["params"].items()})


def test_a_run_resumed_from_a_checkpoint_continues_the_margins_episodes_and_adam(tmp_path):
    """The server's margin list, m_global, round counter and Adam state, and every client's
    episode generator, survive a checkpoint: 4 rounds = 2 rounds, save, fresh objects, 2 more."""
    from pfl_core.checkpoint import Checkpointing
    from pfl_core.engine import Executor
    from pfl_core.federation import Federation, lockstep_round, run_lockstep

    def federation():
        fed = image_data(num_clients=4)
        torch.manual_seed(0)
        model = build_model("le_embedding", (3, 32, 32), 4)
        alg = make_method("metavers", model, shot=2, query=3, warmup=1, margin_window=3)
        cfg = FederationConfig(rounds=4, clients_per_round=2, batch_size=4)
        return Federation(alg, fed, model_params(model), cfg, SeenClients(EvalConfig(reduction="sample")),
                          RunStreams(0))

    reference = run_lockstep([federation()], Executor("sequential"))[0]
    saving = Checkpointing([tmp_path / "run.pt"], every=2)
    first = federation()
    for r in range(2):
        lockstep_round([first], Executor("sequential"), r)
    saving.save([first], 1)
    resumed = federation()
    start = saving.restore([resumed], saving.available(), torch.device("cpu"))
    result = run_lockstep([resumed], Executor("sequential"), start_round=start)[0]
    assert start == 2
    assert result.history == reference.history
    assert result.server["margins"] == reference.server["margins"] and len(result.server["margins"]) == 3
    torch.testing.assert_close(result.server["params"], reference.server["params"], rtol=0, atol=0)


class BatchNormEmbedding(nn.Module):
    """Linear -> BatchNorm (batch statistics): embeddings depend on the batch they are computed in."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(3, 2)
        self.bn = nn.BatchNorm1d(2, track_running_stats=False)

    def forward(self, x, embed=False):
        return self.bn(self.fc(x))


@pytest.mark.parametrize("ce_forward", ["split", "joint"])
def test_ce_forward_chooses_the_codes_passes_under_batch_statistics(ce_forward):
    """split (util.meta_update): support and query embedded in two batches; joint
    (meta_update_frl): the whole episode in one. Without BatchNorm one pass serves both."""
    torch.manual_seed(0)
    alg = make_method("metavers", BatchNormEmbedding().double(), loss="ce", shot=2, query=2, ce_forward=ce_forward)
    assert alg.batch_statistics
    _, loss, _ = grads_of(alg, 0.0, 1.0, 0.0)
    xs, ys, xq, yq = episode_batch()
    with torch.no_grad():
        if ce_forward == "split":
            es, eq = alg.model(xs), alg.model(xq)
        else:
            both = alg.model(torch.cat([xs, xq]))
            es, eq = both[:6], both[6:]
    onehot = torch.nn.functional.one_hot(yq - 4, 3).double()
    assert loss == pytest.approx(float(prototypical_ce(es, eq, onehot, shot=2)))
    other = make_method("metavers", BatchNormEmbedding().double(), loss="ce", shot=2, query=2,
                        ce_forward="joint" if ce_forward == "split" else "split")
    other.model.load_state_dict(alg.model.state_dict())
    assert grads_of(other, 0.0, 1.0, 0.0)[1] != pytest.approx(loss)  # the passes really differ
    assert not metavers().batch_statistics
