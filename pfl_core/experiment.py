"""One run end to end: data -> partition -> model -> method -> federation -> evaluation.

:func:`run_experiment` is the whole core behind the harness: it takes a :class:`RunConfig` and
returns metrics, per-round history and per-client results. It knows nothing of MLflow or YAML.
"""
from __future__ import annotations

import functools
import hashlib
import json
import os
import time
from dataclasses import dataclass, field, replace
from typing import Callable

import numpy as np
import torch

from pfl_core.engine.device import configure_device, device_info
from pfl_core.algorithms import METHODS
from pfl_core.analysis import parse_analyses, run_analyses
from pfl_core.bn_support import check_bn_support
from pfl_core.checkpoint import Checkpointing
from pfl_core.config import RunConfig
from pfl_core.data import build_federated, load_dataset, load_sources
from pfl_core.data.builder import short_train_clients
from pfl_core.data.cgpfl_split import test_in_other_train_fraction
from pfl_core.data.federated import ArrayDataset, FederatedData, standardize
from pfl_core.engine import EXECUTIONS, Executor
from pfl_core.engine.memory import stack_limit
from pfl_core.engine.choice import choose_execution, step_flops
from pfl_core.evaluation import PROTOCOLS, EvalConfig
from pfl_core.federation import Federation, run_lockstep
from pfl_core.models import build_model
from pfl_core.models.kld_bn import has_bn_state
from pfl_core.pretrained import PretrainedState, Provider, final_state, resolve
from pfl_core.seeding import RunStreams
from pfl_core.training import model_params


def resolve_device(device: str = "auto") -> torch.device:
    """``auto``: CUDA when available, else CPU. ``cuda`` without a GPU is an error."""
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if device.startswith("cuda") and not torch.cuda.is_available():
        raise RuntimeError("--device cuda was asked for, but torch sees no CUDA device")
    return torch.device(device)


@functools.lru_cache(maxsize=4)
def _cached_dataset(name: str, params_items: tuple, split: str, data_dir: str | None) -> ArrayDataset:
    params = {k: list(v) if isinstance(v, tuple) else v for k, v in params_items}
    return load_dataset(name, data_dir=data_dir, split=split, **params)


@functools.lru_cache(maxsize=4)
def _cached_sources(name: str, params_items: tuple, sources: tuple, data_dir: str | None) -> ArrayDataset:
    params = {k: list(v) if isinstance(v, tuple) else v for k, v in params_items}
    return load_sources(name, list(sources), data_dir=data_dir, **params)


def load_run_dataset(cfg: RunConfig, data_dir: str | None = None) -> ArrayDataset:
    """The dataset a run partitions: split ``data.split``, or with ``data.source_splits`` the source
    splits of the clients then ``data.pool_splits``, joined (cached per process)."""
    d = cfg.data
    params = tuple(sorted((k, tuple(v) if isinstance(v, list) else v) for k, v in d.params.items()))
    if d.source_splits:
        sources = tuple(dict.fromkeys([*d.source_splits.values(), *d.pool_splits]))
        return _cached_sources(d.dataset, params, sources, data_dir)
    return _cached_dataset(d.dataset, params, d.split, data_dir)


def digest(obj) -> str:
    """A short stable hash of a JSON-able object (partition, sampled clients)."""
    return hashlib.sha256(json.dumps(obj, sort_keys=True).encode()).hexdigest()[:16]


def partition_digest(fed) -> str:
    """Hash of every client's split indices: equal digests mean identical client data."""
    return digest([{k: v.tolist() for k, v in sorted(c.splits.items())} for c in fed.clients]
                  + [fed.train_clients, fed.unseen_clients])


def warm_start(setups: list["RunSetup"], executor: Executor | None = None) -> list:
    """The initial global parameters of each run: the model's own, or, with ``model.warm_start``,
    the final global parameters of each listed method trained in turn from the previous one's (the
    CAFeMe code's shared baseline object, docs/papers/cafeme.md; IFCA's collapse of its k models into that
    one object is not emulated). Predecessors see the same data, batches and client samples; the
    runs given together (seeds of a cell) train their predecessors in lockstep."""
    params = [model_params(s.model) for s in setups]
    for i, step in enumerate(setups[0].cfg.model.warm_start):
        if not isinstance(step, dict) or set(step) - {"name", "params"} or "name" not in step:
            raise ValueError(f"model.warm_start[{i}] must be {{name: <method>, params: {{...}}}}, got {step!r}")
        cls = METHODS.get(step["name"])
        hp = cls.hyper_class.from_dict(step.get("params", {}), where=f"model.warm_start[{i}]: ")
        federations = []
        for setup, init in zip(setups, params):
            predecessor = cls(setup.model, hp)
            predecessor.seed = setup.streams.seed_int("algorithm", i + 1)
            federations.append(Federation(predecessor, setup.fed, init, setup.cfg.federation, setup.protocol,
                                          setup.streams, evaluate_clients=False, augment=setup.cfg.data.augment,
                                          balanced=setup.cfg.data.balanced_sampler))
        params = [r.server["params"] for r in run_lockstep(federations, executor or Executor("sequential"))]
    return params


