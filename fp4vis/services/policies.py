"""Policy and backend names from the user and what runs under them: ``resolve_policies``, ``check_backend``,
``backend_in_use`` and ``attention_label`` (the words of progress bars and headers), the one warning of a
command that falls back to the reference (``warn_reference_fallback``), and ``policy_applied`` (a model
under a policy for the length of a block)."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence
from typing import Any

import torch

from fp4vis.backends import AUTO, REFERENCE, backend_names, get_backend, kernel_backend_name
from fp4vis.patching import patch
from fp4vis.policy import POLICIES, Policy, get_policy
from fp4vis.services.usage import UsageError


def resolve_policies(names: str | Sequence[str], *, allow_bf16: bool = True) -> list[Policy]:
    """Policy names (comma-separated string or a list) -> Policy objects, with a clear error."""
    if isinstance(names, str):
        names = [n for n in names.split(",") if n.strip()]
    out = []
    for n in names:
        n = n.strip() if isinstance(n, str) else n
        try:
            p = get_policy(n)
        except ValueError as e:
            raise UsageError(str(e)) from None
        if not allow_bf16 and p.method == "exact":
            continue
        out.append(p)
    if not out:
        raise UsageError(f"no policy given; known policies are {', '.join(sorted(POLICIES))}")
    return out


def check_backend(backend: str, device: torch.device) -> str:
    """A known backend name; the kernel backends need a CUDA device (the reference and 'auto' work
    everywhere)."""
    known = backend_names()
    if backend not in known:
        raise UsageError(f"backend: unknown backend {backend!r}; use one of {', '.join(known)}")
    if backend not in (AUTO, REFERENCE) and device.type != "cuda":
        raise UsageError(f"backend {backend!r} runs only on a CUDA GPU (device here: {device}); "
                         "use --backend auto or --backend reference on the CPU")
    return backend


def backend_in_use(backend: str, device: torch.device) -> str:
    """The backend that computes FP4 attention on ``device`` under the option ``backend``: a named one itself;
    ``auto``'s pick there, the kernel for this GPU where it loads and can run, else the reference. For labels:
    a call the kernel does not support still falls back to the reference, with its warning."""
    if backend != AUTO:
        return backend
    kernel = kernel_backend_name(torch.device(device))
    loaded = get_backend(kernel) if kernel is not None else None
    return kernel if loaded is not None and loaded.unavailable_reason() is None else REFERENCE


def attention_label(policy: str | Policy, backend: str, device: torch.device, guard: Any = None) -> str:
    """What a run under ``policy`` computes its attention with, as progress bars and headers say it: the
    model's own attention for the exact baseline (``bf16, the model's attention``), else the policy and the
    backend that runs it (``fast, hopper``; ``wan_fast + guard plan, reference``)."""
    pol = get_policy(policy)
    if pol.method == "exact" and guard is None:   # policy_applied leaves the model as it is
        return f"{pol.name}, the model's attention"
    return f"{pol.name}{' + guard plan' if guard is not None else ''}, {backend_in_use(backend, device)}"


def warn_reference_fallback(backend: str, device: torch.device, policy: str | Policy, command: str) -> bool:
    """The warning the README promises where ``backend="auto"`` falls back to the reference, for a command
    on a device without an FP4 kernel (the CPU): ``fp4vis.attention`` itself stays silent for CPU tensors
    (every call would warn; no kernel exists for a CPU), so the command says it once. True when it warned."""
    if backend != AUTO or device.type == "cuda" or get_policy(policy).method == "exact":
        return False
    import warnings

    warnings.warn(f"{command}: no FP4 attention kernel runs on the {device.type.upper()}; policy "
                  f"{get_policy(policy).name!r} runs on the reference emulation (exact numerics, slow); "
                  "--backend reference chooses it and silences this", UserWarning, stacklevel=2)
    return True


@contextlib.contextmanager
def policy_applied(model: Any, policy: str | Policy, *, guard: Any = None, backend: str = "auto",
                   layers: Any = None, **patch_kwargs: Any) -> Iterator[Any]:
    """Run a block with ``model`` (a module or a diffusers pipeline) under an attention policy.

    ``bf16`` without a guard plan leaves the model untouched: it is the baseline, the model's own
    attention (SDPA). Every other policy goes through ``fp4vis.patch`` and is removed afterwards;
    ``patch_kwargs`` (``decoder=True``, ``cross_attention=True``, ``range_check=...``) pass through.
    """
    pol = get_policy(policy)
    if pol.method == "exact" and guard is None:
        yield None
        return
    handle = patch(model, policy=pol, layers=layers, guard=guard, backend=backend, **patch_kwargs)
    try:
        yield handle
    finally:
        handle.remove()
