"""A stand-in accelerator for CPU tests of the GPU path (issue 26, item 1).

:class:`StandInTensor` is a CPU tensor that *reports* another device (``meta``: the one non-CPU
device whose autograd and stream bookkeeping work in a CPU-only process; a tensor that reported
``cuda`` would make autograd ask the CUDA driver for a stream). :class:`DeviceGuard`, a
``TorchDispatchMode``, sees every aten operation of the code under test, computes it on the CPU
and keeps the stand-in device on the outputs that a real GPU would place there. It records as
violations what would fail or stall on a GPU:

* ``mismatch``: an operation mixing device tensors with host tensors of one or more dimensions
  (CUDA raises "Expected all tensors to be on the same device"); explicit copies (``.to``,
  ``copy_``) and host index tensors of ``x[index]`` are allowed, as on CUDA, and counted as
  host-to-device copies; 0-d host tensors are CUDA's "CPU scalars" and allowed;
* ``sync in client step``: a host synchronisation (a device scalar read by ``.item()``,
  ``float()``, ``bool()``, a copy to the host such as ``.tolist()`` or ``.cpu()``, an operation
  whose output size depends on the values: ``nonzero``, boolean masks, ``unique``...) inside a
  call wrapped by :meth:`DeviceGuard.client_step` (a method's ``local_update``);
* ``float64``: a float64 device tensor in a run declared float32.

Synchronisations elsewhere are counted per phase (:meth:`DeviceGuard.phase`), for the budgets of
``tests/test_gpu_guard.py``. Test code only: nothing in the package imports it.
"""
from __future__ import annotations

import contextlib
import functools
import traceback
from collections import Counter

import torch
from torch.utils._mode_utils import no_dispatch
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten, tree_map, tree_unflatten

STAND_IN = torch.device("meta")
"""The device the run is given (``--device meta`` in these tests)."""

aten = torch.ops.aten

#: operations that make the host wait for the device (their result size or value is read on the host)
SYNC_OPS = {aten._local_scalar_dense.default, aten.equal.default, aten.is_nonzero.default,
            aten.nonzero.default, aten.masked_select.default, aten._unique2.default, aten.unique_dim.default,
            aten.unique_consecutive.default, aten.bincount.default, aten.repeat_interleave.Tensor}
#: explicit copies between host and device
COPY_OPS = {aten._to_copy.default, aten.copy_.default, aten._copy_from.default,
            aten._copy_from_and_resize.default}
#: indexing operations whose index tensors may stay on the host (CUDA copies them)
INDEX_OPS = {aten.index.Tensor, aten.index_put_.default, aten.index_put.default, aten._index_put_impl_.default}

#: operations that move or view existing values (not float64 *work* when they carry float64 values)
MOVE_OPS = {aten.stack.default, aten.cat.default, aten.select.int, aten.unbind.int, aten.slice.Tensor,
            aten.view.default, aten._unsafe_view.default, aten.clone.default, aten.detach.default,
            aten.alias.default, aten.expand.default, aten.unsqueeze.default, aten.squeeze.dim,
            aten.squeeze.dims, aten.index.Tensor, aten.lift_fresh.default}


class StandInTensor(torch.Tensor):
    """A CPU tensor (``elem``) that reports :data:`STAND_IN` as its device."""

    elem: torch.Tensor
    __slots__ = ["elem"]

    @staticmethod
    def __new__(cls, elem: torch.Tensor):
        out = torch.Tensor._make_wrapper_subclass(cls, elem.size(), strides=elem.stride(),
                                                  storage_offset=elem.storage_offset(), dtype=elem.dtype,
                                                  layout=elem.layout, device=STAND_IN,
                                                  requires_grad=elem.requires_grad)
        out.elem = elem
        return out

    def tolist(self):
        """As CUDA's: a copy to the host (a sync), then the list."""
        return self.cpu().tolist()

    def __repr__(self, *, tensor_contents=None):
        return f"StandInTensor({self.elem!r})"

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        """Outside a guard (a test reading results): compute on the CPU, no checks."""
        out = func(*tree_map(_unwrap, args), **tree_map(_unwrap, kwargs or {}))
        return tree_map(lambda x: StandInTensor(x) if type(x) is torch.Tensor else x, out)


