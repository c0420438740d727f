"""Fused GPU pre-pass (Triton): ONE launch reads q, k, v once and writes the kernel's operands.

Same numbers as ``fp4vis.formats`` (``nvfp4_qdq`` / ``mxfp4_qdq``; the PyTorch statement is
``prepass.py``): NVFP4 quantize-dequantize of Q and K (``block16`` or ``folded64_mse``
with its 12-candidate MSE scale search), MXFP4 ``alpha * c`` of V, the anchor permutation of K and
V folded into the loads (``perm[p]`` is the logical key at physical position p). One program grid
covers the three tensors: programs ``[0, tq)`` quantize Q rows, ``[tq, tq + tk)`` K rows, the rest
one 32-token V block each; the three outputs live in one buffer. Inputs are (B, H, S, D) views with any
strides (unit stride along D), read in place. With a layer's q/k transform
(``fp4vis.qk_transform.QKTransform``; NORM/ROPE) Q and K are the raw projections, normalised with
the per-token rstd of a first, small launch (``_rms_rstd_kernel``: torch's CUDA rms_norm sum order)
and rotated in registers as they are loaded (``_qk_values``).

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
  ``P = c * sc``. The first sum is common to all candidates and dropped. Only the contenders
  (``fp4vis.formats.FOLDED_MSE_CONTENDERS``: m = 1.0, 0.75, 0.875, 1.125, 1.25, and 0.625 in a tile where
  its scale is an E4M3 subnormal somewhere) are evaluated (``_contender_scale``): in a group that saturates
  no candidate every other candidate is never strictly better than one of them, or only as good and later
  (proved exhaustively over every BF16 group maximum and value, tests/core/test_formats.py). Their error is
  ``sc * sum c (c sc - 2|x|)``: each term an integer multiple of 2^(floor(log2 sc) - 9), 32 of them below
  2^22 of those units, so the float32 sum is exact in any order, and the product with sc in float64
  (``_contender_err``); ties keep the earlier candidate. ``FULL_SEARCH`` (for measurement, the same choice)
  evaluates every candidate instead, each term ``P (P - 2|x|)`` an integer multiple of
  ``U = 2^(2E - 12)`` (E = floor(log2 sc)) below 2^22 U in magnitude whenever no candidate scale
  saturates E4M3 (``base * 1.25 <= 448``), computed exactly by one FMA into the mantissa of 1.5 * 2^23
  and summed as int32 (``_cand_err``). The reference (``fp4vis.formats._folded_mse_choice``)
  sums the same ``P (P - 2|x|)`` in float64, which is exact too except in "huge" groups
  (amax >= 48 * the largest candidate scale), where it takes the first candidate with the largest
  scale (the error decreases strictly with the scale there). A tile with a saturating group runs
  the reference's formulation instead, over every candidate: float64 sums (exact in any order) and the
  huge-group rule, so it splits exact ties as the reference does (slower). The second ``m = 1.0``
  candidate repeats the first's scale exactly and can never win: it is skipped.

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
from fp4vis.formats import (
    FOLDED_MSE_CONTENDERS,
    FOLDED_MSE_MULTIPLIERS,
    FOLDED_MSE_SUBNORMAL_CONTENDER,
    FP8_GROUP_TOP_EXP,
    FP8_MIN_GROUP_EXP,
)

from ..scale_record import (
    K_OPERAND,
    Q_OPERAND,
    V_OPERAND,
    fp8_scale_underflow,
    mxfp4_scale_counts,
    nvfp4_scale_counts,
    record_scale_range,
)
from ..scale_record import words as record_words
from ..triton_shared import exact_f32 as _f32
from .layout import fp8_key_scale_blocks

# _mult_rt below computes these as k / 16 for candidates 1..11, _contender_scale the contenders (m = 1.0,
# 0.625 where subnormal, then _contender_mult's four); keep them in step.
assert FOLDED_MSE_MULTIPLIERS == (1.0, 0.25, 0.3125, 0.375, 0.4375, 0.5, 0.625, 0.75, 0.875, 1.0, 1.125, 1.25)
assert FOLDED_MSE_CONTENDERS == (0, 6, 7, 8, 10, 11) and FOLDED_MSE_SUBNORMAL_CONTENDER == 6

_MAGIC = tl.constexpr(12582912.0)       # 1.5 * 2^23: float32 values in [2^23, 2^24) have ulp 1
_MAGIC_BITS = tl.constexpr(0x4B400000)  # its bit pattern
_FP8_TOP_EXP = tl.constexpr(FP8_GROUP_TOP_EXP)
_FP8_MIN_EXP = tl.constexpr(FP8_MIN_GROUP_EXP)
_E4M3_NAN = tl.constexpr(0x7F)
_E4M3_MIN_NORMAL = tl.constexpr(0.015625)  # 2^-6
# the range record's operand index of each part (kernels/scale_record.py)
Q_PART, K_PART, V_PART = tl.constexpr(Q_OPERAND), tl.constexpr(K_OPERAND), tl.constexpr(V_OPERAND)


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
    FP16 snaps it), two values at a time on FP16x2: convert to FP16 (round to nearest), p = min(p, 6),
    k = max(p, 1), then (p + 512 k) - 512 k by two FMAs, back to float32: 7 instructions per pair where
    the float32 form takes 16.
    The grid: for p in [2^e, 2^(e+1)), e >= 0, 512 k = 512 p is exact, a multiple of 2^(e-1) whose count
    of 2^(e-1) steps is even wherever p is an E2M1 midpoint, and p + 512 p lies in [2^(e+9), 2^(e+10)),
    whose FP16 ulp is 2^(e-1): the first FMA rounds p to the E2M1 step of its binade, ties to even, and
    the second subtracts 512 k exactly; below 1, k = 1 and the step is 0.5 (E2M1's subnormals). Only the
    two largest FP16 values below 2 and below 4 carry p + 512 p into the next binade (they would round
    to 1.5 and 3); no t of the kernel converts to them (below).
    Exact: t is within 2^-22 relative of ax / sc, which is either an E2M1 midpoint b (3 significant
    bits: an FP16 value, and t lies well inside its half-ulp, so the conversion lands on b exactly)
    or at least b 2^-9 away from every midpoint (the module doc), more than an FP16 ulp at b (b
    2^-10 at most), so the conversion cannot reach b; likewise ax / sc is 2 or 4 exactly or at least
    2^-8 relative below it, far from the two FP16 values above. Below 2^-14 (FP16 subnormals) everything
    rounds to 0 either way; t >= 65520 converts to +inf and the min gives 6; NaN gives 6, as
    ``_e2m1_mag`` does (min returns the non-NaN operand). ``fp4vis.formats`` states the same
    rounding; ``tests/kernels/hopper/test_hopper_prepass.py`` checks this arithmetic exhaustively on the CPU (every BF16
    magnitude against every E4M3 scale) and the GPU bit check the PTX."""
    return tl.inline_asm_elementwise(
        asm="""{
        .reg .b32 p, k, s, f;
        .reg .b16 l, h;
        cvt.rn.f16x2.f32 p, $3, $2;
        mov.b32 f, 0x46004600;
        min.f16x2 p, p, f;
        mov.b32 f, 0x3C003C00;
        max.f16x2 k, p, f;
        mov.b32 f, 0x60006000;
        fma.rn.f16x2 s, k, f, p;
        mov.b32 f, 0xE000E000;
        fma.rn.f16x2 p, k, f, s;
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
def _rcp(sc, APPROX: tl.constexpr = False):
    """1 / sc, 0 for sc == 0: correctly rounded (a division, about ten instructions), or APPROX the GPU's
    ``rcp.approx`` (one instruction, within 1 ulp: t = |x| * rcp(sc) stays within 2^-22 relative of |x| / sc, all
    ``_code`` needs; sc is an E4M3 value, never a float32 subnormal). APPROX is for the GPU only (inline
    PTX: Triton's interpreter cannot run it)."""
    if APPROX:
        r = tl.inline_asm_elementwise(asm="rcp.approx.ftz.f32 $0, $1;", constraints="=f,f", args=[sc],
                                      dtype=tl.float32, is_pure=True, pack=1)
        return tl.where(sc == 0.0, 0.0, r)
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
    valid when sc is the unsaturated E4M3 rounding of base * m): every candidate's form, in integer
    units (the full search, ``FULL_SEARCH``)."""
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
def _contender_err(alo, ahi, m2lo, m2hi, sc, CODES_F16: tl.constexpr):
    """sum over the 32 values of P (P - 2|x|), P = c * sc, exactly, as float64: sc times the float32 sum
    of c (c sc - 2|x|) (m2lo, m2hi: -2|x|). For a contender scale of a group that saturates no
    candidate, every term is an integer multiple of 2^(floor(log2 sc) - 9) and 32 of them stay below
    2^22 of those units, so the FMA, the product and every partial sum, in any order, are exact
    (``FOLDED_MSE_CONTENDERS``' test checks it for every BF16 group maximum and value); the product
    with sc (4 significant bits) is exact in float64."""
    r3 = _rcp(sc, CODES_F16)[:, :, None]
    sc3 = sc[:, :, None]
    c_lo = _code(alo, r3, CODES_F16)
    c_hi = _code(ahi, r3, CODES_F16)
    # four terms per FMA chain (the even and odd columns of both halves): one product and three FMAs where
    # four products and three additions would do; exact like any other partial sum
    cle, clo = _pairs(c_lo)
    che, cho = _pairs(c_hi)
    mle, mlo = _pairs(m2lo)
    mhe, mho = _pairs(m2hi)
    terms = tl.fma(cle, tl.fma(cle, sc3, mle),
                   tl.fma(clo, tl.fma(clo, sc3, mlo),
                          tl.fma(che, tl.fma(che, sc3, mhe), cho * tl.fma(cho, sc3, mho))))
    return tl.sum(terms, axis=2).to(tl.float64) * sc.to(tl.float64)


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
    strictly better) among all candidates, errors from ``_cand_err`` (exact integer units) or, WIDE,
    ``_cand_err64`` (float64). A loop, not unrolled (keeps the code small); candidate 9, the second
    m = 1.0, gives the first's scale and can never be strictly better: skipped."""
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
def _contender_mult(i):
    """The multiplier of the i-th contender after m = 1.0 and 0.625: 0.75, 0.875, 1.125, 1.25 for
    i = 0..3, as k / 16 (exact, so base * m rounds as with the constant)."""
    k = 12 + 2 * i + 2 * (i // 2)
    return k.to(tl.float32) * 0.0625


@triton.jit
def _contender_scale(alo, ahi, base, CODES_F16: tl.constexpr):
    """The scale the full search picks (the first candidate with the least error), found among the
    contenders only (``FOLDED_MSE_CONTENDERS``, in the candidates' order: m = 1.0, 0.625, 0.75, 0.875,
    1.125, 1.25) for groups that saturate no candidate: every other candidate is never strictly better
    than a contender, or only as good and later. m = 0.625 is evaluated only in a tile where its scale
    is an E4M3 subnormal in some group (base * 0.625 < 2^-6); elsewhere the other contenders cover it.
    Errors from ``_contender_err``; a loop over the last four, not unrolled."""
    m2lo = -(alo + alo)
    m2hi = -(ahi + ahi)
    best_sc = _e4m3(base * 1.0)
    best_err = _contender_err(alo, ahi, m2lo, m2hi, best_sc, CODES_F16)
    if tl.max((base * 0.625 < _E4M3_MIN_NORMAL).to(tl.int32)) > 0:
        sc = _e4m3(base * 0.625)
        err = _contender_err(alo, ahi, m2lo, m2hi, sc, CODES_F16)
        better = err < best_err
        best_err = tl.where(better, err, best_err)
        best_sc = tl.where(better, sc, best_sc)
    for i in range(4):
        sc = _e4m3(base * _contender_mult(i))
        err = _contender_err(alo, ahi, m2lo, m2hi, sc, CODES_F16)
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
    x = _f32(tl.load(X + off, mask=m, other=0.0))
    return _bf16_round((x * r) * _f32(tl.load(W + woff)))


@triton.jit
def _pairs(x):
    """(even, odd) elements along the last dimension of x (its size even)."""
    return tl.split(tl.reshape(x, x.shape[:-1] + [x.shape[-1] // 2, 2]))


@triton.jit
def _interleaved(even, odd):
    """The inverse of ``_pairs``."""
    j = tl.join(even, odd)
    return tl.reshape(j, j.shape[:-2] + [j.shape[-2] * 2])


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
    contiguous rows (vector loads) and the pairs are split in registers (``_pairs``): loading the
    partner column and the table entries by gathered indices costs a scalar load per value each."""
    if NORM:
        r = tl.load(R + tok, mask=m, other=0.0)
        x = _normed(X, off + col, m, r, W, woff + col)
        if ROPE:
            xe, xo = _pairs(x)
            ce, _co = _pairs(_f32(tl.load(COS + foff + col, mask=m, other=0.0)))
            _se, so = _pairs(_f32(tl.load(SIN + foff + col, mask=m, other=0.0)))
            t1e = xe * ce     # even column: x cos[c] - x' sin[c + 1]
            t2e = xo * so
            t1o = xo * ce     # odd column: x cos[c - 1] + x' sin[c]
            t2o = xe * so
            if COS.dtype.element_ty == tl.bfloat16:
                t1e = _bf16_round(t1e)
                t2e = _bf16_round(t2e)
                t1o = _bf16_round(t1o)
                t2o = _bf16_round(t2o)
            x = _interleaved(_bf16_round(t1e - t2e), _bf16_round(t1o + t2o))
    elif TO_BF16:
        x = _bf16_round(tl.load(X + off + col, mask=m, other=0.0).to(tl.float32))
    else:
        x = _f32(tl.load(X + off + col, mask=m, other=0.0))
    return x


@triton.jit
def _nvfp4_folded(lo, hi, CODES_F16: tl.constexpr, FULL_SEARCH: tl.constexpr):
    """Decoded folded-K64 NVFP4 of (R, D/32, 16) halves lo, hi (column j*16 + t and that + D/2: one
    64-value group per j), the scale of each group chosen by the exact MSE search: among the
    contenders (``_contender_scale``), or every candidate where FULL_SEARCH (the same choice; for
    measurement) or where a candidate saturates E4M3 somewhere in the tile; and the tile's scale-range
    counts (underflow, overflow)."""
    alo = tl.abs(lo)
    ahi = tl.abs(hi)
    amax = tl.maximum(tl.max(alo, axis=2), tl.max(ahi, axis=2))   # (R, NB2)
    base = tl.math.div_rn(amax, 6.0)
    if tl.max((base * 1.25 > 448.0).to(tl.int32)) == 0:
        if FULL_SEARCH:
            best_sc = _best_scale(alo, ahi, alo + alo, ahi + ahi, base, False, CODES_F16)
        else:
            best_sc = _contender_scale(alo, ahi, base, CODES_F16)
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
    r3 = _rcp(best_sc, CODES_F16)[:, :, None]
    out_lo = _nan_if_not_finite(_signed(_code(alo, r3, CODES_F16) * sc3, lo, sc3), alo)
    out_hi = _nan_if_not_finite(_signed(_code(ahi, r3, CODES_F16) * sc3, hi, sc3), ahi)
    under, over = nvfp4_scale_counts(best_sc, amax, base)
    return out_lo, out_hi, under, over


@triton.jit
def _nvfp4_block16(x, CODES_F16: tl.constexpr):
    """Decoded block16 NVFP4 of (R, D/16, 16) x (one group per middle index) and the tile's scale-range
    counts (underflow, overflow)."""
    ax = tl.abs(x)
    amax = tl.max(ax, axis=2)
    base = tl.math.div_rn(amax, 6.0)
    sc = _e4m3(base)
    sc3 = sc[:, :, None]
    under, over = nvfp4_scale_counts(sc, amax, base)
    return (_nan_if_not_finite(_signed(_code(ax, _rcp(sc, CODES_F16)[:, :, None], CODES_F16) * sc3, x, sc3), ax),
            under, over)


@triton.jit
def _nvfp4_rows(X, Y, PERM, use_perm, tile, N, S, H, sb, sh, ss, R, W, COS, SIN, D: tl.constexpr,
                FOLDED: tl.constexpr, HAS_PERM: tl.constexpr, BLOCK_R: tl.constexpr, CODES_F16: tl.constexpr,
                NORM: tl.constexpr, ROPE: tl.constexpr, FULL_SEARCH: tl.constexpr, ROW_ALIGN: tl.constexpr):
    """BLOCK_R rows of one NVFP4 operand: rows (g, s) of the (B, H, S, D) view X (strides sb, sh,
    ss, 1; N = B*H*S rows) -> decoded BF16 rows g * S + s in Y; rows gathered by PERM where HAS_PERM
    and the runtime flag use_perm (the K part) are set; values as ``_qk_values``. Returns the rows'
    scale-range counts (underflow, overflow)."""
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
        out_lo, out_hi, under, over = _nvfp4_folded(lo, hi, CODES_F16, FULL_SEARCH)
        tl.store(Y + dst + col, out_lo.to(tl.bfloat16), mask=m3)
        tl.store(Y + dst + col + D // 2, out_hi.to(tl.bfloat16), mask=m3)
    else:
        NB: tl.constexpr = D // 16
        col = tl.arange(0, NB)[None, :, None] * 16 + tl.arange(0, 16)[None, None, :]
        x = _qk_values(X, src, col, m3, R, tok, W, woff, COS, SIN, foff, NORM, ROPE, True)
        y, under, over = _nvfp4_block16(x, CODES_F16)
        tl.store(Y + dst + col, y.to(tl.bfloat16), mask=m3)
    return under, over


@triton.jit
def _pow2(e):
    """Exact float32 2^e for integer e in [-127, 127]."""
    normal = ((tl.maximum(e, -126) + 127) << 23).to(tl.float32, bitcast=True)
    return tl.where(e < -126, 5.877471754111438e-39, normal)   # 2^-127


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
    alpha * c in BF16; returns the block's scale-range counts (underflow, overflow)."""
    valid, s, dst = _key_block_rows(PERM, blk, g, S, HAS_PERM)
    src, _b, _h = _src_offsets(g, s, H, sb, sh, ss, ROW_ALIGN)
    dst = dst * D
    under = 0
    over = 0
    for d0 in tl.static_range(0, D, BLOCK_D):
        dcol = d0 + tl.arange(0, BLOCK_D)
        v = _f32(tl.load(V + src[:, None] + dcol[None, :], mask=valid[:, None], other=0.0))
        amax = tl.max(tl.abs(v), axis=0)                                  # (BLOCK_D,)
        n_under, n_over = mxfp4_scale_counts(amax)
        under += n_under
        over += n_over
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
    return under, over


# runtime integers of both pre-pass kernels (not specialised: one compile serves every shape)
_RUNTIME_INTS = ["NQ", "SQ", "NK", "SK", "TQ", "TK", "NVB", "NKB", "H", "QSB", "QSH", "QSS", "KSB", "KSH", "KSS",
                 "VSB", "VSH", "VSS"]


@triton.jit(do_not_specialize=["REC", "FLAG", "CALL"] + [n for n in _RUNTIME_INTS if n != "NKB"])
def _prepass_kernel(Q, K, V, YQ, YK, YV, PERM, RQ, RK, WQ, WK, COS, SIN, REC, FLAG, CALL, NQ, SQ, NK, SK, TQ, TK, NVB,
                    H, QSB, QSH, QSS, KSB, KSH, KSS, VSB, VSH, VSS,
                    D: tl.constexpr, FOLDED: tl.constexpr, HAS_PERM: tl.constexpr, BLOCK_R: tl.constexpr,
                    BLOCK_D: tl.constexpr, CODES_F16: tl.constexpr, NORM: tl.constexpr, ROPE: tl.constexpr,
                    FULL_SEARCH: tl.constexpr, ROW_ALIGN: tl.constexpr):
    """Programs [0, TQ): Q row tiles; [TQ, TQ + TK): K row tiles (rows gathered by PERM);
    the rest: V blocks (NVB 32-token blocks per head group, gathered by PERM). Q, K, V: (B, H, S, D)
    views with the given strides; with NORM/ROPE, Q and K are the raw projections and ``_qk_values``
    normalises (rstd RQ/RK, weights WQ/WK) and rotates (COS, SIN) them on the way in. Each program adds
    its scale-range counts to the range record (REC, FLAG) where CALL > 0 (``kernels/scale_record.py``)."""
    pid = tl.program_id(0)
    if pid < TQ + TK:
        # Q and K share one copy of the (large) quantizer code: pick the part's pointers and sizes
        if pid < TQ:
            X, Y, tile, N, S, use_perm, R, W, sb, sh, ss = Q, YQ, pid, NQ, SQ, False, RQ, WQ, QSB, QSH, QSS
        else:
            X, Y, tile, N, S, use_perm, R, W, sb, sh, ss = K, YK, pid - TQ, NK, SK, True, RK, WK, KSB, KSH, KSS
        under, over = _nvfp4_rows(X, Y, PERM, use_perm, tile, N, S, H, sb, sh, ss, R, W, COS, SIN, D, FOLDED,
                                  HAS_PERM, BLOCK_R, CODES_F16, NORM, ROPE, FULL_SEARCH, ROW_ALIGN)
        record_scale_range(REC, FLAG, CALL, tl.where(pid < TQ, Q_PART, K_PART), under, over)
    else:
        vid = pid - TQ - TK
        g = vid // NVB
        under, over = _mxfp4_block(V, YV, PERM, vid - g * NVB, g, SK, H, VSB, VSH, VSS, D, HAS_PERM, BLOCK_D,
                                   ROW_ALIGN)
        record_scale_range(REC, FLAG, CALL, V_PART, under, over)


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
def _fp8_query_rows(Q, Q8, QS, tile, NQ, S, H, sb, sh, ss, R, W, COS, SIN, D: tl.constexpr,
                    BLOCK_Q: tl.constexpr, NORM: tl.constexpr, ROPE: tl.constexpr, ROW_ALIGN: tl.constexpr):
    """BLOCK_Q rows of Q (NQ rows (g, s) of a (B, H, S, D) view in all), one scale per row: E4M3 in
    Q8, 2^E in QS; values as ``_qk_values``. Returns the rows' scale underflows."""
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
    e = _fp8_group_exponent(amax)
    tl.store(Q8 + rows.to(tl.int64)[:, None] * D + col, _fp8_e4m3(x, e[:, None]), mask=rmask[:, None])
    tl.store(QS + rows, _pow2(e), mask=rmask)
    return fp8_scale_underflow(amax)


@triton.jit
def _fp8_key_block(K, K8, KS, PERM, blk, g, S, NKB, H, sb, sh, ss, R, W, COS, SIN, D: tl.constexpr,
                   HAS_PERM: tl.constexpr, NORM: tl.constexpr, ROPE: tl.constexpr, ROW_ALIGN: tl.constexpr):
    """Physical 32-key block blk of head group g, one scale for the block (its valid keys only):
    E4M3 in K8, 2^E in KS (NKB entries per head group; blocks past the sequence, which pad the
    scales to whole kernel tiles, get 1.0); values as ``_qk_values``. Returns its scale underflow (0 or 1)."""
    valid, s, dst = _key_block_rows(PERM, blk, g, S, HAS_PERM)
    src, b, h = _src_offsets(g, s, H, sb, sh, ss, ROW_ALIGN)
    col = tl.arange(0, D)[None, :]
    x = _qk_values(K, src[:, None], col, valid[:, None], R, (b * S + s)[:, None], W, (h * D)[:, None], COS, SIN,
                   (s.to(tl.int64) * D)[:, None], NORM, ROPE, False)
    amax = tl.max(tl.max(tl.abs(x), axis=1), axis=0)
    e = _fp8_group_exponent(amax)
    tl.store(K8 + dst[:, None] * D + col, _fp8_e4m3(x, e), mask=valid[:, None])
    tl.store(KS + g * NKB + blk, tl.where(blk * 32 < S, _pow2(e), 1.0))
    return fp8_scale_underflow(tl.zeros((1,), tl.float32) + amax)


@triton.jit(do_not_specialize=["REC", "FLAG", "CALL"] + [n for n in _RUNTIME_INTS if n not in ("NK", "TK")])
def _fp8_prepass_kernel(Q, K, V, Q8, K8, V6, QS, KS, PERM, RQ, RK, WQ, WK, COS, SIN, REC, FLAG, CALL, NQ, SQ, TQ, SK,
                        NKB, NVB, H,
                        QSB, QSH, QSS, KSB, KSH, KSS, VSB, VSH, VSS,
                        D: tl.constexpr, HAS_PERM: tl.constexpr, BLOCK_Q: tl.constexpr, BLOCK_D: tl.constexpr,
                        NORM: tl.constexpr, ROPE: tl.constexpr, ROW_ALIGN: tl.constexpr):
    """Programs [0, TQ): Q row tiles; the rest one (head group, 32-key block) each, NKB blocks per
    group (scales padded to whole kernel tiles): the K block and, for the NVB blocks that hold keys,
    the V block at the same physical keys (both gathered by PERM). Views, NORM/ROPE and the range
    record (REC, FLAG, CALL) as ``_prepass_kernel``."""
    pid = tl.program_id(0)
    if pid < TQ:
        under = _fp8_query_rows(Q, Q8, QS, pid, NQ, SQ, H, QSB, QSH, QSS, RQ, WQ, COS, SIN, D, BLOCK_Q, NORM, ROPE,
                                ROW_ALIGN)
        record_scale_range(REC, FLAG, CALL, Q_PART, under, 0)
    else:
        kid = pid - TQ
        g = kid // NKB
        blk = kid - g * NKB
        under = _fp8_key_block(K, K8, KS, PERM, blk, g, SK, NKB, H, KSB, KSH, KSS, RK, WK, COS, SIN, D, HAS_PERM, NORM,
                               ROPE, ROW_ALIGN)
        record_scale_range(REC, FLAG, CALL, K_PART, under, 0)
        if blk < NVB:
            under, over = _mxfp4_block(V, V6, PERM, blk, g, SK, H, VSB, VSH, VSS, D, HAS_PERM, BLOCK_D, ROW_ALIGN)
            record_scale_range(REC, FLAG, CALL, V_PART, under, over)


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
        x = _f32(tl.load(X + base + col[None, :], mask=tmask[:, None] & (col < N)[None, :], other=0.0))
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
def _rms_rstd_kernel(XQ, XK, RQ, RK, NQT, NKT, TQ, SQ, SK, QSB, QSS, KSB, KSS, N, eps_q, eps_k,
                     BLOCK_T: tl.constexpr, THREADS: tl.constexpr, NCHUNK: tl.constexpr, ROW_ALIGN: tl.constexpr):
    """Programs [0, TQ): rstd of q's tokens; the rest k's (``_rms_rstd_rows``)."""
    pid = tl.program_id(0)
    if pid < TQ:
        _rms_rstd_rows(XQ, RQ, pid, NQT, SQ, QSB, QSS, N, eps_q, BLOCK_T, THREADS, NCHUNK, ROW_ALIGN)
    else:
        _rms_rstd_rows(XK, RK, pid - TQ, NKT, SK, KSB, KSS, N, eps_k, BLOCK_T, THREADS, NCHUNK, ROW_ALIGN)


# Warps per program of the FP8 pre-pass: 4 at D = 128; 2 at D = 64, where 4 would spread each 32-key
# FP8/MXFP4 block over twice the threads it fills (measured on the H200,
# benchmarks/results/20261129f_h200_prepass_d64-tune.json: 7-10 % faster at ViT shapes).
NUM_WARPS = 4
NUM_WARPS_D64 = 2
# ptxas's register cap of the FP8 pre-pass at D = 128: 72 (from 90: 5 -> 7 programs of 4 warps per SM) takes 11-12 %
# less GPU time at S >= 16k per head group and 9 % at B1 S4096 H24, 0 differing
# (benchmarks/results/20261203j_h200_prepass_variants.json; 2 values spilled, outside any loop); at D = 64 no cap
# changes it
FP8_MAX_REGISTERS = {128: 72, 64: None}
# Rows and warps per program of the NVFP4 pre-pass, by head dim: 16 values per thread either way (each
# 32-value group over two threads, one shuffle per candidate sum). At D = 128, 8 rows on 2 warps take 9-11 % less GPU
# time than 16 on 4, and 16 on 2 or 32 on 4 more (every shape of benchmarks/results/20261203g_h200_prepass_variants-
# before.json and 20261203h_h200_prepass_variants.json); a register cap of 80 (20 -> 24 warps per SM) 2-3 % less
# (20261203i and j; ptxas then spills 12 values outside the candidate loop; 72 measured the same, within 0.4 %).
# At D = 64, 16 rows on 2 warps (4 warps: two shuffle levels per sum, 15-19 % slower,
# 20261129f_h200_prepass_d64-tune.json; 8 rows: 15-19 % slower, 20261203g and h).
NVFP4_LAUNCH = {128: (8, 2, 80), 64: (16, 2, None)}


def default_warps(d: int) -> int:
    """Warps per program of the FP8 pre-pass for head dimension d."""
    return NUM_WARPS if d >= 128 else NUM_WARPS_D64


def nvfp4_launch(d: int) -> tuple[int, int, int | None]:
    """(rows, warps, ptxas's register cap) per program of the NVFP4 pre-pass for head dimension d."""
    return NVFP4_LAUNCH[128] if d >= 128 else NVFP4_LAUNCH[64]


# E2M1 codes of the NVFP4 search on FP16 pairs (``_e2m1_mag_f16``, inline PTX); Triton's interpreter
# (the CPU tests) cannot run inline assembly and takes the float32 form, which gives the same bits.
# FP4VIS_PREPASS_F16_CODES=0 selects the float32 form on the GPU too (for side-by-side timing).
def f16_codes_default() -> bool:
    """The E2M1 code form used where a call does not name one."""
    return cached_setting("FP4VIS_PREPASS_F16_CODES") and not _interpreting()


def full_search_default() -> bool:
    """Whether the folded-K64 scale search evaluates every candidate instead of the contenders
    (FP4VIS_PREPASS_FULL_SEARCH; the same bits either way: for measurement)."""
    return cached_setting("FP4VIS_PREPASS_FULL_SEARCH")


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


def compile_signature(fp8: bool, dtype: str = "bf16", rope_dtype: str = "fp32") -> dict:
    """The pointer and integer types of ``_prepass_kernel`` (``fp8``: ``_fp8_prepass_kernel``) for
    ``dtype`` inputs, as ``compile_check.compile_triton_sm90`` takes them (the GPU build without a GPU)."""
    outs = (("Q8", "*fp8e4nv"), ("K8", "*fp8e4nv"), ("V6", "*bf16"), ("QS", "*fp32"), ("KS", "*fp32")) if fp8 else \
        (("YQ", "*bf16"), ("YK", "*bf16"), ("YV", "*bf16"))
    sig = dict.fromkeys(("Q", "K", "V"), f"*{dtype}") | dict(outs) | {"PERM": "*i32", "RQ": "*fp32", "RK": "*fp32",
                                                                       "WQ": f"*{dtype}", "WK": f"*{dtype}",
                                                                       "COS": f"*{rope_dtype}", "SIN": f"*{rope_dtype}",
                                                                       "REC": "*i32", "FLAG": "i64", "CALL": "i32"}
    ints = ("NQ", "SQ", "TQ", "SK", "NKB", "NVB") if fp8 else ("NQ", "SQ", "NK", "SK", "TQ", "TK", "NVB")
    return sig | dict.fromkeys(ints + tuple(n for n in _RUNTIME_INTS if n.startswith(("H", "QS", "KS", "VS"))), "i32")


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
    kernels' ROW_ALIGN (``_src_offsets``). 8 BF16 values are one 16-byte vector load; with the
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
# small launch computes each token's rstd (``_rms_rstd_kernel``, torch's reduction order); the
# pre-pass then reads the raw projections and normalises and rotates them in registers.

RMS_THREADS = 128     # threads of torch's vectorized CUDA rms_norm block (32 x 4 warps): its sum order
RMS_BLOCK_T = 8       # tokens per program of the rstd launch
_RMS_META: dict[tuple, list] = {}


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
    rows of H*D values, one launch, in the order of torch's CUDA rms_norm (``_rms_rstd_rows``)."""
    b, h, sq, d = q.shape
    sk = k.shape[2]
    n = h * d
    key = (q.shape, k.shape, q.stride(), k.stride(), q_eps, k_eps, q.device)
    meta = _RMS_META.get(key)
    if meta is None:
        tq = -(-(b * sq) // RMS_BLOCK_T)
        grid = tq + -(-(b * sk) // RMS_BLOCK_T)
        tail = (b * sq, b * sk, tq, sq, sk, q.stride(0), q.stride(2), k.stride(0), k.stride(2), n, q_eps, k_eps,
                RMS_BLOCK_T, RMS_THREADS, -(-n // (4 * RMS_THREADS)), row_align(q, k))
        meta = _RMS_META[key] = [grid, tail, None]
    grid, tail, _ = meta
    out = torch.empty(b * (sq + sk), dtype=torch.float32, device=q.device)
    rq, rk = out[:b * sq], out[b * sq:]
    _run(_rms_rstd_kernel, meta, grid, (q, k, rq, rk), tail, (q, k), NUM_WARPS)
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


def _launch(q, k, v, yq, yk, yv, layout: str, perm, block_r: int | None = None, num_warps: int | None = None,
            f16_codes: bool | None = None, record: tuple | None = None):
    """One ordinary Triton launch over the parts whose tensors are given (None: skipped), counting into
    ``record`` (``kernels/scale_record.py``); returns the compiled kernel (or None)."""
    ref = q if q is not None else (k if k is not None else v)
    d = ref.shape[-1]
    rows, warps, cap = nvfp4_launch(d)
    block_r = block_r or rows
    sk = (k if k is not None else v).shape[-2] if (k is not None or v is not None) else 1
    grid, ints = _geometry(q.numel() // d if q is not None else 0, q.shape[-2] if q is not None else 1,
                           k.numel() // d if k is not None else 0, sk,
                           v.numel() // (d * sk) if v is not None else 0, d, block_r)
    if grid == 0:
        return None
    qv, kv, vv = (ref if t is None else t for t in (q, k, v))
    ptrs = tuple(ref if t is None else t for t in (q, k, v, yq, yk, yv, perm)) + (ref,) * 6 + record_words(
        record, ref.device)
    f16 = f16_codes_default() if f16_codes is None else f16_codes
    return _prepass_kernel[(grid,)](*ptrs, *ints, *_view_ints(qv, kv, vv), d, layout == "folded64_mse",
                                    perm is not None, block_r, min(d, 64), f16, False, False, full_search_default(),
                                    row_align(qv, kv, vv), num_warps=num_warps or warps,
                                    enable_fp_fusion=False, **({"maxnreg": cap} if cap else {}))


def _run(kernel, meta: list, grid: int, ptrs: tuple, tail: tuple, inputs: tuple, num_warps: int,
         max_registers: int | None = None):
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
    caps = {} if max_registers is None else {"maxnreg": max_registers}
    ck = kernel[(grid,)](*ptrs, *tail, num_warps=num_warps, enable_fp_fusion=False, **caps)
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
            block_r: int | None = None, num_warps: int | None = None, f16_codes: bool | None = None, qk=None,
            full_search: bool | None = None, max_registers: int | None = None, record: tuple | None = None):
    """(q_hat, k_hat, v6) of (B, H, S, D) views q, k, v (unit stride along D, any other strides) in
    one launch; BF16, contiguous, views of one buffer. ``perm`` (int32, length Skv) gathers the rows
    of K and V (anchor permutation). ``f16_codes``: the E2M1 code form (None: ``f16_codes_default()``;
    the same bits either way). ``qk``: a ``fp4vis.qk_transform.QKTransform`` that
    ``fusable_transform`` accepts; q and k are then the raw projections, normed and rotated on the
    way in (one more, small launch for the rstd). ``full_search``: the folded-K64 scale search over every
    candidate, not only the contenders (None: ``full_search_default()``; the same bits either way).
    ``block_r``, ``num_warps``, ``max_registers`` (ptxas's register cap, 0: none): the launch, for measurement
    (None: ``nvfp4_launch``'s; its cap applies also where rows or warps are given). ``record``: the range
    record's (fields, flag, call) that the blocks whose scale leaves its format are counted into
    (``kernels/scale_record.py``; None: not counted)."""
    _check_views(q, k, v)
    f16 = f16_codes_default() if f16_codes is None else f16_codes
    full_search = full_search_default() if full_search is None else full_search
    key = (q.shape, k.shape, v.shape, q.stride(), k.stride(), v.stride(), q.dtype, k.dtype, v.dtype, layout,
           perm is not None, block_r, num_warps, max_registers, f16, full_search, q.device, _transform_key(qk))
    meta = _META.get(key)
    qk_ptrs, flags = _transform_args(q, k, qk)
    if meta is None:
        d = q.shape[-1]
        nq, nk = q.numel(), k.numel()
        same = q.shape == k.shape == v.shape
        br = block_r or nvfp4_launch(d)[0]
        grid, ints = _geometry(nq // d, q.shape[-2], nk // d, k.shape[-2], v.numel() // (d * k.shape[-2]), d, br)
        consts = (d, layout == "folded64_mse", perm is not None, br, min(d, 64), f16) + flags + (full_search,
                                                                                            row_align(q, k, v))
        tail = ints + _view_ints(q, k, v) + consts
        _rows, warps, cap = nvfp4_launch(d)
        launch = (num_warps or warps, cap if max_registers is None else (max_registers or None))
        meta = [(3,) + tuple(q.shape) if same else (nq + 2 * nk,), same, grid, tail, launch, None]
        _META[key] = meta
    alloc, same, grid, tail, (warps, cap), _ = meta
    buf = torch.empty(alloc, dtype=torch.bfloat16, device=q.device)
    if same:
        yq, yk, yv = buf.unbind(0)
    else:
        nq, nk = q.numel(), k.numel()
        yq, yk, yv = buf[:nq].view(q.shape), buf[nq:nq + nk].view(k.shape), buf[nq + nk:].view(v.shape)
    ptrs = (q, k, v, yq, yk, yv, q if perm is None else perm) + qk_ptrs + record_words(record, q.device)
    _run(_prepass_kernel, meta, grid, ptrs, tail, (q, k, v) + qk_ptrs, warps, cap)
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
              (torch.bfloat16, tuple(k.shape)), (torch.float32, tuple(q.shape[:-1])),
              (torch.float32, tuple(k.shape[:-2]) + (nkb,)))
    parts, nbytes = [], 0
    for dtype, shape in shapes:
        item = dtype.itemsize
        parts.append((dtype, shape, _contiguous_strides(shape), nbytes // item))
        nbytes += -(-math.prod(shape) * item // _FP8_ALIGN) * _FP8_ALIGN
    nq = q.numel() // d
    tq = -(-nq // FP8_BLOCK_Q)
    tail = (nq, q.shape[-2], tq, sk, nkb, -(-sk // 32)) + _view_ints(q, k, v) + (d, has_perm, FP8_BLOCK_Q,
                                                                                 min(d, 64)) + flags + (
        row_align(q, k, v),)
    return [nbytes, parts, tq + g * nkb, tail, launch, None]


def fp8_meta_key(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, perm: torch.Tensor | None = None,
                 num_warps: int | None = None, qk=None, max_registers: int | None = None) -> tuple:
    """The key under which ``fp8_prepass`` keeps its launch state (``_FP8_META``) for these arguments."""
    return (q.shape, k.shape, v.shape, q.stride(), k.stride(), v.stride(), q.dtype, k.dtype, v.dtype,
            perm is not None, num_warps, max_registers, q.device, _transform_key(qk))


def fp8_prepass(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, perm: torch.Tensor | None = None,
                num_warps: int | None = None, qk=None, max_registers: int | None = None, record: tuple | None = None):
    """(q8, k8, v6, q_scale, k_scale) of (B, H, S, D) views q, k, v (unit stride along D; v shaped
    like k, D a power of two) in one launch (see ``prepass.prepare_fp8_operands`` for what they are);
    views of one buffer. ``perm`` (int32, length Skv) gathers the rows of K and V (anchor
    permutation). ``qk`` and ``record`` as in ``prepass``; ``num_warps``, ``max_registers`` (ptxas's register cap,
    0: none): the launch, for measurement (None: ``default_warps``, ``FP8_MAX_REGISTERS``)."""
    _check_views(q, k, v)
    key = fp8_meta_key(q, k, v, perm, num_warps, qk, max_registers)
    qk_ptrs, flags = _transform_args(q, k, qk)
    meta = _FP8_META.get(key)
    if meta is None:
        d = q.shape[-1]
        cap = FP8_MAX_REGISTERS[128 if d >= 128 else 64] if max_registers is None else (max_registers or None)
        meta = _FP8_META[key] = _fp8_plan(q, k, v, perm is not None, flags, (num_warps or default_warps(d), cap))
    nbytes, parts, grid, tail, (warps, cap), _ = meta
    buf = torch.empty(nbytes, dtype=torch.uint8, device=q.device)
    typed = {dtype: buf.view(dtype) for dtype in (torch.float8_e4m3fn, torch.bfloat16, torch.float32)}
    outs = tuple(typed[dtype].as_strided(shape, strides, off) for dtype, shape, strides, off in parts)
    if grid:
        ptrs = (q, k, v) + outs + (q if perm is None else perm,) + qk_ptrs + record_words(record, q.device)
        _run(_fp8_prepass_kernel, meta, grid, ptrs, tail, (q, k, v) + qk_ptrs, warps, cap)
    return outs


def nvfp4_qdq(x: torch.Tensor, layout: str, perm: torch.Tensor | None = None) -> torch.Tensor:
    """Decoded NVFP4 of contiguous (B, H, S, D) x, BF16, rows optionally gathered by ``perm``."""
    y = torch.empty(x.shape, dtype=torch.bfloat16, device=x.device)
    if perm is None:
        _launch(x, None, None, y, None, None, layout, None)
    else:
        _launch(None, x, None, None, y, None, layout, perm)
    return y


def mxfp4_v6(v: torch.Tensor, perm: torch.Tensor | None = None, record: tuple | None = None) -> torch.Tensor:
    """``alpha * c`` of MXFP4 V (contiguous (B, H, S, D)), BF16, keys optionally permuted; ``record`` as in
    ``prepass``."""
    y = torch.empty(v.shape, dtype=torch.bfloat16, device=v.device)
    _launch(None, None, v, None, None, y, "block16", perm, record=record)
    return y
