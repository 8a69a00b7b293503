"""The engine's vocabulary: what a round hands a client and what it gets back, and the client
*program* a method implements to run on both execution paths (:mod:`pfl_core.engine.executor`).

:class:`pfl_core.algorithms.base.Algorithm` implements :class:`ClientProgram`; the engine and the
evaluation protocols type against the protocol, never against the algorithms package.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, ClassVar, Iterator, Protocol

import torch

from pfl_core.batching import BatchStream
from pfl_core.data.federated import ArrayDataset, Client
from pfl_core.engine.plans import Drawn, Plan
from pfl_core.models.kld_bn import Buffers
from pfl_core.training import Params

#: a method's server state: the global model and whatever else its server keeps (a pytree of tensors)
ServerState = dict[str, Any]


@dataclass
class ClientContext:
    """What one client brings to a round: its data, its batch streams and its persistent state.

    ``state`` belongs to the algorithm (personal models, heads, optimiser moments, cluster id) and
    survives across rounds; the federation loop keeps one context per client for the whole run.
    """

    client: Client
    dataset: ArrayDataset
    streams: dict[str, BatchStream]
    state: dict = field(default_factory=dict)
    augment: Any = None
    """The per-sample augmentation of the client's training batches (``data.augment``:
    :class:`pfl_core.engine.augmentation.TrainAugment`, its own generator), None: none."""

    @property
    def cid(self) -> int:
        return self.client.cid

    def num_samples(self, split: str = "train") -> int:
        return self.client.size(split)

    def next_batch(self, split: str = "train") -> tuple[torch.Tensor, torch.Tensor]:
        return self.dataset.batch(self.streams[split].next())

    def next_index(self, split: str = "train") -> torch.Tensor:
        """The index batch :meth:`next_batch` would return (for batch plans)."""
        return self.streams[split].next()

    def epoch_index(self, split: str = "train") -> list[torch.Tensor]:
        """The index batches :meth:`epoch` would yield (for batch plans)."""
        return self.streams[split].epoch()

    def epoch(self, split: str = "train") -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        for index in self.streams[split].epoch():
            yield self.dataset.batch(index)


@dataclass
class ClientUpdate:
    """What a client returns: uploaded parameters (None: nothing uploaded), the aggregation
    weight (its number of training samples), and its mean training loss (a 0-d tensor)."""

    params: Params | None
    num_samples: int
    loss: torch.Tensor
    buffers: Buffers | None = field(default=None, kw_only=True)
    """BN running statistics after local training (models with BN state, BN-aware methods), averaged
    by the server like the parameters (:meth:`Algorithm.aggregate_buffers`); None: none. Keyword-only,
    so that subclasses' positional fields keep their places."""


class ClientProgram(Protocol):
    """The hooks the engine and the evaluation protocols call on a method (all of them: a method
    subclasses :class:`pfl_core.algorithms.base.Algorithm`, which defines every one).

    Training, per sampled client and round, in this order: :meth:`draw` (host: the index batches
    of the round, and the only place a method draws random numbers; any other draw goes into a
    :class:`~pfl_core.engine.plans.Drawn`), :meth:`carry_in` (host: start values; ``drawn`` holds
    the draw's non-index values), :meth:`local_update` (pure tensor code; vmapped over stacked
    clients by the batched path), :meth:`carry_out` (host: persistent state, upload). A method that is not a program overrides
    :meth:`client_update` and names why in ``batched_fallback``.
    """

    hp: Any
    #: None when the client update is a program (batched path available), else why it is not
    batched_fallback: ClassVar[str | None]
    #: None when the batched evaluation path can evaluate the method, else why it cannot
    eval_batched_fallback: ClassVar[str | None]
    #: plan streams whose number of batches may differ between clients (padded with a mask)
    maskable_streams: ClassVar[tuple[str, ...]]
    #: plan streams of training batches, augmented per sample with ``data.augment``
    train_streams: ClassVar[tuple[str, ...]]
    #: whether the evaluation protocol fine-tunes the predictor
    finetune_at_eval: ClassVar[bool]

    def client_update(self, server: ServerState, client: ClientContext, round_idx: int) -> ClientUpdate: ...

    def carry_in(self, server: ServerState, client: ClientContext, round_idx: int,
                 drawn: dict | None = None) -> dict: ...

    def draw(self, client: ClientContext, round_idx: int) -> Plan | Drawn: ...

    def local_update(self, carry: dict, batches: dict, masks: dict) -> tuple[dict, torch.Tensor]: ...

    def carry_out(self, server: ServerState, client: ClientContext, carry: dict,
                  loss: torch.Tensor) -> ClientUpdate: ...

    def predictor(self, server: ServerState, client: ClientContext) -> Params: ...

    def logits(self, params: Params, x: torch.Tensor, client: ClientContext | None) -> torch.Tensor: ...

    def finetune_step(self, params: Params, x: torch.Tensor, y: torch.Tensor, lr: float,
                      client: ClientContext | None) -> Params: ...
