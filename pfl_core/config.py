"""The fully resolved configuration of one run, as nested dataclasses.

The harness builds it from a suite (YAML) and hashes its dict form; the core only needs plain
dicts, so ``pfl_core`` imports neither YAML nor MLflow. Unknown keys are rejected with their path.
"""
from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field, fields, is_dataclass
from typing import Any, Literal

from pfl_core.fields import (ConfigError, Fraction, NonNegativeInt, PositiveInt,
                             check_value_types)


@dataclass
class DataConfig:
    dataset: str = "digits28"
    """Registered dataset name (``pflbench list datasets``)."""
    params: dict = field(default_factory=dict)
    """Loader parameters (e.g. Synthetic's alpha and beta)."""
    split: Literal["train", "test", "all"] = "train"
    """Which split of the source dataset is partitioned: train, test or all."""
    normalize: Literal["none", "pixel", "half"] = "none"
    """Input normalisation: ``none`` (the loader's), ``pixel`` (per-pixel standardisation over the
    dataset, pFedMe/CGPFL MNIST) or ``half`` ((x - 0.5) / 0.5 per channel, pFedMe CIFAR-10)."""
    normalize_stats: Literal["auto", "dataset", "train"] = "auto"
    """The samples ``pixel`` statistics come from. ``dataset``: the whole loaded dataset, held-out
    and test clients included - the pFedMe/CGPFL code's convention (docs/papers/cgpfl.md),
    which produced the published numbers. ``train``: the train split of the run's training clients
    only. ``auto`` (default): ``train`` when ``evaluation.target`` is ``validation`` (a tuning run
    never sees test data, issue 15 item 6), else ``dataset``. ``dataset`` with the validation
    target is rejected."""
    augment: Literal["none", "crop_flip", "speech"] = "none"
    """Per-sample augmentation of the training batches local training draws: ``crop_flip`` =
    RandomCrop(H x W, padding 4) + RandomHorizontalFlip per image, before the normalisation (the
    FedL2P code's CIFAR-10 pretraining transform; docs/papers/fedl2p.md); ``speech`` = time shift +
    background noise per clip before its features (the FedL2P code's Speech Commands training
    items, ``src/data/speech_commands.py`` L263-265); drawn on the host
    from a per-client stream so both execution paths see the same images
    (:mod:`pfl_core.engine.augmentation`). Never applied to evaluation batches."""
    balanced_sampler: bool = False
    """Draw each training epoch of a client with replacement, sample weights n / count of its class
    (:func:`pfl_core.batching.balanced_weights`): the FedL2P code's Speech Commands train loaders
    (``src/data/commands_dataset.py`` L78-80, ``src/data/speech_commands.py`` L121-142), in local
    training and FedL2P's meta-training and meta-net input pass (the evaluation's: ``evaluation.params.balanced``)."""
    subsample: NonNegativeInt = 0
    """Keep a random subset of this many samples before partitioning (0: all). For smoke and
    quick profiles; the subset follows the seed (stream ``subsample``)."""
    num_clients: PositiveInt = 100
    partition: dict = field(default_factory=lambda: {"name": "iid"})
    """``{name: <partitioner>, <param>: <value>, ...}`` (``pflbench list partitioners``)."""
    client_splits: dict = field(default_factory=lambda: {"test": 0.2})
    """Fractions of each client's samples per named split (floored); ``train`` gets the rest."""
    unseen_fraction: Fraction = 0.0
    """Fraction of clients held out of training for the ``unseen`` protocol (CAFeMe: 0.2)."""
    validation_fraction: Fraction = 0.0
    """Fraction of the remaining clients held out of training as validation clients (tuning)."""
    remainder: str = "train"
    """The split that takes what ``client_splits`` leaves (``test`` with ``{train: 0.75}`` floors
    the train part instead)."""
    source_splits: dict = field(default_factory=dict)
    """Client split -> split of the source dataset it comes from, e.g. ``{train: train, val: val,
    test: test}`` (MetaVers: clients hold the same classes in the dataset's train, val and test
    splits; docs/papers/metavers.md). The partitioner assigns classes to clients once and
    cuts each source split with that assignment (for several source splits, only partitioners that
    work in two phases: ``classes_per_client``; one source split, e.g. ``{train: train}`` with
    ``pool_splits``, takes any partitioner); ``split`` and ``client_splits`` are then unused and
    ``client_splits`` must be ``{}``. Empty (default): one source split (``split``) is partitioned
    and each client cut by ``client_splits``."""
    pool_splits: list = field(default_factory=list)
    """Source splits loaded whole beside the clients' (``FederatedData.pools``), for protocols that
    draw from a split rather than from clients (MetaVers' novel-class val/test classes). Needs
    ``source_splits``."""
    partition_seeding: Literal["streams", "reseed"] = "streams"
    """How the partition draws its random numbers. ``streams`` (default): the run's ``partition``
    stream. ``reseed``: the MetaVers code's re-seeding with the run seed before each phase
    (docs/papers/metavers.md): the class assignment from numpy's global generator after
    ``np.random.seed(seed)``, each source split's per-class shuffles from Python's ``random`` after
    ``random.seed(seed)``, which gives the authors' exact clients for a seed. Needs a two-phase
    partitioner."""
    partition_per_group: bool = False
    """Partition each of the dataset's groups (CIFAR-10-C corruption, domain) on its own among
    ``num_clients / G`` clients, group by group, under ONE assignment (FedL2P: the code re-draws the
    Dirichlet matrix per corruption/domain from ``default_rng(1)``, the same matrix for all;
    docs/papers/fedl2p.md); clients g*m .. g*m+m-1 form group g (``Client.meta["group"]``). Needs
    ``source_splits`` and a two-phase partitioner (``lda``)."""
    client_val_fraction: Fraction = 0.0
    """Cut each client's ``train`` split into ``train`` and ``val`` = int(fraction * n) after
    partitioning, with ``random_split`` and a generator seeded ``client_val_seed`` (FedL2P's
    CIFAR-10 loader: 0.2 and 1, 50 samples -> 40 / 10, the same cut every round and every run;
    docs/papers/fedl2p.md). 0 (default): off."""
    client_val_seed: NonNegativeInt = 1
    """The seed of ``client_val_fraction``'s generator (fixed, not the run seed: the code's 1)."""
    redraw_short_clients: bool = False
    """Redraw the partition while a client's train split holds fewer than
    ``federation.batch_size`` samples (the CAFeMe authors' de-facto rule: their code crashes on
    such a client, so their published Dirichlet and FEMNIST numbers come from seeds without one;
    issue 11 item 2). False (default): keep the partition; such a client trains on one short batch
    (docs/papers/cafeme.md), and ``run_info.json`` lists it."""


