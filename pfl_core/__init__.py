"""pfl_core: a thin, readable core for personalized federated learning research.

Data (resident tensors, partitioners, client splits), models, algorithms, the federation loop and
evaluation protocols. It imports neither MLflow, Optuna nor YAML; ``benchmarks`` is the harness.
The distribution's version is written once, in ``benchmarks.__version__`` (``pflbench --version``).
"""
