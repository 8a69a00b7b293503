"""The probe of issue 15, item 4: malformed inputs, and how the harness answers each.

Every case mutates a tiny valid suite (digits28, 10 clients, two methods, one seed) or adds a bad
command-line flag. :func:`classify` puts it in one of three bins:

* ``well``: rejected before any run, with a one-line message naming the file (or the flag), the
  key and a fix;
* ``poorly``: rejected with a traceback, at run time (failed runs), after the sweep (a crashing
  report), or with a message that lacks the file, the key or a fix;
* ``accepted``: runs and reports without a complaint.

``tests/test_bad_inputs.py`` asserts that every case is rejected well (loading only, no run).
Run this file to measure all three bins, runs included (about a minute per accepted case)::

    .venv/bin/python tests/bad_inputs.py            # this checkout
    PYTHONPATH=/tmp/old .venv/bin/python tests/bad_inputs.py   # another checkout's code
"""
from __future__ import annotations

import contextlib
import copy
import io
import math
import os
import sys
import tempfile
import traceback
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import yaml

#: words by which a message tells the user what to write instead
FIX_WORDS = ("must be", "expected", "allowed", "e.g.", "use ", "write ", "remove", "one of", "did you mean",
             "list each", "give each", "make ")


def base_suite() -> dict:
    """The valid suite every case mutates: 2 rounds, 2 fine-tuning steps, 1 seed, 2 x 2 cells."""
    return {
        "paper": "probe", "name": "bad", "table": "Probe",
        "metric": {"key": "acc_last3", "label": "acc", "scale": 100, "pm": "std", "ddof": 0},
        "base": {
            "data": {"dataset": "digits28", "num_clients": 10, "unseen_fraction": 0.2,
                     "client_splits": {"test": 0.2}, "params": {"size": 28}},
            "model": {"name": "mlr"},
            "method": {"params": {"lr": 0.05, "local_epochs": 1}},
            "federation": {"rounds": 2, "clients_per_round": 3, "batch_size": 30},
            "evaluation": {"protocol": "unseen", "params": {"steps": 2, "lr": 0.05}},
        },
        "grid": [
            {"name": "setting", "values": [
                {"label": "dir", "set": {"data.partition": {"name": "dirichlet", "alpha": 0.5, "min_size": 20}}},
                {"label": "iid", "set": {"data.partition": {"name": "iid"}}},
            ]},
            {"name": "method", "key": "method.name", "values": ["fedavg", "fedavg_ft"]},
        ],
        "seeds": [0],
        "profiles": {"smoke": {"seeds": [0], "set": {"federation.rounds": 1}}},
        "published": [{"cell": {"setting": "dir", "method": "fedavg"}, "mean": 50.0, "pm": 1.5,
                       "pm_kind": "std", "runs": 5, "source": "Table 1"}],
    }


@dataclass
class Case:
    name: str
    key: str
    """A word the message must contain: the key (or flag) at fault."""
    mutate: Callable[[dict], None] = lambda d: None
    args: list[str] = field(default_factory=list)
    files: Callable[[Path, Path], None] | None = None
    """Writes the case's files (``files(suite_path, data_dir)``) after the suite: a suite path that
    is not a YAML file, or data files; the run then gets ``--data-dir data_dir``."""
    store: str | None = None
    """The store's SQLite file relative to the case's folder (default ``mlflow.db``); a store case
    is answered well when the message names ``--tracking-uri`` instead of the suite file."""
    dry_run_lists: bool = False
    """A dry run lists this case instead of failing (missing data, issue 37): its rejection is
    checked on a real run, which must stop at the pre-flight before any run."""


def _set(path: str, value) -> Callable[[dict], None]:
    """A mutation setting ``d[a][b]...`` (dotted ``path``; integers index lists)."""
    def mutate(d: dict) -> None:
        *head, last = path.split(".")
        node = d
        for part in head:
            node = node[int(part)] if part.isdigit() else node.setdefault(part, {})
        node[int(last) if last.isdigit() else last] = copy.deepcopy(value)
    return mutate


def _dir_partition(**params) -> Callable[[dict], None]:
    return _set("grid.0.values.0.set", {"data.partition": {"name": "dirichlet", "alpha": 0.5, "min_size": 20,
                                                            **params}})


def _repeat_axis(d: dict) -> None:
    d["grid"].append(copy.deepcopy(d["grid"][1]))


