"""Fused GPU pre-pass (Triton): q/k/v -> the packed codes and scales of ``prepass.KernelOperands``, the
same bits as the PyTorch statement in ``prepass.py`` (which is fp4vis.formats' quantizers laid out;
the CPU tests compare the two bit for bit under Triton's interpreter, the GPU tests on the GPU).

Two launches: ``_nvfp4_rows`` (Q or K rows: block16, or folded-K64 with the MSE scale choice; the
anchor permutation folded into the row gather) and ``_mxfp4_v`` (one 32-token block of V per program,
all columns; written transposed, pairs along tokens). The format math is ``kernels/triton_formats.py``'s
(docs/numerics.md section 1; its module doc has the exactness arguments), following ``fp4vis.formats``:
* inputs are cast to BF16 first (Q/K, ``bf16_round``); ``amax / 6`` is a correctly rounded float32 division
  (what ``formats._over_six`` computes through float64: amax has 8 significant bits, so the quotient is
  never a float32 midpoint and both round alike); E4M3 scales ``e4m3_round``, written as ``e4m3_byte``.
* E2M1 codes of ``x / sc``: ``e2m1_codes`` (``div_rn``, then the rounding boundaries counted).
* folded-K64: err(sc) = sum P (P - 2|x|), P = |c| sc, in float64, exact in any order (the proof in
  ``formats._folded_mse_choice``); candidates in order, a later one wins only when strictly better;
  "huge" groups (amax >= 48 x the largest candidate) take the first largest candidate.
* MXFP4 V: u = ``mxfp4_scale_exponent(amax)``; ``6 v / alpha`` is exact in float32 for BF16/FP16 v.
Both launches compile with ``enable_fp_fusion=False``: the roundings assume no contraction (``base * m``
into the E4M3 rounding's addition would round once instead of twice).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..scale_record import mxfp4_scale_counts, nvfp4_scale_counts, record_scale_range
from ..scale_record import words as record_words
from ..triton_formats import (
    bf16_round,
    e2m1_codes,
    e2m1_index,
    e2m1_value,
    e4m3_byte,
    e4m3_round,
    exact_f32,
    folded_mse_multiplier,
    mxfp4_scale_exponent,
    packed_e2m1_pairs,
    pow2,
)

BLOCK_R = 32   # Q/K rows per program


@triton.jit
def _decoded64(a, safe, sc):
    """P = |E2M1(a / sc)| * sc in float64 (exact: at most 6 significant bits); 0 where sc = 0."""
    p = (e2m1_value(e2m1_index(tl.math.div_rn(a, safe))) * sc).to(tl.float64)
    return tl.where(sc == 0.0, 0.0, p)


@triton.jit(do_not_specialize=["REC", "FLAG", "CALL", "LIMIT", "OPERAND"])
def _nvfp4_rows(X, PERM, C, S, REC, FLAG, CALL, LIMIT, OPERAND, ROWS_IN, ROWS_OUT, D: tl.constexpr,
                FOLDED: tl.constexpr, HAS_PERM: tl.constexpr, BLOCK_R: tl.constexpr):
    """Rows [r0, r0 + BLOCK_R) of head g: C (G, ROWS_OUT, D/2) packed codes, S (G, ROWS_OUT, D/16)
    E4M3 bytes; rows >= ROWS_IN are zero. The scale range is counted into the range record (REC, FLAG)
    as OPERAND (0 q, 1 k) where CALL > 0, underflows with the q/k flush limit LIMIT into the call's words, on which
    the call's attention kernel decides (``kernels/scale_record.py``)."""
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
        xa = bf16_round(tl.load(xrow + oh[None, :], mask=live2, other=0.0).to(tl.float32))
        xb = bf16_round(tl.load(xrow + D // 2 + oh[None, :], mask=live2, other=0.0).to(tl.float32))
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
            if k == 0:
                m = 1.0
            else:
                m = folded_mse_multiplier(k)
            sc = e4m3_round(base * m)
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
        under, over, flushed, top = nvfp4_scale_counts(best_sc, amax, base, 32)
        record_scale_range(REC, FLAG, CALL, LIMIT, OPERAND, under, over, flushed, top)
        bsc3 = tl.broadcast_to(best_sc[:, :, None], aa.shape)
        ca = tl.reshape(e2m1_codes(a3, bsc3), (BLOCK_R, D // 2))
        cb = tl.reshape(e2m1_codes(b3, bsc3), (BLOCK_R, D // 2))
        sbyte = tl.where(live2, e4m3_byte(best_sc), 0).to(tl.uint8)
        oq = tl.arange(0, D // 4)
        ohs = tl.arange(0, NB // 2)
        cbase = C + g * ROWS_OUT * (D // 2) + r[:, None] * (D // 2)
        sbase = S + g * ROWS_OUT * NB + r[:, None] * NB
        for half in tl.static_range(2):
            ch = ca if half == 0 else cb
            packed = tl.where(live2, packed_e2m1_pairs(ch), 0).to(tl.uint8)
            tl.store(cbase + half * (D // 4) + oq[None, :], packed, mask=rows_ok[:, None])
            tl.store(sbase + half * (NB // 2) + ohs[None, :], sbyte, mask=rows_ok[:, None])
    else:
        od = tl.arange(0, D)
        x = bf16_round(tl.load(xrow + od[None, :], mask=live2, other=0.0).to(tl.float32))
        xb = tl.reshape(x, (BLOCK_R, NB, 16))
        amax = tl.max(tl.abs(xb), axis=2)
        base = tl.math.div_rn(amax, tl.full(amax.shape, 6.0, tl.float32))
        sc = e4m3_round(base)
        under, over, flushed, top = nvfp4_scale_counts(sc, amax, base, 16)
        record_scale_range(REC, FLAG, CALL, LIMIT, OPERAND, under, over, flushed, top)
        codes = tl.reshape(e2m1_codes(xb, tl.broadcast_to(sc[:, :, None], xb.shape)), (BLOCK_R, D))
        packed = tl.where(live2, packed_e2m1_pairs(codes), 0).to(tl.uint8)
        sbytes = tl.where(live2, e4m3_byte(sc), 0).to(tl.uint8)
        odp = tl.arange(0, D // 2)
        ods = tl.arange(0, NB)
        tl.store(C + g * ROWS_OUT * (D // 2) + r[:, None] * (D // 2) + odp[None, :], packed, mask=rows_ok[:, None])
        tl.store(S + g * ROWS_OUT * NB + r[:, None] * NB + ods[None, :], sbytes, mask=rows_ok[:, None])


@triton.jit(do_not_specialize=["REC", "FLAG", "CALL", "LIMIT"])
def _mxfp4_v(V, PERM, VC, VS, REC, FLAG, CALL, LIMIT, ROWS_IN, KEYS, D: tl.constexpr,
             HAS_PERM: tl.constexpr):
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
    under, over, flushed, top = mxfp4_scale_counts(amax)
    record_scale_range(REC, FLAG, CALL, LIMIT, 2, under, over, flushed, top)
    u = mxfp4_scale_exponent(amax)
    y = v * pow2(127 - u)[None, :] * 6.0                              # exact for BF16/FP16 v
    idx = e2m1_index(tl.abs(y))
    sign = ((v.to(tl.int32, bitcast=True) >> 31) & 1) << 3
    c = idx | sign                                                    # (32 tokens, D)
    ct = tl.trans(c)                                                  # (D, 32)
    packed = packed_e2m1_pairs(ct).to(tl.uint8)
    tp = tl.arange(0, 16)
    tl.store(VC + g * D * (KEYS // 2) + od[:, None] * (KEYS // 2) + blk * 16 + tp[None, :], packed)
    tl.store(VS + g * D * (KEYS // 32) + od * (KEYS // 32) + blk, u.to(tl.uint8))


def nvfp4_operand(x: torch.Tensor, layout: str, rows: int, perm: torch.Tensor | None, record: tuple | None = None,
                  operand: int = 0):
    """Fused form of ``prepass.nvfp4_operand`` (after an optional row gather ``perm``) for
    (G, S, D) x: (codes (G, rows, D/2) u8, scales (G, rows, D/16) float8_e4m3fn); counted as ``operand`` into
    ``record`` (``kernels/scale_record.py``: ``recorded``; None: not counted)."""
    g, s, d = x.shape
    x = x.contiguous()
    codes = torch.empty(g, rows, d // 2, dtype=torch.uint8, device=x.device)
    scales = torch.empty(g, rows, d // 16, dtype=torch.uint8, device=x.device)
    grid = (triton.cdiv(rows, BLOCK_R), g)
    _nvfp4_rows[grid](x, perm if perm is not None else codes, codes, scales, *record_words(record, x.device), operand,
                      s, rows, D=d,
                      FOLDED=layout == "folded64_mse", HAS_PERM=perm is not None, BLOCK_R=BLOCK_R, num_warps=4,
                      enable_fp_fusion=False)
    return codes, scales.view(torch.float8_e4m3fn)


def mxfp4_v_operand(v: torch.Tensor, keys: int, perm: torch.Tensor | None, record: tuple | None = None):
    """Fused form of ``prepass.mxfp4_v_operand`` (after an optional row gather ``perm``), counted into ``record``
    as ``nvfp4_operand``."""
    g, s, d = v.shape
    v = v.contiguous()
    codes = torch.empty(g, d, keys // 2, dtype=torch.uint8, device=v.device)
    scales = torch.empty(g, d, keys // 32, dtype=torch.uint8, device=v.device)
    _mxfp4_v[(keys // 32, g)](v, perm if perm is not None else codes, codes, scales, *record_words(record, v.device),
                              s, keys, D=d,
                              HAS_PERM=perm is not None, num_warps=4, enable_fp_fusion=False)
    return codes, scales

