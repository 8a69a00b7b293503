"""The evaluation protocol contract and its registry (:data:`PROTOCOLS`)."""
from __future__ import annotations

from dataclasses import replace
from typing import TYPE_CHECKING, ClassVar

from pfl_core.data.federated import FederatedData
from pfl_core.engine.contract import ClientContext, ClientProgram, ServerState
from pfl_core.evaluation.batched import batched_evaluation_fallback, personalize_and_evaluate_batched
from pfl_core.evaluation.config import EvalConfig
from pfl_core.evaluation.results import EvalResult, check_finite_results, summarise
from pfl_core.evaluation.sequential import personalize_and_evaluate
from pfl_core.registry import Registry

if TYPE_CHECKING:
    from pfl_core.engine import Executor

PROTOCOLS: Registry = Registry("evaluation protocol")


class Protocol:
    """Evaluates a method's predictors on a set of clients (chosen by subclasses).

    ``target="validation"`` is for tuning: it evaluates validation clients or ``val`` splits and
    never reads a test client or a test split.
    """

    bn_mode: ClassVar[str] = "train"
    """How a model with BatchNorm running statistics (KLD-BN) is evaluated: ``train``, the module as
    built, each test batch normalised with its own statistics (the running statistics are not
    read: ``seen`` and ``unseen``; a FedL2P stage-1 run's accuracies are such); ``eval``, with the
    running statistics (``proto``, ``novel_class``); ``recipe``, as each method's fine-tuning recipe
    says (``finetune_pretrained``: ``FinetuneRecipe.test_mode``). Runs record it
    (:func:`pfl_core.bn_support.evaluation_bn_mode`; run info and tag ``bn_evaluation``)."""

    seed: int = 0
    """The run's evaluation seed (stream ``evaluation``), set by :func:`pfl_core.experiment.prepare_run`,
    for protocols that draw (``finetune_pretrained``, ``novel_class``)."""

    def __init__(self, cfg: EvalConfig, target: str = "test"):
        if target not in ("test", "validation"):
            raise ValueError(f"evaluation target must be 'test' or 'validation', got {target!r}")
        self.cfg = cfg
        self.target = target

    def client_ids(self, fed: FederatedData) -> list[int]:
        raise NotImplementedError

    def evaluate(self, algorithm: ClientProgram, server: ServerState, contexts: dict[int, ClientContext],
                 executor: "Executor | None" = None, history: list[dict] | None = None) -> EvalResult:
        """Every client's curve; ``executor.execution`` picks the path (default: sequential).
        A non-finite loss at any step (a diverging fine-tuning) raises :class:`DivergenceError`.
        With ``cfg.val_split`` that split is evaluated too, after the test split (whose numbers
        are thus those of a run without it), its summary keys prefixed ``val_``. ``history`` (the
        run's rows so far) is for protocols that depend on it; the model evaluated is the one after
        round ``len(history) + 1`` (the round's own row is appended after its evaluation), which
        ``adapt_batches: continue`` reads."""
        evaluated_round = len(history or []) + 1
        result = self._evaluate(algorithm, server, contexts, executor, evaluated_round=evaluated_round)
        if self.cfg.val_split and self.target == "test":
            val = type(self)(replace(self.cfg, split=self.cfg.val_split, val_split=""), self.target)
            val.seed = self.seed  # the same evaluation streams
            after = val._evaluate(algorithm, server, contexts, executor, evaluated_round=evaluated_round)
            result.summary.update({f"val_{k}": v for k, v in after.summary.items()})
        return result

    def _evaluate(self, algorithm: ClientProgram, server: ServerState, contexts: dict[int, ClientContext],
                  executor: "Executor | None", evaluated_round: int = 1) -> EvalResult:
        steps = self.cfg.steps if algorithm.finetune_at_eval else 0
        batched = executor is not None and executor.execution == "batched"
        if batched and batched_evaluation_fallback(algorithm) is None:
            clients = list(contexts.values())
            params = [algorithm.predictor(server, ctx) for ctx in clients]
            results = personalize_and_evaluate_batched(algorithm, params, clients, self.cfg, steps, evaluated_round)
        else:
            results = [
                personalize_and_evaluate(algorithm, algorithm.predictor(server, ctx), ctx, self.cfg, steps,
                                         evaluated_round)
                for ctx in contexts.values()
            ]
        check_finite_results(results)
        return summarise(results)
