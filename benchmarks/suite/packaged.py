"""The suites that ship inside the package, named ``<paper>/<name>`` (``pflbench run cafeme/table1``).

The suite files live in the repository's ``suites/<paper>/<name>.yaml``; ``benchmarks/suites`` is a
link to that folder, so a checkout, an editable install and a built wheel (where setuptools copies
the files themselves, ``package-data`` in pyproject.toml) all read the same files from
:func:`suites_dir`. A suite argument is a path when that file exists, else a short name;
``report --paper`` and a snapshot's suite read a ``suites/`` folder in the current directory first
(:func:`suite_folders`).
"""
from __future__ import annotations

import re
from pathlib import Path

from benchmarks.suite.schema import SuiteError

SHORT_NAME = re.compile(r"(?P<paper>[\w-]+)/(?P<name>[\w-]+)(\.yaml)?")
"""A short name: ``paper/name``, optionally with the ``.yaml`` suffix."""
LIST_HINT = "`pflbench list suites` lists the packaged names"


def suite_folders() -> list[Path]:
    """Where ``report --paper`` and a snapshot look for a paper's suite files, first match wins: a
    ``suites/`` folder in the current directory (a checkout's root, or one's own suites), then the
    packaged suites."""
    return [Path("suites"), suites_dir()]


def suite_file(key: str) -> Path:
    """The suite file of ``<paper>/<name>`` (a snapshot's suite): the first of :func:`suite_folders`
    that holds it; :class:`SuiteError` when none does."""
    for folder in suite_folders():
        if (folder / f"{key}.yaml").is_file():
            return folder / f"{key}.yaml"
    raise SuiteError(f"suite {key}: no suites/{key}.yaml here and no packaged suite of that name; {LIST_HINT}")


def suites_dir() -> Path:
    """The folder of the packaged suite files (``<paper>/<name>.yaml`` below it)."""
    return (Path(__file__).parents[1] / "suites").resolve()


def suite_names() -> list[str]:
    """Every packaged suite's short name, sorted."""
    return sorted(p.relative_to(suites_dir()).with_suffix("").as_posix() for p in suites_dir().glob("*/*.yaml"))


def resolve_suite(suite: str | Path) -> Path:
    """The suite file ``suite`` names: the path itself when that file exists, else the packaged
    suite of that short name; :class:`SuiteError` (one line) when it is neither."""
    path = Path(suite)
    if path.exists():
        return path
    short = SHORT_NAME.fullmatch(str(suite))
    if short:
        packaged = suites_dir() / short["paper"] / f"{short['name']}.yaml"
        if packaged.is_file():
            return packaged
    raise SuiteError(f"suite file {path} does not exist and is no packaged suite (<paper>/<name>); {LIST_HINT}")
