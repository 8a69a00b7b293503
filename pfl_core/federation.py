"""The federation loop: sample clients, run their updates, aggregate, evaluate.

Client sampling has its own RNG stream, so the sequence of sampled clients depends on the seed
alone, never on the method. A non-finite training loss or server state stops the run with a
:class:`DivergenceError` naming the round (a non-finite evaluation loss too: see
:meth:`pfl_core.evaluation.Protocol.evaluate`).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

import numpy as np
import torch

from pfl_core.algorithms.base import Algorithm
from pfl_core.engine.contract import ClientContext, ClientUpdate, ServerState
from pfl_core.batching import BatchStream, balanced_weights
from pfl_core.checkpoint import Checkpointing
from pfl_core.config import FederationConfig
from pfl_core.data.federated import FederatedData
from pfl_core.early_stopping import stop_round
from pfl_core.engine import Executor, WorkItem
from pfl_core.engine.augmentation import check_augmentable, make_train_augment
from pfl_core.evaluation import EvalResult, Protocol
from pfl_core.seeding import RunStreams
from pfl_core.training import DivergenceError, Params


class ClientSampler:
    """M clients per round, uniformly without replacement, from a dedicated RNG stream."""

    def __init__(self, client_ids: list[int], per_round: int, rng: np.random.Generator):
        if per_round > len(client_ids):
            raise ValueError(f"clients_per_round={per_round} exceeds the {len(client_ids)} training clients")
        self.client_ids = list(client_ids)
        self.per_round = per_round or len(client_ids)
        self.rng = rng

    def sample(self) -> list[int]:
        if self.per_round == len(self.client_ids):
            return list(self.client_ids)
        chosen = self.rng.choice(len(self.client_ids), size=self.per_round, replace=False)
        return [self.client_ids[i] for i in chosen]


def make_contexts(
    fed: FederatedData, client_ids: list[int], cfg: FederationConfig, streams: RunStreams,
    purpose: str, eval_batch_size: int, states: dict[int, dict] | None = None, augment: str = "none",
    balanced: bool = False,
) -> dict[int, ClientContext]:
    """One context per client: a batch stream per split (training splits with ``drop_last``,
    other splits complete) seeded by (run seed, purpose, client, split); with ``augment``
    (``data.augment``) the generator of its training batches' augmentation, seeded by (run seed,
    ``augment``, client); with ``balanced`` (``data.balanced_sampler``) the train stream draws its
    epochs class-balanced with replacement (:func:`pfl_core.batching.balanced_weights`)."""
    contexts = {}
    for cid in client_ids:
        client = fed.clients[cid]
        split_streams = {}
        for k, (name, index) in enumerate(sorted(client.splits.items())):
            training = name == "train"
            split_streams[name] = BatchStream(
                index,
                cfg.batch_size if training else eval_batch_size,
                streams.torch(purpose, cid, k, device="cpu"),
                reshuffle=cfg.reshuffle and training,
                drop_last=cfg.drop_last and training,
                weights=balanced_weights(fed.dataset.y[index]) if balanced and training else None,
            )
        state = states.get(cid, {}) if states is not None else {}
        train_augment = make_train_augment(augment, lambda: streams.torch("augment", cid, device="cpu"),
                                           fed.dataset)
        contexts[cid] = ClientContext(client, fed.dataset, split_streams, state, train_augment)
    return contexts


@dataclass
class FederationResult:
    server: ServerState
    history: list[dict[str, float]] = field(default_factory=list)
    """Per-round metrics: ``round``, ``train_loss`` and, on evaluation rounds, the eval summary."""
    final: EvalResult | None = None
    sampled: list[list[int]] = field(default_factory=list)
    """The clients sampled in each round (depends on the seed alone)."""
    contexts: dict[int, ClientContext] = field(default_factory=dict)
    stopped_round: int | None = None
    """The evaluation round at which early stopping ended training (None: it did not)."""


def _param_dicts(value):
    """Every parameter dict inside a server state (``params``, IFCA's cluster list, ...)."""
    if isinstance(value, dict) and value and all(isinstance(v, torch.Tensor) for v in value.values()):
        yield value
    elif isinstance(value, dict):
        for v in value.values():
            yield from _param_dicts(v)
    elif isinstance(value, (list, tuple)):
        for v in value:
            yield from _param_dicts(v)


def elementwise_finite(tensors: list[torch.Tensor]) -> bool:
    """Every element of ``tensors`` finite: the flags reduced where they live, read once."""
    return bool(torch.stack([torch.isfinite(t).all() for t in tensors]).all())


def _check_finite(server: ServerState, round_idx: int) -> None:
    """One host read per round: every server tensor's finite flag reduced where it lives, then read
    once (a read per tensor was 310 of FedL2P's 312 host syncs per round on a GPU).

    The flag is the finiteness of each tensor's sum: an inf or NaN element makes the sum inf or
    NaN, so a finite sum proves every element finite in one pass without a mask (about 12x faster
    than ``isfinite(t).all()`` on pFedHN's hypernetwork and momentum on a CPU,
    ``benchmarks.timing.finite_check``). A non-finite sum may be an overflow of finite values, so
    then the element-wise check decides."""
    tensors = [t for params in _param_dicts(server) for t in params.values()]
    if not tensors or bool(torch.stack([t.sum().isfinite() for t in tensors]).all()):
        return
    if not elementwise_finite(tensors):
        raise DivergenceError(f"non-finite server parameters after round {round_idx + 1}")


class Federation:
    """One run's federation, advanced a round at a time so that several runs (the seeds of a cell)
    can advance in lockstep, their sampled clients executed together (:func:`run_lockstep`).

    ``on_round(round_idx, metrics)`` is called after every round (for progress and logging).
    ``evaluate_clients=False`` trains only (a warm-start predecessor): no evaluation at all.
    ``augment`` (``data.augment``): per-sample augmentation of the training batches
    (:mod:`pfl_core.engine.augmentation`); evaluation batches are not augmented.
    ``balanced`` (``data.balanced_sampler``): class-balanced training streams (:func:`make_contexts`).
    """

    def __init__(self, algorithm: Algorithm, fed: FederatedData, init_params: Params, cfg: FederationConfig,
                 protocol: Protocol, streams: RunStreams,
                 on_round: Callable[[int, dict[str, float]], None] | None = None,
                 evaluate_clients: bool = True, augment: str = "none", balanced: bool = False):
        self.algorithm, self.fed, self.cfg, self.protocol, self.streams = algorithm, fed, cfg, protocol, streams
        self.on_round, self.evaluate_clients = on_round, evaluate_clients
        self.eval_batch_size = protocol.cfg.batch_size or cfg.batch_size
        check_augmentable(augment, fed.dataset.input_shape, algorithm, fed.dataset)
        self.contexts = make_contexts(fed, fed.train_clients, cfg, streams, "batches", self.eval_batch_size,
                                      augment=augment, balanced=balanced)
        per_round = algorithm.clients_per_round(cfg.clients_per_round)
        self.sampler = ClientSampler(fed.train_clients, per_round, streams.numpy("sampling"))
        algorithm.prepare(fed)
        self.result = FederationResult(algorithm.init_server(init_params), contexts=self.contexts)

    @property
    def server(self) -> ServerState:
        return self.result.server

    def work(self, round_idx: int) -> list[WorkItem]:
        """Sample this round's clients; their work for the executor."""
        sampled = self.sampler.sample()
        self.result.sampled.append(sampled)
        return [WorkItem(self.algorithm, self.server, self.contexts[cid], round_idx) for cid in sampled]

    def evaluate(self, executor: Executor) -> EvalResult:
        ids = self.protocol.client_ids(self.fed)
        states = {cid: ctx.state for cid, ctx in self.contexts.items()}
        eval_ctx = make_contexts(self.fed, ids, self.cfg, self.streams, "eval", self.eval_batch_size, states)
        return self.protocol.evaluate(self.algorithm, self.server, eval_ctx, executor, self.result.history)

    @property
    def stopped(self) -> bool:
        return self.result.stopped_round is not None

    def _early_stop(self, metrics: dict[str, float]) -> bool:
        """Whether ``cfg.early_stopping`` ends training at this evaluation (``metrics``)."""
        key = self.cfg.early_stopping_key
        if key not in metrics:
            raise ValueError(f"federation.early_stopping reads {key!r}, which the evaluation does not "
                             f"log (it logs {sorted(metrics)}): set federation.early_stopping_key, or "
                             "evaluation.params.val_split: val")
        rows = [*self.result.history, metrics]
        first = self.algorithm.pretraining_rounds()  # evaluations of a pretraining stage do not count
        evaluations = [(int(r["round"]), float(r[key])) for r in rows if key in r and r["round"] > first]
        return stop_round(evaluations, self.cfg.patience_rule, self.cfg.patience,
                          self.cfg.early_stopping_after, self.cfg.eval_every) == metrics["round"]

    def finish_round(self, round_idx: int, updates: list[ClientUpdate], executor: Executor) -> None:
        """Aggregate the round's updates, check them, evaluate when due, record the metrics."""
        loss = float(torch.stack([u.loss for u in updates]).mean())
        if not np.isfinite(loss):
            raise DivergenceError(f"non-finite training loss ({loss}) in round {round_idx + 1}")
        self.result.server = self.algorithm.aggregate(self.server, updates)
        _check_finite(self.server, round_idx)
        metrics = {"round": round_idx + 1, "train_loss": loss, **self.algorithm.round_metrics(self.server)}
        method_stop = self.algorithm.stop_after_round(self.server)
        if method_stop:
            self.result.stopped_round = round_idx + 1
        last = round_idx == self.cfg.rounds - 1 or method_stop
        every = self.cfg.eval_every
        if self.evaluate_clients and (last or (every and (round_idx + 1) % every == 0)):
            evaluation = self.evaluate(executor)
            metrics.update(evaluation.summary)
            if self.cfg.early_stopping and self._early_stop(metrics):
                self.result.stopped_round = round_idx + 1
            if last or self.stopped:
                self.result.final = evaluation
        self.result.history.append(metrics)
        if self.on_round is not None:
            self.on_round(round_idx, metrics)

    def finish(self, executor: Executor) -> FederationResult:
        """The result; evaluated here when no round did (zero rounds, or a run that had stopped
        early before the checkpoint it resumed from: its server is the one evaluated then)."""
        if self.result.final is None and self.evaluate_clients:
            history, self.result.history = self.result.history, self.result.history[:-1] if self.stopped else []
            self.result.final = self.evaluate(executor)
            self.result.history = history
        return self.result


def run_lockstep(federations: list[Federation], executor: Executor, start_round: int = 0,
                 checkpointing: Checkpointing | None = None) -> list[FederationResult]:
    """Advance runs of one method (the seeds of a cell) together: each round, the sampled clients
    of every run go to the executor in one call, so the batched path stacks clients x seeds. Each
    run keeps its own data, client samples, batches and state, hence its own numbers.
    ``start_round``: the first round to run (after a restored checkpoint); ``checkpointing``
    saves every run when due (:mod:`pfl_core.checkpoint`)."""
    rounds = {f.cfg.rounds for f in federations}
    if len(rounds) != 1:
        raise ValueError(f"runs in lockstep need the same number of rounds, got {sorted(rounds)}")
    total = rounds.pop()
    for round_idx in range(start_round, total):
        running = [f for f in federations if not f.stopped]  # early stopping
        if not running:
            break
        lockstep_round(running, executor, round_idx)
        if checkpointing is not None and checkpointing.due(round_idx, total):
            checkpointing.save(federations, round_idx)
    return [f.finish(executor) for f in federations]


def lockstep_round(federations: list[Federation], executor: Executor, round_idx: int) -> None:
    """One round of every federation, their sampled clients in one executor call."""
    work = [f.work(round_idx) for f in federations]
    updates = executor.run_many([item for items in work for item in items])
    start = 0
    for federation, items in zip(federations, work):
        federation.finish_round(round_idx, updates[start:start + len(items)], executor)
        start += len(items)


def run_federation(
    algorithm: Algorithm,
    fed: FederatedData,
    init_params: Params,
    cfg: FederationConfig,
    protocol: Protocol,
    streams: RunStreams,
    on_round: Callable[[int, dict[str, float]], None] | None = None,
    evaluate_clients: bool = True,
    executor: Executor | None = None,
    augment: str = "none",
    balanced: bool = False,
) -> FederationResult:
    """Run ``cfg.rounds`` rounds of ``algorithm`` and evaluate with ``protocol`` (one run; see
    :class:`Federation` for the arguments). ``executor`` runs the sampled clients (default:
    sequential, the reference path)."""
    federation = Federation(algorithm, fed, init_params, cfg, protocol, streams, on_round, evaluate_clients,
                            augment, balanced)
    return run_lockstep([federation], executor or Executor("sequential"))[0]
