"""The Hopper pre-pass's host side: q, k, v -> the kernel's operands in one launch of a Triton kernel
(``prepass``: NVFP4 Q/K and MXFP4 V; ``fp8_prepass``: FP8 Q/K and MXFP4 V), bit-equal to ``fp4vis.formats``
(the PyTorch statement is ``prepass_torch.py``). The pieces:

* ``kernels/triton_formats.py``: the format math (E2M1, E4M3, BF16, MXFP4 and FP8 scales), shared with the
  Blackwell pre-pass, with the proofs of exactness;
* ``prepass_nvfp4.py``: the NVFP4 quantizers of a tile of rows, the folded-K64 MSE scale search;
* ``prepass_kernels.py``: the kernels (one program grid over Q rows, K rows and V blocks), the q/k transform
  folded in, the rstd launch;
* ``prepass_tuning.py``: rows, warps and register caps per program (measured on the H200);
* this module: argument checks, the launch geometry cached per input signature and the direct launch.

CPU tests run the kernels through Triton's interpreter; the GPU check counts differing values against
``fp4vis.formats`` (benchmarks/prepass_bench.py).
"""

from __future__ import annotations

import math

import torch
import triton

from ..scale_record import words as record_words
from .fp8_key_scales import fp8_key_scale_blocks
from .prepass_kernels import (
    channel_amax_kernel,
    compile_signature,
    fp8_prepass_kernel,
    fp8_values_kernel,
    prepass_kernel,
    rms_rstd_kernel,
)
from .prepass_tuning import (
    DEFAULT_LAUNCH,
    FP8_BLOCK_Q,
    FP8_MAX_REGISTERS,
    NUM_WARPS,
    NUM_WARPS_D64,
    NVFP4_LAUNCH,
    RMS_BLOCK_T,
    RMS_THREADS,
    V_AMAX_KEYS,
    V_VALUE_KEYS,
    PrepassLaunch,
    default_warps,
    nvfp4_launch,
)

# the launch configuration and the kernels' signature are part of this module's interface (the tests, the
# benchmarks, compile_check.py); FP8_BLOCK_Q and RMS_THREADS are read here, where the benchmarks set them
__all__ = ["DEFAULT_LAUNCH", "FP8_BLOCK_Q", "FP8_MAX_REGISTERS", "NUM_WARPS", "NUM_WARPS_D64", "NVFP4_LAUNCH",
           "RMS_BLOCK_T", "RMS_THREADS", "PrepassLaunch", "compile_signature", "default_warps", "fp8_meta_key",
           "fp8_prepass", "fp8_values", "fusable_transform", "mxfp4_v6", "nvfp4_launch", "nvfp4_qdq", "prepass",
           "rms_rstd", "row_align"]


# Host path. ``prepass`` and ``fp8_prepass`` keep, per input signature, the launch geometry (one
# allocation and a few views per call); ``_run`` launches. Triton's ``kernel[grid](...)`` binds and
# specialises every argument on each call (tens of microseconds); with the direct launch (``PrepassLaunch.direct``,
# the default; FP4VIS_PREPASS_DIRECT_LAUNCH=0 turns it off in the backend; checked on the H200 with Triton 3.6:
# benchmarks/prepass_bench.py compares the direct launches bit for bit and records LAUNCH_STATE,
# benchmarks/results/20261129d_h200_prepass.json) the compiled kernel is cached
# and ``CompiledKernel.run`` called directly, as ``JITFunction.run`` does (all arguments,
# constexprs last). Only when no Triton launch hooks are set when it is cached (a profiler attached
# later does not see these launches) and the inputs are 16-byte aligned (as the cached kernel was
# specialised); if the direct call ever raises it is turned off for the process (LAUNCH_STATE says
# why) and the ordinary launch is used.
FAST_LAUNCH = True   # False once a direct call raised (for the process)
LAUNCH_STATE = "not used yet"
NVFP4_LAUNCH_STATE: dict[tuple, list] = {}


