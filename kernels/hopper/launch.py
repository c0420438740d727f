"""The eager launcher of the Hopper backend: a typed call (``fp4vis.call.AttentionCall``) through the pre-pass and
the CuTe DSL kernel. ``attention(call, config)`` asks ``fp4vis.policy`` for the policy's kernel parameters,
``config.product_config`` for the kernel variant (or takes the one a test or a benchmark hands it),
``prepass.kernel_operands`` for the operands, and ``launch``es the compiled kernel on the current CUDA stream.

Compiled kernels are cached per configuration (``KERNELS``, by ``KernelConfig.key()``:
``kernels/launch_shared.py``); each compile is timed and logged (logger ``fp4vis.kernels.hopper``) and kept in
``COMPILE_TIMES``. With TVM-FFI (``FP4VIS_HOPPER_TVM_FFI``, where apache-tvm-ffi imports) torch tensors go straight
in and the stream is the caller's (a few microseconds per launch); otherwise through DLPack. At small S the call is
host-bound (SDPA cuDNN takes ~18 us of host time per call), so every per-call step is cached.
"""

from __future__ import annotations

import logging
from typing import NamedTuple

import torch

from fp4vis.call import AttentionCall, RecordSlot
from fp4vis.policy import KernelParams
from fp4vis.settings import KernelSettings, kernel_settings

from ..launch_shared import CompiledKernels
from ..scale_record import decide
from .config import KernelConfig, product_config
from .prepass import KernelOperands, kernel_operands

log = logging.getLogger("fp4vis.kernels.hopper")

KERNELS: CompiledKernels[CompiledKernel] = CompiledKernels(log)   # by KernelConfig.key()
COMPILE_TIMES = KERNELS.compile_times
# Calls whose query and key sequences are both at most SHORT_SEQ run the short-sequence variant
# (KernelConfig.ctas_per_sm = 2: CTAs of 64 query rows, two per SM) where the call names no kernel
# variant (``product_config``); FP4VIS_HOPPER_SHORT=0 turns that off. Measured on the H200,
# self-attention, kernel alone, side by side (benchmarks/short_seq_bench.py,
# benchmarks/results/20261129f_h200_shortseq.json): 30 % faster at 256 tokens, 9-16 % at 197, 1-6 % at
# 577, -3 % to +1 % at 1024, 10-14 % slower at 4096. Long queries over short keys (cross-attention) are
# not measured and keep the default kernel.
SHORT_SEQ = 768


def short_sequences(seqlen_q: int, seqlen_k: int, settings: KernelSettings) -> bool:
    """Both sequences within SHORT_SEQ (and the short variant switched on): where it was measured to pay."""
    return seqlen_q <= SHORT_SEQ and seqlen_k <= SHORT_SEQ and settings.hopper_short


def _to_cute(t: torch.Tensor | None, tvm_ffi: bool = False):
    """Contiguous (B, H, S, D) operand, (B, H, N) scale tensor or (B,) key counts -> CuTe tensor, dynamic
    layout (the kernel makes its own (S, D, H, B) view: no permuted torch view per call); None stays None."""
    from cutlass.cute.runtime import from_dlpack
    if t is None:
        return None
    kw = {"enable_tvm_ffi": True} if tvm_ffi else {}
    return from_dlpack(t.detach(), assumed_align=16 if t.dim() == 4 else 4,
                       **kw).mark_layout_dynamic(leading_dim=t.dim() - 1)


_NO_SCALES: dict[torch.device, torch.Tensor] = {}
_NO_RECORD = (0, 0, 0)


def _unused_scales(device: torch.device) -> torch.Tensor:
    """A placeholder for the kernel's q_scale/k_scale arguments where the policy has none (NVFP4 Q/K)."""
    t = _NO_SCALES.get(device)
    if t is None:
        t = _NO_SCALES[device] = torch.ones(1, 1, 4, dtype=torch.float32, device=device)
    return t


def _current_stream():
    import cuda.bindings.driver as cuda
    return cuda.CUstream(torch.cuda.current_stream().cuda_stream)


class CompiledKernel(NamedTuple):
    """A compiled kernel variant and how it is launched: through TVM-FFI (torch tensors passed straight in, the
    stream the caller's) or through DLPack."""

    fn: object
    tvm_ffi: bool

    def __call__(self, tensors: tuple, s_log2: float, margin_raw: float, words: tuple) -> None:
        if self.tvm_ffi:
            self.fn(*tensors, s_log2, margin_raw, *words)
            return
        from cutlass import Float32, Int32, Int64
        self.fn(*(_to_cute(t) for t in tensors), Float32(s_log2), Float32(margin_raw), Int64(words[0]),
                Int64(words[1]), Int32(words[2]), _current_stream())


