"""Small PTX helpers of the Hopper kernel (CuTe DSL ``dsl_user_op``s): scalar and packed steps of
Direct-P with their exact semantics spelled out in PTX, so that no compiler rewrite can change a
rounding (docs/numerics.md sections 1-2 for what they compute; docs/hopper_kernel.md for why each
form is exact)."""

from __future__ import annotations

import math
import struct

from cutlass import Float32, Int32, Int64
from cutlass._mlir.dialects import llvm
from cutlass.cutlass_dsl import T, dsl_user_op

from fp4vis.backends.range_record import (
    CALL_AMAX,
    CALL_FLUSHED,
    CALL_LIMIT,
    CALL_UNDERFLOW,
    FIRST_CALL,
    SCALE_UNDERFLOW,
)
from fp4vis.scale_range import V_FLUSH_FRACTION

from .config import EIGHTHS_LOG2

LOG2_6 = math.log2(6.0)
LOG2_1P5 = math.log2(1.5)


def _f32_hex(x: float) -> str:
    bits = struct.unpack("<I", struct.pack("<f", x))[0]
    return f"0f{bits:08X}"


def _asm(ret, args, body: str, constraints: str, loc=None, ip=None):
    return llvm.inline_asm(ret, [a.ir_value(loc=loc, ip=ip) for a in args], body, constraints,
                           has_side_effects=False, is_align_stack=False,
                           asm_dialect=llvm.AsmDialect.AD_ATT)


@dsl_user_op
def e2m1_relu_round(y: Float32, *, loc=None, ip=None) -> Float32:
    """E2M1 round-to-nearest-even with saturation of ``max(y, 0)`` (docs/numerics.md section 1), as a float.

    For t in [2^e, 2^(e+1)) adding C = 2^(max(e, 0) + 22) rounds t (ties to even) to a multiple
    of 2^(max(e,0) - 1): step 0.5 below 2, 1 in [2, 4), 2 above: exactly the E2M1 grid; then
    saturate at 6. 7 instructions, no MUFU."""
    body = ("{ .reg .f32 t, r; .reg .b32 c;\n"
            "max.f32 t, $1, 0f00000000;\n"
            "and.b32 c, t, 0x7F800000;\n"
            "add.s32 c, c, 0x0B000000;\n"
            "max.s32 c, c, 0x4A800000;\n"
            "add.rn.f32 r, t, c;\n"
            "sub.rn.f32 r, r, c;\n"
            "min.f32 $0, r, 0f40C00000; }")
    return Float32(_asm(T.f32(), [Float32(y)], body, "=f,f", loc, ip))


@dsl_user_op
def e2m1_round_eighths(y8: Float32, *, loc=None, ip=None) -> Float32:
    """E2M1 RNE with saturation of ``8 * y8`` for y8 >= 0, returned divided by 8 (values q/8).

    The affine FMA produces y/8 with ``.sat`` (clamping to [0, 1] is the relu for free; y >= 8
    saturates to 1 and then to 6/8 here, as E2M1 saturates at 6). Same grid trick as
    ``e2m1_relu_round`` one binade-triple lower: 6 instructions, no MUFU."""
    body = ("{ .reg .f32 r; .reg .b32 c;\n"
            "and.b32 c, $1, 0x7F800000;\n"
            "add.s32 c, c, 0x0B000000;\n"
            "max.s32 c, c, 0x49000000;\n"
            "add.rn.f32 r, $1, c;\n"
            "sub.rn.f32 r, r, c;\n"
            "min.f32 $0, r, 0f3F400000; }")
    return Float32(_asm(T.f32(), [Float32(y8)], body, "=f,f", loc, ip))


@dsl_user_op
def fma_rn_sat(a: Float32, b: Float32, c: Float32, *, loc=None, ip=None) -> Float32:
    return Float32(_asm(T.f32(), [Float32(a), Float32(b), Float32(c)], "fma.rn.sat.f32 $0, $1, $2, $3;",
                        "=f,f,f,f", loc, ip))


@dsl_user_op
def ex2_approx(x: Float32, *, loc=None, ip=None) -> Float32:
    return Float32(_asm(T.f32(), [Float32(x)], "ex2.approx.ftz.f32 $0, $1;", "=f,f", loc, ip))


