"""How a run uses its accelerator (issue 26, item 4): TF32, the CUDA device, and what is recorded.

* **TF32 off by default.** PyTorch lets cuDNN convolutions use TF32 by default
  (``torch.backends.cudnn.allow_tf32 = True``; cuBLAS matmuls not: ``torch.backends.cuda.matmul.allow_tf32
  = False``; PyTorch docs, "TensorFloat-32 (TF32) on Ampere (and later) devices"). TF32 keeps a
  10-bit mantissa, so a GPU run would differ from the CPU by more than float32 rounding, which is
  all the README promises. Every run sets both flags to ``allow_tf32`` (default False: a harness
  choice, the switch is ``pflbench run --allow-tf32``) and records them.
* **``cuda:N``.** :func:`configure_device` makes device N the current CUDA device
  (``torch.cuda.set_device``), so that work placed on "the current device" (cuBLAS handles,
  ``torch.cuda.synchronize()``, default streams) lands on the device the run was given.
* **Recorded.** :func:`device_info`: the device's name, torch, CUDA and cuDNN versions, the TF32
  flags and the CPU kernels' vector level (ATen's CPU capability: DEFAULT, AVX2, AVX512, ...), in
  every run's ``info`` (hence its tags and ``run_info.json``). The last one moves CPU numbers: CGPFL
  Table 1's FMNIST-DNN Per-FedAvg-HF seed 0 evaluated 0.2914370 at round 3 under ``DEFAULT`` and
  0.2914704 under ``AVX2``, same commit and configuration (``ATEN_CPU_CAPABILITY`` pins it).
"""
from __future__ import annotations

import platform
from pathlib import Path

import torch


def configure_device(device: torch.device | str, allow_tf32: bool = False) -> None:
    """Set the TF32 flags of this process to ``allow_tf32`` and, for ``cuda:N``, make N current.
    Neither initialises CUDA on a CPU run."""
    device = torch.device(device)
    torch.backends.cuda.matmul.allow_tf32 = allow_tf32
    torch.backends.cudnn.allow_tf32 = allow_tf32
    if device.type == "cuda" and device.index is not None:
        torch.cuda.set_device(device)


def cpu_name() -> str:
    """The CPU's model name (Linux: ``/proc/cpuinfo``), else what :mod:`platform` knows."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def device_info(device: torch.device | str) -> dict:
    """What a run's numbers depend on besides its configuration: the device's name, the torch,
    CUDA and cuDNN versions, the TF32 flags and ATen's CPU capability (the vector kernels it
    dispatches to on this CPU, ``ATEN_CPU_CAPABILITY`` when set)."""
    device = torch.device(device)
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else cpu_name()
    cudnn = torch.backends.cudnn.version() if device.type == "cuda" else None
    return {"device_name": name, "torch_version": torch.__version__, "cuda_version": torch.version.cuda or "",
            "cudnn_version": "" if cudnn is None else str(cudnn),
            "allow_tf32": bool(torch.backends.cuda.matmul.allow_tf32 or torch.backends.cudnn.allow_tf32),
            "cpu_capability": torch.backends.cpu.get_cpu_capability()}


def synchronize(device: torch.device | str) -> None:
    """Wait for the work queued on ``device`` (that device, not the current one); no-op off CUDA."""
    device = torch.device(device)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
