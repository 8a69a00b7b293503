"""benchmarks: the harness around pfl_core (suites, runner, MLflow tracking, reports, CLI)."""
