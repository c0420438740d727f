"""Fused GPU pre-pass (Triton): q/k/v -> the packed codes and scales of ``prepass.Operands``, the
same bits as the PyTorch statement in ``prepass.py`` (which is fp4vis.formats' quantizers laid out;
the CPU tests compare the two bit for bit under Triton's interpreter, the GPU tests on the GPU).

Two launches: ``_nvfp4_rows`` (Q or K rows: block16, or folded-K64 with the MSE scale choice; the
anchor permutation folded into the row gather) and ``_mxfp4_v`` (one 32-token block of V per program,
all columns; written transposed, pairs along tokens). Exactness (docs/numerics.md section 1), following
``fp4vis.formats``:
* inputs are cast to BF16 first (Q/K); ``amax / 6`` is a correctly rounded float32 division (what
  ``formats._over_six`` computes through float64: amax has 8 significant bits, so the quotient is
  never a float32 midpoint and both round alike); E4M3 is ``min(v, 448)`` converted with RNE.
* E2M1 codes of ``x / sc`` with ``div_rn``: x has 8 significant bits and ``b * sc`` (b an E2M1
  midpoint) at most 7, so x / sc is a midpoint exactly or at least b * 2^-9 away from one: the
  rounded quotient stays on its side; the rounding boundaries are then counted (ties to even).
* folded-K64: err(sc) = sum P (P - 2|x|), P = |c| sc, in float64, exact in any order (the proof in
  ``formats._folded_mse_choice``); candidates in order, a later one wins only when strictly better;
  "huge" groups (amax >= 48 x the largest candidate) take the first largest candidate.
* MXFP4 V: u from the exponent and mantissa bits of amax (nearest power of two, ties to the even
  exponent; amax <= 1e-38 gives 0); ``6 v / alpha`` is exact in float32 for BF16/FP16 v.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from fp4vis.formats import E4M3_MAX, FOLDED_MSE_MULTIPLIERS, MXFP4_ZERO_AMAX

from ..scale_record import mxfp4_scale_counts, nvfp4_scale_counts, record_scale_range
from ..scale_record import words as record_words
from ..triton_shared import exact_f32
from .kernel import _e2m1_index, _e2m1_value  # the one E2M1 emulation of the Blackwell sources

# _candidate below computes the multipliers as k / 16 (exact); keep the two in step
assert FOLDED_MSE_MULTIPLIERS == (1.0, 0.25, 0.3125, 0.375, 0.4375, 0.5, 0.625, 0.75, 0.875, 1.0, 1.125, 1.25)

# literals in the kernels below (Triton's interpreter mishandles module constexprs in tensor
# arithmetic); checked against the project's constants here
assert MXFP4_ZERO_AMAX == 1e-38 and E4M3_MAX == 448.0
BLOCK_R = 32   # Q/K rows per program


@triton.jit
def _bf16_rne(x):
    """float32 x rounded to BF16 (nearest, ties to even) and back, from the bits: the same on the
    GPU as cvt.rn.bf16.f32, and under Triton's interpreter (whose conversion truncates)."""
    bits = x.to(tl.int32, bitcast=True)
    bits = (bits + 0x7FFF + ((bits >> 16) & 1)) & -65536
    return bits.to(tl.float32, bitcast=True)


@triton.jit
def _e4m3(v):
    """E4M3 value (float32) of v >= 0: RNE, saturating at 448 (E4M3_MAX). Rounded on the float32
    grid by adding and subtracting C = 2^(e + 20) (its ulp is E4M3's 2^(e - 3); 2^14 below the
    normal range, the subnormal grid 2^-9): exact, and independent of the conversion instruction
    (Triton's interpreter mis-rounds float8 ties)."""
    v = tl.minimum(v, 448.0)
    c = (v.to(tl.int32, bitcast=True) & 0x7F800000) + (20 << 23)
    c = tl.maximum(c, (14 + 127) << 23)
    cf = c.to(tl.float32, bitcast=True)
    return (v + cf) - cf