def _empty_grid(d: dict) -> None:
    d["grid"], d["published"] = [], []  # no published cell to trip over first


def _write(content: bytes) -> Callable[[Path, Path], None]:
    """Replace the suite file by ``content`` (a binary file, YAML with a repeated key)."""
    return lambda path, data_dir: path.write_bytes(content)


def _directory(path: Path, data_dir: Path) -> None:
    path.unlink()
    path.mkdir()


def _repeated_key(path: Path, data_dir: Path) -> None:
    text = path.read_text().replace("  federation:\n", "  federation:\n    rounds: 5\n", 1)
    path.write_text(text)  # base.federation.rounds twice: 5 then 2


def _mnist(labels=None, n_labels: int | None = None) -> Callable[[Path, Path], None]:
    """MNIST idx files of 60 training images under ``data_dir`` with bad ``labels`` or a label file
    of ``n_labels`` entries (images and labels disagree)."""
    def write(path: Path, data_dir: Path) -> None:
        import numpy as np
        from fake_data import write_idx, write_mnist

        write_mnist(data_dir, n_train=60, n_test=10)
        raw = data_dir / "MNIST" / "raw"
        if labels is not None:
            write_idx(raw / "train-labels-idx1-ubyte", np.array(labels(60)))
        if n_labels is not None:
            write_idx(raw / "train-labels-idx1-ubyte", np.arange(n_labels) % 10)
    return write


def _damaged_store(path: Path, data_dir: Path) -> None:
    """A SQLite file with a valid header whose schema page is overwritten."""
    import sqlite3

    db = path.parent / "mlflow.db"
    with contextlib.closing(sqlite3.connect(db)) as conn:
        conn.execute("CREATE TABLE t (x)")
        conn.commit()
    data = bytearray(db.read_bytes())
    data[100:600] = b"\xff" * 500
    db.write_bytes(bytes(data))


def _read_only_store(path: Path, data_dir: Path) -> None:
    import sqlite3

    db = path.parent / "mlflow.db"
    with contextlib.closing(sqlite3.connect(db)) as conn:
        conn.execute("CREATE TABLE t (x)")
        conn.commit()
    db.chmod(0o444)


def _owned_by_another_file(path: Path, data_dir: Path) -> None:
    """The store's experiment probe/bad already belongs to another suite file (issue 29, item 6)."""
    import json

    from mlflow.tracking import MlflowClient

    from benchmarks.store.ownership import SUITE_FILES_TAG

    client = MlflowClient(tracking_uri=f"sqlite:///{path.parent / 'mlflow.db'}")
    client.create_experiment("probe/bad", tags={SUITE_FILES_TAG: json.dumps(["suites/probe/other.yaml"])})


def _on_mnist(d: dict) -> None:
    d["base"]["data"].update(dataset="mnist", num_clients=4, params={})
    d["base"]["federation"]["clients_per_round"] = 2
    d["grid"][0]["values"][0]["set"]["data.partition"]["min_size"] = 2


