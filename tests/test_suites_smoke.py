"""End to end: every suite's ``smoke`` profile on tiny files in the REAL on-disk formats.

* ``make reproduce-cafeme-table1 PROFILE=smoke`` (the issue's acceptance test) in a subprocess on
  generated MNIST idx / CIFAR-10 pickles, into a tmp MLflow store and report folder;
* every other suite: its smoke profile restricted with ``only=`` to one method on every cell of the
  other axes plus the paper's own method (CAFeMe / CGPFL) in one or two cells, through
  :func:`benchmarks.running.sweep.run_sweep` into a tmp SQLite store;
* every suite's paper grid (cells x seeds) and published cells;
* the published numbers in the suites against ``shared/specs/published-numbers.md``.

The datasets come from ``tests/fake_data.py`` (one data directory for the whole session).
"""
from __future__ import annotations

import math
import os
import re
import shutil
import subprocess
from pathlib import Path
from urllib.parse import urlparse

import pytest

import benchmarks.running.sweep as runner
from benchmarks.running.sweep import run_sweep
from benchmarks.suite.spec import cell_id, load_suite
from benchmarks.store.tracking import Tracker
from conftest import REPO_ROOT, store

import fake_data
from suite_names import unregistered

SUITES_DIR = REPO_ROOT / "suites"
ALL_SUITES = sorted(p.relative_to(SUITES_DIR).with_suffix("").as_posix() for p in SUITES_DIR.glob("*/*.yaml"))
SPECS_DIR = Path(__file__).resolve().parents[2] / "shared" / "specs"
FAKE_GIT = ("0123456789abcdef0123456789abcdef01234567", False)

#: smoke runs per suite: a list of ``only=`` filters whose expansions are concatenated. One cheap
#: method on every cell of the other axes (every dataset / partition / setting the suite reads:
#: fedavg_ft for CAFeMe and the demo, FedAvg or CGPFL for CGPFL), plus the paper's own method
#: (cafeme, cgpfl, cgpfl_heur) or a baseline in one cell. cafeme/table1 runs in full through
#: ``make`` (test_make_reproduce_cafeme_table1_smoke).
SMOKE_ONLY: dict[str, list[dict[str, list[str]]]] = {
    "demo/offline": [{"method": ["fedavg_ft"]}],
    "cafeme/table2": [{"method": ["fedavg_ft"]}, {"dataset": ["femnist"], "method": ["cafeme"]}],
    "cafeme/fig3": [{"method": ["fedavg_ft"]}, {"partition": ["none"], "method": ["cafeme"]}],
    "cafeme/fig4": [{"method": ["fedavg_ft"]}, {"dataset": ["metadataset"], "method": ["cafeme"]}],
    "cafeme/fig5": [{"samples": ["10", "60"], "method": ["fedavg_ft"]},
                    {"samples": ["10"], "method": ["cafeme"]}],
    "cgpfl/table1": [{"method": ["FedAvg"]}, {"setting": ["mnist-mlr"], "method": ["CGPFL-K4"]}],
    "cgpfl/fig1": [{"method": ["CGPFL-K2"]}, {"setting": ["mnist-mlr"], "method": ["pFedMe-PM"]}],
    "cgpfl/fig2": [{"method": ["CGPFL-K2"]}, {"setting": ["fmnist-mlr"], "method": ["Per-FedAvg-HF"]}],
    "cgpfl/fig3": [{"method": ["CGPFL-K4"]},
                   {"setting": ["mnist-mlr"], "method": ["CGPFL-K20", "CGPFL-Heur-mu10"]}],
    # MetaVers: FedAvg (or the cheapest method) on every cell; every method and MetaVers' per-dataset
    # settings (the CIFAR-100 500-client full-batch episodes included) in a few cells
    "metavers/table2": [{"method": ["FedAvg"]}, {"clients": ["50"], "method": ["MetaVers"]},
                        {"dataset": ["cifar100"], "clients": ["500"], "method": ["MetaVers"]},
                        {"dataset": ["cifar10"], "clients": ["50"]}],
    "metavers/table3": [{"method": ["FedAvg-Proto"]}, {"clients": ["50"]}],
    "metavers/table4": [{"method": ["FedAvg", "FedBABU", "FedRep", "MetaVers"]}],
    "metavers/table5": [{"method": ["Only-CE"]}, {"clients": ["50"]}],
    "metavers/table6": [{"method": ["FedAvg", "MetaVers"]}],
    "metavers/fig2": [{"method": ["Local", "Only-Triplet", "Only-CE", "MetaVers"]}],
    "metavers/fig3": [{"dataset": ["cifar10"]}, {"dataset": ["cifar100"], "attack": ["FedAvg"]}],
    # FedL2P: FT (BN C) (or the suite's only method) on every cell, which also runs every stage-1 block
    # once; every method in one cell per dataset
    "fedl2p/table1": [{"method": ["FT-BN-C"]}, {"alpha": ["0.1"], "pretraining": ["FedAvg"]}],
    "fedl2p/table2": [{"method": ["Global"]}, {"alpha": ["0.1"], "e": ["5"]}],
    "fedl2p/table3": [{"method": ["FT-BN-C"]}, {"setting": ["cifar10c-a0.5", "office_caltech10-a1000", "domainnet-a0.5"]}],
    "fedl2p/table4": [{"e": ["5"]}, {"e": ["15"], "method": ["seen:FT-BN-C"]}],
    "fedl2p/table5": [{"method": ["FT-BN-C"]}, {"setting": ["cifar10-a0.1", "domainnet-a0.1"]}],
    "fedl2p/table6": [{"method": ["FedL2P"]}],
    "fedl2p/fig2": [{"method": ["FedL2P"]}],
    "fedl2p/fig3": [{"method": ["FedL2P"]}],
    "fedl2p/fig4": [{"method": ["FedL2P"]}],
    "fedl2p/fig5": [{"method": ["FedL2P"]}],
}
#: suite -> reason, for smoke failures whose cause is in the source (xfail strict)
KNOWN_FAILURES: dict[str, str] = {}


