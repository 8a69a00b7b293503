"""pFedHN (Shamsian et al., ICML 2021): a server hypernetwork generates each client's model.

The server holds a hypernetwork h(v_i; phi): a learned embedding v_i per client, an MLP, and one
linear head per parameter of the *target* network (the method's model, e.g. ``lenet``: conv1,
conv2, fc1, fc2, fc3, shapes read from the model). A round of the paper's Algorithm 1 (and of the
code ``experiments/pfedhn/trainer.py``, AvivSham/pFedHN), for each sampled client i:

1. theta_i = h(v_i; phi) (server side, :meth:`PFedHN.carry_in`);
2. the client trains theta_i for ``inner_steps`` SGD steps (momentum, weight decay, gradient norm
   clipped) to theta_tilde_i (:meth:`PFedHN.local_update`, the client program);
3. the server's gradient of (phi, v_i) is the vector-Jacobian product
   (d theta_i / d phi)^T (theta_i - theta_tilde_i) (:meth:`PFedHN.carry_out`, the upload), and
   the server takes one clipped SGD step with momentum and weight decay (:meth:`PFedHN.aggregate`).

The code samples **one client per round** (``random.choice``; docs/papers/metavers.md):
that is this method's default (``clients_per_round``), whatever ``federation.clients_per_round``
says. With several clients per round their VJPs are averaged (the code has no such case). The
code trains for 5000 such rounds (``--num-steps``); the round count is the suite's.
Each client predicts with its generated weights h(v_i; phi). Clients that never trained keep their
initial random embedding (the paper's novel-client fine-tuning of v is not implemented).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Annotated, Literal

import torch
from torch import nn
from torch.func import functional_call

from pfl_core.algorithms import METHODS
from pfl_core.algorithms.base import Algorithm
from pfl_core.engine.contract import ClientContext, ClientUpdate, ServerState
from pfl_core.fields import HyperParams, SGD_LR, Tune
from pfl_core.fields import NonNegativeFloat, NonNegativeInt, PositiveFloat, PositiveInt
from pfl_core.algorithms._lib.optim import clip_grad_norm, sgd_momentum_step
from pfl_core.training import Params, batch_loss, value_and_grad


@dataclass
class PFedHNHyper(HyperParams):
    inner_steps: Annotated[PositiveInt, Tune(1, 100, log=True, order=2)] = 50
    """k, the client's SGD steps on its generated weights per round (code ``--inner-steps`` 50)."""
    inner_lr: Annotated[PositiveFloat, SGD_LR.at(1)] = 5e-3
    """Client SGD learning rate (code ``--inner-lr`` 5e-3)."""
    inner_momentum: NonNegativeFloat = 0.9
    """Client SGD momentum (code: 0.9; a fresh optimiser every round)."""
    inner_weight_decay: NonNegativeFloat = 5e-5
    """Client SGD weight decay (code ``--inner-wd`` 5e-5)."""
    lr: Annotated[PositiveFloat, SGD_LR] = 1e-2
    """Hypernetwork SGD learning rate, embeddings included (code ``--lr`` 1e-2; ``--embed-lr``
    defaults to it)."""
    momentum: NonNegativeFloat = 0.9
    """Hypernetwork SGD momentum (code: 0.9; the moments live on the server across rounds)."""
    weight_decay: NonNegativeFloat = 1e-3
    """Hypernetwork SGD weight decay (code ``--wd`` 1e-3)."""
    grad_clip: NonNegativeFloat = 50.0
    """Gradient norm clipping of both the client steps and the hypernetwork step (code:
    ``clip_grad_norm_(..., 50)`` in both places); 0: none."""
    embed_dim: NonNegativeInt = 0
    """Client embedding size; 0: the code's automatic ``int(1 + U / 4)`` (``--embed-dim -1``) for U
    training clients."""
    hidden_dim: PositiveInt = 100
    """Width of the hypernetwork MLP (code ``--hyper-hid`` 100)."""
    n_hidden: NonNegativeInt = 3
    """Hidden Linear layers after the first, each behind a ReLU (code ``--n-hidden`` 3)."""
    clients_per_round: NonNegativeInt = 1
    """Clients sampled per round: 1 in the pFedHN code (docs/papers/metavers.md), the
    default here whatever ``federation.clients_per_round`` (5 for the rest of MetaVers' Table 2)
    says; 0 takes ``federation.clients_per_round``."""
    batch_draw: Literal["fresh_shuffle", "stream"] = "fresh_shuffle"
    """``fresh_shuffle``: each inner step takes the first batch of a new shuffle of the client's
    train split (the code's ``next(iter(train_loader))``); ``stream``: consecutive batches of the
    client's cyclic stream, as the other methods draw them."""


class HyperNetwork(nn.Module):
    """Embedding(clients, embed_dim) -> Linear(embed_dim, hidden) -> n_hidden x [ReLU,
    Linear(hidden, hidden)] -> one Linear(hidden, numel) head per target parameter, reshaped to
    its shape (the code's ``CNNHyper``, heads named after the target's parameters)."""

    def __init__(self, target_shapes: dict[str, torch.Size], num_clients: int, embed_dim: int,
                 hidden_dim: int, n_hidden: int):
        super().__init__()
        self.shapes = dict(target_shapes)
        self.embeddings = nn.Embedding(num_clients, embed_dim)
        layers: list[nn.Module] = [nn.Linear(embed_dim, hidden_dim)]
        for _ in range(n_hidden):
            layers += [nn.ReLU(), nn.Linear(hidden_dim, hidden_dim)]
        self.mlp = nn.Sequential(*layers)
        self.heads = nn.ModuleDict({self.head_name(name): nn.Linear(hidden_dim, shape.numel())
                                    for name, shape in self.shapes.items()})

    @staticmethod
    def head_name(target_name: str) -> str:
        return target_name.replace(".", "_")

    def forward(self, client: torch.Tensor) -> dict[str, torch.Tensor]:
        """The target parameters theta = h(v_client) (``client`` a 0-d index tensor)."""
        features = self.mlp(self.embeddings(client))
        return {name: self.heads[self.head_name(name)](features).view(shape)
                for name, shape in self.shapes.items()}


