"""The registry of attention backends and the one place that picks a backend for a call.

The reference is always registered. Kernel backends declare themselves where they are defined (their name, the
GPUs ``auto`` picks them on, their ``supports``) and are listed as entry points of the group ``fp4vis.backends``
(pyproject.toml: ``hopper = "fp4vis.kernels.hopper.backend:BACKEND"``; another package can add its own): the
registry loads them at the first lookup (so ``import fp4vis`` never touches CUDA or CuTe DSL). Core names no
kernel. The kernel modules import ``fp4vis.backends.base`` only: nothing they load calls back into this module.
"""

from __future__ import annotations

import importlib.metadata

import torch

from fp4vis.call import AttentionCall
from fp4vis.tracing import constant_at_trace_time, warn_once

from .base import AUTO, REFERENCE, Backend, device_capability
from .reference import ReferenceBackend

ENTRY_POINT_GROUP = "fp4vis.backends"

_REGISTRY: dict[str, Backend] = {}
_IMPORT_ERRORS: dict[str, str] = {}


def register_backend(backend: Backend) -> None:
    """Register (or replace) a backend under ``backend.name``."""
    _REGISTRY[backend.name] = backend


register_backend(ReferenceBackend())


def kernel_entry_points() -> tuple:
    """The kernel backends installed (entry points of ``ENTRY_POINT_GROUP``, in their packages' order); none is
    loaded."""
    return tuple(importlib.metadata.entry_points(group=ENTRY_POINT_GROUP))


def backend_names() -> list[str]:
    """Every name ``backend=`` accepts, "auto" first."""
    kernels = [ep.name for ep in kernel_entry_points()]
    return [AUTO, REFERENCE, *kernels, *sorted(set(_REGISTRY) - {REFERENCE, *kernels})]


_LOADED: list[bool] = []


@constant_at_trace_time
def _load_kernel_backends() -> bool:
    """Import every kernel backend module once and register its ``BACKEND`` (the import errors kept for
    ``available_backends``). All at once, at the first lookup (a few milliseconds, no CUDA and no CuTe
    DSL): under torch.compile Dynamo runs this for real instead of tracing the imports, before any
    lookup in the trace reads the registry."""
    if not _LOADED:
        for ep in kernel_entry_points():
            if ep.name in _REGISTRY:   # registered by the user under a kernel's name: theirs stays
                continue
            try:
                register_backend(ep.load())
            except Exception as exc:  # a kernel backend that cannot load here is reported, not fatal
                _IMPORT_ERRORS[ep.name] = f"{type(exc).__name__}: {exc}"
        _LOADED.append(True)
    return True


def get_backend(name: str) -> Backend | None:
    """The backend registered under ``name`` (kernel backends are loaded at the first lookup); None (and
    the import error kept for ``available_backends``) when it cannot be loaded here."""
    _load_kernel_backends()
    if name not in _REGISTRY and name not in _IMPORT_ERRORS:
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
    """The kernel backend ``auto`` tries on this device: the registered backend that names the device's compute
    capability among its ``auto_capabilities`` (None: the reference is the only choice)."""
    if device.type != "cuda":
        return None
    _load_kernel_backends()
    cap = device_capability(device.index)
    return next((name for name, b in _REGISTRY.items() if cap in b.auto_capabilities), None)


def select_backend(name: str, call: AttentionCall) -> Backend:
    """The backend that runs this call (``fp4vis.attention``). An explicit name raises when it cannot; ``auto``
    takes the kernel for this GPU when it supports the call and otherwise falls back to the reference with
    one warning per reason."""
    asked, reason = ask_backend(name, call)
    return backend_to_run(name, asked, reason)


def ask_backend(name: str, call: AttentionCall) -> tuple[Backend | None, str | None]:
    """The backend ``name`` asks to run this call, and its answer (``supports``: asked here, once per call).
    ``(backend, None)``: it runs the call; ``(backend, reason)``: it cannot; ``(None, why)``: the explicit name's
    backend cannot load here. ``auto`` asks the kernel for the call's GPU, or, without one that loads there, the
    reference (with one warning on a GPU). A patched layer keeps exact attention where the answer is no
    (``fp4vis.patching.layer.LayerState.select``); ``fp4vis.attention`` goes on as ``backend_to_run`` says."""
    _load_kernel_backends()
    if name == AUTO:
        backend = _auto_backend(call.q)
    else:
        backend = get_backend(name)
        if backend is None:
            return None, f"backend={name!r} is not available here: {load_error(name)}"
    return backend, backend.supports(call)


def backend_to_run(name: str, asked: Backend | None, reason: str | None) -> Backend:
    """What ``fp4vis.attention`` runs after ``ask_backend(name, call)`` answered ``(asked, reason)``: the asked
    backend where it runs the call; for ``auto``, else the reference (one warning per reason); an explicit name
    that cannot raises."""
    if reason is None:
        return asked
    if asked is None:
        raise RuntimeError(reason)
    if name != AUTO:
        raise RuntimeError(f"backend={name!r} cannot run this call: {reason}")
    warn_once(("unsupported", asked.name, reason), f"fp4vis: {asked.name} backend does not support this call "
               f"({reason}); using the reference emulation (slow)")
    return _REGISTRY[REFERENCE]


def _auto_backend(q: torch.Tensor) -> Backend:
    """The backend ``auto`` asks first for tensors on q's device: the kernel for this GPU where one loads, else the
    reference (on a GPU with one warning)."""
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
    return backend
