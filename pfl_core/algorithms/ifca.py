"""IFCA (Ghosh et al., 2020) as the CAFeMe code runs it (docs/papers/cafeme.md: IFCA; code ``IFCAClient`` /
``train_ifca``).

* The server holds k models ("clusters").
* Each round, a sampled client picks the cluster with the smallest **summed** training loss over
  one pass of its whole train ("pers") split (the sum of per-batch mean cross-entropies, as the
  code's ``compute_best_model``), trains that model with plain SGD for ``local_epochs`` full epochs,
  and uploads it with the index of the cluster it chose.
* The server averages each cluster over exactly the clients that chose it (uniform mean, as the
  code's ``aggregate_model_params``); a cluster nobody chose is left unchanged.
* At evaluation a client picks its cluster the same way and is evaluated with it directly (IFCA)
  or after the protocol's fine-tuning (IFCA-FT).

By default the k models are initialised independently (the harness's fix of the code's
warm-start defect, docs/papers/cafeme.md): see :meth:`IFCA.init_server`. Switches:

* ``shared_clusters``: the k models are **one** model, as in the authors' code, whose
  ``[args["model"] for _ in range(k)]`` holds k references to one object: every client's k losses
  tie, it picks cluster 0, and the server averages every upload into that one model. Published
  IFCA / IFCA-FT are therefore uniform FedAvg with IFCA's local training (issue 11, item 1);
  the ``code_shared_init`` profiles turn it on.
* ``weight_sharing``: the code's "IFCA with weights sharing" (``train_ifca(weight_sharing=True)``,
  not reported in the paper): after the per-cluster averages, the parameters named with
  ``shared_prefix`` (the code's ``cnn`` blocks: our ``features``, the conv trunk) are averaged over
  every upload and written into every cluster. The results-era ``main.py`` (8ef6145) trained it
  after IFCA and before Ditto, on the same shared object (a ``model.warm_start`` stage).
"""
from __future__ import annotations

import copy
import hashlib
from dataclasses import dataclass
from typing import Annotated

import torch
import torch.nn.functional as F
from torch import nn

from pfl_core.algorithms import METHODS
from pfl_core.algorithms.base import Weighting
from pfl_core.engine.contract import ClientContext, ClientUpdate, ServerState
from pfl_core.algorithms.fedavg import FedAvg, FedAvgHyper
from pfl_core.algorithms._lib.round_lr import round_lr_carry
from pfl_core.fields import FINETUNE_ORDER, PositiveInt, Tune
from pfl_core.algorithms._lib.cluster_pass import SplitLogits, exact_losses, loop_losses
from pfl_core.models.per_sample import per_sample, rows_independent
from pfl_core.training import Params, average_params, forward, model_params


@dataclass
class IFCAHyper(FedAvgHyper):
    """IFCA's local training is FedAvg's (``lr`` 0.001, ``local_epochs`` S = 5: code ``lr_outer``
    and ``adapt_steps`` epochs; FEMNIST S = 8)."""

    weighting: Weighting = "uniform"
    """Per-cluster aggregation: ``uniform`` = plain mean over the clients that chose the cluster
    (CAFeMe code ``aggregate_model_params``); ``samples`` = weighted by train samples."""
    num_clusters: Annotated[PositiveInt, Tune(2, 8, order=FINETUNE_ORDER + 1)] = 4
    """k, number of cluster models (CAFeMe code ``n_models_ifca``: RMNIST 4, CIFAR-10 3,
    FEMNIST 2, Meta-Dataset 8)."""
    init_seed_offset: int = 0
    """Salt of the re-initialisation seed of clusters 1..k-1 (harness choice; see
    :meth:`IFCA.init_server`). Changing it draws another set of independent initialisations."""
    shared_clusters: bool = False
    """True: the k cluster models are one shared model (the CAFeMe code's k references to one
    object, docs/papers/cafeme.md; = uniform FedAvg with IFCA's local training), so ``num_clusters`` plays
    no role. False: k independently initialised models (the IFCA paper; harness default)."""
    weight_sharing: bool = False
    """True: after the per-cluster averages, average the ``shared_prefix`` parameters over every
    upload and write them into every cluster (CAFeMe code ``train_ifca(weight_sharing=True)``)."""
    shared_prefix: str = "features."
    """Parameters shared across clusters with ``weight_sharing`` (the code's ``cnn`` blocks = the
    conv trunk ``features`` of the CAFeMe base models)."""

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.num_clusters < 1:
            raise ValueError(f"num_clusters must be >= 1, got {self.num_clusters}")