@triton.jit
def _e4m3_byte(v):
    """The E4M3 bit pattern (int32 0..126) of an E4M3 value v >= 0 (``_e4m3``'s output)."""
    bits = v.to(tl.int32, bitcast=True)
    ef = (bits >> 23) & 0xFF
    normal = (((ef - 120) << 3) | ((bits >> 20) & 7))
    return tl.where(ef >= 121, normal, (v * 512.0).to(tl.int32))    # subnormals: multiples of 2^-9


@triton.jit
def _codes(x, sc):
    """Signed E2M1 codes (int32, sign bit 3) of x / sc; sc = 0 gives +0 codes."""
    safe = tl.where(sc == 0.0, 1.0, sc)
    idx = _e2m1_index(tl.abs(tl.math.div_rn(x, safe)))
    sign = ((x.to(tl.int32, bitcast=True) >> 31) & 1) << 3
    return tl.where(sc == 0.0, 0, idx | sign)


@triton.jit
def _decoded64(a, safe, sc):
    """P = |E2M1(a / sc)| * sc in float64 (exact: at most 6 significant bits); 0 where sc = 0."""
    p = (_e2m1_value(_e2m1_index(tl.math.div_rn(a, safe))) * sc).to(tl.float64)
    return tl.where(sc == 0.0, 0.0, p)


@triton.jit
def _candidate(k: tl.constexpr):
    """FOLDED_MSE_MULTIPLIERS[k] (= k16 / 16 with k16 in 16, 4, 5, 6, 7, 8, 10, 12, 14, 16, 18, 20)."""
    if k == 0:
        m = 1.0
    elif k < 5:
        m = (k + 3) / 16.0        # 0.25, 0.3125, 0.375, 0.4375
    elif k == 9:
        m = 1.0
    else:
        m = (2 * k - 2) / 16.0    # 0.5, 0.625, 0.75, 0.875, (9), 1.125, 1.25
    return m


