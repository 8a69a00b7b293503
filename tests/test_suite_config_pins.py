"""Every packaged suite expands, profile by profile, to the config hashes pinned in
``tests/data/suite_config_hashes.json``: moving values between a suite and its shared files
(``extends``), reordering keys or refactoring the loader changes no run's identity. A deliberate
change (a corrected suite value, a ``CONFIG_VERSION`` bump) rewrites the pins:
``python tests/test_suite_config_pins.py --write``, committed with the change that moved them."""
from __future__ import annotations

import hashlib
import json
import sys
from pathlib import Path

import pytest

from benchmarks.suite.packaged import suite_names
from benchmarks.suite.spec import load_suite

PINS = Path(__file__).parent / "data" / "suite_config_hashes.json"


def fingerprint(name: str) -> dict[str, list]:
    """profile -> [number of runs, digest of the sorted (cell, seed, config hash) triples]."""
    suite = load_suite(name)
    out = {}
    for profile in suite.profiles:
        rows = sorted(f"{s.cell_id}|{s.seed}|{s.config_hash}" for s in suite.expand(profile))
        out[profile] = [len(rows), hashlib.sha256("\n".join(rows).encode()).hexdigest()[:16]]
    return out


@pytest.mark.parametrize("name", suite_names())
def test_suite_config_hashes_unchanged(name):
    pinned = json.loads(PINS.read_text())
    assert name in pinned, f"{name} has no pinned hashes: python tests/test_suite_config_pins.py --write"
    assert fingerprint(name) == pinned[name], (
        f"{name}: the expanded config hashes moved (profile -> [runs, digest]); if deliberate, rewrite the "
        f"pins with python tests/test_suite_config_pins.py --write and say why in the commit")


def test_every_pinned_suite_still_exists():
    assert sorted(json.loads(PINS.read_text())) == suite_names()


if __name__ == "__main__" and sys.argv[1:] == ["--write"]:
    PINS.write_text(json.dumps({n: fingerprint(n) for n in suite_names()}, indent=1, sort_keys=True) + "\n")
    print(f"wrote {PINS}")
