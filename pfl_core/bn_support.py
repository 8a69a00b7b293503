"""BatchNorm running statistics across models, methods and protocols (issue 28 item 9).

A model whose BatchNorm layers keep running statistics (KLD-BN: FedL2P's ResNets, MetaVers'
``conv4``/``conv4_frl``; :func:`pfl_core.models.model_keeps_bn_state`) needs a method that carries
them (``Algorithm.keeps_bn_state``): any other leaves them at their initial values (0, 1), and an
evaluation that reads them would normalise with statistics no client computed.
:func:`check_bn_support` rejects that pairing when a configuration is loaded.

How a protocol evaluates such a model is :data:`Protocol.bn_mode
<pfl_core.evaluation.protocol.Protocol.bn_mode>`; :func:`evaluation_bn_mode` names it for a
configuration, so that a run evaluated in train mode (each test batch normalised with its own
statistics, e.g. a FedL2P stage-1 run under ``seen``) says so.
"""
from __future__ import annotations

from pfl_core.algorithms import METHODS
from pfl_core.evaluation import PROTOCOLS
from pfl_core.fields import ConfigError
from pfl_core.models import model_keeps_bn_state


def bn_methods() -> list[str]:
    """The registered methods that carry BN running statistics."""
    return [name for name in METHODS.names() if METHODS.get(name).keeps_bn_state]


def check_bn_support(method: str, model: str, key: str = "method.name") -> None:
    """Reject method ``method`` on model ``model`` when the model keeps BN running statistics and
    the method does not carry them (a :class:`ConfigError` keyed ``key``, one line naming the fix)."""
    if model_keeps_bn_state(model) and not METHODS.get(method).keeps_bn_state:
        raise ConfigError(
            f"method {method!r} does not carry BatchNorm running statistics, but model {model!r} keeps them "
            f"(KLD-BN), so they would stay at their initial values: use a method that carries them "
            f"({', '.join(bn_methods())}) or a model without BN state", key)


def evaluation_bn_mode(model: str, protocol: str) -> str | None:
    """How protocol ``protocol`` evaluates model ``model``'s BatchNorm: ``train`` (batch statistics
    of each test batch), ``eval`` (running statistics), ``recipe`` (each method's fine-tuning recipe
    says, ``finetune_pretrained``); None for a model without BN state."""
    return PROTOCOLS.get(protocol).bn_mode if model_keeps_bn_state(model) else None