def launch_hooks_clear() -> bool:
    """No Triton launch hook is set (None, or an empty ``knobs.HookChain``)."""
    rt = getattr(getattr(triton, "knobs", None), "runtime", None)
    if rt is None:
        from triton.compiler import CompiledKernel as rt
    hooks = (getattr(rt, "launch_enter_hook", None), getattr(rt, "launch_exit_hook", None))
    return all(h is None or (isinstance(getattr(h, "calls", None), list) and not h.calls) for h in hooks)


def _geometry(nq: int, sq: int, nk: int, sk: int, g_v: int, d: int, block_r: int) -> tuple[int, tuple]:
    """(grid, integer arguments) for nq Q rows (sequence sq), nk K rows and g_v V head groups
    (sequence sk)."""
    tq = -(-nq // block_r)
    tk = -(-nk // block_r)
    nvb = -(-sk // 32)
    return tq + tk + nvb * g_v, (nq, sq, nk, sk, tq, tk, nvb)


def _view_ints(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> tuple:
    """(H, then the batch, head and token strides of q, k and v): the kernels read (B, H, S, D) views
    with any such strides (the last one 1: ``_check_views``)."""
    return (q.shape[1],) + tuple(q.stride()[:3]) + tuple(k.stride()[:3]) + tuple(v.stride()[:3])


def row_align(*tensors: torch.Tensor) -> int:
    """The largest of 8, 4, 2, 1 elements that divides every stride but the last of every tensor: the
    kernels' ROW_ALIGN (``prepass_kernels._src_offsets``). 8 BF16 values are one 16-byte vector load; with the
    pointers' own 16-byte alignment (Triton specialises on it) every row then starts on a vector."""
    align = 8
    for t in tensors:
        for st in t.stride()[:-1]:
            while st % align:
                align //= 2
    return align


def _check_views(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
    for name, t in (("q", q), ("k", k), ("v", v)):
        if t.dim() != 4 or t.stride(-1) != 1:
            raise ValueError(f"{name}: the Triton pre-pass reads (B, H, S, D) views with unit stride along D; "
                             f"got shape {tuple(t.shape)}, strides {t.stride()}")


# ------------------------------------------------------------------------------------------------
# The layer's q/k transform (fp4vis.qk_transform.QKTransform) folded into the pre-pass: a first,
# small launch computes each token's rstd (``rms_rstd_kernel``, torch's reduction order); the
# pre-pass then reads the raw projections and normalises and rotates them in registers.

RMS_LAUNCH_STATE: dict[tuple, list] = {}


def fusable_transform(q: torch.Tensor, k: torch.Tensor, qk) -> str | None:
    """None where ``qk`` (a QKTransform) folds into the pre-pass for (B, H, S, D) views q, k of the raw
    projections, else why not (the caller then applies it in PyTorch first): BF16 projections whose
    tokens are contiguous rows of H*D values (torch's vectorized rms_norm, whose order the rstd
    launch reproduces), both norms with BF16 weights of H*D values, and a rotary table pair shaped
    (1, S, 1, D), contiguous, float32 or BF16, for q and k of one sequence."""
    h, d = q.shape[1], q.shape[-1]
    if qk.q_weight is None or qk.k_weight is None:
        return "a q/k transform without both RMS norms"
    for name, t in (("q", q), ("k", k)):
        if t.dtype != torch.bfloat16:
            return f"{name}: dtype {t.dtype} (the fused norm takes BF16)"
        if t.stride(1) != d or t.stride(-1) != 1 or (h * d) % 4 or t.data_ptr() % 8:
            return f"{name}: not rows of H*D contiguous, 8-byte aligned values per token"
    for w in (qk.q_weight, qk.k_weight):
        if w.dtype != torch.bfloat16 or w.numel() != h * d or not w.is_contiguous() or w.data_ptr() % 8:
            return "norm weights: not contiguous BF16 of H*D values"
    if qk.rope is not None:
        if q.shape[2] != k.shape[2]:
            return "a rotary embedding with different q and k sequences"
        for t in qk.rope:
            if (tuple(t.shape) != (1, q.shape[2], 1, d) or not t.is_contiguous()
                    or t.dtype not in (torch.float32, torch.bfloat16)):
                return f"rotary table {tuple(t.shape)} {t.dtype} (expected (1, S, 1, D), float32 or BF16)"
    return None


def rms_rstd(q: torch.Tensor, k: torch.Tensor, q_eps: float, k_eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-token rstd (float32, B * S each) of the raw q and k projections, (B, H, S, D) views of
    rows of H*D values, one launch, in the order of torch's CUDA rms_norm (``prepass_kernels._rms_rstd_rows``)."""
    b, h, sq, d = q.shape
    sk = k.shape[2]
    n = h * d
    key = (q.shape, k.shape, q.stride(), k.stride(), q_eps, k_eps, q.device)
    meta = RMS_LAUNCH_STATE.get(key)
    if meta is None:
        tq = -(-(b * sq) // RMS_BLOCK_T)
        grid = tq + -(-(b * sk) // RMS_BLOCK_T)
        tail = (b * sq, b * sk, tq, sq, sk, q.stride(0), q.stride(2), k.stride(0), k.stride(2), n, q_eps, k_eps,
                RMS_BLOCK_T, RMS_THREADS, -(-n // (4 * RMS_THREADS)), row_align(q, k))
        meta = RMS_LAUNCH_STATE[key] = [grid, tail, None]
    grid, tail, _ = meta
    out = torch.empty(b * (sq + sk), dtype=torch.float32, device=q.device)
    rq, rk = out[:b * sq], out[b * sq:]
    _run(rms_rstd_kernel, meta, grid, (q, k, rq, rk), tail, (q, k), (NUM_WARPS, None, True))
    return rq, rk


def _transform_args(q: torch.Tensor, k: torch.Tensor, qk) -> tuple[tuple, tuple]:
    """(the kernels' RQ, RK, WQ, WK, COS, SIN pointers; NORM, ROPE) for ``qk`` (None: no transform,
    placeholders)."""
    if qk is None:
        return (q,) * 6, (False, False)
    rq, rk = rms_rstd(q, k, qk.q_eps, qk.k_eps)
    cos, sin = qk.rope if qk.rope is not None else (q, q)
    return (rq, rk, qk.q_weight, qk.k_weight, cos, sin), (True, qk.rope is not None)


def _transform_key(qk) -> tuple:
    return () if qk is None else (qk.rope is not None, qk.rope[0].dtype if qk.rope is not None else None)


def launch_parts(inputs: tuple, outputs: tuple, layout: str, perm, f16_codes: bool, full_search: bool = False,
            record: tuple | None = None):
    """One ordinary Triton launch over the parts whose tensors are given ((q, k, v) ``inputs`` into (yq, yk, yv)
    ``outputs``; None: skipped), counting into ``record`` (``kernels/scale_record.py``)."""
    q, k, v = inputs
    ref = q if q is not None else (k if k is not None else v)
    d = ref.shape[-1]
    block_r, warps, cap = nvfp4_launch(d)
    sk = (k if k is not None else v).shape[-2] if (k is not None or v is not None) else 1
    grid, ints = _geometry(q.numel() // d if q is not None else 0, q.shape[-2] if q is not None else 1,
                           k.numel() // d if k is not None else 0, sk,
                           v.numel() // (d * sk) if v is not None else 0, d, block_r)
    if grid == 0:
        return
    qv, kv, vv = (ref if t is None else t for t in inputs)
    ptrs = tuple(ref if t is None else t for t in (*inputs, *outputs, perm)) + (ref,) * 6 + record_words(
        record, ref.device)
    prepass_kernel[(grid,)](*ptrs, *ints, *_view_ints(qv, kv, vv), d, layout == "folded64_mse",
                             perm is not None, block_r, min(d, 64), f16_codes, False, False, full_search,
                             row_align(qv, kv, vv), num_warps=warps, enable_fp_fusion=False,
                             **({"maxnreg": cap} if cap else {}))


def _run(kernel, meta: list, grid: int, ptrs: tuple, tail: tuple, inputs: tuple, launch: tuple):
    """One launch of ``kernel`` (all arguments: ``ptrs`` then ``tail``, constexprs last) for the
    input signature whose cached state is ``meta``; ``launch``: (warps, register cap, direct); ``meta[-1]`` keeps
    the compiled kernel for the direct launch (see above; ``inputs`` are the tensors whose alignment it assumes)."""
    global FAST_LAUNCH, LAUNCH_STATE
    num_warps, max_registers, direct = launch
    direct = direct and FAST_LAUNCH
    ck = meta[-1]
    if ck is not None and direct and _aligned(inputs):
        try:
            ck.run(grid, 1, 1, torch._C._cuda_getCurrentRawStream(inputs[0].device.index), ck.function,
                   ck.packed_metadata, None, None, None, *ptrs, *tail)
            return
        except Exception as exc:  # pragma: no cover - depends on the Triton version
            FAST_LAUNCH = False
            LAUNCH_STATE = f"direct launch off: {type(exc).__name__}: {exc}"
    caps = {} if max_registers is None else {"maxnreg": max_registers}
    ck = kernel[(grid,)](*ptrs, *tail, num_warps=num_warps, enable_fp_fusion=False, **caps)
    if meta[-1] is None and inputs[0].is_cuda and direct:
        if not hasattr(ck, "packed_metadata") or not hasattr(ck, "function"):
            LAUNCH_STATE = f"direct launch off: the launch returned {type(ck).__name__}"
        elif not launch_hooks_clear():
            LAUNCH_STATE = "direct launch off: Triton launch hooks are set"
        elif _aligned(inputs):
            meta[-1] = ck
            LAUNCH_STATE = "direct"


def _aligned(inputs: tuple) -> bool:
    """All input tensors start on 16 bytes (as a kernel specialised on the first call assumes)."""
    bits = 0
    for t in inputs:
        bits |= t.data_ptr()
    return (bits & 15) == 0


def prepass(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layout: str, perm: torch.Tensor | None = None,
            f16_codes: bool | None = None, qk=None, full_search: bool = False, record: tuple | None = None,
            launch: PrepassLaunch = DEFAULT_LAUNCH):
    """(q_hat, k_hat, v6) of (B, H, S, D) views q, k, v (unit stride along D, any other strides) in
    one launch; BF16, contiguous, views of one buffer. ``perm`` (int32, length Skv) gathers the rows
    of K and V (anchor permutation). ``f16_codes``: the E2M1 codes on FP16 pairs (inline PTX; None: where the
    tensors are on the GPU: Triton's interpreter takes the float32 form; the same bits either way). ``qk``: a
    ``fp4vis.qk_transform.QKTransform`` that ``fusable_transform`` accepts; q and k are then the raw projections,
    normed and rotated on the way in (one more, small launch for the rstd). ``full_search``: the folded-K64 scale
    search over every candidate, not only the contenders (the same bits: for measurement). ``record``: the range
    record's (fields, flag, call, score scale) that the blocks whose scale leaves its format are counted into
    (``kernels/scale_record.py``: ``recorded``; None: not counted). ``launch``: ``PrepassLaunch`` (rows, warps and
    register cap for measurement: None the tuned ones, whose cap applies also where rows or warps are given; the
    direct launch)."""
    _check_views(q, k, v)
    f16 = q.is_cuda if f16_codes is None else f16_codes
    key = (q.shape, k.shape, v.shape, q.stride(), k.stride(), v.stride(), q.dtype, k.dtype, v.dtype, layout,
           perm is not None, launch[:3], f16, full_search, q.device, _transform_key(qk))
    meta = NVFP4_LAUNCH_STATE.get(key)
    qk_ptrs, flags = _transform_args(q, k, qk)
    if meta is None:
        d = q.shape[-1]
        nq, nk = q.numel(), k.numel()
        same = q.shape == k.shape == v.shape
        rows, warps, cap = nvfp4_launch(d)
        br = launch.block_r or rows
        grid, ints = _geometry(nq // d, q.shape[-2], nk // d, k.shape[-2], v.numel() // (d * k.shape[-2]), d, br)
        consts = (d, layout == "folded64_mse", perm is not None, br, min(d, 64), f16) + flags + (full_search,
                                                                                            row_align(q, k, v))
        tail = ints + _view_ints(q, k, v) + consts
        shape = (launch.num_warps or warps, cap if launch.max_registers is None else (launch.max_registers or None))
        meta = [(3,) + tuple(q.shape) if same else (nq + nk + v.numel(),), same, grid, tail, shape, None]
        NVFP4_LAUNCH_STATE[key] = meta
    alloc, same, grid, tail, (warps, cap), _ = meta
    buf = torch.empty(alloc, dtype=torch.bfloat16, device=q.device)
    if same:
        yq, yk, yv = buf.unbind(0)
    else:
        nq, nk = q.numel(), k.numel()
        yq, yk, yv = buf[:nq].view(q.shape), buf[nq:nq + nk].view(k.shape), buf[nq + nk:].view(v.shape)
    ptrs = (q, k, v, yq, yk, yv, q if perm is None else perm) + qk_ptrs + record_words(record, q.device)
    _run(prepass_kernel, meta, grid, ptrs, tail, (q, k, v) + qk_ptrs, (warps, cap, launch.direct))
    return yq, yk, yv


_FP8_ALIGN = 128     # byte alignment of each operand inside the FP8 pre-pass's one buffer
FP8_LAUNCH_STATE: dict[tuple, list] = {}


def _contiguous_strides(shape: tuple) -> tuple:
    """Row-major strides (in elements) of ``shape``."""
    strides, step = [], 1
    for n in reversed(shape):
        strides.append(step)
        step *= n
    return tuple(reversed(strides))


def _fp8_plan(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, has_perm: bool, flags: tuple,
              launch: tuple) -> list:
    """What ``fp8_prepass`` keeps per input signature: [buffer bytes, the five outputs as (dtype,
    shape, strides, element offset) in the order returned, grid, kernel arguments after the
    pointers, ``launch`` (warps, register cap), compiled kernel (None)]. The outputs are 128-byte aligned
    slices of one uint8 buffer."""
    d, sk = q.shape[-1], k.shape[-2]
    g = k.numel() // (sk * d) if sk else 0
    nkb = fp8_key_scale_blocks(sk)
    shapes = ((torch.float8_e4m3fn, tuple(q.shape)), (torch.float8_e4m3fn, tuple(k.shape)),
              (torch.bfloat16, tuple(v.shape)), (torch.float32, tuple(q.shape[:-1])),
              (torch.float32, tuple(k.shape[:-2]) + (nkb,)))
    parts, nbytes = [], 0
    for dtype, shape in shapes:
        item = dtype.itemsize
        parts.append((dtype, shape, _contiguous_strides(shape), nbytes // item))
        nbytes += -(-math.prod(shape) * item // _FP8_ALIGN) * _FP8_ALIGN
    nq = q.numel() // d
    tq = -(-nq // FP8_BLOCK_Q)
    tail = (nq, q.shape[-2], tq, sk, nkb, -(-v.shape[-2] // 32)) + _view_ints(q, k, v) + (d, has_perm, FP8_BLOCK_Q,
                                                                                 min(d, 64)) + flags + (
        row_align(q, k, v),)
    return [nbytes, parts, tq + g * nkb, tail, launch, None]


def fp8_meta_key(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, perm: torch.Tensor | None = None, qk=None,
                 launch: PrepassLaunch = DEFAULT_LAUNCH) -> tuple:
    """The key under which ``fp8_prepass`` keeps its launch state (``FP8_LAUNCH_STATE``) for these arguments."""
    return (q.shape, k.shape, v.shape, q.stride(), k.stride(), v.stride(), q.dtype, k.dtype, v.dtype,
            perm is not None, launch.num_warps, launch.max_registers, q.device, _transform_key(qk))


def fp8_prepass(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, perm: torch.Tensor | None = None, qk=None,
                record: tuple | None = None, launch: PrepassLaunch = DEFAULT_LAUNCH):
    """(q8, k8, v6, q_scale, k_scale) of (B, H, S, D) views q, k, v (unit stride along D; v shaped like k, or with
    no keys where V takes its own pass; D a power of two) in one launch (see ``prepass.KernelOperands`` for what
    they are); views of one buffer. ``perm`` (int32, length Skv) gathers the rows of K and V (anchor
    permutation). ``qk``, ``record`` and ``launch`` as in ``prepass`` (warps and register cap: None
    ``default_warps``, ``FP8_MAX_REGISTERS``)."""
    _check_views(q, k, v)
    num_warps, max_registers = launch.num_warps, launch.max_registers
    key = fp8_meta_key(q, k, v, perm, qk, launch)
    qk_ptrs, flags = _transform_args(q, k, qk)
    meta = FP8_LAUNCH_STATE.get(key)
    if meta is None:
        d = q.shape[-1]
        cap = FP8_MAX_REGISTERS[128 if d >= 128 else 64] if max_registers is None else (max_registers or None)
        meta = FP8_LAUNCH_STATE[key] = _fp8_plan(q, k, v, perm is not None, flags, (num_warps or default_warps(d), cap))
    nbytes, parts, grid, tail, (warps, cap), _ = meta
    buf = torch.empty(nbytes, dtype=torch.uint8, device=q.device)
    typed = {dtype: buf.view(dtype) for dtype in (torch.float8_e4m3fn, torch.bfloat16, torch.float32)}
    outs = tuple(typed[dtype].as_strided(shape, strides, off) for dtype, shape, strides, off in parts)
    if grid:
        ptrs = (q, k, v) + outs + (q if perm is None else perm,) + qk_ptrs + record_words(record, q.device)
        _run(fp8_prepass_kernel, meta, grid, ptrs, tail, (q, k, v) + qk_ptrs, (warps, cap, launch.direct))
    return outs


def fp8_values(v: torch.Tensor, record: tuple | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """The V operand of the FP8 P/V kernel from a (B, H, S, D) view v (unit stride along D; D 64 or 128):
    (V^T E4M3 bytes (B, H, D, SP) with SP = S rounded up to 32, each 32-key block in ``pv_key_order``, zeros past
    S; its float32 scales 2^E (B, H, D), one per channel: ``fp4vis.formats.fp8_channel_quantize``). No host
    synchronisation: the channel maxima (zeroed words, ``channel_amax_kernel``), then the bytes and scales, and V's
    scale range (``fp4vis.formats.fp8_channel_scale_counts``) into ``record`` (as ``prepass``'s)."""
    b, h, s, d = v.shape
    sp = -(-s // 32) * 32
    vt = torch.empty((b, h, d, sp), dtype=torch.float8_e4m3fn, device=v.device)
    scales = torch.empty((b, h, d), dtype=torch.float32, device=v.device)
    if sp and b * h:
        amax = torch.zeros((b, h, d), dtype=torch.int32, device=v.device)
        args = (h, v.stride(0), v.stride(1), v.stride(2), d)
        channel_amax_kernel[(b * h, -(-s // V_AMAX_KEYS))](v, amax, s, *args, V_AMAX_KEYS, row_align(v),
                                                           num_warps=4)
        fp8_values_kernel[(b * h, -(-sp // V_VALUE_KEYS))](v, vt, amax, scales, *record_words(record, v.device), s, sp,
                                                           *args, min(d, 64), V_VALUE_KEYS, row_align(v), num_warps=4,
                                                           enable_fp_fusion=False)
    return vt, scales


def nvfp4_qdq(x: torch.Tensor, layout: str, perm: torch.Tensor | None = None,
              full_search: bool = False) -> torch.Tensor:
    """Decoded NVFP4 of contiguous (B, H, S, D) x, BF16, rows optionally gathered by ``perm`` (the pre-pass's Q/K
    quantizer alone, for the tests)."""
    y = torch.empty(x.shape, dtype=torch.bfloat16, device=x.device)
    if perm is None:
        launch_parts((x, None, None), (y, None, None), layout, None, x.is_cuda, full_search)
    else:
        launch_parts((None, x, None), (None, y, None), layout, perm, x.is_cuda, full_search)
    return y


def mxfp4_v6(v: torch.Tensor, perm: torch.Tensor | None = None, record: tuple | None = None) -> torch.Tensor:
    """``alpha * c`` of MXFP4 V (contiguous (B, H, S, D)), BF16, keys optionally permuted; ``record`` as in
    ``prepass``."""
    y = torch.empty(v.shape, dtype=torch.bfloat16, device=v.device)
    launch_parts((None, None, v), (None, None, y), "block16", perm, v.is_cuda, record=record)
    return y
