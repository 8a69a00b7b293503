"""The speed benchmark: fixed workloads timed on the sequential and the batched path in one run.

    python -m benchmarks.timing.speed                      # every workload, CPU (and CUDA when present)
    python -m benchmarks.timing.speed --only fedavg-rmnist cafeme-rmnist --rounds 3 --csv speed.csv

Each workload has the shapes of a paper cell (model, batch size, client sizes, local work, clients
per round); the pixels are random (timing does not depend on them, and no dataset is needed). For
every workload and device it times

* ``sequential``: one client at a time (the reference path);
* ``batched``: the round's clients vmapped together (:mod:`pfl_core.engine`);
* ``batched xK``: K seeds advanced in lockstep, their clients stacked (``--seeds``, default 5),
  time per run-round;
* with ``--capture``, on CUDA only: ``batched cap`` and ``batched xK cap``, the same with each
  vmapped step shape replayed as a CUDA graph (:mod:`pfl_core.engine.capture`);

and reports seconds per round (median over ``--rounds`` timed rounds after one warm-up round), the
speed-up over the sequential path, and the achieved GFLOP/s (convolution and matmul FLOPs of one
round, counted by ``torch.utils.flop_counter``) next to a plain fp32 matmul's on the same threads,
and the path ``--execution auto`` would take for the workload (:mod:`pfl_core.engine.choice`).

A ``choice`` workload (``ifca-choice-cifar10``) times one step instead of a round: IFCA's cluster
choice of every client (:func:`pfl_core.algorithms.ifca.cluster_losses`: the loss of each cluster
model over the client's whole train split), seconds per choice of all clients on three paths:

* ``loop``: the reference, one forward per batch (:func:`~pfl_core.algorithms._lib.cluster_pass.loop_losses`);
* ``chunked``: the harness's pass from chunked forwards (the same losses bit for bit), computing the
  per-row logits (an evaluation's choice, or a round's first);
* ``kept``: the same pass reading the logits a previous pass over the same clusters kept (the
  round's training choice after an evaluation; only partial batches are forwarded).

Their FLOPs are counted per path (the chunked pass pads the split to whole batches).
Nothing is asserted: these are measurements to compare, rerun on your own machine.
"""
from __future__ import annotations

import argparse
import csv
import statistics
import time
from dataclasses import dataclass, field

import torch
from torch.utils.flop_counter import FlopCounterMode

from pfl_core.engine.device import configure_device, device_info, synchronize
from pfl_core.algorithms import METHODS
from pfl_core.algorithms._lib.cluster_pass import SplitLogits, loop_losses
from pfl_core.algorithms.ifca import cluster_losses
from pfl_core.atomic_file import atomic_path
from pfl_core.config import FederationConfig
from pfl_core.data.federated import ArrayDataset, Client, FederatedData
from pfl_core.engine import Executor
from pfl_core.engine.choice import choose_execution, step_flops
from pfl_core.evaluation import EvalConfig
from pfl_core.evaluation.clients import UnseenClients
from pfl_core.federation import Federation, lockstep_round
from pfl_core.models import build_model
from pfl_core.seeding import RunStreams
from pfl_core.training import model_params


@dataclass(frozen=True)
class Workload:
    """One round (or one evaluation) with a paper cell's shapes."""

    name: str
    description: str
    method: str
    model: str
    input_shape: tuple[int, ...]
    hp: dict = field(default_factory=dict)
    train_size: int = 480
    test_size: int = 120
    clients: int = 100
    per_round: int = 5
    batch_size: int = 30
    classes: int = 10
    eval_steps: int = -1
    """>= 0: time the unseen-client evaluation (20 clients, this many fine-tuning steps) instead of a round."""
    drop_last: bool = True
    """The training streams drop a last partial batch (the federation's ``drop_last``)."""
    choice: bool = False
    """Time IFCA's cluster choice of every client (:func:`time_choice`) instead of a round."""


