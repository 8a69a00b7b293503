"""Evaluation protocols, separate from the algorithms, registered in :data:`PROTOCOLS` by name.

* ``unseen`` / ``seen`` (:mod:`.clients`): held-out or training clients, each with its
  personalized predictor, optionally fine-tuned for N steps first (an accuracy curve over steps);
* ``proto`` (:mod:`.proto`): nearest-prototype classification and nVAR (MetaVers);
* ``novel_class`` (:mod:`.novel_class`): groups of classes never trained on (MetaVers Table 6);
* ``finetune_pretrained`` (:mod:`.finetune_pretrained`): fine-tune-then-test from a pretrained
  model with a method's recipe (FedL2P).

:mod:`.protocol` is the contract (:class:`Protocol`), :mod:`.config` the shared settings,
:mod:`.results` what a protocol returns; :mod:`.sequential` and :mod:`.batched` are the two
execution paths of the fine-tune-and-test loop, :mod:`.adaptation` which batches its fine-tuning
steps take. Every module of this package is imported here, so
a new protocol is one file that registers itself.
"""
from __future__ import annotations

from pfl_core.evaluation.config import EvalConfig
from pfl_core.registry import import_package_modules
from pfl_core.evaluation.protocol import PROTOCOLS, Protocol
from pfl_core.evaluation.results import SUMMARY_KEYS, ClientResult, EvalResult, check_finite_results, summarise

import_package_modules(__name__, __path__)

from pfl_core.evaluation import finetune_pretrained, novel_class, proto  # noqa: E402

#: every summary key a protocol may log (each also as ``val_<key>``), for the suites' metric checks
EVAL_KEYS = tuple(f"{prefix}{k}" for prefix in ("", "val_")
                  for k in dict.fromkeys((*SUMMARY_KEYS, *proto.PROTO_KEYS, *novel_class.NOVEL_KEYS,
                                          *finetune_pretrained.FINETUNE_KEYS)))
#: summary keys with a free suffix (``acc_group/<group>``)
EVAL_KEY_PREFIXES = finetune_pretrained.FINETUNE_KEY_PREFIXES

__all__ = ["EVAL_KEYS", "EVAL_KEY_PREFIXES", "PROTOCOLS", "SUMMARY_KEYS", "ClientResult", "EvalConfig",
           "EvalResult", "Protocol", "check_finite_results", "summarise"]
