"""The registry of attention backends and the one place that picks a backend for a call.

The reference is always registered. Kernel backends live in ``fp4vis.kernels.<name>``; the registry
imports such a module only when a call could use it (so ``import fp4vis`` never touches CUDA or
CuTe DSL) and registers the module's ``BACKEND``. The kernel modules import ``fp4vis.backends.base``
only: nothing they load calls back into this module.
"""

from __future__ import annotations

import importlib

import torch

from fp4vis.call import AttentionCall
from fp4vis.tracing import constant_at_trace_time, warn_once

from .base import (
    AUTO,
    BLACKWELL,
    BLACKWELL_CAPABILITIES,
    HOPPER,
    HOPPER_CAPABILITIES,
    REFERENCE,
    Backend,
    device_capability,
)
from .reference import ReferenceBackend

# kernel backend name -> module holding its BACKEND
KERNEL_MODULES = {HOPPER: "fp4vis.kernels.hopper.backend", BLACKWELL: "fp4vis.kernels.blackwell.backend"}
# the kernel backend "auto" tries on a CUDA device of each compute capability (the Blackwell kernel's
# sm_90 build is a verification path: "auto" never picks it on a Hopper GPU)
AUTO_BY_CAPABILITY = {**{cap: HOPPER for cap in HOPPER_CAPABILITIES},
                      **{cap: BLACKWELL for cap in BLACKWELL_CAPABILITIES}}

_REGISTRY: dict[str, Backend] = {}
_IMPORT_ERRORS: dict[str, str] = {}


def register_backend(backend: Backend) -> None:
    """Register (or replace) a backend under ``backend.name``."""
    _REGISTRY[backend.name] = backend


register_backend(ReferenceBackend())


def backend_names() -> list[str]:
    """Every name ``backend=`` accepts, "auto" first."""
    return [AUTO, REFERENCE, *KERNEL_MODULES, *sorted(set(_REGISTRY) - {REFERENCE, *KERNEL_MODULES})]


_LOADED: list[bool] = []


@constant_at_trace_time
def _load_kernel_backends() -> bool:
    """Import every kernel backend module once and register its ``BACKEND`` (the import errors kept for
    ``available_backends``). All at once, at the first lookup (a few milliseconds, no CUDA and no CuTe
    DSL): under torch.compile Dynamo runs this for real instead of tracing the imports, before any
    lookup in the trace reads the registry."""
    if not _LOADED:
        for name, module in KERNEL_MODULES.items():
            if name in _REGISTRY:   # registered by the user under a kernel's name: theirs stays
                continue
            try:
                register_backend(importlib.import_module(module).BACKEND)
            except Exception as exc:  # a kernel backend that cannot load here is reported, not fatal
                _IMPORT_ERRORS[name] = f"{type(exc).__name__}: {exc}"
        _LOADED.append(True)
    return True


def get_backend(name: str) -> Backend | None:
    """The backend registered under ``name`` (kernel backends are loaded at the first lookup); None (and
    the import error kept for ``available_backends``) when it cannot be loaded here."""
    _load_kernel_backends()
    if name not in _REGISTRY and name not in KERNEL_MODULES:
        raise ValueError(f"backend: unknown backend {name!r}; known backends are {', '.join(backend_names())}")
    return _REGISTRY.get(name)


def load_error(name: str) -> str:
    """Why the kernel backend ``name`` could not be loaded (after ``get_backend`` returned None)."""
    return _IMPORT_ERRORS.get(name, "not registered")


def available_backends() -> dict[str, str | None]:
    """Every known backend -> None when it can run on this machine, else why not."""
    result: dict[str, str | None] = {}
    for name in backend_names()[1:]:
        backend = get_backend(name)
        result[name] = load_error(name) if backend is None else backend.unavailable_reason()
    return result


def kernel_backend_name(device: torch.device) -> str | None:
    """The kernel backend ``auto`` tries on this device (None: the reference is the only choice)."""
    if device.type != "cuda":
        return None
    return AUTO_BY_CAPABILITY.get(device_capability(device.index))


def select_backend(name: str, call: AttentionCall) -> Backend:
    """The backend that runs this call. An explicit name raises when it cannot; ``auto`` takes the
    kernel for this GPU when it supports the call and otherwise falls back to the reference with
    one warning per reason."""
    q = call.q
    _load_kernel_backends()
    if name != AUTO:
        backend = get_backend(name)
        if backend is None:
            raise RuntimeError(f"backend={name!r} is not available here: {load_error(name)}")
        reason = backend.supports(call)
        if reason is not None:
            raise RuntimeError(f"backend={name!r} cannot run this call: {reason}")
        return backend
    reference = _REGISTRY[REFERENCE]
    if not q.is_cuda:
        return reference
    kernel = kernel_backend_name(q.device)
    if kernel is None:
        warn_once(("nokernel", str(q.device)), f"fp4vis: no FP4 attention kernel for "
                   f"{torch.cuda.get_device_name(q.device)}; using the reference emulation (slow)")
        return reference
    backend = get_backend(kernel)
    if backend is None:
        warn_once(("import", kernel), f"fp4vis: the {kernel} backend cannot load "
                   f"({load_error(kernel)}); using the reference emulation (slow)")
        return reference
    reason = backend.supports(call)
    if reason is not None:
        warn_once(("unsupported", kernel, reason), f"fp4vis: {kernel} backend does not support this call "
                   f"({reason}); using the reference emulation (slow)")
        return reference
    return backend
