"""Fused GPU pre-pass (Triton): ONE launch reads q, k, v once and writes the kernel's operands.

Same numbers as ``fp4vis.formats`` (``nvfp4_qdq`` / ``mxfp4_qdq``; the PyTorch statement is
``prepass.py``): NVFP4 quantize-dequantize of Q and K (``block16`` or ``folded64_mse``
with its 12-candidate MSE scale search), MXFP4 ``alpha * c`` of V, the anchor permutation of K and
V folded into the loads (``perm[p]`` is the logical key at physical position p). One program grid
covers the three tensors: programs ``[0, tq)`` quantize Q rows, ``[tq, tq + tk)`` K rows, the rest
one 32-token V block each; the three outputs live in one buffer.

FP8 Q/K operands (``fp8_prepass``, policy ``fast_fp8qk``; ``fp4vis.formats.fp8_pow2_quantize``): a
second kernel, also one launch: programs ``[0, tq)`` turn ``FP8_BLOCK_Q`` query rows each into E4M3
bytes and their power-of-two scales, every other program one 32-key block of K (bytes and one scale,
gathered by ``perm``) and the V block at the same physical keys (MXFP4 as above). The group
exponent is read off the float32 exponent field of the group maximum, the scaling by 2^-E is exact,
``_e4m3`` rounds in float32 and only then is the value converted to ``float8e4nv`` (exact whatever
rounding the conversion uses).

Exact arithmetic, cheaper than the literal formulation (the proofs are in the comments below and in
docs/hopper_kernel.md; CPU tests run this through Triton's interpreter, the GPU check counts
differing values against ``fp4vis.formats``):

* E2M1 code of ``x / sc`` without a division: ``t = |x| * rcp(sc)``, snapped to a multiple of
  2^-12, then rounded to the E2M1 grid (ties to even). ``x`` is BF16 (8 significant bits) and
  ``b * sc`` (b an E2M1 midpoint, sc an E4M3 value) has at most 7, so ``x / sc`` is either exactly
  a midpoint b or at least ``b * 2^-9`` away from it; ``t`` is within 2^-22 relative of ``x / sc``,
  so the snap puts exact ties exactly on b and leaves everything else on its side. On the GPU the
  conversion of t to FP16 is the snap (an FP16 ulp at b is at most b * 2^-10) and the E2M1 grid
  rounding runs on FP16 pairs (``_e2m1_mag_f16``; ``f16_codes_default``).
* Folded-K64 MSE search: ``err = sum (c*sc - x)^2 = sum x^2 + sum_{c != 0} P (P - 2|x|)`` with
  ``P = c * sc``. The first sum is common to all candidates and dropped. Each term of the second
  is an integer multiple of ``U = 2^(2E - 12)`` (E = floor(log2 sc)) below 2^22 U in magnitude
  whenever no candidate scale saturates E4M3 (``base * 1.25 <= 448``), so it is computed exactly by
  one FMA into the mantissa of 1.5 * 2^23 and summed as int32: the comparison of candidates is
  exact (ties keep the earlier candidate). The reference (``fp4vis.formats._folded_mse_choice``)
  sums the same ``P (P - 2|x|)`` in float64, which is exact too except in "huge" groups
  (amax >= 48 * the largest candidate scale), where it takes the first candidate with the largest
  scale (the error decreases strictly with the scale there). A tile with a saturating group runs
  the reference's formulation instead: float64 sums (exact in any order) and the huge-group rule, so
  it splits exact ties as the reference does (slower). The second ``m = 1.0`` candidate repeats the
  first's scale exactly and can never win: it is skipped in both branches.

The kernels are compiled with ``enable_fp_fusion=False`` (no contraction of ``base * m`` before
its E4M3 rounding, nor of the snap); the exact FMAs are written explicitly.
"""

from __future__ import annotations

import functools
import math
import os

import torch
import triton
import triton.language as tl

from fp4vis.config import cached_setting
from fp4vis.formats import FOLDED_MSE_MULTIPLIERS, FP8_GROUP_TOP_EXP, FP8_MIN_GROUP_EXP

from .layout import fp8_key_scale_blocks

# _mult_rt below computes these as k / 16 for candidates 1..11; keep the two in step.
assert FOLDED_MSE_MULTIPLIERS == (1.0, 0.25, 0.3125, 0.375, 0.4375, 0.5, 0.625, 0.75, 0.875, 1.0, 1.125, 1.25)

_MAGIC = tl.constexpr(12582912.0)       # 1.5 * 2^23: float32 values in [2^23, 2^24) have ulp 1
_MAGIC_BITS = tl.constexpr(0x4B400000)  # its bit pattern
_FP8_TOP_EXP = tl.constexpr(FP8_GROUP_TOP_EXP)
_FP8_MIN_EXP = tl.constexpr(FP8_MIN_GROUP_EXP)
_E4M3_NAN = tl.constexpr(0x7F)