EXECUTION_CHOICES = ("auto", *EXECUTIONS)


def make_executor(execution: str, device: torch.device, setups: list["RunSetup"] | None = None,
                  capture: str | None = None) -> Executor:
    """The executor of ``execution``; ``auto`` chooses per run from the cost of one client step of
    ``setups[0]`` (:func:`pfl_core.engine.choice.choose_execution`: batched on a GPU, and on a CPU
    for small models whose steps are bound by per-step overhead; docs/speed.md). The reason is
    kept on the executor (``choice``) for the run's record. ``capture``: the batched step's capture
    (:mod:`pfl_core.engine.capture`; default ``PFL_CAPTURE_STEP``, set by ``--capture-step``, else off)."""
    if execution not in EXECUTION_CHOICES:
        raise ValueError(f"execution must be one of {EXECUTION_CHOICES}, got {execution!r}")
    capture = capture or os.environ.get("PFL_CAPTURE_STEP") or "off"
    if capture != "off" and device.type != "cuda":
        raise ValueError(f"step capture {capture!r} needs a CUDA device (this run's device is {device}); "
                         "run without --capture-step")
    why = None
    if execution == "auto":
        execution, why = choose_execution(device.type, *auto_inputs(setups or []))
    executor = Executor(execution, capture=capture)
    executor.choice = why
    if execution == "batched" and setups:
        executor.stack_limit, executor.stack_reason = setup_stack_limit(setups[0], device)
    return executor


def setup_stack_limit(setup: "RunSetup", device: torch.device) -> tuple[int, str]:
    """The batched path's clients per vmapped call for this run (:mod:`pfl_core.engine.memory`);
    (0, why) where the model cannot be counted alone (a model with extra inputs)."""
    try:
        return stack_limit(setup.model, tuple(setup.dataset.input_shape), setup.cfg.federation.batch_size, device)
    except Exception as err:  # noqa: BLE001 - any model the counter cannot call alone: no limit
        return 0, f"no limit (the model's step could not be counted alone: {type(err).__name__})"


def auto_inputs(setups: list["RunSetup"]) -> tuple[float | None, int]:
    """(FLOPs of one client step, clients per executor call) of runs in lockstep, for ``auto``;
    the FLOPs are None where the model cannot be counted alone (a model with extra inputs)."""
    if not setups:
        return None, 2
    s = setups[0]
    fed_cfg = s.cfg.federation
    per_round = s.algorithm.clients_per_round(fed_cfg.clients_per_round) or len(s.fed.train_clients)
    try:
        flops = step_flops(s.model, tuple(s.dataset.input_shape), fed_cfg.batch_size)
    except Exception:  # noqa: BLE001 - any model the counter cannot call alone: the device decides
        flops = None
    return flops, per_round * len(setups)


def execution_info(executor: Executor, algorithm, lockstep: int = 1) -> dict:
    """How a run's clients were executed, for its record: ``execution``, ``lockstep_runs`` (runs
    advanced together) and, on a fallback, why."""
    info = {"execution": "batched" if executor.uses_batched(algorithm) else "sequential",
            "lockstep_runs": lockstep}
    if getattr(executor, "choice", None):
        info["execution_choice"] = executor.choice
    if info["execution"] == "batched" and getattr(executor, "captured", None) is not None:
        info["step_capture"] = executor.captured.summary()
    if info["execution"] == "batched" and getattr(executor, "stack_reason", None):
        info["stack_limit"] = f"{executor.stack_limit or 'none'}: {executor.stack_reason}"
    if executor.execution == "batched" and algorithm.batched_fallback:
        info["execution_fallback"] = algorithm.batched_fallback
    return info


@dataclass
class RunResult:
    metrics: dict[str, float]
    history: list[dict[str, float]]
    clients: list[dict]
    curve_mean: list[float] = field(default_factory=list)
    curve_weighted: list[float] = field(default_factory=list)
    info: dict = field(default_factory=dict)
    arrays: dict[str, dict[str, np.ndarray]] = field(default_factory=dict)
    """Post-run analyses' arrays by artifact name (logged as ``<name>.npz``)."""
    final_state: PretrainedState | None = None
    """The final global parameters and BN running statistics (:func:`pfl_core.pretrained.final_state`):
    what a stage-2 run starts from when this run is its stage 1; None for a method whose server
    keeps no global ``params`` (pFedHN's hypernetwork), which cannot be a stage 1."""