# 2^f on [-1/2, 1/2], degree 3: the minimax fit in relative error (Remez; tests/kernels/hopper/test_exp2_poly.py
# derives it), error <= 7.5e-5, far below E4M3's 2^-4 rounding of P
EXP2_POLY = (0.99992807, 0.69326099, 0.24261112, 0.05517167)


@dsl_user_op
def ex2_poly(x: Float32, *, loc=None, ip=None) -> Float32:
    """2^x on the FMA pipe (the exponential unit's work moved to the ALUs, as flash-attn-4 does on Blackwell):
    n = round(x) by the 1.5 * 2^23 addition, 2^(x - n) by ``EXP2_POLY``, n added to the exponent field. x is
    clamped at -120 first (max.NaN: a NaN stays NaN), so the result stays a normal float32; x <= 2^22."""
    c0, c1, c2, c3 = (_f32_hex(c) for c in EXP2_POLY)
    body = ("{ .reg .f32 y, r, n, f, p; .reg .b32 rb, pb;\n"
            "max.NaN.f32 y, $1, 0fC2F00000;\n"
            "add.rn.f32 r, y, 0f4B400000;\n"
            "sub.rn.f32 n, r, 0f4B400000;\n"
            "sub.rn.f32 f, y, n;\n"
            f"fma.rn.f32 p, f, {c3}, {c2};\n"
            f"fma.rn.f32 p, p, f, {c1};\n"
            f"fma.rn.f32 p, p, f, {c0};\n"
            "mov.b32 rb, r;\n shl.b32 rb, rb, 23;\n mov.b32 pb, p;\n add.s32 pb, pb, rb;\n mov.b32 $0, pb; }")
    return Float32(_asm(T.f32(), [Float32(x)], body, "=f,f", loc, ip))


@dsl_user_op
def fma_rn(a: Float32, b: Float32, c: Float32, *, loc=None, ip=None) -> Float32:
    return Float32(_asm(T.f32(), [Float32(a), Float32(b), Float32(c)], "fma.rn.f32 $0, $1, $2, $3;",
                        "=f,f,f,f", loc, ip))


@dsl_user_op
def fmax_nan(a: Float32, b: Float32, *, loc=None, ip=None) -> Float32:
    """max that propagates NaN (``max.NaN``; plain ``max`` returns the other operand): a NaN score
    from a non-finite input reaches the row's denominator (see ``direct_p``). Same cost as max."""
    return Float32(_asm(T.f32(), [Float32(a), Float32(b)], "max.NaN.f32 $0, $1, $2;", "=f,f,f", loc, ip))


@dsl_user_op
def mask_key(val: Float32, col: Int32, limit: Int32, *, loc=None, ip=None) -> Float32:
    """``val`` if col < limit else -inf."""
    body = "{ .reg .pred p; setp.lt.s32 p, $2, $3; selp.f32 $0, $1, 0fFF800000, p; }"
    return Float32(_asm(T.f32(), [Float32(val), Int32(col), Int32(limit)], body, "=f,f,r,r", loc, ip))


@dsl_user_op
def select_f32(flag: Int32, a: Float32, b: Float32, *, loc=None, ip=None) -> Float32:
    """``a`` if flag != 0 else ``b``."""
    body = "{ .reg .pred p; setp.ne.s32 p, $1, 0; selp.f32 $0, $2, $3, p; }"
    return Float32(_asm(T.f32(), [Int32(flag), Float32(a), Float32(b)], body, "=f,r,f,f", loc, ip))


@dsl_user_op
def quad_broadcast(x, src: int, *, loc=None, ip=None):
    """``x`` (Float32 or Int32) of thread ``src`` (0..3) of this thread's quad (lanes 4i..4i+3):
    shfl.sync.idx with 4-lane segments (c = segment mask 0x1C << 8 | clamp 3, which selects the same
    lanes as CUDA's width-4 value 0x1C1F)."""
    body = f"shfl.sync.idx.b32 $0, $1, {src}, 0x1C03, 0xFFFFFFFF;"
    if isinstance(x, Int32):
        return Int32(_asm(T.i32(), [x], body, "=r,r", loc, ip))
    return Float32(_asm(T.f32(), [Float32(x)], body, "=f,f", loc, ip))


