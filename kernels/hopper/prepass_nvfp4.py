"""The Hopper pre-pass's NVFP4 quantizers of a tile of Q or K rows (``nvfp4_block16``, ``nvfp4_folded``): decoded
BF16 values ``c * sc`` (the operands the Hopper kernel reads), the values of ``fp4vis.formats.nvfp4_qdq``, and the
tile's scale-range counts. The E2M1 codes are ``kernels/triton_formats.py``'s ``e2m1_quotient`` (exact: its
module doc).

The folded-K64 scale search, exact and cheaper than the literal formulation (docs/hopper_kernel.md): ``err = sum
(c*sc - x)^2 = sum x^2 + sum_{c != 0} P (P - 2|x|)`` with ``P = c * sc``. The first sum is common to all
candidates and dropped. Only the contenders (``fp4vis.formats.FOLDED_MSE_CONTENDERS``: m = 1.0, 0.75, 0.875,
1.125, 1.25, and 0.625 in a tile where its scale is an E4M3 subnormal somewhere) are evaluated
(``_contender_scale``): in a group that saturates no candidate every other candidate is never strictly better
than one of them, or only as good and later (proved exhaustively over every BF16 group maximum and value,
tests/core/test_formats.py). Their error is ``sc * sum c (c sc - 2|x|)``: each term an integer multiple of
2^(floor(log2 sc) - 9), 32 of them below 2^22 of those units, so the float32 sum is exact in any order, and the
product with sc in float64 (``_contender_err``); ties keep the earlier candidate. ``FULL_SEARCH`` (for
measurement, the same choice) evaluates every candidate instead, each term ``P (P - 2|x|)`` an integer multiple
of ``U = 2^(2E - 12)`` (E = floor(log2 sc)) below 2^22 U in magnitude whenever no candidate scale saturates E4M3
(``base * 1.25 <= 448``), computed exactly by one FMA into the mantissa of 1.5 * 2^23 and summed as int32
(``_cand_err``). The reference (``fp4vis.formats._folded_mse_choice``) sums the same ``P (P - 2|x|)`` in
float64, which is exact too except in "huge" groups (amax >= 48 * the largest candidate scale), where it takes
the first candidate with the largest scale (the error decreases strictly with the scale there). A tile with a
saturating group runs the reference's formulation instead, over every candidate: float64 sums (exact in any
order) and the huge-group rule, so it splits exact ties as the reference does (slower). The second ``m = 1.0``
candidate repeats the first's scale exactly and can never win: it is skipped.

Compiled with ``enable_fp_fusion=False`` (no contraction of ``base * m`` before its E4M3 rounding, nor of the
snap of the codes); the exact FMAs are written explicitly.
"""

from __future__ import annotations

import triton
import triton.language as tl

from fp4vis.formats import FOLDED_MSE_CONTENDERS, FOLDED_MSE_SUBNORMAL_CONTENDER

from ..scale_record import nvfp4_scale_counts
from ..triton_formats import (
    e2m1_quotient,
    e4m3_round,
    folded_mse_multiplier,
    nan_if_not_finite,
    pairs,
    scale_reciprocal,
    with_scale_sign,
)

# _contender_scale below evaluates the contenders (m = 1.0, 0.625 where subnormal, then _contender_mult's four);
# keep them in step
assert FOLDED_MSE_CONTENDERS == (0, 6, 7, 8, 10, 11) and FOLDED_MSE_SUBNORMAL_CONTENDER == 6

_MAGIC = tl.constexpr(12582912.0)       # 1.5 * 2^23: float32 values in [2^23, 2^24) have ulp 1
_MAGIC_BITS = tl.constexpr(0x4B400000)  # its bit pattern
_E4M3_MIN_NORMAL = tl.constexpr(0.015625)  # 2^-6


@triton.jit
def _cand_err(alo, ahi, alo2, ahi2, sc, CODES_F16: tl.constexpr):
    """sum over the 32 values of P (P - 2|x|), P = c * sc, exactly, as float64 (see module doc;
    valid when sc is the unsaturated E4M3 rounding of base * m): every candidate's form, in integer
    units (the full search, ``FULL_SEARCH``)."""
    r = scale_reciprocal(sc)
    e = tl.maximum(((sc.to(tl.int32, bitcast=True) >> 23) & 0xFF) - 127, -9)   # floor(log2 sc)
    inv_u = ((127 + 12 - 2 * e) << 23).to(tl.float32, bitcast=True)           # 2^(12 - 2E)
    u = ((127 - 12 + 2 * e) << 23).to(tl.float32, bitcast=True)               # 2^(2E - 12)
    scu = sc * inv_u                                                          # exact
    sc3 = sc[:, :, None]
    scu3 = scu[:, :, None]
    r3 = r[:, :, None]
    c_lo = e2m1_quotient(alo, r3, CODES_F16)
    c_hi = e2m1_quotient(ahi, r3, CODES_F16)
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
    r3 = scale_reciprocal(sc, CODES_F16)[:, :, None]
    sc3 = sc[:, :, None]
    c_lo = e2m1_quotient(alo, r3, CODES_F16)
    c_hi = e2m1_quotient(ahi, r3, CODES_F16)
    # four terms per FMA chain (the even and odd columns of both halves): one product and three FMAs where
    # four products and three additions would do; exact like any other partial sum
    cle, clo = pairs(c_lo)
    che, cho = pairs(c_hi)
    mle, mlo = pairs(m2lo)
    mhe, mho = pairs(m2hi)
    terms = tl.fma(cle, tl.fma(cle, sc3, mle),
                   tl.fma(clo, tl.fma(clo, sc3, mlo),
                          tl.fma(che, tl.fma(che, sc3, mhe), cho * tl.fma(cho, sc3, mho))))
    return tl.sum(terms, axis=2).to(tl.float64) * sc.to(tl.float64)