CASES = [
    # the cases
    Case("negative rounds", "rounds", _set("base.federation.rounds", -3)),
    Case("num_clients 0", "num_clients", _set("base.data.num_clients", 0)),
    Case("negative dirichlet alpha", "alpha", _dir_partition(alpha=-0.5)),
    Case("batch size 0", "batch_size", _set("base.federation.batch_size", 0)),
    Case("${sed} placeholder", "size", _set("base.data.params.size", "${sed}")),
    Case("NaN learning rate", "lr", _set("base.method.params.lr", math.nan)),
    Case("--device gpu", "--device", args=["--device", "gpu"]),
    Case("seeds: '42'", "seeds", _set("seeds", "42")),
    Case("empty grid", "grid", _empty_grid),
    Case("duplicate axis", "grid", _repeat_axis),
    Case("duplicate axis values", "grid", _set("grid.1.values", ["fedavg", "fedavg"])),
    Case("negative learning rate", "lr", _set("base.method.params.lr", -0.05)),
    Case("metric.key typo", "metric.key", _set("metric.key", "acc_last_3")),
    Case("seeds: 1", "seeds", _set("seeds", 1)),
    Case("string published number", "mean", _set("published.0.mean", "50.0%")),
    # more of the same kinds
    Case("negative fine-tuning steps", "steps", _set("base.evaluation.params.steps", -1)),
    Case("fine-tuning lr 0", "lr", _set("base.evaluation.params.lr", 0)),
    Case("negative lr decay", "gamma", _set("base.evaluation.params.gamma", -0.8)),
    Case("decay_every 0", "decay_every", _set("base.evaluation.params.decay_every", 0)),
    Case("unknown reduction", "reduction", _set("base.evaluation.params.reduction", "mean")),
    Case("protocol typo", "unsen", _set("base.evaluation.protocol", "unsen")),
    Case("evaluation target typo", "target", _set("base.evaluation.target", "val")),
    Case("all clients unseen", "unseen_fraction", _set("base.data.unseen_fraction", 1.0)),
    Case("negative unseen fraction", "unseen_fraction", _set("base.data.unseen_fraction", -0.1)),
    Case("client split above 1", "client_splits", _set("base.data.client_splits", {"test": 1.5})),
    Case("client split as a string", "client_splits", _set("base.data.client_splits", {"test": "0.2"})),
    Case("normalize typo", "normalize", _set("base.data.normalize", "pixels")),
    Case("dataset split typo", "split", _set("base.data.split", "validation")),
    Case("negative subsample", "subsample", _set("base.data.subsample", -10)),
    Case("more clients per round than clients", "clients_per_round", _set("base.federation.clients_per_round", 50)),
    Case("negative clients per round", "clients_per_round", _set("base.federation.clients_per_round", -1)),
    Case("negative eval_every", "eval_every", _set("base.federation.eval_every", -2)),
    Case("negative local epochs", "local_epochs", _set("base.method.params.local_epochs", -1)),
    Case("lr as a string", "lr", _set("base.method.params.lr", "1e-3")),
    Case("lr as a boolean", "lr", _set("base.method.params.lr", True)),
    Case("dirichlet alpha 0", "alpha", _dir_partition(alpha=0)),
    Case("negative min_size", "min_size", _dir_partition(min_size=-5)),
    Case("partition parameter typo", "alpah", _dir_partition(alpah=0.5)),
    Case("zero shards", "num_shards", _set("grid.0.values.1.set", {"data.partition": {"name": "shards", "num_shards": 0}})),
    Case("dataset typo", "digits", _set("base.data.dataset", "digits")),
    Case("model typo", "cnn9", _set("base.model.name", "cnn9")),
    Case("method typo", "fedavgg", _set("grid.1.values", ["fedavg", "fedavgg"])),
    Case("duplicate seeds", "seeds", _set("seeds", [0, 0])),
    Case("negative seed", "seeds", _set("seeds", [-1])),
    Case("fractional seed", "seeds", _set("seeds", [0.5])),
    Case("profile seeds as a string", "seeds", _set("profiles.smoke.seeds", "0")),
    Case("published spread as text", "pm", _set("published.0.pm", "n/a")),
    Case("published runs 0", "runs", _set("published.0.runs", 0)),
    Case("metric.pm typo", "pm", _set("metric.pm", "stdev")),
    Case("curve metric typo", "curve_metric", _set("metric.curve_metric", "curve/accuracy")),
    Case("fractional num_clients", "num_clients", _set("base.data.num_clients", 2.5)),
    Case("batch size as a string", "batch_size", _set("base.federation.batch_size", "32")),
    Case("unknown config key", "method.nam", _set("grid.1.key", "method.nam")),
    Case("negative dataset parameter", "size", _set("base.data.params.size", -28)),
    Case("unknown dataset parameter", "sise", _set("base.data.params", {"sise": 28})),
    Case("infinite fine-tuning lr", "lr", _set("base.evaluation.params.lr", math.inf)),
    # issue 29, item 2: files that are not suites, data that is not data
    Case("suite path is a directory", "directory", files=_directory),
    Case("binary suite file", "UTF-8", files=_write(bytes(range(256)) * 4)),
    Case("NUL bytes in the suite file", "binary", files=_write(b"paper: probe\x00\x00\n")),
    Case("YAML key set twice", "rounds", files=_repeated_key),
    Case("empty axis label", "label", _set("grid.0.values.0.label", "")),
    Case("empty scalar axis value", "values", _set("grid.1.values", ["fedavg", ""])),
    Case("idx label out of range", "train-labels-idx1-ubyte", _on_mnist,
         files=_mnist(labels=lambda n: [(i * 16) % 170 for i in range(n)])),
    Case("idx images and labels disagree", "train-labels-idx1-ubyte", _on_mnist, files=_mnist(n_labels=50)),
    # issue 29, item 3: store faults
    Case("corrupt SQLite store", "not a SQLite database", store="mlflow.db",
         files=lambda path, data_dir: (path.parent / "mlflow.db").write_bytes(b"not a database\n" * 300)),
    Case("SQLite store with a damaged page", "damaged", store="mlflow.db", files=_damaged_store),
    Case("read-only SQLite store", "read-only", store="mlflow.db", files=_read_only_store),
    Case("store folder is a file", "is a file", store="blocker/mlflow.db",
         files=lambda path, data_dir: (path.parent / "blocker").write_text("a file\n")),
    # issue 29, item 6: an experiment belongs to one suite file
    Case("experiment of another suite file", "name", files=_owned_by_another_file),
    # issue 29, item 1: cells that load but cannot run
    Case("unseen protocol without unseen clients", "evaluation.protocol", _set("base.data.unseen_fraction", 0)),
    Case("zero local epochs", "local_epochs", _set("base.method.params.local_epochs", 0)),
    Case("partition min_size the data cannot meet", "data.partition", _dir_partition(min_size=400)),
    Case("real dataset without its files", "data.dataset", _set("base.data", {
        "dataset": "mnist", "num_clients": 10, "unseen_fraction": 0.2, "client_splits": {"test": 0.2}}),
        files=lambda path, data_dir: data_dir.mkdir(parents=True, exist_ok=True), dry_run_lists=True),
]


