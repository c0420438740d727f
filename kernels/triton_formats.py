"""The formats of docs/numerics.md section 1 (and section 7's FP8 groups) as Triton device functions: the one
home of the format math that both kernel backends' pre-passes (and the Blackwell kernel's E2M1 codes) are built
from. ``fp4vis.formats`` is the PyTorch statement of the same values; the CPU tests run these functions through
Triton's interpreter and compare them with it bit for bit (``tests/kernels/test_triton_formats.py``, and every
pre-pass test).

Written for exactness on the GPU and under the interpreter alike: roundings are done on the float32 grid
(adding and subtracting a power of two) or from the bits, never by a conversion instruction whose rounding
the interpreter gets wrong (BF16 truncates, float8 ties, BF16 subnormals flush). They assume no FMA
contraction (the pre-passes compile with ``enable_fp_fusion=False``; the exact FMAs are written explicitly).

Two E2M1 encoders, one per kind of operand a pre-pass writes:

* decoded values (the Hopper pre-pass: BF16 ``c * sc``): ``e2m1_quotient`` rounds ``x / sc`` without a
  division. ``t = |x| * rcp(sc)`` is snapped to a multiple of 2^-12, then rounded to the E2M1 grid (ties to
  even). ``x`` is BF16 (8 significant bits) and ``b * sc`` (b an E2M1 midpoint, sc an E4M3 value) has at most
  7, so ``x / sc`` is either exactly a midpoint b or at least ``b * 2^-9`` away from it; ``t`` is within 2^-22
  relative of ``x / sc``, so the snap puts exact ties exactly on b and leaves everything else on its side. On
  the GPU the conversion of t to FP16 is the snap (an FP16 ulp at b is at most b * 2^-10) and the grid
  rounding runs on FP16 pairs (``e2m1_magnitude_f16``);
* codes (the Blackwell pre-pass: packed E2M1 nibbles): ``e2m1_codes`` counts the rounding boundaries below the
  correctly rounded quotient (``div_rn``): by the same argument it stays on its side of every boundary.
"""

from __future__ import annotations

import triton
import triton.language as tl

from fp4vis.formats import E4M3_MAX, FOLDED_MSE_MULTIPLIERS, FP8_GROUP_TOP_EXP, FP8_MIN_GROUP_EXP, MXFP4_ZERO_AMAX

# literals below (Triton's interpreter mishandles module constexprs in tensor arithmetic), checked here
assert E4M3_MAX == 448.0 and MXFP4_ZERO_AMAX == 1e-38
# folded_mse_multiplier computes these as k / 16; keep the two in step
assert FOLDED_MSE_MULTIPLIERS == (1.0, 0.25, 0.3125, 0.375, 0.4375, 0.5, 0.625, 0.75, 0.875, 1.0, 1.125, 1.25)

_FP8_TOP_EXP = tl.constexpr(FP8_GROUP_TOP_EXP)
_FP8_MIN_EXP = tl.constexpr(FP8_MIN_GROUP_EXP)
_E4M3_NAN = tl.constexpr(0x7F)


# ---------------------------------------------------------------------------------------------
# float32, BF16, powers of two
# ---------------------------------------------------------------------------------------------

@triton.jit
def exact_f32(x):
    """BF16 or FP16 x in float32, exactly. BF16 by moving its bits up 16 places, which is what the
    GPU's conversion does; Triton's interpreter flushes BF16 subnormals to 0 instead."""
    if x.dtype == tl.bfloat16:
        return (x.to(tl.uint16, bitcast=True).to(tl.uint32) << 16).to(tl.float32, bitcast=True)
    else:
        return x.to(tl.float32)


@triton.jit
def bf16_round(x):
    """float32 x rounded to the nearest BF16 value (ties to even), kept in float32; exact integer arithmetic,
    the same on the GPU as cvt.rn.bf16.f32 and under Triton's interpreter (whose conversion truncates)."""
    bits = x.to(tl.int32, bitcast=True)
    bits = (bits + 0x7FFF + ((bits >> 16) & 1)) & -65536
    return bits.to(tl.float32, bitcast=True)


