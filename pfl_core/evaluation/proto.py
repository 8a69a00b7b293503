"""Nearest-prototype evaluation (docs/papers/metavers.md: ``proto_eval``) and nVAR.

Protocol ``proto``: on every training client, the prototypes are the mean embedding, per class, of
the client's **entire** train split; every sample of the client's val and test splits is classified
by the nearest prototype (squared Euclidean, :mod:`pfl_core.prototypes`) among the client's own
classes, i.e. the classes present in its train split. A sample whose label is not among them is
necessarily wrong. Two summaries per split: ``avg_acc`` = correct / samples pooled over clients
(sample-weighted: the number MetaVers reports) and ``mean_acc`` = the unweighted mean of the
clients' accuracies. The summaries of :func:`pfl_core.evaluation.summarise` (``acc``,
``acc_weighted``, ...) are there too; the val split's keys carry the prefix ``val_``.

Any method whose model has a feature embedding can be evaluated so: this is the ``-Proto``
evaluation of MetaVers' Table 3 (FedAvg-Proto, ...), chosen by a suite with
``evaluation.protocol: proto``. The layer is the model's ``embed=True`` output
(:func:`pfl_core.training.embed`): ReLU(fc2), the 84-d input of the classifier, for ``lenet``
(a harness choice: the paper does not say which layer); the 84-d output for MetaVers'
``le_embedding``. A method may override it with an ``embedding(params, x)`` method.

Per-client loss (the divergence witness of :func:`pfl_core.evaluation.check_finite_results`): the
cross-entropy of the prototype logits over the client's own classes, on the samples whose label is
one of them.

nVAR (Table 4; :func:`nvar`) with a harness choice: class prototypes c_k from the test
embeddings of all clients pooled, n_k the nearest other prototype, nVAR = mean over classes of the
mean over class-k samples of ||c_k - f(x)||^2 / ||c_k - n_k||^2. Logged as ``nvar`` when
``evaluation.params.nvar`` is true.

The model embeds in eval mode (BatchNorm with running statistics), as the code's ``model.eval()``.
Two paths, like :mod:`pfl_core.evaluation`: ``sequential`` embeds each client's splits in chunks of
the evaluation batch size, in index order; ``batched`` embeds the same chunks, the clients whose
chunks at one position have equal sizes in one ``vmap``-ed call (clients sharing the server's
parameters are broadcast, not copied), then scores every client from the stacked embeddings. The
chunks are the same, so the two agree to float rounding (tested in float64).
"""
from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass

import torch

from pfl_core.engine.contract import ClientContext, ClientProgram, ServerState
from pfl_core.data.federated import FederatedData
from pfl_core.evaluation.batched import ClientStack, group_calls
from pfl_core.evaluation.config import EvalConfig
from pfl_core.evaluation.protocol import PROTOCOLS, Protocol
from pfl_core.evaluation.results import ClientResult, EvalResult, check_finite_results, summarise
from pfl_core.prototypes import class_prototypes, nearest_prototype, prototype_logits, squared_distances
from pfl_core.training import Params, embed

#: the summary keys of the ``proto`` protocol beyond :data:`pfl_core.evaluation.SUMMARY_KEYS`
PROTO_KEYS = ("avg_acc", "mean_acc", "nvar")