@dataclass
class RunSetup:
    """Everything a run builds before training: data, clients, model, method, protocol, streams."""

    cfg: RunConfig
    device: torch.device
    dataset: ArrayDataset
    fed: object
    model: torch.nn.Module
    algorithm: object
    protocol: object
    streams: RunStreams
    analyses: list = field(default_factory=list)
    """The post-run analyses of ``evaluation.analyses`` (:mod:`pfl_core.analysis`)."""
    pretrained_info: dict = field(default_factory=dict)
    """Where ``model.pretrained`` came from (stage-1 config hash and run, or a source)."""


def run_data(cfg: RunConfig, streams: RunStreams, data_dir: str | None = None) -> tuple[ArrayDataset, FederatedData]:
    """The dataset a run loads (standardized, subsampled) and its federation: partition, client
    splits, held-out clients; on the CPU. Also the data step of the sweep's pre-flight."""
    d = cfg.data
    from_train = d.normalize == "pixel" and cfg.pixel_stats_from() == "train"
    dataset = load_run_dataset(cfg, data_dir)
    if not from_train:  # the paper code's order: statistics of the whole set, before subsampling
        dataset = standardize(dataset, d.normalize)
    if d.subsample and d.subsample < len(dataset):
        keep = streams.numpy("subsample").choice(len(dataset), size=d.subsample, replace=False)
        dataset = dataset.subset(torch.as_tensor(sorted(keep)))
    partition = dict(d.partition)
    fed = build_federated(
        dataset,
        num_clients=d.num_clients,
        partition=partition.pop("name"),
        partition_params=partition,
        client_splits=d.client_splits,
        unseen_fraction=d.unseen_fraction,
        streams=streams,
        remainder=d.remainder,
        validation_fraction=d.validation_fraction,
        min_train_size=cfg.federation.batch_size if d.redraw_short_clients else 0,
        source_splits=d.source_splits,
        pool_splits=d.pool_splits,
        partition_seeding=d.partition_seeding,
        partition_per_group=d.partition_per_group,
        client_val_fraction=d.client_val_fraction,
        client_val_seed=d.client_val_seed,
    )
    if from_train:  # statistics of the training clients' train splits only (a tuning run)
        rows = torch.cat([fed.clients[c].splits["train"] for c in fed.train_clients])
        fed = replace(fed, dataset=standardize(fed.dataset, "pixel", rows=rows))
    return dataset, fed


def prepare_run(cfg: RunConfig, dev: torch.device, data_dir: str | None = None,
                pretrained: Provider | None = None) -> RunSetup:
    """Load and partition the data, build the model (seeded, then loaded with the pretrained state
    of ``model.pretrained`` from ``pretrained``, default :class:`InProcessPretraining`), the method
    (``algorithm.pretrained``: that state) and the protocol. A method that does not carry the BN
    running statistics of a model that keeps them is rejected first (:func:`check_bn_support`)."""
    check_bn_support(cfg.method.name, cfg.model.name)
    for i, step in enumerate(cfg.model.warm_start):
        check_bn_support(step.get("name", ""), cfg.model.name, f"model.warm_start[{i}].name")
    streams = RunStreams(cfg.seed)
    d = cfg.data
    dataset, fed = run_data(cfg, streams, data_dir)
    fed = fed.to(dev)

    method_cls = METHODS.get(cfg.method.name)
    hp = method_cls.hyper_class.from_dict(cfg.method.params, where=f"method {cfg.method.name}: ")
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(streams.seed_int("init"))
        model = build_model(cfg.model.name, dataset.input_shape, dataset.num_classes, **cfg.model.params)
    model = model.to(dev)
    state, pretrained_info = resolve(cfg, model, pretrained or InProcessPretraining(str(dev), data_dir))
    algorithm = method_cls(model, hp)
    algorithm.seed = streams.seed_int("algorithm")
    algorithm.pretrained = state
    protocol_cls = PROTOCOLS.get(cfg.evaluation.protocol)
    protocol = protocol_cls(EvalConfig.from_dict(cfg.evaluation.params, where="evaluation.params: "),
                            target=cfg.evaluation.target)
    protocol.seed = streams.seed_int("evaluation")
    if hasattr(protocol, "bind"):  # novel_class: splits not in data.pool_splits, preprocessed as the training data
        params = tuple(sorted((k, tuple(v) if isinstance(v, list) else v) for k, v in d.params.items()))
        protocol.bind({role: replace(_cached_dataset(d.dataset, params, split, data_dir), mean=fed.dataset.mean,
                                     std=fed.dataset.std).to(dev)
                       for role, split in protocol.dataset_splits.items() if split not in d.pool_splits})
    analyses = parse_analyses(cfg.evaluation.analyses)
    return RunSetup(cfg, dev, dataset, fed, model, algorithm, protocol, streams, analyses, pretrained_info)