def suite_path(key: str) -> Path:
    return SUITES_DIR / f"{key}.yaml"


_LOADED: dict[str, object] = {}


def suite_of(key: str):
    """The loaded suite; a skip naming what is missing while the suite names a method, dataset,
    model, protocol or config key this checkout does not register (the MetaVers suites name pieces
    written in parallel, issue 13)."""
    missing = unregistered(suite_path(key))
    if missing:
        pytest.skip(f"{key} names what is not registered here yet: {', '.join(missing)}")
    if key not in _LOADED:
        _LOADED[key] = load_suite(suite_path(key))
    return _LOADED[key]


# ------------------------------------------------------------------------------------- fixtures


@pytest.fixture(scope="session")
def smoke_data(tmp_path_factory):
    """(data dir, CIFAR-10 md5s): every dataset the smoke profiles read (fake_data.write_all)."""
    root = tmp_path_factory.mktemp("pfl_data")
    return root, fake_data.write_all(root)


@pytest.fixture(scope="session")
def smoke_tracker(tmp_path_factory) -> Tracker:
    """One SQLite store for every in-process smoke sweep (one experiment per suite); a fresh
    store per test would repeat MLflow's schema migrations each time."""
    uri, artifacts = store(tmp_path_factory.mktemp("smoke_store"))
    return Tracker(uri, artifacts)


@pytest.fixture(scope="session")
def metavers_data(smoke_data) -> dict:
    """CIFAR-100, CINIC-10 and mini-ImageNet for the MetaVers smoke profiles, beside
    :func:`smoke_data` (``fake_data.write_metavers``); the CIFAR-100 md5s. Requested only once a
    MetaVers suite loads, i.e. once its datasets are registered."""
    return fake_data.write_metavers(smoke_data[0])


@pytest.fixture(scope="session")
def fedl2p_data(smoke_data) -> Path:
    """CIFAR-10-C, Office-Caltech-10, DomainNet and Speech Commands for the FedL2P smoke profiles,
    beside :func:`smoke_data`, with the writers of the branches that load them (tests/fake_data.py):
    CIFAR-10-C's 10 corruptions of 60 images per severity (1 client each: 38 / 10 / 12, every class in every split), FedBN's
    Office / DomainNet layout (one smoke client per domain), Speech Commands with 4 training and 2
    held-out speakers (the smoke pools). Requested only once a FedL2P suite loads."""
    from pfl_core.data.cifar10c import FEDL2P_CORRUPTIONS

    root = smoke_data[0]
    fake_data.write_cifar10c(root, FEDL2P_CORRUPTIONS, per_severity=60)
    for name in ("office_caltech10", "domainnet"):
        fake_data.write_fedbn_domains(root, name, test=10)  # every class in every split (the LDA cuts need them)
    fake_data.write_speech_commands(root, train_speakers={f"s{k}000001": 6 for k in range(4)},
                                    held_speakers={"v0000001": ("val", 6), "t0000001": ("test", 6)})
    return root