@dsl_user_op
def select_by_lane(lane: Int32, xs: list, *, loc=None, ip=None) -> Float32:
    """``xs[lane]`` for lane in 0..3 (three selects: registers cannot be indexed at run time)."""
    body = ("{ .reg .pred p1, p2, p3; .reg .f32 t;\n"
            "setp.eq.s32 p1, $1, 1;\nsetp.eq.s32 p2, $1, 2;\nsetp.eq.s32 p3, $1, 3;\n"
            "selp.f32 t, $3, $2, p1;\nselp.f32 t, $4, t, p2;\nselp.f32 $0, $5, t, p3; }")
    return Float32(_asm(T.f32(), [Int32(lane)] + [Float32(x) for x in xs], body, "=f,r,f,f,f,f", loc, ip))


@dsl_user_op
def pow2_of_splat(a2: Int32, *, loc=None, ip=None) -> Float32:
    """alpha from ``bf16x2_splat_pow2(alpha)``: its high half is the power of two's float32 bits >> 16."""
    return Float32(_asm(T.f32(), [Int32(a2)], "and.b32 $0, $1, 0xFFFF0000;", "=f,r", loc, ip))


@dsl_user_op
def block_exponent(mx: Float32, m: Float32, s2: Float32, anchored: bool, unclamped: bool = False, *, loc=None,
                   ip=None) -> Int32:
    """u = clamp(floor((mx - m) * s + 1 - log2(1.5)) + 127, 0, 254) (docs/numerics.md section 2, steps 1-2).

    The floor is taken with a round-down add of 1.5 * 2^23, which puts floor(g) in the low mantissa
    bits for |g| < 2^22: no float-to-int conversion (16/clk/SM on Hopper). The bits are clamped
    from below before the subtraction: a sum below 2^23 (g < -2^22), a negative one (g below
    -1.5 * 2^23, where the signed bits would wrap) and -inf (an all-masked block) all give u = 0;
    g >= 2^22 and +inf give 254 — as cvt.rmi.sat did, for every non-NaN g. Without anchors m = 0
    and ``mx - m`` is skipped (exact: x - 0 = x). ``unclamped``: leave out the top clamp (the range
    record counts e > 254 before ``clamp_exponent`` applies it)."""
    g = "sub.rn.f32 g, $1, $2;\nmul.rn.f32 g, g, $3;\n" if anchored else "mul.rn.f32 g, $1, $3;\n"
    body = ("{ .reg .f32 g; .reg .s32 e;\n" + g +
            f"add.rn.f32 g, g, {_f32_hex(1.0 - LOG2_1P5)};\n"
            "add.rm.f32 g, g, 0f4B400000;\n"
            "mov.b32 e, g;\n"
            f"max.s32 e, e, {0x4B400000 - 127};\n"
            f"sub.s32 e, e, {0x4B400000 - 127};\n"
            + ("mov.s32 $0, e; }" if unclamped else "min.s32 $0, e, 254; }"))
    return Int32(_asm(T.i32(), [Float32(mx), Float32(m), Float32(s2)], body, "=r,f,f,f", loc, ip))


@dsl_user_op
def clamp_exponent(e: Int32, *, loc=None, ip=None) -> Int32:
    """u = min(e, 254): the top clamp of ``block_exponent(..., unclamped=True)``."""
    return Int32(_asm(T.i32(), [Int32(e)], "min.s32 $0, $1, 254;", "=r,r", loc, ip))


@dsl_user_op
def count_saturated(count: Int32, e: Int32, *, loc=None, ip=None) -> Int32:
    """count + 1 where the unclamped block exponent byte e exceeds 254 (a saturated P block: the
    reference's ``saturated_blocks``), else count."""
    body = "{ .reg .pred p; .reg .s32 t; setp.gt.s32 p, $2, 254; selp.s32 t, 1, 0, p; add.s32 $0, $1, t; }"
    return Int32(_asm(T.i32(), [Int32(count), Int32(e)], body, "=r,r,r", loc, ip))


