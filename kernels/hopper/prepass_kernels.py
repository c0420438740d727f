"""The Hopper pre-pass's Triton kernels (the host side: ``prepass_launch.py``).

``prepass_kernel``: ONE launch reads q, k and v once and writes the kernel's operands, the values of
``fp4vis.formats`` (``nvfp4_qdq`` / ``mxfp4_qdq``; the PyTorch statement is ``prepass.py``): NVFP4
quantize-dequantize of Q and K (``block16`` or ``folded64_mse`` with its MSE scale search:
``prepass_nvfp4.py``), MXFP4 ``alpha * c`` of V, the anchor permutation of K and V folded into the loads
(``perm[p]`` is the logical key at physical position p). One program grid covers the three tensors: programs
``[0, tq)`` quantize Q rows, ``[tq, tq + tk)`` K rows, the rest one 32-token V block each; the three outputs
live in one buffer. Inputs are (B, H, S, D) views with any strides (unit stride along D), read in place. With a
layer's q/k transform (``fp4vis.qk_transform.QKTransform``; NORM/ROPE) Q and K are the raw projections,
normalised with the per-token rstd of a first, small launch (``rms_rstd_kernel``: torch's CUDA rms_norm sum
order) and rotated in registers as they are loaded (``_qk_values``).

``fp8_prepass_kernel``: the FP8 Q/K operands (policy ``fast_fp8qk``; ``fp4vis.formats.fp8_pow2_quantize``),
also one launch: programs ``[0, tq)`` turn ``BLOCK_Q`` query rows each into E4M3 bytes and their power-of-two
scales, every other program one 32-key block of K (bytes and one scale, gathered by ``perm``) and the V block at
the same physical keys (MXFP4 as above). The group exponent is read off the float32 exponent field of the group
maximum, the scaling by 2^-E is exact, ``e4m3_round`` rounds in float32 and only then is the value converted to
``float8e4nv`` (exact whatever rounding the conversion uses).

The format math is ``kernels/triton_formats.py``'s. The kernels are compiled with ``enable_fp_fusion=False``
(no contraction of a product before its rounding); the exact FMAs are written explicitly. The CPU tests run
them through Triton's interpreter, and ``compile_signature`` lets them build for sm_90 without a GPU.
"""

from __future__ import annotations

import triton
import triton.language as tl

from ..scale_record import (
    K_OPERAND,
    Q_OPERAND,
    V_OPERAND,
    fp8_scale_counts,
    mxfp4_scale_counts,
    record_scale_range,
)
from ..triton_formats import (
    bf16_exact,
    bf16_round,
    e2m1_round,
    exact_f32,
    fp8_e4m3,
    fp8_group_exponent,
    interleaved,
    mxfp4_scale_exponent,
    nan_if_not_finite,
    pairs,
    pow2,
)
from .prepass_nvfp4 import nvfp4_block16, nvfp4_folded

# the range record's operand index of each part (kernels/scale_record.py)
Q_PART, K_PART, V_PART = tl.constexpr(Q_OPERAND), tl.constexpr(K_OPERAND), tl.constexpr(V_OPERAND)


@triton.jit
def _src_offsets(g, s, H, sb, sh, ss, ROW_ALIGN: tl.constexpr):
    """Element offsets of rows (head group g = b * H + h, token s) of a (B, H, S, D) view with strides
    (sb, sh, ss, 1), and their token index b * S + s is left to the caller: returns (offsets, b, h).
    ROW_ALIGN: a number of elements that divides every stride (``row_align``): the strides are runtime
    integers, so without this hint Triton cannot prove a row's start aligned and loads it value by value."""
    b = g // H
    h = g - b * H
    return tl.multiple_of(b.to(tl.int64) * sb + h.to(tl.int64) * sh + s.to(tl.int64) * ss, ROW_ALIGN), b, h


