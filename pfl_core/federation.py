"""The federation loop: sample clients, run their updates, aggregate, evaluate.

Client sampling has its own RNG stream, so the sequence of sampled clients depends on the seed
alone, never on the method. A non-finite training loss or server state stops the run with a
:class:`DivergenceError` naming the round.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

import numpy as np
import torch

from pfl_core.algorithms.base import Algorithm, ClientContext, ServerState
from pfl_core.batching import BatchStream
from pfl_core.config import FederationConfig
from pfl_core.data.federated import FederatedData
from pfl_core.engine import Executor
from pfl_core.evaluation import EvalResult, Protocol
from pfl_core.seeding import RunStreams
from pfl_core.training import Params, all_finite


class DivergenceError(RuntimeError):
    """Training produced a non-finite loss or parameters."""


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
    purpose: str, eval_batch_size: int, states: dict[int, dict] | None = None,
) -> dict[int, ClientContext]:
    """One context per client: a batch stream per split (training splits with ``drop_last``,
    other splits complete) seeded by (run seed, purpose, client, split)."""
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
            )
        state = states.get(cid, {}) if states is not None else {}
        contexts[cid] = ClientContext(client, fed.dataset, split_streams, state)
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


def _check_finite(server: ServerState, round_idx: int) -> None:
    if not all(all_finite(params) for params in _param_dicts(server)):
        raise DivergenceError(f"non-finite server parameters after round {round_idx + 1}")


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
) -> FederationResult:
    """Run ``cfg.rounds`` rounds of ``algorithm`` and evaluate with ``protocol``.

    ``on_round(round_idx, metrics)`` is called after every round (for progress and logging).
    ``evaluate_clients=False`` trains only (a warm-start predecessor): no evaluation at all.
    ``executor`` runs the sampled clients (default: sequential, the reference path).
    """
    executor = executor or Executor("sequential")
    eval_bs = protocol.cfg.batch_size or cfg.batch_size
    train_ctx = make_contexts(fed, fed.train_clients, cfg, streams, "batches", eval_bs)
    sampler = ClientSampler(fed.train_clients, cfg.clients_per_round, streams.numpy("sampling"))
    server = algorithm.init_server(init_params)
    result = FederationResult(server, contexts=train_ctx)

    def evaluate() -> EvalResult:
        ids = protocol.client_ids(fed)
        states = {cid: ctx.state for cid, ctx in train_ctx.items()}
        eval_ctx = make_contexts(fed, ids, cfg, streams, "eval", eval_bs, states)
        return protocol.evaluate(algorithm, server, eval_ctx, executor)

    for round_idx in range(cfg.rounds):
        sampled = sampler.sample()
        result.sampled.append(sampled)
        updates = executor.run(algorithm, server, [train_ctx[cid] for cid in sampled], round_idx)
        loss = float(torch.stack([u.loss for u in updates]).mean())
        if not np.isfinite(loss):
            raise DivergenceError(f"non-finite training loss ({loss}) in round {round_idx + 1}")
        server = algorithm.aggregate(server, updates)
        _check_finite(server, round_idx)
        metrics = {"round": round_idx + 1, "train_loss": loss}
        last = round_idx == cfg.rounds - 1
        if evaluate_clients and (last or (cfg.eval_every and (round_idx + 1) % cfg.eval_every == 0)):
            evaluation = evaluate()
            metrics.update(evaluation.summary)
            if last:
                result.final = evaluation
        result.history.append(metrics)
        if on_round is not None:
            on_round(round_idx, metrics)
    if cfg.rounds == 0 and evaluate_clients:
        result.final = evaluate()
    result.server = server
    return result
