"""Where the Blackwell kernel can run and how it gets there: the route of each CUDA device (``route``: the Triton JIT
on Blackwell, precompiled cubins or the JIT on the H200's sm_90 verification route), the environment the
self-check's verdict is keyed on (``identity``). The memo dicts are read through functions that torch.compile runs
for real while tracing (their results are constants of the graph): Dynamo would trace the filesystem probes of a
cache wrapper.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import os

import torch

from fp4vis.backends.base import device_capability
from fp4vis.settings import kernel_settings
from fp4vis.tracing import constant_at_trace_time

from . import cubin as cubin_mod
from .config import CAPABILITIES, MIN_TRITON, WARP_SPECIALIZED_ARCHS, KernelConfig, arch_of_capability

VERIFICATION_CAPABILITY = (9, 0)


@functools.cache
def triton_problem() -> str | None:
    """None when this process's Triton can compile the kernel, else why not."""
    try:
        import triton
    except Exception as exc:  # pragma: no cover - depends on the machine
        return f"Triton is not importable ({type(exc).__name__}: {exc}); Triton >= 3.8 is needed"
    try:
        have = tuple(int(x) for x in triton.__version__.split(".")[:2])
    except ValueError:
        return f"unparseable Triton version {triton.__version__!r}"
    if have < MIN_TRITON:
        return (f"Triton {triton.__version__} is too old: tl.dot_scaled with NVFP4 operands needs Triton >= "
                f"{MIN_TRITON[0]}.{MIN_TRITON[1]} (torch 2.14 bundles 3.8)")
    return None


@functools.cache
def driver_version() -> int:
    """The CUDA driver version (cuDriverGetVersion), 0 where it cannot be read."""
    try:
        lib = ctypes.CDLL("libcuda.so.1")
        v = ctypes.c_int(0)
        return v.value if lib.cuDriverGetVersion(ctypes.byref(v)) == 0 else 0
    except OSError:
        return 0


@functools.cache
def _source_hash() -> str:
    here = os.path.dirname(__file__)
    h = hashlib.sha256()
    # the kernels' sources, with the range record's decision they share with the pre-passes
    for name in ("kernel.py", "gluon_ws.py", "ptx.py", "prepass.py", "config.py", "../scale_record.py"):
        with open(os.path.join(here, name), "rb") as f:
            h.update(f.read())
    return h.hexdigest()[:16]


def _fp4vis_version() -> str:
    try:
        from importlib.metadata import version
        return version("fp4vis")
    except Exception:  # pragma: no cover
        return "unknown"


_ROUTES: dict[int, tuple[str, int] | str] = {}
_CUBINS: dict[tuple, bool] = {}


def clear_route_cache() -> None:
    _ROUTES.clear()
    _CUBINS.clear()


@constant_at_trace_time
def route(index: int) -> tuple[str, int] | str:
    """(launch kind "jit" / "cubin", Triton arch) for CUDA device ``index``, or why none."""
    r = _ROUTES.get(index)
    if r is None:
        r = _ROUTES[index] = _compute_route(index)
    return r


@constant_at_trace_time
def warp_specialized_asked() -> bool:
    """``FP4VIS_BLACKWELL_WARP_SPECIALIZED`` (read once with the kernel settings; a constant while Dynamo traces)."""
    return kernel_settings().blackwell_warp_specialized


@constant_at_trace_time
def cubin_available(key: tuple) -> bool:
    """Whether the cubin of the ``KernelConfig`` with this ``key()`` is there (a key: Dynamo passes plain
    values to a function it runs while tracing)."""
    ok = _CUBINS.get(key)
    if ok is None:
        ok = _CUBINS[key] = cubin_mod.has_cubin(KernelConfig(*key))
    return ok


def _compute_route(index: int) -> tuple[str, int] | str:
    cap = device_capability(index)
    if cap in CAPABILITIES:
        problem = triton_problem()
        return problem if problem else ("jit", arch_of_capability(cap))
    if cap == VERIFICATION_CAPABILITY:
        if cubin_mod.cubin_dir():
            return ("cubin", 90)
        if triton_problem() is None:
            return ("jit", 90)
        return (f"sm_90 verification route needs precompiled cubins ({cubin_mod.CUBIN_ENV}) or Triton >= 3.8 "
                f"({triton_problem()})")
    return f"compute capability {cap[0]}.{cap[1]} has no Blackwell kernel build (10.0, 10.3, 12.0)"


def device_index(device: torch.device) -> int:
    """The CUDA device index of ``device`` (the current device where it names none; 0 off CUDA)."""
    if device.type != "cuda":
        return 0
    return device.index if device.index is not None else torch.cuda.current_device()


def identity(device: torch.device) -> dict:
    """What the self-check's verdict on ``device`` is keyed on: the GPU, its driver, fp4vis, the route and its
    compiler, the kernels' source and which kernel the fast-class policies take ("serial", or "warp_specialized"
    where ``FP4VIS_BLACKWELL_WARP_SPECIALIZED`` asks and the GPU has it)."""
    index = device_index(device)
    r = route(index)
    kind = r if isinstance(r, str) else r[0]
    if kind == "jit":
        import triton
        compiler = triton.__version__
    else:
        compiler = "cubin:" + str(cubin_mod.cubin_dir())
    cap = device_capability(index)
    ws = warp_specialized_asked() and not isinstance(r, str) and r[1] in WARP_SPECIALIZED_ARCHS
    return {"device": torch.cuda.get_device_name(index), "capability": f"{cap[0]}.{cap[1]}",
            "driver": driver_version(), "fp4vis": _fp4vis_version(), "route": kind, "compiler": compiler,
            "source": _source_hash(), "schedule": "warp_specialized" if ws else "serial"}
