"""The Direct-P forward (docs/numerics.md section 2) as one Triton source on the block-scaled FP4 MMAs.

Per program: BLOCK_M query rows of one (batch, head). Q·Kᵀ is ``tl.dot_scaled`` on NVFP4 operands
(E2M1 codes, E4M3 scale per 16 along D), the P codes and their E8M0 block scales α' are computed
in registers from the scores, and P·V is ``tl.dot_scaled`` on MXFP4 operands (P codes with α' per
row per 32 keys as the A scale; V codes with an E8M0 scale per column per 32 tokens as the B
scale). The denominator comes from the same codes and scales (docs/numerics.md section 2, step 7): a second
block-scaled MMA of P against a block of 1.0 codes.

Lowering (Triton >= 3.8): sm_100a/sm_103a ``tcgen05.mma ... kind::mxf4nvf4.block_scale`` /
``kind::mxf4.block_scale``; sm_120a ``mma.sync ... kind::mxf4nvf4.block_scale``; sm_90a an exact
upcast of the FP4 operands to BF16 + wgmma (the H200 verification build: docs/blackwell_kernel.md).

Operand layouts (all contiguous; G = B*H; the pre-pass ``prepass.py`` writes them):
  QC (G, SQP, D/2) u8 E2M1 pairs along D      QS (G, SQP, D/16) E4M3
  KC (G, SKP, D/2) u8 E2M1 pairs along D      KS (G, SKP, D/16) E4M3
  VC (G, D, SKP/2) u8 E2M1 pairs along tokens VS (G, D, SKP/32) E8M0
  OUT (G, SQ, D) bf16/fp16
SQP / SKP are Sq / Skv padded to whole tiles with zero codes; keys >= NUM_KEYS are masked.

The range record (``fp4vis.backends.range_record``; docs/numerics.md section 8), as the Hopper kernel
keeps it: each program counts its saturated (row, block) pairs (e + 127 > 254), its empty rows of SQ
and its outputs of rows of SQ that are NaN or Inf in the output dtype; where CALL > 0 and a count is
not zero it adds them to REC (int32: saturated, empty, non-finite, first call as a minimum) and stores
CALL into FLAG (pinned host memory). CALL = 0 records nothing (REC and FLAG may be any int32 memory).
Program (0, 0) also decides on the underflows the call's pre-pass left in the record, which it finished before
this launch in stream order (``kernels/scale_record.py``: ``decide_scale_range``).
"""

from __future__ import annotations

import triton
import triton.language as tl

from fp4vis.formats import OVERFLOW_BF16, OVERFLOW_FP16

from ..scale_record import decide_scale_range
from ..triton_formats import e2m1_index, e2m1_value
from .config import E8M0_BIAS, KEY_BLOCK, LOG2_1P5, LOG2_6, MAX_EXP_BYTE, NVFP4_BLOCK
from .ptx import E2M1X2, FMA_F32X2

_E2M1X2_ASM, _E2M1X2_CONSTRAINTS = tl.constexpr(E2M1X2[0]), tl.constexpr(E2M1X2[1])
_FMA_X2_ASM, _FMA_X2_CONSTRAINTS = tl.constexpr(FMA_F32X2[0]), tl.constexpr(FMA_F32X2[1])
_KEY_BLOCK = tl.constexpr(KEY_BLOCK)
_SF16 = tl.constexpr(NVFP4_BLOCK)
_BIAS = tl.constexpr(E8M0_BIAS)
_MAX_U = tl.constexpr(MAX_EXP_BYTE)
_LOG2_6 = tl.constexpr(LOG2_6)
_ONE_MINUS_LOG2_1P5 = tl.constexpr(1.0 - LOG2_1P5)
_DEN_N = tl.constexpr(16)   # columns of the denominator MMA (the smallest N the FP4 MMAs take)
_OVERFLOW_FP16 = tl.constexpr(OVERFLOW_FP16)   # fp4vis.formats: magnitudes that round to Inf in FP16
_OVERFLOW_BF16 = tl.constexpr(OVERFLOW_BF16)


