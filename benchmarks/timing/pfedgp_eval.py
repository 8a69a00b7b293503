"""The cost of one pFedGP (``gp_head: tree_pg``) evaluation with a validation split, with the Gibbs
draws reused by the val pass (what runs do) or drawn again (``--refit``: the baseline, each client's
chains run once per pass), to be timed from outside:

    farm-bench -n 3 -- python -m benchmarks.timing.pfedgp_eval --check \\
        --vs 'python -m benchmarks.timing.pfedgp_eval --refit --check'

Synthetic 3 x 32 x 32 inputs (the Gibbs cost depends on the number of train samples, not their
values), ``--clients`` clients of ``--classes`` classes with ``--train`` train samples each, the
MetaVers / pFedGP CIFAR backbone (``pfedgp_cnn``) and the code's test Gibbs settings (30 chains of 5
sweeps). ``--check`` prints the summary, identical on both paths.
"""
from __future__ import annotations

import argparse
import json

import torch

from pfl_core.data.federated import ArrayDataset, Client, FederatedData
from pfl_core.algorithms import METHODS
from pfl_core.config import FederationConfig
from pfl_core.evaluation import EvalConfig
from pfl_core.evaluation.clients import SeenClients
from pfl_core.federation import make_contexts
from pfl_core.models import build_model
from pfl_core.seeding import RunStreams
from pfl_core.training import model_params


def federation(clients: int, classes: int, train: int, test: int, seed: int = 0) -> FederatedData:
    gen = torch.Generator().manual_seed(seed)
    per_client = train + 2 * test
    labels = torch.cat([torch.arange(per_client) % classes + classes * (c % (10 // classes)) for c in range(clients)])
    x = torch.randn(labels.numel(), 3, 32, 32, generator=gen) + labels[:, None, None, None] / 10
    parts = []
    for c in range(clients):
        idx = torch.arange(c * per_client, (c + 1) * per_client)
        parts.append(Client(c, {"train": idx[:train], "test": idx[train:train + test], "val": idx[train + test:]}))
    return FederatedData(ArrayDataset("synthetic32", x, labels, 10), parts, list(range(clients)))


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--clients", type=int, default=2)
    parser.add_argument("--classes", type=int, default=2)
    parser.add_argument("--train", type=int, default=600)
    parser.add_argument("--test", type=int, default=100)
    parser.add_argument("--refit", action="store_true", help="draw each client's chains again in the val pass")
    parser.add_argument("--check", action="store_true", help="print the evaluation summary")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    fed = federation(args.clients, args.classes, args.train, args.test)
    torch.manual_seed(0)  # the backbone's initialisation
    model = build_model("pfedgp_cnn", (3, 32, 32), 10)
    algorithm = METHODS.get("pfedgp")(model, METHODS.get("pfedgp").hyper_class.from_dict({}))
    algorithm.prepare(fed)
    server = {"params": model_params(model)}
    contexts = make_contexts(fed, fed.train_clients, FederationConfig(batch_size=64), RunStreams(0), "evaluation", 450)
    if args.refit:  # the baseline: each pass fits every client afresh
        summary = SeenClients(EvalConfig(steps=0, reduction="sample")).evaluate(algorithm, server, contexts).summary
        algorithm.forget_fits()
        val = SeenClients(EvalConfig(steps=0, reduction="sample", split="val"))
        summary.update({f"val_{k}": v for k, v in val.evaluate(algorithm, server, contexts).summary.items()})
    else:
        both = SeenClients(EvalConfig(steps=0, reduction="sample", val_split="val"))
        summary = both.evaluate(algorithm, server, contexts).summary
    if args.check:
        print(json.dumps(summary, sort_keys=True))
    return summary


if __name__ == "__main__":
    main()
