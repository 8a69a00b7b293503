"""Running sweeps: the runner, executors and workers, stages, process lifecycle, the GPU lend."""
