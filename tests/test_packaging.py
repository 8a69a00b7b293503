"""The installable package: the suites inside it, short suite names, one version, the extras, and
the built wheel itself (about a second: setuptools in this environment, no isolation). `make wheel-smoke` installs that wheel into a fresh environment and
runs a packaged suite from outside the checkout (CI)."""
from __future__ import annotations

import email
import fnmatch
import re
import shutil
import stat
import subprocess
import sys
import tomllib
import zipfile
from pathlib import Path

import pytest

import benchmarks
from benchmarks.cli import main
from benchmarks.store.ownership import suite_file_id
from benchmarks.suite.packaged import resolve_suite, suite_file, suite_names, suites_dir
from benchmarks.reporting import paper_suites
from benchmarks.suite.schema import SuiteError
from conftest import REPO_ROOT, tiny_suite_dict, write_suite

PYPROJECT = tomllib.loads((REPO_ROOT / "pyproject.toml").read_text())
SUITE_FILES = sorted(p.relative_to(REPO_ROOT / "suites").as_posix()
                     for p in (REPO_ROOT / "suites").rglob("*") if p.is_file())
"""Every file under suites/ (suite files, tuned values beside them), relative to suites/."""


@pytest.fixture(autouse=True)
def _isolated(isolated):
    return isolated  # cwd: an empty tmp_path, as outside the checkout


def test_the_packaged_suites_are_the_checkout_suites():
    """``benchmarks/suites`` (what the wheel ships) is the checkout's ``suites/``, and
    pyproject's package-data takes every file there into the package."""
    assert suites_dir() == (REPO_ROOT / "suites").resolve()
    patterns = PYPROJECT["tool"]["setuptools"]["package-data"]["benchmarks"]
    left_out = [f for f in SUITE_FILES if not any(fnmatch.fnmatch(f"suites/{f}", p) for p in patterns)]
    assert not left_out, f"not in [tool.setuptools.package-data] benchmarks = {patterns}"
    assert suite_names() == sorted(f[:-len(".yaml")] for f in SUITE_FILES if f.endswith(".yaml"))
    assert "demo/offline" in suite_names() and "cafeme/table1" in suite_names()


def test_short_names_resolve_to_the_packaged_files_and_a_path_still_wins(tmp_path):
    for name in suite_names():
        assert resolve_suite(name) == suites_dir() / f"{name}.yaml"
        assert resolve_suite(f"{name}.yaml") == suites_dir() / f"{name}.yaml"
        # the same suite file in the store, whether named by its path or its short name
        assert suite_file_id(resolve_suite(name)) == suite_file_id(REPO_ROOT / "suites" / f"{name}.yaml")
    local = write_suite(tmp_path / "demo" / "offline.yaml", tiny_suite_dict())  # cwd is tmp_path
    assert resolve_suite("demo/offline.yaml") == Path("demo/offline.yaml")
    assert resolve_suite(str(local)) == local
    assert resolve_suite("demo/offline") == suites_dir() / "demo" / "offline.yaml"
    assert suite_file_id(Path("/venv/site-packages/benchmarks/suites/demo/offline.yaml")) == "suites/demo/offline.yaml"


def test_a_papers_suites_and_a_snapshots_suite_come_from_here_first_then_from_the_package(tmp_path):
    """``report --paper`` and ``--from-snapshot``/``--beside-snapshot``: ./suites when it has the
    paper's files (a checkout's root, one's own suites), else the packaged ones."""
    assert paper_suites("demo") == [suites_dir() / "demo" / "offline.yaml"]  # cwd: tmp_path, no suites/
    assert suite_file("cgpfl/table1") == suites_dir() / "cgpfl" / "table1.yaml"
    write_suite(tmp_path / "suites" / "demo" / "mine.yaml", tiny_suite_dict())
    assert paper_suites("demo") == [Path("suites/demo/mine.yaml")]
    assert suite_file("demo/mine") == Path("suites/demo/mine.yaml")
    assert suite_file("demo/offline") == suites_dir() / "demo" / "offline.yaml"
    with pytest.raises(SuiteError, match="pflbench list suites"):
        suite_file("demo/nope")