@dataclass
class ClusterUpdate(ClientUpdate):
    """A client's upload plus the index of the cluster model it trained."""

    cluster: int = 0


def params_fingerprint(params: Params) -> bytes:
    """SHA-256 of the parameter names and values (on CPU): a deterministic function of the run's
    model initialisation, hence of the run seed."""
    digest = hashlib.sha256()
    for name in sorted(params):
        digest.update(name.encode())
        digest.update(params[name].detach().to("cpu", torch.float64).contiguous().numpy().tobytes())
    return digest.digest()


def reinitialised_params(model: nn.Module, seed: int) -> Params:
    """Fresh PyTorch-default parameters for ``model``'s architecture, drawn with ``seed``.

    A CPU deep copy of the template has ``reset_parameters()`` called on every submodule that has
    one, under a forked CPU RNG (the global RNG is left untouched). Every parameter must belong to
    such a submodule, otherwise it could not be re-drawn and an error is raised.
    """
    fresh = copy.deepcopy(model).to("cpu")
    covered: set[str] = set()
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        for prefix, module in fresh.named_modules():
            if hasattr(module, "reset_parameters"):
                module.reset_parameters()
                covered |= {f"{prefix}.{n}" if prefix else n for n, _ in module.named_parameters(recurse=False)}
    missing = sorted(set(dict(fresh.named_parameters())) - covered)
    if missing:
        raise ValueError(f"cannot re-initialise parameters {missing}: their modules have no reset_parameters()")
    return model_params(fresh)


def cluster_losses(model: nn.Module, clusters: list[Params], client: ClientContext,
                   cache: SplitLogits | None = None) -> torch.Tensor:
    """Summed per-batch mean CE of every cluster over one pass of the client's train split
    (code ``compute_best_model``); a k-vector kept on the device. Three ways, by the model:

    * samples do not interact (:func:`~pfl_core.models.per_sample.per_sample`): one forward per
      cluster (:func:`one_pass_losses`: the same sums up to float rounding);
    * rows independent otherwise (:func:`~pfl_core.models.per_sample.rows_independent`, e.g. CGPFL's
      CIFAR-10 CNN with the project's max-pool): the per-batch loop's numbers bit for bit from
      chunked forwards, the per-row logits kept in ``cache`` for the next pass over the same cluster
      tensors (:func:`~pfl_core.algorithms._lib.cluster_pass.exact_losses`; a shape whose check
      fails, and a dataset with an ``inputs`` map, take the loop);
    * others (BatchNorm, Dropout): batch by batch (:func:`~pfl_core.algorithms._lib.cluster_pass.loop_losses`).
    """
    index = client.epoch_index()
    with torch.no_grad():
        if index and per_sample(model):
            x, y = client.dataset.batch(torch.cat(index))
            sizes = [int(i.numel()) for i in index]
            return torch.stack([one_pass_losses(model, params, x, y, sizes) for params in clusters])
        if index and rows_independent(model):
            losses = exact_losses(model, clusters, client.dataset, client.streams["train"].index, index,
                                  SplitLogits() if cache is None else cache)
            if losses is not None:
                return losses
        return loop_losses(model, clusters, [client.dataset.batch(i) for i in index])


def one_pass_losses(model: nn.Module, params: Params, x: torch.Tensor, y: torch.Tensor, sizes: list[int]
                    ) -> torch.Tensor:
    """Sum over consecutive batches of ``sizes`` rows of (x, y) of each batch's mean CE, from one
    forward of all rows (a harness speed-up of the per-batch loop: one call instead of one per batch)."""
    losses = F.cross_entropy(forward(model, params, x), y, reduction="none")
    counts = torch.tensor(sizes)  # the batch of every row, built on the host: no device read
    batch_of = torch.repeat_interleave(torch.arange(len(sizes)), counts).to(losses.device)
    counts = counts.to(losses.device)
    sums = torch.zeros(len(sizes), dtype=losses.dtype, device=losses.device).index_add_(0, batch_of, losses)
    return (sums / counts).sum()


