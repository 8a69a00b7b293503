"""Every evaluation protocol, registered: ``unseen`` and ``seen`` (:mod:`pfl_core.evaluation`),
``proto`` (:mod:`pfl_core.proto_eval`), ``novel_class`` (:mod:`pfl_core.novel_class`) and
``finetune_pretrained`` (:mod:`pfl_core.finetune_protocol`). Import :data:`PROTOCOLS` from here to
see them all."""
from __future__ import annotations

from pfl_core import finetune_protocol, novel_class, proto_eval
from pfl_core.evaluation import PROTOCOLS, SUMMARY_KEYS

__all__ = ["PROTOCOLS", "EVAL_KEYS", "EVAL_KEY_PREFIXES"]

#: every summary key a protocol may log (each also as ``val_<key>``), for the suites' metric checks
EVAL_KEYS = tuple(f"{prefix}{k}" for prefix in ("", "val_")
                  for k in dict.fromkeys((*SUMMARY_KEYS, *proto_eval.PROTO_KEYS, *novel_class.NOVEL_KEYS,
                                          *finetune_protocol.FINETUNE_KEYS)))
#: summary keys with a free suffix (``acc_group/<group>``)
EVAL_KEY_PREFIXES = finetune_protocol.FINETUNE_KEY_PREFIXES