@triton.jit
def bf16_exact(x):
    """float32 x that is a BF16 value (NaN included) -> BF16 by dropping its low 16 bits, exactly as
    the GPU's rounding conversion would give it; Triton's interpreter flushes BF16 subnormals."""
    return (x.to(tl.uint32, bitcast=True) >> 16).to(tl.uint16).to(tl.bfloat16, bitcast=True)


@triton.jit
def pow2(e):
    """Exact float32 2^e for integer e in [-127, 127] (``fp4vis.formats.pow2``)."""
    normal = ((tl.maximum(e, -126) + 127) << 23).to(tl.float32, bitcast=True)
    return tl.where(e < -126, 5.877471754111438e-39, normal)   # 2^-127


@triton.jit
def round_pow2_grid(mag, min_exp_plus: tl.constexpr, floor_bits: tl.constexpr):
    """RNE of mag >= 0 to a grid whose ulp is 2^(exp(mag) - mantissa) with a subnormal floor:
    add C = max(2^(e + 23 - mantissa), floor) and subtract it again (both exact)."""
    bits = mag.to(tl.int32, bitcast=True)
    c = (bits & 0x7F800000) + min_exp_plus
    c = tl.maximum(c, floor_bits)
    cf = c.to(tl.float32, bitcast=True)
    return (mag + cf) - cf


@triton.jit
def with_sign_of(mag, x):
    """copysign(mag, x) for mag >= 0 on the bits: a negative x whose magnitude rounds to 0 gives -0,
    as torch.copysign in fp4vis.formats does."""
    sign = x.to(tl.int32, bitcast=True) & -2147483648
    return (mag.to(tl.int32, bitcast=True) | sign).to(tl.float32, bitcast=True)


@triton.jit
def nan_if_not_finite(out, mag):
    """NaN where the input magnitude is NaN or Inf: the attention kernel then propagates it to
    the output (as SDPA does) instead of quantizing it to a finite code."""
    return tl.where(mag < float("inf"), out, float("nan"))


# ---------------------------------------------------------------------------------------------
# E4M3
# ---------------------------------------------------------------------------------------------

@triton.jit
def e4m3_round(mag):
    """E4M3 RNE with saturation of mag >= 0 (the values of ``fp4vis.formats.e4m3_round``): rounded on the
    float32 grid (3 mantissa bits, min exponent -6: the subnormal grid 2^-9), exact, and independent of the
    conversion instruction (Triton's interpreter mis-rounds float8 ties). Inf, and (minimum ignoring NaN)
    NaN, give 448."""
    r = round_pow2_grid(mag, 20 << 23, (127 - 6 + 20) << 23)
    return tl.minimum(r, 448.0)


@triton.jit
def e4m3_byte(v):
    """The E4M3 bit pattern (int32 0..126) of an E4M3 value v >= 0 (``e4m3_round``'s output)."""
    bits = v.to(tl.int32, bitcast=True)
    ef = (bits >> 23) & 0xFF
    normal = (((ef - 120) << 3) | ((bits >> 20) & 7))
    return tl.where(ef >= 121, normal, (v * 512.0).to(tl.int32))    # subnormals: multiples of 2^-9


@triton.jit
def folded_mse_multiplier(i):
    """FOLDED_MSE_MULTIPLIERS[i] for i in 1..11 (a runtime integer or a constexpr; candidate 0 is m = 1.0): k / 16
    with k = 4, 5, 6, 7, 8, 10, 12, 14, 16, 18, 20 (exact, so base * m rounds as with the constant)."""
    k = tl.where(i <= 5, i + 3, 2 * i - 2)
    return k.to(tl.float32) * 0.0625


# ---------------------------------------------------------------------------------------------
# E2M1
# ---------------------------------------------------------------------------------------------

