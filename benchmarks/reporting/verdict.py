"""The verdict of one cell: reproduced, above, below, partial, failed, not run (or no reference).

Pure: numbers in, a :class:`Verdict` out. The rule, in order:

1. ``not run``: no run of the cell finished or failed.
2. ``failed``: every run failed; the detail carries the reasons.
3. ``partial``: 0 < finished < expected seeds; the detail still gives the provisional comparison.
4. ``no reference``: the paper prints no number for the cell (ours only).
5. Otherwise compare d = ours - paper with a bound:

   * the paper gives a spread: bound = 2 * sqrt(se_ours^2 + se_paper^2), where se_paper is the
     paper's +- converted to a standard error of the mean (:func:`paper_sem`) and se_ours the SEM
     of our per-seed values (ddof 1). With one seed our SE is unknown and counts as 0 (said so);
   * the paper gives no spread: bound = ``metric.tolerance`` (absolute, in the metric's unit);
     without a tolerance, 2 * se_ours when we have two seeds or more; else ``undecided``.

   ``reproduced`` when |d| <= bound (the edge counts as reproduced), else ``above`` or ``below``.

The same rule compares ours with a second reference, a re-run of the authors' code
(:mod:`benchmarks.suite.code_reference`): its per-seed values are known, so its SE is their SEM (ddof 1)
and its spread needs no conversion. :func:`label` puts the two verdicts into plain words.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

REPRODUCED, ABOVE, BELOW, PARTIAL = "reproduced", "above", "below", "partial"
FAILED, NOT_RUN, NO_REFERENCE, UNDECIDED = "failed", "not run", "no reference", "undecided"
VERDICTS = (REPRODUCED, ABOVE, BELOW, PARTIAL, FAILED, NOT_RUN, NO_REFERENCE, UNDECIDED)

LEGEND = {
    REPRODUCED: "|ours − paper| ≤ the bound: 2·√(SE_ours² + SE_paper²) (rule 2SE), or the suite's "
                "absolute tolerance where the paper gives no spread (rule tol)",
    ABOVE: "ours exceeds the paper by more than the bound",
    BELOW: "ours falls short of the paper by more than the bound",
    PARTIAL: "only k of n seeds finished; the comparison in brackets is provisional",
    FAILED: "every run of the cell failed (reason given)",
    NOT_RUN: "no run of the cell in the store for this profile",
    NO_REFERENCE: "the paper prints no number for this cell",
    UNDECIDED: "the paper gives no spread, the suite no tolerance, and we have one seed",
}
RULES = {
    "2SE": "2·√(SE_ours² + SE_ref²), SE = std/√n; the paper's ± converted by its kind and runs, the "
           "authors' code's SE the SEM (ddof 1) of its per-seed values",
    "2SE*": "2·SE_ref only: one seed of ours, our SE unknown",
    "tol": "the suite's absolute metric.tolerance (the reference gives no spread)",
    "2SE(ours)": "2·SE_ours: the reference gives no spread and the suite no tolerance",
}


ONE_SEED = "one seed"
"""A partial cell with a single finished seed reads ``one seed of n (...)``: a spot check, whose
comparison says "within the bound" where more seeds would say reproduced."""
ONE_SEED_WORDS = {REPRODUCED: "within the bound"}


@dataclass(frozen=True)
class Verdict:
    verdict: str
    rule: str = ""
    bound: float = math.nan
    diff: float = math.nan
    detail: str = ""
    compared: str = ""
    """The comparison alone (reproduced/above/below/undecided/no reference), also for ``partial``."""


def _finite(x: float | None) -> bool:
    return x is not None and not (isinstance(x, float) and math.isnan(x))


def paper_sem(pm: float | None, pm_kind: str | None, runs: int | None, ddof: int = 0) -> float:
    """The paper's +- as a standard error of the mean (NaN when it cannot be known).

    ``sem``: as printed. ``std`` over ``runs`` runs with ``ddof``: the unbiased std is
    pm * sqrt((runs - ddof) / (runs - 1)), and the SEM that over sqrt(runs); for ddof 1 this is
    pm / sqrt(runs). Without ``runs`` a std cannot be converted: NaN.
    """
    if not _finite(pm) or pm_kind in (None, "", "none"):
        return math.nan
    if pm_kind == "sem":
        return float(pm)
    if pm_kind != "std" or not runs or runs < 2 or runs - ddof <= 0:
        return math.nan
    return float(pm) * math.sqrt((runs - ddof) / (runs - 1)) / math.sqrt(runs)


def compare(ours: float, se_ours: float, paper: float, se_paper: float,
            tolerance: float | None) -> Verdict:
    """reproduced / above / below (or undecided) for one cell with numbers on both sides."""
    diff = ours - paper
    if _finite(se_paper):
        rule = "2SE" if _finite(se_ours) else "2SE*"
        bound = 2.0 * math.sqrt(se_paper ** 2 + (se_ours ** 2 if _finite(se_ours) else 0.0))
    elif tolerance is not None:
        rule, bound = "tol", float(tolerance)
    elif _finite(se_ours):
        rule, bound = "2SE(ours)", 2.0 * se_ours
    else:
        return Verdict(UNDECIDED, "", math.nan, diff, "no spread on either side and no tolerance", UNDECIDED)
    kind = REPRODUCED if abs(diff) <= bound else (ABOVE if diff > 0 else BELOW)
    return Verdict(kind, rule, bound, diff, compared=kind)


def decide(*, finished: int, expected: int, failed: int, ours: float, se_ours: float,
           paper: float | None, se_paper: float, tolerance: float | None,
           failure_reason: str = "") -> Verdict:
    """The verdict of one cell (rule order in the module docstring)."""
    if finished == 0:
        if failed == 0:
            return Verdict(NOT_RUN)
        return Verdict(FAILED, detail=failure_reason or "no reason recorded")
    result = (compare(ours, se_ours, paper, se_paper, tolerance) if _finite(paper)
              else Verdict(NO_REFERENCE, compared=NO_REFERENCE))
    if finished < expected:
        extra = f"; {failed} failed: {failure_reason}" if failed else ""
        seen = result.verdict
        if finished == 1:  # a spot check: never called reproduced on one seed (issue 37)
            seen = ONE_SEED_WORDS.get(seen, seen)
            return Verdict(PARTIAL, result.rule, result.bound, result.diff,
                           f"{ONE_SEED} of {expected} ({seen}){extra}", result.compared)
        return Verdict(PARTIAL, result.rule, result.bound, result.diff,
                       f"{finished}/{expected} ({seen}){extra}", result.compared)
    return result


# ---------------------------------------------------------------- plain-words labels (issue 17)

PAPER_WORDS = {REPRODUCED: "reproduces the paper", ABOVE: "above the paper", BELOW: "below the paper",
               UNDECIDED: "undecided against the paper", NO_REFERENCE: "no published number"}
CODE_WORDS = {REPRODUCED: "matches the authors' code", ABOVE: "above the authors' code",
              BELOW: "below the authors' code", UNDECIDED: "undecided against the authors' code"}
BOTH = {(REPRODUCED, REPRODUCED): "reproduces the paper and the authors' code",
        (ABOVE, ABOVE): "above both", (BELOW, BELOW): "below both"}
LABEL_RULE = ("label: the verdict against the paper and the one against the authors' code in words; "
              "'matches the authors' code, below the paper' = within the bound of the code's values, "
              "below the paper's beyond it; 'below both' / 'above both' = beyond both bounds")


def label(paper: Verdict, code: Verdict | None = None) -> str:
    """The cell in plain words, from its verdict against the paper and, when the suite has one, the
    verdict against the authors' code (same rule): e.g. "reproduces the paper", "matches the
    authors' code, below the paper", "below both", "not run"; "partial k/n: ..." is provisional."""
    if paper.verdict in (NOT_RUN, FAILED):
        return paper.verdict
    p = paper.compared or paper.verdict
    c = (code.compared or code.verdict) if code is not None else None
    if c is None or c == NO_REFERENCE:
        words = "no reference" if p == NO_REFERENCE else PAPER_WORDS[p]
    elif (p, c) in BOTH:
        words = BOTH[p, c]
    elif p == REPRODUCED:
        words = f"{PAPER_WORDS[p]}, {CODE_WORDS[c]}"
    else:
        words = f"{CODE_WORDS[c]}, {PAPER_WORDS[p]}"
    if paper.verdict == PARTIAL and paper.detail.startswith(ONE_SEED):
        expected = paper.detail[len(ONE_SEED):].split()[1]
        return f"{ONE_SEED} of {expected} (a spot check): " + words.replace(PAPER_WORDS[REPRODUCED], "within the paper's bound")
    if paper.verdict == PARTIAL:
        return f"partial {paper.detail.split(' ')[0]}: {words}"
    return words
