"""A stage-1 run of a KLD-BN model is evaluated with BatchNorm in train mode (``seen``: each test
batch normalised with its own statistics), so its accuracies are not the paper's Global Accuracy;
the run says so (issue 28 item 9): tag ``bn_evaluation=train``, its name and description, the
sweep's log line and ``run_info.json``."""
from __future__ import annotations

import pytest

import benchmarks.running.sweep as runner
from benchmarks.running.sweep import run_sweep
from benchmarks.running.stages import PRETRAIN_EXPERIMENT
from benchmarks.suite.spec import RunSpec, config_hash, load_suite
from benchmarks.store.tracking import (BN_EVALUATION_TAG, TRAIN_MODE_LABEL, TRAIN_MODE_NOTE, Tracker,
                                 read_json_artifact)
from benchmarks.store import mlflow_ui as ui
from pfl_core.config import RunConfig
from conftest import store

FAKE_GIT = ("0123456789abcdef0123456789abcdef01234567", False)
META = {"paper": "tiny", "table": "BN"}

SUITE = """\
paper: tiny
name: bn_stage1
table: BN stage 1
metric: {key: acc, label: accuracy}
base:
  data: {dataset: digits28, num_clients: 4, subsample: 96, client_splits: {test: 0.25}}
  model:
    name: resnet18_audio
    params: {width: 2}
    pretrained:
      data: {dataset: digits28, num_clients: 4, subsample: 96, client_splits: {test: 0.25}}
      model: {name: resnet18_audio, params: {width: 2}}
      method: {name: fedavg, params: {lr: 0.1, local_steps: 1}}
      federation: {rounds: 1, clients_per_round: 2, batch_size: 16}
      evaluation: {protocol: seen}
      seed: 1
  method: {name: fedavg, params: {lr: 0.05, local_steps: 1}}
  federation: {rounds: 0, clients_per_round: 2, batch_size: 16}
  evaluation: {protocol: seen}
grid:
  - name: method
    values:
      - {label: global, set: {federation.rounds: 0}}
seeds: [0]
"""


@pytest.fixture(autouse=True)
def _isolated(isolated, monkeypatch):
    monkeypatch.setattr(runner, "git_state", lambda: FAKE_GIT)
    return isolated


def spec(model: str, protocol: str, stage: str = "") -> RunSpec:
    config = RunConfig.from_dict({"model": {"name": model}, "method": {"name": "fedavg"},
                                  "evaluation": {"protocol": protocol}}).to_dict()
    return RunSpec("tiny/bn", {"method": "fedavg"}, 0, "paper", config, config_hash(config), stage=stage)


def test_the_tags_name_a_train_mode_stage1_and_no_other_run():
    stage1 = Tracker.run_tags(spec("resnet18_cifar", "seen", "pretrain"), META, {}, FAKE_GIT)
    assert stage1[BN_EVALUATION_TAG] == "train"
    assert stage1["mlflow.runName"].endswith(f"({TRAIN_MODE_LABEL})")
    assert stage1[ui.NOTE_TAG].endswith(TRAIN_MODE_NOTE) and "Global Accuracy" in TRAIN_MODE_NOTE
    stage2 = Tracker.run_tags(spec("resnet18_cifar", "finetune_pretrained"), META, {}, FAKE_GIT)
    assert stage2[BN_EVALUATION_TAG] == "recipe" and TRAIN_MODE_LABEL not in stage2["mlflow.runName"]
    novel = Tracker.run_tags(spec("conv4", "novel_class", "pretrain"), META, {}, FAKE_GIT)
    assert novel[BN_EVALUATION_TAG] == "eval" and TRAIN_MODE_NOTE not in novel[ui.NOTE_TAG]
    plain = Tracker.run_tags(spec("mlr", "seen", "pretrain"), META, {}, FAKE_GIT)
    assert BN_EVALUATION_TAG not in plain and TRAIN_MODE_LABEL not in plain["mlflow.runName"]


def test_a_trained_kld_bn_stage1_is_named_a_train_mode_evaluation_in_the_store_and_the_log(tmp_path):
    path = tmp_path / "suites" / "tiny" / "bn_stage1.yaml"
    path.parent.mkdir(parents=True)
    path.write_text(SUITE)
    suite = load_suite(path)
    tracker = Tracker(*store(tmp_path / "store"))
    lines = []
    summary = run_sweep(suite, suite.expand("paper"), tracker, device="cpu",
                        echo=lambda *a, **k: lines.append(" ".join(map(str, a))))
    assert summary.finished == 1
    (stage1,) = tracker.runs(PRETRAIN_EXPERIMENT, "FINISHED")
    tags = stage1.data.tags
    assert tags[BN_EVALUATION_TAG] == "train" and tags["mlflow.runName"].endswith(f"({TRAIN_MODE_LABEL})")
    assert read_json_artifact(tracker.client, stage1.info.run_id, "run_info.json")["bn_evaluation"] == "train"
    assert any("1 of them evaluated with BatchNorm in train mode" in line and "Global Accuracy" in line
               for line in lines)
    (stage2,) = tracker.runs(suite.key, "FINISHED")
    assert stage2.data.tags[BN_EVALUATION_TAG] == "train"  # seen on a KLD-BN model, stage 2 alike
    assert TRAIN_MODE_LABEL not in stage2.data.tags["mlflow.runName"]  # only stage 1 is renamed


def test_seen_evaluates_a_kld_bn_model_with_each_batchs_own_statistics():
    """What ``bn_mode = "train"`` claims: a row's logits under ``seen`` depend on the rest of its
    test batch (batch statistics), and in eval mode (``proto``, ``novel_class``) they do not."""
    import torch

    from pfl_core.evaluation.proto import eval_mode
    from pfl_core.training import model_params
    from tests.helpers import make_method, tiny_resnet

    torch.manual_seed(0)
    model = tiny_resnet()
    algorithm, params = make_method("fedavg", model), model_params(model)
    x = torch.rand(4, 3, 6, 6)
    with torch.no_grad():
        assert not torch.allclose(algorithm.logits(params, x, None)[:1], algorithm.logits(params, x[:1], None))
        with eval_mode(model):
            torch.testing.assert_close(algorithm.logits(params, x, None)[:1], algorithm.logits(params, x[:1], None))