@dataclass
class ModelConfig:
    name: str = "mlr"
    params: dict = field(default_factory=dict)
    warm_start: list = field(default_factory=list)
    """Methods trained before this run's method, each from the previous one's final global model
    (``[{name: fedavg, params: {...}}, ...]``); the run's method starts where the last ends. Off
    (empty) by default: it emulates the CAFeMe code's single model object shared by its baselines
    (docs/papers/cafeme.md), a known defect reproduced only on request."""
    pretrained: dict = field(default_factory=dict)
    """The two-stage pipeline (FedL2P, issue 14): the run starts from a pretrained model instead of
    its own initialisation. Either a stage-1 run configuration (a mapping with that run's own
    ``data``, ``model``, ``method``, ``federation``, ``evaluation``, ``seed``; defaults as a
    :class:`RunConfig`), whose final global parameters and BatchNorm running statistics become this
    run's starting point (:mod:`pfl_core.pretrained`), or ``{source: imagenet}``: the model's own
    ImageNet weights (``weights: imagenet``), nothing trained. Empty (default): no stage 1. The
    stage-1 seed is its own key (a suite fixes it: one pretrained model shared by the seeds of
    stage 2, FedL2P contract)."""


@dataclass
class MethodConfig:
    name: str = "fedavg"
    params: dict = field(default_factory=dict)
    """Overrides of the method's hyperparameter dataclass."""


