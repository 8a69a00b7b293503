"""MetaVers (Lim, Ha, Yoon; WACV 2024) as the authors' code trains it (docs/papers/metavers.md).

Each round, every sampled client draws a fresh episode from its train split
(:mod:`pfl_core.algorithms._lib.episodes`: N = its classes, K shots, Q queries, the "R*" fallback) and computes
on the global embedding network f (:mod:`pfl_core.algorithms._lib.margin_losses`):

* L_S, the prototypical cross-entropy with squared distances (Eq. 2);
* d, its local margin: the mean over class pairs of the distance between class means over the
  whole episode (Eq. 3; a second forward pass in the code, gradient kept);
* the margin m = max(d, m_global) + ``margin_hp`` ("select": gradient through d when
  d >= m_global), and L_T, the centroid triplet loss with squared distances (Eq. 4);
* L = gamma L_S + (1 - gamma) L_T in rounds tau > W, L = L_S before (``trainer.py:401-406``).

Clients upload gradients (FedSGD). The server sums them, scales by 1/|sampled|
(``trainer.py:424-427``) and takes one Adam step (lr 1e-3; coupled weight decay 1e-3 for
CIFAR-10), its Adam state persisting across rounds. It keeps every active client's detached d
(``d != 0``, as the code); after each round tau >= W, m_global = the mean of the last
``margin_window`` (250 = 50 rounds x 5 clients) values; before, ``initial_margin`` (0.0).

Every code-vs-paper difference (docs/papers/metavers.md) is a switch, off by default (the published
numbers came from the code): ``update`` (Eq. 5-6), ``global_margin`` (Eq. 7), ``w_role``,
``margin_scale`` (Eq. 3), ``squared``, ``triplet_negative`` (Eq. 4), ``triplet_reduction``,
``margin_grad``. Ablations: ``loss`` (Table 5;
W forced to -1 for ``ce``/``triplet``, ``trainer.py:111-112``) and ``margin_from`` (fixed margin).
The novel-class trainer (docs/papers/metavers.md) is the same method with ``margin_update:
client``, ``first_round: 1``, ``ce_forward: joint``, ``margin_window: 500``, ``lr_step: 5000``.

BatchNorm running statistics (models with BN state, ``conv4``/``conv4_frl``): the code trains one
model in train mode through a round, so every client's passes move the running statistics in
client order: ``meta_update_frl`` (one pass over the episode) and ``triplet_update_frl`` (a second
pass over the same images with the same parameters, hence the same batch statistics) in rounds
tau <= W, and for clients of two or more classes after (``trainer_novel_class.py:200-230``).
Clients return their pass's batch statistics; the server replays the updates in the sampled order
(:mod:`pfl_core.algorithms._lib.bn_passes`) and evaluation embeds with them in eval mode. Only ``ce_forward: joint``
(the novel-class trainer) is implemented with BN state.

Prediction is by prototypes: the predictor is the global embedding network, evaluated by the
``proto`` protocol (a client's prototypes from its whole train split). :meth:`MetaVers.logits`
is that classifier for the generic protocols (see its docstring).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Annotated, Literal

import torch
from torch import nn

from pfl_core.algorithms import METHODS
from pfl_core.algorithms.base import Algorithm
from pfl_core.engine.contract import ClientContext, ClientUpdate, ServerState
from pfl_core.engine.plans import Drawn
from pfl_core.fields import ADAM_LR, HyperParams, Tune
from pfl_core.fields import NonNegativeFloat, NonNegativeInt, PositiveFloat, PositiveInt, Probability
from pfl_core.algorithms._lib.bn_passes import pass_statistics, replay_passes
from pfl_core.algorithms._lib.episodes import Episode, class_pools, draw_episode
from pfl_core.algorithms._lib.margin_losses import centroid_triplet, distances, local_margin, prototypical_ce
from pfl_core.algorithms._lib.optim import init_optimizer_state, optimizer_step
from pfl_core.models.kld_bn import bn_mode, has_bn_state
from pfl_core.prototypes import class_prototypes
from pfl_core.training import Params, embed, initial_bn_state, value_and_grad


@dataclass
class MetaVersHyper(HyperParams):
    # -- episodes (docs/papers/metavers.md) ------------------------------------------------
    shot: PositiveInt = 5
    """K, support images per class (code default 5; README: CIFAR-10 20, CIFAR-100 10 or 3 at
    U = 500 (``shot_500``), CINIC-10 25 or 20 at U = 500)."""
    query: NonNegativeInt = 15
    """Q, query images per class (code default 15; README: 30, 20, 35 (CINIC-10 U = 500: 30))."""
    full_batch: bool = False
    """Always train on one shuffled train batch of up to ``fallback_batch`` images instead of an
    episode (CIFAR-100 with 500 clients, ``trainer.py:316-317``)."""
    fallback_batch: PositiveInt = 450
    """Size of that batch (the code's train loaders: 450)."""
    # -- losses (docs/papers/metavers.md) ----------------------------------------------------------------
    gamma: Annotated[Probability, Tune(0.0, 1.0, order=1)] = 0.5
    """L = gamma L_S + (1 - gamma) L_T after the warm-up (code default 0.5; README 0.2-0.6; the
    novel-class trainer hard-codes 0.5)."""
    warmup: int = 50
    """W (``--w``): rounds tau <= W train on L_S only and the global margin is averaged from round
    W on (code). Forced to -1 when ``loss`` is not ``hybrid`` (``trainer.py:111-112``)."""
    loss: Literal["hybrid", "ce", "triplet"] = "hybrid"
    """``hybrid`` (MetaVers), ``ce`` (L_S only, Table 5 "Only CE"), ``triplet`` (L_T only)."""
    margin_from: Literal["select", "fixed"] = "select"
    """``select``: m = max(d, m_global) + margin_hp (code ``--d_from select``); ``fixed``:
    m = fixed_margin + margin_hp, no gradient (``--d_from margin``, Table 5 "Only Triplet")."""
    fixed_margin: NonNegativeFloat = 0.75
    """The fixed margin (paper Table 5: 0.75; the README example uses 3.0; docs/papers/metavers.md)."""
    margin_hp: float = 0.0
    """Added to the margin (code ``--margin_hp``, 0)."""
    initial_margin: float = 0.0
    """m_global before the first average (code ``--margin``, 0.0)."""
    margin_window: PositiveInt = 250
    """The global margin averages the last this many local margins (the code: 50 rounds x the
    clients per round; 250 for the benchmark, 500 for the novel-class trainer)."""
    # -- server ----------------------------------------------------------------------------------
    lr: Annotated[PositiveFloat, ADAM_LR] = 0.001
    """Server Adam learning rate (code 1e-3)."""
    weight_decay: NonNegativeFloat = 0.0
    """Coupled L2 of the server Adam (``torch.optim.Adam(weight_decay=...)``, not AdamW): 1e-3 for
    CIFAR-10 (``--optimizer 1``), 0 otherwise."""
    lr_step: NonNegativeInt = 0
    """StepLR period in rounds (0: none, the benchmark; 5000 in the novel-class trainer)."""
    lr_gamma: PositiveFloat = 0.5
    """StepLR factor (novel-class trainer: 0.5)."""
    # -- the novel-class trainer (docs/papers/metavers.md) ---------------------------------------
    margin_update: Literal["round", "client"] = "round"
    """``round``: m_global averaged once after each round tau >= W (``trainer.py:433-437``);
    ``client``: in rounds tau > W, re-averaged before every client, over a list that already holds
    the d of the round's earlier clients (``trainer_novel_class.py:203-214``)."""
    first_round: Literal[0, 1] = 0
    """The code's index tau of the first round: 0 (``trainer.py``) or 1 (the novel-class trainer),
    which shifts the warm-up by one round."""
    ce_forward: Literal["split", "joint"] = "split"
    """With batch statistics (BatchNorm) only: L_S embeds support and query in two passes
    (``split``, ``util.meta_update``) or the whole episode in one (``joint``,
    ``meta_update_frl``). Without BatchNorm all passes give the same embeddings and one is run."""
    # -- code-vs-paper switches (docs/papers/metavers.md), off by default -----------------
    update: Literal["fedsgd_adam", "local_sgd"] = "fedsgd_adam"
    """``fedsgd_adam``: gradients averaged, one server Adam step (the code);
    ``local_sgd``: each client takes theta_i = theta - local_lr * grad L and the server averages
    the theta_i (paper Eq. 5-6)."""
    local_lr: PositiveFloat = 0.001
    """eta of Eq. 5 (``update: local_sgd``; not given in the paper's main text)."""
    global_margin: Literal["window", "recursive"] = "window"
    """``window``: the mean of the last ``margin_window`` local margins (the code);
    ``recursive``: Eq. 7, m^(tau+1) = (sum of the past W-1 global margins + this round's mean d) / W
    (missing past values count as ``initial_margin``)."""
    w_role: Literal["warmup", "interval"] = "warmup"
    """``warmup``: W is an L_S-only warm-up and the start of margin averaging (the code);
    ``interval``: no warm-up (mixed loss from the first round, margin averaged after every round)
    and the window is the last W rounds' margins (the paper's averaging interval)."""
    margin_scale: Literal["pair_mean", "eq3"] = "pair_mean"
    """``pair_mean``: d = mean over class pairs (the code); ``eq3``: x N/(N-1), the paper's
    1/(N-1)^2 sum over ordered pairs."""
    squared: bool = True
    """Squared distances in the L_S logits and the triplet hinge (the code); False:
    Euclidean (paper). The margin d is Euclidean either way."""
    triplet_negative: Literal["anchor", "positive"] = "anchor"
    """Negative term d(a_c, n) (the code) or d(p, n) (paper Eq. 4)."""
    triplet_reduction: Literal["mean", "sum"] = "mean"
    """L_T: mean over pairs then classes (the code) or the sum over all (paper)."""
    margin_grad: bool = True
    """Gradient flows through m = d when d >= m_global (the code); False: m detached."""

    def __post_init__(self) -> None:
        if self.margin_update == "client" and self.global_margin == "recursive":
            raise ValueError("metavers: global_margin 'recursive' (Eq. 7) is a per-round rule; "
                             "it cannot be combined with margin_update 'client'")


@dataclass
class MetaVersUpdate(ClientUpdate):
    """A client's upload: its gradient (``params``; parameters with ``update: local_sgd``), its
    detached local margin d, and whether the server collects d (loss not ``ce``)."""

    margin: torch.Tensor = field(default_factory=lambda: torch.zeros(()))
    collects: bool = False
    bn_stats: dict = field(default_factory=dict)
    """Batch statistics of the client's episode pass (models with BN state; :mod:`pfl_core.algorithms._lib.bn_passes`)."""
    bn_passes: int = 0
    """How many train-mode passes the code runs on that episode (1 or 2)."""


def _has_batch_statistics(model: nn.Module) -> bool:
    return any(isinstance(m, nn.modules.batchnorm._NormBase) for m in model.modules())


@METHODS.register("metavers")
class MetaVers(Algorithm):
    """MetaVers (module docstring). Server state: ``params``, ``adam``, ``margins`` (recent local
    margins), ``m_global``, ``global_history`` (Eq. 7), ``rounds`` (aggregated so far)."""

    hyper_class = MetaVersHyper
    keeps_bn_state = True
    eval_batched_fallback = ("prototype logits need each client's train split, read on the host "
                             "(the proto protocol evaluates MetaVers batched)")

    def __init__(self, model, hp):
        super().__init__(model, hp)
        self.batch_statistics = _has_batch_statistics(model)
        self.bn_state = has_bn_state(model)
        if self.bn_state and hp.ce_forward != "joint":
            raise ValueError("metavers: a model with BatchNorm running statistics is implemented for "
                             "ce_forward 'joint' only (the novel-class trainer's passes)")
        self._ways: dict[int, int] = {}
        self._pools: dict[int, list[torch.Tensor]] = {}
        self._round_margins: list[float] = []  # margin_update=client: this round's d so far
        self._prototype_cache: tuple | None = None  # (params, cid, prototypes, present) for logits

    # -- schedule -----------------------------------------------------------------------------------
    @property
    def w(self) -> int:
        """The effective W: -1 without warm-up (single-loss ablations, paper ``interval`` role)."""
        return -1 if self.hp.loss != "hybrid" or self.hp.w_role == "interval" else self.hp.warmup

    def tau(self, round_idx: int) -> int:
        return round_idx + self.hp.first_round

    def loss_weights(self, tau: int) -> tuple[float, float]:
        """(weight of L_S, weight of L_T) in round tau."""
        if self.hp.loss == "ce":
            return 1.0, 0.0
        if self.hp.loss == "triplet":
            return 0.0, 1.0
        return (self.hp.gamma, 1.0 - self.hp.gamma) if tau > self.w else (1.0, 0.0)

    # -- server ---------------------------------------------------------------------------------------
    def init_server(self, params: Params) -> ServerState:
        server = {"params": params, "adam": init_optimizer_state("adam", params), "margins": [],
                  "m_global": float(self.hp.initial_margin), "global_history": [], "rounds": 0,
                  "round_stats": {}}
        if self.bn_state:
            server["buffers"] = initial_bn_state(self.model)
        return server

    def window(self, clients_per_round: int) -> int:
        """How many local margins the global margin averages (``w_role``)."""
        if self.hp.w_role == "interval":
            return max(self.hp.warmup, 1) * clients_per_round
        return self.hp.margin_window

    def _averaged(self, margins: list[float], history: list[float], fresh: list[float], window: int,
                  previous: float) -> float:
        """The new m_global: the mean of the last ``window`` kept local margins, or Eq. 7
        (``recursive``): the global margins in effect in the past W-1 rounds (``history``; missing
        ones count as ``initial_margin``) plus the mean of this round's ``fresh`` margins, over W.
        ``previous`` when there is nothing to average."""
        if self.hp.global_margin == "window":
            recent = margins[-window:]
            return sum(recent) / len(recent) if recent else previous
        span = max(self.hp.warmup, 1)
        past = history[len(history) - (span - 1):] if span > 1 else []
        past = [self.hp.initial_margin] * (span - 1 - len(past)) + past
        current = sum(fresh) / len(fresh) if fresh else previous
        return (sum(past) + current) / span

    def aggregate(self, server: ServerState, updates: list[ClientUpdate]) -> ServerState:
        """Sum the uploads and scale by 1/|sampled|; one server Adam step (``fedsgd_adam``) or the
        mean of the uploaded parameters (``local_sgd``); then collect the round's margins."""
        params, adam = server["params"], server["adam"]
        scale = 1.0 / len(updates)
        mean = {k: sum(u.params[k] for u in updates) * scale for k in params}
        if self.hp.update == "fedsgd_adam":
            decay = self.hp.lr_gamma ** (server["rounds"] // self.hp.lr_step) if self.hp.lr_step else 1.0
            params, adam = optimizer_step("adam", params, mean, adam, self.hp.lr * decay, self.hp.weight_decay)
        else:
            params = mean
        tau = self.tau(server["rounds"])
        if self.hp.margin_update == "client":
            fresh, self._round_margins = self._round_margins, []
        else:
            values = torch.stack([u.margin for u in updates]).tolist()  # one host read per round
            fresh = [v for v, u in zip(values, updates) if u.collects and v != 0]  # the code's d != 0
        margins = (server["margins"] + fresh)[-self.window(len(updates)):]
        history = server["global_history"]
        m_global = server["m_global"]
        if self.hp.margin_update == "client":
            m_global = self._m_global_for_client(m_global, margins, tau + 1)  # what the next client reads
        elif tau >= self.w:
            m_global = self._averaged(margins, history, fresh, self.window(len(updates)), m_global)
        history = (history + [server["m_global"]])[-max(self.hp.warmup, 1):]
        stats = {"m_global": m_global}
        if fresh:
            stats["local_margin"] = sum(fresh) / len(fresh)
        new = {"params": params, "adam": adam, "margins": margins, "m_global": m_global,
               "global_history": history, "rounds": server["rounds"] + 1, "round_stats": stats}
        if self.bn_state:
            buffers = server["buffers"]
            for u in updates:  # the code's client order
                buffers = replay_passes(self.model, buffers, u.bn_stats, u.bn_passes)
            new["buffers"] = buffers
        return new

    def _m_global_for_client(self, previous: float, margins: list[float], tau: int) -> float:
        """``margin_update: client``: in rounds tau > W the mean of the last ``margin_window``
        values of ``margins`` (recomputed before every client of the round); else ``previous``."""
        if tau <= self.w:
            return previous
        return self._averaged(margins, [], [], self.hp.margin_window, previous)

    def round_metrics(self, server: ServerState) -> dict[str, float]:
        """``m_global`` after the round and ``local_margin``, the mean d the server collected."""
        return dict(server.get("round_stats", {}))

    def run_info(self, server: ServerState) -> dict:
        return {"metavers_m_global": server["m_global"], "metavers_margins_kept": len(server["margins"])}

    # -- the client program ---------------------------------------------------------------------------
    def episode(self, client: ClientContext) -> Episode:
        """A fresh episode of ``client`` (its class pools are indexed once per run)."""
        pools = self._pools.get(client.cid)
        if pools is None:
            index = client.client.splits["train"]
            pools = self._pools[client.cid] = class_pools(client.dataset.y[index], index)
        episode = draw_episode(pools, self.hp.shot, self.hp.query, client.streams["train"].generator,
                               self.hp.fallback_batch, self.hp.full_batch, where=f"metavers client {client.cid}: ")
        device = client.client.splits["train"].device
        return Episode(episode.support.to(device), episode.query.to(device), episode.ways, episode.fallback)

    def carry_in(self, server: ServerState, client: ClientContext, round_idx: int,
                 drawn: dict | None = None) -> dict:
        params = server["params"]
        like = next(iter(params.values()))
        tau = self.tau(round_idx)
        m_global = server["m_global"]
        if self.hp.margin_update == "client":
            m_global = self._client_margin(server, client, tau, drawn["episode"])
        w_s, w_t = self.loss_weights(tau)
        scalar = lambda v: torch.tensor(v, dtype=like.dtype, device=like.device)
        return {"params": params, "m_global": scalar(m_global), "w_s": scalar(w_s), "w_t": scalar(w_t)}

    def _client_margin(self, server: ServerState, client: ClientContext, tau: int, episode: Episode) -> float:
        """``margin_update: client``: read m_global over the kept margins plus the round's earlier
        clients' d, then add this client's d (computed here, without gradient, on the round's
        episode and the received parameters) to the round's list."""
        margins = (server["margins"] + self._round_margins)[-self.hp.margin_window:]
        m_global = self._m_global_for_client(server["m_global"], margins, tau)
        if episode.ways >= 2 and self.hp.loss != "ce":
            with torch.no_grad():
                x, y = client.dataset.batch(torch.cat([episode.support, episode.query]))
                d = local_margin(embed(self.model, server["params"], x), self._onehot(y, episode.ways, x.dtype),
                                 self.hp.margin_scale == "eq3")
            value = float(d)
            if value != 0:
                self._round_margins.append(value)
        return m_global

    def draw(self, client: ClientContext, round_idx: int) -> Drawn:
        """The round's episode: its support and query batches, and the episode itself for
        ``carry_in`` (``margin_update: client`` computes the client's margin on it)."""
        episode = self.episode(client)
        self._ways[client.cid] = episode.ways
        return Drawn({"support": [episode.support], "query": [episode.query]}, {"episode": episode})

    def _onehot(self, labels: torch.Tensor, ways: int, dtype: torch.dtype,
                support: torch.Tensor | None = None) -> torch.Tensor:
        """[rows, ways] class membership of ``labels`` against the classes of the K-blocks of the
        ``support`` labels (default: ``labels`` starts with the support blocks)."""
        support = labels[: ways * self.hp.shot] if support is None else support
        classes = support.reshape(ways, self.hp.shot)[:, 0]
        return (labels.unsqueeze(1) == classes.unsqueeze(0)).to(dtype)

    def _embeddings(self, params: Params, xs: torch.Tensor, xq: torch.Tensor):
        """(support, query, whole episode) embeddings, with the code's forward passes where they
        differ (batch statistics; ``ce_forward``), else one pass."""
        episode = embed(self.model, params, torch.cat([xs, xq]))
        if self.batch_statistics and self.hp.ce_forward == "split":
            return embed(self.model, params, xs), embed(self.model, params, xq), episode
        return episode[: len(xs)], episode[len(xs):], episode

    def episode_loss(self, params: Params, xs, ys, xq, yq, m_global, w_s, w_t):
        """(L, d) of one episode (module docstring)."""
        hp = self.hp
        ways = ys.shape[0] // hp.shot
        support_onehot = self._onehot(ys, ways, xs.dtype)
        query_onehot = self._onehot(yq, ways, xs.dtype, ys)
        es, eq, episode = self._embeddings(params, xs, xq)
        onehot = torch.cat([support_onehot, query_onehot])
        d = local_margin(episode, onehot, hp.margin_scale == "eq3")
        loss = episode.sum() * 0.0
        if hp.loss != "triplet":
            loss = loss + w_s * prototypical_ce(es, eq, query_onehot, hp.shot, hp.squared)
        if hp.loss != "ce":
            if hp.margin_from == "fixed":
                margin = torch.full_like(d, hp.fixed_margin)
            else:
                local = d if hp.margin_grad else d.detach()
                margin = torch.where(d >= m_global, local, m_global)
            triplet = centroid_triplet(episode, onehot, margin + hp.margin_hp, hp.squared,
                                       hp.triplet_negative, hp.triplet_reduction)
            loss = loss + w_t * triplet
        return loss, d

    def local_update(self, carry, batches, masks):
        (xs, ys), (xq, yq) = batches["support"], batches["query"]
        grads, (loss, (d, stats)) = value_and_grad(self._loss_and_statistics, carry["params"], xs[0], ys[0], xq[0],
                                                   yq[0], carry["m_global"], carry["w_s"], carry["w_t"], has_aux=True)
        if self.hp.update == "local_sgd":
            upload = {k: p - self.hp.local_lr * grads[k] for k, p in carry["params"].items()}
        else:
            upload = grads
        return {"upload": upload, "margin": d, **({"bn_stats": stats} if self.bn_state else {})}, loss

    def _loss_and_statistics(self, params: Params, *args):
        """(L, (d, batch statistics of the episode pass)); no statistics without BN state."""
        if not self.bn_state:
            loss, d = self.episode_loss(params, *args)
            return loss, (d, {})
        with bn_mode(self.model, "train"):
            loss, d = self.episode_loss(params, *args)
            return loss, (d, pass_statistics(self.model))

    def bn_passes(self, ways: int, tau: int) -> int:
        """Train-mode passes of the code on one client's episode: ``meta_update_frl`` always, and
        ``triplet_update_frl`` in rounds tau <= W or for two or more classes
        (``trainer_novel_class.py:200-230``)."""
        return 1 + int(tau <= self.w or ways >= 2)

    def carry_out(self, server: ServerState, client: ClientContext, carry, loss) -> ClientUpdate:
        """The upload and d; the server collects d unless the loss is ``ce`` (the code computes no d
        there) or d is 0 (a one-class episode has none)."""
        passes = self.bn_passes(self._ways.pop(client.cid), self.tau(server["rounds"])) if self.bn_state else 0
        return MetaVersUpdate(carry["upload"], client.num_samples("train"), loss, carry["margin"],
                              self.hp.loss != "ce", carry.get("bn_stats", {}), passes)

    # -- prediction -------------------------------------------------------------------------------------
    def logits(self, params: Params, x: torch.Tensor, client: ClientContext) -> torch.Tensor:
        """Prototype logits -||f(x) - c_k||^2, c_k the mean embedding of class k over the client's
        whole train split (``proto_eval``). MetaVers has no classifier, so this needs the client
        (sequential evaluation only). A class absent from the train split gets a logit 1e3 below
        the row's lowest real one: never predicted, its loss finite."""
        if client is None:
            raise ValueError("metavers classifies by prototypes of each client's train split: evaluate it "
                             "with the 'proto' protocol or sequentially (logits needs the client)")
        prototypes, present = self._train_prototypes(params, client)
        logits = -distances(embed(self.model, params, x), prototypes, squared=True)
        floor = logits.masked_fill(~present, float("inf")).amin(1, keepdim=True) - 1e3
        return torch.where(present, logits, floor)

    def _train_prototypes(self, params: Params, client: ClientContext) -> tuple[torch.Tensor, torch.Tensor]:
        """(prototypes [classes, d], bool mask of the classes present) of the client's train split,
        computed once per (parameters, client) while its evaluation batches are scored."""
        cached = self._prototype_cache
        if cached is not None and cached[0] is params and cached[1] == client.cid:
            return cached[2], cached[3]
        train_x, train_y = client.dataset.batch(client.client.splits["train"])
        classes = client.dataset.num_classes
        with torch.no_grad():
            prototypes = class_prototypes(embed(self.model, params, train_x), train_y, classes)
        present = torch.bincount(train_y, minlength=classes) > 0
        self._prototype_cache = (params, client.cid, prototypes, present)
        return prototypes, present