WORKLOADS = [
    Workload("fedavg-rmnist", "CAFeMe Table 1, RMNIST: FedAvg, 5 clients x 5 epochs x 16 batches of 30, model A",
             "fedavg", "cafeme_cnn_a", (1, 28, 28), {"lr": 0.001, "local_epochs": 5, "weighting": "uniform"}),
    Workload("cafeme-rmnist", "CAFeMe Table 1, RMNIST: CAFeMe, 5 clients x (5 inner + 6 query batches of 30), model A + FM",
             "cafeme", "cafeme_a", (1, 28, 28)),
    Workload("fedavg-cifar10", "CAFeMe Table 1, CIFAR-10: FedAvg, 5 clients x 5 epochs x 8 batches of 50, model B",
             "fedavg", "cafeme_cnn_b", (3, 32, 32), {"lr": 0.001, "local_epochs": 5, "weighting": "uniform"},
             train_size=400, test_size=100, batch_size=50),
    Workload("eval-unseen", "CAFeMe evaluation: 20 unseen clients x 51 points (50 SGD steps), FedAvg-FT, model A",
             "fedavg_ft", "cafeme_cnn_a", (1, 28, 28), eval_steps=50),
    Workload("cgpfl-mnist", "CGPFL Table 1, MNIST DNN: CGPFL, 40 clients x 10 local rounds x 5 inner steps, batch 20",
             "cgpfl", "dnn", (784,), {"num_clusters": 4}, train_size=1000, test_size=200, clients=40, per_round=40,
             batch_size=20),
    Workload("cgpfl-mlr", "CGPFL Table 1, MNIST MLR: CGPFL, 40 clients x 10 local rounds x 5 inner steps, batch 20",
             "cgpfl", "mlr", (784,), {"num_clusters": 4}, train_size=1000, test_size=200, clients=40, per_round=40,
             batch_size=20),
    Workload("pfedme-synthetic", "pFedMe Synthetic(0.5, 0.5), MLR: pFedMe, 10 of 100 clients x 20 local rounds x "
             "5 inner steps, batch 20 (pFedMe code: local_epochs 20, K 5)", "pfedme", "mlr", (60,),
             {"local_rounds": 20, "inner_steps": 5}, train_size=400, test_size=40, clients=100, per_round=10,
             batch_size=20),
    Workload("cgpfl-cifar10", "CGPFL Table 1, CIFAR-10 CNN: CGPFL, 40 clients x 10 local rounds x 5 inner steps, "
             "batch 20", "cgpfl", "cgpfl_cnn", (3, 32, 32), {"num_clusters": 4, "lr": 0.03, "personal_lr": 0.01},
             train_size=1000, test_size=200, clients=40, per_round=40, batch_size=20),
    Workload("metavers-lenet", "MetaVers Table 2, CIFAR-10: FedAvg, 5 of 50 clients x 50 steps of 64, LeNet",
             "fedavg", "lenet", (3, 32, 32), {"lr": 0.005, "local_steps": 50, "local_epochs": 0},
             train_size=800, test_size=200, clients=50, per_round=5, batch_size=64),
    Workload("ifca-choice-cifar10", "CGPFL Table 1, CIFAR-10 CNN: IFCA-K4's cluster choice, 40 clients x 4 "
             "clusters x 2025 train samples (the mean of floor(0.75 n), n ~ U{400..5000}) in batches of 20, "
             "the last partial", "ifca", "cgpfl_cnn", (3, 32, 32), {"num_clusters": 4, "lr": 0.03,
                                                                     "local_steps": 10},
             train_size=2025, test_size=10, clients=40, per_round=40, batch_size=20, drop_last=False, choice=True),
]


def random_federation(w: Workload, device: torch.device, seed: int) -> FederatedData:
    """``w.clients`` clients of ``w.train_size`` + ``w.test_size`` random samples (uint8 images or
    float features); 20 extra unseen clients for the evaluation workload."""
    gen = torch.Generator().manual_seed(seed)
    unseen = 20 if w.eval_steps >= 0 else 0
    total = (w.clients + unseen) * (w.train_size + w.test_size)
    if len(w.input_shape) == 3:
        x = torch.randint(0, 256, (total, *w.input_shape), generator=gen, dtype=torch.uint8)
    else:
        x = torch.randn(total, *w.input_shape, generator=gen)
    y = torch.randint(0, w.classes, (total,), generator=gen)
    size = w.train_size + w.test_size
    clients = [Client(c, {"train": torch.arange(c * size, c * size + w.train_size),
                          "test": torch.arange(c * size + w.train_size, (c + 1) * size)})
               for c in range(w.clients + unseen)]
    fed = FederatedData(ArrayDataset(w.name, x, y, w.classes, offline=True), clients,
                        list(range(w.clients)), list(range(w.clients, w.clients + unseen)))
    return fed.to(device)


