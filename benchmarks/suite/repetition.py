"""How much of the suite files repeats itself: ``python -m benchmarks.suite.repetition [FOLDER]``.

The measure (issue 38, item 2), over every ``*.yml`` and ``*.yaml`` file below ``FOLDER`` (default:
the packaged ``suites/``, shared ``_*.yml`` files included) that a person writes. The tuned-values
files ``*.tuned.yml`` are left out and counted on a line of their own: ``pflbench tune`` writes them
(their header says to edit by re-tuning), one entry per study with the same provenance fields, so
their repetition is a record's schema, not something an author restates.

* a *line* is a line of such a file whose text, stripped of leading and trailing white space, is
  neither empty nor a comment (starts with ``#``); a trailing comment stays part of its line;
* a line *recurs* when its stripped text equals that of at least one other line, in the same file
  or in another (every copy counts, the first included: two equal lines are two recurring lines);
* the *share* is recurring lines / lines;
* the recurring lines split into *bare section keys*, a mapping key with no value on its line
  (``profiles:``, ``- name:``, ``"1000":``) or with only a YAML block-scalar indicator
  (``caption: >``, ``averaging: |-``), whose content follows on the next lines, and *content*, every
  other recurring line (a value, a list item, a flow mapping).

Nothing is parsed as YAML: the measure is about the text a reader sees, so an anchor's alias
(``*warm_p``) is a line of its own and two suites stating ``seeds: [0]`` count twice. Baseline at
issue 38, item 2: 464 of 1,901 lines recur (24.4%), 278 bare section keys (14.6%), 186 content
(9.8%). ``--top N`` lists the N most repeated content lines with their counts.
"""
from __future__ import annotations

import argparse
import re
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

#: a mapping key (a list item's first key too) with nothing after the colon but a block-scalar indicator
BARE_KEY = re.compile(r"""^(- )?[\w.\-"']+:( +[>|][-+0-9]*)?$""")


@dataclass(frozen=True)
class Repetition:
    """The measure of one folder: counts, and the recurring lines by text."""

    files: int
    lines: int
    recurring: int
    bare_keys: int
    counts: Counter
    tuned_files: int = 0
    tuned_lines: int = 0
    """The machine-written ``*.tuned.yml`` files and their lines, not in the measure."""

    @property
    def content(self) -> int:
        return self.recurring - self.bare_keys

    def share(self, count: int) -> float:
        return count / self.lines if self.lines else 0.0


TUNED_SUFFIX = ".tuned.yml"
"""The name ending of the tuned-values files ``pflbench tune`` writes (a suite's default ``tuned.file``)."""


def yaml_files(folder: Path, tuned: bool = False) -> list[Path]:
    """The ``*.yml``/``*.yaml`` files below ``folder``: the written ones, or (``tuned``) the tuned-values files."""
    return sorted(p for p in folder.glob("**/*.y*ml")
                  if p.suffix in (".yml", ".yaml") and p.name.endswith(TUNED_SUFFIX) == tuned)


def file_lines(files: list[Path]) -> list[str]:
    """The stripped non-blank, non-comment lines of ``files``."""
    return [s for p in files for s in (line.strip() for line in p.read_text(encoding="utf-8").splitlines())
            if s and not s.startswith("#")]


def measure(folder: Path) -> Repetition:
    """The repetition of the suite files below ``folder`` (module docstring)."""
    files, tuned = yaml_files(folder), yaml_files(folder, tuned=True)
    lines = file_lines(files)
    counts = Counter(lines)
    recurring = [s for s in lines if counts[s] > 1]
    bare = sum(1 for s in recurring if BARE_KEY.match(s))
    return Repetition(len(files), len(lines), len(recurring), bare,
                      Counter({s: n for s, n in counts.items() if n > 1}), len(tuned), len(file_lines(tuned)))


def report(rep: Repetition, top: int = 0) -> str:
    """The measure as printed by the command line."""
    out = [f"suite lines (non-blank, non-comment): {rep.lines} in {rep.files} files",
           f"recurring elsewhere: {rep.recurring} ({rep.share(rep.recurring):.1%})",
           f"  bare section keys: {rep.bare_keys} ({rep.share(rep.bare_keys):.1%})",
           f"  content:           {rep.content} ({rep.share(rep.content):.1%})"]
    if rep.tuned_files:
        out.append(f"not counted: {rep.tuned_lines} lines in {rep.tuned_files} tuned-values file(s) "
                   f"(*{TUNED_SUFFIX}, written by pflbench tune)")
    content = [(n, s) for s, n in rep.counts.most_common() if not BARE_KEY.match(s)]
    out += [f"  {n:3d}x {s[:110]}" for n, s in content[:top]]
    return "\n".join(out)


def main(argv: list[str] | None = None) -> None:
    from benchmarks.suite.packaged import suites_dir

    parser = argparse.ArgumentParser(prog="python -m benchmarks.suite.repetition", description=__doc__.split("\n")[0])
    parser.add_argument("folder", nargs="?", type=Path, default=None, help="default: the packaged suites/")
    parser.add_argument("--top", type=int, default=0, help="list the N most repeated content lines")
    args = parser.parse_args(argv)
    print(report(measure(args.folder or suites_dir()), args.top))


if __name__ == "__main__":
    main()
