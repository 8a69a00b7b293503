"""The algorithm interface (docs/adding-a-method.md).

An algorithm says how the server state is initialised, what a sampled client does in a round
(reading and writing its own persistent state), how the uploads are aggregated, and which
parameters a client predicts with. Hyperparameters are a dataclass whose defaults are the paper's
values; suites override them by name and unknown names are rejected.

A client's round is written once, as a *program* (:mod:`pfl_core.engine.executor`):
:meth:`Algorithm.draw`, :meth:`Algorithm.carry_in`, the pure :meth:`Algorithm.local_update` and
:meth:`Algorithm.carry_out`. The engine runs it for one client (the sequential path, also
:meth:`Algorithm.client_update`) or vmapped over a stack of clients (the batched path). A method
that overrides :meth:`Algorithm.client_update` instead runs on the sequential path only and says
why in ``batched_fallback``.
"""
from __future__ import annotations

from abc import ABC
from typing import ClassVar, Literal

import torch
from torch import nn

from pfl_core.engine.contract import ClientContext, ClientUpdate, ServerState
from pfl_core.engine.plans import Drawn, Plan
from pfl_core.algorithms._lib.round_lr import round_lr_carry
from pfl_core.fields import HyperParams, check_value_types
from pfl_core.training import Params, average_buffers, average_params, forward, initial_bn_state, sgd_step

#: server aggregation weights: ``samples`` (n_k / n, the FedAvg paper) or ``uniform`` (plain mean)
Weighting = Literal["samples", "uniform"]