# ---------------------------------------------------------------------------------------------
# device helpers
# ---------------------------------------------------------------------------------------------

@triton.jit
def _e2m1x2_hw(lo, hi):
    """One byte of two E2M1 codes (lo in the low nibble) of relu(lo), relu(hi), by the hardware
    conversion ``cvt.rn.satfinite.relu.e2m1x2.f32`` (``ptx.E2M1X2``: four pairs per call into one 32-bit
    register), which defines docs/numerics.md section 1's rounding."""
    return tl.inline_asm_elementwise(_E2M1X2_ASM, _E2M1X2_CONSTRAINTS, [lo, hi], dtype=tl.uint8, is_pure=True, pack=4)


@triton.jit
def _fma_x2(a, b, c):
    """a·b + c, two lanes per ``fma.rn.f32x2`` (sm_100a on; ``ptx.FMA_F32X2``): each lane is ``fma.rn.f32``'s one
    rounding, so the bits are ``tl.fma``'s."""
    return tl.inline_asm_elementwise(_FMA_X2_ASM, _FMA_X2_CONSTRAINTS, [a, b, c], dtype=tl.float32, is_pure=True,
                                     pack=2)


@triton.jit
def _native_mask(keys):
    """docs/numerics.md section 2 native exp2 positions of physical key indices: b = j // 32, quarter = b % 4,
    pair = (j % 32) // 2; native when pair is quarter, quarter + 8, 4 or 12."""
    quarter = (keys // 32) % 4
    pair = (keys % 32) // 2
    return (pair == quarter) | (pair == quarter + 8) | (pair == 4) | (pair == 12)


@triton.jit
def _decode_nvfp4(packed, scales, R: tl.constexpr, C: tl.constexpr):
    """Float32 values (R, C) of packed E2M1 pairs (R, C/2) times their E4M3 scales (R, C/16)."""
    lo = (packed & 15).to(tl.int32)
    hi = (packed >> 4).to(tl.int32)
    vlo = tl.where((lo & 8) != 0, -1.0, 1.0) * e2m1_value(lo & 7)
    vhi = tl.where((hi & 8) != 0, -1.0, 1.0) * e2m1_value(hi & 7)
    vals = tl.reshape(tl.join(vlo, vhi), (R, C))
    sc = tl.broadcast_to(scales.to(tl.float32)[:, :, None], (R, C // 16, 16))
    return vals * tl.reshape(sc, (R, C))


@triton.jit
def _qk_scores(q, qs, kc_ptr, ks_ptr, kbase, ksbase, j0, SKP, zero,
               D: tl.constexpr, BLOCK_N: tl.constexpr, QK_DECODE: tl.constexpr):
    """raw = Q̂ K̂ᵀ (float32, no softmax scale) of the query tile against keys j0..j0+BLOCK_N:
    tl.dot_scaled on NVFP4 operands. K codes are read as the (D/2, BLOCK_N) B operand (packed
    along D, the reduction dim), its scales as (BLOCK_N, D/16). ``zero`` is a runtime 0.0: Triton
    3.8's sm_100 pipeline fails (TritonGPUOptimizeAccumulatorInit, "uninitialized alloc must have a
    mutable memdesc type") on a constant-zero accumulator of a scaled MMA inside a loop; a splat of
    a runtime zero compiles (one TMEM store of the tile per step; docs/blackwell_kernel.md)."""
    on = j0 + tl.arange(0, BLOCK_N)
    odp = tl.arange(0, D // 2)
    ods = tl.arange(0, D // _SF16)
    ks = tl.load(ks_ptr + ksbase + on[:, None] * (D // _SF16) + ods[None, :])
    if QK_DECODE:
        # test build for Triton's CPU interpreter, which decodes NVFP4 scales as E8M0: the same
        # codes and scales decoded in registers (exact in float32), then a plain dot
        kk = tl.load(kc_ptr + kbase + on[:, None] * (D // 2) + odp[None, :])
        qd = _decode_nvfp4(q, qs, q.shape[0], D)
        kd = _decode_nvfp4(kk, ks, BLOCK_N, D)
        return tl.dot(qd, tl.trans(kd), input_precision="ieee")
    kt = tl.load(kc_ptr + kbase + on[None, :] * (D // 2) + odp[:, None])
    acc = tl.full((q.shape[0], BLOCK_N), zero, tl.float32)
    return tl.dot_scaled(q, qs, "e2m1", kt, ks, "e2m1", acc)


@triton.jit
def _direct_p(raw, keys, m, s_log2, affine_a, affine_b, shift, NUM_KEYS,
              BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, ANCHORED: tl.constexpr, NATIVE: tl.constexpr,
              HW_CVT: tl.constexpr, FMA_X2: tl.constexpr, MASK: tl.constexpr):
    """docs/numerics.md section 2 steps 1-6 for one (BLOCK_M, BLOCK_N) score tile: returns the packed P codes
    (BLOCK_M, BLOCK_N/2) u8, their E8M0 scale bytes α' (BLOCK_M, BLOCK_N/32) u8 and which blocks saturated
    (e + 127 > 254, before the clamp: the range record), (BLOCK_M, BLOCK_N/32) int32 0/1. (Step 7's
    denominator is a second block-scaled MMA of the same codes and scales: see the kernel.)

    Float32 in the reference's order: d = raw - m first (the reference subtracts m before scaling),
    g = max_B(d)·s, and the code argument as one FMA, y = d·(A s) + (A k + B) with k = log2 6 - ē
    (native: 2^(d·s + k)): one rounding of the float64 reference's value, so codes differ from it
    only where y lies within an ulp of an E2M1 midpoint."""
    NB: tl.constexpr = BLOCK_N // 32
    if ANCHORED:
        d = raw - m[:, None]
    else:
        d = raw                                                      # m = 0: exact, skipped
    # masked keys are -inf: they drop out of the block max and give code 0 on both paths. MASK: "none" (a tile
    # wholly below the last key), "keys" (the tile past it), "test" (either: decided at run time)
    if MASK == "keys":
        d = tl.where((keys < NUM_KEYS)[None, :], d, float("-inf"))
    elif MASK == "test":
        if tl.max(keys) >= NUM_KEYS:
            d = tl.where((keys < NUM_KEYS)[None, :], d, float("-inf"))
    d3 = tl.reshape(d, (BLOCK_M, NB, 32))
    g = tl.max(d3, axis=2) * s_log2                                  # step 1 (s > 0)
    e = tl.floor(g + _ONE_MINUS_LOG2_1P5)                            # step 2 (-inf for empty blocks)
    u = tl.minimum(tl.maximum(e + _BIAS, 0.0), _MAX_U * 1.0)
    ub = tl.maximum(u, (shift + 1) * 1.0)                            # step 3: working exponent
    # step 4's constant k = log2(6) - e_bar; blocks with u = 0 give q = 0 (k = -inf)
    k = tl.where(u == 0.0, float("-inf"), _LOG2_6 - (ub - _BIAS))
    kaff = affine_a * k + affine_b
    a_s = affine_a * s_log2
    if FMA_X2:
        y3 = _fma_x2(d3, tl.full(d3.shape, a_s, tl.float32), tl.broadcast_to(kaff[:, :, None], d3.shape))
    else:
        y3 = tl.fma(d3, a_s, kaff[:, :, None])                       # step 5, affine positions
    if NATIVE:
        yn = tl.exp2(tl.fma(d3, s_log2, k[:, :, None]))              # step 5, native positions
        # the pattern repeats every 4 blocks (quarter = block % 4): with whole 128-key tiles it is
        # the same for every tile, a loop invariant
        if BLOCK_N % 128 == 0:
            nat = tl.reshape(_native_mask(tl.arange(0, BLOCK_N)), (1, NB, 32))
        else:
            nat = tl.reshape(_native_mask(keys), (1, NB, 32))
        y3 = tl.where(nat, yn, y3)
    y_lo, y_hi = tl.split(tl.reshape(y3, (BLOCK_M, BLOCK_N // 2, 2)))
    if HW_CVT:
        packed = _e2m1x2_hw(y_lo, y_hi).to(tl.int32)
    else:
        packed = e2m1_index(y_lo) | (e2m1_index(y_hi) << 4)
    sbyte = (ub - shift).to(tl.int32)                                # step 6: >= 1, never subnormal
    saturated = (e + _BIAS > _MAX_U * 1.0).to(tl.int32)
    return packed.to(tl.uint8), sbyte.to(tl.uint8), saturated


@triton.jit
def _key_tile(q, qs, KC, KS, VC, VS, kbase, ksbase, vbase, vsbase, j0, SKP, NUM_KEYS, zero, m, rows,
              s_log2, affine_a, affine_b, shift, acc, den_acc, sat_blocks, n_sat,
              D: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, ANCHORED: tl.constexpr,
              NATIVE: tl.constexpr, HW_CVT: tl.constexpr, QK_DECODE: tl.constexpr, REGISTER_LEAN: tl.constexpr,
              FMA_X2: tl.constexpr, MASK: tl.constexpr):
    """One key tile j0..j0+BLOCK_N of the main loop: Q·Kᵀ, Direct-P, the denominator and P·V MMAs; returns the
    updated accumulators and saturation counts (MASK: see _direct_p)."""
    od = tl.arange(0, D)
    otp = tl.arange(0, BLOCK_N // 2)
    ots = tl.arange(0, BLOCK_N // _KEY_BLOCK)
    # E2M1 code 2 is 1.0; E8M0 127 is 2^0
    ones = tl.full((BLOCK_N // 2, _DEN_N), 0x22, tl.uint8)
    ones_s = tl.full((_DEN_N, BLOCK_N // 32), 127, tl.uint8)
    v_row = tl.multiple_of(SKP // 2, BLOCK_N // 2)
    vs_row = tl.multiple_of(SKP // 32, BLOCK_N // 32)
    raw = _qk_scores(q, qs, KC, KS, kbase, ksbase, j0, SKP, zero, D, BLOCK_N, QK_DECODE)
    keys = j0 + tl.arange(0, BLOCK_N)
    p, ps, sat = _direct_p(raw, keys, m, s_log2, affine_a, affine_b, shift, NUM_KEYS,
                           BLOCK_M, BLOCK_N, ANCHORED, NATIVE, HW_CVT, FMA_X2, MASK)
    if REGISTER_LEAN:
        n_sat += tl.sum(tl.where(rows, tl.sum(sat, axis=1), 0))
    else:
        sat_blocks += tl.where(rows[:, None], sat, 0)
    # step 7 on the tensor cores: l = Σ_B α'_B Σ_j q_j = (P codes with α') x (a column of 1.0s),
    # the same codes and scales P·V consumes; every column of den_acc is l (exact products,
    # float32 sums)
    den_acc = tl.dot_scaled(p, ps, "e2m1", ones, ones_s, "e2m1", den_acc)
    # V as the (BLOCK_N/2, D) B operand (packed along tokens), its scales as (D, BLOCK_N/32)
    if REGISTER_LEAN:   # byte-wide loads (Triton sees no alignment): fewer registers in flight
        v = tl.load(VC + vbase + od[None, :] * (SKP // 2) + (j0 // 2 + otp)[:, None])
        vs = tl.load(VS + vsbase + od[:, None] * (SKP // 32) + (j0 // 32 + ots)[None, :])
    else:
        v = tl.load(VC + vbase + od[None, :] * v_row + tl.multiple_of(j0 // 2, BLOCK_N // 2) + otp[:, None])
        vs = tl.load(VS + vsbase + od[:, None] * vs_row + tl.multiple_of(j0 // 32, BLOCK_N // 32) + ots[None, :])
    acc = tl.dot_scaled(p, ps, "e2m1", v, vs, "e2m1", acc)

    return acc, den_acc, sat_blocks, n_sat


# ---------------------------------------------------------------------------------------------
# the kernel
# ---------------------------------------------------------------------------------------------

@triton.jit
def direct_p_fwd(QC, QS, KC, KS, VC, VS, OUT, REC, FLAG, KEY_LENS,
                 SQ, SQP, SKP, NUM_KEYS, N_ANCHOR, HEADS, s_log2, margin_raw, affine_a, affine_b, shift, CALL,
                 D: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, NATIVE: tl.constexpr,
                 ANCHORED: tl.constexpr, HW_CVT: tl.constexpr, QK_DECODE: tl.constexpr, KEY_LENGTHS: tl.constexpr,
                 REGISTER_LEAN: tl.constexpr, FMA_X2: tl.constexpr):
    pid_m = tl.program_id(0)
    pid_g = tl.program_id(1).to(tl.int64)
    key_end = SKP
    if KEY_LENGTHS:   # a key-masked call: this batch element's kept keys, gathered first (kernels/kept_keys.py)
        NUM_KEYS = tl.load(KEY_LENS + pid_g // HEADS)
        N_ANCHOR = tl.minimum(N_ANCHOR, NUM_KEYS)
        key_end = tl.cdiv(NUM_KEYS, BLOCK_N) * BLOCK_N
    om = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    odp = tl.arange(0, D // 2)
    ods = tl.arange(0, D // _SF16)
    od = tl.arange(0, D)
    qbase = pid_g * SQP * (D // 2)
    kbase = pid_g * SKP * (D // 2)
    ksbase = pid_g * SKP * (D // _SF16)
    # the pre-pass pads the keys to whole tiles, so V's rows (SKP/2 bytes) start 16-byte aligned and its codes
    # load in 16-byte vectors, its scales in 4-byte words (Triton cannot know this of an int argument)
    v_row = tl.multiple_of(SKP // 2, BLOCK_N // 2)
    vbase = pid_g * D * v_row
    vs_row = tl.multiple_of(SKP // 32, BLOCK_N // 32)
    vsbase = pid_g * D * vs_row
    zero = s_log2 * 0.0   # s_log2 is finite: a runtime zero (see _qk_scores)
    q = tl.load(QC + qbase + om[:, None] * (D // 2) + odp[None, :])
    qs = tl.load(QS + pid_g * SQP * (D // _SF16) + om[:, None] * (D // _SF16) + ods[None, :])

    # the fixed row reference (docs/numerics.md sections 2, 4): m = 0, or anchor max + margin over the first
    # N_ANCHOR physical keys (the pre-pass put the samples there)
    if ANCHORED:
        amax = tl.full((BLOCK_M,), float("-inf"), tl.float32)
        for j0 in range(0, N_ANCHOR, BLOCK_N):
            raw = _qk_scores(q, qs, KC, KS, kbase, ksbase, j0, SKP, zero, D, BLOCK_N, QK_DECODE)
            keys = j0 + tl.arange(0, BLOCK_N)
            raw = tl.where((keys < N_ANCHOR)[None, :], raw, float("-inf"))
            amax = tl.maximum(amax, tl.max(raw, axis=1))
        m = amax + margin_raw
    else:
        m = tl.zeros((BLOCK_M,), tl.float32)

    acc = tl.zeros((BLOCK_M, D), tl.float32)
    den_acc = tl.zeros((BLOCK_M, _DEN_N), tl.float32)
    rows = om < SQ
    # saturated blocks, counted where each thread holds them and summed across the tile once, after the loop (a
    # REGISTER_LEAN build sums them per tile into one scalar instead: no registers, a CTA reduction per tile)
    sat_blocks = tl.zeros((BLOCK_M, BLOCK_N // _KEY_BLOCK), tl.int32)
    n_sat = tl.sum(tl.zeros((BLOCK_M,), tl.int32))
    # the tiles wholly below the last key, then the one past it: the loop has no mask test (whose branch costs
    # a CTA reduction, and on the anchored builds 64 register moves at its merge, per tile); a REGISTER_LEAN
    # build, which the second copy of the tile spills, tests each tile instead
    full_end = key_end if REGISTER_LEAN else NUM_KEYS // BLOCK_N * BLOCK_N
    for j0 in range(0, full_end, BLOCK_N):
        acc, den_acc, sat_blocks, n_sat = _key_tile(
            q, qs, KC, KS, VC, VS, kbase, ksbase, vbase, vsbase, j0, SKP, NUM_KEYS, zero, m, rows,
            s_log2, affine_a, affine_b, shift, acc, den_acc, sat_blocks, n_sat,
            D, BLOCK_M, BLOCK_N, ANCHORED, NATIVE, HW_CVT, QK_DECODE, REGISTER_LEAN, FMA_X2,
            "test" if REGISTER_LEAN else "none")
    if not REGISTER_LEAN:
        if full_end < key_end:
            acc, den_acc, sat_blocks, n_sat = _key_tile(
                q, qs, KC, KS, VC, VS, kbase, ksbase, vbase, vsbase, full_end, SKP, NUM_KEYS, zero, m, rows,
                s_log2, affine_a, affine_b, shift, acc, den_acc, sat_blocks, n_sat,
                D, BLOCK_M, BLOCK_N, ANCHORED, NATIVE, HW_CVT, QK_DECODE, REGISTER_LEAN, FMA_X2, "keys")

    # O = Σ (α' q)(α c) / 36 / (Σ α' c_B / 6) = acc / (6 den)  (docs/numerics.md sections 1, 2 step 8);
    # a row whose probabilities all underflowed (den = 0) gives 0, as the Hopper kernel does
    den = tl.max(den_acc, axis=1)
    den6 = tl.where(den > 0.0, 6.0 * den, 1.0)
    o = tl.math.div_rn(acc, tl.broadcast_to(den6[:, None], (BLOCK_M, D)))   # correctly rounded, as the reference
    # acc * 0 keeps a NaN from a flagged head's V scales (pre-pass: non-finite input) non-finite
    o = tl.where((den > 0.0)[:, None], o, acc * 0.0)
    optr = OUT + pid_g * SQ * D + om[:, None] * D + od[None, :]
    tl.store(optr, o.to(OUT.dtype.element_ty), mask=rows[:, None])
    if CALL > 0:   # the range record (module docstring)
        # NaN, or a magnitude that rounds to Inf in the output dtype (half an ulp above its largest value)
        limit = float("inf")
        if OUT.dtype.element_ty == tl.float16:
            limit = _OVERFLOW_FP16
        elif OUT.dtype.element_ty == tl.bfloat16:
            limit = _OVERFLOW_BF16
        n_empty = tl.sum((rows & (den == 0.0)).to(tl.int32))
        bad = ~(tl.abs(o) < limit) & rows[:, None]
        n_nonfinite = tl.sum(tl.sum(bad.to(tl.int32), axis=1))
        n_sat += tl.sum(tl.sum(sat_blocks, axis=1))
        if n_sat + n_empty + n_nonfinite > 0:
            tl.atomic_add(REC, n_sat)
            tl.atomic_add(REC + 1, n_empty)
            tl.atomic_add(REC + 2, n_nonfinite)
            tl.atomic_min(REC + 3, CALL)
            tl.store(FLAG, CALL)
        if (pid_m == 0) & (pid_g == 0):   # the pre-pass's scale range, once per call (module docstring)
            zero_word = tl.zeros((1,), tl.int32)   # (``zero`` is the kernel's float runtime zero)
            decide_scale_range(REC, FLAG, CALL, zero_word, zero_word == 0)


# the kernel's runtime argument list, in order (the cubin launcher builds its ABI from it)
POINTER_ARGS = ("QC", "QS", "KC", "KS", "VC", "VS", "OUT", "REC", "FLAG", "KEY_LENS")
ALIGNED_ARGS = POINTER_ARGS[:7]   # the operands (16-byte aligned); the record's words and the key counts are not
INT_ARGS = ("SQ", "SQP", "SKP", "NUM_KEYS", "N_ANCHOR", "HEADS")
FLOAT_ARGS = ("s_log2", "margin_raw", "affine_a", "affine_b")
INT_TAIL_ARGS = ("shift", "CALL")


def signature(out_dtype: str) -> dict:
    """Triton signature of ``direct_p_fwd`` for an output dtype ("bf16"/"fp16")."""
    sig = {"QC": "*u8", "QS": "*fp8e4nv", "KC": "*u8", "KS": "*fp8e4nv", "VC": "*u8", "VS": "*u8",
           "OUT": f"*{out_dtype}", "REC": "*i32", "FLAG": "*i32", "KEY_LENS": "*i32"}
    sig.update({name: "i32" for name in INT_ARGS})
    sig.update({name: "fp32" for name in FLOAT_ARGS})
    sig.update({name: "i32" for name in INT_TAIL_ARGS})
    return sig


def constexprs(cfg, qk_decode: bool = False) -> dict:
    """The compile-time specialisation of ``cfg`` (``qk_decode``: the CPU-interpreter test build)."""
    return dict(D=cfg.head_dim, BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, NATIVE=cfg.native,
                ANCHORED=cfg.anchored, HW_CVT=cfg.hw_cvt and not qk_decode, QK_DECODE=qk_decode,
                KEY_LENGTHS=cfg.key_lengths, REGISTER_LEAN=cfg.register_lean,
                FMA_X2=cfg.fma_x2 and not qk_decode)


def compile_for_target(cfg):
    """Compile ``cfg`` for its arch with this process's Triton, no GPU needed (Triton's own ptxas);
    returns the CompiledKernel (``.asm`` has "ptx", "cubin", "ttgir"; ``.metadata``)."""
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    sig = dict(signature(cfg.out_dtype), **{name: "constexpr" for name in constexprs(cfg)})
    # pointers 16-byte aligned (the pre-pass allocates them so), as Triton's JIT specialises them
    attrs = {(direct_p_fwd.arg_names.index(name),): [["tt.divisibility", 16]] for name in ALIGNED_ARGS}
    src = ASTSource(fn=direct_p_fwd, signature=sig, constexprs=constexprs(cfg), attrs=attrs)
    return triton.compile(src, target=GPUTarget("cuda", cfg.arch, 32),
                          options={"num_warps": cfg.num_warps, "num_stages": cfg.num_stages})


def grid(cfg, ops) -> tuple[int, int]:
    return (ops.rows_q // cfg.block_m, ops.qc.shape[0])


def runtime_args(ops, out, params, record=None, key_lengths=None, heads: int = 1) -> tuple:
    """The kernel's runtime arguments in signature order, from the pre-pass operands, the output, the policy's
    ``fp4vis.policy.KernelParams``, ``record`` (the call's ``fp4vis.call.RecordSlot``; None: record nothing, the
    output standing in for both words) and a key-masked call's int32 (B,) ``key_lengths`` with its ``heads`` per
    batch element (None: every element has all keys, the output standing in for the unread pointer)."""
    rec, flag, call = record if record is not None else (out, out, 0)
    n_anchor = int(params.anchor) if key_lengths is not None else min(int(params.anchor), ops.num_keys)
    return (ops.qc, ops.qs, ops.kc, ops.ks, ops.vc, ops.vs, out, rec, flag,
            out if key_lengths is None else key_lengths,
            ops.seq_q, ops.rows_q, ops.keys, ops.num_keys, n_anchor, int(heads),
            float(params.s_log2), float(params.margin_raw), float(params.affine_a),
            float(params.affine_b), int(params.shift), int(call))


def launch_jit(cfg, ops, out, params, qk_decode: bool = False) -> None:
    """Launch through Triton's JIT on the current stream (a GPU Triton >= 3.8 supports, or Triton's
    CPU interpreter with ``qk_decode``)."""
    direct_p_fwd[grid(cfg, ops)](*runtime_args(ops, out, params), **constexprs(cfg, qk_decode),
                                 num_warps=cfg.num_warps, num_stages=cfg.num_stages)
