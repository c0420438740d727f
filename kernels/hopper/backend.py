"""The Hopper (sm_90) backend of ``fp4vis.attention``: pre-pass + CuTe DSL Direct-P kernel.

``BACKEND`` (name ``"hopper"``) is what ``fp4vis.backends.registry`` registers when it loads this module.

* Supported: CUDA device of compute capability 9.0, BF16 or FP16 q/k/v (output in the same
  dtype), head dim 64 or 128 (q, k and v alike), any B, H, Sq, Skv >= 1 (partial tiles masked,
  cross-attention), Direct-P policies without the per-tensor global Q/K scale (``fast``,
  ``wan_fast``, ``accurate``, ``guard`` and user policies within those rules, anchors <= 128), and
  the FP8 Q/K policy ``fast_fp8qk`` (``qk_format="fp8_e4m3"``, without anchors), and key-padding masks
  (``key_mask``: each batch element's kept keys gathered first, ``kernels/kept_keys.py``; the kernel reads a key
  count per batch element). Anything else: ``supports`` says why, and ``backend="auto"`` falls back visibly.
* A call's way: ``HopperBackend.run(call)`` -> ``launch.attention(call)``: the policy's ``KernelParams``, the
  kernel variant (``config.product_config``), the operands (``prepass.kernel_operands``), the launch. Under
  torch.compile, and where autograd records, ``run`` goes through the custom op instead (``op.op_call``: the one
  place a call is flattened), whose body builds the call again and runs the same launcher. It launches on the
  current CUDA stream and allocates nothing that outlives the call, so CUDA-graph capture then replay with new
  inputs gives new outputs (compile the kernel once, outside capture, first).
* Range checks: where ``fp4vis.attention`` passes a range record (``range_check`` "raise" or
  "warn"; under torch.compile the op starts it at run time from the call's site), the kernel
  variant with ``range_record`` counts saturated P blocks,
  empty rows and non-finite outputs on the device and ``fp4vis.backends.range_record`` reports them
  later (no synchronisation per call); ``run`` returns ``None`` for the RangeReport. Rows whose
  probabilities all underflow produce 0 rather than NaN.
"""

from __future__ import annotations

import torch

from fp4vis.backends.base import (
    Backend,
    first_reason,
    has_capability,
    need_cuda_capability,
    need_dtype,
    need_head_dims,
    need_kernel_method,
    need_nonempty,
)
from fp4vis.policy import Policy
from fp4vis.tracing import constant_at_trace_time

from ..launch_shared import needs_custom_op
from .launch import attention
from .op import op_call

CAPABILITIES = ((9, 0),)   # the H100 / H200 (sm_90a): where this kernel is built for, and "auto" picks it
SUPPORTED_HEAD_DIMS = (64, 128)
SUPPORTED_DTYPES = (torch.bfloat16, torch.float16)
MAX_ANCHOR = 128

_CUTLASS_IMPORT: dict[str, str | None] = {}


# run for real under torch.compile: a traced first call would guard on the dict and recompile at the next
# call, once it is filled
@constant_at_trace_time
def _cutlass_import_error() -> str | None:
    if "error" not in _CUTLASS_IMPORT:
        try:
            import cutlass  # noqa: F401
            import cutlass.cute  # noqa: F401
            _CUTLASS_IMPORT["error"] = None
        except Exception as exc:  # pragma: no cover - depends on the machine
            _CUTLASS_IMPORT["error"] = f"nvidia-cutlass-dsl is not importable ({type(exc).__name__}: {exc})"
    return _CUTLASS_IMPORT["error"]


class HopperBackend(Backend):
    """Direct-P on the H200/H100 tensor cores (CuTe DSL, sm_90a)."""

    name = "hopper"
    auto_capabilities = CAPABILITIES
    records_range = True

    fuses_qk_transform = True   # folded into the pre-pass where it can be, applied first there otherwise

    def unavailable_reason(self) -> str | None:
        if not torch.cuda.is_available():
            return "no CUDA device"
        if not has_capability(CAPABILITIES):
            return "no sm_90 (Hopper) GPU"
        return _cutlass_import_error()

    def supports(self, call) -> str | None:
        q, k, v, policy = call.q, call.k, call.v, call.policy
        return first_reason(
            need_kernel_method(policy),
            need_cuda_capability(q, CAPABILITIES, "sm_90"),
            need_dtype(q, SUPPORTED_DTYPES),
            need_head_dims(q, k, v, SUPPORTED_HEAD_DIMS),
            need_nonempty(q, k),
            _policy_reason(policy),
            _cutlass_import_error())

    def run(self, call):
        # the eager launcher; the custom op under torch.compile and where autograd records
        if not needs_custom_op(call.q, call.k, call.v):
            return attention(call), None
        return op_call(call), None


def _policy_reason(policy: Policy) -> str | None:
    """The policy fields the kernel does not implement."""
    if policy.qk_global_scale:
        return "qk_global_scale (per-tensor NVFP4 scale) is not implemented in the kernel"
    if policy.code_rounding == "bf16" and policy.shift < 3:
        return "code_rounding='bf16' needs the shift L >= 3"
    if policy.qk_fp8 and policy.anchor > 0:
        return "qk_format 'fp8_e4m3' with anchors is not implemented in the kernel"
    if policy.anchor > MAX_ANCHOR:
        return f"anchor = {policy.anchor} > {MAX_ANCHOR}"
    return None


BACKEND = HopperBackend()