@triton.jit
def _round_pow2_grid(mag, min_exp_plus: tl.constexpr, floor_bits: tl.constexpr):
    """RNE of mag >= 0 to a grid whose ulp is 2^(exp(mag) - mantissa) with a subnormal floor:
    add C = max(2^(e + 23 - mantissa), floor) and subtract it again (both exact)."""
    bits = mag.to(tl.int32, bitcast=True)
    c = (bits & 0x7F800000) + min_exp_plus
    c = tl.maximum(c, floor_bits)
    cf = c.to(tl.float32, bitcast=True)
    return (mag + cf) - cf


@triton.jit
def _f32(x):
    """BF16 or FP16 x in float32, exactly. BF16 by moving its bits up 16 places, which is what the
    GPU's conversion does; Triton's interpreter flushes BF16 subnormals to 0 instead."""
    if x.dtype == tl.bfloat16:
        return (x.to(tl.uint16, bitcast=True).to(tl.uint32) << 16).to(tl.float32, bitcast=True)
    else:
        return x.to(tl.float32)


@triton.jit
def _bf16_exact(x):
    """float32 x that is a BF16 value (NaN included) -> BF16 by dropping its low 16 bits, exactly as
    the GPU's rounding conversion would give it; Triton's interpreter flushes BF16 subnormals."""
    return (x.to(tl.uint32, bitcast=True) >> 16).to(tl.uint16).to(tl.bfloat16, bitcast=True)


@triton.jit
def _bf16_round(x):
    """float32 -> nearest BF16 value (ties to even), kept in float32; exact integer arithmetic."""
    bits = x.to(tl.int32, bitcast=True)
    bits = (bits + 0x7FFF + ((bits >> 16) & 1)) & -65536
    return bits.to(tl.float32, bitcast=True)


@triton.jit
def _e2m1_mag(t):
    """E2M1 RNE magnitude with saturation of t >= 0."""
    r = _round_pow2_grid(t, 22 << 23, 149 << 23)  # 1 mantissa bit, min normal exp 0
    return tl.minimum(r, 6.0)


@triton.jit
def _with_sign_of(mag, x):
    """copysign(mag, x) for mag >= 0 on the bits: a negative x whose magnitude rounds to 0 gives -0,
    as torch.copysign in fp4vis.formats does."""
    sign = x.to(tl.int32, bitcast=True) & -2147483648
    return (mag.to(tl.int32, bitcast=True) | sign).to(tl.float32, bitcast=True)


@triton.jit
def _e2m1(x):
    """E2M1 RNE with saturation, sign copied (fp4vis.formats.e2m1_round, -0 included)."""
    return _with_sign_of(_e2m1_mag(tl.abs(x)), x)


@triton.jit
def _code(ax, r, CODES_F16: tl.constexpr):
    """E2M1 magnitude of ax / sc given r = rcp(sc) (r = 0 for sc = 0): exact, see the module doc.
    CODES_F16: ``_e2m1_mag_f16`` on pairs (the snap is the conversion to FP16). Otherwise (t + 2048) - 2048
    rounds t < 2048 to a multiple of 2^-12 (larger t saturate anyway), then ``_e2m1_mag``."""
    t = ax * r
    if CODES_F16:
        return _e2m1_mag_f16(t)
    t = (t + 2048.0) - 2048.0
    return _e2m1_mag(t)


@triton.jit
def _e2m1_mag_f16(t):
    """``_e2m1_mag`` of the snapped t for float32 t = ax * rcp(sc) >= 0 (unsnapped: the conversion to
    FP16 snaps it), two values at a time on FP16x2:
    convert to FP16 (round to nearest), min 6, and the grid trick with C = max(2^(e + 9), 2^9) (FP16
    has 10 mantissa bits), back to float32: 9 instructions per pair where the float32 form takes 16.
    Exact: t is within 2^-22 relative of ax / sc, which is either an E2M1 midpoint b (3 significant
    bits: an FP16 value, and t lies well inside its half-ulp, so the conversion lands on b exactly)
    or at least b 2^-9 away from every midpoint (the module doc), more than an FP16 ulp at b (b
    2^-10 at most), so the conversion cannot reach b. Below 2^-14 (FP16 subnormals) everything
    rounds to 0 either way; t >= 65520 converts to +inf and the min gives 6; NaN gives 6, as
    ``_e2m1_mag`` does (min returns the non-NaN operand). ``fp4vis.formats`` states the same
    rounding; ``tests/kernels/hopper/test_hopper_prepass.py`` checks this arithmetic exhaustively on the CPU (every BF16
    magnitude against every E4M3 scale) and the GPU bit check the PTX."""
    return tl.inline_asm_elementwise(
        asm="""{
        .reg .b32 p, c, f;
        .reg .b16 l, h;
        cvt.rn.f16x2.f32 p, $3, $2;
        mov.b32 f, 0x46004600;
        min.f16x2 p, p, f;
        and.b32 c, p, 0x7C007C00;
        add.u32 c, c, 0x24002400;
        mov.b32 f, 0x60006000;
        max.f16x2 c, c, f;
        add.rn.f16x2 p, p, c;
        sub.rn.f16x2 p, p, c;
        mov.b32 {l, h}, p;
        cvt.f32.f16 $0, l;
        cvt.f32.f16 $1, h;
        }""",
        constraints="=f,=f,f,f", args=[t], dtype=tl.float32, is_pure=True, pack=2)


