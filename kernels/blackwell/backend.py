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
* ``torch.ops.fp4vis.blackwell_attention`` is a ``torch.library.custom_op`` with a fake
  implementation (one graph node under torch.compile); launches on the current CUDA stream and
  allocates only its operands and output, so CUDA-graph capture and replay with new inputs work
  once the kernel is compiled and self-checked (make one eager call first).
* Compiled kernels are cached per ``KernelConfig.key()``; compile/load times are logged (logger
  ``fp4vis.kernels.blackwell``) and kept in ``COMPILE_TIMES``.
* Range checks through the range record (``fp4vis.backends.range_record``), as the Hopper kernel: where
  ``fp4vis.attention`` passes a record, the call's number goes to the kernel, which counts saturated
  blocks, empty rows and non-finite outputs into the device's record (``run`` returns None for
  the RangeReport). Rows whose probabilities all underflow give 0.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import os
import threading
import time

import torch

from fp4vis.backends import range_record
from fp4vis.backends.base import (
    BLACKWELL,
    BLACKWELL_CAPABILITIES,
    Backend,
    device_capability,
    first_reason,
    need_direct_p,
    need_dtype,
    need_head_dims,
    need_no_key_mask,
    need_nonempty,
)
from fp4vis.layout import kernel_params
from fp4vis.policy import Policy
from fp4vis.tracing import constant_at_trace_time

from . import cubin as cubin_mod
from . import selfcheck
from .config import LOG2E, MIN_TRITON, SUPPORTED_HEAD_DIMS, KernelConfig, arch_of_capability
from .prepass import prepare

log = logging.getLogger("fp4vis.kernels.blackwell")

SUPPORTED_DTYPES = (torch.bfloat16, torch.float16)
VERIFICATION_CAPABILITY = (9, 0)

_LOCK = threading.Lock()
_KERNELS: dict[tuple, object] = {}
COMPILE_TIMES: dict[tuple, float] = {}


# ---------------------------------------------------------------------------------------------
# environment
# ---------------------------------------------------------------------------------------------

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
    for name in ("kernel.py", "prepass.py", "config.py"):
        with open(os.path.join(here, name), "rb") as f:
            h.update(f.read())
    return h.hexdigest()[:16]


def _fp4vis_version() -> str:
    try:
        from importlib.metadata import version
        return version("fp4vis")
    except Exception:  # pragma: no cover
        return "unknown"


# Memo dicts, read through functions that torch.compile runs for real while tracing (their results are
# constants of the graph) rather than traces: Dynamo would trace the filesystem probes of a cache wrapper.
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
def _has_cubin(key: tuple) -> bool:
    """Whether the cubin of the ``KernelConfig`` with this ``key()`` is there (a key: Dynamo passes plain
    values to a function it runs while tracing)."""
    ok = _CUBINS.get(key)
    if ok is None:
        ok = _CUBINS[key] = cubin_mod.has_cubin(KernelConfig(*key))
    return ok


def _compute_route(index: int) -> tuple[str, int] | str:
    cap = device_capability(index)
    if cap in BLACKWELL_CAPABILITIES:
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


def _index(device: torch.device) -> int:
    if device.type != "cuda":
        return 0
    return device.index if device.index is not None else torch.cuda.current_device()


def kernel_config(index: int, head_dim: int, dtype: torch.dtype, native: bool, anchored: bool) -> KernelConfig:
    r = route(index)
    if isinstance(r, str):
        raise RuntimeError(f"fp4vis blackwell: {r}")
    return KernelConfig(head_dim, "bf16" if dtype == torch.bfloat16 else "fp16", native, anchored, r[1])


def _jit_launcher(cfg: KernelConfig):
    from .kernel import constexprs, direct_p_fwd
    consts = constexprs(cfg)

    def fn(grid, args):
        direct_p_fwd[grid](*args, **consts, num_warps=cfg.num_warps, num_stages=cfg.num_stages)
    return fn