@triton.jit
def _normed(X, off, m, r, W, woff):
    """BF16 RMS-normed values, in float32, of the BF16 projection at X + off: ``w * (rstd * x)``
    rounded to BF16, as torch's CUDA rms_norm (float32 products in that order, one rounding)."""
    x = exact_f32(tl.load(X + off, mask=m, other=0.0))
    return bf16_round((x * r) * exact_f32(tl.load(W + woff)))


@triton.jit
def _qk_values(X, off, col, m, R, tok, W, woff, COS, SIN, foff, NORM: tl.constexpr, ROPE: tl.constexpr,
               TO_BF16: tl.constexpr):
    """float32 values of q or k at X + off + col (col: runs of contiguous columns along the last
    dimension, each starting at an even column): the input itself (rounded to BF16 first where
    TO_BF16, as the NVFP4 quantizer of fp4vis.formats takes it), or
    (NORM) RMS-normed with the token's rstd R[tok] and the weights W[woff + col], then (ROPE)
    rotated as ``fp4vis.qk_transform.apply_rotary_emb``: the pair of column c is c ^ 1, the even
    column of a pair takes ``x cos[c] - x' sin[c + 1]``, the odd one ``x' sin[c] + x cos[c - 1]``
    (float32 tables: float32 products and sum; BF16 tables: each product and the sum rounded to
    BF16, as torch's BF16 ops do), rounded to BF16 once at the end. Every tensor is loaded in
    contiguous rows (vector loads) and the pairs are split in registers (``pairs``): loading the
    partner column and the table entries by gathered indices costs a scalar load per value each."""
    if NORM:
        r = tl.load(R + tok, mask=m, other=0.0)
        x = _normed(X, off + col, m, r, W, woff + col)
        if ROPE:
            xe, xo = pairs(x)
            ce, _co = pairs(exact_f32(tl.load(COS + foff + col, mask=m, other=0.0)))
            _se, so = pairs(exact_f32(tl.load(SIN + foff + col, mask=m, other=0.0)))
            t1e = xe * ce     # even column: x cos[c] - x' sin[c + 1]
            t2e = xo * so
            t1o = xo * ce     # odd column: x cos[c - 1] + x' sin[c]
            t2o = xe * so
            if COS.dtype.element_ty == tl.bfloat16:
                t1e = bf16_round(t1e)
                t2e = bf16_round(t2e)
                t1o = bf16_round(t1o)
                t2o = bf16_round(t2o)
            x = interleaved(bf16_round(t1e - t2e), bf16_round(t1o + t2o))
    elif TO_BF16:
        x = bf16_round(tl.load(X + off + col, mask=m, other=0.0).to(tl.float32))
    else:
        x = exact_f32(tl.load(X + off + col, mask=m, other=0.0))
    return x


