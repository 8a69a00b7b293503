"""Measure seconds per federation round and per evaluation, and project a suite's wall-clock.

    python -m benchmarks.timing.round_timing suites/cafeme/table1.yaml --only dataset=rmnist --rounds 3

For every cell of the chosen profile (one seed), runs ``--rounds`` rounds and its evaluation on this
machine, reports the mean seconds per round (the first round, which pays for warm-up, excluded when
there are several) and the evaluation time, and projects the profile's total as
``sum over runs of (rounds x s/round + evaluations x evaluation)``, one evaluation per
``eval_every`` rounds plus the final one. Nothing is logged to MLflow.

A suite whose runs start from a stage-1 ``model.pretrained`` (FedL2P) also pays for its stage 1s:
each distinct stage-1 configuration (by config hash) is timed and counted once, as the runner
trains it once (:mod:`benchmarks.running.stages`); the stage-2 cells are timed from their model's own
initialisation (:func:`pfl_core.pretrained.untrained`: the cost, not the accuracy, matters here).
"""
from __future__ import annotations

import argparse
import copy
import time

import torch

from benchmarks.suite.spec import load_suite, parse_only, stage1_hash
from pfl_core.config import RunConfig
from pfl_core.experiment import EXECUTION_CHOICES, run_experiment
from pfl_core.pretrained import untrained


#: ``--clock``: wall time, or this process's CPU time (a busy shared machine, one torch thread)
CLOCKS = {"wall": time.perf_counter, "cpu": time.process_time}


def time_cell(config: dict, rounds: int, device: str, data_dir: str | None,
              execution: str = "auto", clock: str = "wall") -> tuple[float, float]:
    """(seconds per round, seconds of the final evaluation) over ``rounds`` >= 3 rounds.

    Rounds 2..n-1 are timed (round 1 pays for loading and warm-up); the last round's interval
    holds one round plus the evaluation, which gives the evaluation time."""
    if rounds < 3:
        raise ValueError("--rounds must be at least 3")
    cfg = copy.deepcopy(config)
    cfg["federation"]["rounds"] = rounds
    cfg["federation"]["eval_every"] = 0
    stamps: list[float] = []
    run_experiment(RunConfig.from_dict(cfg), device=device, data_dir=data_dir, execution=execution,
                   on_round=lambda i, m: stamps.append(CLOCKS[clock]()), pretrained=untrained)
    intervals = [b - a for a, b in zip(stamps[:-1], stamps[1:])]
    round_s = sum(intervals[:-1]) / len(intervals[:-1])
    return round_s, max(0.0, intervals[-1] - round_s)


def projected_seconds(federation: dict, round_s: float, eval_s: float) -> float:
    """One run's projection: rounds x s/round plus one evaluation per ``eval_every`` rounds (the
    run's periodic evaluations, e.g. MetaVers' every 50) and the final one."""
    rounds, every = federation["rounds"], federation.get("eval_every", 0) or 0
    evaluations = 1 + (rounds // every if every else 0)
    return rounds * round_s + evaluations * eval_s


def stage1_configs(specs) -> dict[str, dict]:
    """The distinct stage-1 configurations of ``specs`` by config hash (each trained once)."""
    return {stage1_hash(s.config): s.config["model"]["pretrained"] for s in specs if stage1_hash(s.config)}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("suite")
    parser.add_argument("--profile", default="paper", help="the profile whose runs are projected")
    parser.add_argument("--only", action="append", metavar="AXIS=LABEL[,LABEL]")
    parser.add_argument("--rounds", type=int, default=4, help="rounds per cell, >= 3 (default 4)")
    parser.add_argument("--device", default="auto")
    parser.add_argument("--data-dir", default=None)
    parser.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    parser.add_argument("--execution", choices=EXECUTION_CHOICES, default="auto",
                        help="the path pflbench run would use (auto: by the cost of a client step, pfl_core.engine.choice)")
    parser.add_argument("--clock", choices=sorted(CLOCKS), default="wall",
                        help="wall time, or this process's CPU time (a busy shared machine; use with --threads 1)")
    args = parser.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    suite = load_suite(args.suite)
    specs = suite.expand(args.profile, only=parse_only(args.only))
    per_cell: dict[str, tuple[float, float]] = {}
    print(f"{'cell':55s} {'s/round':>8s} {'eval s':>8s}")
    for spec in specs:
        if spec.cell_id in per_cell:
            continue
        per_cell[spec.cell_id] = time_cell(spec.config, args.rounds, args.device, args.data_dir, args.execution,
                                             args.clock)
        round_s, eval_s = per_cell[spec.cell_id]
        print(f"{spec.cell_id:55s} {round_s:8.3f} {eval_s:8.1f}", flush=True)
    total = sum(projected_seconds(s.config["federation"], *per_cell[s.cell_id]) for s in specs)
    stage1 = stage1_configs(specs)
    for wanted, config in stage1.items():  # each distinct stage 1 once, however many runs share it
        round_s, eval_s = time_cell(config, args.rounds, args.device, args.data_dir, args.execution, args.clock)
        print(f"{'pretrain ' + wanted:55s} {round_s:8.3f} {eval_s:8.1f}", flush=True)
        total += projected_seconds(config["federation"], round_s, eval_s)
    if stage1:
        print(f"(stage 1: {len(stage1)} distinct pretraining run(s), each counted once)")
    print(f"projected wall-clock of {len(specs)} runs ({args.profile} profile, one process, "
          f"torch threads {torch.get_num_threads()}, execution {args.execution}, clock {args.clock}): "
          f"{total / 3600:.1f} h")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
