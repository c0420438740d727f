"""Fused GPU pre-pass (Triton): one read of q, k, v and one write of the kernel's operands.

Same arithmetic as ``kernels/hopper_prepass.py`` (the PyTorch version, which is bit-checked against
``fp4vis.formats`` on the CPU): NVFP4 quantize-dequantize of Q and K (``block16`` or
``folded64_mse`` with the MSE scale search), MXFP4 ``alpha * c`` of V, and the anchor permutation
of K and V folded into the loads (``perm[p]`` is the logical key at physical position p). All
roundings are exact round-to-nearest-even: divisions use ``div_rn``, minifloat rounding adds a
power of two whose ulp is the target ulp (``(t + C) - C``). The MSE error of each folded-K64
candidate is summed in float64, where it is exact, so ties go to the first candidate in any
summation order (SPEC: "a later candidate wins only with a strictly smaller error"), as
``fp4vis.formats`` does. ``amax / 6`` is correctly rounded (``div_rn``), as in ``fp4vis.formats``.
The kernels are compiled with ``enable_fp_fusion=False``: a fused multiply-add could skip the
float32 rounding of ``base * m`` before its E4M3 rounding (the reference rounds it first).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from fp4vis.formats import FOLDED_MSE_MULTIPLIERS

# _mult below spells these out as compile-time constants; keep the two in step.
assert FOLDED_MSE_MULTIPLIERS == (1.0, 0.25, 0.3125, 0.375, 0.4375, 0.5, 0.625, 0.75, 0.875, 1.0, 1.125, 1.25)


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
def _bf16_round(x):
    """float32 -> nearest BF16 value (ties to even), kept in float32; exact integer arithmetic."""
    bits = x.to(tl.int32, bitcast=True)
    bits = (bits + 0x7FFF + ((bits >> 16) & 1)) & -65536
    return bits.to(tl.float32, bitcast=True)


@triton.jit
def _e2m1(x):
    """E2M1 RNE with saturation, sign kept (values of fp4vis.formats.e2m1_round)."""
    mag = tl.abs(x)
    r = _round_pow2_grid(mag, 22 << 23, 149 << 23)  # 1 mantissa bit, min normal exp 0
    r = tl.minimum(r, 6.0)
    return tl.where(x < 0, -r, r)


@triton.jit
def _e4m3(mag):
    """E4M3 RNE with saturation of mag >= 0 (values of fp4vis.formats.e4m3_round)."""
    r = _round_pow2_grid(mag, 20 << 23, (127 - 6 + 20) << 23)  # 3 mantissa bits, min exp -6
    return tl.minimum(r, 448.0)


@triton.jit
def _qdq(x, sc):
    """Decoded E2M1(x / sc) * sc, 0 where sc == 0."""
    safe = tl.where(sc == 0.0, 1.0, sc)
    return tl.where(sc == 0.0, 0.0, _e2m1(tl.math.div_rn(x, safe)) * sc)


@triton.jit
def _mult(i: tl.constexpr):
    """FOLDED_MSE_MULTIPLIERS[i] as a compile-time constant."""
    if i == 0:
        return 1.0
    elif i == 1:
        return 0.25
    elif i == 2:
        return 0.3125
    elif i == 3:
        return 0.375
    elif i == 4:
        return 0.4375
    elif i == 5:
        return 0.5
    elif i == 6:
        return 0.625
    elif i == 7:
        return 0.75
    elif i == 8:
        return 0.875
    elif i == 9:
        return 1.0
    elif i == 10:
        return 1.125
    else:
        return 1.25


@triton.jit
def _div6(x, RECIP6: tl.constexpr):
    """x / 6 rounded to nearest (RECIP6 False), or x * float32(1/6) as PyTorch computes a CUDA
    tensor divided by a Python scalar (RECIP6 True)."""
    if RECIP6:
        return x * 0.16666667163372040
    else:
        return tl.math.div_rn(x, 6.0)


@triton.jit
def _nvfp4_kernel(X, Y, PERM, N, S, D: tl.constexpr, FOLDED: tl.constexpr, HAS_PERM: tl.constexpr,
                  BLOCK_R: tl.constexpr, RECIP6: tl.constexpr):
    pid = tl.program_id(0)
    rows = pid * BLOCK_R + tl.arange(0, BLOCK_R)           # global row = g * S + s (physical)
    rmask = rows < N
    rows = tl.where(rmask, rows, 0)
    g = rows // S
    s = rows % S
    if HAS_PERM:
        src_s = tl.load(PERM + s)
    else:
        src_s = s
    src = (g * S + src_s).to(tl.int64) * D
    dst = rows.to(tl.int64) * D
    m3 = rmask[:, None, None]
    if FOLDED:
        NB2: tl.constexpr = D // 32
        j = tl.arange(0, NB2)
        t = tl.arange(0, 16)
        col = j[None, :, None] * 16 + t[None, None, :]    # (1, NB2, 16)
        lo = _bf16_round(tl.load(X + src[:, None, None] + col, mask=m3, other=0.0).to(tl.float32))
        hi = _bf16_round(tl.load(X + src[:, None, None] + col + D // 2, mask=m3, other=0.0).to(tl.float32))
        amax = tl.maximum(tl.max(tl.abs(lo), axis=2), tl.max(tl.abs(hi), axis=2))   # (R, NB2)
        base = _div6(amax, RECIP6)
        best_sc = _e4m3(base * 1.0)
        d_lo = (_qdq(lo, best_sc[:, :, None]) - lo).to(tl.float64)
        d_hi = (_qdq(hi, best_sc[:, :, None]) - hi).to(tl.float64)
        best_err = tl.sum(d_lo * d_lo, axis=2) + tl.sum(d_hi * d_hi, axis=2)   # exact in float64
        for i in tl.static_range(1, 12):
            sc = _e4m3(base * _mult(i))
            e_lo = (_qdq(lo, sc[:, :, None]) - lo).to(tl.float64)
            e_hi = (_qdq(hi, sc[:, :, None]) - hi).to(tl.float64)
            err = tl.sum(e_lo * e_lo, axis=2) + tl.sum(e_hi * e_hi, axis=2)
            better = err < best_err
            best_err = tl.where(better, err, best_err)
            best_sc = tl.where(better, sc, best_sc)
        tl.store(Y + dst[:, None, None] + col, _qdq(lo, best_sc[:, :, None]).to(tl.bfloat16), mask=m3)
        tl.store(Y + dst[:, None, None] + col + D // 2, _qdq(hi, best_sc[:, :, None]).to(tl.bfloat16),
                 mask=m3)
    else:
        NB: tl.constexpr = D // 16
        j = tl.arange(0, NB)
        t = tl.arange(0, 16)
        col = j[None, :, None] * 16 + t[None, None, :]
        x = _bf16_round(tl.load(X + src[:, None, None] + col, mask=m3, other=0.0).to(tl.float32))
        sc = _e4m3(_div6(tl.max(tl.abs(x), axis=2), RECIP6))
        tl.store(Y + dst[:, None, None] + col, _qdq(x, sc[:, :, None]).to(tl.bfloat16), mask=m3)


@triton.jit
def _pow2(e):
    """Exact float32 2^e for integer e in [-127, 127]."""
    normal = ((tl.maximum(e, -126) + 127) << 23).to(tl.float32, bitcast=True)
    return tl.where(e < -126, 5.877471754111438e-39, normal)   # 2^-127


@triton.jit
def _mxfp4_kernel(V, Y, PERM, S, D: tl.constexpr, HAS_PERM: tl.constexpr, BLOCK_D: tl.constexpr):
    blk = tl.program_id(0)        # 32-token block within the sequence
    g = tl.program_id(1)          # head group b*H + h
    p = blk * 32 + tl.arange(0, 32)
    valid = p < S
    if HAS_PERM:
        src_s = tl.load(PERM + p, mask=valid, other=0)
    else:
        src_s = p
    for d0 in tl.static_range(0, D, BLOCK_D):
        dcol = d0 + tl.arange(0, BLOCK_D)
        src = (g * S + src_s).to(tl.int64) * D
        v = tl.load(V + src[:, None] + dcol[None, :], mask=valid[:, None], other=0.0).to(tl.float32)
        amax = tl.max(tl.abs(v), axis=0)                                  # (BLOCK_D,)
        bits = amax.to(tl.int32, bitcast=True)
        e = ((bits >> 23) & 0xFF) - 127                                   # floor(log2 amax), normals
        mid = 1.5 * _pow2(e)
        up = (amax > mid) | ((amax == mid) & ((e & 1) != 0))
        u = tl.minimum(tl.maximum(e + up.to(tl.int32) + 127, 0), 254)
        u = tl.where(amax <= 1e-38, 0, u)
        codes = _e2m1((6.0 * v) * _pow2(127 - u)[None, :])
        out = codes * _pow2(u - 127)[None, :]
        dst = (g * S + p).to(tl.int64) * D
        tl.store(Y + dst[:, None] + dcol[None, :], out.to(tl.bfloat16), mask=valid[:, None])


def nvfp4_qdq(x: torch.Tensor, layout: str, perm: torch.Tensor | None = None, div6: str = "exact") -> torch.Tensor:
    """Decoded NVFP4 of contiguous (B, H, S, D) x, BF16, rows optionally gathered by ``perm``.

    ``div6``: how ``amax / 6`` is rounded. "exact" (default) is SPEC's correctly rounded division, as
    ``fp4vis.formats`` computes it on every device; "recip" multiplies by float32(1/6) (kept to
    measure what that shortcut changes)."""
    b, h, s, d = x.shape
    y = torch.empty(x.shape, dtype=torch.bfloat16, device=x.device)
    n = b * h * s
    block_r = 16
    recip6 = div6 == "recip"
    _nvfp4_kernel[(triton.cdiv(n, block_r),)](x, y, perm if perm is not None else x, n, s, D=d,
                                              FOLDED=layout == "folded64_mse", HAS_PERM=perm is not None,
                                              BLOCK_R=block_r, RECIP6=recip6, enable_fp_fusion=False)
    return y


def mxfp4_v6(v: torch.Tensor, perm: torch.Tensor | None = None) -> torch.Tensor:
    """``alpha * c`` of MXFP4 V (contiguous (B, H, S, D)), BF16, keys optionally permuted."""
    b, h, s, d = v.shape
    y = torch.empty(v.shape, dtype=torch.bfloat16, device=v.device)
    grid = (triton.cdiv(s, 32), b * h)
    _mxfp4_kernel[grid](v, y, perm if perm is not None else v, s, D=d, HAS_PERM=perm is not None,
                        BLOCK_D=min(d, 64), enable_fp_fusion=False)
    return y
