"""Settings shared by every evaluation protocol (:class:`EvalConfig`)."""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Annotated, Literal

from pfl_core.fields import FINETUNE_ORDER, HyperParams, NonNegativeInt, PositiveFloat, PositiveInt, Tune


@dataclass
class EvalConfig(HyperParams):
    """Settings of an evaluation protocol (both protocols share them)."""

    steps: NonNegativeInt = 0
    """Personalization steps at evaluation for methods that fine-tune (CAFeMe: 50)."""
    lr: Annotated[PositiveFloat, Tune(1e-4, 0.5, log=True, order=FINETUNE_ORDER)] = 0.01
    """Fine-tuning learning rate (CAFeMe: ``lr_ft`` for baselines, ``lr_ft_pfl`` for CAFeMe)."""
    gamma: PositiveFloat = 0.8
    """Multiplicative learning-rate decay (CAFeMe: 0.8)."""
    decay_every: PositiveInt = 5
    """Decay the learning rate after every this many steps (CAFeMe: 5)."""
    step_lrs: list[float] = field(default_factory=list)
    """The learning rate of each fine-tuning step, in order (at least ``steps`` of them); empty:
    ``lr`` decayed by ``gamma`` every ``decay_every`` steps. The pFedMe code's Per-FedAvg evaluation
    is ``[alpha, beta]`` with ``steps: 2``: one SGD step at its learning rate, a second at beta
    (CharlieDinh/pFedMe, ``FLAlgorithms/users/userperavg.py`` L73-88, ``MySGD.step`` in
    ``FLAlgorithms/optimizers/fedoptimizer.py`` L9-23; docs/papers/cgpfl.md, code conventions)."""
    adapt_split: Literal["train", "evaluated"] = "train"
    """Where the fine-tuning batches come from: ``train``, the client's train split (its train
    stream: the federation's batch size and order); ``evaluated``, the split being evaluated
    (``split``: ``test``, or ``val`` when tuning), cut in that split's fixed order into batches of the
    train batch size, as the pFedMe code's Per-FedAvg evaluation draws them
    (``get_next_test_batch``, ``FLAlgorithms/users/userbase.py`` L27, L134-142). ``evaluated`` is a
    leak - the model adapts on samples it is then scored on - kept only to reproduce that code,
    never a default."""
    adapt_batches: Literal["restart", "continue"] = "restart"
    """Which of those batches an evaluation takes: ``restart``, the first ``steps`` of a fresh pass
    (every evaluation alike; the harness's); ``continue``, a cyclic iterator over the fixed order
    that every round advances by ``steps``: the evaluation after round R takes the batches at
    positions steps*R .. steps*R + steps - 1 (mod the number of batches), as the pFedMe code's
    per-client iterator does, drawn once a round by the evaluation before training
    (``userbase.py`` L31, L134-142; ``FLAlgorithms/servers/serverperavg.py`` L48). Needs a fixed
    train order (``federation.reshuffle: false``) with ``adapt_split: train``."""
    batch_size: NonNegativeInt = 0
    """Evaluation batch size; 0 = the federation's training batch size."""
    reduction: Literal["batch_mean", "sample"] = "batch_mean"
    """Client accuracy: ``batch_mean`` = unweighted mean of per-batch accuracies, batches of size 1
    skipped (CAFeMe code); ``sample`` = correct predictions / samples."""
    split: str = "test"
    """The client split evaluated on."""
    val_split: str = ""
    """Also evaluate this client split at every evaluation (e.g. ``val``), its summary keys
    prefixed ``val_`` (``val_acc``, ``val_avg_acc``, ...): the per-round validation history that
    best-validation selection (docs/papers/metavers.md) and early stopping read. Empty:
    the evaluated split only. Ignored when tuning (``target: validation`` evaluates ``val``)."""
    nvar: bool = False
    """Protocol ``proto``: also log ``nvar`` of the test embeddings (MetaVers Table 4;
    docs/papers/fedl2p.md, harness default: :func:`pfl_core.evaluation.proto.nvar`)."""
    novel_val_split: str = "val"
    """Protocol ``novel_class``: the dataset split holding the validation classes (Table 6)."""
    novel_test_split: str = "test"
    """Protocol ``novel_class``: the dataset split holding the test classes."""
    ways: PositiveInt = 5
    """Protocol ``novel_class``: classes per group (MetaVers code: 5)."""
    users: PositiveInt = 10
    """Protocol ``novel_class``: users per group, one fold of every class each (code: 10)."""
    groups_val: PositiveInt = 500
    """Protocol ``novel_class``: groups per validation evaluation (code: 500)."""
    groups_test: PositiveInt = 1000
    """Protocol ``novel_class``: groups per test evaluation (code: 1000)."""
    epochs: NonNegativeInt = 15
    """Protocol ``finetune_pretrained``: fine-tuning epochs e (FedL2P: 15, and 5 for Tables 2 and 4)."""
    finetune_splits: list[str] = field(default_factory=lambda: ["train"])
    """Protocol ``finetune_pretrained``: the client splits fine-tuned on, joined (FedL2P CIFAR-10:
    ``[train, val]``, all 50 samples, docs/papers/fedl2p.md; other datasets ``[train]``)."""
    test_batch_size: PositiveInt = 50
    """Protocol ``finetune_pretrained``: test batch size (FedL2P code: 50)."""
    augment: bool = True
    """Protocol ``finetune_pretrained``: per-sample augmentation of the fine-tuning batches and of
    the meta-net input pass (docs/papers/fedl2p.md: evaluation path)."""
    balanced: bool = False
    """Protocol ``finetune_pretrained``: draw the meta-net input epoch and every fine-tuning epoch
    with replacement, weight n / count of the sample's class (the FedL2P code's Speech Commands
    train loader, ``src/data/commands_dataset.py`` L78-80, which its evaluation fine-tunes on,
    ``src/apps/clients/fedl2p_classification_client.py`` L799-808); False: permutations."""
    clients: Literal["seen", "unseen"] = "seen"
    """Protocol ``finetune_pretrained``: which clients are evaluated, the training clients
    (``seen``) or the held-out ones (``unseen``: Speech Commands' unseen speaker pool, Table 4)."""
    stack_size: NonNegativeInt = 64
    """Protocol ``finetune_pretrained``, batched path: clients per vmapped stack (0: all clients of
    equal batch shapes at once). Memory only (the numbers do not depend on it): a stack trains
    ``stack_size`` x ``batch_size`` images per step and holds their inputs for all its steps."""

    def __post_init__(self) -> None:
        if self.step_lrs and len(self.step_lrs) < self.steps:
            raise ValueError(f"evaluation step_lrs {self.step_lrs} gives fewer rates than steps = {self.steps}")
        bad = [v for v in self.step_lrs
               if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or v <= 0]
        if bad:
            raise ValueError(f"evaluation step_lrs must be positive numbers, got {self.step_lrs}")

    def lr_at(self, step: int) -> float:
        if self.step_lrs:
            return float(self.step_lrs[step])
        return self.lr * self.gamma ** (step // self.decay_every)
