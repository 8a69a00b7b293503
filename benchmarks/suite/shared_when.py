"""The conditions of a shared file's overrides and marks, fitted to one suite that extends it.

A shared file's ``overrides`` and ``marks`` (and its profiles' ``overrides``) may name, in their
``when``, any label of the paper: a label of the suite's own axis, or a grid value of the suite's
shared files (``grid_values``). A suite lists only some of the paper's grid values, so in each suite
such an entry applies to the labels the suite has: a grid value the suite does not list is left out
of the condition, and an entry left with no label on one of its axes applies to no cell and is left
out. (``{when: {setting: [domainnet-a1000, domainnet-a0.5]}, ...}`` reads as ``{when: {setting:
[domainnet-a0.5]}, ...}`` in a suite whose setting axis has only ``domainnet-a0.5``.) This changes no
cell's configuration: a label that no cell has matches nothing either way. A label that is neither
the suite's nor a shared grid value (a typo) fails when the suite loads, in one line naming the
shared file; an axis the suite lacks fails as in the suite itself. A suite's own entries are checked
as written: there, every label must be one of the suite's.
"""
from __future__ import annotations

from pathlib import Path
from typing import Any

from benchmarks.suite.schema import SuiteError


def suite_labels(grid: Any) -> dict[str, list[str]]:
    """Axis name -> the labels a suite file's own grid lists (as written: before shared values are read)."""
    out: dict[str, list[str]] = {}
    for axis in grid if isinstance(grid, list) else []:
        if isinstance(axis, dict) and isinstance(axis.get("values"), list):
            out[str(axis.get("name"))] = [str(v.get("label")) if isinstance(v, dict) else str(v)
                                          for v in axis["values"]]
    return out


def fit_entries(entries: Any, labels: dict[str, list[str]], named: set[str], where: str) -> Any:
    """``entries`` (a list of ``{when, ...}``) with each condition cut to the labels the suite has
    (module docstring); anything not of that shape is returned as it is, for the suite's checks."""
    if not isinstance(entries, list):
        return entries
    out = []
    for i, entry in enumerate(entries):
        when = entry.get("when") if isinstance(entry, dict) else None
        if not isinstance(when, dict):
            out.append(entry)
            continue
        fitted, applies = {}, True
        for axis, want in when.items():
            if str(axis) not in labels:  # fails in the suite's checks (unknown axis), naming the axes
                fitted[axis] = want
                continue
            wants = want if isinstance(want, list) else [want]
            for label in wants:
                if str(label) not in labels[str(axis)] and str(label) not in named:
                    raise SuiteError(f"{where}[{i}].when.{axis}: {label!r} is not a label of the axis in this suite "
                                     f"({labels[str(axis)]}) nor a grid value of its shared files; correct it or "
                                     f"add it to grid_values")
            kept = [label for label in wants if str(label) in labels[str(axis)]]
            applies = applies and bool(kept)
            fitted[axis] = kept if isinstance(want, list) else (kept or [want])[0]
        if applies:
            out.append({**entry, "when": fitted})
    return out


def fit_shared(shared: dict, labels: dict[str, list[str]], named: set[str], file: Path) -> dict:
    """A shared file's mapping with its ``overrides``, ``marks`` and profiles' ``overrides`` fitted to
    the suite whose own axes list ``labels`` (``named``: the grid values of the suite's shared files)."""
    out = dict(shared)
    for key in ("overrides", "marks"):
        if key in out:
            out[key] = fit_entries(out[key], labels, named, f"{file}: {key}")
    profiles = out.get("profiles")
    if isinstance(profiles, dict):
        out["profiles"] = {name: {**p, "overrides": fit_entries(p["overrides"], labels, named,
                                                                f"{file}: profiles.{name}.overrides")}
                           if isinstance(p, dict) and "overrides" in p else p for name, p in profiles.items()}
    return out