@pytest.fixture
def data_env(smoke_data, tmp_path, monkeypatch):
    """The smoke data as $PFL_DATA_DIR (no download), CIFAR md5s patched for this test only,
    cwd = tmp_path, a fixed git state (no git call per sweep)."""
    from torchvision import datasets as tv

    root, md5s = smoke_data
    fake_data.patch_cifar_md5(tv.CIFAR10, md5s, monkeypatch)
    monkeypatch.setenv("PFL_DATA_DIR", str(root))
    monkeypatch.setenv("PFL_DOWNLOAD", "0")
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    monkeypatch.setattr(runner, "git_state", lambda: FAKE_GIT)
    monkeypatch.chdir(tmp_path)
    return root


def quiet(*_args, **_kwargs):
    pass


def failures(tracker: Tracker, key: str) -> list[str]:
    return [f"{r.data.tags.get('cell')} seed={r.data.tags.get('seed')}: {r.data.tags.get('failure_reason')}"
            for r in tracker.runs(key, status=None) if r.info.status != "FINISHED"]


# --------------------------------------------------------------------- acceptance: make, cafeme/table1


def _snapshot(paths: list[Path]) -> dict[str, int]:
    out = {}
    for p in paths:
        for f in ([p] if p.is_file() else p.rglob("*") if p.is_dir() else []):
            out[str(f)] = f.stat().st_mtime_ns
    return out


@pytest.mark.slow
@pytest.mark.parametrize("paper, name, expected", [("cafeme", "table1", 32), ("cgpfl", "table1", 45)])
def test_make_reproduce_table_smoke(smoke_data, tmp_path, paper, name, expected):
    """`make reproduce-<paper>-table1 PROFILE=smoke` exits 0 on generated MNIST/FMNIST/CIFAR-10 files:
    every smoke run FINISHED in the suite's experiment of the store (CAFeMe: 8 methods x 2 datasets x
    2 partitions; CGPFL: 9 methods x 5 settings; seed 0), each tagged, artifacts beside the store, and
    the report rendered into OUT."""
    from mlflow.tracking import MlflowClient

    if shutil.which("make") is None or not (REPO_ROOT / ".venv" / "bin" / "pflbench").exists():
        pytest.skip("needs make and the project's .venv (make setup)")
    root, md5s = smoke_data
    out = tmp_path / "reports"
    uri = f"sqlite:///{tmp_path}/mlflow.db"
    env = {k: v for k, v in os.environ.items() if not k.startswith("MLFLOW_")}
    env.update({"PFL_DATA_DIR": str(root), "PFL_DOWNLOAD": "0", "MLFLOW_TRACKING_URI": uri,
                "GIT_OPTIONAL_LOCKS": "0",  # the runner's `git status` must not take the index lock
                # CIFAR-10 md5s of the generated files, patched onto torchvision in pflbench
                **fake_data.cifar_md5_hook_env(tmp_path / "hook", md5s)})
    repo_reports = [REPO_ROOT / "reports" / paper, REPO_ROOT / "reports" / f"{paper}.pdf",
                    REPO_ROOT / "results" / "mlartifacts"]
    before = _snapshot(repo_reports)
    # -o: never rebuild the venv stamp here (no network; `make test` / `make setup` own that)
    cmd = ["make", "-o", ".venv/.installed", f"reproduce-{paper}-{name}", "PROFILE=smoke", f"OUT={out}"]
    proc = subprocess.run(cmd, cwd=REPO_ROOT, env=env, capture_output=True, text=True, timeout=1800)
    client = MlflowClient(tracking_uri=uri)
    experiment = client.get_experiment_by_name(f"{paper}/{name}")
    assert proc.returncode == 0, f"{' '.join(cmd)} exited {proc.returncode}:\n" \
                                 f"{proc.stdout[-4000:]}\n{proc.stderr[-4000:]}"
    assert experiment is not None
    runs = client.search_runs([experiment.experiment_id], "tags.run_kind = 'cell'", max_results=1000)  # not the sweep's parent
    bad = [f"{r.data.tags.get('cell')}: {r.info.status} {r.data.tags.get('failure_reason')}"
           for r in runs if r.info.status != "FINISHED"]
    assert not bad, "\n".join(bad)
    assert len(runs) == expected
    specs = suite_of(f"{paper}/{name}").expand("smoke")
    assert {r.data.tags["config_hash"] for r in runs} == {s.config_hash for s in specs}
    by_hash = {s.config_hash: s for s in specs}
    for r in runs:
        tags, spec = r.data.tags, by_hash[r.data.tags["config_hash"]]
        assert tags["suite"] == f"{paper}/{name}" and tags["paper"] == paper
        assert tags["profile"] == "smoke" and tags["seed"] == "0"
        assert tags["cell"] == spec.cell_id and tags["method"] == spec.method
        assert {k: tags[f"cell.{k}"] for k in spec.cell} == spec.cell
        assert tags["partition_digest"] and tags["sampling_digest"] and tags["git_commit"]
        assert "offline_data" not in tags  # real-format MNIST/CIFAR files, not offline stand-ins
        assert math.isfinite(r.data.metrics["acc_last3"])
    for suffix in (".md", ".csv"):
        assert (out / paper / f"{name}{suffix}").stat().st_size > 0
    assert (out / f"{paper}.pdf").stat().st_size > 0
    assert f"{expected} finished" in proc.stdout
    assert (tmp_path / "mlartifacts").is_dir()
    assert _snapshot(repo_reports) == before, "reports or artifacts went into the repo, not OUT/tmp"


