"""A second reference beside the paper: what a re-run of the authors' released code gives.

A suite may carry, per cell, the per-seed values of such a re-run (issue 17). The provenance of
every value is data, checked when the suite is loaded: a value names a source, and a source says
which repository, commit and local edits ran, on which data, for how many rounds, on what machine
and when. A value without a source, a source without one of these fields, or a cell outside the
grid fails with the file and the key::

    code_reference:
      sources:
        authors-ae46d39:                      # any name; values refer to it
          repository: annaVettoruzzo/CAFeMe   # required: where the code is
          commit: ae46d39                     # required: the exact commit that ran
          local_edits: ["..."]                # required: every local change ([] when none)
          rounds: 1000                        # required
          data: "RMNIST, shards partition"    # required: dataset, partition, clients
          machine: CPU                        # required
          date: "2026-11-20"                  # required: when it ran (free text)
          metric: "mean of steps 48-50"       # optional: how a value was read off the code
          notes: "..."                        # optional
      values:
        - cell: {dataset: rmnist, partition: shards, method: cafeme}
          source: authors-ae46d39
          seeds: {0: 98.61, 1: 98.14, 2: 98.85}   # seed -> value, in the metric's unit

Seeds of the authors' code are not this project's seeds (other streams draw the partition and the
initial model), so the report compares the two sets of seeds as distributions, never per seed.

A leaf module: :func:`benchmarks.suite.spec.load_suite` calls :func:`parse_code_reference` with its own
key and cell checks and its error class, so the messages read like every other suite error.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import numpy as np

#: ``pflbench report --help``: the two references a cell is compared with
REPORT_HELP = """\
Each cell of a table is compared with two references:

  paper     the number the paper prints (the suite's `published`, with its source);
  code ref  what the authors' released code gives when re-run (the suite's `code_reference`):
            per-seed values, each naming a source whose provenance is data beside it
            (repository, commit, local edits, rounds, data, machine, date). Such values come
            from running the authors' repository ourselves, never from the paper; a suite
            without them shows no code column.

Both comparisons use one rule: reproduced when |ours - reference| <= 2 * sqrt(SE_ours^2 +
SE_ref^2) (the paper's +- converted to a standard error; the code's SEM over its seeds), else
above or below. The label puts the two verdicts into words: "reproduces the paper", "matches
the authors' code, below the paper", "below both", "not run", ... The PDF's first page counts
verdicts and labels per table, with Kendall's tau and the switches in force."""

SECTION_KEYS = {"sources", "values"}
PROVENANCE_REQUIRED = {"repository", "commit", "local_edits", "rounds", "data", "machine", "date"}
PROVENANCE_KEYS = PROVENANCE_REQUIRED | {"metric", "notes"}
VALUE_KEYS = {"cell", "source", "seeds"}


@dataclass(frozen=True)
class CodeReference:
    """One cell's values from the authors' code, with the provenance of their source."""

    cell: dict[str, str]
    source: str
    provenance: dict
    seeds: dict[int, float]

    @property
    def values(self) -> list[float]:
        return [self.seeds[s] for s in sorted(self.seeds)]

    @property
    def mean(self) -> float:
        return float(np.mean(self.values))

    @property
    def short(self) -> str:
        """``owner/repo@commit``: the column's footnote key."""
        return f"{self.provenance['repository']}@{self.provenance['commit']}"

    def describe(self) -> str:
        """One line of provenance: repository, commit, edits, seeds, rounds, data, machine, date."""
        p = self.provenance
        edits = "; ".join(p["local_edits"]) if p["local_edits"] else "none"
        seeds = ", ".join(f"{s}: {v:g}" for s, v in sorted(self.seeds.items()))
        line = (f"{self.short}, local edits: {edits}; seeds {{{seeds}}}; {p['rounds']} rounds; "
                f"data: {p['data']}; machine: {p['machine']}; date: {p['date']}")
        return line + (f"; metric: {p['metric']}" if p.get("metric") else "")


class Checks:
    """What the suite loader lends the parser: its key check ``keys(mapping, allowed, where,
    required)``, its cell check ``cell(cell, where) -> normalised cell`` and its error class."""

    def __init__(self, keys: Callable, cell: Callable[[Any, str], dict[str, str]], error: type[Exception]):
        self.keys, self.cell, self.error = keys, cell, error


def _number(value: Any, where: str, check: Checks) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise check.error(f"{where}: expected a finite number, got {value!r}")
    return float(value)


def _sources(section: Any, where: str, check: Checks) -> dict[str, dict]:
    if not isinstance(section, dict) or not section:
        raise check.error(f"{where}: expected a mapping of source names to their provenance "
                         f"(keys {sorted(PROVENANCE_REQUIRED)})")
    out = {}
    for name, provenance in section.items():
        at = f"{where}.{name}"
        check.keys(provenance, PROVENANCE_KEYS, at, PROVENANCE_REQUIRED)
        for key in sorted(PROVENANCE_REQUIRED - {"local_edits", "rounds"}):
            if not isinstance(provenance[key], str) or not provenance[key].strip():
                raise check.error(f"{at}.{key}: expected a non-empty string, got {provenance[key]!r}")
        if not isinstance(provenance["local_edits"], list) or not all(
                isinstance(e, str) and e.strip() for e in provenance["local_edits"]):
            raise check.error(f"{at}.local_edits: expected a list of the local changes, one string "
                              f"each ([] when the code ran unchanged)")
        rounds = provenance["rounds"]
        if isinstance(rounds, bool) or not isinstance(rounds, int) or rounds < 1:
            raise check.error(f"{at}.rounds: expected a positive integer, got {rounds!r}")
        out[str(name)] = dict(provenance)
    return out


def parse_code_reference(section: Any, where: str, check: Checks) -> list[CodeReference]:
    """Validate a suite's ``code_reference`` section (``where``: file and key, for messages);
    return one :class:`CodeReference` per value, cells normalised by ``check.cell``."""
    if section is None:
        return []
    check.keys(section, SECTION_KEYS, where, SECTION_KEYS)
    sources = _sources(section["sources"], f"{where}.sources", check)
    if not isinstance(section["values"], list):
        raise check.error(f"{where}.values: expected a list of {{cell, source, seeds}}")
    out: list[CodeReference] = []
    for i, entry in enumerate(section["values"]):
        at = f"{where}.values[{i}]"
        check.keys(entry, VALUE_KEYS, at, VALUE_KEYS)
        cell = check.cell(entry["cell"], f"{at}.cell")
        if entry["source"] not in sources:
            raise check.error(f"{at}.source: {entry['source']!r} is not a source of code_reference.sources; "
                              f"sources: {sorted(sources)}")
        seeds = entry["seeds"]
        if not isinstance(seeds, dict) or not seeds:
            raise check.error(f"{at}.seeds: expected a mapping seed -> value (in the metric's unit)")
        values = {}
        for seed, value in seeds.items():
            if isinstance(seed, bool) or not isinstance(seed, int):
                raise check.error(f"{at}.seeds: seed {seed!r} is not an integer")
            values[seed] = _number(value, f"{at}.seeds.{seed}", check)
        if any(ref.cell == cell for ref in out):
            raise check.error(f"{at}.cell: {cell} already has a code reference")
        out.append(CodeReference(cell, str(entry["source"]), sources[entry["source"]], values))
    return out