@METHODS.register("pfedhn")
class PFedHN(Algorithm):
    """pFedHN; server state: ``hnet`` (hypernetwork parameters), ``hnet_momentum``; no client state."""

    hyper_class = PFedHNHyper

    def __init__(self, model, hp):
        super().__init__(model, hp)
        self.hnet: HyperNetwork | None = None

    def prepare(self, fed) -> None:
        """Size the embedding table by the partition's clients (indexed by client id)."""
        embed_dim = self.hp.embed_dim or int(1 + len(fed.train_clients) / 4)
        shapes = {name: p.shape for name, p in self.model.named_parameters()}
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(self.seed)  # the hypernetwork's initialisation: the run's algorithm stream
            self.hnet = HyperNetwork(shapes, len(fed.clients), embed_dim, self.hp.hidden_dim, self.hp.n_hidden)

    def clients_per_round(self, configured: int) -> int:
        return self.hp.clients_per_round or configured

    def init_server(self, params: Params) -> ServerState:
        if self.hnet is None:
            raise RuntimeError("pfedhn: prepare(fed) must run before init_server (the federation calls it)")
        like = next(iter(params.values()))
        hnet = {k: v.detach().to(like) for k, v in self.hnet.named_parameters()}
        return {"hnet": hnet, "hnet_momentum": {k: torch.zeros_like(v) for k, v in hnet.items()}}

    def generate(self, hnet: Params, cid: int) -> Params:
        """theta_cid = h(v_cid; hnet) (differentiable in ``hnet``)."""
        index = torch.tensor(cid, device=next(iter(hnet.values())).device)
        return functional_call(self.hnet, hnet, (index,))

    # -- the client program: inner SGD on the generated weights ---------------------------------
    def carry_in(self, server: ServerState, client: ClientContext, round_idx: int,
                 drawn: dict | None = None) -> dict:
        with torch.no_grad():
            theta = self.generate(server["hnet"], client.cid)
        return {"params": theta, "momentum": {k: torch.zeros_like(v) for k, v in theta.items()}}

    def draw(self, client: ClientContext, round_idx: int):
        stream = client.streams["train"]
        take = stream.fresh_batch if self.hp.batch_draw == "fresh_shuffle" else stream.next
        return {"train": [take() for _ in range(self.hp.inner_steps)]}

    def local_update(self, carry, batches, masks):
        hp, (xs, ys) = self.hp, batches["train"]
        params, momentum, losses = carry["params"], carry["momentum"], []
        for step in range(len(xs)):
            grads, loss = value_and_grad(lambda p, x, y: batch_loss(self.model, p, x, y), params, xs[step], ys[step])
            params, momentum = sgd_momentum_step(params, clip_grad_norm(grads, hp.grad_clip), momentum,
                                                 hp.inner_lr, hp.inner_momentum, hp.inner_weight_decay)
            losses.append(loss)
        return {"params": params, "momentum": momentum}, torch.stack(losses).mean()

    def carry_out(self, server: ServerState, client: ClientContext, carry, loss) -> ClientUpdate:
        """Upload the hypernetwork gradient (d theta / d phi)^T (theta - theta_tilde)."""
        return ClientUpdate(self.hypergradient(server["hnet"], client.cid, carry["params"]),
                            client.num_samples("train"), loss)

    def hypergradient(self, hnet: Params, cid: int, trained: Params) -> Params:
        """The VJP of Algorithm 1: grad_phi = (d theta / d phi)^T (theta - theta_tilde), where
        theta = h(v_cid; hnet) and theta_tilde = ``trained``."""
        with torch.enable_grad():
            leaves = {k: v.detach().requires_grad_(True) for k, v in hnet.items()}
            theta = self.generate(leaves, cid)
            names = list(theta)
            grads = torch.autograd.grad([theta[k] for k in names], list(leaves.values()),
                                        grad_outputs=[theta[k].detach() - trained[k] for k in names],
                                        allow_unused=True)
        return {k: torch.zeros_like(v) if g is None else g for (k, v), g in zip(leaves.items(), grads)}

    def aggregate(self, server: ServerState, updates: list[ClientUpdate]) -> ServerState:
        """Mean of the uploaded hypergradients, clipped, then one SGD step with momentum."""
        grads = {k: torch.stack([u.params[k] for u in updates]).mean(0) for k in server["hnet"]}
        hnet, momentum = sgd_momentum_step(server["hnet"], clip_grad_norm(grads, self.hp.grad_clip),
                                           server["hnet_momentum"], self.hp.lr, self.hp.momentum,
                                           self.hp.weight_decay)
        return {**server, "hnet": hnet, "hnet_momentum": momentum}

    def predictor(self, server: ServerState, client: ClientContext) -> Params:
        with torch.no_grad():
            return self.generate(server["hnet"], client.cid)