@triton.jit
def e2m1_magnitude(t):
    """E2M1 RNE magnitude with saturation of t >= 0."""
    r = round_pow2_grid(t, 22 << 23, 149 << 23)  # 1 mantissa bit, min normal exp 0
    return tl.minimum(r, 6.0)


@triton.jit
def e2m1_round(x):
    """E2M1 RNE with saturation, sign copied (fp4vis.formats.e2m1_round, -0 included)."""
    return with_sign_of(e2m1_magnitude(tl.abs(x)), x)


@triton.jit
def scale_reciprocal(sc, APPROX: tl.constexpr = False):
    """1 / sc, 0 for sc == 0: correctly rounded (a division, about ten instructions), or APPROX the GPU's
    ``rcp.approx`` (one instruction, within 1 ulp: t = |x| * rcp(sc) stays within 2^-22 relative of |x| / sc, all
    ``e2m1_quotient`` needs; sc is an E4M3 value, never a float32 subnormal). APPROX is for the GPU only (inline
    PTX: Triton's interpreter cannot run it)."""
    if APPROX:
        r = tl.inline_asm_elementwise(asm="rcp.approx.ftz.f32 $0, $1;", constraints="=f,f", args=[sc],
                                      dtype=tl.float32, is_pure=True, pack=1)
        return tl.where(sc == 0.0, 0.0, r)
    return tl.where(sc == 0.0, 0.0, tl.math.div_rn(1.0, tl.where(sc == 0.0, 1.0, sc)))


@triton.jit
def e2m1_quotient(ax, r, CODES_F16: tl.constexpr):
    """E2M1 magnitude of ax / sc given r = ``scale_reciprocal(sc)`` (r = 0 for sc = 0): exact, see the module
    doc. CODES_F16: ``e2m1_magnitude_f16`` on pairs (the snap is the conversion to FP16). Otherwise
    (t + 2048) - 2048 rounds t < 2048 to a multiple of 2^-12 (larger t saturate anyway), then ``e2m1_magnitude``."""
    t = ax * r
    if CODES_F16:
        return e2m1_magnitude_f16(t)
    t = (t + 2048.0) - 2048.0
    return e2m1_magnitude(t)