@triton.jit
def _e4m3(mag):
    """E4M3 RNE with saturation of mag >= 0 (values of fp4vis.formats.e4m3_round)."""
    r = _round_pow2_grid(mag, 20 << 23, (127 - 6 + 20) << 23)  # 3 mantissa bits, min exp -6
    return tl.minimum(r, 448.0)


@triton.jit
def _rcp(sc):
    """Correctly rounded 1 / sc, 0 for sc == 0."""
    return tl.where(sc == 0.0, 0.0, tl.math.div_rn(1.0, tl.where(sc == 0.0, 1.0, sc)))


@triton.jit
def _signed(mag, x, sc):
    """mag with the sign of x (copysign, so -0 for a negative x whose code is 0), +0 where sc == 0
    (as fp4vis.formats: a zero scale gives +0 codes)."""
    sign = x.to(tl.int32, bitcast=True) & -2147483648
    sign = tl.where(sc > 0.0, sign, 0)
    return (mag.to(tl.int32, bitcast=True) | sign).to(tl.float32, bitcast=True)


@triton.jit
def _mult_rt(i):
    """FOLDED_MSE_MULTIPLIERS[i] for a runtime i in 1..11: k / 16 with k = 4, 5, 6, 7, 8, 10, ..., 20
    (exact, so base * m rounds as with the constant)."""
    k = tl.where(i <= 5, i + 3, 2 * i - 2)
    return k.to(tl.float32) * 0.0625


@triton.jit
def _cand_err(alo, ahi, alo2, ahi2, sc, CODES_F16: tl.constexpr):
    """sum over the 32 values of P (P - 2|x|), P = c * sc, exactly, as float64 (see module doc;
    valid when sc is the unsaturated E4M3 rounding of base * m)."""
    r = _rcp(sc)
    e = tl.maximum(((sc.to(tl.int32, bitcast=True) >> 23) & 0xFF) - 127, -9)   # floor(log2 sc)
    inv_u = ((127 + 12 - 2 * e) << 23).to(tl.float32, bitcast=True)           # 2^(12 - 2E)
    u = ((127 - 12 + 2 * e) << 23).to(tl.float32, bitcast=True)               # 2^(2E - 12)
    scu = sc * inv_u                                                          # exact
    sc3 = sc[:, :, None]
    scu3 = scu[:, :, None]
    r3 = r[:, :, None]
    c_lo = _code(alo, r3, CODES_F16)
    c_hi = _code(ahi, r3, CODES_F16)
    f_lo = tl.fma(c_lo * scu3, tl.fma(c_lo, sc3, -alo2), _MAGIC)    # MAGIC + P (P - 2|x|) / U
    f_hi = tl.fma(c_hi * scu3, tl.fma(c_hi, sc3, -ahi2), _MAGIC)
    n = (f_lo.to(tl.int32, bitcast=True) - _MAGIC_BITS) + (f_hi.to(tl.int32, bitcast=True) - _MAGIC_BITS)
    tot = tl.sum(n, axis=2)                                                   # |tot| < 2^27
    return tot.to(tl.float64) * u.to(tl.float64)


@triton.jit
def _cand_err64(alo, ahi, alo2, ahi2, sc, CODES_F16: tl.constexpr):
    """sum over the 32 values of P (P - 2|x|), P = c * sc, in float64 as fp4vis.formats computes it
    (alo2, ahi2: 2|x| in float64): exact, in any summation order, unless the group is huge."""
    sc3 = sc[:, :, None]
    r3 = _rcp(sc)[:, :, None]
    p_lo = (_code(alo, r3, CODES_F16) * sc3).to(tl.float64)       # exact: at most 6 significant bits
    p_hi = (_code(ahi, r3, CODES_F16) * sc3).to(tl.float64)
    return tl.sum(p_lo * (p_lo - alo2), axis=2) + tl.sum(p_hi * (p_hi - ahi2), axis=2)


@triton.jit
def _best_scale(alo, ahi, alo2, ahi2, base, WIDE: tl.constexpr, CODES_F16: tl.constexpr):
    """The first folded-K64 candidate scale with the least error (a later one wins only when
    strictly better), errors from ``_cand_err`` (exact integer units) or, WIDE, ``_cand_err64``
    (float64). A loop, not unrolled (keeps the code small); candidate 9, the second m = 1.0, gives
    the first's scale and can never be strictly better: skipped."""
    best_sc = _e4m3(base * 1.0)
    if WIDE:
        best_err = _cand_err64(alo, ahi, alo2, ahi2, best_sc, CODES_F16)
    else:
        best_err = _cand_err(alo, ahi, alo2, ahi2, best_sc, CODES_F16)
    for i in range(1, 12):
        if i != 9:
            sc = _e4m3(base * _mult_rt(i))
            if WIDE:
                err = _cand_err64(alo, ahi, alo2, ahi2, sc, CODES_F16)
            else:
                err = _cand_err(alo, ahi, alo2, ahi2, sc, CODES_F16)
            better = err < best_err
            best_err = tl.where(better, err, best_err)
            best_sc = tl.where(better, sc, best_sc)
    return best_sc