def run_result(setup: RunSetup, fed_result, info: dict) -> RunResult:
    """Metrics, history, per-client results and provenance of a finished run."""
    final, fed, server = fed_result.final, setup.fed, fed_result.server
    metrics = dict(final.summary)
    metrics["train_loss"] = fed_result.history[-1]["train_loss"] if fed_result.history else float("nan")
    short = short_train_clients(fed.clients, setup.cfg.federation.batch_size)  # all clients, unseen too
    metrics["short_train_clients"] = float(len(short))  # the report counts them per run
    metrics.update({k: float(v) for k, v in setup.algorithm.run_metrics(server).items()})
    if setup.algorithm.pretraining_rounds():  # the report's best-validation selection skips them
        metrics["pretraining_rounds"] = float(setup.algorithm.pretraining_rounds())
    if setup.cfg.federation.early_stopping:  # the round training ended at (rounds: it did not stop)
        metrics["stopped_round"] = float(fed_result.stopped_round or setup.cfg.federation.rounds)
    clients = [
        {"cid": r.cid, "num_samples": r.num_samples, "acc": r.acc, "loss": r.loss,
         "meta": fed.clients[r.cid].meta}
        for r in final.clients
    ]
    info = {
        "device": str(setup.device),
        **info,
        "dataset_offline": setup.dataset.offline,
        "dataset_description": setup.dataset.description,
        "num_train_clients": len(fed.train_clients),
        "num_unseen_clients": len(fed.unseen_clients),
        "num_validation_clients": len(fed.validation_clients),
        "validation_clients": fed.validation_clients,
        "unseen_clients": fed.unseen_clients,
        "partition_digest": partition_digest(fed),
        "sampling_digest": digest(fed_result.sampled),
        "short_train_splits": short,
        "partition_draws": fed.partition_draws,
        "test_in_other_train_fraction": test_in_other_train_fraction(fed),
        **setup.algorithm.run_info(fed_result.server),
    }
    if setup.dataset.provenance:  # not the official files (the CIFAR-10 reconstruction, an accepted copy)
        info["data_provenance"] = setup.dataset.provenance
    if setup.pretrained_info:
        info["pretrained"] = setup.pretrained_info
    if has_bn_state(setup.model):  # train: accuracies with each test batch's own BN statistics
        info["bn_evaluation"] = setup.protocol.bn_mode
    if setup.cfg.federation.early_stopping:
        info["early_stopped_at_round"] = fed_result.stopped_round
    analysed = run_analyses(setup.analyses, setup, fed_result)
    metrics.update(analysed.metrics)
    return RunResult(metrics, fed_result.history, clients, final.curve_mean, final.curve_weighted, info,
                     {**final.arrays, **analysed.arrays},
                     final_state(setup.model, server) if "params" in server else None)


def run_experiment(
    cfg: RunConfig,
    device: str = "auto",
    data_dir: str | None = None,
    on_round: Callable[[int, dict[str, float]], None] | None = None,
    execution: str = "auto",
    checkpointing: Checkpointing | None = None,
    pretrained: Provider | None = None,
    allow_tf32: bool = False,
) -> RunResult:
    """Run one configuration and return its results (raises DivergenceError on NaN).

    ``execution`` is how the clients are run, never what is computed (the config hash ignores it):
    ``sequential`` (one client at a time, the reference), ``batched`` (vmapped stacks of clients,
    :mod:`pfl_core.engine`), or ``auto`` (:func:`make_executor`). A method without a client
    program runs sequentially either way; ``info["execution"]`` records the path taken and why.
    ``checkpointing`` (:mod:`pfl_core.checkpoint`) saves the run every N rounds and resumes it.
    ``pretrained`` provides the stage-1 state of ``model.pretrained`` (:mod:`pfl_core.pretrained`;
    default: stage 1 runs here first, :class:`InProcessPretraining`). ``allow_tf32``: TF32 matmuls
    and convolutions on a CUDA device (default off, :mod:`pfl_core.engine.device`)."""
    return run_experiments([cfg], device, data_dir, on_round, execution, checkpointing, pretrained, allow_tf32)[0]


