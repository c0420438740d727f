"""Backends behind ``fp4vis.attention``: a small registry, one place that picks a backend.

A backend says whether it can run a call (``unsupported_reason``) and runs it (``forward``) on
validated (B, H, S, D) tensors. The reference is always registered. Kernel backends live in
``fp4vis.kernels`` and register themselves when their module is imported; the registry imports
them lazily, only when a call could use them, so importing fp4vis never touches CUDA or CuTe DSL.
"""

from __future__ import annotations

import functools
import importlib
import warnings

import torch

from fp4vis.policy import Policy
from fp4vis.reference import RangeReport, reference_attention

# backend name -> module that registers it on import
# (a Blackwell backend registers here once its kernel exists and has run on hardware)
_LAZY_BACKENDS = {"hopper": "fp4vis.kernels.hopper_backend"}
# which kernel backend "auto" tries for a CUDA device of this compute capability
_AUTO_BY_CAPABILITY = {(9, 0): "hopper"}


class Backend:
    """Interface of an attention backend."""

    name: str = "?"

    def unsupported_reason(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, policy: Policy,
                           scale: float) -> str | None:
        """None when this backend can run the call, else a short reason."""
        raise NotImplementedError

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, policy: Policy,
                scale: float) -> tuple[torch.Tensor, RangeReport | None]:
        """Attention of (B, H, S, D) tensors; returns the output (q's dtype) and a RangeReport
        (None when the backend does not check its range)."""
        raise NotImplementedError


class ReferenceBackend(Backend):
    """The exact emulation of SPEC.md (``fp4vis.reference``): every policy, device and shape."""

    name = "reference"

    def unsupported_reason(self, q, k, v, policy, scale):
        return None

    # The emulation is chunked Python with data-dependent checks: torch.compile runs it eagerly (one
    # graph break) instead of tracing every chunk.
    @torch.compiler.disable
    def forward(self, q, k, v, policy, scale):
        for name, t in (("q", q), ("k", k), ("v", v)):
            if not bool(torch.isfinite(t).all()):
                bad = "NaN" if bool(torch.isnan(t).any()) else "Inf"
                raise ValueError(f"{name}: contains {bad}; attention inputs must be finite")
        b, h = q.shape[:2]
        out, report = reference_attention(q.flatten(0, 1), k.flatten(0, 1), v.flatten(0, 1), policy, scale)
        return out.unflatten(0, (b, h)), report


_REGISTRY: dict[str, Backend] = {}
_IMPORT_ERRORS: dict[str, str] = {}
_WARNED: set[str] = set()


def register_backend(backend: Backend) -> None:
    """Register (or replace) a backend under ``backend.name``."""
    _REGISTRY[backend.name] = backend


register_backend(ReferenceBackend())


def get_backend(name: str) -> Backend | None:
    """The backend registered under ``name``, importing a kernel backend on first use; None (and
    the import error kept for ``available_backends``) when it cannot be loaded here."""
    if name in _REGISTRY:
        return _REGISTRY[name]
    module = _LAZY_BACKENDS.get(name)
    if module is None:
        raise ValueError(f"backend: unknown backend {name!r}; known backends are "
                         f"auto, {', '.join(sorted({*_REGISTRY, *_LAZY_BACKENDS}))}")
    if name not in _IMPORT_ERRORS:
        try:
            importlib.import_module(module)
        except Exception as exc:  # a kernel backend that cannot load here is reported, not fatal
            _IMPORT_ERRORS[name] = f"{type(exc).__name__}: {exc}"
    return _REGISTRY.get(name)


def available_backends() -> dict[str, str | None]:
    """Every known backend -> None when it can run on this machine, else why not."""
    result: dict[str, str | None] = {}
    for name in ["reference", *_LAZY_BACKENDS]:
        backend = get_backend(name)
        if backend is None:
            result[name] = _IMPORT_ERRORS.get(name, "not registered")
            continue
        check = getattr(backend, "unavailable_reason", None)
        result[name] = check() if check else None
    return result


def device_capability(index: int | None) -> tuple[int, int]:
    """``torch.cuda.get_device_capability`` of CUDA device ``index`` (None: the current device),
    cached (it is asked on every call)."""
    return _capability(torch.cuda.current_device() if index is None else index)


@functools.cache
def _capability(index: int) -> tuple[int, int]:
    return torch.cuda.get_device_capability(index)


def kernel_backend_name(device: torch.device) -> str | None:
    """The kernel backend ``auto`` tries on this device (None: the reference is the only choice)."""
    if device.type != "cuda":
        return None
    return _AUTO_BY_CAPABILITY.get(device_capability(device.index))


def _warn_once(key: str, message: str) -> None:
    if key not in _WARNED:
        _WARNED.add(key)
        warnings.warn(message, stacklevel=4)


def select_backend(name: str, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, policy: Policy,
                   scale: float) -> Backend:
    """The backend that runs this call. An explicit name raises when it cannot; ``auto`` takes the
    kernel for this GPU when it supports the call and otherwise falls back to the reference with
    one warning per reason."""
    if name != "auto":
        backend = get_backend(name)
        if backend is None:
            raise RuntimeError(f"backend={name!r} is not available here: "
                               f"{_IMPORT_ERRORS.get(name, 'not registered')}")
        reason = backend.unsupported_reason(q, k, v, policy, scale)
        if reason is not None:
            raise RuntimeError(f"backend={name!r} cannot run this call: {reason}")
        return backend
    reference = _REGISTRY["reference"]
    if not q.is_cuda:
        return reference
    kernel = kernel_backend_name(q.device)
    if kernel is None:
        _warn_once(f"nokernel{q.device}", f"fp4vis: no FP4 attention kernel for "
                   f"{torch.cuda.get_device_name(q.device)}; using the reference emulation (slow)")
        return reference
    backend = get_backend(kernel)
    if backend is None:
        _warn_once(f"import{kernel}", f"fp4vis: the {kernel} backend cannot load "
                   f"({_IMPORT_ERRORS.get(kernel)}); using the reference emulation (slow)")
        return reference
    reason = backend.unsupported_reason(q, k, v, policy, scale)
    if reason is not None:
        _warn_once(f"{kernel}:{reason}", f"fp4vis: {kernel} backend does not support this call "
                   f"({reason}); using the reference emulation (slow)")
        return reference
    return backend
