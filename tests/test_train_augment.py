"""Per-sample augmentation of training batches in the engine (``data.augment: crop_flip``; FedL2P
spec, "Transforms": RandomCrop(32, padding 4) + RandomHorizontalFlip, then Normalize)."""
from __future__ import annotations

import pytest
import torch

from pfl_core.data.augment.crop_flip import draw_crop_flip
from pfl_core.checkpoint import Checkpointing
from pfl_core.config import FederationConfig, RunConfig
from pfl_core.fields import ConfigError
from pfl_core.data.federated import ArrayDataset, Client, FederatedData
from pfl_core.engine.augmentation import augment_draws
from pfl_core.engine.plans import gather, make_buckets
from pfl_core.evaluation import EvalConfig
from pfl_core.evaluation.clients import SeenClients
from pfl_core.experiment import run_experiments
from pfl_core.federation import Federation, make_contexts
from pfl_core.seeding import RunStreams
from pfl_core.training import model_params
from tests.helpers import make_method, one_thread, tiny_federation  # noqa: F401
from tests.test_checkpoint import Stop, _same, _stop_after

pytestmark = pytest.mark.usefixtures("one_thread")

MEAN, STD = (0.25, 0.5, 0.75), (0.5, 0.25, 0.125)


def uint8_federation(sizes=(6, 6), size=8, seed=0, float64=False) -> FederatedData:
    """uint8 3 x size x size images with a per-channel mean/std, as a real image loader gives
    (``float64``: the same images as float64 in [0, 1], for float64 equivalence runs)."""
    gen = torch.Generator().manual_seed(seed)
    total = sum(sizes) + 2 * len(sizes)
    x = torch.randint(0, 256, (total, 3, size, size), generator=gen, dtype=torch.uint8)
    x = x.double() / 255 if float64 else x
    y = torch.randint(0, 3, (total,), generator=gen)
    clients, start = [], 0
    for cid, n in enumerate(sizes):
        clients.append(Client(cid, {"train": torch.arange(start, start + n),
                                    "test": torch.arange(start + n, start + n + 2)}))
        start += n + 2
    return FederatedData(ArrayDataset("img", x, y, 3, mean=MEAN, std=STD), clients, list(range(len(sizes))))


def by_hand(image: torch.Tensor, top: int, left: int, flip: bool) -> torch.Tensor:
    """torchvision's order on one uint8 image: pad 4 with black, crop, flip, ToTensor, Normalize."""
    padded = torch.zeros(3, image.shape[1] + 8, image.shape[2] + 8)
    padded[:, 4:-4, 4:-4] = image.float() / 255
    crop = padded[:, top:top + image.shape[1], left:left + image.shape[2]]
    crop = crop.flip(-1) if flip else crop
    return (crop - torch.tensor(MEAN).view(3, 1, 1)) / torch.tensor(STD).view(3, 1, 1)


def _contexts(fed, augment="crop_flip", batch_size=4):
    return make_contexts(fed, fed.train_clients, FederationConfig(batch_size=batch_size, drop_last=False),
                         RunStreams(0), "batches", batch_size, augment=augment)


def test_draws_come_from_the_clients_stream_in_plan_order():
    fed = uint8_federation()
    algorithm = make_method("perfedavg", torch.nn.Linear(1, 1), local_steps=2, skip_logging_batch=False)
    ctx = _contexts(fed)[1]
    plan = algorithm.draw(ctx, 0)
    draws = augment_draws(algorithm, ctx, plan)
    gen = RunStreams(0).torch("augment", 1)
    for name in ("b1", "b2", "b3"):  # plan order, batch by batch
        for index, got in zip(plan[name], draws[name]):
            want = draw_crop_flip(len(index), gen, padding=4)
            assert all(torch.equal(a, b) for a, b in zip(got, want))
    assert augment_draws(algorithm, _contexts(fed, "none")[1], plan) is None