def get_kernel(index: int, cfg: KernelConfig):
    """The launcher ``fn(grid, args)`` of ``cfg`` on device ``index`` (compiled / loaded once)."""
    key = (cfg.key(), index)
    fn = _KERNELS.get(key)
    if fn is not None:
        return fn
    with _LOCK:
        fn = _KERNELS.get(key)
        if fn is None:
            t0 = time.perf_counter()
            kind = route(index)[0]
            if kind == "cubin":
                fn = cubin_mod.get(cfg)
            else:
                fn = _jit_launcher(cfg)
            COMPILE_TIMES[key] = time.perf_counter() - t0
            log.info("fp4vis blackwell: %s ready via %s in %.2f s", cfg.tag(), kind, COMPILE_TIMES[key])
            _KERNELS[key] = fn
    return fn


# ---------------------------------------------------------------------------------------------
# the op
# ---------------------------------------------------------------------------------------------

def run_unchecked(q, k, v, scale, affine_a, affine_b, shift, native_exp2, anchor, margin_raw, qk_fmt,
                  launcher=None, call_number: int = 0, record=None) -> torch.Tensor:
    """Pre-pass + kernel of (B, H, S, D) tensors, without the self-check gate (the self-check runs
    this). ``launcher(cfg, grid, args)``: inject another launch (tests). ``call_number`` > 0: the
    kernel adds its range counts to ``record`` (a ``fp4vis.backends.range_record.RangeRecord``;
    default: the device's) under that number."""
    from ..scale_record import placeholder
    from .kernel import grid, runtime_args
    index = _index(q.device)
    cfg = kernel_config(index, q.shape[-1], q.dtype, native_exp2, anchor > 0)
    if call_number:   # the record's words, which the pre-pass and the kernel add to
        rec = record if record is not None else range_record.record_for(q.device)
        words = (rec.fields, rec.flag, call_number)
    else:
        words = (placeholder(q.device), placeholder(q.device), 0)
    ops = prepare(q, k, v, qk_fmt, anchor, cfg.block_m, cfg.block_n, record=words if call_number else None)
    b, h = q.shape[:2]
    out = torch.empty(b * h, q.shape[-2], v.shape[-1], dtype=q.dtype, device=q.device)
    params = dict(s_log2=scale * LOG2E, margin_raw=margin_raw, affine_a=affine_a, affine_b=affine_b, shift=shift,
                  n_anchor=min(anchor, k.shape[-2]))
    args = runtime_args(ops, out, params, words)
    if launcher is None:
        get_kernel(index, cfg)(grid(cfg, ops), args)
    else:
        launcher(cfg, grid(cfg, ops), args)
    return out.unflatten(0, (b, h))


def blackwell_attention_eager(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, affine_a: float,
                              affine_b: float, shift: int, native_exp2: bool, anchor: int, margin_raw: float,
                              qk_fmt: str, call_number: int = 0, record_site: int = 0) -> torch.Tensor:
    """Direct-P attention of (B, H, S, D) BF16/FP16 CUDA tensors on the Blackwell kernel; refuses
    (SelfCheckError) on a GPU where the kernel failed its self-check. The body of the custom op
    ``torch.ops.fp4vis.blackwell_attention``. ``call_number``: the range record's number of this call
    (0: no record). ``record_site``: a compiled call's site (``range_record.call_site``): the call is
    numbered here, at run time, instead."""
    BACKEND.ensure_verified(q.device)
    if record_site:
        call_number = range_record.start_site_call(record_site, (q, k, v))[2]
    return run_unchecked(q, k, v, scale, affine_a, affine_b, shift, native_exp2, anchor, margin_raw, qk_fmt,
                         call_number=call_number)


blackwell_attention = torch.library.custom_op("fp4vis::blackwell_attention", mutates_args=(),
                                              device_types="cuda")(blackwell_attention_eager)


@blackwell_attention.register_fake
def _blackwell_attention_fake(q, k, v, scale, affine_a, affine_b, shift, native_exp2, anchor, margin_raw, qk_fmt,
                              call_number=0, record_site=0):
    return q.new_empty(q.shape[:-1] + (v.shape[-1],))


def policy_args(policy: Policy, head_dim: int, scale: float) -> dict:
    """The op's keyword arguments for a policy (``fp4vis.layout.kernel_params``, flattened for the op)."""
    p = kernel_params(policy, head_dim, scale)
    return dict(affine_a=p.affine_a, affine_b=p.affine_b, shift=p.shift, native_exp2=p.native_exp2, anchor=p.anchor,
                margin_raw=p.margin_raw, qk_fmt=p.qk_layout)