@METHODS.register("ifca")
class IFCA(FedAvg):
    """IFCA without fine-tuning at evaluation (the chosen cluster is evaluated directly).

    Server state: ``{"clusters": [k parameter dicts], "params": clusters[0]}``; ``params`` is only
    a default for code that expects one global model.
    """

    hyper_class = IFCAHyper
    keeps_bn_state = False  # cluster models only: FedAvg's BN state is not carried

    def init_server(self, params: Params) -> ServerState:
        """Cluster 0 is the run's initial model; cluster j >= 1 is re-drawn with PyTorch's default
        initialisation (:func:`reinitialised_params`) under the seed
        ``sha256(fingerprint(params), init_seed_offset, j)``. The initial model already depends only
        on the run seed (its "init" stream), so the k initialisations are reproducible, distinct,
        and change with the seed."""
        if self.hp.shared_clusters:
            return {"params": params, "clusters": [params]}
        fingerprint = params_fingerprint(params)
        device = next(iter(params.values())).device
        clusters = [params]
        for j in range(1, self.hp.num_clusters):
            key = hashlib.sha256(fingerprint + f"ifca:{self.hp.init_seed_offset}:{j}".encode()).digest()
            seed = int.from_bytes(key[:8], "little") >> 1
            clusters.append({k: v.to(device) for k, v in reinitialised_params(self.model, seed).items()})
        return {"params": clusters[0], "clusters": clusters}

    @classmethod
    def mechanism(cls, hp: IFCAHyper) -> str:
        """How this configuration's cluster models come about, for the report."""
        if hp.shared_clusters:
            how = "IFCA: one shared model (the code's k references to one object = uniform FedAvg)"
        else:
            how = f"IFCA: {hp.num_clusters} independently initialised cluster models"
        return how + (f", weight sharing of {hp.shared_prefix}*" if hp.weight_sharing else "")

    @property
    def split_logits(self) -> SplitLogits:
        """The per-row logits of the current clusters, per client split (:func:`cluster_losses`): an
        evaluation's choice leaves them for the next round's, which sees the same cluster tensors."""
        if "_split_logits" not in self.__dict__:
            self._split_logits = SplitLogits()
        return self._split_logits

    def choose_cluster(self, server: ServerState, client: ClientContext) -> int:
        """argmin of :func:`cluster_losses` (one host sync per client: the index picks a model);
        a single (shared) model needs no loss pass (the code's k equal losses pick index 0)."""
        if len(server["clusters"]) == 1:
            client.state["cluster"] = 0
            return 0
        choice = int(torch.argmin(cluster_losses(self.model, server["clusters"], client, self.split_logits)))
        client.state["cluster"] = choice
        return choice

    def carry_in(self, server: ServerState, client: ClientContext, round_idx: int,
                 drawn: dict | None = None) -> dict:
        """FedAvg's local SGD (its plan and update) from the chosen cluster's model, at the round's
        lr (a scheduled lr, :mod:`~pfl_core.algorithms._lib.round_lr`)."""
        params = server["clusters"][self.choose_cluster(server, client)]
        return {"params": params, **round_lr_carry(self.hp, round_idx, next(iter(params.values())))}

    def carry_out(self, server: ServerState, client: ClientContext, carry, loss) -> ClientUpdate:
        return ClusterUpdate(carry["params"], client.num_samples("train"), loss, cluster=client.state["cluster"])

    def aggregate(self, server: ServerState, updates: list[ClientUpdate]) -> ServerState:
        """Average each cluster over the clients that chose it; unchosen clusters stay as they are."""
        clusters = list(server["clusters"])
        for j in range(len(clusters)):
            chosen = [u for u in updates if u.params is not None and u.cluster == j]
            if chosen:
                weights = self.aggregation_weights(chosen)
                clusters[j] = average_params([u.params for u in chosen], weights)
        if self.hp.weight_sharing:
            clusters = self.share_weights(clusters, updates)
        return {**server, "params": clusters[0], "clusters": clusters}

    def share_weights(self, clusters: list[Params], updates: list[ClientUpdate]) -> list[Params]:
        """Every cluster gets the average over all uploads of the ``shared_prefix`` parameters."""
        uploads = [u for u in updates if u.params is not None]
        if not uploads:
            return clusters
        shared = average_params([u.params for u in uploads], self.aggregation_weights(uploads))
        names = [k for k in shared if k.startswith(self.hp.shared_prefix)]
        if not names:
            raise ValueError(f"ifca weight_sharing: no parameter starts with shared_prefix "
                             f"{self.hp.shared_prefix!r}; parameters: {sorted(shared)[:6]}...")
        return [{**params, **{k: shared[k] for k in names}} for params in clusters]

    def predictor(self, server: ServerState, client: ClientContext) -> Params:
        """The cluster with the smallest summed loss over the client's train split (at test
        time the cluster is chosen the same way; docs/papers/cafeme.md)."""
        return server["clusters"][self.choose_cluster(server, client)]


@METHODS.register("ifca_ft")
class IFCAFT(IFCA):
    """IFCA whose chosen cluster model is fine-tuned by the evaluation protocol (IFCA-FT)."""

    finetune_at_eval = True