# ----------------------------------------------------------------------- every other suite, smoke


def smoke_specs(key: str) -> list:
    suite = suite_of(key)
    specs, seen = [], set()
    for only in SMOKE_ONLY[key]:
        for spec in suite.expand("smoke", only=only):
            if spec.config_hash not in seen:
                seen.add(spec.config_hash)
                specs.append(spec)
    return specs


def _smoke_params():
    for key in SMOKE_ONLY:
        marks = [pytest.mark.xfail(strict=True, reason=KNOWN_FAILURES[key])] if key in KNOWN_FAILURES else []
        yield pytest.param(key, id=key, marks=marks)


@pytest.mark.slow
def test_smoke_selection_covers_every_suite():
    """Every suite is smoke-run: cafeme/table1 through make, the others through SMOKE_ONLY; every
    cell value of every non-method axis is in some selected run."""
    assert set(SMOKE_ONLY) | {"cafeme/table1"} == set(ALL_SUITES)
    for key in SMOKE_ONLY:
        if unregistered(suite_path(key)):
            continue  # test_suite_smoke_runs_finish skips it, naming what is missing
        suite = suite_of(key)
        # every selected cell, also one whose smoke config equals another's (e.g. FedL2P's e = 5
        # and e = 15 at one smoke epoch): the run of that config covers both
        cells = [s.cell for only in SMOKE_ONLY[key] for s in suite.expand("smoke", only=only)]
        for axis in suite.axes:
            if axis.name != "method" and not (key == "cafeme/fig5" and axis.name == "samples"):
                assert {c[axis.name] for c in cells} == set(axis.labels), (key, axis.name)


@pytest.mark.slow
@pytest.mark.parametrize("key", list(_smoke_params()))
def test_suite_smoke_runs_finish(key, data_env, smoke_tracker, request, monkeypatch):
    suite = suite_of(key)
    if suite.paper == "metavers":
        from torchvision import datasets as tv

        fake_data.patch_cifar_md5(tv.CIFAR100, request.getfixturevalue("metavers_data"), monkeypatch)
    if suite.paper == "fedl2p":
        request.getfixturevalue("fedl2p_data")
    specs = smoke_specs(key)
    assert specs and all(s.profile == "smoke" for s in specs)
    tracker = smoke_tracker
    summary = run_sweep(suite, specs, tracker, device="cpu", data_dir=str(data_env), echo=quiet)
    failed = failures(tracker, key)
    assert not failed and summary.failed == 0, f"{key} smoke failures:\n" + "\n".join(failed)
    runs = tracker.runs(key)
    assert summary.finished + summary.reused == len(specs) == len(runs)  # reused: shared with a suite swept before
    assert {r.data.tags["config_hash"] for r in runs} == {s.config_hash for s in specs}
    for r in runs:
        assert math.isfinite(r.data.metrics[suite.metric["key"]])
        assert (r.data.tags.get("offline_data") == "true") == (key == "demo/offline")


# ---------------------------------------------------------------------------- paper grids, published


@pytest.mark.parametrize("key", ALL_SUITES)
def test_paper_grid_and_published_cells(key):
    suite = suite_of(key)
    specs = suite.expand("paper")
    cells = suite.cells()
    assert len(cells) == math.prod(len(a.labels) for a in suite.axes)
    assert len(specs) == len(cells) * len(suite.raw["seeds"])
    assert len({(s.cell_id, s.seed) for s in specs}) == len(specs)
    assert len({s.config_hash for s in specs}) == len(specs)
    ids = {cell_id(c) for c in cells}
    for entry in suite.published:
        assert cell_id(entry["cell"]) in ids, entry["cell"]
    assert len({cell_id(e["cell"]) for e in suite.published}) == len(suite.published)