@pytest.mark.parametrize("name", ["cafeme/tabel1", "nope", "demo/offline/x", "../suites/demo/offline"])
def test_an_unknown_suite_name_is_one_line_that_says_where_the_names_are(name, capsys):
    with pytest.raises(SuiteError, match="pflbench list suites"):
        resolve_suite(name)
    assert main(["run", name, "--dry-run"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and name in err and "`pflbench list suites`" in err


def test_run_takes_a_packaged_suite_by_its_short_name(tmp_path, capsys):
    uri = f"sqlite:///{tmp_path}/store/mlflow.db"
    assert main(["run", "demo/offline", "--profile", "smoke", "--dry-run", "--no-data-check", "--tracking-uri", uri]) == 0
    out = capsys.readouterr().out
    assert re.search(r"^6 runs \(0 already FINISHED, 6 to run\); profile=smoke", out, flags=re.M), out


def test_the_version_is_written_once(capsys):
    """pyproject reads ``benchmarks.__version__``; ``--version`` prints it; the changelog's newest
    released entry is that version (an ``[Unreleased]`` section may come first)."""
    assert "version" not in PYPROJECT["project"] and "version" in PYPROJECT["project"]["dynamic"]
    assert PYPROJECT["tool"]["setuptools"]["dynamic"]["version"] == {"attr": "benchmarks.__version__"}
    with pytest.raises(SystemExit) as done:
        main(["--version"])
    assert done.value.code == 0 and capsys.readouterr().out == f"pflbench {benchmarks.__version__}\n"
    entries = re.findall(r"^## \[([^\]]+)\]", (REPO_ROOT / "CHANGELOG.md").read_text(), flags=re.M)
    released = [e for e in entries if e != "Unreleased"]  # Keep a Changelog: changes not yet released on top
    assert released and released[0] == benchmarks.__version__ and entries.index(released[0]) <= 1


def test_the_heavy_parts_are_extras_and_dev_holds_them_all():
    deps = " ".join(PYPROJECT["project"]["dependencies"])
    extras = PYPROJECT["project"]["optional-dependencies"]
    for extra, package in [("cluster", "ray"), ("dashboard", "optuna-dashboard"), ("docs", "mkdocs-material")]:
        assert any(r.startswith(package) for r in extras[extra]) and package not in deps
    for tool in ["pytest", "playwright", "build"]:
        assert tool not in deps and any(r.startswith(tool) for r in extras["dev"])
    assert "pflbench[cluster,dashboard,docs]" in extras["dev"]


def _copy_sources(dest: Path) -> None:
    """What setuptools builds the wheel from, links kept as links (``benchmarks/suites``)."""
    dest.mkdir()
    for name in ["pyproject.toml", "README.md"]:
        shutil.copy2(REPO_ROOT / name, dest / name)
    for name in ["benchmarks", "pfl_core", "suites"]:
        shutil.copytree(REPO_ROOT / name, dest / name, symlinks=True,
                        ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))


def test_the_built_wheel_holds_every_suite_file_the_version_and_the_command(tmp_path):
    """The wheel (setuptools, as ``python -m build`` calls it) holds each file of suites/ itself,
    not a link, byte for byte; its metadata carries the version and the extras."""
    src = tmp_path / "src"
    _copy_sources(src)
    assert (src / "benchmarks" / "suites").is_symlink()
    proc = subprocess.run([sys.executable, "-c", "import sys; from setuptools import build_meta as b; "
                           "print(b.build_wheel(sys.argv[1]))", str(tmp_path / "dist")],
                          cwd=src, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    wheel = tmp_path / "dist" / proc.stdout.split()[-1]
    with zipfile.ZipFile(wheel) as whl:
        infos = {i.filename: i for i in whl.infolist()}
        shipped = sorted(n[len("benchmarks/suites/"):] for n in infos if n.startswith("benchmarks/suites/"))
        assert shipped == SUITE_FILES
        for rel in SUITE_FILES:
            info = infos[f"benchmarks/suites/{rel}"]
            assert not stat.S_ISLNK(info.external_attr >> 16), f"{rel} is a link in the wheel"
            assert whl.read(info) == (REPO_ROOT / "suites" / rel).read_bytes()
        assert {n.split("/")[0] for n in infos} == {"benchmarks", "pfl_core", wheel.name.split("-py3")[0] + ".dist-info"}
        dist_info = f"pflbench-{benchmarks.__version__}.dist-info"
        meta = email.message_from_bytes(whl.read(f"{dist_info}/METADATA"))
        entry_points = whl.read(f"{dist_info}/entry_points.txt").decode()
    assert meta["Version"] == benchmarks.__version__
    assert {"cluster", "dashboard", "docs", "dev"} <= set(meta.get_all("Provides-Extra"))
    assert any(r.startswith("ray") and 'extra == "cluster"' in r for r in meta.get_all("Requires-Dist"))
    assert "pflbench = benchmarks.cli:main" in entry_points
