"""Timing tools, each a command (``python -m benchmarks.timing.<tool>``), never run by a test for
its numbers:

* :mod:`~benchmarks.timing.speed`: one round of fixed workloads on both execution paths beside the
  device's matmul rate (the README's speed table);
* :mod:`~benchmarks.timing.round_timing`: a suite's real rounds timed and projected to the whole
  profile (how long a table takes before it is run);
* :mod:`~benchmarks.timing.block_timing`: one model block's step, for profiling a model.
"""
