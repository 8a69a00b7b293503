"""TF32, ``cuda:N`` and the recorded versions (issue 26, item 4), checked without a GPU."""
from __future__ import annotations

import os
import subprocess
import sys
import types
from pathlib import Path
import warnings

import pytest
import torch

from pfl_core.engine import device as accelerator
from pfl_core.engine.device import configure_device, device_info
from pfl_core.seeding import use_deterministic


@pytest.fixture
def tf32_flags():
    """Leaves this process's TF32 flags as it found them."""
    before = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    yield
    torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = before


def test_tf32_is_off_by_default_and_a_switch_turns_it_on(tf32_flags):
    torch.backends.cudnn.allow_tf32 = True  # PyTorch's own default for convolutions
    configure_device("cpu")
    assert not torch.backends.cuda.matmul.allow_tf32 and not torch.backends.cudnn.allow_tf32
    assert device_info("cpu")["allow_tf32"] is False
    configure_device("cpu", allow_tf32=True)
    assert torch.backends.cuda.matmul.allow_tf32 and torch.backends.cudnn.allow_tf32
    assert device_info("cpu")["allow_tf32"] is True


def test_cuda_n_becomes_the_current_device_and_is_the_one_synchronised(monkeypatch, tf32_flags):
    calls = []
    monkeypatch.setattr(torch.cuda, "set_device", lambda d: calls.append(("set_device", d)))
    monkeypatch.setattr(torch.cuda, "synchronize", lambda d=None: calls.append(("synchronize", d)))
    configure_device("cuda:1")
    configure_device("cuda")  # no index: the current device stays
    accelerator.synchronize("cuda:1")
    accelerator.synchronize("cpu")
    assert calls == [("set_device", torch.device("cuda:1")), ("synchronize", torch.device("cuda:1"))]


def test_the_speed_benchmark_synchronises_its_own_device(monkeypatch):
    from benchmarks.timing import speed

    seen = []
    monkeypatch.setattr(torch.cuda, "synchronize", lambda d=None: seen.append(d))
    speed.sync(torch.device("cuda:1"))
    assert seen == [torch.device("cuda:1")]


def test_a_run_records_its_device_versions_and_tf32(tf32_flags):
    from pfl_core.config import RunConfig
    from pfl_core.experiment import run_experiment

    cfg = RunConfig.from_dict({
        "data": {"dataset": "digits28", "num_clients": 4, "unseen_fraction": 0.25,
                 "partition": {"name": "iid"}},
        "model": {"name": "mlr"}, "method": {"name": "fedavg", "params": {"lr": 0.05, "local_steps": 1}},
        "federation": {"rounds": 1, "clients_per_round": 2, "batch_size": 10},
        "evaluation": {"protocol": "unseen", "params": {"steps": 1, "lr": 0.05}}, "seed": 0})
    info = run_experiment(cfg, device="cpu").info
    assert info["torch_version"] == torch.__version__
    assert info["cuda_version"] == (torch.version.cuda or "")
    assert info["allow_tf32"] is False and info["device_name"]
    assert info["cpu_capability"] == torch.backends.cpu.get_cpu_capability()


def test_the_cpu_capability_recorded_is_the_one_the_kernels_use():
    """ATen's vector level moves CPU rounding (CGPFL Table 1, FMNIST-DNN: DEFAULT and AVX2 differ at
    the 5th digit), so the record must follow ``ATEN_CPU_CAPABILITY``, not the CPU's flags."""
    code = "from pfl_core.engine.device import device_info; print(device_info('cpu')['cpu_capability'])"
    env = {**os.environ, "ATEN_CPU_CAPABILITY": "default"}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "DEFAULT"


def test_a_cpu_run_names_the_cpu_model_not_the_architecture():
    from pfl_core.engine.device import cpu_name

    cpuinfo = Path("/proc/cpuinfo")
    models = [l.split(":", 1)[1].strip() for l in cpuinfo.read_text().splitlines()
              if l.startswith("model name")] if cpuinfo.exists() else []
    if not models:
        pytest.skip("no model name in /proc/cpuinfo")
    assert cpu_name() == models[0] == device_info("cpu")["device_name"]


def test_the_versions_and_tf32_are_tags_of_every_run():
    from benchmarks.store.tracking import Tracker

    spec = types.SimpleNamespace(suite="s", cell_id="c", method="fedavg", seed=0, profile="smoke",
                                 config_hash="h", cell={}, stage=None, config={})
    info = {"device": "cuda:0", "device_name": "NVIDIA H100", "torch_version": "2.9", "cuda_version": "12.8",
            "cudnn_version": "91000", "allow_tf32": False, "cpu_capability": "AVX512"}
    tags = Tracker.run_tags(spec, {"paper": "p"}, {"info": info}, ("abc", False))
    keys = ("device_name", "torch_version", "cuda_version", "cudnn_version", "allow_tf32", "cpu_capability")
    assert {k: tags[k] for k in keys} == {"device_name": "NVIDIA H100", "torch_version": "2.9", "cuda_version": "12.8",
                                          "cudnn_version": "91000", "allow_tf32": "false", "cpu_capability": "AVX512"}


def test_deterministic_mode_warns_when_cuda_was_initialised_before_cublas_was_configured(monkeypatch):
    monkeypatch.delenv("CUBLAS_WORKSPACE_CONFIG", raising=False)
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: True)
    try:
        with pytest.warns(RuntimeWarning, match="too late for cuBLAS"):
            use_deterministic(True)
        with warnings.catch_warnings():
            warnings.simplefilter("error")  # set now: no second warning
            use_deterministic(True)
    finally:
        use_deterministic(False)