@triton.jit
def _cand_err64(alo, ahi, alo2, ahi2, sc, CODES_F16: tl.constexpr):
    """sum over the 32 values of P (P - 2|x|), P = c * sc, in float64 as fp4vis.formats computes it
    (alo2, ahi2: 2|x| in float64): exact, in any summation order, unless the group is huge."""
    sc3 = sc[:, :, None]
    r3 = scale_reciprocal(sc)[:, :, None]
    p_lo = (e2m1_quotient(alo, r3, CODES_F16) * sc3).to(tl.float64)       # exact: at most 6 significant bits
    p_hi = (e2m1_quotient(ahi, r3, CODES_F16) * sc3).to(tl.float64)
    return tl.sum(p_lo * (p_lo - alo2), axis=2) + tl.sum(p_hi * (p_hi - ahi2), axis=2)


@triton.jit
def _best_scale(alo, ahi, alo2, ahi2, base, WIDE: tl.constexpr, CODES_F16: tl.constexpr):
    """The first folded-K64 candidate scale with the least error (a later one wins only when
    strictly better) among all candidates, errors from ``_cand_err`` (exact integer units) or, WIDE,
    ``_cand_err64`` (float64). A loop, not unrolled (keeps the code small); candidate 9, the second
    m = 1.0, gives the first's scale and can never be strictly better: skipped."""
    best_sc = e4m3_round(base * 1.0)
    if WIDE:
        best_err = _cand_err64(alo, ahi, alo2, ahi2, best_sc, CODES_F16)
    else:
        best_err = _cand_err(alo, ahi, alo2, ahi2, best_sc, CODES_F16)
    for i in range(1, 12):
        if i != 9:
            sc = e4m3_round(base * folded_mse_multiplier(i))
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
    best_sc = e4m3_round(base * 1.0)
    best_err = _contender_err(alo, ahi, m2lo, m2hi, best_sc, CODES_F16)
    if tl.max((base * 0.625 < _E4M3_MIN_NORMAL).to(tl.int32)) > 0:
        sc = e4m3_round(base * 0.625)
        err = _contender_err(alo, ahi, m2lo, m2hi, sc, CODES_F16)
        better = err < best_err
        best_err = tl.where(better, err, best_err)
        best_sc = tl.where(better, sc, best_sc)
    for i in range(4):
        sc = e4m3_round(base * _contender_mult(i))
        err = _contender_err(alo, ahi, m2lo, m2hi, sc, CODES_F16)
        better = err < best_err
        best_err = tl.where(better, err, best_err)
        best_sc = tl.where(better, sc, best_sc)
    return best_sc


@triton.jit
def nvfp4_folded(lo, hi, CODES_F16: tl.constexpr, FULL_SEARCH: tl.constexpr):
    """Decoded folded-K64 NVFP4 of (R, D/32, 16) halves lo, hi (column j*16 + t and that + D/2: one
    64-value group per j), the scale of each group chosen by the exact MSE search: among the
    contenders (``_contender_scale``), or every candidate where FULL_SEARCH (the same choice; for
    measurement) or where a candidate saturates E4M3 somewhere in the tile; and the tile's scale-range
    counts (``scale_record.nvfp4_scale_counts``)."""
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
        sc_max = e4m3_round(base * 1.25)
        best_sc = tl.where(amax >= 48.0 * sc_max, sc_max, best_sc)
    sc3 = best_sc[:, :, None]
    r3 = scale_reciprocal(best_sc, CODES_F16)[:, :, None]
    out_lo = nan_if_not_finite(with_scale_sign(e2m1_quotient(alo, r3, CODES_F16) * sc3, lo, sc3), alo)
    out_hi = nan_if_not_finite(with_scale_sign(e2m1_quotient(ahi, r3, CODES_F16) * sc3, hi, sc3), ahi)
    return out_lo, out_hi, nvfp4_scale_counts(best_sc, amax, base, 32)


@triton.jit
def nvfp4_block16(x, CODES_F16: tl.constexpr):
    """Decoded block16 NVFP4 of (R, D/16, 16) x (one group per middle index) and the tile's scale-range
    counts (``scale_record.nvfp4_scale_counts``)."""
    ax = tl.abs(x)
    amax = tl.max(ax, axis=2)
    base = tl.math.div_rn(amax, 6.0)
    sc = e4m3_round(base)
    sc3 = sc[:, :, None]
    r3 = scale_reciprocal(sc, CODES_F16)[:, :, None]
    return (nan_if_not_finite(with_scale_sign(e2m1_quotient(ax, r3, CODES_F16) * sc3, x, sc3), ax),
            nvfp4_scale_counts(sc, amax, base, 16))