def compile_kernel(cfg: KernelConfig, tensors: tuple, tvm_ffi: bool) -> CompiledKernel:
    """Compile ``cfg``: through TVM-FFI where ``tvm_ffi`` and the machine has apache-tvm-ffi, else through the
    plain DLPack path."""
    import cutlass.cute as cute
    from cutlass import Float32, Int32, Int64
    from cutlass.cute.runtime import make_fake_stream

    from .kernel import DirectPAttentionSm90
    if tvm_ffi:
        try:
            args = [_to_cute(t, tvm_ffi=True) for t in tensors]
            fn = cute.compile(DirectPAttentionSm90(cfg), *args, Float32(1.0), Float32(0.0), Int64(0), Int64(0),
                              Int32(0), make_fake_stream(use_tvm_ffi_env_stream=True),
                              options="--gpu-arch sm_90a --enable-tvm-ffi")
            return CompiledKernel(fn, True)
        except Exception as exc:  # no apache-tvm-ffi here, or an incompatible version
            log.info("fp4vis hopper: TVM-FFI launch path unavailable (%s); using DLPack", exc)
    args = [_to_cute(t) for t in tensors]
    fn = cute.compile(DirectPAttentionSm90(cfg), *args, Float32(1.0), Float32(0.0), Int64(0), Int64(0), Int32(0),
                      _current_stream(), options="--gpu-arch sm_90a")
    return CompiledKernel(fn, False)


def compiled_kernel(cfg: KernelConfig, tensors: tuple, tvm_ffi: bool) -> CompiledKernel:
    """The compiled kernel ``cfg`` (``compile_kernel``; compiled on first use, then cached)."""
    return KERNELS.get(cfg.key(), lambda: compile_kernel(cfg, tensors, tvm_ffi),
                       lambda run: f"fp4vis hopper: compiled {cfg} (tvm-ffi: {run.tvm_ffi})")


def output_like(q: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """The kernel's output, (B, H, Sq, Dv) in q's dtype, laid out in memory as (B, Sq, H, Dv): the layout every
    caller turns it into (diffusers' processors, timm and transformers flatten the heads into the channels), which
    then costs no copy. SDPA's flash and cuDNN kernels return theirs the same way; the kernel stores rows through
    the output's strides."""
    b, h, s = q.shape[:-1]
    return q.new_empty(b, s, h, v.shape[-1]).transpose(1, 2)


def launch(cfg: KernelConfig, ops: KernelOperands, out: torch.Tensor, params: KernelParams,
           record: RecordSlot | None = None, tvm_ffi: bool = True) -> None:
    """Launch the Direct-P kernel ``cfg`` on the pre-pass's operands into ``out`` ((B, H, Sq, Dv), q's dtype, D
    contiguous; ``output_like``'s layout or any other) on the current CUDA stream. ``record``: the call's range
    record where ``cfg.range_record``."""
    if cfg.range_record and record is None:
        raise ValueError("record: a kernel compiled with range_record needs the call's record")
    if cfg.pv_fp8 != (ops.v_scale is not None):
        raise ValueError(f"v: the kernel variant {'reads V^T in E4M3' if cfg.pv_fp8 else 'reads MXFP4 V'}, the "
                         f"operands {'have MXFP4 V' if ops.v_scale is None else 'have V^T in E4M3'}")
    v = ops.v6.view(torch.uint8) if cfg.pv_fp8 else ops.v6   # the kernel recasts E4M3 bytes
    if cfg.qk_fp8:
        tensors = (ops.q.view(torch.uint8), ops.k.view(torch.uint8), v, out, ops.q_scale, ops.k_scale)
    else:
        unused = _unused_scales(out.device)
        tensors = (ops.q, ops.k, v, out, unused, unused)
    if cfg.key_lengths != (ops.key_lengths is not None):
        raise ValueError(f"key_lengths: the kernel variant {'reads' if cfg.key_lengths else 'takes no'} key counts, "
                         f"the operands {'have none' if ops.key_lengths is None else 'have them'}")
    tensors += (ops.key_lengths, ops.v_scale)
    words = record.addresses if record is not None and cfg.range_record else _NO_RECORD
    compiled_kernel(cfg, tensors, tvm_ffi)(tensors, params.s_log2, params.margin_raw, words)


def attention(call: AttentionCall, config: KernelConfig | None = None) -> torch.Tensor:
    """The eager launcher: ``call`` (validated, (B, H, S, D) CUDA views) through the pre-pass and the kernel.
    ``config``: a kernel variant (the tests', the benchmarks'); None: ``product_config`` for the call. The kernel
    decides on the scale range its pre-pass recorded (``kernels/scale_record.py``); where it does not run or records
    nothing, ``scale_record.decide`` does."""
    q, k = call.q, call.k
    params = call.policy.kernel_params(q.shape[-1], call.scale)
    settings = kernel_settings()
    cfg = config or product_config(params, q.shape[-1], "bf16" if q.dtype == torch.bfloat16 else "fp16",
                                   short_sequences(q.shape[-2], k.shape[-2], settings), call.record is not None,
                                   call.key_mask is not None)
    try:
        ops = kernel_operands(call, params, settings)
        out = output_like(q, call.v)
        launch(cfg, ops, out, params, call.record, settings.hopper_tvm_ffi)
    except BaseException:
        decide(call.record)   # no kernel decided on the pre-pass's scale range: its words must not reach the next call
        raise
    if call.record is not None and not cfg.range_record:
        decide(call.record)   # a variant that records nothing (a timing P path) leaves the decision to its own launch
    return out