@dsl_user_op
def count_zero_row(count: Int32, den: Float32, row: Int32, rows: Int32, lane: Int32, *, loc=None, ip=None) -> Int32:
    """count + 1 where the row's denominator is 0 (every probability underflowed), the row is one of
    the call's (row < rows) and this is lane 0 of the quad that shares the row, else count."""
    body = ("{ .reg .pred p, r; .reg .s32 t; setp.eq.f32 p, $2, 0f00000000; setp.lt.s32 r, $3, $4; and.pred p, p, r;\n"
            "setp.eq.s32 r, $5, 0; and.pred p, p, r; selp.s32 t, 1, 0, p; add.s32 $0, $1, t; }")
    return Int32(_asm(T.i32(), [Int32(count), Float32(den), Int32(row), Int32(rows), Int32(lane)], body,
                      "=r,r,f,r,r,r", loc, ip))


@dsl_user_op
def abs_max_nan(acc: Float32, x: Float32, *, loc=None, ip=None) -> Float32:
    """max(acc, |x|), NaN if either is NaN."""
    body = "{ .reg .f32 t; abs.f32 t, $2; max.NaN.f32 $0, $1, t; }"
    return Float32(_asm(T.f32(), [Float32(acc), Float32(x)], body, "=f,f,f", loc, ip))


@dsl_user_op
def not_below(x: Float32, limit: float, *, loc=None, ip=None) -> Int32:
    """1 where x is NaN or x >= limit (an unordered or greater-equal comparison), else 0."""
    body = f"{{ .reg .pred p; setp.geu.f32 p, $1, {_f32_hex(limit)}; selp.s32 $0, 1, 0, p; }}"
    return Int32(_asm(T.i32(), [Float32(x)], body, "=r,f", loc, ip))


@dsl_user_op
def record_range(record: Int64, flag: Int64, call: Int32, saturated: Int32, empty: Int32, nonfinite: Int32,
                 *, loc=None, ip=None) -> None:
    """Add one thread's counts to the range record (``fp4vis.backends.range_record``: int32 fields
    saturated blocks, empty rows, non-finite outputs at byte offsets 0, 4, 8, the first call's number
    at 12) and store the call's number into the host-visible flag, where any count is non-zero."""
    body = ("{ .reg .pred p; .reg .s32 t; .reg .u64 a;\n"
            "add.s32 t, $3, $4;\nadd.s32 t, t, $5;\nsetp.ne.s32 p, t, 0;\n"
            "@p red.global.add.s32 [$0], $3;\n"
            "add.u64 a, $0, 4;\n@p red.global.add.s32 [a], $4;\n"
            "add.u64 a, $0, 8;\n@p red.global.add.s32 [a], $5;\n"
            "add.u64 a, $0, 12;\n@p red.global.min.s32 [a], $2;\n"
            "@p st.volatile.global.s32 [$1], $2; }")
    args = [Int64(record), Int64(flag), Int32(call), Int32(saturated), Int32(empty), Int32(nonfinite)]
    llvm.inline_asm(None, [a.ir_value(loc=loc, ip=ip) for a in args], body, "l,l,r,r,r,r",
                    has_side_effects=True, is_align_stack=False, asm_dialect=llvm.AsmDialect.AD_ATT)


def _f64_hex(x: float) -> str:
    return f"0d{struct.unpack('<Q', struct.pack('<d', x))[0]:016X}"


def _decision_ptx() -> str:
    """PTX of ``decide_scale_range`` ($0 the record's address, $1 the flag's, $2 the call): the call words read and
    cleared (``atom.exch``), then per operand the criterion and, where it holds, the record's atomics."""
    def at(field: int) -> str:
        return f"[$0+{4 * field}]"
    take = [f"@live atom.global.exch.b32 {reg}, {at(field + i)}, 0;"
            for field, regs in ((CALL_UNDERFLOW, "n"), (CALL_FLUSHED, "f"), (CALL_AMAX, "a"))
            for i, reg in enumerate(r + str(j) for r in regs for j in range(3))]
    take.append(f"@live atom.global.exch.b32 lim, {at(CALL_LIMIT)}, 0;")
    body = ["{ .reg .pred live, p, c; .reg .s32 n0, n1, n2; .reg .f32 f0, f1, f2, a0, a1, a2, lim;",
            ".reg .f64 x, y, l;", "setp.gt.s32 live, $2, 0;", *take, "cvt.f64.f32 l, lim;"]
    for op, (flushed, amax) in enumerate((("f0", "a1"), ("f1", "a0"), ("f2", "a2"))):
        body += [f"cvt.f64.f32 x, {flushed};", f"cvt.f64.f32 y, {amax};"]
        if op < 2:    # q: q_flushed * k_amax > limit; k: k_flushed * q_amax > limit
            body += ["mul.rn.f64 x, x, y;", "setp.gt.f64 p, x, l;"]
        else:         # v: v_flushed > v_amax * V_FLUSH_FRACTION
            body += [f"mul.rn.f64 y, y, {_f64_hex(V_FLUSH_FRACTION)};", "setp.gt.f64 p, x, y;"]
        body += [f"setp.gt.s32 c, n{op}, 0;", "and.pred p, p, c;", "and.pred p, p, live;",
                 f"@p red.global.add.s32 {at(SCALE_UNDERFLOW + op)}, n{op};",
                 f"@p red.global.min.s32 {at(FIRST_CALL)}, $2;", "@p st.volatile.global.s32 [$1], $2;"]
    return "\n".join(body) + " }"