@dataclass
class FederationConfig:
    rounds: NonNegativeInt = 100
    clients_per_round: NonNegativeInt = 5
    """Clients sampled uniformly without replacement per round (0 = all training clients)."""
    batch_size: PositiveInt = 32
    reshuffle: bool = False
    """Reshuffle a client's batches every epoch (False: shuffle once, fixed order, as CAFeMe)."""
    drop_last: bool = True
    eval_every: NonNegativeInt = 0
    """Evaluate every this many rounds (0: only after the last round). The evaluation of round
    ``r`` follows ``r`` updates: MetaVers' evaluation at tau = r *before* that round's update."""
    early_stopping: bool = False
    """Stop training by the validation history (docs/papers/metavers.md; the code's
    rule, not in the paper, which trains T rounds): :func:`pfl_core.early_stopping.stop_round`
    on ``early_stopping_key`` at every evaluation. Off: every round runs (all other suites)."""
    early_stopping_key: str = "val_acc_weighted"
    """The evaluation summary key early stopping reads (``val_acc_weighted`` = the pooled val
    accuracy, MetaVers' val ``avg_acc``, with ``evaluation.params.val_split: val``)."""
    patience: NonNegativeInt = 10
    """Early stopping: stop once the patience counter exceeds this (MetaVers code: 10)."""
    patience_rule: Literal["drop", "no_best"] = "drop"
    """Early stopping: ``drop`` counts evaluations lower than the previous one, reset at a new
    best (MetaVers ``trainer.py``, Tables 2-5); ``no_best`` counts every evaluation without a new
    best (``trainer_novel_class.py``, Table 6)."""
    early_stopping_after: NonNegativeInt = 101
    """Early stopping: the code stops only at a round above this (MetaVers: ``min_epoch + 1`` =
    101; Table 6's trainer: 0), so an evaluation due at or before it still takes place."""


@dataclass
class EvaluationConfig:
    protocol: str = "seen"
    """``unseen`` (held-out clients, fine-tuning curve) or ``seen`` (personalized predictors)."""
    target: Literal["test", "validation"] = "test"
    """``test``: the paper's evaluation. ``validation``: tuning; the unseen protocol evaluates the
    validation clients, the seen protocol the ``val`` split; test clients and splits are never read."""
    params: dict = field(default_factory=dict)
    """Overrides of :class:`pfl_core.evaluation.EvalConfig`."""
    analyses: list = field(default_factory=list)
    """Post-run analyses of the final model (:mod:`pfl_core.analysis`), e.g. ``[{name: embeddings,
    samples: 2000}]`` (MetaVers Figure 2's t-SNE) or ``[{name: dlg, target: prototypes, leakage:
    true}]`` (Figure 3); each adds metrics and an ``.npz`` artifact to the run. Empty: none."""