def build(w: Workload, device: torch.device, seed: int) -> Federation:
    torch.manual_seed(seed)
    model = build_model(w.model, w.input_shape, w.classes).to(device)
    cls = METHODS.get(w.method)
    algorithm = cls(model, cls.hyper_class.from_dict(w.hp))
    cfg = FederationConfig(rounds=10**6, clients_per_round=w.per_round, batch_size=w.batch_size,
                           drop_last=w.drop_last)
    protocol = UnseenClients(EvalConfig(steps=max(w.eval_steps, 0), lr=0.001))
    return Federation(algorithm, random_federation(w, device, seed), model_params(model), cfg, protocol,
                      RunStreams(seed), evaluate_clients=False)


#: ``--clock``: wall time, or this process's CPU time (on a shared machine, where neighbours steal
#: wall time; with one torch thread it counts the work of this run alone)
CLOCKS = {"wall": time.perf_counter, "cpu": time.process_time}
clock = CLOCKS["wall"]


def sync(device: torch.device) -> None:
    """Wait for ``device`` itself (``cuda:1`` too, not the current device)."""
    synchronize(device)


def step_once(federations: list[Federation], executor: Executor, w: Workload, round_idx: int) -> None:
    """One round of every federation in lockstep, or their unseen-client evaluations."""
    if w.eval_steps >= 0:
        for f in federations:
            f.evaluate(executor)
        return
    lockstep_round(federations, executor, round_idx)


def time_path(w: Workload, device: torch.device, execution: str, seeds: int, rounds: int,
              capture: str = "off") -> tuple[float, float]:
    """(median seconds per run-round, GFLOP per run-round) of ``w`` on one path."""
    federations = [build(w, device, seed) for seed in range(seeds)]
    executor = Executor(execution, capture=capture)
    step_once(federations, executor, w, 0)  # warm-up: first calls, allocator, cuDNN autotuning, graph recording
    sync(device)
    times = []
    for r in range(rounds):
        started = clock()
        step_once(federations, executor, w, r + 1)
        sync(device)
        times.append((clock() - started) / seeds)
    with FlopCounterMode(display=False) as counter:
        step_once(federations[:1], Executor("sequential"), w, rounds + 1)
    return statistics.median(times), counter.get_total_flops() / 1e9


def time_choice(w: Workload, device: torch.device, rounds: int) -> list[tuple[str, float, float]]:
    """(path, median seconds per choice of every client, GFLOP per choice) of IFCA's cluster choice
    (module docstring) on the ``loop``, ``chunked`` and ``kept`` paths, after one warm-up each (the
    chunked pass checks its chunk shapes once per process then)."""
    federation = build(w, device, 0)
    model, clusters = federation.algorithm.model, federation.server["clusters"]
    contexts = list(federation.contexts.values())
    kept = SplitLogits()

    def loop() -> None:
        with torch.no_grad():
            for ctx in contexts:
                int(torch.argmin(loop_losses(model, clusters, [ctx.dataset.batch(i) for i in ctx.epoch_index()])))

    def chunked(cache=None) -> None:
        for ctx in contexts:
            int(torch.argmin(cluster_losses(model, clusters, ctx, SplitLogits() if cache is None else cache)))

    out = []
    for label, run in (("loop", loop), ("chunked", chunked), ("kept", lambda: chunked(kept))):
        run()  # warm-up (for "kept": fills the kept logits)
        sync(device)
        times = []
        for _ in range(rounds):
            started = clock()
            run()
            sync(device)
            times.append(clock() - started)
        with FlopCounterMode(display=False) as counter:
            run()
        out.append((label, statistics.median(times), counter.get_total_flops() / 1e9))
    return out


def matmul_gflops(device: torch.device, n: int = 2048, repeats: int = 10) -> float:
    a, b = torch.randn(n, n, device=device), torch.randn(n, n, device=device)
    a @ b
    sync(device)
    started = clock()
    for _ in range(repeats):
        a @ b
    sync(device)
    return 2 * n ** 3 * repeats / (clock() - started) / 1e9


def auto_choice(w: Workload, device: torch.device, seeds: int) -> str:
    """The path ``--execution auto`` takes for ``w`` (:mod:`pfl_core.engine.choice`), and why."""
    model = build_model(w.model, w.input_shape, w.classes)
    return choose_execution(device.type, step_flops(model, w.input_shape, w.batch_size), w.per_round * seeds)[1]