@dsl_user_op
def decide_scale_range(record: Int64, flag: Int64, call: Int32, *, loc=None, ip=None) -> None:
    """The PTX twin of ``kernels/scale_record.py``'s ``decide_scale_range``, for one thread of the call's attention
    kernel, which runs after the call's pre-pass in stream order: where ``call`` > 0, the pre-pass's underflows that
    can change the result (the same exact arithmetic: float32 maxima multiplied in float64 against the float32 q/k
    flush limit; v against its amax * 2^-24) added to the record with the call's number, the number stored into the
    flag, and every call word cleared; nothing where ``call`` is 0."""
    args = [Int64(record), Int64(flag), Int32(call)]
    llvm.inline_asm(None, [a.ir_value(loc=loc, ip=ip) for a in args], _decision_ptx(), "l,l,r",
                    has_side_effects=True, is_align_stack=False, asm_dialect=llvm.AsmDialect.AD_ATT)


@dsl_user_op
def block_constants(u: Int32, shift: int, aff_a: float, aff_b: float, eighths: bool, *, loc=None, ip=None):
    """From the block exponent u: (alpha', affine additive constant, native additive constant).

    ubar = max(u, L+1), ebar = ubar - 127; alpha' = 2^(ubar - L - 127) (never subnormal);
    x = (raw - m)*s + k with k = log2 6 - ebar; affine y = A*x + B = (A*s)*(raw - m) + (A*k + B).
    With ``eighths`` the codes are computed as q/8: alpha' carries the factor 8, the affine
    constant is (A*k + B)/8 (one FMA with A/8, B/8: identical to rounding A*k + B and dividing by
    8) and the native constant k - 3. ebar is made exactly in float from the bits of 2^23 + ubar
    (no int-to-float conversion). A block with u = 0 gets additive constants -inf (its codes are 0)."""
    ub = Int32(_asm(T.i32(), [Int32(u)], f"max.s32 $0, $1, {shift + 1};", "=r,r", loc, ip))
    sh = shift - (EIGHTHS_LOG2 if eighths else 0)
    alpha = Float32(_asm(T.f32(), [ub], "{ .reg .s32 t; sub.s32 t, $1, " + str(sh) + "; shl.b32 $0, t, 23; }",
                         "=f,r", loc, ip))
    kbody = ("{ .reg .f32 e; .reg .b32 t; .reg .pred p;\n"
             "add.s32 t, $2, 0x4B000000;\n"
             "mov.b32 e, t;\n"
             f"sub.rn.f32 e, e, {_f32_hex(2.0 ** 23 + 127)};\n"
             f"sub.rn.f32 e, {_f32_hex(LOG2_6)}, e;\n"
             "setp.eq.s32 p, $1, 0;\n"
             "selp.f32 $0, 0fFF800000, e, p; }")
    knat = Float32(_asm(T.f32(), [Int32(u), ub], kbody, "=f,r,r", loc, ip))
    ka, kb = (aff_a / 8.0, aff_b / 8.0) if eighths else (aff_a, aff_b)
    kaff = Float32(_asm(T.f32(), [knat], f"fma.rn.f32 $0, $1, {_f32_hex(ka)}, {_f32_hex(kb)};", "=f,f", loc, ip))
    if eighths:
        knat = knat - 3.0          # 2^(x - 3) = 2^x / 8; -inf stays -inf
    return alpha, kaff, knat


