"""The Blackwell backend of ``fp4vis.attention``: pre-pass + the Triton Direct-P kernel on the
block-scaled FP4 MMAs (sm_100a / sm_103a / sm_120a), self-checked on first use.

* Supported: compute capability 10.0, 10.3 or 12.0 with Triton >= 3.8; BF16 or FP16 q/k/v (output
  in the same dtype), head dim 64 or 128, any B, H, Sq, Skv >= 1 (partial tiles masked,
  cross-attention), exact (docs/numerics.md) Direct-P policies without the per-tensor global Q/K scale (fast,
  wan_fast, accurate, guard and user policies within those rules, any anchor count).
* Verification route on sm_90 (the H200): ``backend="blackwell"`` runs the same source where
  precompiled sm_90 cubins exist (``FP4VIS_BLACKWELL_CUBINS``, see ``cubin.py``) or the local Triton
  (>= 3.8) can JIT it (dot_scaled lowers to an exact BF16 upcast + wgmma there). ``auto`` never picks
  it: the Hopper CuTe DSL backend is the sm_90 product path.
* A call's way: ``BlackwellBackend.run(call)`` -> the self-check's gate (``launch.ensure_verified``: run once per
  device) -> ``launch.attention(call)``: the policy's ``KernelParams``, the route's ``KernelConfig``
  (``route.py``), ``prepass.kernel_operands``, the kernel's arguments and the launch. Under torch.compile, and where
  autograd records, through ``torch.ops.fp4vis.blackwell_attention`` instead (``op.py``: the one place a call is
  flattened), one graph node. It launches on the current CUDA stream and allocates only its operands and output,
  so CUDA-graph capture and replay with new inputs work once the kernel is compiled and self-checked (make one
  eager call first).
* Range checks through the range record (``fp4vis.backends.range_record``), as the Hopper kernel: where
  ``fp4vis.attention`` passes a record, the call's number goes to the kernel, which counts saturated
  blocks, empty rows and non-finite outputs into the device's record (``run`` returns None for
  the RangeReport). Rows whose probabilities all underflow give 0.
"""

from __future__ import annotations

import torch

from fp4vis.backends.base import (
    Backend,
    first_reason,
    need_direct_p,
    need_dtype,
    need_head_dims,
    need_nonempty,
)
from fp4vis.policy import Policy

from ..launch_shared import needs_custom_op
from . import cubin as cubin_mod
from . import first_use, launch, selfcheck
from .config import CAPABILITIES, SUPPORTED_HEAD_DIMS, KernelConfig
from .op import op_call
from .route import cubin_available, device_index, route, triton_problem

SUPPORTED_DTYPES = (torch.bfloat16, torch.float16)


class BlackwellBackend(Backend):
    """Direct-P on the Blackwell block-scaled FP4 tensor cores (Triton tl.dot_scaled)."""

    name = "blackwell"
    auto_capabilities = CAPABILITIES
    records_range = True

    # --- availability
    def unavailable_reason(self) -> str | None:
        if not torch.cuda.is_available():
            return "no CUDA device"
        reasons = []
        for i in range(torch.cuda.device_count()):
            r = route(i)
            if not isinstance(r, str):
                return None
            reasons.append(r)
        return "; ".join(sorted(set(reasons)))

    def supports(self, call) -> str | None:
        q, k, v, policy = call.q, call.k, call.v, call.policy
        reason = need_direct_p(policy) or (
            None if q.is_cuda else "tensors are not on a CUDA device")
        if reason is not None:
            return reason
        index = device_index(q.device)
        r = route(index)   # needs a CUDA device: the checks below come after it
        if isinstance(r, str):
            return r
        reason = first_reason(need_dtype(q, SUPPORTED_DTYPES), need_head_dims(q, k, v, SUPPORTED_HEAD_DIMS),
                              need_nonempty(q, k), _policy_reason(policy))
        if reason is not None:
            return reason
        if r[0] == "cubin":
            cfg = launch.product_config(index, q.shape[-1], q.dtype, policy.native_exp2, policy.anchor > 0,
                                        call.key_mask is not None)
            if not cubin_available(cfg.key()):
                return f"no precompiled cubin {cfg.tag()} in {cubin_mod.cubin_dir()}"
        return None

    # --- self-check
    def verdict(self, device: torch.device, force: bool = False, shape=None) -> dict:
        return launch.verdict(device, force, shape)

    def ensure_verified(self, device: torch.device, shape=None) -> dict:
        return launch.ensure_verified(device, shape)

    def status(self) -> dict:
        """For ``fp4vis info``: availability, routes, compiled configs, the verdicts (this process's and those cached
        for this machine's GPUs) and their first-use figures (``first_use.summary``)."""
        routes = {i: route(i) for i in range(torch.cuda.device_count())} if torch.cuda.is_available() else {}
        verdicts = selfcheck.process_verdicts()
        for i, r in routes.items():
            v = None if isinstance(r, str) else selfcheck.known_verdict(launch.identity(torch.device("cuda", i)))
            if v is not None and all(v is not w for w in verdicts):
                verdicts.append(v)
        return {"available": self.unavailable_reason() or "yes",
                "triton": triton_problem() or "ok",
                "routes": routes,
                "compiled": sorted(KernelConfig(*key[0]).tag() for key in launch.KERNELS.keys()),
                "selfcheck": {v["identity"].get("device", "?"): ("passed" if v["passed"] else "FAILED")
                              for v in verdicts},
                "first_use_timing": {v["identity"].get("device", "?"): first_use.summary(v["timing"])
                                     for v in verdicts if v.get("timing")}}

    # --- the call
    def run(self, call):
        # the eager launcher behind the self-check's gate; the custom op under torch.compile and where autograd
        # records
        q, k, v = call.q, call.k, call.v
        if not needs_custom_op(q, k, v):
            launch.ensure_verified(q.device, shape=first_use.call_shape(call))
            return launch.attention(call), None
        return op_call(call), None


def _policy_reason(policy: Policy) -> str | None:
    """The policy fields the kernel does not implement."""
    if policy.qk_fp8:
        return "qk_format 'fp8_e4m3' is a Hopper policy (FP8 Q/K); the Blackwell kernel is NVFP4"
    if policy.qk_global_scale:
        return "qk_global_scale (per-tensor NVFP4 scale) is not implemented in the kernel"
    if policy.code_rounding != "exact":
        return f"code_rounding={policy.code_rounding!r} (the kernel rounds P codes exactly)"
    return None


BACKEND = BlackwellBackend()


def ensure(device=None) -> dict:
    """Run (or look up) the self-check of the Blackwell backend on ``device`` (default: current
    CUDA device) and return the verdict; raises SelfCheckError when it failed."""
    return BACKEND.ensure_verified(torch.device("cuda", torch.cuda.current_device()) if device is None
                                   else torch.device(device))


def run_table(device=None, force: bool = True) -> tuple[bool, str]:
    """For ``fp4vis selfcheck``: run the check now (``force``) and, where it passed, the first-use timing; return
    (passed, printable table with the figures: ``first_use.format_timing``)."""
    dev = torch.device("cuda", torch.cuda.current_device()) if device is None else torch.device(device)
    v = BACKEND.verdict(dev, force=force)
    timing = first_use.format_timing(v.get("timing")) if v["passed"] else "first-use timing: none (the check failed)"
    return v["passed"], selfcheck.format_table(v) + "\n" + timing
