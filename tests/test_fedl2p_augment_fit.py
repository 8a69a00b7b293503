"""Every FedL2P suite run's augmentation fits its dataset (issue 28 item 4): the code augments
Speech Commands clips per item (time shift + background noise, ``src/data/speech_commands.py``
L263-265) in stage 1 and meta-training and its ``jit_augment`` is the identity
(``src/data/commands_dataset.py`` L30-31); images get their batch-shared ``jit_augment`` (CIFAR crop +
flip, Office/DomainNet flip + rotation) and never the audio augmentation."""
from __future__ import annotations

import pytest

from test_fedl2p_suites import NAMES, draft

#: the meta-training jit_augment of each image dataset (docs/papers/fedl2p.md)
META_AUGMENT = {"cifar10": "crop_flip", "cifar10c": "crop_flip", "office_caltech10": "flip_rotate",
                "domainnet": "flip_rotate"}
META_METHODS = ("fedl2p", "l2p")


def _data_augment(block: dict) -> str:
    return block.get("data", {}).get("augment", "none")


@pytest.mark.parametrize("profile", ["paper", "smoke"])
@pytest.mark.parametrize("name", NAMES)
def test_every_fedl2p_and_l2p_cells_augmentation_fits_its_dataset(name, profile):
    for run in draft(name, profile):
        config, where = run.config, f"{name}/{profile}/{run.cell_id}"
        dataset = config["data"]["dataset"]
        stage1 = config["model"].get("pretrained", {})
        if dataset == "speech_commands":
            assert _data_augment(stage1) == "speech", f"{where}: stage 1 without the speech augmentation"
        else:
            assert _data_augment(config) != "speech" and _data_augment(stage1) != "speech", where
        if config["method"]["name"] not in META_METHODS:
            continue
        meta = config["method"].get("params", {}).get("meta_augment", "crop_flip")
        if dataset == "speech_commands":
            assert (_data_augment(config), meta) == ("speech", "none"), f"{where}: crop/flip on fbank images"
        else:
            assert meta == META_AUGMENT[dataset], where


@pytest.mark.parametrize("name", NAMES)
def test_speech_commands_runs_draw_class_balanced_training_batches_in_both_stages(name):
    """The code's Speech Commands train loaders are class-balanced (``src/data/speech_commands.py``
    L121-142); no image dataset's are."""
    for run in draft(name, "paper"):
        config = run.config
        speech = config["data"]["dataset"] == "speech_commands"
        for block in (config, config["model"].get("pretrained", {})):
            if "data" in block:
                assert block["data"].get("balanced_sampler", False) is speech, f"{name}/{run.cell_id}"


@pytest.mark.parametrize("name", NAMES)
def test_speech_commands_evaluations_fine_tune_on_class_balanced_epochs(name):
    for run in draft(name, "paper"):
        speech = run.config["data"]["dataset"] == "speech_commands"
        assert run.config["evaluation"]["params"].get("balanced", False) is speech, f"{name}/{run.cell_id}"
