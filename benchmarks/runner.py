"""The suite runner: expand, skip what already FINISHED, run the rest, log every run.

Runs execute in this process (``jobs=1``, with a per-round progress bar) or in a process pool
(``jobs>1``). Workers only compute; the parent writes every result to MLflow, so an interrupted
sweep leaves no half-written run and resumes where it stopped. A diverging run (NaN) is logged as
FAILED with its reason and the sweep goes on.
"""
from __future__ import annotations

import multiprocessing
import os
import time
import traceback
from concurrent.futures import ProcessPoolExecutor, as_completed
from dataclasses import dataclass

import torch
from tqdm.auto import tqdm

from benchmarks.suite import RunSpec, Suite
from benchmarks.tracking import Tracker, git_state
from pfl_core.config import RunConfig
from pfl_core.experiment import run_experiment
from pfl_core.federation import DivergenceError


@dataclass
class SweepSummary:
    total: int
    skipped: int
    finished: int
    failed: int
    wall_s: float


def execute_spec(spec: RunSpec, device: str, data_dir: str | None, threads: int | None = None,
                 progress: bool = False) -> dict:
    """Run one spec and return a picklable outcome (metrics, history, clients) or its error."""
    if threads:
        torch.set_num_threads(threads)
    started = time.time()
    cfg = RunConfig.from_dict(spec.config)
    bar = tqdm(total=cfg.federation.rounds, desc="  rounds", leave=False, disable=not progress)

    def on_round(round_idx: int, metrics: dict) -> None:
        bar.update(1)
        bar.set_postfix(loss=f"{metrics['train_loss']:.3f}")

    try:
        result = run_experiment(cfg, device=device, data_dir=data_dir, on_round=on_round)
    except DivergenceError as err:
        return {"started": started, "ended": time.time(), "error": f"diverged: {err}"}
    except Exception as err:  # noqa: BLE001 - any crash of one run must not end the sweep
        return {"started": started, "ended": time.time(),
                "error": f"{type(err).__name__}: {err}", "traceback": traceback.format_exc()}
    finally:
        bar.close()
    return {"started": started, "ended": time.time(), "metrics": result.metrics,
            "history": result.history, "clients": result.clients, "curve_mean": result.curve_mean,
            "curve_weighted": result.curve_weighted, "info": result.info}


def pending_runs(specs: list[RunSpec], tracker: Tracker) -> tuple[list[RunSpec], set[str]]:
    done = tracker.finished_hashes(specs[0].suite) if specs else set()
    return [s for s in specs if s.config_hash not in done], done


def run_sweep(suite: Suite, specs: list[RunSpec], tracker: Tracker, jobs: int = 1,
              device: str = "auto", data_dir: str | None = None, echo=print) -> SweepSummary:
    """Run every spec whose config hash has not FINISHED yet; log each as it completes."""
    started = time.perf_counter()
    todo, _ = pending_runs(specs, tracker)
    skipped = len(specs) - len(todo)
    if skipped:
        echo(f"{suite.key}: {skipped} of {len(specs)} runs already FINISHED, skipping them")
    git = git_state()
    meta = {"paper": suite.paper, "table": suite.raw.get("table", "")}
    finished = failed = 0
    bar = tqdm(total=len(todo), desc=f"{suite.key} runs", unit="run")

    def record(spec: RunSpec, outcome: dict) -> None:
        nonlocal finished, failed
        tracker.log(spec, meta, outcome, git)
        if "error" in outcome:
            failed += 1
            bar.write(f"FAILED {spec.cell_id} seed={spec.seed}: {outcome['error']}")
        else:
            finished += 1
        bar.update(1)

    if jobs <= 1:
        for spec in todo:
            bar.set_postfix_str(f"{spec.cell_id} seed={spec.seed}")
            record(spec, execute_spec(spec, device, data_dir, progress=True))
    else:
        threads = max(1, (os.cpu_count() or 1) // jobs)
        ctx = multiprocessing.get_context("spawn")
        with ProcessPoolExecutor(max_workers=jobs, mp_context=ctx) as pool:
            futures = {pool.submit(execute_spec, s, device, data_dir, threads): s for s in todo}
            for future in as_completed(futures):
                record(futures[future], future.result())
    bar.close()
    return SweepSummary(len(specs), skipped, finished, failed, time.perf_counter() - started)
