"""FedL2P's evaluation protocol ``finetune_pretrained`` (docs/papers/fedl2p.md).

Every client of the setting (``evaluation.params.clients``: the training clients, or the held-out
ones for Speech Commands' unseen pool) personalizes the pretrained model and is tested:

1. the client's fine-tuning data is its ``finetune_splits`` joined (CIFAR-10: train + val, all 50
   samples, docs/papers/fedl2p.md); its batches are drawn from the client's own stream (run seed, client), so
   every method sees the same batches (:func:`pfl_core.algorithms._lib.finetune.plan_client`);
2. the meta-net inputs (xi, LRNet statistics) are computed once, on one per-sample augmented epoch
   of that data, with the pretrained model in init mode (:mod:`pfl_core.algorithms._lib.meta_inputs`);
3. the method turns them into a :class:`~pfl_core.algorithms._lib.finetune.FinetuneRecipe`
   (``finetune_recipe(server, pretrained, inputs, client)``: betas, per-tensor lrs,
   running-statistics start, test mode; ``client``, the client's context, for a method with
   per-client state such as L2P's own lambda);
4. e epochs of fine-tuning, then the test split at batch 50 (:func:`pfl_core.algorithms._lib.finetune.finetune_clients`,
   vmapped over clients on the batched path).

Summary (percent, unlike the other protocols' fractions, as the paper prints them): ``acc_pooled``
= 100 sum correct / sum test (the reported number), ``acc`` = the mean over clients of their own
accuracy, ``acc_group/<group>`` = the pooled accuracy of the clients of each meta ``group``
(corruption, domain), ``eval_loss`` = the mean test loss. The per-client beta, eta, xi and x go to
the run artifact ``personalization.npz`` (with ``cid``, ``group``, ``correct``, ``total``) for
Table 6 and Figures 2-5 (:mod:`pfl_core.analysis.personalization`).

Tuning (``target: validation``) tests on the ``val`` split and leaves it out of the fine-tuning data.
"""
from __future__ import annotations

import numpy as np
import torch

from pfl_core.batching import balanced_weights
from pfl_core.engine.contract import ClientContext, ClientProgram, ServerState
from pfl_core.data.federated import FederatedData
from pfl_core.evaluation.protocol import PROTOCOLS, Protocol
from pfl_core.evaluation.results import ClientResult, EvalResult, check_finite_results
from pfl_core.algorithms._lib.finetune import (ClientOutcome, FinetuneRecipe, MetaInputs, client_meta_inputs, finetune_clients,
                               lr_tree, mean_accuracy, plan_client, pooled_accuracy, pretrained_state)
from pfl_core.models.kld_bn import load_pretrained

#: the summary keys of ``finetune_pretrained`` beyond the shared ones (``acc_group/<group>`` too)
FINETUNE_KEYS = ("acc_pooled",)
#: summary keys with a free suffix
FINETUNE_KEY_PREFIXES = ("acc_group/",)
#: the run artifact of the per-client arrays
ARRAYS_ARTIFACT = "personalization"


@PROTOCOLS.register("finetune_pretrained")
class FinetunePretrained(Protocol):
    """Module docstring. Its batches come from ``self.seed`` (the run's evaluation seed) and each
    client's id."""

    bn_mode = "recipe"

    @property
    def test_split(self) -> str:
        return "val" if self.target == "validation" else self.cfg.split

    @property
    def finetune_splits(self) -> list[str]:
        splits = [s for s in self.cfg.finetune_splits if s != self.test_split]
        if not splits:
            raise ValueError(f"evaluation.params.finetune_splits {self.cfg.finetune_splits} leaves nothing to "
                             f"fine-tune on besides the tested split {self.test_split!r}")
        return splits

    def client_ids(self, fed: FederatedData) -> list[int]:
        ids = fed.train_clients if self.cfg.clients == "seen" else fed.unseen_clients
        if not ids:
            raise ValueError(f"evaluation.params.clients: {self.cfg.clients} names no client of this run"
                             + (" (unseen needs held-out clients: data.unseen_fraction > 0 or a dataset with an "
                                "unseen pool)" if self.cfg.clients == "unseen" else ""))
        for split in (*self.finetune_splits, self.test_split):
            missing = [c for c in ids if split not in fed.clients[c].splits]
            if missing:
                raise ValueError(f"finetune_pretrained: client {missing[0]} has no {split!r} split: add it to "
                                 f"data.client_splits or change evaluation.params.finetune_splits")
        return ids

    def _evaluate(self, algorithm: ClientProgram, server: ServerState, contexts: dict[int, ClientContext],
                  executor=None, evaluated_round: int = 1) -> EvalResult:
        if not hasattr(algorithm, "finetune_recipe"):
            raise ValueError(f"protocol finetune_pretrained evaluates methods that personalize a pretrained model "
                             f"(global_model, ft_bn_c, ft_bn_g, ft_bn_i, fedl2p, l2p); {type(algorithm).__name__} "
                             "has no finetune_recipe")
        model, cfg = algorithm.model, self.cfg
        state = pretrained_state(server, model)
        dataset = next(iter(contexts.values())).dataset if contexts else None
        if hasattr(dataset, "for_evaluation"):  # Office: the code's evaluation path is not normalised (l2p-domains)
            dataset = dataset.for_evaluation()
        augment = self._augment(dataset) if cfg.augment and dataset is not None else None
        plans = []
        for ctx in contexts.values():
            index = torch.cat([ctx.client.splits[s] for s in self.finetune_splits])
            batch_size = cfg.batch_size or (ctx.streams["train"].batch_size if "train" in ctx.streams else 32)
            weights = balanced_weights(ctx.dataset.y[index]) if cfg.balanced else None
            plans.append(plan_client(ctx.cid, index, ctx.client.splits[self.test_split], cfg.epochs, batch_size,
                                     cfg.test_batch_size, self.seed, str(ctx.client.meta.get("group", "")), weights))
        start = load_pretrained(model, state)
        inputs = [client_meta_inputs(model, state, plan.inputs(dataset, "meta", augment)[0], start)
                  for plan in plans]
        recipes = [algorithm.finetune_recipe(server, state, meta, ctx) for meta, ctx in zip(inputs, contexts.values())]
        batched = executor is not None and executor.execution == "batched"
        outcomes = finetune_clients(model, state, dataset, plans, recipes, cfg.lr, augment, batched, cfg.stack_size)
        results = [ClientResult(o.cid, o.total, [o.correct / o.total], [o.loss / o.total]) for o in outcomes]
        check_finite_results(results)
        arrays = {ARRAYS_ARTIFACT: client_arrays(outcomes, recipes, inputs, state, cfg.lr)}
        return EvalResult(results, summarise_outcomes(outcomes), arrays=arrays)

    def _augment(self, dataset):
        """The dataset's per-sample augmentation (:data:`PER_SAMPLE_AUGMENT`)."""
        if dataset.name not in PER_SAMPLE_AUGMENT:
            raise ValueError(f"evaluation.params.augment: no per-sample augmentation is wired for dataset "
                             f"{dataset.name!r} (known: {sorted(PER_SAMPLE_AUGMENT)}); set "
                             "evaluation.params.augment: false")
        return PER_SAMPLE_AUGMENT[dataset.name]


