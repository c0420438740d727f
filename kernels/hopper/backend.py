"""The Hopper (sm_90) backend of ``fp4vis.attention``: pre-pass + CuTe DSL Direct-P kernel.

``BACKEND`` (name ``"hopper"``) is what ``fp4vis.backends.registry`` registers when it loads this module.

* Supported: CUDA device of compute capability 9.0, BF16 or FP16 q/k/v (output in the same
  dtype), head dim 64 or 128 (q, k and v alike), any B, H, Sq, Skv >= 1 (partial tiles masked,
  cross-attention), Direct-P policies without the per-tensor global Q/K scale (``fast``,
  ``wan_fast``, ``accurate``, ``guard`` and user policies within those rules, anchors <= 128), and
  the FP8 Q/K policy ``fast_fp8qk`` (``qk_format="fp8_e4m3"``, without anchors).
  Anything else: ``supports`` says why, and ``backend="auto"`` falls back visibly.
* The op ``torch.ops.fp4vis.hopper_attention`` is a ``torch.library.custom_op`` with a fake
  implementation, so torch.compile keeps it as one node (no graph break); it launches on the
  current CUDA stream and allocates nothing that outlives the call, so CUDA-graph capture then
  replay with new inputs gives new outputs (compile the kernel once, outside capture, first).
* Compiled kernels are cached per configuration (``DirectPConfig.key()``); each compile is timed
  and logged (logger ``fp4vis.kernels.hopper``) and kept in ``COMPILE_TIMES``.
* Range checks: where ``fp4vis.attention`` passes a range record (``range_check`` "raise" or
  "warn"; under torch.compile the op starts it at run time from the call's site), the kernel
  variant with ``range_record`` counts saturated P blocks,
  empty rows and non-finite outputs on the device and ``fp4vis.backends.range_record`` reports them
  later (no synchronisation per call); ``run`` returns ``None`` for the RangeReport. Rows whose
  probabilities all underflow produce 0 rather than NaN.
"""

from __future__ import annotations

import functools
import logging
import threading
import time

import torch

from fp4vis.backends import range_record
from fp4vis.backends.base import (
    HOPPER,
    HOPPER_CAPABILITIES,
    Backend,
    first_reason,
    has_capability,
    need_cuda_capability,
    need_direct_p,
    need_dtype,
    need_head_dims,
    need_no_key_mask,
    need_nonempty,
)
from fp4vis.config import cached_setting, setting
from fp4vis.layout import LOG2E, kernel_params
from fp4vis.policy import QK_FP8, Policy
from fp4vis.qk_transform import QKTransform
from fp4vis.tracing import constant_at_trace_time

from .layout import fp8_key_scale_blocks
from .prepass import prepare_kernel_operands

log = logging.getLogger("fp4vis.kernels.hopper")

SUPPORTED_HEAD_DIMS = (64, 128)
SUPPORTED_DTYPES = (torch.bfloat16, torch.float16)
MAX_ANCHOR = 128

_LOCK = threading.Lock()
_KERNELS: dict[tuple, tuple[object, bool]] = {}
COMPILE_TIMES: dict[tuple, float] = {}
# Calls whose query and key sequences are both at most SHORT_SEQ run the short-sequence variant
# (DirectPConfig.ctas_per_sm = 2: CTAs of 64 query rows, two per SM) where the call names no kernel
# variant; FP4VIS_HOPPER_SHORT=0 turns that off. Measured on the H200,
# self-attention, kernel alone, side by side (benchmarks/short_seq_bench.py,
# benchmarks/results/20261129f_h200_shortseq.json): 30 % faster at 256 tokens, 9-16 % at 197, 1-6 % at
# 577, -3 % to +1 % at 1024, 10-14 % slower at 4096. Long queries over short keys (cross-attention) are
# not measured and keep the default kernel.
SHORT_SEQ = 768


# The per-call checks and set-up below are cached: at small S the call is host-bound (SDPA cuDNN
# takes ~18 us of host time per call), so every microsecond of Python counts.
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


