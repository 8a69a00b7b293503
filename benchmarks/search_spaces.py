"""Search spaces of the Optuna studies (``pflbench tune``): one small named function per method.

A space is ``space(trial, config) -> {dotted config key: value}``: every parameter is named by the
dotted key it sets (``method.params.lr``, ``evaluation.params.lr``, ...), so a trial's parameters,
the best parameters written to ``<suite>.tuned.yml`` and the values a suite run applies are the
same mapping. ``config`` is the cell's resolved run configuration (a dict): a space reads it to tune
only what is active (``local_steps`` when the suite counts steps, ``local_epochs`` when it counts
epochs; the evaluation fine-tuning rate only when the protocol fine-tunes) and to bound counts by
the setting (IFCA's clusters by the training clients).

Ranges are wide on purpose (about two decades either side of the papers' values) and learning
rates, proximal weights and other scale parameters are searched on a log scale. Budgets are the
same for every method (``--trials``); spaces do not change the compute per round much beyond the
local-step counts the papers themselves vary.
"""
from __future__ import annotations

from typing import Any, Callable

from pfl_core.algorithms import METHODS

Space = Callable[[Any, dict], dict[str, Any]]
SPACES: dict[str, Space] = {}

# shared ranges
SGD_LR = (1e-4, 1.0)
"""Plain SGD learning rates (FedAvg, Local, IFCA, the evaluation fine-tuning rate)."""
ADAM_LR = (1e-5, 1e-1)
"""Adam learning rates (Ditto's global step, FedRep, CAFeMe's outer loop)."""
PROX_LR = (1e-4, 1e-1)
"""Local-model steps of the proximal methods (pFedMe, CGPFL, APFL, L2SGD)."""
FT_LR = (1e-4, 0.5)
"""The evaluation protocol's fine-tuning rate (CAFeMe ``lr_ft``)."""


class NoSearchSpaceError(KeyError):
    """A method has no registered search space."""

    def __str__(self) -> str:  # KeyError quotes its message otherwise
        return str(self.args[0])


def space(*methods: str):
    """Register the decorated function as the search space of ``methods``."""

    def register(fn: Space) -> Space:
        for name in methods:
            SPACES[name] = fn
        return fn

    return register


def get_space(method: str) -> Space:
    if method in NOTHING_TO_TUNE:
        raise NoSearchSpaceError(f"method {method!r} has nothing to tune: {NOTHING_TO_TUNE[method]}")
    if method not in SPACES:
        raise NoSearchSpaceError(
            f"no search space for method {method!r}; spaces exist for {sorted(SPACES)} "
            f"(add one to benchmarks/search_spaces.py)")
    return SPACES[method]


def suggest(trial, config: dict) -> dict[str, Any]:
    """The trial's parameters for the cell ``config`` (dotted key -> value)."""
    return get_space(config["method"]["name"])(trial, config)


def _params(config: dict) -> dict:
    return config["method"].get("params") or {}


def _log(trial, key: str, bounds: tuple[float, float]) -> float:
    return trial.suggest_float(key, bounds[0], bounds[1], log=True)


def _finetune_lr(trial, config: dict) -> dict[str, Any]:
    """``evaluation.params.lr`` for methods that the protocol fine-tunes (steps > 0)."""
    method = METHODS.get(config["method"]["name"])
    steps = (config["evaluation"].get("params") or {}).get("steps", 0)
    if method.finetune_at_eval and steps:
        return {"evaluation.params.lr": _log(trial, "evaluation.params.lr", FT_LR)}
    return {}


def _local_work(trial, config: dict) -> dict[str, Any]:
    """``local_steps`` (1..50, log) when the cell counts batches (its value or the method's
    default), else ``local_epochs`` (1..5)."""
    default = getattr(METHODS.get(config["method"]["name"]).hyper_class, "local_steps", 0)
    if _params(config).get("local_steps", default):
        return {"method.params.local_steps": trial.suggest_int("method.params.local_steps", 1, 50, log=True)}
    return {"method.params.local_epochs": trial.suggest_int("method.params.local_epochs", 1, 5)}