@dataclass
class RunConfig:
    data: DataConfig = field(default_factory=DataConfig)
    model: ModelConfig = field(default_factory=ModelConfig)
    method: MethodConfig = field(default_factory=MethodConfig)
    federation: FederationConfig = field(default_factory=FederationConfig)
    evaluation: EvaluationConfig = field(default_factory=EvaluationConfig)
    seed: NonNegativeInt = 0

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, values: dict[str, Any]) -> "RunConfig":
        cfg = _build(cls, values, "")
        cfg.check_consistency()
        return cfg

    def pixel_stats_from(self) -> str:
        """``dataset`` or ``train``: where ``pixel`` statistics come from (``data.normalize_stats``)."""
        if self.data.normalize_stats == "auto":
            return "train" if self.evaluation.target == "validation" else "dataset"
        return self.data.normalize_stats

    def training_clients(self) -> int:
        """How many clients train: ``num_clients`` minus the unseen, then the validation clients
        (rounded as :func:`pfl_core.data.splits.split_seen_unseen` rounds them)."""
        d = self.data
        seen = d.num_clients - int(round(d.num_clients * d.unseen_fraction))
        return seen - int(round(seen * d.validation_fraction))

    def check_consistency(self) -> None:
        """The rules that tie fields together (the per-field ones are in the annotations)."""
        total = 0.0
        for name, fraction in self.data.client_splits.items():
            key = f"data.client_splits.{name}"
            if isinstance(fraction, bool) or not isinstance(fraction, (int, float)) \
                    or not math.isfinite(fraction) or not 0 <= fraction < 1:
                raise ConfigError(f"{key} must be a fraction in [0, 1), got {fraction!r}", key)
            total += fraction
        if total >= 1:
            raise ConfigError(f"data.client_splits: the fractions sum to {total:g}, leaving nothing for "
                              f"{self.data.remainder!r}; make them sum to less than 1", "data.client_splits")
        self._check_source_splits()
        self._check_pretrained()
        if self.evaluation.target == "validation" and self.data.normalize_stats == "dataset":
            raise ConfigError("data.normalize_stats: 'dataset' statistics include test clients, which a "
                              "tuning run (evaluation.target: validation) must not see; use auto or train",
                              "data.normalize_stats")
        train = self.training_clients()
        if train < 1:
            raise ConfigError(f"data.unseen_fraction / data.validation_fraction leave no training client "
                              f"of data.num_clients={self.data.num_clients}", "data.unseen_fraction")
        if self.federation.clients_per_round > train:
            raise ConfigError(f"federation.clients_per_round must be <= the {train} training clients "
                              f"(data.num_clients minus unseen and validation clients), or 0 for all; got "
                              f"{self.federation.clients_per_round}", "federation.clients_per_round")

    def stage1(self) -> "RunConfig | None":
        """The stage-1 run of ``model.pretrained`` (None: no stage 1, or a ``source``)."""
        pretrained = self.model.pretrained
        if not pretrained or "source" in pretrained:
            return None
        return RunConfig.from_dict(pretrained)

    def pretrained_source(self) -> str | None:
        """``imagenet`` for ``model.pretrained: {source: imagenet}``, else None."""
        return self.model.pretrained.get("source")

    def _check_pretrained(self) -> None:
        """``model.pretrained``: ``{source: imagenet}`` or a valid stage-1 run configuration whose
        model is this run's (errors keyed ``model.pretrained.<dotted key>``)."""
        pretrained, key = self.model.pretrained, "model.pretrained"
        if not pretrained:
            return
        if self.model.warm_start:
            raise ConfigError("model.pretrained and model.warm_start both set the starting model; keep one",
                              "model.warm_start")
        if "source" in pretrained:
            if set(pretrained) != {"source"} or pretrained["source"] not in PRETRAINED_SOURCES:
                raise ConfigError(f"{key}: a source is written {{source: {'|'.join(PRETRAINED_SOURCES)}}} alone, "
                                  f"got {pretrained!r}; or describe a stage-1 run (data, model, method, ...)", key)
            if self.model.params.get("weights") != pretrained["source"]:
                raise ConfigError(f"{key}: {{source: {pretrained['source']}}} starts from the model's own "
                                  f"{pretrained['source']} weights: set model.params.weights: "
                                  f"{pretrained['source']} (a model that has them, e.g. resnet18_imagenet)",
                                  "model.params.weights")
            return
        stage1 = _build(RunConfig, pretrained, key)  # its errors name model.pretrained.<key>
        if stage1.model.pretrained:
            raise ConfigError(f"{key}.model.pretrained: a stage-1 run starts from its own initialisation "
                              "(one stage of pretraining); remove it", f"{key}.model.pretrained")
        try:
            stage1.check_consistency()
        except ConfigError as err:
            raise ConfigError(f"{key}: {err}", f"{key}.{err.key}" if err.key else key) from None
        if stage1.model.name != self.model.name:
            raise ConfigError(f"{key}.model.name is {stage1.model.name!r} but this run's model is "
                              f"{self.model.name!r}: stage 2 starts from the stage-1 model, so they must be "
                              f"the same", f"{key}.model.name")

    def _check_source_splits(self) -> None:
        """``data.source_splits`` / ``pool_splits`` / ``partition_seeding`` with the other data keys
        (the split names and the partitioner are checked against the dataset at suite load time,
        :func:`pfl_core.data.builder.check_sources`)."""
        d = self.data
        if d.partition_seeding == "reseed" and d.redraw_short_clients:
            raise ConfigError("data.redraw_short_clients cannot redraw a partition under data.partition_seeding: "
                              "reseed (the same seed gives the same clients); turn one off",
                              "data.redraw_short_clients")
        if d.partition_per_group and not d.source_splits:
            raise ConfigError("data.partition_per_group needs data.source_splits (e.g. {train: train, val: val, "
                              "test: test})", "data.partition_per_group")
        if not d.source_splits:
            if d.pool_splits:
                raise ConfigError("data.pool_splits needs data.source_splits (the clients' splits, e.g. "
                                  "{train: train})", "data.pool_splits")
            return
        if d.client_splits:
            raise ConfigError("data.client_splits must be {} with data.source_splits: each client split comes "
                              "whole from its source split", "data.client_splits")
        for name, source in d.source_splits.items():
            if not isinstance(source, str):
                raise ConfigError(f"data.source_splits.{name} must name a split of the dataset (train, val, "
                                  f"test), got {source!r}", f"data.source_splits.{name}")
        if not isinstance(d.pool_splits, list) or not all(isinstance(s, str) for s in d.pool_splits):
            raise ConfigError(f"data.pool_splits must be a list of split names, got {d.pool_splits!r}",
                              "data.pool_splits")
        if d.redraw_short_clients:
            raise ConfigError("data.redraw_short_clients does not apply with data.source_splits; turn it off",
                              "data.redraw_short_clients")