@functools.lru_cache(maxsize=256)
def kernel_config(head_dim: int, out_dtype: str, affine_a: float, affine_b: float, shift: int,
                  native_exp2: bool, anchor: int, schedule: str, p_path: str, num_wg: int,
                  code_rounding: str, qk_fp8: bool, block_scales: str = "", ctas_per_sm: int = 0,
                  short: bool = False, range_record: bool = False):
    """``DirectPConfig.make`` for the custom op's arguments (""/0: the defaults), cached: the module
    defaults ``make`` reads from the environment (``FP4VIS_HOPPER_*``) are taken at first use, so code
    that changes them must call ``kernel_config.cache_clear()``.
    ``short`` (``short_sequences``, the caller's comparison) picks ``ctas_per_sm = 2`` where the call
    names no variant (``auto_ctas_per_sm``). ``range_record``: the variant that writes the range record."""
    from .config import DirectPConfig
    return DirectPConfig.make(head_dim, out_dtype, affine_a, affine_b, shift, native_exp2, anchor,
                              schedule=schedule or None, p_path=p_path or None, num_wg=num_wg or None,
                              code_rounding=code_rounding, qk_fp8=qk_fp8, block_scales=block_scales or None,
                              ctas_per_sm=auto_ctas_per_sm(short, schedule, p_path, num_wg, block_scales,
                                                           ctas_per_sm) or None,
                              range_record=range_record)


def short_sequences(seqlen_q: int, seqlen_k: int) -> bool:
    """Both sequences within SHORT_SEQ (and FP4VIS_HOPPER_SHORT on): where the short-sequence variant was
    measured to pay."""
    return seqlen_q <= SHORT_SEQ and seqlen_k <= SHORT_SEQ and cached_setting("FP4VIS_HOPPER_SHORT")


def auto_ctas_per_sm(short: bool, schedule: str = "", p_path: str = "", num_wg: int = 0, block_scales: str = "",
                     ctas_per_sm: int = 0) -> int:
    """The dispatch rule: 2 (the short-sequence variant) for short sequences where the call leaves every
    variant field to the defaults (""/0), else ``ctas_per_sm`` (0: the default): a variant asked for by
    name (the tests', the benchmark's) is never swapped."""
    if short and not (schedule or p_path or num_wg or block_scales or ctas_per_sm):
        return 2
    return ctas_per_sm


def _to_cute(t: torch.Tensor, tvm_ffi: bool = False):
    """Contiguous (B, H, S, D) operand or (B, H, N) scale tensor -> CuTe tensor, dynamic layout (the
    kernel makes its own (S, D, H, B) view: no permuted torch view per call)."""
    from cutlass.cute.runtime import from_dlpack
    kw = {"enable_tvm_ffi": True} if tvm_ffi else {}
    return from_dlpack(t.detach(), assumed_align=16 if t.dim() == 4 else 4,
                       **kw).mark_layout_dynamic(leading_dim=t.dim() - 1)


_NO_SCALES: dict[torch.device, torch.Tensor] = {}


def _unused_scales(device: torch.device) -> torch.Tensor:
    """A placeholder for the kernel's q_scale/k_scale arguments where the policy has none (NVFP4 Q/K)."""
    t = _NO_SCALES.get(device)
    if t is None:
        t = _NO_SCALES[device] = torch.ones(1, 1, 4, dtype=torch.float32, device=device)
    return t


def _current_stream():
    import cuda.bindings.driver as cuda
    return cuda.CUstream(torch.cuda.current_stream().cuda_stream)