@triton.jit
def e2m1_magnitude_f16(t):
    """``e2m1_magnitude`` of the snapped t for float32 t = ax * rcp(sc) >= 0 (unsnapped: the conversion to
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
    ``e2m1_magnitude`` does (min returns the non-NaN operand). ``fp4vis.formats`` states the same
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
def with_scale_sign(mag, x, sc):
    """mag with the sign of x (copysign, so -0 for a negative x whose code is 0), +0 where sc == 0
    (as fp4vis.formats: a zero scale gives +0 codes)."""
    sign = x.to(tl.int32, bitcast=True) & -2147483648
    sign = tl.where(sc > 0.0, sign, 0)
    return (mag.to(tl.int32, bitcast=True) | sign).to(tl.float32, bitcast=True)


@triton.jit
def e2m1_index(y):
    """E2M1 magnitude index (0..7) of E2M1_rne_sat(max(0, y)) (docs/numerics.md section 1), by counting the
    rounding boundaries below y: ties go to the even index (down at 0.25, 1.25, 2.5, 5; up at 0.75,
    1.75, 3.5). -inf and NaN give 0. The exact emulation for archs without the cvt instruction."""
    return ((y > 0.25).to(tl.int32) + (y >= 0.75).to(tl.int32) + (y > 1.25).to(tl.int32)
            + (y >= 1.75).to(tl.int32) + (y > 2.5).to(tl.int32) + (y >= 3.5).to(tl.int32)
            + (y > 5.0).to(tl.int32))


@triton.jit
def e2m1_value(idx):
    """The magnitude {0, .5, 1, 1.5, 2, 3, 4, 6} of an E2M1 index 0..7 (float32, exact)."""
    f = idx.to(tl.float32)
    return tl.where(idx < 4, f * 0.5, tl.where(idx == 7, 6.0, f - 2.0))


@triton.jit
def e2m1_codes(x, sc):
    """Signed E2M1 codes (int32, sign bit 3) of x / sc for BF16 values x and E4M3 scales sc (exact: the
    module doc); sc = 0 gives +0 codes."""
    safe = tl.where(sc == 0.0, 1.0, sc)
    idx = e2m1_index(tl.abs(tl.math.div_rn(x, safe)))
    sign = ((x.to(tl.int32, bitcast=True) >> 31) & 1) << 3
    return tl.where(sc == 0.0, 0, idx | sign)


@triton.jit
def pairs(x):
    """(even, odd) elements along the last dimension of x (its size even)."""
    return tl.split(tl.reshape(x, x.shape[:-1] + [x.shape[-1] // 2, 2]))


@triton.jit
def interleaved(even, odd):
    """The inverse of ``pairs``."""
    j = tl.join(even, odd)
    return tl.reshape(j, j.shape[:-2] + [j.shape[-2] * 2])


@triton.jit
def packed_e2m1_pairs(codes):
    """Two 4-bit codes per byte along the last dimension, the even element in the low nibble
    (``fp4vis.formats.pack_fp4``), as int32."""
    lo, hi = pairs(codes)
    return lo | (hi << 4)


# ---------------------------------------------------------------------------------------------
# MXFP4 and FP8 group scales
# ---------------------------------------------------------------------------------------------

@triton.jit
def mxfp4_scale_exponent(amax):
    """The E8M0 byte u (int32 0..254) of MXFP4 block maxima amax (``fp4vis.formats.e8m0_nearest_pow2``): the
    power of two nearest to amax, e + 1 where amax > 1.5 * 2^e (e = floor(log2 amax)) or equal to it with e odd;
    a subnormal amax above the zero threshold rounds up to 2^-126 (u = 1), amax <= 1e-38 (MXFP4_ZERO_AMAX) gives
    0, Inf and NaN 254."""
    bits = amax.to(tl.int32, bitcast=True)
    e = ((bits >> 23) & 0xFF) - 127                                   # floor(log2 amax), normals
    mid = 1.5 * pow2(e)
    up = (amax > mid) | ((amax == mid) & ((e & 1) != 0))
    u = tl.minimum(tl.maximum(e + up.to(tl.int32) + 127, 0), 254)
    return tl.where(amax <= 1e-38, 0, u)


@triton.jit
def fp8_group_exponent(amax):
    """fp4vis.formats.fp8_group_exponent: E = max(floor(log2 amax) - 7, -126) off the float32
    exponent field (amax >= 0), so that the group maximum scales into [2^7, 2^8); 0 for an all-zero group."""
    field = (amax.to(tl.int32, bitcast=True) >> 23) & 0xFF
    return tl.where(amax == 0.0, 0, tl.maximum(field - 127 - _FP8_TOP_EXP, _FP8_MIN_EXP))


@triton.jit
def fp8_e4m3(x, e):
    """E4M3 (float8e4nv) of x * 2^-e. The scaling by a power of two is exact (whatever it pushes
    below float32's normal range is far below E4M3's smallest subnormal, 2^-9, and rounds to a
    signed 0 either way) and ``e4m3_round`` rounds in float32 (|x| 2^-e < 2^8: no saturation), so the
    conversion of an exact E4M3 value is exact whatever rounding it uses. NaN (0x7F) where x is
    NaN or Inf, set on the byte: the GPU's conversion gives it too, Triton's interpreter does not."""
    ax = tl.abs(x)
    byte = with_sign_of(e4m3_round(ax * pow2(-e)), x).to(tl.float8e4nv).to(tl.uint8, bitcast=True)
    nan = tl.full(byte.shape, _E4M3_NAN, tl.uint8)
    return tl.where(ax < float("inf"), byte, nan).to(tl.float8e4nv, bitcast=True)