# ---------------------------------------------------------------------------------------------
# the backend
# ---------------------------------------------------------------------------------------------

class BlackwellBackend(Backend):
    """Direct-P on the Blackwell block-scaled FP4 tensor cores (Triton tl.dot_scaled)."""

    name = BLACKWELL
    records_range = True

    def __init__(self):
        self.kernel_fn = None   # tests inject a (q, k, v, policy, scale) -> out to check the gate

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
        reason = need_direct_p(policy) or need_no_key_mask(call) or (
            None if q.is_cuda else "tensors are not on a CUDA device")
        if reason is not None:
            return reason
        index = _index(q.device)
        r = route(index)   # needs a CUDA device: the checks below come after it
        if isinstance(r, str):
            return r
        reason = first_reason(need_dtype(q, SUPPORTED_DTYPES), need_head_dims(q, k, v, SUPPORTED_HEAD_DIMS),
                              need_nonempty(q, k), _policy_reason(policy))
        if reason is not None:
            return reason
        if r[0] == "cubin":
            cfg = kernel_config(index, q.shape[-1], q.dtype, policy.native_exp2, policy.anchor > 0)
            if not _has_cubin(cfg.key()):
                return f"no precompiled cubin {cfg.tag()} in {cubin_mod.cubin_dir()}"
        return None

    # --- self-check
    def identity(self, device: torch.device) -> dict:
        index = _index(device)
        r = route(index)
        kind = r if isinstance(r, str) else r[0]
        if kind == "jit":
            import triton
            compiler = triton.__version__
        else:
            compiler = "cubin:" + str(cubin_mod.cubin_dir())
        cap = device_capability(index)
        return {"device": torch.cuda.get_device_name(index), "capability": f"{cap[0]}.{cap[1]}",
                "driver": driver_version(), "fp4vis": _fp4vis_version(), "route": kind, "compiler": compiler,
                "source": _source_hash()}

    def _check_fn(self):
        if self.kernel_fn is not None:
            return self.kernel_fn

        def fn(q, k, v, policy, scale):
            return run_unchecked(q, k, v, float(scale), **policy_args(policy, q.shape[-1], float(scale)))
        return fn

    def verdict(self, device: torch.device, force: bool = False) -> dict:
        return selfcheck.verdict_for(self.identity(device), self._check_fn(), device, force=force)

    def ensure_verified(self, device: torch.device) -> dict:
        v = self.verdict(device)
        if not v["passed"]:
            selfcheck._raise_failed(v)
        return v

    def status(self) -> dict:
        """For ``fp4vis info``: availability, routes, compiled configs, this process's verdicts."""
        return {"available": self.unavailable_reason() or "yes",
                "triton": triton_problem() or "ok",
                "routes": {i: route(i) for i in range(torch.cuda.device_count())} if torch.cuda.is_available() else {},
                "compiled": sorted(KernelConfig(*key[0]).tag() for key in _KERNELS),
                "selfcheck": {v["identity"].get("device", "?"): ("passed" if v["passed"] else "FAILED")
                              for v in selfcheck._VERDICTS.values()}}

    # --- the call
    def run(self, call):
        q, k, v, policy, scale = call.q, call.k, call.v, call.policy, call.scale
        grad = torch.is_grad_enabled() and (q.requires_grad or k.requires_grad or v.requires_grad)
        if self.kernel_fn is not None:  # a test's injected kernel goes through the same gate
            self.ensure_verified(q.device)
            return self.kernel_fn(q, k, v, policy, scale), None
        traced = torch.compiler.is_compiling() or grad
        op = torch.ops.fp4vis.blackwell_attention if traced else blackwell_attention_eager
        out = op(q.contiguous(), k.contiguous(), v.contiguous(), scale, **policy_args(policy, q.shape[-1], scale),
                 call_number=call.record[2] if call.record else 0, record_site=call.record_site)
        return out, None


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
    """For ``fp4vis selfcheck``: run the check now (``force``), return (passed, printable table)."""
    dev = torch.device("cuda", torch.cuda.current_device()) if device is None else torch.device(device)
    v = BACKEND.verdict(dev, force=force)
    return v["passed"], selfcheck.format_table(v)