def _compile(cfg, tensors) -> tuple[object, bool]:
    """Compile ``cfg``; with TVM-FFI (torch tensors passed straight in, the current stream taken
    from the caller: a few microseconds per launch) when the machine has apache-tvm-ffi and
    FP4VIS_HOPPER_TVM_FFI is on, else through the plain DLPack path. Returns (function, uses_tvm_ffi)."""
    import cutlass.cute as cute
    from cutlass import Float32, Int32, Int64
    from cutlass.cute.runtime import make_fake_stream

    from .kernel import DirectPAttentionSm90
    if setting("FP4VIS_HOPPER_TVM_FFI"):
        try:
            args = [_to_cute(t, tvm_ffi=True) for t in tensors]
            fn = cute.compile(DirectPAttentionSm90(cfg), *args, Float32(1.0), Float32(0.0), Int64(0), Int64(0),
                              Int32(0), make_fake_stream(use_tvm_ffi_env_stream=True),
                              options="--gpu-arch sm_90a --enable-tvm-ffi")
            return fn, True
        except Exception as exc:  # no apache-tvm-ffi here, or an incompatible version
            log.info("fp4vis hopper: TVM-FFI launch path unavailable (%s); using DLPack", exc)
    args = [_to_cute(t) for t in tensors]
    fn = cute.compile(DirectPAttentionSm90(cfg), *args, Float32(1.0), Float32(0.0), Int64(0), Int64(0), Int32(0),
                      _current_stream(),
                      options="--gpu-arch sm_90a")
    return fn, False


def get_kernel(cfg, tensors) -> tuple[object, bool]:
    """The compiled kernel for ``cfg`` (compiled on first use, then cached) and its launch path."""
    key = cfg.key()
    entry = _KERNELS.get(key)
    if entry is not None:
        return entry
    with _LOCK:
        entry = _KERNELS.get(key)
        if entry is None:
            t0 = time.perf_counter()
            entry = _compile(cfg, tensors)
            dt = time.perf_counter() - t0
            COMPILE_TIMES[key] = dt
            log.info("fp4vis hopper: compiled %s in %.2f s (tvm-ffi: %s)", cfg, dt, entry[1])
            _KERNELS[key] = entry
    return entry


def run_kernel(q_hat: torch.Tensor, k_hat: torch.Tensor, v6: torch.Tensor, q_scale: torch.Tensor | None,
               k_scale: torch.Tensor | None, out: torch.Tensor, cfg, s_log2: float, m_offset: float,
               record: tuple[int, int, int] = (0, 0, 0)) -> None:
    """Launch the Direct-P kernel on the operands of ``prepare_kernel_operands`` (all (B, H, S, D)
    contiguous; with ``cfg.qk_fp8`` q_hat, k_hat are float8_e4m3fn and q_scale, k_scale their
    power-of-two scales, otherwise the scales are None) on the current CUDA stream. ``record``: the
    range record's (fields address, flag address, call number) where ``cfg.range_record``
    (``fp4vis.backends.range_record.RangeRecord.launch_args``)."""
    if cfg.range_record and not (record[0] and record[1]):
        raise ValueError("record: a kernel compiled with range_record needs the record's addresses")
    if cfg.qk_fp8:
        if q_scale is None or k_scale is None:
            raise ValueError("q_scale, k_scale: the FP8 Q/K kernel needs both (prepare_fp8_operands)")
        need = fp8_key_scale_blocks(k_hat.shape[-2])   # the kernel reads whole tiles without a bound check
        if (q_scale.dtype != torch.float32 or tuple(q_scale.shape) != tuple(q_hat.shape[:-1])
                or k_scale.dtype != torch.float32 or tuple(k_scale.shape) != tuple(k_hat.shape[:-2]) + (need,)):
            raise ValueError(f"q_scale, k_scale: float32 {tuple(q_hat.shape[:-1])} and "
                             f"{tuple(k_hat.shape[:-2]) + (need,)} expected (prepare_fp8_operands), got "
                             f"{q_scale.dtype} {tuple(q_scale.shape)} and {k_scale.dtype} {tuple(k_scale.shape)}")
        q_hat, k_hat = q_hat.view(torch.uint8), k_hat.view(torch.uint8)   # the kernel recasts to E4M3
    else:
        q_scale = k_scale = _unused_scales(q_hat.device)
    tensors = (q_hat, k_hat, v6, out, q_scale, k_scale)
    fn, tvm_ffi = get_kernel(cfg, tensors)
    if tvm_ffi:
        fn(*tensors, s_log2, m_offset, *record)
    else:
        from cutlass import Float32, Int32, Int64
        fn(*(_to_cute(t) for t in tensors), Float32(s_log2), Float32(m_offset), Int64(record[0]), Int64(record[1]),
           Int32(record[2]), _current_stream())