def crop_flip_augment(dataset, index: torch.Tensor, generator: torch.Generator):
    """CIFAR-10 / CIFAR-10-C: RandomCrop(32, padding 4) + RandomHorizontalFlip per sample on the
    [0, 1] images, then the dataset's Normalize (the code's evaluation transform)."""
    from pfl_core.data.augment.crop_flip import crop_flip, draw_crop_flip  # the FedL2P data module (issue 14)

    x, y = dataset.raw_batch(index)
    return dataset.normalize(crop_flip(x, draw_crop_flip(len(y), generator))), y


def flip_rotate_augment(dataset, index: torch.Tensor, generator: torch.Generator):
    """Office-Caltech-10 / DomainNet: RandomHorizontalFlip + RandomRotation(+-30) per sample on the
    [0, 1] images, then the dataset's normalisation (none on Office's evaluation path)."""
    from pfl_core.data.augment.flip_rotate import draw_flip_rotate, flip_rotate  # FedL2P domains (issue 14)

    x, y = dataset.raw_batch(index)
    return dataset.to_inputs(dataset.normalize(flip_rotate(x, draw_flip_rotate(len(y), generator)))), y


def speech_augment(dataset, index: torch.Tensor, generator: torch.Generator):
    """Speech Commands: the code's training augmentation (time shift, background noise), which its
    ``__getitem__`` also applies to the evaluation's fine-tuning and meta-input batches
    (docs/papers/fedl2p.md), on the stored clips before their features."""
    import numpy as np

    from pfl_core.data.audio import SpeechAugment  # FedL2P domains (issue 14)

    rows, y = dataset.raw_batch(index)
    aug = SpeechAugment(dataset.extras["noise"], dataset.extras["noise_lengths"])
    rng = np.random.default_rng(int(torch.randint(0, 2**62, (1,), generator=generator)))
    return dataset.to_inputs(dataset.normalize(aug.apply(rows, aug.draw(len(y), rng)))), y


#: per-sample augmentation of the evaluation's fine-tuning and meta-input batches, per dataset
# (docs/papers/fedl2p.md)
PER_SAMPLE_AUGMENT = {"cifar10": crop_flip_augment, "cifar10c": crop_flip_augment,
                      "office_caltech10": flip_rotate_augment, "domainnet": flip_rotate_augment,
                      "speech_commands": speech_augment}


def summarise_outcomes(outcomes: list[ClientOutcome]) -> dict[str, float]:
    """``acc_pooled``, ``acc``, ``acc_group/<group>`` (pooled within each group; percent) and
    ``eval_loss`` (the mean over clients of their mean test loss)."""
    summary = {"acc_pooled": pooled_accuracy(outcomes), "acc": mean_accuracy(outcomes),
               "eval_loss": sum(o.loss / o.total for o in outcomes) / len(outcomes)}
    groups = sorted({o.group for o in outcomes if o.group})
    for group in groups:
        summary[f"acc_group/{group}"] = pooled_accuracy([o for o in outcomes if o.group == group])
    return summary


def client_arrays(outcomes: list[ClientOutcome], recipes: list[FinetuneRecipe], inputs: list[MetaInputs],
                  state, default_lr: float) -> dict[str, np.ndarray]:
    """The per-client arrays of Table 6 and Figures 2-5 (rows in client order)."""
    as_np = lambda t: torch.as_tensor(t).detach().double().cpu().numpy()
    etas = [torch.stack(list(lr_tree(r, state["params"], default_lr).values())) for r in recipes]
    return {
        "cid": np.array([o.cid for o in outcomes]),
        "group": np.array([o.group for o in outcomes]),
        "correct": np.array([o.correct for o in outcomes]),
        "total": np.array([o.total for o in outcomes]),
        "beta": np.stack([as_np(r.betas).reshape(-1) for r in recipes]),
        "eta": np.stack([as_np(e) for e in etas]),
        "xi": np.stack([as_np(m.xi).reshape(-1) for m in inputs]),
        "x": np.stack([as_np(m.lr_stats).reshape(-1) for m in inputs]),
    }