def _max_clusters(config: dict, cap: int = 8) -> int:
    data = config["data"]
    seen = data["num_clients"] - int(round(data["num_clients"] * data.get("unseen_fraction", 0.0)))
    return max(2, min(cap, seen // 2))


@space("local", "fedavg", "fedavg_ft")
def sgd_space(trial, config: dict) -> dict[str, Any]:
    """Local SGD: lr (log 1e-4..1), local steps or epochs; the fine-tuning lr when fine-tuned."""
    return {"method.params.lr": _log(trial, "method.params.lr", SGD_LR),
            **_local_work(trial, config), **_finetune_lr(trial, config)}


@space("ifca", "ifca_ft")
def ifca_space(trial, config: dict) -> dict[str, Any]:
    """IFCA: FedAvg's space plus the number of cluster models k (2..min(8, seen clients / 2))."""
    out = sgd_space(trial, config)
    out["method.params.num_clusters"] = trial.suggest_int("method.params.num_clusters", 2,
                                                          _max_clusters(config))
    return out


@space("ditto")
def ditto_space(trial, config: dict) -> dict[str, Any]:
    """Ditto: personal SGD lr, global Adam lr, lambda (``mu``, log 1e-3..10), personal steps."""
    return {"method.params.lr": _log(trial, "method.params.lr", SGD_LR),
            "method.params.global_lr": _log(trial, "method.params.global_lr", ADAM_LR),
            "method.params.mu": _log(trial, "method.params.mu", (1e-3, 10.0)),
            "method.params.personal_steps": trial.suggest_int("method.params.personal_steps", 1, 10),
            **_finetune_lr(trial, config)}


@space("fedrep")
def fedrep_space(trial, config: dict) -> dict[str, Any]:
    """FedRep: Adam lr, head steps (1..10) and body steps (1..5) per round."""
    return {"method.params.lr": _log(trial, "method.params.lr", ADAM_LR),
            "method.params.head_steps": trial.suggest_int("method.params.head_steps", 1, 10),
            "method.params.body_steps": trial.suggest_int("method.params.body_steps", 1, 5),
            **_finetune_lr(trial, config)}


@space("perfedavg", "perfedavg_fo")
def perfedavg_space(trial, config: dict) -> dict[str, Any]:
    """Per-FedAvg: alpha (inner, log 1e-4..0.5), beta (outer, log 1e-5..0.1), local steps (1..10)."""
    return {"method.params.alpha": _log(trial, "method.params.alpha", (1e-4, 0.5)),
            "method.params.beta": _log(trial, "method.params.beta", (1e-5, 0.1)),
            "method.params.local_steps": trial.suggest_int("method.params.local_steps", 1, 10),
            **_finetune_lr(trial, config)}


@space("cafeme")
def cafeme_space(trial, config: dict) -> dict[str, Any]:
    """CAFeMe: inner SGD rate (log 1e-3..0.5), outer Adam rate (log 1e-5..1e-2), adapt steps
    (1..10) and the evaluation fine-tuning rate (``lr_ft``)."""
    return {"method.params.inner_lr": _log(trial, "method.params.inner_lr", (1e-3, 0.5)),
            "method.params.outer_lr": _log(trial, "method.params.outer_lr", (1e-5, 1e-2)),
            "method.params.adapt_steps": trial.suggest_int("method.params.adapt_steps", 1, 10),
            **_finetune_lr(trial, config)}


def _prox(trial) -> dict[str, Any]:
    return {"method.params.lr": _log(trial, "method.params.lr", PROX_LR),
            "method.params.personal_lr": _log(trial, "method.params.personal_lr", (1e-3, 0.5)),
            "method.params.lam": _log(trial, "method.params.lam", (0.1, 50.0))}


@space("pfedme")
def pfedme_space(trial, config: dict) -> dict[str, Any]:
    """pFedMe: eta (log 1e-4..0.1), personal lr (log 1e-3..0.5), lambda (log 0.1..50), beta (1..2)."""
    return {**_prox(trial), "method.params.beta": trial.suggest_float("method.params.beta", 1.0, 2.0),
            **_finetune_lr(trial, config)}


@space("cgpfl")
def cgpfl_space(trial, config: dict) -> dict[str, Any]:
    """CGPFL: pFedMe's proximal rates and lambda, plus K (2..min(8, seen clients / 2))."""
    return {**_prox(trial), "method.params.num_clusters":
            trial.suggest_int("method.params.num_clusters", 2, _max_clusters(config)),
            **_finetune_lr(trial, config)}


@space("cgpfl_heur")
def cgpfl_heur_space(trial, config: dict) -> dict[str, Any]:
    """CGPFL-Heur: the proximal rates and lambda, plus mu of expression (11) (log 0.1..100)."""
    return {**_prox(trial), "method.params.mu": _log(trial, "method.params.mu", (0.1, 100.0)),
            **_finetune_lr(trial, config)}


@space("apfl")
def apfl_space(trial, config: dict) -> dict[str, Any]:
    """APFL: lr (log 1e-4..0.1), initial mixing alpha (0.05..0.95), local steps (1..20)."""
    return {"method.params.lr": _log(trial, "method.params.lr", PROX_LR),
            "method.params.alpha_init": trial.suggest_float("method.params.alpha_init", 0.05, 0.95),
            "method.params.local_steps": trial.suggest_int("method.params.local_steps", 1, 20),
            **_finetune_lr(trial, config)}


@space("l2sgd")
def l2sgd_space(trial, config: dict) -> dict[str, Any]:
    """L2SGD: lr (log 1e-4..0.1), lambda (log 0.1..50), aggregation probability p (log 0.02..0.5)."""
    return {"method.params.lr": _log(trial, "method.params.lr", PROX_LR),
            "method.params.lam": _log(trial, "method.params.lam", (0.1, 50.0)),
            "method.params.p": _log(trial, "method.params.p", (0.02, 0.5)),
            **_finetune_lr(trial, config)}


@space("fedper", "lg_fedavg", "fedbabu")
def momentum_sgd_space(trial, config: dict) -> dict[str, Any]:
    """The MetaVers baselines' momentum SGD: lr (log 1e-4..1), local steps or epochs."""
    return {"method.params.lr": _log(trial, "method.params.lr", SGD_LR),
            **_local_work(trial, config), **_finetune_lr(trial, config)}


@space("knn_per")
def knn_per_space(trial, config: dict) -> dict[str, Any]:
    """kNN-Per: the FedAvg model's lr and local work, the kNN weight lambda (0..1) and k (1..20)."""
    return {**momentum_sgd_space(trial, config),
            "method.params.weight": trial.suggest_float("method.params.weight", 0.0, 1.0),
            "method.params.k": trial.suggest_int("method.params.k", 1, 20, log=True)}


@space("fedproto")
def fedproto_space(trial, config: dict) -> dict[str, Any]:
    """FedProto: lr (log 1e-4..1), local steps or epochs, the prototype weight ld (log 1e-2..10)."""
    return {**momentum_sgd_space(trial, config),
            "method.params.ld": _log(trial, "method.params.ld", (1e-2, 10.0))}


@space("metavers")
def metavers_space(trial, config: dict) -> dict[str, Any]:
    """MetaVers: the server Adam lr (log 1e-5..1e-1) and the loss mix gamma (0..1)."""
    return {"method.params.lr": _log(trial, "method.params.lr", ADAM_LR),
            "method.params.gamma": trial.suggest_float("method.params.gamma", 0.0, 1.0),
            **_finetune_lr(trial, config)}


@space("pfedhn")
def pfedhn_space(trial, config: dict) -> dict[str, Any]:
    """pFedHN: the hypernetwork's lr and the client's inner lr (log 1e-4..1), inner steps (1..100)."""
    return {"method.params.lr": _log(trial, "method.params.lr", SGD_LR),
            "method.params.inner_lr": _log(trial, "method.params.inner_lr", SGD_LR),
            "method.params.inner_steps": trial.suggest_int("method.params.inner_steps", 1, 100, log=True),
            **_finetune_lr(trial, config)}


@space("pfedgp")
def pfedgp_space(trial, config: dict) -> dict[str, Any]:
    """pFedGP: the backbone's lr (log 1e-4..1) and the kernel's outputscale (log 1..32)."""
    return {"method.params.lr": _log(trial, "method.params.lr", SGD_LR),
            "method.params.outputscale": _log(trial, "method.params.outputscale", (1.0, 32.0)),
            **_finetune_lr(trial, config)}


FT_LR_GRID = (1.0, 0.1, 0.01, 1e-3, 1e-4, 1e-5)
"""The FedL2P paper's fine-tuning lr grid (docs/papers/fedl2p.md)."""
META_LR = (1e-5, 1e-1)
"""FedL2P's meta-net SGD learning rates (BNNet, LRNet: 1e-3; eta-tilde: 1e-4)."""


@space("ft_bn_c", "ft_bn_g", "ft_bn_i")
def ft_space(trial, config: dict) -> dict[str, Any]:
    """FedL2P's FT baselines: the fine-tuning lr from the paper's grid {1, 0.1, ..., 1e-5}."""
    return {"evaluation.params.lr": trial.suggest_categorical("evaluation.params.lr", FT_LR_GRID)}


@space("fedl2p", "l2p")
def fedl2p_space(trial, config: dict) -> dict[str, Any]:
    """FedL2P / L2P: the meta-nets' SGD lrs (log 1e-5..1e-1; eta-tilde's two decades lower)."""
    return {"method.params.lr_bnnet": _log(trial, "method.params.lr_bnnet", META_LR),
            "method.params.lr_lrnet": _log(trial, "method.params.lr_lrnet", META_LR),
            "method.params.lr_eta": _log(trial, "method.params.lr_eta", (META_LR[0] / 10, META_LR[1] / 10))}


#: methods with nothing to tune: ``pflbench tune`` says so instead of searching
NOTHING_TO_TUNE = {"global_model": "Global Accuracy evaluates the pretrained model as it is (no lr, no training)"}


def describe() -> dict[str, str]:
    """method -> the first line of its space's docstring (for ``pflbench tune --list-spaces``)."""
    return {name: (fn.__doc__ or "").strip().splitlines()[0] for name, fn in sorted(SPACES.items())}