def hopper_attention_eager(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, affine_a: float,
                           affine_b: float, shift: int, native_exp2: bool, anchor: int, margin_raw: float,
                           qk_fmt: str, schedule: str = "", p_path: str = "", num_wg: int = 0,
                           code_rounding: str = "exact", block_scales: str = "", ctas_per_sm: int = 0,
                           record_fields: int = 0, record_flag: int = 0, call_number: int = 0,
                           record_site: int = 0, q_norm: torch.Tensor | None = None,
                           k_norm: torch.Tensor | None = None, q_eps: float = 0.0, k_eps: float = 0.0,
                           rope_cos: torch.Tensor | None = None, rope_sin: torch.Tensor | None = None) -> torch.Tensor:
    """Direct-P attention of (B, H, S, D) BF16/FP16 CUDA tensors (views) on the Hopper kernel.
    ``schedule`` / ``p_path`` / ``num_wg`` / ``block_scales`` / ``ctas_per_sm``: ""/0 the defaults, else a
    kernel variant (see ``config.DirectPConfig``; for the tests and the benchmark). With the defaults,
    sequences up to ``SHORT_SEQ`` run the short-sequence variant (``kernel_config``).
    ``record_fields``, ``record_flag``, ``call_number``: the range record's launch arguments
    (``fp4vis.backends.range_record``); 0: the variant without the record. ``record_site``: a compiled
    call's site (``range_record.call_site``): the record is started here, at run time, instead.
    ``q_norm`` .. ``rope_sin``: a ``fp4vis.qk_transform.QKTransform`` as tensors (``transform_args``): q, k
    are then raw projections, normed and rotated in the pre-pass.

    This plain function is the body of the custom op ``torch.ops.fp4vis.hopper_attention``;
    ``HopperBackend`` calls it directly outside torch.compile, which saves the dispatcher's
    30-85 us per call (H200, benchmarks/results/20261129b_h200_prepass.json)."""
    qk = None
    if q_norm is not None or k_norm is not None or rope_cos is not None:
        qk = QKTransform(q_norm, k_norm, q_eps, k_eps, None if rope_cos is None else (rope_cos, rope_sin))
    if record_site:
        record_fields, record_flag, call_number = range_record.start_site_call(record_site, (q, k, v))
    return _attention(q, k, v, qk, scale, affine_a, affine_b, shift, native_exp2, anchor, margin_raw, qk_fmt,
                      schedule, p_path, num_wg, code_rounding, block_scales, ctas_per_sm, record_fields, record_flag,
                      call_number)


def transform_args(qk: QKTransform | None) -> dict:
    """The custom op's keyword arguments for a q/k transform (none for None)."""
    if qk is None:
        return {}
    cos, sin = qk.rope if qk.rope is not None else (None, None)
    return dict(q_norm=qk.q_weight, k_norm=qk.k_weight, q_eps=float(qk.q_eps), k_eps=float(qk.k_eps),
                rope_cos=cos, rope_sin=sin)