def _unwrap(x):
    if isinstance(x, StandInTensor):
        return x.elem
    if isinstance(x, torch.device) and x.type == STAND_IN.type:
        return torch.device("cpu")
    return x


def to_host(tree):
    """``tree`` with every stand-in tensor replaced by its CPU tensor (for comparisons)."""
    return tree_map(lambda x: x.elem if isinstance(x, StandInTensor) else x, tree)


def _project_path(filename: str) -> str | None:
    """``pfl_core/...`` or ``benchmarks/...`` of a frame's file; None outside the project's code."""
    for root in ("/pfl_core/", "/benchmarks/"):
        if root in filename:
            return root[1:] + filename.rsplit(root, 1)[1]
    return None


def _project_frames() -> list[tuple[str, int, str]]:
    """(project path, line, function) of the project's frames on the stack, innermost last."""
    frames = ((_project_path(f.filename), f.lineno, f.name) for f in traceback.extract_stack())
    return [frame for frame in frames if frame[0] is not None]


def _where() -> str:
    """The innermost frames of the project's code that issued an operation."""
    return " <- ".join(f"{path}:{line}" for path, line, _ in reversed(_project_frames()[-3:])) or "test code"


class _HostData(TorchFunctionMode):
    """``torch.tensor(data, device=...)`` and ``torch.as_tensor``: torch builds these below the
    dispatch modes (a real, empty meta tensor); here they are built on the host, then copied."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        device = kwargs.get("device")
        if func in (torch.tensor, torch.as_tensor) and device is not None and torch.device(device) == STAND_IN \
                and not isinstance(args[0], torch.Tensor):
            return func(*args, **{**kwargs, "device": "cpu"}).to(STAND_IN)
        return func(*args, **kwargs)


class DeviceGuard(TorchDispatchMode):
    """Checks every operation against the rules of the module docstring.

    ``dtype``: the run's float dtype (float64 work is a violation when it is float32).
    ``violations``: ``(kind, op, where)``; ``syncs`` and ``h2d``: counters by phase.
    """

    def __init__(self, dtype: torch.dtype = torch.float32):
        super().__init__()
        self.dtype = dtype
        self.violations: list[tuple[str, str, str]] = []
        self.syncs: Counter = Counter()
        self.h2d: Counter = Counter()
        self.sync_sites: Counter = Counter()
        """``(phase, where)`` of every synchronisation: what a budget's failure message lists."""
        self.current = "setup"
        self.in_client_step = 0

    def __enter__(self):
        self._host_data = _HostData()
        self._host_data.__enter__()
        return super().__enter__()

    def __exit__(self, *exc):
        try:
            return super().__exit__(*exc)
        finally:
            self._host_data.__exit__(*exc)

    @contextlib.contextmanager
    def phase(self, name: str):
        """Count the synchronisations and copies of the block under ``name``."""
        before, self.current = self.current, name
        try:
            yield
        finally:
            self.current = before

    def client_step(self, fn):
        """``fn`` (a method's ``local_update``) wrapped so that a sync inside it is a violation."""
        @functools.wraps(fn)
        def wrapped(*args, **kwargs):
            self.in_client_step += 1
            try:
                return fn(*args, **kwargs)
            finally:
                self.in_client_step -= 1
        return wrapped

    def _flag(self, kind: str, func) -> None:
        self.violations.append((kind, str(func), _where()))

    def _sync(self, func) -> None:
        if self.in_client_step:
            self._flag("sync in client step", func)
        self.syncs[self.current] += 1
        self.sync_sites[self.current, _where()] += 1

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        flat, _ = tree_flatten((args, kwargs))
        on_device = any(isinstance(x, StandInTensor) for x in flat)
        target = kwargs.get("device")
        to_device = isinstance(target, torch.device) and target.type == STAND_IN.type
        to_host_copy = self._classify(func, args, kwargs, flat, on_device, to_device, target)
        unwrapped = tree_map(_unwrap, (args, kwargs))
        if func is aten._efficientzerotensor.default:  # forward-mode AD's zero tangent: a real zero tensor
            func = aten.zeros.default
        out = func(*unwrapped[0], **unwrapped[1])
        if func in SYNC_OPS and on_device or func is aten.index.Tensor and on_device and _bool_index(args):
            self._sync(func)
        if to_host_copy or not (on_device or to_device):
            return out
        out = self._wrap(func, out, args, unwrapped[0])
        if isinstance(out, StandInTensor) and (out.shape, out.stride()) != (out.elem.shape, out.elem.stride()):
            with no_dispatch():  # an in-place view op (squeeze_): the same change to the wrapper's metadata
                func(out, *args[1:], **kwargs)
        return out

    def _classify(self, func, args, kwargs, flat, on_device, to_device, target) -> bool:
        """Record mismatches and copies; whether the output is a host tensor copied from the device."""
        if func in COPY_OPS:
            if func is aten._to_copy.default:
                source = args[0]
                if isinstance(source, StandInTensor) and target is not None and not to_device:
                    self._sync(func)  # device -> host (.cpu(), .tolist(), .numpy() after .cpu())
                    return True
                if not isinstance(source, StandInTensor) and to_device:
                    self.h2d[self.current] += 1
                return False
            dst, src = args[0], args[1]
            if isinstance(src, StandInTensor) and not isinstance(dst, StandInTensor):
                self._sync(func)
            elif isinstance(dst, StandInTensor) and not isinstance(src, StandInTensor) and src.dim() > 0:
                self.h2d[self.current] += 1
            return False
        if not on_device:
            return False
        checked = [args[0]] if func in INDEX_OPS else flat
        if func in INDEX_OPS and any(type(i) is torch.Tensor for i in tree_flatten(args[1])[0]):
            self.h2d[self.current] += 1
        if func in INDEX_OPS and len(args) > 2:
            checked = [args[0], *tree_flatten(args[2:])[0]]
        if any(type(x) is torch.Tensor and x.dim() > 0 and x.device.type == "cpu" for x in checked):
            self._flag("mismatch", func)
        return False

    def _wrap(self, func, out, args, unwrapped_args):
        """Outputs as stand-in tensors; an output that is an input (in-place ops) stays that input."""
        originals = {id(u): a for a, u in zip(tree_flatten(args)[0], tree_flatten(unwrapped_args)[0])
                     if isinstance(a, torch.Tensor)}
        leaves, spec = tree_flatten(out)
        wrapped = []
        for x in leaves:
            if type(x) is torch.Tensor:
                x = originals[id(x)] if id(x) in originals else StandInTensor(x)
                if self.dtype == torch.float32 and x.dtype == torch.float64 and func not in MOVE_OPS \
                        and not _float64_allowed():
                    self._flag("float64", func)
            wrapped.append(x)
        return tree_unflatten(wrapped, spec)