@triton.jit(do_not_specialize=["REC", "FLAG", "CALL", "OPERAND"])
def _nvfp4_rows(X, PERM, C, S, REC, FLAG, CALL, OPERAND, ROWS_IN, ROWS_OUT, D: tl.constexpr, FOLDED: tl.constexpr,
                HAS_PERM: tl.constexpr, BLOCK_R: tl.constexpr):
    """Rows [r0, r0 + BLOCK_R) of head g: C (G, ROWS_OUT, D/2) packed codes, S (G, ROWS_OUT, D/16)
    E4M3 bytes; rows >= ROWS_IN are zero. The scale range is counted into the range record (REC, FLAG)
    as OPERAND (0 q, 1 k) where CALL > 0 (``kernels/scale_record.py``)."""
    g = tl.program_id(1).to(tl.int64)
    r = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    live = r < ROWS_IN
    src = r
    if HAS_PERM:
        src = tl.load(PERM + r, mask=live, other=0)
    rows_ok = r < ROWS_OUT
    live2 = live[:, None]
    xrow = X + g * ROWS_IN * D + src[:, None].to(tl.int64) * D
    NB: tl.constexpr = D // 16
    if FOLDED:
        # docs/numerics.md section 1: block i shares its scale with block i + NB/2, i.e. column c with c + D/2.
        # The two halves are loaded, searched and stored separately (plain (R, NB/2, 16) blocks:
        # no 4-D permutes or broadcast reshapes, whose GPU lowering disagreed with the interpreter)
        oh = tl.arange(0, D // 2)
        xa = _bf16_rne(tl.load(xrow + oh[None, :], mask=live2, other=0.0).to(tl.float32))
        xb = _bf16_rne(tl.load(xrow + D // 2 + oh[None, :], mask=live2, other=0.0).to(tl.float32))
        a3 = tl.reshape(xa, (BLOCK_R, NB // 2, 16))
        b3 = tl.reshape(xb, (BLOCK_R, NB // 2, 16))
        aa = tl.abs(a3)
        ab = tl.abs(b3)
        amax = tl.maximum(tl.max(aa, axis=2), tl.max(ab, axis=2))
        base = tl.math.div_rn(amax, tl.full(amax.shape, 6.0, tl.float32))
        two_a = aa.to(tl.float64) * 2.0
        two_b = ab.to(tl.float64) * 2.0
        best_err = tl.full(amax.shape, float("inf"), tl.float64)
        best_sc = tl.zeros(amax.shape, tl.float32)
        top_sc = tl.zeros(amax.shape, tl.float32)
        for k in tl.static_range(12):
            sc = _e4m3(base * _candidate(k))
            top_sc = tl.maximum(top_sc, sc)
            safe3 = tl.broadcast_to(tl.where(sc == 0.0, 1.0, sc)[:, :, None], aa.shape)
            sc3 = tl.broadcast_to(sc[:, :, None], aa.shape)
            pa = _decoded64(aa, safe3, sc3)
            pb = _decoded64(ab, safe3, sc3)
            err = tl.sum(pa * (pa - two_a), axis=2) + tl.sum(pb * (pb - two_b), axis=2)
            better = err < best_err
            best_err = tl.where(better, err, best_err)
            best_sc = tl.where(better, sc, best_sc)
        # huge groups (amax >= 48 x the largest candidate, formats._HUGE_RATIO): the first candidate
        # with the largest scale; only its value matters
        best_sc = tl.where(amax >= 48.0 * top_sc, top_sc, best_sc)
        under, over = nvfp4_scale_counts(best_sc, amax, base)
        record_scale_range(REC, FLAG, CALL, OPERAND, under, over)
        bsc3 = tl.broadcast_to(best_sc[:, :, None], aa.shape)
        ca = tl.reshape(_codes(a3, bsc3), (BLOCK_R, D // 2))
        cb = tl.reshape(_codes(b3, bsc3), (BLOCK_R, D // 2))
        sbyte = tl.where(live2, _e4m3_byte(best_sc), 0).to(tl.uint8)
        oq = tl.arange(0, D // 4)
        ohs = tl.arange(0, NB // 2)
        cbase = C + g * ROWS_OUT * (D // 2) + r[:, None] * (D // 2)
        sbase = S + g * ROWS_OUT * NB + r[:, None] * NB
        for half in tl.static_range(2):
            ch = ca if half == 0 else cb
            lo, hi = tl.split(tl.reshape(ch, (BLOCK_R, D // 4, 2)))
            packed = tl.where(live2, lo | (hi << 4), 0).to(tl.uint8)
            tl.store(cbase + half * (D // 4) + oq[None, :], packed, mask=rows_ok[:, None])
            tl.store(sbase + half * (NB // 2) + ohs[None, :], sbyte, mask=rows_ok[:, None])
    else:
        od = tl.arange(0, D)
        x = _bf16_rne(tl.load(xrow + od[None, :], mask=live2, other=0.0).to(tl.float32))
        xb = tl.reshape(x, (BLOCK_R, NB, 16))
        amax = tl.max(tl.abs(xb), axis=2)
        base = tl.math.div_rn(amax, tl.full(amax.shape, 6.0, tl.float32))
        sc = _e4m3(base)
        under, over = nvfp4_scale_counts(sc, amax, base)
        record_scale_range(REC, FLAG, CALL, OPERAND, under, over)
        codes = tl.reshape(_codes(xb, tl.broadcast_to(sc[:, :, None], xb.shape)), (BLOCK_R, D))
        lo, hi = tl.split(tl.reshape(codes, (BLOCK_R, D // 2, 2)))
        packed = tl.where(live2, lo | (hi << 4), 0).to(tl.uint8)
        sbytes = tl.where(live2, _e4m3_byte(sc), 0).to(tl.uint8)
        odp = tl.arange(0, D // 2)
        ods = tl.arange(0, NB)
        tl.store(C + g * ROWS_OUT * (D // 2) + r[:, None] * (D // 2) + odp[None, :], packed, mask=rows_ok[:, None])
        tl.store(S + g * ROWS_OUT * NB + r[:, None] * NB + ods[None, :], sbytes, mask=rows_ok[:, None])


@triton.jit(do_not_specialize=["REC", "FLAG", "CALL"])
def _mxfp4_v(V, PERM, VC, VS, REC, FLAG, CALL, ROWS_IN, KEYS, D: tl.constexpr, HAS_PERM: tl.constexpr):
    """One 32-token block of head g: VC (G, D, KEYS/2) codes packed along tokens, VS (G, D, KEYS/32)
    E8M0 bytes; tokens >= ROWS_IN are zero. The scale range is counted as ``_nvfp4_rows`` does (operand 2)."""
    g = tl.program_id(1).to(tl.int64)
    blk = tl.program_id(0)
    t = blk * 32 + tl.arange(0, 32)
    live = t < ROWS_IN
    src = t
    if HAS_PERM:
        src = tl.load(PERM + t, mask=live, other=0)
    od = tl.arange(0, D)
    v = exact_f32(tl.load(V + g * ROWS_IN * D + src[:, None].to(tl.int64) * D + od[None, :], mask=live[:, None],
                          other=0.0))
    amax = tl.max(tl.abs(v), axis=0)                                  # (D,)
    under, over = mxfp4_scale_counts(amax)
    record_scale_range(REC, FLAG, CALL, 2, under, over)
    bits = amax.to(tl.int32, bitcast=True)
    ef = (bits >> 23) & 0xFF
    mant = bits & 0x7FFFFF
    up = (mant > 0x400000) | ((mant == 0x400000) & (((ef - 127) & 1) != 0))
    u = ef + up.to(tl.int32)
    # a subnormal amax above the zero threshold (1e-38 .. 2^-126) rounds up to 2^-126: u = 1
    u = tl.where(ef == 0, 1, u)
    u = tl.minimum(tl.maximum(u, 0), 254)
    u = tl.where(amax <= 1e-38, 0, u)                 # formats.MXFP4_ZERO_AMAX
    # 2^(127 - u) from its bits; u = 254 gives the subnormal 2^-127
    inv_alpha = tl.where(u == 254, 0x00400000, (254 - u) << 23).to(tl.float32, bitcast=True)
    y = v * inv_alpha[None, :] * 6.0                                  # exact for BF16/FP16 v
    idx = _e2m1_index(tl.abs(y))
    sign = ((v.to(tl.int32, bitcast=True) >> 31) & 1) << 3
    c = idx | sign                                                    # (32 tokens, D)
    ct = tl.trans(c)                                                  # (D, 32)
    lo, hi = tl.split(tl.reshape(ct, (D, 16, 2)))
    packed = (lo | (hi << 4)).to(tl.uint8)
    tp = tl.arange(0, 16)
    tl.store(VC + g * D * (KEYS // 2) + od[:, None] * (KEYS // 2) + blk * 16 + tp[None, :], packed)
    tl.store(VS + g * D * (KEYS // 32) + od * (KEYS // 32) + blk, u.to(tl.uint8))


def nvfp4_operand(x: torch.Tensor, layout: str, rows: int, perm: torch.Tensor | None, record: tuple | None = None,
                  operand: int = 0):
    """Fused form of ``prepass.nvfp4_operand`` (after an optional row gather ``perm``) for
    (G, S, D) x: (codes (G, rows, D/2) u8, scales (G, rows, D/16) float8_e4m3fn); ``record``, ``operand`` as
    there."""
    g, s, d = x.shape
    x = x.contiguous()
    codes = torch.empty(g, rows, d // 2, dtype=torch.uint8, device=x.device)
    scales = torch.empty(g, rows, d // 16, dtype=torch.uint8, device=x.device)
    grid = (triton.cdiv(rows, BLOCK_R), g)
    _nvfp4_rows[grid](x, perm if perm is not None else codes, codes, scales, *record_words(record, x.device), operand,
                      s, rows, D=d,
                      FOLDED=layout == "folded64_mse", HAS_PERM=perm is not None, BLOCK_R=BLOCK_R, num_warps=4)
    return codes, scales.view(torch.float8_e4m3fn)


def mxfp4_v_operand(v: torch.Tensor, keys: int, perm: torch.Tensor | None, record: tuple | None = None):
    """Fused form of ``prepass.mxfp4_v_operand`` (after an optional row gather ``perm``)."""
    g, s, d = v.shape
    v = v.contiguous()
    codes = torch.empty(g, d, keys // 2, dtype=torch.uint8, device=v.device)
    scales = torch.empty(g, d, keys // 32, dtype=torch.uint8, device=v.device)
    _mxfp4_v[(keys // 32, g)](v, perm if perm is not None else codes, codes, scales, *record_words(record, v.device),
                              s, keys, D=d,
                              HAS_PERM=perm is not None, num_warps=4)
    return codes, scales