@dsl_user_op
def e2m1_grid_eighths(y8: Float32, fma_constant: bool = True, *, loc=None, ip=None) -> Float32:
    """``e2m1_round_eighths`` without the final saturation (8 * y8 = 8 rounds to 8/8; the packed P
    path saturates on BF16 pairs), for 0 <= y8 <= 1.

    ``fma_constant``: the rounding constant is C = 2^e * 2^22 + (2^19 - 2^16) for y8 in [2^e,
    2^(e+1)), one FFMA on the exponent bits instead of an integer add and max (which ptxas fuses
    into one ALU instruction): C lies in the binade [2^(e+22), 2^(e+23)) for e >= -3 (steps 2^(e-1))
    and in [2^19, 2^20) for -6 <= e <= -4 (step 1/16); below 2^-6, where C falls to [2^18, 2^19)
    (step 1/32), every y8 < 1/64 rounds to 0 either way; C is an even multiple of its step wherever a
    tie can occur, so ties go to even as E2M1 wants. Identical to the integer form for every float32
    in [0, 1] (checked exhaustively); not for +inf (gives NaN), so only for the affine codes. Same
    count (4 instructions), one fewer on the ALU pipe."""
    if fma_constant:
        c = f"fma.rn.f32 c, c, 0f4A800000, {_f32_hex(2.0 ** 19 - 2.0 ** 16)};\n"
    else:
        c = "add.s32 c, c, 0x0B000000;\nmax.s32 c, c, 0x49000000;\n"
    body = ("{ .reg .f32 r; .reg .b32 c;\n"
            "and.b32 c, $1, 0x7F800000;\n" + c +
            "add.rn.f32 r, $1, c;\n"
            "sub.rn.f32 $0, r, c; }")
    return Float32(_asm(T.f32(), [Float32(y8)], body, "=f,f", loc, ip))


@dsl_user_op
def pack_sat_bf16x2(lo: Float32, hi: Float32, *, loc=None, ip=None) -> Int32:
    """BF16 pair (lo in the low half) of two E2M1 grid values / 8 (exact in BF16), saturated at 6/8."""
    body = ("{ .reg .b32 p, c;\n"
            "cvt.rn.bf16x2.f32 p, $2, $1;\n"
            "mov.b32 c, 0x3F403F40;\n"
            "min.bf16x2 $0, p, c; }")
    return Int32(_asm(T.i32(), [Float32(lo), Float32(hi)], body, "=r,f,f", loc, ip))


@dsl_user_op
def e2m1_bf16x2_eighths(lo: Float32, hi: Float32, *, loc=None, ip=None) -> Int32:
    """``code_rounding="bf16"``: a pair of y/8 values rounded to BF16, then to the E2M1 grid / 8 on
    BF16x2 (the grid trick of ``e2m1_round_eighths`` with C = max(2^(e + 6), 8): BF16 has 7
    mantissa bits; y/8 <= 1 after ``fma.sat``, larger native values saturate all the same), and
    saturated at 6/8: 7 instructions per pair where the exact path takes 10."""
    body = ("{ .reg .b32 p, c, f, r;\n"
            "cvt.rn.bf16x2.f32 p, $2, $1;\n"
            "and.b32 c, p, 0x7F807F80;\n"
            "add.s32 c, c, 0x03000300;\n"
            "mov.b32 f, 0x41004100;\n"
            "max.bf16x2 c, c, f;\n"
            "add.rn.bf16x2 r, p, c;\n"
            "sub.rn.bf16x2 r, r, c;\n"
            "mov.b32 f, 0x3F403F40;\n"
            "min.bf16x2 $0, r, f; }")
    return Int32(_asm(T.i32(), [Float32(lo), Float32(hi)], body, "=r,f,f", loc, ip))