#: the ``model.pretrained: {source: ...}`` values: weights that come with the model, no stage 1
PRETRAINED_SOURCES = ("imagenet",)


def _build(cls, values: Any, path: str):
    if not isinstance(values, dict):
        raise ConfigError(f"{path or 'config'}: expected a mapping, got {type(values).__name__}")
    known = {f.name: f for f in fields(cls)}
    unknown = sorted(set(values) - set(known))
    if unknown:
        where = f"{path}." if path else ""
        raise ConfigError(f"unknown key(s) {[where + k for k in unknown]}; allowed under "
                          f"{path or 'the run config'}: {sorted(known)}", where + unknown[0])
    kwargs = {}
    values = check_value_types(cls, values, f"{path}." if path else "")
    for name, value in values.items():
        default = cls.__dataclass_fields__[name].default_factory
        sub = f"{path}.{name}" if path else name
        nested = default() if callable(default) else None
        if is_dataclass(nested):
            kwargs[name] = _build(type(nested), value, sub)
        else:
            kwargs[name] = value
    return cls(**kwargs)


def section_keys(cls=RunConfig, prefix: str = "") -> set[str]:
    """All dotted keys of the config schema (``data.num_clients``, ...) for validating overrides.
    Free-form dict fields (``params``, ``partition``, ``client_splits``) accept any sub-key."""
    keys = set()
    for f in fields(cls):
        key = f"{prefix}{f.name}"
        keys.add(key)
        default = f.default_factory() if callable(f.default_factory) else None
        if is_dataclass(default):
            keys |= section_keys(type(default), key + ".")
    return keys
