"""Protocols ``unseen`` and ``seen``: held-out clients, or the training clients, each evaluated
with its personalized predictor (fine-tuned first when the method fine-tunes at evaluation)."""
from __future__ import annotations

from dataclasses import replace

from pfl_core.data.federated import FederatedData
from pfl_core.evaluation.config import EvalConfig
from pfl_core.evaluation.protocol import PROTOCOLS, Protocol


@PROTOCOLS.register("unseen")
class UnseenClients(Protocol):
    """Held-out clients that never trained (CAFeMe's 20 new clients); validation clients when
    tuning."""

    def client_ids(self, fed: FederatedData) -> list[int]:
        ids = fed.validation_clients if self.target == "validation" else fed.unseen_clients
        if not ids:
            what = "data.validation_fraction" if self.target == "validation" else "data.unseen_fraction"
            raise ValueError(f"the 'unseen' protocol needs held-out clients: set {what} > 0")
        return ids


@PROTOCOLS.register("seen")
class SeenClients(Protocol):
    """The training clients, each with its personalized predictor, on their test split (their
    ``val`` split when tuning)."""

    def __init__(self, cfg: EvalConfig, target: str = "test"):
        if target == "validation":
            cfg = replace(cfg, split="val")
        super().__init__(cfg, target)

    def client_ids(self, fed: FederatedData) -> list[int]:
        for split in filter(None, (self.cfg.split, self.target == "test" and self.cfg.val_split)):
            missing = [c for c in fed.train_clients if split not in fed.clients[c].splits]
            if missing:
                raise ValueError(f"client {missing[0]} has no {split!r} split: add it to "
                                 f"data.client_splits (e.g. {{{split}: 0.1}})")
        return fed.train_clients