def md_table(text: str, heading: str) -> list[dict[str, str]]:
    """The first Markdown table after the ``### <heading>...`` line (any heading level), as a list
    of row dicts."""
    lines = text.splitlines()
    start = next(i for i, line in enumerate(lines) if re.match(rf"#+ {re.escape(heading)}", line))
    header, rows = None, []
    for line in lines[start + 1:]:
        if line.startswith("#"):
            break
        if not line.startswith("|"):
            if rows:
                break
            continue
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if header is None:
            header = cells
        elif not set("".join(cells)) <= set("-: "):
            rows.append(dict(zip(header, cells)))
    return rows


CAFEME_METHODS = {"FedAvg": "fedavg", "FedAvg-FT": "fedavg_ft", "IFCA": "ifca", "IFCA-FT": "ifca_ft",
                  "Ditto": "ditto", "FedRep": "fedrep", "Per-FedAvg": "perfedavg", "CAFeMe": "cafeme"}
DATASETS = {"CIFAR-10": "cifar10", "CIFAR10": "cifar10", "RMNIST": "rmnist", "FEMNIST": "femnist",
            "Meta-Dataset": "metadataset", "MNIST": "mnist", "FMNIST": "fmnist"}


def partition_label(name: str) -> str:
    """"Shards" -> shards, "None" -> none, "Dirichlet (α=0.3)" / "Dirichlet α=1000" -> dir0.3 / dir1000."""
    m = re.fullmatch(r"Dirichlet \(?α=([\d.]+)\)?", name)
    return f"dir{m.group(1)}" if m else name.lower()


def cgpfl_method(name: str) -> str:
    """"IFCA (K = 4)" -> IFCA-K4, "pFedMe (PM)" -> pFedMe-PM, "CGPFL-Heur" -> CGPFL-Heur."""
    m = re.fullmatch(r"(.+?) \((.+)\)", name)
    return m.group(1) + "-" + re.sub(r"[\s=]", "", m.group(2)) if m else name


def _column(row: dict, prefix: str) -> str:
    return next(v for k, v in row.items() if k.startswith(prefix))


PUBLISHED_TABLES = {
    "cafeme/table1": ("CAFeMe Table 1", lambda r: {"dataset": DATASETS[r["dataset"]],
                                                   "partition": partition_label(r["partition"]),
                                                   "method": CAFEME_METHODS[r["method"]]}),
    "cafeme/table2": ("CAFeMe Table 2", lambda r: {"dataset": DATASETS[r["dataset"]],
                                                   "method": CAFEME_METHODS[r["method"]]}),
    "cafeme/fig3": ("CAFeMe Figure 3", lambda r: {"partition": partition_label(r["partition"]),
                                                  "method": CAFEME_METHODS[r["method"]]}),
    "cgpfl/table1": ("CGPFL Table 1", lambda r: {"setting": f"{DATASETS[r['dataset']]}-{r['model'].lower()}",
                                                 "method": cgpfl_method(r["method"])}),
}


@pytest.mark.parametrize("key", list(PUBLISHED_TABLES))
def test_published_numbers_match_spec(key):
    spec = SPECS_DIR / "published-numbers.md"
    if not spec.is_file():
        pytest.skip(f"{spec} not present")
    heading, to_cell = PUBLISHED_TABLES[key]
    rows = md_table(spec.read_text(encoding="utf-8"), heading)
    assert rows, f"no table under '### {heading}' in {spec}"
    expected = {}
    for row in rows:
        pm = _column(row, "±")
        expected[cell_id(to_cell(row))] = (float(_column(row, "mean") if any(k.startswith("mean") for k in row)
                                                 else _column(row, "accuracy")),
                                           None if pm.startswith("—") else float(pm))
    suite = suite_of(key)
    got = {cell_id(e["cell"]): (float(e["mean"]), None if e.get("pm") is None else float(e["pm"]))
           for e in suite.published}
    assert set(got) == set(expected), (sorted(set(got) ^ set(expected)))
    wrong = {c: (got[c], expected[c]) for c in expected if got[c] != expected[c]}
    assert not wrong, f"{key}: suite (mean, pm) vs published-numbers.md: {wrong}"