@triton.jit
def _nan_if_not_finite(out, mag):
    """NaN where the input magnitude is NaN or Inf: the attention kernel then propagates it to
    the output (as SDPA does) instead of quantizing it to a finite code."""
    return tl.where(mag < float("inf"), out, float("nan"))


@triton.jit
def _nvfp4_rows(X, Y, PERM, use_perm, tile, N, S, D: tl.constexpr, FOLDED: tl.constexpr,
                HAS_PERM: tl.constexpr, BLOCK_R: tl.constexpr, CODES_F16: tl.constexpr):
    """BLOCK_R rows of one NVFP4 operand: X (N = G*S rows of D) -> decoded BF16 rows in Y; rows
    gathered by PERM where HAS_PERM and the runtime flag use_perm (the K part) are set."""
    rows = tile * BLOCK_R + tl.arange(0, BLOCK_R)          # global row = g * S + s (physical)
    rmask = rows < N
    rows = tl.where(rmask, rows, 0)
    if HAS_PERM:
        g = rows // S
        s = rows - g * S
        src_rows = tl.where(use_perm, g * S + tl.load(PERM + s, mask=rmask & use_perm, other=0), rows)
    else:
        src_rows = rows
    src = src_rows.to(tl.int64) * D
    dst = rows.to(tl.int64) * D
    m3 = rmask[:, None, None]
    if FOLDED:
        NB2: tl.constexpr = D // 32
        j = tl.arange(0, NB2)
        t = tl.arange(0, 16)
        col = j[None, :, None] * 16 + t[None, None, :]    # (1, NB2, 16)
        lo = _bf16_round(tl.load(X + src[:, None, None] + col, mask=m3, other=0.0).to(tl.float32))
        hi = _bf16_round(tl.load(X + src[:, None, None] + col + D // 2, mask=m3, other=0.0).to(tl.float32))
        alo = tl.abs(lo)
        ahi = tl.abs(hi)
        amax = tl.maximum(tl.max(alo, axis=2), tl.max(ahi, axis=2))   # (R, NB2)
        base = tl.math.div_rn(amax, 6.0)
        # exact integer path unless a candidate scale saturates E4M3 somewhere in the tile
        if tl.max((base * 1.25 > 448.0).to(tl.int32)) == 0:
            best_sc = _best_scale(alo, ahi, alo + alo, ahi + ahi, base, False, CODES_F16)
        else:
            # a candidate saturates E4M3: the float64 sums of fp4vis.formats (exact unless the group
            # is huge), then the huge groups' rule
            ax64 = alo.to(tl.float64)
            ahx64 = ahi.to(tl.float64)
            best_sc = _best_scale(alo, ahi, ax64 + ax64, ahx64 + ahx64, base, True, CODES_F16)
            # huge group (amax >= 48 * the largest candidate, E4M3(base * 1.25): the rounding is
            # monotonic): the error decreases strictly with the scale, the largest scale wins
            sc_max = _e4m3(base * 1.25)
            best_sc = tl.where(amax >= 48.0 * sc_max, sc_max, best_sc)
        sc3 = best_sc[:, :, None]
        r3 = _rcp(best_sc)[:, :, None]
        out_lo = _nan_if_not_finite(_signed(_code(alo, r3, CODES_F16) * sc3, lo, sc3), alo)
        out_hi = _nan_if_not_finite(_signed(_code(ahi, r3, CODES_F16) * sc3, hi, sc3), ahi)
        tl.store(Y + dst[:, None, None] + col, out_lo.to(tl.bfloat16), mask=m3)
        tl.store(Y + dst[:, None, None] + col + D // 2, out_hi.to(tl.bfloat16), mask=m3)
    else:
        NB: tl.constexpr = D // 16
        j = tl.arange(0, NB)
        t = tl.arange(0, 16)
        col = j[None, :, None] * 16 + t[None, None, :]
        x = _bf16_round(tl.load(X + src[:, None, None] + col, mask=m3, other=0.0).to(tl.float32))
        ax = tl.abs(x)
        sc = _e4m3(tl.math.div_rn(tl.max(ax, axis=2), 6.0))
        sc3 = sc[:, :, None]
        out = _nan_if_not_finite(_signed(_code(ax, _rcp(sc)[:, :, None], CODES_F16) * sc3, x, sc3), ax)
        tl.store(Y + dst[:, None, None] + col, out.to(tl.bfloat16), mask=m3)


@triton.jit
def _pow2(e):
    """Exact float32 2^e for integer e in [-127, 127]."""
    normal = ((tl.maximum(e, -126) + 127) << 23).to(tl.float32, bitcast=True)
    return tl.where(e < -126, 5.877471754111438e-39, normal)   # 2^-127


@triton.jit
def _key_block_rows(PERM, blk, g, S, HAS_PERM: tl.constexpr):
    """(valid, src, dst) of the 32 physical keys of block blk in head group g: the int64 rows read
    (``perm[p]``, the logical key at physical position p, where HAS_PERM) and written (p). Shared
    by the K and V blocks, which must agree on the physical order."""
    p = blk * 32 + tl.arange(0, 32)
    valid = p < S
    if HAS_PERM:
        src_s = tl.load(PERM + p, mask=valid, other=0)
    else:
        src_s = p
    return valid, (g * S + src_s).to(tl.int64), (g * S + p).to(tl.int64)


@triton.jit
def _mxfp4_block(V, Y, PERM, blk, g, S, D: tl.constexpr, HAS_PERM: tl.constexpr, BLOCK_D: tl.constexpr):
    """One 32-token block of V (head group g) -> alpha * c in BF16."""
    valid, src, dst = _key_block_rows(PERM, blk, g, S, HAS_PERM)
    src = src * D
    dst = dst * D
    for d0 in tl.static_range(0, D, BLOCK_D):
        dcol = d0 + tl.arange(0, BLOCK_D)
        v = _f32(tl.load(V + src[:, None] + dcol[None, :], mask=valid[:, None], other=0.0))
        amax = tl.max(tl.abs(v), axis=0)                                  # (BLOCK_D,)
        bits = amax.to(tl.int32, bitcast=True)
        e = ((bits >> 23) & 0xFF) - 127                                   # floor(log2 amax), normals
        mid = 1.5 * _pow2(e)
        up = (amax > mid) | ((amax == mid) & ((e & 1) != 0))
        u = tl.minimum(tl.maximum(e + up.to(tl.int32) + 127, 0), 254)
        u = tl.where(amax <= 1e-38, 0, u)
        # 6 v is exact in float32 for BF16/FP16 v; scaling by a power of two is exact
        codes = _e2m1((6.0 * v) * _pow2(127 - u)[None, :])
        out = _nan_if_not_finite(codes * _pow2(u - 127)[None, :], tl.abs(v))
        tl.store(Y + dst[:, None] + dcol[None, :], _bf16_exact(out), mask=valid[:, None])


@triton.jit(do_not_specialize=["NQ", "SQ", "NK", "SK", "TQ", "TK", "NVB"])
def _prepass_kernel(Q, K, V, YQ, YK, YV, PERM, NQ, SQ, NK, SK, TQ, TK, NVB,
                    D: tl.constexpr, FOLDED: tl.constexpr, HAS_PERM: tl.constexpr, BLOCK_R: tl.constexpr,
                    BLOCK_D: tl.constexpr, CODES_F16: tl.constexpr):
    """Programs [0, TQ): Q row tiles; [TQ, TQ + TK): K row tiles (rows gathered by PERM);
    the rest: V blocks (NVB 32-token blocks per head group, gathered by PERM)."""
    pid = tl.program_id(0)
    if pid < TQ + TK:
        # Q and K share one copy of the (large) quantizer code: pick the part's pointers and sizes
        if pid < TQ:
            X, Y, tile, N, S, use_perm = Q, YQ, pid, NQ, SQ, False
        else:
            X, Y, tile, N, S, use_perm = K, YK, pid - TQ, NK, SK, True
        _nvfp4_rows(X, Y, PERM, use_perm, tile, N, S, D, FOLDED, HAS_PERM, BLOCK_R, CODES_F16)
    else:
        vid = pid - TQ - TK
        g = vid // NVB
        _mxfp4_block(V, YV, PERM, vid - g * NVB, g, SK, D, HAS_PERM, BLOCK_D)


@triton.jit
def _fp8_group_exponent(amax):
    """fp4vis.formats.fp8_group_exponent: E = max(floor(log2 amax) - 7, -126) off the float32
    exponent field (amax >= 0), so that the group maximum scales into [2^7, 2^8)."""
    field = (amax.to(tl.int32, bitcast=True) >> 23) & 0xFF
    return tl.maximum(field - 127 - _FP8_TOP_EXP, _FP8_MIN_EXP)


@triton.jit
def _fp8_e4m3(x, e):
    """E4M3 (float8e4nv) of x * 2^-e. The scaling by a power of two is exact (whatever it pushes
    below float32's normal range is far below E4M3's smallest subnormal, 2^-9, and rounds to a
    signed 0 either way) and ``_e4m3`` rounds in float32 (|x| 2^-e < 2^8: no saturation), so the
    conversion of an exact E4M3 value is exact whatever rounding it uses. NaN (0x7F) where x is
    NaN or Inf, set on the byte: the GPU's conversion gives it too, Triton's interpreter does not."""
    ax = tl.abs(x)
    byte = _with_sign_of(_e4m3(ax * _pow2(-e)), x).to(tl.float8e4nv).to(tl.uint8, bitcast=True)
    nan = tl.full(byte.shape, _E4M3_NAN, tl.uint8)
    return tl.where(ax < float("inf"), byte, nan).to(tl.float8e4nv, bitcast=True)


@triton.jit
def _fp8_query_rows(Q, Q8, QS, tile, NQ, D: tl.constexpr, BLOCK_Q: tl.constexpr):
    """BLOCK_Q rows of Q (NQ rows of D in all), one scale per row: E4M3 in Q8, 2^E in QS."""
    rows = tile * BLOCK_Q + tl.arange(0, BLOCK_Q)
    rmask = rows < NQ
    off = rows.to(tl.int64)[:, None] * D + tl.arange(0, D)[None, :]
    x = _f32(tl.load(Q + off, mask=rmask[:, None], other=0.0))
    e = _fp8_group_exponent(tl.max(tl.abs(x), axis=1))
    tl.store(Q8 + off, _fp8_e4m3(x, e[:, None]), mask=rmask[:, None])
    tl.store(QS + rows, _pow2(e), mask=rmask)


@triton.jit
def _fp8_key_block(K, K8, KS, PERM, blk, g, S, NKB, D: tl.constexpr, HAS_PERM: tl.constexpr):
    """Physical 32-key block blk of head group g, one scale for the block (its valid keys only):
    E4M3 in K8, 2^E in KS (NKB entries per head group; blocks past the sequence, which pad the
    scales to whole kernel tiles, get 1.0)."""
    valid, src, dst = _key_block_rows(PERM, blk, g, S, HAS_PERM)
    col = tl.arange(0, D)[None, :]
    x = _f32(tl.load(K + src[:, None] * D + col, mask=valid[:, None], other=0.0))
    e = _fp8_group_exponent(tl.max(tl.max(tl.abs(x), axis=1), axis=0))
    tl.store(K8 + dst[:, None] * D + col, _fp8_e4m3(x, e), mask=valid[:, None])
    tl.store(KS + g * NKB + blk, tl.where(blk * 32 < S, _pow2(e), 1.0))


@triton.jit(do_not_specialize=["NQ", "TQ", "SK", "NKB", "NVB"])
def _fp8_prepass_kernel(Q, K, V, Q8, K8, V6, QS, KS, PERM, NQ, TQ, SK, NKB, NVB,
                        D: tl.constexpr, HAS_PERM: tl.constexpr, BLOCK_Q: tl.constexpr, BLOCK_D: tl.constexpr):
    """Programs [0, TQ): Q row tiles; the rest one (head group, 32-key block) each, NKB blocks per
    group (scales padded to whole kernel tiles): the K block and, for the NVB blocks that hold keys,
    the V block at the same physical keys (both gathered by PERM)."""
    pid = tl.program_id(0)
    if pid < TQ:
        _fp8_query_rows(Q, Q8, QS, pid, NQ, D, BLOCK_Q)
    else:
        kid = pid - TQ
        g = kid // NKB
        blk = kid - g * NKB
        _fp8_key_block(K, K8, KS, PERM, blk, g, SK, NKB, D, HAS_PERM)
        if blk < NVB:
            _mxfp4_block(V, V6, PERM, blk, g, SK, D, HAS_PERM, BLOCK_D)


BLOCK_R = 16
# Warps per program: 4 at D = 128; 2 at D = 64, where 4 would spread each 16-value group over 4
# threads (two shuffle levels per candidate sum) and each 32-key FP8/MXFP4 block over twice the
# threads it fills: measured on the H200 (benchmarks/results/20261129f_h200_prepass_d64-tune.json)
# 15-19 % faster NVFP4 and 7-10 % faster FP8 pre-passes at ViT shapes (B64 S197 H12, B8 S577 H16).
NUM_WARPS = 4
NUM_WARPS_D64 = 2


def default_warps(d: int) -> int:
    """Warps per program of both pre-passes for head dimension d."""
    return NUM_WARPS if d >= 128 else NUM_WARPS_D64


# E2M1 codes of the NVFP4 search on FP16 pairs (``_e2m1_mag_f16``, inline PTX); Triton's interpreter
# (the CPU tests) cannot run inline assembly and takes the float32 form, which gives the same bits.
# FP4VIS_PREPASS_F16_CODES=0 selects the float32 form on the GPU too (for side-by-side timing).
def f16_codes_default() -> bool:
    """The E2M1 code form used where a call does not name one."""
    return cached_setting("FP4VIS_PREPASS_F16_CODES") and not _interpreting()


@functools.cache
def _interpreting() -> bool:
    """Triton's CPU interpreter (TRITON_INTERPRET=1) is on: it cannot run inline assembly."""
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


# Host path. ``prepass`` and ``fp8_prepass`` keep, per input signature, the launch geometry (one
# allocation and a few views per call); ``_run`` launches. Triton's ``kernel[grid](...)`` binds and
# specialises every argument on each call (tens of microseconds); with the direct launch (default;
# FP4VIS_PREPASS_DIRECT_LAUNCH=0 turns it off; checked on the H200 with Triton 3.6:
# benchmarks/prepass_bench.py compares the direct launches bit for bit and records LAUNCH_STATE,
# benchmarks/results/20261129d_h200_prepass.json) the compiled kernel is cached
# and ``CompiledKernel.run`` called directly, as ``JITFunction.run`` does (all arguments,
# constexprs last). Only when no Triton launch hooks are set when it is cached (a profiler attached
# later does not see these launches) and the inputs are 16-byte aligned (as the cached kernel was
# specialised); if the direct call ever raises it is turned off for the process (LAUNCH_STATE says
# why) and the ordinary launch is used.
FAST_LAUNCH: bool | None = None   # None: as FP4VIS_PREPASS_DIRECT_LAUNCH says; False once a direct call raised
LAUNCH_STATE = "not used yet"
_META: dict[tuple, list] = {}


def direct_launch_on() -> bool:
    """Whether launches go straight to the compiled kernel (see above)."""
    return cached_setting("FP4VIS_PREPASS_DIRECT_LAUNCH") if FAST_LAUNCH is None else FAST_LAUNCH


def _hooks_clear() -> bool:
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


def _launch(q, k, v, yq, yk, yv, layout: str, perm, block_r: int | None = None, num_warps: int | None = None,
            f16_codes: bool | None = None):
    """One ordinary Triton launch over the parts whose tensors are given (None: skipped); returns
    the compiled kernel (or None)."""
    ref = q if q is not None else (k if k is not None else v)
    d = ref.shape[-1]
    block_r = block_r or BLOCK_R
    sk = (k if k is not None else v).shape[-2] if (k is not None or v is not None) else 1
    grid, ints = _geometry(q.numel() // d if q is not None else 0, q.shape[-2] if q is not None else 1,
                           k.numel() // d if k is not None else 0, sk,
                           v.numel() // (d * sk) if v is not None else 0, d, block_r)
    if grid == 0:
        return None
    ptrs = tuple(ref if t is None else t for t in (q, k, v, yq, yk, yv, perm))
    f16 = f16_codes_default() if f16_codes is None else f16_codes
    return _prepass_kernel[(grid,)](*ptrs, *ints, d, layout == "folded64_mse", perm is not None, block_r,
                                    min(d, 64), f16, num_warps=num_warps or default_warps(d), enable_fp_fusion=False)


def _run(kernel, meta: list, grid: int, ptrs: tuple, tail: tuple, inputs: tuple, num_warps: int):
    """One launch of ``kernel`` (all arguments: ``ptrs`` then ``tail``, constexprs last) for the
    input signature whose cached state is ``meta``; ``meta[-1]`` keeps the compiled kernel for the
    direct launch (``direct_launch_on``, see above; ``inputs`` are the tensors whose alignment it assumes)."""
    global FAST_LAUNCH, LAUNCH_STATE
    ck = meta[-1]
    if ck is not None and direct_launch_on() and _aligned(inputs):
        try:
            ck.run(grid, 1, 1, torch._C._cuda_getCurrentRawStream(inputs[0].device.index), ck.function,
                   ck.packed_metadata, None, None, None, *ptrs, *tail)
            return
        except Exception as exc:  # pragma: no cover - depends on the Triton version
            FAST_LAUNCH = False
            LAUNCH_STATE = f"direct launch off: {type(exc).__name__}: {exc}"
    ck = kernel[(grid,)](*ptrs, *tail, num_warps=num_warps, enable_fp_fusion=False)
    if meta[-1] is None and inputs[0].is_cuda and direct_launch_on():
        if not hasattr(ck, "packed_metadata") or not hasattr(ck, "function"):
            LAUNCH_STATE = f"direct launch off: the launch returned {type(ck).__name__}"
        elif not _hooks_clear():
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
            block_r: int | None = None, num_warps: int | None = None, f16_codes: bool | None = None):
    """(q_hat, k_hat, v6) of contiguous (B, H, S, D) q, k, v in one launch; BF16, contiguous, views of
    one buffer. ``perm`` (int32, length Skv) gathers the rows of K and V (anchor permutation).
    ``f16_codes``: the E2M1 code form (None: ``f16_codes_default()``; the same bits either way)."""
    f16 = f16_codes_default() if f16_codes is None else f16_codes
    key = (q.shape, k.shape, v.shape, q.dtype, k.dtype, v.dtype, layout, perm is not None, block_r, num_warps,
           f16, q.device)
    meta = _META.get(key)
    if meta is None:
        d = q.shape[-1]
        nq, nk = q.numel(), k.numel()
        same = q.shape == k.shape == v.shape
        br = block_r or BLOCK_R
        grid, ints = _geometry(nq // d, q.shape[-2], nk // d, k.shape[-2], v.numel() // (d * k.shape[-2]), d, br)
        tail = ints + (d, layout == "folded64_mse", perm is not None, br, min(d, 64), f16)
        meta = [(3,) + tuple(q.shape) if same else (nq + 2 * nk,), same, grid, tail, None]
        _META[key] = meta
    alloc, same, grid, tail, _ = meta
    buf = torch.empty(alloc, dtype=torch.bfloat16, device=q.device)
    if same:
        yq, yk, yv = buf.unbind(0)
    else:
        nq, nk = q.numel(), k.numel()
        yq, yk, yv = buf[:nq].view(q.shape), buf[nq:nq + nk].view(k.shape), buf[nq + nk:].view(v.shape)
    ptrs = (q, k, v, yq, yk, yv, q if perm is None else perm)
    _run(_prepass_kernel, meta, grid, ptrs, tail, (q, k, v), num_warps or default_warps(q.shape[-1]))
    return yq, yk, yv


FP8_BLOCK_Q = 32     # query rows per program of the FP8 pre-pass (as many values as a 32-key block)
_FP8_ALIGN = 128     # byte alignment of each operand inside the FP8 pre-pass's one buffer
_FP8_META: dict[tuple, list] = {}


def _contiguous_strides(shape: tuple) -> tuple:
    """Row-major strides (in elements) of ``shape``."""
    strides, step = [], 1
    for n in reversed(shape):
        strides.append(step)
        step *= n
    return tuple(reversed(strides))


def _fp8_plan(q: torch.Tensor, k: torch.Tensor, has_perm: bool) -> list:
    """What ``fp8_prepass`` keeps per input signature: [buffer bytes, the five outputs as (dtype,
    shape, strides, element offset) in the order returned, grid, kernel arguments after the
    pointers, compiled kernel (None)]. The outputs are 128-byte aligned slices of one uint8 buffer."""
    d, sk = q.shape[-1], k.shape[-2]
    g = k.numel() // (sk * d) if sk else 0
    nkb = fp8_key_scale_blocks(sk)
    shapes = ((torch.float8_e4m3fn, tuple(q.shape)), (torch.float8_e4m3fn, tuple(k.shape)),
              (torch.bfloat16, tuple(k.shape)), (torch.float32, tuple(q.shape[:-1])),
              (torch.float32, tuple(k.shape[:-2]) + (nkb,)))
    parts, nbytes = [], 0
    for dtype, shape in shapes:
        item = dtype.itemsize
        parts.append((dtype, shape, _contiguous_strides(shape), nbytes // item))
        nbytes += -(-math.prod(shape) * item // _FP8_ALIGN) * _FP8_ALIGN
    nq = q.numel() // d
    tq = -(-nq // FP8_BLOCK_Q)
    tail = (nq, tq, sk, nkb, -(-sk // 32), d, has_perm, FP8_BLOCK_Q, min(d, 64))
    return [nbytes, parts, tq + g * nkb, tail, None]


def fp8_prepass(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, perm: torch.Tensor | None = None,
                num_warps: int | None = None):
    """(q8, k8, v6, q_scale, k_scale) of contiguous (B, H, S, D) q, k, v (v shaped like k, D a power
    of two) in one launch (see ``prepass.prepare_fp8_operands`` for what they are); views of
    one buffer. ``perm`` (int32, length Skv) gathers the rows of K and V (anchor permutation)."""
    key = (q.shape, k.shape, v.shape, q.dtype, k.dtype, v.dtype, perm is not None, num_warps, q.device)
    meta = _FP8_META.get(key)
    if meta is None:
        meta = _FP8_META[key] = _fp8_plan(q, k, perm is not None)
    nbytes, parts, grid, tail, _ = meta
    buf = torch.empty(nbytes, dtype=torch.uint8, device=q.device)
    typed = {dtype: buf.view(dtype) for dtype in (torch.float8_e4m3fn, torch.bfloat16, torch.float32)}
    outs = tuple(typed[dtype].as_strided(shape, strides, off) for dtype, shape, strides, off in parts)
    if grid:
        ptrs = (q, k, v) + outs + (q if perm is None else perm,)
        _run(_fp8_prepass_kernel, meta, grid, ptrs, tail, (q, k, v), num_warps or default_warps(q.shape[-1]))
    return outs


def nvfp4_qdq(x: torch.Tensor, layout: str, perm: torch.Tensor | None = None) -> torch.Tensor:
    """Decoded NVFP4 of contiguous (B, H, S, D) x, BF16, rows optionally gathered by ``perm``."""
    y = torch.empty(x.shape, dtype=torch.bfloat16, device=x.device)
    if perm is None:
        _launch(x, None, None, y, None, None, layout, None)
    else:
        _launch(None, x, None, None, y, None, layout, perm)
    return y


def mxfp4_v6(v: torch.Tensor, perm: torch.Tensor | None = None) -> torch.Tensor:
    """``alpha * c`` of MXFP4 V (contiguous (B, H, S, D)), BF16, keys optionally permuted."""
    y = torch.empty(v.shape, dtype=torch.bfloat16, device=v.device)
    _launch(None, None, v, None, None, y, "block16", perm)
    return y
