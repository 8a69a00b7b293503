"""benchmarks: the harness around pfl_core (suites, runner, MLflow tracking, reports, CLI)."""

__version__ = "0.4.0"
"""The version of the ``pflbench`` distribution: the one place it is written (pyproject.toml reads it,
``pflbench --version`` prints it, CHANGELOG.md lists what each version holds)."""
