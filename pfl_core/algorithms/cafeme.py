"""CAFeMe: contextual modulation and meta-learning (paper Algorithms 1-2; docs/papers/cafeme.md).

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

With a label-conditioned modulator (model switch ``context_labels``, docs/papers/cafeme.md) the context
follows the paper's Algorithms 1-2 (docs/papers/cafeme.md): an inner step or a fine-tuning step is
conditioned on its own personalization batch D' (Alg. 2 lines 3-6); the query loss and every
evaluation batch on the **last** personalization batch, through the current FM parameters
(Alg. 2 line 8, Alg. 1 line 8), never on their own labels. Before the first fine-tuning step of an
evaluation the context is the first batch of the client's personalization split (its fixed order).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Annotated

import torch
import torch.nn.functional as F

from pfl_core.algorithms import METHODS
from pfl_core.algorithms.base import Algorithm, Weighting
from pfl_core.engine.contract import ClientContext, ClientUpdate, ServerState
from pfl_core.fields import HyperParams, Tune
from pfl_core.fields import NonNegativeInt, PositiveFloat, PositiveInt
from pfl_core.algorithms._lib.optim import client_optimizer_state, optimizer_step
from pfl_core.training import Params, value_and_grad


@dataclass
class CAFeMeHyper(HyperParams):
    inner_lr: Annotated[PositiveFloat, Tune(1e-3, 0.5, log=True)] = 0.05
    """alpha, SGD step of the inner loop (code ``lr_inner``: 0.05; FEMNIST 0.01)."""
    outer_lr: Annotated[PositiveFloat, Tune(1e-5, 1e-2, log=True, order=1)] = 0.001
    """beta, the client-side Adam learning rate (code ``lr_outer``)."""
    adapt_steps: Annotated[NonNegativeInt, Tune(1, 10, order=2)] = 5
    """S, inner steps per round (code ``adapt_steps``: 5; FEMNIST 8)."""
    query_batches: PositiveInt = 6
    """Train batches concatenated into the query set (code ``size_ratio``)."""
    first_order: bool = True
    """True: first-order MAML, as the code (docs/papers/cafeme.md). False: second order through the inner
    loop."""
    persist_outer_optimizer: bool = True
    """The client's Adam moments and step count carry over between its rounds (code)."""
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

    def loss(self, params: Params, x: torch.Tensor, y: torch.Tensor,
             context: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
        """CE on a batch; the FM context is ``context = (x', y')`` (label-conditioned FM) or, when
        None, the batch itself (with its labels when the FM conditions on them)."""
        return F.cross_entropy(torch.func.functional_call(self.model, params, (x,), self._context(x, y, context)), y)

    def _context(self, x, y, context) -> dict:
        """The forward's context keywords: none for the images-only FM (the batch is its own
        context inside the model), else the labelled batch ``context`` or ``(x, y)``."""
        if not self.context_labels:
            return {}
        cx, cy = (x, y) if context is None else context
        return {"context_x": cx, "context_y": cy}

    def query_context(self, support: tuple) -> tuple | None:
        """The query loss's context: the last support batch with a label-conditioned FM (paper Alg.
        2 line 8: zeta = g_mu'(D') of the last D'), else None (the query set is its own, unlabelled,
        context, as in the code)."""
        xs, ys = support
        return (xs[len(xs) - 1], ys[len(ys) - 1]) if self.context_labels else None

    def meta_gradient(self, params: Params, support: tuple, query: tuple) -> tuple[Params, torch.Tensor]:
        """(gradient for omega, query loss) given the inner batches ``support = (xs, ys)`` (indexable
        by step) and the query batch.

        Inner loop: phi_s = phi_{s-1} - alpha * grad loss(phi_{s-1}; support[s]). First order: the
        gradient of the query loss at phi_S; second order: its gradient w.r.t. omega through the
        inner steps (a ``grad`` of a function that itself takes gradients)."""
        xs, ys = support

        def adapted(omega: Params) -> Params:
            phi = omega
            for step in range(len(xs)):
                grads, _ = value_and_grad(self.loss, phi, xs[step], ys[step])
                phi = {name: p - self.hp.inner_lr * grads[name] for name, p in phi.items()}
            return phi

        context = self.query_context(support)
        if self.hp.first_order:
            with torch.no_grad():
                phi = adapted(params)
            return value_and_grad(self.loss, phi, *query, context)
        # a transform at the outer level makes every inner value_and_grad a nested torch.func.grad
        grads, loss = torch.func.grad_and_value(lambda omega, x, y: self.loss(adapted(omega), x, y, context))(
            dict(params), *query)
        return grads, loss.detach()

    # -- the client program (steps 1-4 of the module docstring) ----------------------------------
    def carry_in(self, server: ServerState, client: ClientContext, round_idx: int,
                 drawn: dict | None = None) -> dict:
        adam = client_optimizer_state(client.state, "outer_adam", "adam", server["params"],
                                      persist=self.hp.persist_outer_optimizer)
        return {"params": server["params"], "adam": adam}

    def draw(self, client: ClientContext, round_idx: int):
        """S support batches, then ``query_batches`` batches concatenated into one query batch."""
        support = [client.next_index() for _ in range(self.hp.adapt_steps)]
        query = torch.cat([client.next_index() for _ in range(self.hp.query_batches)])
        return {"support": support, "query": [query]}

    def local_update(self, carry, batches, masks):
        xq, yq = batches["query"]
        grads, query_loss = self.meta_gradient(carry["params"], batches["support"], (xq[0], yq[0]))
        params, adam = optimizer_step("adam", carry["params"], grads, carry["adam"], self.hp.outer_lr)
        return {"params": params, "adam": adam}, query_loss

    def carry_out(self, server: ServerState, client: ClientContext, carry, loss) -> ClientUpdate:
        if self.hp.persist_outer_optimizer:
            client.state["outer_adam"] = carry["adam"]
        return ClientUpdate(carry["params"], client.num_samples("train"), loss)

    # -- evaluation ---------------------------------------------------------------------------------
    EVAL_CONTEXT = "eval_context"
    """``client.state`` key of the last personalization batch of the current evaluation."""

    def predictor(self, server: ServerState, client: ClientContext) -> Params:
        """The global model; a new evaluation of ``client`` forgets the previous one's context."""
        client.state.pop(self.EVAL_CONTEXT, None)
        return server["params"]

    def _eval_context(self, client: ClientContext) -> dict:
        """Label-conditioned FM at evaluation: the last personalization (fine-tuning) batch of this
        evaluation, or before the first step the first batch of the split's fixed order (module
        docstring). Images-only mode, the default, needs no context."""
        if not self.context_labels:
            return {}
        context = client.state.get(self.EVAL_CONTEXT)
        if context is None:
            context = client.dataset.batch(client.streams["train"].epoch()[0])
        return self._context(None, None, context)

    def logits(self, params: Params, x: torch.Tensor, client: ClientContext) -> torch.Tensor:
        return torch.func.functional_call(self.model, params, (x,), self._eval_context(client))

    def finetune_step(self, params: Params, x, y, lr: float, client: ClientContext) -> Params:
        """One SGD step on the personalization batch (x, y), its own context (Alg. 2 lines 3-6);
        with a label-conditioned FM the batch becomes the evaluation's context."""
        grads, _ = value_and_grad(self.loss, params, x, y)
        if self.context_labels and client is not None:
            client.state[self.EVAL_CONTEXT] = (x, y)
        with torch.no_grad():
            return {k: p - lr * grads[k] for k, p in params.items()}