#: the project's deliberate float64 bookkeeping on the device, by the module (a path prefix, so that
#: a module moved into a package of that name still matches) or the function that does it (the
#: innermost project frame); any other float64 device tensor in a float32 run is a violation
FLOAT64_ALLOWED = {
    "pfl_core/algorithms/_lib/optim": "Adam's step count and bias corrections (0-d), float64 as "
                                      "torch.optim.Adam's host floats (its non-capturable form)",
    "pfl_core/evaluation": "the batched evaluation's per-client loss and accuracy sums (steps x clients)",
    "pfl_core/algorithms/apfl": "APFL's mixing weight alpha, a float64 scalar per client (the reference code's "
                                "Python float)",
    "average_buffers": "the mean of BN's integer batch counters, exact in float64 (pfl_core.training)",
}


def _float64_allowed() -> bool:
    frames = _project_frames()
    if not frames:
        return False
    path = frames[-1][0]
    function = next((name for *_, name in reversed(frames) if not name.startswith("<")), "")  # not a genexpr
    return any(path.startswith(key) or function == key for key in FLOAT64_ALLOWED)


def _bool_index(args) -> bool:
    """``x[mask]``: a boolean index makes the output size depend on the values (a sync on CUDA)."""
    return any(isinstance(i, torch.Tensor) and i.dtype == torch.bool for i in tree_flatten(args[1])[0])