def choice_rows(w: Workload, device: torch.device, device_name: str, rounds: int, reference: float,
                info: dict) -> list[dict]:
    """Time a ``choice`` workload (:func:`time_choice`), print its lines, return its CSV rows."""
    print(f"{w.name:16s} {device_name:6s} cluster choice of {w.clients} clients (s/round: seconds per choice)")
    rows, baseline = [], None
    for label, seconds, gflop in time_choice(w, device, rounds):
        baseline = baseline or seconds
        rate = gflop / seconds
        row = {"workload": w.name, "device": device_name, "path": label, "step_capture": "off",
               "s_per_round": seconds, "speedup": baseline / seconds, "gflop_per_round": gflop, "gflops": rate,
               "matmul_gflops": reference, "percent_of_matmul": 100 * rate / reference,
               "torch_threads": torch.get_num_threads(), **info, "description": w.description}
        rows.append(row)
        print(f"{w.name:16s} {device_name:6s} {label:14s} {seconds:9.4f} {row['speedup']:7.2f}x "
              f"{rate:8.1f} {row['percent_of_matmul']:7.0f}%  ({gflop:.1f} GFLOP per choice)", flush=True)
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--only", nargs="+", choices=[w.name for w in WORKLOADS], help="workloads to time")
    parser.add_argument("--devices", nargs="+", default=None, help="default: cpu, and cuda when present")
    parser.add_argument("--rounds", type=int, default=3, help="timed rounds per path (after one warm-up)")
    parser.add_argument("--seeds", type=int, default=5, help="seeds in lockstep for the 'batched xK' path (1: off)")
    parser.add_argument("--threads", type=int, default=0, help="torch CPU threads (0: torch's default)")
    parser.add_argument("--csv", default=None, help="also write the table to this CSV file")
    parser.add_argument("--allow-tf32", action="store_true", help="TF32 matmuls and convolutions on CUDA (default off)")
    parser.add_argument("--capture", action="store_true",
                        help="also time the batched paths with CUDA-graph step capture (CUDA devices only)")
    parser.add_argument("--clock", choices=sorted(CLOCKS), default="wall",
                        help="wall time, or this process's CPU time (a busy shared machine; use with --threads 1)")
    args = parser.parse_args(argv)
    global clock
    clock = CLOCKS[args.clock]
    if args.threads:
        torch.set_num_threads(args.threads)
    devices = args.devices or ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])
    chosen = [w for w in WORKLOADS if not args.only or w.name in args.only]
    paths = [("sequential", "sequential", 1, "off"), ("batched", "batched", 1, "off")]
    if args.seeds > 1:
        paths.append((f"batched x{args.seeds}", "batched", args.seeds, "off"))
    captured = [(f"{label} cap", execution, seeds, "cuda_graphs") for label, execution, seeds, _ in paths[1:]]
    rows = []
    header = f"{'workload':16s} {'device':6s} {'path':14s} {'s/round':>9s} {'speed-up':>8s} {'GFLOP/s':>8s} {'% matmul':>8s}"
    print("random pixels with the shapes of each cell (timing only); torch", torch.__version__, "clock", args.clock)
    for device_name in devices:
        device = torch.device(device_name)
        configure_device(device, args.allow_tf32)
        info = device_info(device)
        reference = matmul_gflops(device)
        print(f"\n{device_name} ({info['device_name']}, CUDA {info['cuda_version'] or '-'}, TF32 "
              f"{'on' if info['allow_tf32'] else 'off'}): fp32 matmul {reference:.0f} GFLOP/s, torch threads "
              f"{torch.get_num_threads()}")
        print(header)
        for w in chosen:
            if w.choice:
                rows += choice_rows(w, device, device_name, args.rounds, reference, info)
                continue
            print(f"{w.name:16s} {device_name:6s} {auto_choice(w, device, 1)}")
            baseline = None
            for label, execution, seeds, capture in paths + (captured if args.capture and device.type == "cuda" else []):
                seconds, gflop = time_path(w, device, execution, seeds, args.rounds, capture)
                baseline = baseline or seconds
                rate = gflop / seconds
                row = {"workload": w.name, "device": device_name, "path": label, "step_capture": capture,
                       "s_per_round": seconds,
                       "speedup": baseline / seconds, "gflop_per_round": gflop, "gflops": rate,
                       "matmul_gflops": reference, "percent_of_matmul": 100 * rate / reference,
                       "torch_threads": torch.get_num_threads(), **info, "description": w.description}
                rows.append(row)
                print(f"{w.name:16s} {device_name:6s} {label:14s} {seconds:9.4f} {row['speedup']:7.2f}x "
                      f"{rate:8.1f} {row['percent_of_matmul']:7.0f}%", flush=True)
    if args.csv:
        with atomic_path(args.csv) as tmp, open(tmp, "w", newline="") as handle:
            writer = csv.DictWriter(handle, fieldnames=list(rows[0]))
            writer.writeheader()
            writer.writerows(rows)
        print(f"\nwrote {args.csv}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
