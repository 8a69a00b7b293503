"""What a suite file names that this checkout does not register (methods, datasets, models,
protocols, analyses, config keys), read from the raw YAML without loading the suite.

The MetaVers suites name pieces other engineers write in parallel (issue 13); until those land,
the tests that load such a suite skip with this list as their reason, and every other check of
the suite (grids, published numbers, hyperparameter rows, profiles) runs on the raw YAML."""
from __future__ import annotations

from pathlib import Path
from typing import Any, Iterator


from benchmarks.suite.schema import FREE_FORM, SCHEMA_KEYS, leaves as _leaves
from pfl_core.algorithms import METHODS
from pfl_core.data import DATASETS
from pfl_core.evaluation import PROTOCOLS
from pfl_core.models import MODELS
from benchmarks.suite.file import read_suite_file

REGISTRIES = {"method.name": ("method", METHODS), "data.dataset": ("dataset", DATASETS),
              "model.name": ("model", MODELS), "evaluation.protocol": ("protocol", PROTOCOLS)}


def _settings(raw: dict) -> Iterator[dict]:
    """Every mapping of dotted keys to values the suite sets (base as dotted leaves)."""
    yield _leaves(raw.get("base") or {})
    for axis in raw.get("grid") or []:
        for value in axis.get("values") or []:
            yield value.get("set") or {} if isinstance(value, dict) else {axis["key"]: value}
    sections = [raw] + list((raw.get("profiles") or {}).values())
    for section in sections:
        section = section or {}
        if section is not raw:
            yield section.get("set") or {}
        yield from ((section.get("methods") or {}).values())
        yield from ((entry.get("set") or {}) for entry in section.get("overrides") or [])


def _known_key(key: str) -> bool:
    """A schema key, or a leaf under a schema key whose value is a mapping (``data.source_splits.train``)
    or under a free-form section (``method.params.lr``)."""
    parts = key.split(".")
    prefixes = {".".join(parts[:i]) for i in range(2, len(parts) + 1)} or {key}
    return bool(prefixes & (set(SCHEMA_KEYS) | {p for p in FREE_FORM if p in SCHEMA_KEYS}))


def _analyses(value: Any) -> list[str]:
    return [a.get("name") for a in value if isinstance(a, dict)] if isinstance(value, list) else []


def unregistered(path: Path) -> list[str]:
    """``["method 'metavers'", "config key 'federation.early_stopping'", ...]`` (empty: all known)."""
    raw = read_suite_file(Path(path))
    missing = []
    method_keys = set(raw.get("methods") or {})
    for prof in (raw.get("profiles") or {}).values():
        method_keys |= set((prof or {}).get("methods") or {})
    missing += [f"method {m!r}" for m in sorted(method_keys) if m not in METHODS]
    for setting in _settings(raw):
        for key, value in _leaves(setting).items() if not all("." in k for k in setting) else setting.items():
            if not _known_key(key):
                missing.append(f"config key {key!r}")
            if key in REGISTRIES and value not in REGISTRIES[key][1]:
                missing.append(f"{REGISTRIES[key][0]} {value!r}")
            if key == "evaluation.analyses":
                try:
                    from pfl_core.analysis import ANALYSES
                except ImportError:
                    missing.append("pfl_core.analysis (evaluation.analyses)")
                    continue
                missing += [f"analysis {a!r}" for a in _analyses(value) if a not in ANALYSES]
    return sorted(set(missing))