@triton.jit
def _nvfp4_rows(X, Y, PERM, use_perm, tile, N, S, H, sb, sh, ss, R, W, COS, SIN, D: tl.constexpr,
                FOLDED: tl.constexpr, HAS_PERM: tl.constexpr, BLOCK_R: tl.constexpr, CODES_F16: tl.constexpr,
                NORM: tl.constexpr, ROPE: tl.constexpr, FULL_SEARCH: tl.constexpr, ROW_ALIGN: tl.constexpr):
    """BLOCK_R rows of one NVFP4 operand: rows (g, s) of the (B, H, S, D) view X (strides sb, sh,
    ss, 1; N = B*H*S rows) -> decoded BF16 rows g * S + s in Y; rows gathered by PERM where HAS_PERM
    and the runtime flag use_perm (the K part) are set; values as ``_qk_values``. Returns the rows'
    scale-range counts (``scale_record.nvfp4_scale_counts``)."""
    rows = tile * BLOCK_R + tl.arange(0, BLOCK_R)          # global row = g * S + s (physical)
    rmask = rows < N
    rows = tl.where(rmask, rows, 0)
    g = rows // S
    s = rows - g * S
    if HAS_PERM:
        s = tl.where(use_perm, tl.load(PERM + s, mask=rmask & use_perm, other=0), s)
    src, b, h = _src_offsets(g, s, H, sb, sh, ss, ROW_ALIGN)
    tok = (b * S + s)[:, None, None]
    woff = (h * D)[:, None, None]
    foff = (s.to(tl.int64) * D)[:, None, None]
    src = src[:, None, None]
    dst = (rows.to(tl.int64) * D)[:, None, None]
    m3 = rmask[:, None, None]
    if FOLDED:
        NB2: tl.constexpr = D // 32
        col = tl.arange(0, NB2)[None, :, None] * 16 + tl.arange(0, 16)[None, None, :]   # (1, NB2, 16)
        lo = _qk_values(X, src, col, m3, R, tok, W, woff, COS, SIN, foff, NORM, ROPE, True)
        hi = _qk_values(X, src, col + D // 2, m3, R, tok, W, woff, COS, SIN, foff, NORM, ROPE, True)
        out_lo, out_hi, counts = nvfp4_folded(lo, hi, CODES_F16, FULL_SEARCH)
        tl.store(Y + dst + col, out_lo.to(tl.bfloat16), mask=m3)
        tl.store(Y + dst + col + D // 2, out_hi.to(tl.bfloat16), mask=m3)
    else:
        NB: tl.constexpr = D // 16
        col = tl.arange(0, NB)[None, :, None] * 16 + tl.arange(0, 16)[None, None, :]
        x = _qk_values(X, src, col, m3, R, tok, W, woff, COS, SIN, foff, NORM, ROPE, True)
        y, counts = nvfp4_block16(x, CODES_F16)
        tl.store(Y + dst + col, y.to(tl.bfloat16), mask=m3)
    return counts


@triton.jit
def _key_block_rows(PERM, blk, g, S, HAS_PERM: tl.constexpr):
    """(valid, s, dst) of the 32 physical keys of block blk in head group g: the logical keys read
    (``perm[p]``, the logical key at physical position p, where HAS_PERM) and the int64 rows
    written (g * S + p). Shared by the K and V blocks, which must agree on the physical order."""
    p = blk * 32 + tl.arange(0, 32)
    valid = p < S
    if HAS_PERM:
        src_s = tl.load(PERM + p, mask=valid, other=0)
    else:
        src_s = p
    return valid, src_s, (g * S + p).to(tl.int64)


@triton.jit
def _mxfp4_block(V, Y, PERM, blk, g, S, H, sb, sh, ss, D: tl.constexpr, HAS_PERM: tl.constexpr,
                 BLOCK_D: tl.constexpr, ROW_ALIGN: tl.constexpr):
    """One 32-token block of V (head group g; a (B, H, S, D) view with strides sb, sh, ss, 1) ->
    alpha * c in BF16; returns the block's scale-range counts (``scale_record.mxfp4_scale_counts``)."""
    valid, s, dst = _key_block_rows(PERM, blk, g, S, HAS_PERM)
    src, _b, _h = _src_offsets(g, s, H, sb, sh, ss, ROW_ALIGN)
    dst = dst * D
    under = 0
    over = 0
    flushed = 0.0
    top = 0.0
    for d0 in tl.static_range(0, D, BLOCK_D):
        dcol = d0 + tl.arange(0, BLOCK_D)
        v = exact_f32(tl.load(V + src[:, None] + dcol[None, :], mask=valid[:, None], other=0.0))
        amax = tl.max(tl.abs(v), axis=0)                                  # (BLOCK_D,)
        n_under, n_over, n_flushed, n_top = mxfp4_scale_counts(amax)
        under += n_under
        over += n_over
        flushed = tl.maximum(flushed, n_flushed)
        top = tl.maximum(top, n_top)
        u = mxfp4_scale_exponent(amax)
        # 6 v is exact in float32 for BF16/FP16 v; scaling by a power of two is exact
        codes = e2m1_round((6.0 * v) * pow2(127 - u)[None, :])
        out = nan_if_not_finite(codes * pow2(u - 127)[None, :], tl.abs(v))
        tl.store(Y + dst[:, None] + dcol[None, :], bf16_exact(out), mask=valid[:, None])
    return under, over, flushed, top


@triton.jit
def pv_key_order(k):
    """The physical key stored at position k (0..31) of a 32-key block of the FP8 P/V kernel's V^T: the column of
    the score accumulator that the FP8 WGMMA's A fragment holds in slot k (``config.PV_FP8_KEY_ORDER``), so that P
    goes from the accumulator to the A fragment without moving between registers or threads."""
    return 16 * (k // 16) + 8 * ((k % 4) // 2) + 2 * ((k % 16) // 4) + (k % 2)


@triton.jit(do_not_specialize=["S", "H", "sb", "sh", "ss"])
def channel_amax_kernel(V, AMAX, S, H, sb, sh, ss, D: tl.constexpr, KEYS: tl.constexpr, ROW_ALIGN: tl.constexpr):
    """The channel maxima of V's magnitudes over the keys (head group g = program 0, KEYS keys from program 1 on; a
    (B, H, S, D) view with strides sb, sh, ss, 1) into AMAX (G, D) int32, zeroed first: the float32 bits of |v|,
    which order as the values do (NaN above Inf: a NaN channel's maximum is NaN, as a float maximum gives it)."""
    g = tl.program_id(0)
    s = tl.program_id(1) * KEYS + tl.arange(0, KEYS)
    valid = s < S
    src, _b, _h = _src_offsets(g, tl.where(valid, s, 0), H, sb, sh, ss, ROW_ALIGN)
    dcol = tl.arange(0, D)
    v = exact_f32(tl.load(V + src[:, None] + dcol[None, :], mask=valid[:, None], other=0.0))
    top = tl.max(tl.abs(v).to(tl.int32, bitcast=True), axis=0)
    tl.atomic_max(AMAX + g * D + dcol, top, sem="relaxed")


@triton.jit(do_not_specialize=["S", "SP", "H", "sb", "sh", "ss", "REC", "FLAG", "CALL", "LIMIT"])
def fp8_values_kernel(V, VT, AMAX, VS, REC, FLAG, CALL, LIMIT, S, SP, H, sb, sh, ss, D: tl.constexpr,
                      BLOCK_D: tl.constexpr, KEYS: tl.constexpr, ROW_ALIGN: tl.constexpr):
    """KEYS keys of V (whole 32-key blocks; head group g = program 0, the keys program 1: B * H is unbounded,
    S / KEYS below 65536; a (B, H, S, D) view with strides sb, sh, ss, 1) as E4M3 of v / 2^E into V^T (G, D, SP)
    bytes with each 32-key block's keys in ``pv_key_order`` (KEYS bytes in a row per channel), E per channel from
    its maximum magnitude over the keys (AMAX, (G, D), float32 bits: ``channel_amax_kernel``;
    ``fp8_group_exponent``), and 2^E into VS (float32 (G, D), written by program 0); keys >= S are written as 0 up to
    SP = S rounded up to 32 (the kernel's TMA reads whole blocks). Program 0 of each head group adds the group's
    ``fp8_channel_scale_counts`` to the range record (REC, FLAG, CALL, LIMIT: ``scale_record.record_scale_range``,
    operand v) where CALL > 0."""
    g = tl.program_id(0)
    blk = tl.program_id(1)
    k = tl.arange(0, KEYS)
    pos = blk * KEYS + k
    s = blk * KEYS + 32 * (k // 32) + pv_key_order(k % 32)
    valid = s < S
    src, _b, _h = _src_offsets(g, tl.where(valid, s, 0), H, sb, sh, ss, ROW_ALIGN)
    dst = g.to(tl.int64) * D * SP + pos
    under, flushed, amax = 0, 0.0, 0.0   # program 0's: its head group's channels
    for d0 in tl.static_range(0, D, BLOCK_D):
        dcol = d0 + tl.arange(0, BLOCK_D)
        v = exact_f32(tl.load(V + src[:, None] + dcol[None, :], mask=valid[:, None], other=0.0))
        top = tl.load(AMAX + g * D + dcol).to(tl.float32, bitcast=True)
        e = fp8_group_exponent(top)
        tl.store(VT + dst[:, None] + dcol[None, :].to(tl.int64) * SP, fp8_e4m3(v, e[None, :]),
                 mask=(pos < SP)[:, None])
        if blk == 0:
            tl.store(VS + g * D + dcol, pow2(e))
            # channels as groups of one value each: flushed is a channel's maximum (formats.fp8_channel_scale_counts)
            n, _, f, a = fp8_scale_counts(top, 1)
            under, flushed, amax = under + n, tl.maximum(flushed, f), tl.maximum(amax, a)
    if blk == 0:
        record_scale_range(REC, FLAG, CALL, LIMIT, V_PART, under, 0, flushed, amax)


# runtime integers of both pre-pass kernels (not specialised: one compile serves every shape)
_RUNTIME_INTS = ["NQ", "SQ", "NK", "SK", "TQ", "TK", "NVB", "NKB", "H", "QSB", "QSH", "QSS", "KSB", "KSH", "KSS",
                 "VSB", "VSH", "VSS"]


@triton.jit(do_not_specialize=["REC", "FLAG", "CALL", "LIMIT"] + [n for n in _RUNTIME_INTS if n != "NKB"])
def prepass_kernel(Q, K, V, YQ, YK, YV, PERM, RQ, RK, WQ, WK, COS, SIN, REC, FLAG, CALL, LIMIT, NQ, SQ, NK, SK, TQ, TK,
                    NVB, H, QSB, QSH, QSS, KSB, KSH, KSS, VSB, VSH, VSS,
                    D: tl.constexpr, FOLDED: tl.constexpr, HAS_PERM: tl.constexpr, BLOCK_R: tl.constexpr,
                    BLOCK_D: tl.constexpr, CODES_F16: tl.constexpr, NORM: tl.constexpr, ROPE: tl.constexpr,
                    FULL_SEARCH: tl.constexpr, ROW_ALIGN: tl.constexpr):
    """Programs [0, TQ): Q row tiles; [TQ, TQ + TK): K row tiles (rows gathered by PERM);
    the rest: V blocks (NVB 32-token blocks per head group, gathered by PERM). Q, K, V: (B, H, S, D)
    views with the given strides; with NORM/ROPE, Q and K are the raw projections and ``_qk_values``
    normalises (rstd RQ/RK, weights WQ/WK) and rotates (COS, SIN) them on the way in. Each program adds
    its scale-range counts to the range record (REC, FLAG) where CALL > 0, its underflows with the q/k flush
    limit LIMIT to the call's words, on which the call's attention kernel decides (``kernels/scale_record.py``)."""
    pid = tl.program_id(0)
    if pid < TQ + TK:
        # Q and K share one copy of the (large) quantizer code: pick the part's pointers and sizes
        if pid < TQ:
            X, Y, tile, N, S, use_perm, R, W, sb, sh, ss = Q, YQ, pid, NQ, SQ, False, RQ, WQ, QSB, QSH, QSS
        else:
            X, Y, tile, N, S, use_perm, R, W, sb, sh, ss = K, YK, pid - TQ, NK, SK, True, RK, WK, KSB, KSH, KSS
        under, over, flushed, amax = _nvfp4_rows(X, Y, PERM, use_perm, tile, N, S, H, sb, sh, ss, R, W, COS, SIN, D,
                                                 FOLDED, HAS_PERM, BLOCK_R, CODES_F16, NORM, ROPE, FULL_SEARCH,
                                                 ROW_ALIGN)
        record_scale_range(REC, FLAG, CALL, LIMIT, tl.where(pid < TQ, Q_PART, K_PART), under, over, flushed, amax)
    else:
        vid = pid - TQ - TK
        g = vid // NVB
        under, over, flushed, amax = _mxfp4_block(V, YV, PERM, vid - g * NVB, g, SK, H, VSB, VSH, VSS, D, HAS_PERM,
                                                  BLOCK_D, ROW_ALIGN)
        record_scale_range(REC, FLAG, CALL, LIMIT, V_PART, under, over, flushed, amax)


@triton.jit
def _fp8_query_rows(Q, Q8, QS, tile, NQ, S, H, sb, sh, ss, R, W, COS, SIN, D: tl.constexpr,
                    BLOCK_Q: tl.constexpr, NORM: tl.constexpr, ROPE: tl.constexpr, ROW_ALIGN: tl.constexpr):
    """BLOCK_Q rows of Q (NQ rows (g, s) of a (B, H, S, D) view in all), one scale per row: E4M3 in
    Q8, 2^E in QS; values as ``_qk_values``. Returns the rows' scale-range counts
    (``scale_record.fp8_scale_counts``)."""
    rows = tile * BLOCK_Q + tl.arange(0, BLOCK_Q)
    rmask = rows < NQ
    rows = tl.where(rmask, rows, 0)
    g = rows // S
    s = rows - g * S
    src, b, h = _src_offsets(g, s, H, sb, sh, ss, ROW_ALIGN)
    col = tl.arange(0, D)[None, :]
    x = _qk_values(Q, src[:, None], col, rmask[:, None], R, (b * S + s)[:, None], W, (h * D)[:, None], COS, SIN,
                   (s.to(tl.int64) * D)[:, None], NORM, ROPE, False)
    amax = tl.max(tl.abs(x), axis=1)
    e = fp8_group_exponent(amax)
    tl.store(Q8 + rows.to(tl.int64)[:, None] * D + col, fp8_e4m3(x, e[:, None]), mask=rmask[:, None])
    tl.store(QS + rows, pow2(e), mask=rmask)
    return fp8_scale_counts(amax, D)


@triton.jit
def _fp8_key_block(K, K8, KS, PERM, blk, g, S, NKB, H, sb, sh, ss, R, W, COS, SIN, D: tl.constexpr,
                   HAS_PERM: tl.constexpr, NORM: tl.constexpr, ROPE: tl.constexpr, ROW_ALIGN: tl.constexpr):
    """Physical 32-key block blk of head group g, one scale for the block (its valid keys only):
    E4M3 in K8, 2^E in KS (NKB entries per head group; blocks past the sequence, which pad the
    scales to whole kernel tiles, get 1.0); values as ``_qk_values``. Returns its scale-range counts
    (``scale_record.fp8_scale_counts``)."""
    valid, s, dst = _key_block_rows(PERM, blk, g, S, HAS_PERM)
    src, b, h = _src_offsets(g, s, H, sb, sh, ss, ROW_ALIGN)
    col = tl.arange(0, D)[None, :]
    x = _qk_values(K, src[:, None], col, valid[:, None], R, (b * S + s)[:, None], W, (h * D)[:, None], COS, SIN,
                   (s.to(tl.int64) * D)[:, None], NORM, ROPE, False)
    amax = tl.max(tl.max(tl.abs(x), axis=1), axis=0)
    e = fp8_group_exponent(amax)
    tl.store(K8 + dst[:, None] * D + col, fp8_e4m3(x, e), mask=valid[:, None])
    tl.store(KS + g * NKB + blk, tl.where(blk * 32 < S, pow2(e), 1.0))
    return fp8_scale_counts(tl.zeros((1,), tl.float32) + amax, D)


@triton.jit(do_not_specialize=["REC", "FLAG", "CALL", "LIMIT"] + [n for n in _RUNTIME_INTS if n not in ("NK", "TK")])
def fp8_prepass_kernel(Q, K, V, Q8, K8, V6, QS, KS, PERM, RQ, RK, WQ, WK, COS, SIN, REC, FLAG, CALL, LIMIT, NQ, SQ, TQ,
                        SK, NKB, NVB, H,
                        QSB, QSH, QSS, KSB, KSH, KSS, VSB, VSH, VSS,
                        D: tl.constexpr, HAS_PERM: tl.constexpr, BLOCK_Q: tl.constexpr, BLOCK_D: tl.constexpr,
                        NORM: tl.constexpr, ROPE: tl.constexpr, ROW_ALIGN: tl.constexpr):
    """Programs [0, TQ): Q row tiles; the rest one (head group, 32-key block) each, NKB blocks per
    group (scales padded to whole kernel tiles): the K block and, for the NVB blocks that hold keys,
    the V block at the same physical keys (both gathered by PERM). Views, NORM/ROPE and the range
    record (REC, FLAG, CALL, LIMIT) as ``prepass_kernel``."""
    pid = tl.program_id(0)
    if pid < TQ:
        under, over, flushed, amax = _fp8_query_rows(Q, Q8, QS, pid, NQ, SQ, H, QSB, QSH, QSS, RQ, WQ, COS, SIN, D,
                                                     BLOCK_Q, NORM, ROPE, ROW_ALIGN)
        record_scale_range(REC, FLAG, CALL, LIMIT, Q_PART, under, over, flushed, amax)
    else:
        kid = pid - TQ
        g = kid // NKB
        blk = kid - g * NKB
        under, over, flushed, amax = _fp8_key_block(K, K8, KS, PERM, blk, g, SK, NKB, H, KSB, KSH, KSS, RK, WK, COS,
                                                    SIN, D, HAS_PERM, NORM, ROPE, ROW_ALIGN)
        record_scale_range(REC, FLAG, CALL, LIMIT, K_PART, under, over, flushed, amax)
        if blk < NVB:
            under, over, flushed, amax = _mxfp4_block(V, V6, PERM, blk, g, SK, H, VSB, VSH, VSS, D, HAS_PERM, BLOCK_D,
                                                      ROW_ALIGN)
            record_scale_range(REC, FLAG, CALL, LIMIT, V_PART, under, over, flushed, amax)


@triton.jit
def _rms_rstd_rows(X, R, tile, NT, S, sb, ss, N, eps, BLOCK_T: tl.constexpr, THREADS: tl.constexpr,
                   NCHUNK: tl.constexpr, ROW_ALIGN: tl.constexpr):
    """rstd of BLOCK_T tokens (b * S + s < NT) of a (B, S, N) projection (strides sb, ss, 1) in the
    order of torch's vectorized CUDA rms_norm (a block of THREADS threads, 32-lane warps, one row):
    thread t sums x^2 over its 4-value vectors t, t + THREADS, ... in turn, value by value, then a
    shuffle-down tree over the 32 lanes (lane i + lane i + 16, then + 8, ...) and one over the warps
    (warp i + warp i + W/2, ...); the sum over N (a correctly rounded division), + eps, rsqrt. Every
    addition of two partial sums is one float32 rounding, so the same tree gives the same bits; x^2
    of a BF16/FP16 value is exact; padding adds exact zeros."""
    tok = tile * BLOCK_T + tl.arange(0, BLOCK_T)
    tmask = tok < NT
    tok = tl.where(tmask, tok, 0)
    b = tok // S
    base = tl.multiple_of(b.to(tl.int64) * sb + (tok - b * S).to(tl.int64) * ss, ROW_ALIGN)[:, None]
    acc = tl.zeros((BLOCK_T, THREADS), tl.float32)
    for j in tl.static_range(NCHUNK):
        col = j * THREADS * 4 + tl.arange(0, THREADS * 4)
        x = exact_f32(tl.load(X + base + col[None, :], mask=tmask[:, None] & (col < N)[None, :], other=0.0))
        even, odd = tl.split(tl.reshape(x, (BLOCK_T, THREADS, 2, 2)))   # vector values 0, 2 / 1, 3
        x0, x2 = tl.split(even)
        x1, x3 = tl.split(odd)
        acc = acc + x0 * x0
        acc = acc + x1 * x1
        acc = acc + x2 * x2
        acc = acc + x3 * x3
    WARPS: tl.constexpr = THREADS // 32
    lanes = tl.reshape(acc, (BLOCK_T, WARPS, 32))
    lanes = tl.sum(tl.reshape(lanes, (BLOCK_T, WARPS, 2, 16)), axis=2)
    lanes = tl.sum(tl.reshape(lanes, (BLOCK_T, WARPS, 2, 8)), axis=2)
    lanes = tl.sum(tl.reshape(lanes, (BLOCK_T, WARPS, 2, 4)), axis=2)
    lanes = tl.sum(tl.reshape(lanes, (BLOCK_T, WARPS, 2, 2)), axis=2)
    warps = tl.sum(lanes, axis=2)                                       # (BLOCK_T, WARPS)
    if WARPS >= 8:
        warps = tl.sum(tl.reshape(warps, (BLOCK_T, 2, WARPS // 2)), axis=1)
    if WARPS >= 4:
        warps = tl.sum(tl.reshape(warps, (BLOCK_T, 2, 2)), axis=1)
    total = tl.sum(warps, axis=1)
    rstd = tl.math.rsqrt(tl.math.div_rn(total, N.to(tl.float32)) + eps)
    tl.store(R + tok, rstd, mask=tmask)


@triton.jit(do_not_specialize=["NQT", "NKT", "TQ", "SQ", "SK", "QSB", "QSS", "KSB", "KSS"])
def rms_rstd_kernel(XQ, XK, RQ, RK, NQT, NKT, TQ, SQ, SK, QSB, QSS, KSB, KSS, N, eps_q, eps_k,
                     BLOCK_T: tl.constexpr, THREADS: tl.constexpr, NCHUNK: tl.constexpr, ROW_ALIGN: tl.constexpr):
    """Programs [0, TQ): rstd of q's tokens; the rest k's (``_rms_rstd_rows``)."""
    pid = tl.program_id(0)
    if pid < TQ:
        _rms_rstd_rows(XQ, RQ, pid, NQT, SQ, QSB, QSS, N, eps_q, BLOCK_T, THREADS, NCHUNK, ROW_ALIGN)
    else:
        _rms_rstd_rows(XK, RK, pid - TQ, NKT, SK, KSB, KSS, N, eps_k, BLOCK_T, THREADS, NCHUNK, ROW_ALIGN)


def compile_signature(fp8: bool, dtype: str = "bf16", rope_dtype: str = "fp32") -> dict:
    """The pointer and integer types of ``prepass_kernel`` (``fp8``: ``fp8_prepass_kernel``) for
    ``dtype`` inputs, as ``compile_check.compile_triton_sm90`` takes them (the GPU build without a GPU)."""
    outs = (("Q8", "*fp8e4nv"), ("K8", "*fp8e4nv"), ("V6", "*bf16"), ("QS", "*fp32"), ("KS", "*fp32")) if fp8 else \
        (("YQ", "*bf16"), ("YK", "*bf16"), ("YV", "*bf16"))
    sig = dict.fromkeys(("Q", "K", "V"), f"*{dtype}") | dict(outs) | {"PERM": "*i32", "RQ": "*fp32", "RK": "*fp32",
                                                                       "WQ": f"*{dtype}", "WK": f"*{dtype}",
                                                                       "COS": f"*{rope_dtype}", "SIN": f"*{rope_dtype}",
                                                                       "REC": "*i32", "FLAG": "i64", "CALL": "i32",
                                                                       "LIMIT": "fp32"}
    ints = ("NQ", "SQ", "TQ", "SK", "NKB", "NVB") if fp8 else ("NQ", "SQ", "NK", "SK", "TQ", "TK", "NVB")
    return sig | dict.fromkeys(ints + tuple(n for n in _RUNTIME_INTS if n.startswith(("H", "QS", "KS", "VS"))), "i32")