def nvar(embeddings: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """nVAR of pooled embeddings (module docstring): classes without samples are left out; needs
    at least two classes."""
    present = torch.unique(labels)
    if present.numel() < 2:
        raise ValueError("nVAR needs samples of at least two classes")
    remap = torch.searchsorted(present, labels)
    protos = class_prototypes(embeddings, remap, present.numel())
    between = squared_distances(protos, protos)
    between.fill_diagonal_(float("inf"))
    nearest = between.min(1).values  # ||c_k - n_k||^2
    within = (embeddings - protos[remap]).pow(2).sum(1)  # ||c_k - f(x)||^2 per sample
    ratio = within / nearest[remap]
    per_class = torch.zeros(present.numel(), dtype=ratio.dtype, device=ratio.device).index_add_(0, remap, ratio)
    per_class = per_class / torch.bincount(remap, minlength=present.numel()).to(ratio.dtype)
    return per_class.mean()


@contextmanager
def eval_mode(model: torch.nn.Module):
    """``model`` in eval mode (BatchNorm with its running statistics) for the block, as the code's
    ``model.eval()`` before ``proto_eval`` and the novel-class evaluation; its mode is restored."""
    training = model.training
    model.eval()
    try:
        yield model
    finally:
        model.train(training)


@dataclass
class _Scores:
    """One client's scores on one split (device tensors until read)."""

    correct: torch.Tensor
    loss_sum: torch.Tensor
    count: int


def _score(train_emb: torch.Tensor, train_y: torch.Tensor, emb: torch.Tensor, y: torch.Tensor,
           num_classes: int) -> _Scores:
    """Classify ``emb`` by the nearest prototype of the classes of ``train_y`` (module docstring)."""
    protos = class_prototypes(train_emb, train_y, num_classes)
    own = torch.bincount(train_y, minlength=num_classes) > 0
    hits = (nearest_prototype(emb, protos, own) == y).sum()
    logits = prototype_logits(emb, protos).masked_fill(~own, float("-inf"))
    known = own[y]  # samples of a class the client has no prototype of carry no loss
    target = logits.gather(1, y.unsqueeze(1)).squeeze(1)
    per_sample = torch.logsumexp(logits, 1) - target.masked_fill(~known, 0.0)
    loss = torch.where(known, per_sample, torch.zeros_like(per_sample)).sum()
    return _Scores(hits, loss, int(y.numel()))


@PROTOCOLS.register("proto")
class ProtoEval(Protocol):
    """``proto_eval`` on the training clients (module docstring): their val and test splits
    (``val`` only when tuning: ``target="validation"``)."""

    bn_mode = "eval"

    def __init__(self, cfg: EvalConfig, target: str = "test"):
        super().__init__(cfg, target)
        self.splits = ["val"] if target == "validation" else [cfg.val_split, "test"] if cfg.val_split else ["test"]

    def client_ids(self, fed: FederatedData) -> list[int]:
        for split in ("train", *self.splits):
            missing = [c for c in fed.train_clients if split not in fed.clients[c].splits]
            if missing:
                raise ValueError(f"protocol 'proto' needs a {split!r} split on every client; client "
                                 f"{missing[0]} has none: add it to data.client_splits")
        return fed.train_clients

    def _chunks(self, ctx: ClientContext, split: str) -> list[torch.Tensor]:
        """The split's rows in index order, in chunks of the evaluation batch size (the batch size
        of the evaluated split's stream: ``batch_size``, else the federation's)."""
        size = self.cfg.batch_size or ctx.streams[self.splits[-1]].batch_size
        return list(ctx.client.splits[split].split(size))

    def _embed(self, algorithm: ClientProgram, params: Params, x: torch.Tensor) -> torch.Tensor:
        own = getattr(algorithm, "embedding", None)
        return own(params, x) if own is not None else embed(algorithm.model, params, x)

    @torch.no_grad()
    def _embed_sequential(self, algorithm, params: list[Params], contexts: list[ClientContext],
                          split: str) -> list[torch.Tensor]:
        out = []
        for p, ctx in zip(params, contexts):
            parts = [self._embed(algorithm, p, ctx.dataset.batch(index)[0]) for index in self._chunks(ctx, split)]
            out.append(torch.cat(parts))
        return out

    @torch.no_grad()
    def _embed_batched(self, algorithm, params: list[Params], contexts: list[ClientContext],
                       split: str) -> list[torch.Tensor]:
        """Every client's embedding of ``split``: at each chunk position, the clients whose chunks
        have equal sizes in one vmapped call (:class:`pfl_core.evaluation.ClientStack`)."""
        stack = ClientStack(params, contexts)
        chunks = [self._chunks(ctx, split) for ctx in contexts]
        parts: list[list[torch.Tensor]] = [[] for _ in contexts]
        device = next(iter(stack.params.values())).device
        for position in range(max(len(c) for c in chunks)):
            batches = {i: c[position] for i, c in enumerate(chunks) if position < len(c)}
            for call in group_calls(0, position, batches):
                x = torch.stack([contexts[i].dataset.batch(row)[0] for i, row in zip(call.members, call.rows)])
                at = torch.tensor(call.members, device=device)
                emb = stack.call(lambda p, x, y, client: self._embed(algorithm, p, x), call.members, at, x, x)
                for k, i in enumerate(call.members):
                    parts[i].append(emb[k])
        return [torch.cat(p) for p in parts]

    def evaluate(self, algorithm: ClientProgram, server: ServerState, contexts: dict[int, ClientContext],
                 executor=None, history=None) -> EvalResult:
        clients = list(contexts.values())
        params = [algorithm.predictor(server, ctx) for ctx in clients]
        # the batched path never calls the method's client hooks (only predictor, on the host, and
        # the embedding), so a method's eval_batched_fallback (about its logits) does not apply
        batched = executor is not None and executor.execution == "batched"
        embed_all = self._embed_batched if batched else self._embed_sequential
        num_classes = clients[0].dataset.num_classes
        labels = {split: [ctx.dataset.y[ctx.client.splits[split]] for ctx in clients]
                  for split in ("train", *self.splits)}
        with eval_mode(algorithm.model):
            embedded = {split: embed_all(algorithm, params, clients, split) for split in ("train", *self.splits)}
        train = embedded["train"]
        summary, final = {}, None
        for split in self.splits:
            emb = embedded[split]
            scores = [_score(t, ty, e, y, num_classes)
                      for t, ty, e, y in zip(train, labels["train"], emb, labels[split])]
            result = self._summarise(clients, scores)
            if split == "test" and self.cfg.nvar:
                result.summary["nvar"] = float(nvar(torch.cat(emb), torch.cat(labels[split])))
            prefix = "" if split == self.splits[-1] else "val_"
            summary.update({prefix + k: v for k, v in result.summary.items()})
            final = result
        final.summary = summary
        return final

    def _summarise(self, clients: list[ClientContext], scores: list[_Scores]) -> EvalResult:
        correct = torch.stack([s.correct for s in scores]).tolist()  # one read per split
        losses = torch.stack([s.loss_sum.to(torch.float64) for s in scores]).tolist()
        results = [ClientResult(ctx.cid, s.count, [c / max(s.count, 1)], [loss / max(s.count, 1)])
                   for ctx, s, c, loss in zip(clients, scores, correct, losses)]
        check_finite_results(results)
        result = summarise(results)
        result.summary["avg_acc"] = sum(correct) / max(sum(s.count for s in scores), 1)
        result.summary["mean_acc"] = result.summary["acc"]
        return result