@dsl_user_op
def order_before_wait(xs: list, never: Int32, *, loc=None, ip=None) -> None:
    """Shared-memory stores of the floats ``xs`` predicated on ``never < 0`` (false at run time, unknown to
    ptxas), placed just before ``wgmma.wait_group``: ptxas keeps the wait after memory operations
    but otherwise hoists it as early as it can, which would put it before the work it is meant
    to overlap; ``xs`` depending on that work pins the wait behind it. Four floats per 128-bit store, the rest one
    per store."""
    n = len(xs)
    vec = [f"@p st.shared.v4.f32 [$0+{16 * g}], {{${1 + 4 * g}, ${2 + 4 * g}, ${3 + 4 * g}, ${4 + 4 * g}}};"
           for g in range(n // 4)]
    one = [f"@p st.shared.f32 [$0+{4 * i}], ${1 + i};" for i in range(n - n % 4, n)]
    body = "{ .reg .pred p; setp.lt.s32 p, $0, 0; " + " ".join(vec + one) + " }"
    llvm.inline_asm(None, [Int32(never).ir_value(loc=loc, ip=ip)] + [Float32(x).ir_value(loc=loc, ip=ip) for x in xs],
                    body, "r" + ",f" * n, has_side_effects=True, is_align_stack=False,
                    asm_dialect=llvm.AsmDialect.AD_ATT)


@dsl_user_op
def mul_bf16x2(a: Int32, b: Int32, *, loc=None, ip=None) -> Int32:
    return Int32(_asm(T.i32(), [Int32(a), Int32(b)], "mul.rn.bf16x2 $0, $1, $2;", "=r,r,r", loc, ip))


@dsl_user_op
def add_bf16x2(a: Int32, b: Int32, *, loc=None, ip=None) -> Int32:
    return Int32(_asm(T.i32(), [Int32(a), Int32(b)], "add.rn.bf16x2 $0, $1, $2;", "=r,r,r", loc, ip))


@dsl_user_op
def bf16x2_splat_pow2(alpha: Float32, *, loc=None, ip=None) -> Int32:
    """(alpha, alpha) as a BF16 pair, for a power of two alpha (its float32 bits >> 16 are exact)."""
    body = "{ .reg .b32 t; mov.b32 t, $1; shr.u32 t, t, 16; prmt.b32 $0, t, t, 0x1010; }"
    return Int32(_asm(T.i32(), [Float32(alpha)], body, "=r,f", loc, ip))


@dsl_user_op
def bf16x2_sum(p: Int32, *, loc=None, ip=None) -> Float32:
    """low + high half of a BF16 pair, in float32 (exact for the code sums it is used on)."""
    body = ("{ .reg .b32 lo, hi; .reg .f32 a, b;\n"
            "shl.b32 lo, $1, 16;\n"
            "and.b32 hi, $1, 0xFFFF0000;\n"
            "mov.b32 a, lo;\n"
            "mov.b32 b, hi;\n"
            "add.rn.f32 $0, a, b; }")
    return Float32(_asm(T.f32(), [Int32(p)], body, "=f,r", loc, ip))


@dsl_user_op
def e4m3x4(x0: Float32, x1: Float32, x2: Float32, x3: Float32, *, loc=None, ip=None) -> Int32:
    """Four float32 as E4M3 bytes 0..3 of a word (round to nearest even, saturating to finite; NaN stays NaN): the
    FP8 P/V kernel's P, four consecutive k slots of its A fragment. ``cvt...e4m3x2`` puts its first source in the
    upper byte."""
    body = ("{ .reg .b16 lo, hi;\n"
            "cvt.rn.satfinite.e4m3x2.f32 lo, $2, $1;\n"
            "cvt.rn.satfinite.e4m3x2.f32 hi, $4, $3;\n"
            "mov.b32 $0, {lo, hi}; }")
    return Int32(_asm(T.i32(), [Float32(x0), Float32(x1), Float32(x2), Float32(x3)], body, "=r,f,f,f,f", loc, ip))


@dsl_user_op
def defined_here(x: Int32, *, loc=None, ip=None) -> Int32:
    """``x``, copied by an instruction that stays where it is written (a volatile ``mov``): a value made before
    ``wgmma.wait_group`` and written into a WGMMA operand after it must not have its register defined earlier,
    while the WGMMA in flight still reads that register (ptxas would serialise every WGMMA of the kernel)."""
    return Int32(llvm.inline_asm(T.i32(), [Int32(x).ir_value(loc=loc, ip=ip)], "mov.b32 $0, $1;", "=r,r",
                                 has_side_effects=True, is_align_stack=False, asm_dialect=llvm.AsmDialect.AD_ATT))

