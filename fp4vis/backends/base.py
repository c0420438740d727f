"""What every attention backend is: the ``Backend`` interface (each backend declares its own name and the GPUs
``auto`` picks it on), the device-capability lookup, and the small named checks that backends compose their
``supports`` from. Imports only core modules: kernel backends import this, never the registry that loads them."""

from __future__ import annotations

import torch

from fp4vis.call import AttentionCall
from fp4vis.policy import Policy
from fp4vis.range_report import RangeReport
from fp4vis.tracing import constant_at_trace_time

# the names every registry has: "auto" picks a backend per call, "reference" is the exact emulation; kernel
# backends name themselves (``Backend.name``)
AUTO = "auto"
REFERENCE = "reference"


class Backend:
    """Interface of an attention backend: ``supports`` and ``run`` take the validated call
    (``fp4vis.call.AttentionCall``).

    Under torch.compile the call carries its ``record_site`` (``range_record.call_site``: the call's policy,
    range_check, layout and layer): the backend runs a custom op that takes it and reports the call's range
    itself at run time (the reference raises or warns in its op; a kernel starts its record there), and
    returns None for the RangeReport."""

    name: str = "?"
    #: the compute capabilities of the GPUs on which ``backend="auto"`` tries this backend first
    auto_capabilities: tuple[tuple[int, int], ...] = ()
    #: True where ``run`` uses the call's ``record`` (its ``fp4vis.call.RecordSlot``): the
    #: kernel reports its range on the device
    records_range: bool = False

    #: True where ``run`` takes a call with its ``qk_transform`` (a ``fp4vis.qk_transform.QKTransform``: q and k
    #: are then raw projections that the backend normalises and rotates itself, e.g. in its pre-pass); otherwise
    #: ``fp4vis.attention`` applies the transform first
    fuses_qk_transform: bool = False

    def unavailable_reason(self) -> str | None:
        """None when the backend can run on this machine at all, else why not."""
        return None

    def supports(self, call: AttentionCall) -> str | None:
        """None when this backend can run the call, else a short reason."""
        raise NotImplementedError

    def run(self, call: AttentionCall) -> tuple[torch.Tensor, RangeReport | None]:
        """The attention output (q's dtype, (B, H, Sq, Dv)) and a RangeReport (None when the backend does not
        check its range, or reports it through the range record: ``records_range``)."""
        raise NotImplementedError


# a plain dict, not functools.cache: Dynamo warns on every compiled call site that traces a cached function;
# run for real under torch.compile (a traced first call would guard on the dict, and recompile once it is filled)
_CAPABILITIES: dict[int, tuple[int, int]] = {}


@constant_at_trace_time
def device_capability(index: int | None) -> tuple[int, int]:
    """``torch.cuda.get_device_capability`` of CUDA device ``index`` (None: the current device),
    cached (it is asked on every call)."""
    index = torch.cuda.current_device() if index is None else index
    cap = _CAPABILITIES.get(index)
    if cap is None:
        cap = _CAPABILITIES[index] = torch.cuda.get_device_capability(index)
    return cap


# ------------------------------------------------------------------------------------------------
# Named checks: each returns None when the call passes, else the reason (a backend's
# ``supports`` is the first reason of its list of checks).


def first_reason(*reasons: str | None) -> str | None:
    """The first reason that is not None (checks given as already-evaluated values)."""
    for reason in reasons:
        if reason is not None:
            return reason
    return None


def need_direct_p(policy: Policy) -> str | None:
    if policy.is_fp8_pv:
        return f"policy {policy.name!r} is the FP8 P/V softmax (method 'fp8_pv'), which this backend does not compute"
    return None if policy.is_direct_p else f"policy {policy.name!r} is not a Direct-P policy"


def need_kernel_method(policy: Policy) -> str | None:
    """Direct-P or the FP8 P/V softmax: the two methods the Hopper kernel computes."""
    return None if policy.is_direct_p or policy.is_fp8_pv else (
        f"policy {policy.name!r} (method {policy.method!r}) is neither Direct-P nor the FP8 P/V softmax")


def need_cuda_capability(q: torch.Tensor, capabilities: tuple[tuple[int, int], ...], what: str) -> str | None:
    if not q.is_cuda:
        return "tensors are not on a CUDA device"
    if device_capability(q.device.index) not in capabilities:
        return f"device {torch.cuda.get_device_name(q.device)} is not {what}"
    return None


def need_dtype(q: torch.Tensor, dtypes: tuple[torch.dtype, ...]) -> str | None:
    if q.dtype in dtypes:
        return None
    return f"dtype {q.dtype} (the kernel takes {' or '.join(str(d).removeprefix('torch.') for d in dtypes)})"


def need_head_dims(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, head_dims: tuple[int, ...]) -> str | None:
    d = q.shape[-1]
    if d in head_dims and k.shape[-1] == d and v.shape[-1] == d:
        return None
    return (f"head dims q/k/v = {d}/{k.shape[-1]}/{v.shape[-1]} (the kernel supports "
            f"{' and '.join(map(str, head_dims))})")


def need_nonempty(q: torch.Tensor, k: torch.Tensor) -> str | None:
    return "empty sequence" if q.shape[-2] == 0 or k.shape[-2] == 0 else None


def has_capability(capabilities: tuple[tuple[int, int], ...]) -> bool:
    """Whether any visible CUDA device has one of ``capabilities``."""
    return torch.cuda.is_available() and any(device_capability(i) in capabilities
                                             for i in range(torch.cuda.device_count()))