class Algorithm(ABC):
    """Base class of every federated method. Subclasses set ``hyper_class`` and implement the
    client program (:meth:`draw`, :meth:`carry_in`, :meth:`local_update`, :meth:`carry_out`) or,
    sequential only, :meth:`client_update`; the defaults below are FedAvg's server."""

    hyper_class: ClassVar[type[HyperParams]] = HyperParams
    #: whether the evaluation protocol fine-tunes this method's predictor (the "-FT" variants)
    finetune_at_eval: ClassVar[bool] = False
    #: tuning ranges the method puts on the evaluation protocol's fields (field -> ``Tune``),
    #: searched whether or not it fine-tunes at evaluation (FedL2P's FT baselines: the lr grid)
    tune_evaluation: ClassVar[dict] = {}
    #: why the method has no tuning range, if it has none (``pflbench tune`` says so)
    nothing_to_tune: ClassVar[str] = ""
    #: an integer derived from the run seed (stream ``algorithm``), for a method's own randomness
    #: (k-means restarts, coin flips); set by the experiment before training
    seed: int = 0
    #: the stage-1 state of ``model.pretrained`` (:mod:`pfl_core.pretrained`: ``{"params", "buffers"}``
    #: on the run's device), set by the experiment before :meth:`prepare`; None without a stage 1.
    #: The model's initial parameters (hence :meth:`init_server`'s) are already its ``params``.
    pretrained: dict | None = None
    #: None when the client update is a program (batched path available), else why it is not
    batched_fallback: ClassVar[str | None] = None
    #: None when the batched evaluation path can evaluate this method, else why it cannot
    eval_batched_fallback: ClassVar[str | None] = None
    #: plan streams whose number of batches may differ between clients: the batched path may pad
    #: them, and :meth:`local_update` then receives a mask for them
    maskable_streams: ClassVar[tuple[str, ...]] = ()
    #: plan streams of training batches (the client's train split as local training consumes it):
    #: those ``data.augment`` augments per sample (:mod:`pfl_core.engine.augmentation`); a method
    #: that names none rejects ``data.augment``
    train_streams: ClassVar[tuple[str, ...]] = ()
    #: whether the method carries the BatchNorm running statistics of a model that keeps them
    #: (KLD-BN: FedL2P's ResNets, MetaVers' ``conv4``): its clients update them and the server
    #: keeps them (``server["buffers"]``), or, for a method that trains nothing, its evaluation
    #: starts from the pretrained ones. A method that does not is rejected with such a model at
    #: load time (:func:`pfl_core.bn_support.check_bn_support`): it would evaluate with statistics
    #: no client ever computed
    keeps_bn_state: ClassVar[bool] = False

    def __init__(self, model: nn.Module, hp: HyperParams):
        check_value_types(type(hp), vars(hp), f"{type(self).__name__}: ")  # types and Literal choices
        self.model = model
        self.hp = hp

    def prepare(self, fed) -> None:
        """Facts of the run's partition (a :class:`~pfl_core.data.federated.FederatedData`) that the
        method needs before :meth:`init_server`, e.g. pFedHN's client count (its embedding table);
        called by the federation. Nothing by default."""

    def clients_per_round(self, configured: int) -> int:
        """Clients sampled per round; ``configured`` is ``federation.clients_per_round``. A method
        with its own sampling rule (pFedHN: one client per round) overrides it."""
        return configured

    def init_server(self, params: Params) -> ServerState:
        """``{"params"}``, plus ``"buffers"`` (the BN running statistics, :func:`initial_bn_state`)
        when the model keeps BN state (FedL2P's KLD-BN ResNets)."""
        buffers = initial_bn_state(self.model)
        return {"params": params} if buffers is None else {"params": params, "buffers": buffers}

    def client_update(self, server: ServerState, client: ClientContext, round_idx: int) -> ClientUpdate:
        """Train client ``client`` starting from ``server``; may read and write ``client.state``.
        By default: the client program on this one client (the sequential path)."""
        from pfl_core.engine.executor import run_program

        return run_program(self, server, client, round_idx)

    # -- the client program ---------------------------------------------------------------------
    def round_carry(self, server: ServerState, round_idx: int) -> dict:
        """What the BN-aware, lr-scheduled programs (fedavg, fedbabu, perfedavg) add to a carry:
        ``buffers``, the server's BN running statistics (models with BN state), and ``lr``, the
        round's scheduled lr as a 0-d tensor (hyperparameters with a
        :class:`~pfl_core.algorithms._lib.round_lr.RoundLR` schedule).
        Neither key for a model without BN state and an unscheduled lr (the old carry)."""
        carry = {"buffers": server["buffers"]} if server.get("buffers") is not None else {}
        return {**carry, **round_lr_carry(self.hp, round_idx, next(iter(server["params"].values())))}

    def carry_in(self, server: ServerState, client: ClientContext, round_idx: int,
                 drawn: dict | None = None) -> dict:
        """The client's start values (a pytree of tensors) from the server and ``client.state``;
        ``drawn``: the non-index values of this round's :meth:`draw` (called first), if any."""
        raise NotImplementedError(f"{type(self).__name__} has no client program")

    def draw(self, client: ClientContext, round_idx: int) -> Plan | Drawn:
        """The index batches the client consumes this round, per named stream, drawn in the
        order of the method's reference code (host side: all randomness lives here). A method
        that draws anything else returns ``Drawn(plan, values)``; ``values`` reach :meth:`carry_in`."""
        raise NotImplementedError(f"{type(self).__name__} has no client program")

    def local_update(self, carry: dict, batches: dict, masks: dict) -> tuple[dict, torch.Tensor]:
        """Pure tensor function of one client's round: ``batches[stream] = (xs, ys)`` indexable by
        step; ``masks[stream]`` (maskable streams of a padded stack only) marks the real steps.
        Returns the new carry and the client's mean training loss (0-d). No host syncs, no
        randomness, no Python branching on tensor values: it runs under ``torch.func.vmap``."""
        raise NotImplementedError(f"{type(self).__name__} has no client program")

    def carry_out(self, server: ServerState, client: ClientContext, carry: dict,
                  loss: torch.Tensor) -> ClientUpdate:
        """Write the client's persistent state from ``carry`` and return its upload."""
        raise NotImplementedError(f"{type(self).__name__} has no client program")

    def aggregation_weights(self, updates: list[ClientUpdate]) -> list[float]:
        """Per-upload weights following ``hp.weighting`` (samples when the method has no such field)."""
        weighting = getattr(self.hp, "weighting", "samples")
        return [float(u.num_samples) if weighting == "samples" else 1.0 for u in updates]

    def average_uploads(self, updates: list[ClientUpdate]) -> Params | None:
        """The ``hp.weighting`` average of the uploaded parameters (None if nothing was uploaded)."""
        uploads = [u for u in updates if u.params is not None]
        if not uploads:
            return None
        return average_params([u.params for u in uploads], self.aggregation_weights(uploads))

    def aggregate(self, server: ServerState, updates: list[ClientUpdate]) -> ServerState:
        """Average the uploads, weighted by samples or uniformly (``hp.weighting``), and their BN
        running statistics with the same weights (:meth:`aggregate_buffers`)."""
        average = self.average_uploads(updates)
        return self.aggregate_buffers(server if average is None else {**server, "params": average}, updates)

    def aggregate_buffers(self, server: ServerState, updates: list[ClientUpdate]) -> ServerState:
        """``server`` with ``"buffers"`` replaced by the ``hp.weighting`` average of the uploaded BN
        running statistics (:func:`~pfl_core.training.average_buffers`: the FedL2P code averages
        the whole state_dict); ``server`` itself when no update carries any."""
        uploads = [u for u in updates if u.buffers is not None]
        if not uploads:
            return server
        return {**server, "buffers": average_buffers([u.buffers for u in uploads], self.aggregation_weights(uploads))}

    def predictor(self, server: ServerState, client: ClientContext) -> Params:
        """The parameters client ``client`` evaluates with (before any protocol fine-tuning)."""
        return server["params"]

    def round_metrics(self, server: ServerState) -> dict[str, float]:
        """Method-specific statistics of the round just aggregated (host floats), added to the
        round's history row (logged as ``round/<key>``); none by default."""
        return {}

    def stop_after_round(self, server: ServerState) -> bool:
        """Whether the method's own early-stopping rule ends training after the round just
        aggregated (FedL2P: rounds since its best round); the federation then evaluates and stops.
        Never by default."""
        return False

    def pretraining_rounds(self) -> int:
        """Rounds at the start of a run that train another model than the method's own (LG-FedAvg:
        its FedAvg stage, ``pretrain_rounds``). Evaluations at rounds up to this one score that
        model, so best-validation selection (the run's metric ``pretraining_rounds``, read by the
        report) and early stopping skip them. 0 by default."""
        return 0

    def run_info(self, server: ServerState) -> dict:
        """JSON-able facts of a finished run for its record (``run_info.json``), e.g. a choice the
        method made while training; none by default."""
        return {}

    def run_metrics(self, server: ServerState) -> dict[str, float]:
        """Numbers a finished run logs as metrics beside its accuracies, so that snapshots, reports
        and the MLflow run table carry them (``run_info`` only reaches ``run_info.json``), e.g. a
        choice the method made while training; none by default."""
        return {}

    def logits(self, params: Params, x: torch.Tensor, client: ClientContext) -> torch.Tensor:
        """Predictions of ``params`` on ``x`` for ``client`` at evaluation (a hook for methods
        whose forward needs more than the inputs, e.g. a labelled context batch)."""
        return forward(self.model, params, x)

    def finetune_step(self, params: Params, x: torch.Tensor, y: torch.Tensor, lr: float,
                      client: ClientContext) -> Params:
        """One SGD step of the evaluation protocol's personalization."""
        return sgd_step(self.model, params, x, y, lr)[0]
