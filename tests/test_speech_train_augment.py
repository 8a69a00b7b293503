"""``data.augment: speech``: the FedL2P code's per-item time shift and background noise of Speech
Commands training items (``src/data/speech_commands.py`` L263-265) in stage 1 (any method with
``train_streams``) and in FedL2P/L2P meta-training, including the meta-net input pass."""
from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from pfl_core.config import FederationConfig
from pfl_core.data.audio import CLIP, SpeechAugment, join_rows
from pfl_core.data.federated import ArrayDataset, FederatedData
from pfl_core.engine.augmentation import augment_draws
from pfl_core.engine.plans import gather, make_buckets
from pfl_core.evaluation import EvalConfig
from pfl_core.evaluation.clients import SeenClients
from pfl_core.federation import Federation, make_contexts
from pfl_core.seeding import RunStreams
from pfl_core.training import model_params
from tests.helpers import fedl2p_round, l2p_federation, split_clients, make_method, one_thread, tiny_resnet  # noqa: F401 (fixture)

pytestmark = pytest.mark.usefixtures("one_thread")

FAST = {"inner_epochs": 1, "outer_epochs": 1, "lr_bnnet": 0.1, "lr_lrnet": 0.1, "lr_eta": 0.01,
        "meta_augment": "none"}


def clip_features(rows: torch.Tensor) -> torch.Tensor:
    """A cheap stand-in for the fbank image: the clip averaged down to a 3 x 6 x 6 image."""
    return F.adaptive_avg_pool1d(rows[:, 1:].unsqueeze(1), 108).view(-1, 3, 6, 6) * 20


def speech_federation(sizes=(8, 8), val=3, test=2, seed=0) -> FederatedData:
    """float64 one-second clips (some shorter) with two background-noise files in ``extras``."""
    gen = torch.Generator().manual_seed(seed)
    total = sum(sizes) + (val + test) * len(sizes)
    lengths = torch.randint(CLIP // 2, CLIP + 1, (total,), generator=gen)
    rows = join_rows(lengths, torch.rand(total, CLIP, generator=gen, dtype=torch.float64) * 2 - 1)
    noise = torch.rand(2, 2 * CLIP, generator=gen, dtype=torch.float64) - 0.5
    y = torch.randint(0, 3, (total,), generator=gen)
    clients = split_clients(sizes, val, test)
    dataset = ArrayDataset("speechy", rows, y, 3, inputs=clip_features,
                           extras={"noise": noise, "noise_lengths": torch.tensor([2 * CLIP, CLIP + 100])})
    return FederatedData(dataset, clients, list(range(len(sizes))))


def _contexts(fed, augment="speech", batch_size=4):
    return make_contexts(fed, fed.train_clients, FederationConfig(batch_size=batch_size, drop_last=False),
                         RunStreams(0), "batches", batch_size, augment=augment)


def test_gathered_speech_batches_are_shifted_and_noised_clips_then_features():
    fed = speech_federation(sizes=(6,))
    algorithm = make_method("fedavg", torch.nn.Linear(1, 1), local_epochs=1)
    ctx = _contexts(fed)[0]
    plan = algorithm.draw(ctx, 0)  # batches of 4 and 2
    draws = augment_draws(algorithm, ctx, plan)
    gen = RunStreams(0).torch("augment", 0)
    aug = SpeechAugment(fed.dataset.extras["noise"], fed.dataset.extras["noise_lengths"])
    batches, _ = gather([fed.dataset], [plan], make_buckets([plan], (), 0.0)[0], False, [draws])
    for x, index, d in zip(batches["train"][0], plan["train"], draws["train"]):
        want = aug.draw(len(index), np.random.default_rng(int(torch.randint(0, 2**62, (1,), generator=gen))))
        assert all(torch.equal(a, b) for a, b in zip(d, want))  # one numpy seed per batch from the client's stream
        torch.testing.assert_close(x, clip_features(aug.apply(fed.dataset.x[index], d)))
        assert not torch.allclose(x, fed.dataset.batch(index)[0])


def test_fedl2p_meta_net_inputs_are_computed_on_per_item_augmented_clips():
    from pfl_core.algorithms._lib.meta_inputs import meta_inputs

    fed = speech_federation(sizes=(6,))
    torch.manual_seed(0)
    model = tiny_resnet().double()
    algorithm = make_method("fedl2p", model, **FAST)
    server = algorithm.init_server(model_params(model))
    ctx = _contexts(fed)[0]
    xi, x = algorithm.client_inputs(server, ctx)
    gen = RunStreams(0).torch("augment", 0)
    aug = SpeechAugment(fed.dataset.extras["noise"], fed.dataset.extras["noise_lengths"])
    batches = []
    for index in torch.split(fed.clients[0].splits["train"], 4):
        rng = np.random.default_rng(int(torch.randint(0, 2**62, (1,), generator=gen)))
        batches.append(clip_features(aug.apply(fed.dataset.x[index], aug.draw(len(index), rng))))
    with torch.no_grad():
        want = meta_inputs(model, server["params"], server["buffers"], batches)
    torch.testing.assert_close(xi, want[0])
    torch.testing.assert_close(x, want[1])
    plain = algorithm.client_inputs(server, _contexts(fed, "none")[0])
    assert not torch.allclose(plain[0], xi)


def test_fedl2p_speech_training_is_identical_on_both_paths_and_differs_from_plain():
    from tests.test_engine_equivalence import assert_same_run

    fed = speech_federation()

    def run(execution, augment):
        return fedl2p_round(fed, execution, FAST, augment=augment)

    sequential = run("sequential", "speech")
    assert_same_run(sequential, run("batched", "speech"))
    plain = run("sequential", "none")
    key = next(iter(plain.server["lambda"]))
    assert not torch.equal(plain.server["lambda"][key], sequential.server["lambda"][key])


def test_augmentations_are_rejected_on_data_they_do_not_fit():
    model = torch.nn.Linear(3, 3)
    protocol, cfg = SeenClients(EvalConfig()), FederationConfig()
    with pytest.raises(ValueError, match="audio clips"):
        Federation(make_method("fedavg", model), speech_federation(), model_params(model), cfg, protocol,
                   RunStreams(0), augment="crop_flip")
    with pytest.raises(ValueError, match="background noise"):
        Federation(make_method("fedavg", model), l2p_federation(), model_params(model), cfg, protocol,
                   RunStreams(0), augment="speech")


def test_fedl2p_augments_its_inner_and_l_t_batches_never_val():
    fed = speech_federation(sizes=(6,))
    algorithm = make_method("fedl2p", tiny_resnet().double(), **FAST)
    ctx = _contexts(fed)[0]
    plan = algorithm.draw(ctx, 0).plan
    draws = augment_draws(algorithm, ctx, plan)
    assert sorted(draws) == ["inner", "ltrain"]
    assert [len(d.shift) for d in draws["inner"]] == [len(i) for i in plan["inner"]]