def _message_is_good(message: str, case: Case, suite_path: Path) -> bool:
    where = "--" if case.args or case.store else str(suite_path)
    lines = [line for line in message.strip().splitlines() if line.strip()]
    last = lines[-1] if lines else ""
    return (where in last and case.key in last and "Traceback" not in message
            and any(word in last for word in FIX_WORDS))


def _runs_in(uri: str) -> int:
    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri=uri)
    experiments = client.search_experiments()
    return len(client.search_runs([e.experiment_id for e in experiments])) if experiments else 0


def classify(case: Case, folder: Path, run: bool = True) -> tuple[str, str]:
    """(bin, last line of the answer) of ``case``; ``run=False`` only lists the runs (``--dry-run``),
    so a case that loads is then ``accepted`` without running."""
    from benchmarks import cli

    data = base_suite()
    case.mutate(data)
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / "bad.yaml"
    path.write_text(yaml.safe_dump(data, sort_keys=False))
    uri = f"sqlite:///{folder / (case.store or 'mlflow.db')}"
    argv = ["run", str(path), "--tracking-uri", uri, "--strict", "--report", "--out", str(folder / "reports"),
            *case.args]
    saved = {k: os.environ.get(k) for k in ("PFL_DOWNLOAD", "PFL_DATA_DIR")}  # --data-dir sets PFL_DATA_DIR
    if case.files is not None:
        case.files(path, folder / "data")
        argv += ["--data-dir", str(folder / "data")]
        os.environ["PFL_DOWNLOAD"] = "0"  # a missing dataset is reported, never fetched by the probe
    if not run:
        argv.append("--dry-run")
    err = io.StringIO()
    with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
        try:
            rc = cli.main(argv)
        except SystemExit as exit_:  # argparse
            rc = exit_.code
        except Exception:  # noqa: BLE001 - a traceback is a poor answer, recorded as such
            traceback.print_exc()
            rc = -1
    for key, value in saved.items():
        os.environ.pop(key, None) if value is None else os.environ.__setitem__(key, value)
    message = err.getvalue()
    last = (message.strip().splitlines() or [""])[-1]
    if rc == 0:
        return "accepted", last
    if rc == -1 or (run and _runs_in(uri)):
        return "poorly", last
    return ("well" if _message_is_good(message, case, path) else "poorly"), last


def main() -> int:
    counts = {"well": 0, "poorly": 0, "accepted": 0}
    with tempfile.TemporaryDirectory() as tmp:
        for i, case in enumerate(CASES):
            verdict, last = classify(case, Path(tmp) / f"case{i}")
            counts[verdict] += 1
            print(f"{verdict:8s} {case.name:40s} {last[:150]}", flush=True)
    print(f"{len(CASES)} malformed inputs: {counts['well']} rejected well, {counts['poorly']} poorly, "
          f"{counts['accepted']} accepted")
    return 0


if __name__ == "__main__":
    sys.path.append(str(Path(__file__).resolve().parents[1]))
    sys.exit(main())