def run_experiments(
    cfgs: list[RunConfig],
    device: str = "auto",
    data_dir: str | None = None,
    on_round: Callable[[int, dict[str, float]], None] | None = None,
    execution: str = "auto",
    checkpointing: Checkpointing | None = None,
    pretrained: Provider | None = None,
    allow_tf32: bool = False,
) -> list[RunResult]:
    """Run configurations that differ only in their seed *in lockstep*: every round, the sampled
    clients of all of them go to the executor together (on the batched path: one vmapped stack of
    clients x seeds). Each run keeps its own partition, client samples, batches and state, so each
    gets what it gets alone. ``on_round(round_idx, metrics)`` fires once per round (first run's
    metrics). One failing run (NaN) fails the group: run the seeds alone to isolate it.
    ``checkpointing`` has one path per configuration: the runs resume from their checkpoints when
    all exist at the same round (the warm start is then skipped: its result is in the saved
    server state), and are saved together every N rounds. ``pretrained``: as in
    :func:`run_experiment`, shared by the runs (one stage 1 for the seeds of a cell).
    ``allow_tf32``: as in :func:`run_experiment`; the device, versions and TF32 flags are recorded
    in each run's ``info`` (:func:`pfl_core.engine.device.device_info`)."""
    started = time.perf_counter()
    dev = resolve_device(device)
    configure_device(dev, allow_tf32)
    if execution not in EXECUTION_CHOICES:
        raise ValueError(f"execution must be one of {EXECUTION_CHOICES}, got {execution!r}")
    _check_lockstep(cfgs)
    provider = pretrained or InProcessPretraining(device, data_dir, execution, allow_tf32)
    setups = [prepare_run(cfg, dev, data_dir, provider) for cfg in cfgs]
    executor = make_executor(execution, dev, setups)
    if checkpointing is not None:
        checkpointing.clock_start = started
    saved = checkpointing.available() if checkpointing is not None else None
    inits = [model_params(s.model) for s in setups] if saved else warm_start(setups, executor)
    federations = [
        Federation(s.algorithm, s.fed, init, s.cfg.federation, s.protocol, s.streams,
                   on_round if k == 0 else None, augment=s.cfg.data.augment,
                   balanced=s.cfg.data.balanced_sampler)
        for k, (s, init) in enumerate(zip(setups, inits))
    ]
    start = checkpointing.restore(federations, saved, dev) if saved else 0
    results = run_lockstep(federations, executor, start, checkpointing)
    before = checkpointing.before_s if start else 0.0  # seconds of earlier processes (None: unknown)
    wall = (time.perf_counter() - started + (before or 0.0)) / len(cfgs)
    info = {**execution_info(executor, setups[0].algorithm, len(cfgs)), **device_info(dev), "wall_s": wall}
    if start:
        info["resumed_from_round"] = start
        info["wall_s_before_resume"] = before  # the whole lockstep group's, as the run's wall_s metric
    if checkpointing is not None and checkpointing.discarded:
        info["checkpoint_discarded"] = checkpointing.discarded
    return [run_result(s, r, info) for s, r in zip(setups, results)]


class InProcessPretraining:
    """The default provider: runs each distinct stage-1 configuration here, once, with the
    stage-2 run's device, data folder and execution path, and keeps its state."""

    def __init__(self, device: str = "auto", data_dir: str | None = None, execution: str = "auto",
                 allow_tf32: bool = False):
        self.device, self.data_dir, self.execution, self.allow_tf32 = device, data_dir, execution, allow_tf32
        self.states: dict[str, PretrainedState] = {}

    def __call__(self, stage1: RunConfig) -> PretrainedState:
        key = json.dumps(stage1.to_dict(), sort_keys=True, default=str)
        if key not in self.states:
            self.states[key] = run_experiment(stage1, self.device, self.data_dir, execution=self.execution,
                                              allow_tf32=self.allow_tf32).final_state
        return self.states[key]


def _check_lockstep(cfgs: list[RunConfig]) -> None:
    """Runs in lockstep share the method, model and federation settings (only seeds may differ)."""
    if not cfgs:
        raise ValueError("run_experiments needs at least one configuration")
    first = cfgs[0]
    for cfg in cfgs[1:]:
        for part in ("method", "model", "federation", "evaluation"):
            if getattr(cfg, part) != getattr(first, part):
                raise ValueError(f"runs in lockstep must share their {part} settings; "
                                 f"seed {cfg.seed} differs from seed {first.seed}")
        if cfg.data.dataset != first.data.dataset:
            raise ValueError("runs in lockstep must share their dataset")
