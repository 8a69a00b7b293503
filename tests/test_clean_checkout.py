"""No command writes into the checkout (issue 38, item 3): ``pflbench tune``, ``run`` and
``report`` on the demo suite (smoke profile, one cell) in a clean clone of this repository, with
the stores outside it, leave ``git status`` empty and no hidden file (a lock, a temporary file)."""
from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import REPO_ROOT


def _git(cwd: Path, *args: str) -> str:
    return subprocess.run(["git", *args], cwd=cwd, capture_output=True, text=True, check=True).stdout


def clean_clone(target: Path) -> Path:
    """A clone of this repository at ``target`` holding the working tree's tracked and new files
    (committed there), so that the test checks the code as it is now."""
    if shutil.which("git") is None or not (REPO_ROOT / ".git").exists():
        pytest.skip("needs git and a git checkout")
    subprocess.run(["git", "clone", "-q", "--no-hardlinks", str(REPO_ROOT), str(target)], check=True)
    changed = _git(REPO_ROOT, "ls-files", "-m", "-o", "--exclude-standard", "-z").split("\0")
    for name in filter(None, changed):
        source, dest = REPO_ROOT / name, target / name
        if source.is_file():
            dest.parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(source, dest)
        elif not source.exists():
            dest.unlink(missing_ok=True)
    if _git(target, "status", "--porcelain"):
        _git(target, "add", "-A")
        _git(target, "-c", "user.name=test", "-c", "user.email=test@localhost", "commit", "-q", "-m", "working tree")
    assert _git(target, "status", "--porcelain") == ""
    return target


def hidden_files(root: Path) -> list[str]:
    """Files or folders whose name starts with a dot, outside ``.git``."""
    found = []
    for folder, dirs, files in os.walk(root):
        dirs[:] = [d for d in dirs if d != ".git"]
        found += [str(Path(folder, n).relative_to(root)) for n in [*dirs, *files] if n.startswith(".")]
    return found


@pytest.mark.slow
def test_tune_run_and_report_write_nothing_into_a_clean_clone(tmp_path):
    clone = clean_clone(tmp_path / "clone")
    before = set(hidden_files(clone))
    env = {k: v for k, v in os.environ.items() if k != "MLFLOW_TRACKING_URI"}
    env["PFLBENCH_RESULTS_DIR"] = str(tmp_path / "results")
    cell = ["--device", "cpu", "--profile", "smoke"]
    commands = [
        ["tune", "suites/demo/offline.yaml", "--method", "fedavg", "--cell", "setting=synthetic-seen",
         "--trials", "1", "--seeds", "1000", *cell],
        ["run", "suites/demo/offline.yaml", "--only", "setting=synthetic-seen", "--only", "method=fedavg",
         "--report", *cell],
        ["report", "suites/demo/offline.yaml", "--profile", "smoke"],
    ]
    for argv in commands:
        proc = subprocess.run([sys.executable, "-m", "benchmarks.cli", *argv], cwd=clone, env=env,
                              capture_output=True, text=True, timeout=300)
        assert proc.returncode == 0, f"{argv}: {proc.stdout[-2000:]} {proc.stderr[-3000:]}"
        assert _git(clone, "status", "--porcelain") == "", f"after pflbench {argv[0]}"
        assert set(hidden_files(clone)) == before, f"after pflbench {argv[0]}"
    assert list((tmp_path / "results" / "locks").glob("*.lock"))  # the tuned file's lock went there
