"""CAFeMe: contextual modulation and meta-learning (paper Algorithms 1-2; CAFeMe spec, "CAFeMe
client update, exactly as the code does it").

Client update from the global parameters omega (FM and base alike):

1. phi_0 = omega; for s = 1..S: phi_s = phi_{s-1} - alpha * grad CE(f(x_s; phi_{s-1}), y_s) on the
   next train ("pers") batch, the FM context computed from x_s.
2. Query set: the next ``query_batches`` (6) train batches concatenated; L_q = CE(f(x_q; phi_S)),
   the context taken over the whole query set.
3. First order (the code): grad L_q at phi_S is used as omega's gradient. Second order (switch):
   the gradient flows back through the inner steps.
4. One Adam step (lr beta) on the client's copy of omega; the Adam state belongs to the client and
   persists across its participations (switch).
Server: the uniform mean of the uploaded parameters.

At evaluation all parameters are fine-tuned by the protocol (``lr_ft_pfl``), each evaluation batch
being its own context (transductive, unlabelled), as in the code.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from pfl_core.algorithms import METHODS
from pfl_core.algorithms.base import Algorithm, ClientContext, ClientUpdate, HyperParams, ServerState, Weighting
from pfl_core.optim import client_optimizer
from pfl_core.training import Params


@dataclass
class CAFeMeHyper(HyperParams):
    inner_lr: float = 0.05
    """alpha, SGD step of the inner loop (code ``lr_inner``: 0.05; FEMNIST 0.01)."""
    outer_lr: float = 0.001
    """beta, the client-side Adam learning rate (code ``lr_outer``)."""
    adapt_steps: int = 5
    """S, inner steps per round (code ``adapt_steps``: 5; FEMNIST 8)."""
    query_batches: int = 6
    """Train batches concatenated into the query set (code ``size_ratio``)."""
    first_order: bool = True
    """True: first-order MAML, as the code (spec diff 4). False: second order through the inner loop."""
    persist_outer_optimizer: bool = True
    """The client's Adam moments and step count carry over between its rounds (code, diff 5)."""
    weighting: Weighting = "uniform"
    """Server aggregation: the code's plain mean (``uniform``) or ``samples``."""


@METHODS.register("cafeme")
class CAFeMe(Algorithm):
    """CAFeMe; needs a modulated model (``cafeme_a`` / ``cafeme_b``)."""

    hyper_class = CAFeMeHyper
    finetune_at_eval = True

    def __init__(self, model, hp):
        super().__init__(model, hp)
        if not hasattr(model, "fm"):
            raise ValueError("cafeme needs a modulated model: set model.name to cafeme_a or cafeme_b")
        self.context_labels = model.fm.context_labels

    def loss(self, params: Params, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        """CE on a batch that is its own context (with its labels when the FM conditions on them)."""
        kwargs = {"context_y": y} if self.context_labels else {}
        return F.cross_entropy(torch.func.functional_call(self.model, params, (x,), kwargs), y)

    def meta_gradient(self, params: Params, support: list, query: tuple) -> tuple[Params, torch.Tensor]:
        """(gradient for omega, query loss) given the inner batches and the query batch.

        Inner loop: phi_s = phi_{s-1} - alpha * grad loss(phi_{s-1}; support[s]). First order: the
        gradient of the query loss at phi_S; second order: its gradient w.r.t. omega through the
        inner steps (create_graph)."""
        second_order = not self.hp.first_order
        omega = {k: v.detach().requires_grad_(True) for k, v in params.items()}
        phi = omega
        for x, y in support:
            grads = torch.autograd.grad(self.loss(phi, x, y), list(phi.values()), create_graph=second_order)
            phi = {name: p - self.hp.inner_lr * g for (name, p), g in zip(phi.items(), grads)}
            if not second_order:
                phi = {name: p.detach().requires_grad_(True) for name, p in phi.items()}
        query_loss = self.loss(phi, *query)
        wrt = omega if second_order else phi
        return dict(zip(wrt, torch.autograd.grad(query_loss, list(wrt.values())))), query_loss.detach()

    def client_update(self, server: ServerState, client: ClientContext, round_idx: int) -> ClientUpdate:
        support = [client.next_batch() for _ in range(self.hp.adapt_steps)]
        query = [client.next_batch() for _ in range(self.hp.query_batches)]
        query = (torch.cat([b[0] for b in query]), torch.cat([b[1] for b in query]))
        grads, query_loss = self.meta_gradient(server["params"], support, query)
        opt = client_optimizer(client.state, "outer_adam", server["params"],
                               persist=self.hp.persist_outer_optimizer, lr=self.hp.outer_lr)
        return ClientUpdate(opt.step(grads), client.num_samples("train"), query_loss)

    def _eval_context(self, client: ClientContext) -> dict:
        """Label-conditioned FM at evaluation: the context is the first batch of the client's
        personalization split in its fixed order (the paper uses the last personalization batch;
        images-only mode, the default, needs no context)."""
        if not self.context_labels:
            return {}
        cx, cy = client.dataset.batch(client.streams["train"].epoch()[0])
        return {"context_x": cx, "context_y": cy}

    def logits(self, params: Params, x: torch.Tensor, client: ClientContext) -> torch.Tensor:
        return torch.func.functional_call(self.model, params, (x,), self._eval_context(client))

    def finetune_step(self, params: Params, x, y, lr: float, client: ClientContext) -> Params:
        leaves = {k: v.detach().requires_grad_(True) for k, v in params.items()}
        grads = torch.autograd.grad(self.loss(leaves, x, y), list(leaves.values()))
        return {k: (p - lr * g).detach() for (k, p), g in zip(leaves.items(), grads)}