def test_gathered_training_batches_are_cropped_flipped_then_normalised():
    fed = uint8_federation(sizes=(6,))
    algorithm = make_method("fedavg", torch.nn.Linear(1, 1), local_epochs=1)
    ctx = _contexts(fed)[0]
    plan = algorithm.draw(ctx, 0)  # batches of 4 and 2: the per-step path of gather
    draws = augment_draws(algorithm, ctx, plan)
    batches, _ = gather([fed.dataset], [plan], make_buckets([plan], (), 0.0)[0], False, [draws])
    xs, _ = batches["train"]
    seen = 0
    for x, index, d in zip(xs, plan["train"], draws["train"]):
        for k, row in enumerate(index):
            want = by_hand(fed.dataset.x[row], int(d.top[k]), int(d.left[k]), bool(d.flip[k]))
            torch.testing.assert_close(x[k], want)
            seen += bool(d.flip[k]) + (int(d.top[k]) != 4)
    assert seen > 0  # the draws really moved or flipped something
    plain, _ = gather([fed.dataset], [plan], make_buckets([plan], (), 0.0)[0], False)
    torch.testing.assert_close(plain["train"][0][0], fed.dataset.batch(plan["train"][0])[0])


def test_augmented_training_is_identical_on_both_paths_and_differs_from_plain():
    from tests.test_engine_equivalence import assert_same_run, tiny_resnet
    from pfl_core.engine import Executor
    from pfl_core.federation import run_federation

    fed = uint8_federation(sizes=(8, 8, 8, 4), float64=True)

    def run(execution, augment, pad=0.0):
        torch.manual_seed(0)
        model = tiny_resnet().double()
        algorithm = make_method("fedavg", model, lr=0.1, local_epochs=1)
        return run_federation(algorithm, fed, model_params(model), FederationConfig(rounds=2, clients_per_round=4,
                                                                                     batch_size=4),
                              SeenClients(EvalConfig(reduction="sample")), RunStreams(0),
                              executor=Executor(execution, pad), augment=augment)

    sequential = run("sequential", "crop_flip")
    assert_same_run(sequential, run("batched", "crop_flip", pad=1.0))  # a padded stack (2 + 1 steps)
    plain = run("sequential", "none")
    assert not torch.equal(plain.server["params"]["conv1.weight"], sequential.server["params"]["conv1.weight"])


def test_augment_is_rejected_where_it_cannot_apply():
    model = torch.nn.Linear(3, 3)
    protocol, cfg = SeenClients(EvalConfig()), FederationConfig()
    with pytest.raises(ValueError, match="crops and flips images"):
        Federation(make_method("fedavg", model), tiny_federation(), model_params(model), cfg, protocol, RunStreams(0),
                   augment="crop_flip")
    with pytest.raises(ValueError, match="train_streams"):
        Federation(make_method("ditto", model), uint8_federation(), model_params(model), cfg, protocol, RunStreams(0),
                   augment="crop_flip")
    with pytest.raises(ConfigError, match="augment"):
        RunConfig.from_dict({"data": {"augment": "flip"}})


def test_a_resumed_augmented_run_equals_the_uninterrupted_one(tmp_path):
    """The checkpoint keeps each client's augmentation generator (digits28 images, fedavg)."""
    from tests.test_checkpoint import _config

    cfg = RunConfig.from_dict({**_config("fedavg", 0).to_dict(), "data": {**_config("fedavg", 0).to_dict()["data"],
                                                                          "augment": "crop_flip"}})
    reference = run_experiments([cfg], device="cpu")
    saving = Checkpointing([tmp_path / "run.pt"], every=2)
    with pytest.raises(Stop):
        run_experiments([cfg], device="cpu", on_round=_stop_after(3), checkpointing=saving)
    _same(reference[0], run_experiments([cfg], device="cpu", checkpointing=saving)[0])
    plain = run_experiments([_config("fedavg", 0)], device="cpu")[0]
    assert plain.history != reference[0].history