def _attention(q, k, v, qk, scale, affine_a, affine_b, shift, native_exp2, anchor, margin_raw, qk_fmt, schedule="",
               p_path="", num_wg=0, code_rounding="exact", block_scales="", ctas_per_sm=0, record_fields=0,
               record_flag=0, call_number=0) -> torch.Tensor:
    """``hopper_attention_eager`` with ``qk``: None, or the ``fp4vis.qk_transform.QKTransform`` that
    makes the attention's q and k from the raw projections q, k (folded into the pre-pass)."""
    record = None
    if call_number:   # the pre-pass counts the scale range into the record the kernel writes
        rec = range_record.record_for(q.device)
        record = (rec.fields, rec.flag, call_number)
    ops = prepare_kernel_operands(q, k, v, qk_fmt, anchor, qk=qk, record=record)
    out = torch.empty(q.shape[:-1] + (v.shape[-1],), dtype=q.dtype, device=q.device)
    cfg = kernel_config(q.shape[-1], "bf16" if q.dtype == torch.bfloat16 else "fp16", affine_a, affine_b,
                        shift, native_exp2, anchor, schedule, p_path, num_wg, code_rounding, qk_fmt == QK_FP8,
                        block_scales, ctas_per_sm, short_sequences(q.shape[-2], k.shape[-2]), bool(record_fields))
    run_kernel(*ops, out, cfg, scale * LOG2E, margin_raw, (record_fields, record_flag, call_number))
    return out


hopper_attention = torch.library.custom_op("fp4vis::hopper_attention", mutates_args=(),
                                           device_types="cuda")(hopper_attention_eager)


@hopper_attention.register_fake
def _hopper_attention_fake(q, k, v, scale, affine_a, affine_b, shift, native_exp2, anchor, margin_raw,
                           qk_fmt, schedule="", p_path="", num_wg=0, code_rounding="exact", block_scales="",
                           ctas_per_sm=0, record_fields=0, record_flag=0, call_number=0, record_site=0, q_norm=None,
                           k_norm=None, q_eps=0.0, k_eps=0.0, rope_cos=None, rope_sin=None):
    return q.new_empty(q.shape[:-1] + (v.shape[-1],))


def policy_args(policy: Policy, head_dim: int, scale: float) -> dict:
    """The custom op's keyword arguments for a policy (``fp4vis.layout.kernel_params``, flattened for the op)."""
    p = kernel_params(policy, head_dim, scale)
    return dict(affine_a=p.affine_a, affine_b=p.affine_b, shift=p.shift, native_exp2=p.native_exp2, anchor=p.anchor,
                margin_raw=p.margin_raw, qk_fmt=p.qk_layout, code_rounding=p.code_rounding)


class HopperBackend(Backend):
    """Direct-P on the H200/H100 tensor cores (CuTe DSL, sm_90a)."""

    name = HOPPER
    records_range = True
    fuses_qk_transform = True

    def unavailable_reason(self) -> str | None:
        if not torch.cuda.is_available():
            return "no CUDA device"
        if not has_capability(HOPPER_CAPABILITIES):
            return "no sm_90 (Hopper) GPU"
        return _cutlass_import_error()

    def supports(self, call) -> str | None:
        q, k, v, policy = call.q, call.k, call.v, call.policy
        return first_reason(
            need_direct_p(policy),
            need_no_key_mask(call),
            need_cuda_capability(q, HOPPER_CAPABILITIES, "sm_90"),
            need_dtype(q, SUPPORTED_DTYPES),
            need_head_dims(q, k, v, SUPPORTED_HEAD_DIMS),
            need_nonempty(q, k),
            _policy_reason(policy),
            _cutlass_import_error())

    def run(self, call):
        # the custom op under torch.compile (one graph node: the views, the q/k transform and the call's
        # site go in, the pre-pass reads them in place and the record starts at run time) and where
        # autograd would need it (it has no backward: it then fails at backward, not silently); the
        # same function, undispatched, otherwise (the dispatcher costs tens of microseconds a call)
        q, k, v, scale = call.q, call.k, call.v, call.scale
        grad = torch.is_grad_enabled() and (q.requires_grad or k.requires_grad or v.requires_grad)
        rec = {} if call.record is None else dict(zip(("record_fields", "record_flag", "call_number"), call.record))
        args = dict(policy_args(call.policy, q.shape[-1], scale), **rec)
        if torch.compiler.is_compiling() or grad:
            out = torch.ops.fp4vis.hopper_attention(q, k, v, scale, **args, record_site=call.record_site,
                                                    **transform_args(call.qk_transform))
            return out, None
        return _attention(q, k, v, call.qk_transform, scale, **args), None


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
