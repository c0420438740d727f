"""A warp-specialised Direct-P forward in Gluon for sm_100a (compile-level; policy ``fast`` only).

The numbers are ``kernel.py``'s ``direct_p_fwd`` for m = 0 and no native positions (docs/numerics.md section 2),
with its range record, per-batch key counts and BF16 or FP16 output: the same block-scaled MMAs (NVFP4 Q·Kᵀ,
MXFP4 P·V, the denominator as P against a block of 1.0 codes) and ``_direct_p``'s float32 operations in the same
order. What differs is the schedule:

Partitions (``gl.warp_specialize``), per CTA one (batch·head, 128 query rows):
  * default, 4 warps: Direct-P on the even key tiles (S buffer 0), then the epilogue O = acc / (6 den);
  * worker 0, 4 warps: Direct-P on the odd key tiles (S buffer 1). With m = 0 the tiles are independent (no
    running max), so two warpgroups ping-pong over the key tiles of one query tile, two warps per scheduler;
  * worker 1, 1 warp: the MMAs. Per tile j: tcgen05_copy of K's scales to TMEM, S_j = Q·K_jᵀ (use_acc=False:
    no zero accumulator), then for tile j - 1 the denominator and P·V MMAs; completion goes to mbarriers,
    the warp waits only for operands, never for its own MMAs;
  * worker 2, 1 warp: TMA loads of Q (once) and of the K/V codes and scales into a STAGES-deep SMEM ring.

TMEM (columns of 32 bits, per CTA): S 2 x 128, O D, den 16, P codes 2 x 16 (128 x 64 bytes each), scales
(Q, K x 2, V x 2, α' x 2, the 1.0 block); Triton rounds the allocation to 512 at both head dims (1 CTA/SM).

Operand layouts (the pre-pass writes today's; the codes are the same, the scales are re-ordered):
  QC (G*SQP, D/2) u8, KC (G*SKP, D/2) u8 as today (2-D views);
  VC (G*D, SKP/2) u8 as today (2-D view; one (D, 64) box per tile);
  QS, KS, VS in the tcgen05 "packed block" scale order (the order ``tcgen05_copy`` reads, as the Gluon
  block-scaled matmul example uses): per 128 rows and 4 scale columns one 512-byte unit laid out
  [32][4][4] (row r = 32 i + l of the unit at byte 16 l + 4 i + c), units of a tile contiguous:
  QSP (1, G*SQP/128, D/64, 2, 256) e4m3, KSP (1, G*SKP/128, D/64, 2, 256) e4m3,
  VSP (1, G*DP/128, SKP/128, 2, 256) u8 with DP = D rounded up to 128. D = 64: P·V and the denominator are
  one MMA of N = 128 (B rows 64..79 are 1.0 codes, 80..127 zero codes, written once in SMEM), so rows 64..127
  of each scale unit must hold 127 (2^0; never 0xFF, the E8M0 NaN, which would poison the zero products).
  OUT (G, SQ, D) bf16 or fp16 (the JIT specialises on its dtype).
SKP is NUM_KEYS padded to whole 128-key tiles (zero codes); the tile past the last key is masked as kernel.py
masks it. SQP is a multiple of 128. KEY_LENGTHS (a key-masked call, kept keys gathered first by
kernels/kept_keys.py): NUM_KEYS = KEY_LENS[pid_g // HEADS], loaded once before the partitions start, and every
partition derives its tile count from it. NUM_KEYS = 0 (an element whose mask keeps nothing): no partition
loads, issues, waits or commits anything, and the epilogue writes 0 (den = 0 by the tile count, not from TMEM).

The range record (kernel.py's module docstring): REC (i32: saturated, empty, non-finite, first call as a
minimum), FLAG (i32, pinned host memory), CALL. Each Direct-P thread counts its row's saturated blocks
(e + 127 > 254, before the clamp) in four float32 registers (one per block position of a tile), every tile;
where CALL > 0 each Direct-P warpgroup leaves its counts per row in shared memory at its end, and the epilogue
sums them over the rows of SQ with its empty rows (den = 0) and its outputs that are NaN or round to Inf in
OUT's dtype, and where any count is not zero thread 0 adds them to REC, lowers REC[3] to CALL and stores CALL
into FLAG. CALL = 0 records nothing (REC, FLAG may be any int32 memory); the steady loop's cost is the count
(four compares and two packed adds per tile and thread). CTA (0, 0)'s epilogue also decides on the underflows the
call's pre-pass left in the record (``kernels/scale_record.py``: ``decide_scale_range``, the serial kernel's).
No anchors or native positions in this build.
"""

from __future__ import annotations

from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.blackwell import (
    TensorMemoryLayout,
    TensorMemoryScalesLayout,
    allocate_tensor_memory,
    fence_async_shared,
    mbarrier,
    tcgen05_commit,
    tcgen05_copy,
    tcgen05_mma_scaled,
    tma,
)

from fp4vis.formats import OVERFLOW_BF16, OVERFLOW_FP16

from ..scale_record import decide_scale_range
from .config import E8M0_BIAS, LOG2_1P5, LOG2_6, MAX_EXP_BYTE, WS_STAGES, WS_WARPS
from .ptx import E2M1X2, FMA_F32X2

_E2M1X2_ASM, _E2M1X2_CONSTRAINTS = gl.constexpr(E2M1X2[0]), gl.constexpr(E2M1X2[1])
_FMA_X2_ASM, _FMA_X2_CONSTRAINTS = gl.constexpr(FMA_F32X2[0]), gl.constexpr(FMA_F32X2[1])
_BIAS = gl.constexpr(float(E8M0_BIAS))
_MAX_U = gl.constexpr(float(MAX_EXP_BYTE))
_LOG2_6 = gl.constexpr(LOG2_6)
_ONE_MINUS_LOG2_1P5 = gl.constexpr(1.0 - LOG2_1P5)
_OVERFLOW_FP16 = gl.constexpr(OVERFLOW_FP16)   # fp4vis.formats: magnitudes that round to Inf in FP16
_OVERFLOW_BF16 = gl.constexpr(OVERFLOW_BF16)
_DEN_N = gl.constexpr(16)      # columns of the denominator MMA (the smallest N the FP4 MMAs take)
_BLOCK = gl.constexpr(128)     # query rows per CTA = keys per tile
_STAGES = gl.constexpr(WS_STAGES)   # the K/V ring's depth (config.py)
_WORKER_REGS = gl.constexpr([192, 48, 48])   # registers per thread: Direct-P worker, MMA warp, load warp


# ---------------------------------------------------------------------------------------------
# Direct-P (kernel.py's _direct_p for m = 0, no native positions, no mask; same float32 order)
# ---------------------------------------------------------------------------------------------

@gluon.jit
def _e2m1x2_hw(lo, hi):
    """kernel.py's ``_e2m1x2_hw`` (``ptx.E2M1X2``): four bytes of two E2M1 codes each of relu(lo), relu(hi)."""
    return gl.inline_asm_elementwise(_E2M1X2_ASM, _E2M1X2_CONSTRAINTS, [lo, hi], dtype=gl.uint8, is_pure=True, pack=4)


@gluon.jit
def _fma_x2(a, b, c):
    """kernel.py's ``_fma_x2`` (``ptx.FMA_F32X2``): a·b + c two lanes per ``fma.rn.f32x2``."""
    return gl.inline_asm_elementwise(_FMA_X2_ASM, _FMA_X2_CONSTRAINTS, [a, b, c], dtype=gl.float32, is_pure=True,
                                     pack=2)


@gluon.jit
def _direct_p_fast(raw, s_log2, affine_a, affine_b, shift, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr):
    """docs/numerics.md section 2 steps 1-6 for one (BLOCK_M, BLOCK_N) score tile with m = 0: the packed P codes
    (BLOCK_M, BLOCK_N/2) u8, their E8M0 scale bytes α' (BLOCK_M, BLOCK_N/32) u8 and which blocks saturated
    (BLOCK_M, BLOCK_N/32) float32 1.0/0.0. Operation for operation kernel.py's ``_direct_p`` with ANCHORED,
    NATIVE, MASK off and HW_CVT, FMA_X2 on."""
    NB: gl.constexpr = BLOCK_N // 32
    d3 = gl.reshape(raw, (BLOCK_M, NB, 32))                          # d = raw (m = 0: exact, skipped)
    g = gl.max(d3, axis=2) * s_log2                                  # step 1 (s > 0)
    e = gl.floor(g + _ONE_MINUS_LOG2_1P5)                            # step 2 (-inf for empty blocks)
    ebias = e + _BIAS
    u = gl.minimum(gl.maximum(ebias, 0.0), _MAX_U)
    ub = gl.maximum(u, (shift + 1) * 1.0)                            # step 3: working exponent
    k = gl.where(u == 0.0, float("-inf"), _LOG2_6 - (ub - _BIAS))    # step 4's k = log2 6 - ē
    kaff = affine_a * k + affine_b
    a_s = affine_a * s_log2
    y3 = _fma_x2(d3, gl.full(d3.shape, a_s, gl.float32, d3.type.layout),
                 gl.broadcast(kaff[:, :, None], d3)[0])               # step 5, affine positions
    y_lo, y_hi = gl.split(gl.reshape(y3, (BLOCK_M, BLOCK_N // 2, 2)))
    packed = _e2m1x2_hw(y_lo, y_hi)
    sbyte = (ub - shift).to(gl.int32)                                # step 6: >= 1, never subnormal
    # the range record: which blocks saturated (e + 127 > 254, before the clamp), in the thread's registers
    n_sat = gl.where(ebias > _MAX_U, 1.0, 0.0)
    return packed, sbyte.to(gl.uint8), n_sat


# ---------------------------------------------------------------------------------------------
# the range record
# ---------------------------------------------------------------------------------------------

@gluon.jit
def _first_thread(like):
    """Which element of ``like`` (an int32 tensor of one element per thread) thread 0 of the CTA holds. Thread 0 is
    found by reading %tid.x here (inline asm, not hoisted): a scalar atomic's own one-thread predicate reuses the
    lane and warp ids computed at the kernel's entry, which then stay live across every partition and spill at
    D = 128."""
    tid = gl.inline_asm_elementwise("mov.u32 $0, %tid.x;", "=r,r", [like], dtype=gl.int32, is_pure=False, pack=1)
    return tid == 0


@gluon.jit
def _add_to_record(REC, FLAG, CALL, n_sat, n_empty, n_nonfinite, like):
    """kernel.py's atomics of the record, by thread 0 of the CTA (``_first_thread``): REC[0..2] += the counts,
    REC[3] = min(REC[3], CALL), FLAG = CALL. ``like``: an int32 tensor of one element per thread."""
    first = _first_thread(like)
    zero = gl.zeros_like(like)
    gl.atomic_add(REC + zero, zero + n_sat, mask=first)
    gl.atomic_add(REC + 1 + zero, zero + n_empty, mask=first)
    gl.atomic_add(REC + 2 + zero, zero + n_nonfinite, mask=first)
    gl.atomic_min(REC + 3 + zero, zero + CALL, mask=first)
    gl.store(FLAG + zero, zero + CALL, mask=first)


# ---------------------------------------------------------------------------------------------
# partitions
# ---------------------------------------------------------------------------------------------

@gluon.jit
def _dp_tile(j, phase, s_buf, p_buf, ps_buf, s_ready, s_free, p_ready, p_free, NUM_KEYS, n_sat,
             s_log2, affine_a, affine_b, shift, WG: gl.constexpr, MASKED: gl.constexpr):
    """Direct-P of key tile j in buffers WG; returns ``n_sat`` plus the tile's saturated blocks. MASKED:
    the tile past the last key (kernel.py's MASK == "keys": keys >= NUM_KEYS are -inf, so they leave the block
    max and get code 0)."""
    s_layout: gl.constexpr = s_buf.get_reg_layout()
    mbarrier.wait(s_ready.index(WG), phase)
    raw = s_buf.load(s_layout)
    mbarrier.arrive(s_free.index(WG), count=1)                        # S buffer WG free for tile j + 2
    if MASKED:
        keys = j * 128 + gl.arange(0, 128, gl.SliceLayout(0, s_layout))
        raw = gl.where((keys < NUM_KEYS)[None, :], raw, float("-inf"))
    p, ps, sat = _direct_p_fast(raw, s_log2, affine_a, affine_b, shift, _BLOCK, _BLOCK)
    mbarrier.wait(p_free.index(WG), phase ^ 1)                       # P·V of tile j - 2 done with P buffer WG
    p_buf.store(gl.convert_layout(p, p_buf.get_reg_layout()))
    ps_buf.store(gl.convert_layout(ps, ps_buf.get_reg_layout()))
    mbarrier.arrive(p_ready.index(WG), count=1)
    return n_sat + gl.convert_layout(sat, n_sat.type.layout)


@gluon.jit
def _dp_partition(s_tmem, p_tmem, ps_buf, s_ready, s_free, p_ready, p_free, NUM_KEYS, sat_smem, CALL,
                  s_log2, affine_a, affine_b, shift, WG: gl.constexpr):
    """Direct-P on key tiles WG, WG + 2, ... (S, P and α' buffers WG): the tiles wholly below the last key in a
    loop without a mask, then the one past it (if it is this warpgroup's), as kernel.py does. The saturated
    blocks are counted in registers, one float32 per (row, block position) of the tile (a thread's four: per tile
    four compares and two packed adds, no reduction); where CALL > 0 the partition leaves its counts per row in
    ``sat_smem`` after its loop, for the epilogue's record (no atomics in the partitions)."""
    n_tiles = (NUM_KEYS + 127) // 128
    n_full = NUM_KEYS // 128
    s_buf = s_tmem.index(WG)
    p_buf = p_tmem.index(WG)
    row_layout: gl.constexpr = gl.SliceLayout(1, s_buf.get_reg_layout())
    # the block maxima's layout (one row per thread, its four blocks in registers, as the S tile's TMEM load)
    blk_layout: gl.constexpr = gl.SliceLayout(2, gl.BlockedLayout([1, 1, 32], [32, 1, 1], [4, 1, 1], [2, 1, 0]))
    n_sat = gl.zeros([_BLOCK, _BLOCK // 32], gl.float32, blk_layout)
    i = 0
    for j in range(WG, n_full, 2):
        n_sat = _dp_tile(j, i & 1, s_buf, p_buf, ps_buf, s_ready, s_free, p_ready, p_free, NUM_KEYS, n_sat,
                         s_log2, affine_a, affine_b, shift, WG, False)
        i += 1
    if (n_full < n_tiles) & (n_full % 2 == WG):
        n_sat = _dp_tile(n_full, i & 1, s_buf, p_buf, ps_buf, s_ready, s_free, p_ready, p_free, NUM_KEYS, n_sat,
                         s_log2, affine_a, affine_b, shift, WG, True)
    if CALL > 0:   # the range record: this warpgroup's counts per row, for the epilogue (after the join)
        sat_smem.index(WG).store(gl.convert_layout(gl.sum(n_sat, axis=1), row_layout).to(gl.int32))


@gluon.jit
def _dp_worker(s_tmem, p_tmem, ps_buf, s_ready, s_free, p_ready, p_free, NUM_KEYS, sat_smem, CALL,
               s_log2, affine_a, affine_b, shift):
    _dp_partition(s_tmem, p_tmem, ps_buf, s_ready, s_free, p_ready, p_free, NUM_KEYS, sat_smem, CALL,
                  s_log2, affine_a, affine_b, shift, 1)


@gluon.jit
def _scales_2d(smem, ROWS: gl.constexpr, COLS: gl.constexpr):
    """The (ROWS, COLS) scale matrix of a packed-block SMEM tile (1, ROWS/128, COLS/4, 2, 256): the view
    ``tcgen05_copy`` takes (the Gluon block-scaled matmul example's order)."""
    s = smem.reshape((smem.shape[1], smem.shape[2], 32, 4, 4))
    s = s.permute((0, 3, 2, 1, 4))
    return s.reshape((ROWS, COLS))


@gluon.jit
def _qk(j, b: gl.constexpr, q_smem, k_smem, ks_smem, s_tmem, qs_tmem, ks_buf, k_ready, k_empty, s_ready, s_free,
        D: gl.constexpr):
    """Tile j's S = Q·Kᵀ into S buffer b (use_acc=False: no zero accumulator)."""
    st = j % _STAGES
    mbarrier.wait(k_ready.index(st), (j // _STAGES) & 1)
    mbarrier.wait(s_free.index(b), ((j // 2) & 1) ^ 1)
    tcgen05_copy(_scales_2d(ks_smem.index(st), _BLOCK, D // 16), ks_buf)
    tcgen05_mma_scaled(q_smem, k_smem.index(st).permute((1, 0)), s_tmem.index(b), qs_tmem, ks_buf,
                       "e2m1", "e2m1", use_acc=False, mbarriers=[s_ready.index(b), k_empty.index(st)])


@gluon.jit
def _pv(t, b: gl.constexpr, v_smem, vs_smem, ones_smem, o_tmem, den_tmem, p_tmem, ps_buf, vs_buf, ones_s_tmem,
        v_ready, v_empty, p_ready, p_free, D: gl.constexpr, DP: gl.constexpr):
    """Tile t's denominator and P·V MMAs from P buffer b (the denominator first; P·V's commit covers both).
    DP > D (D = 64): one MMA of N = DP, B = [V; 16 rows of 1.0 codes; zero rows], whose columns D..D+15 are the
    denominator (``o_tmem`` is (128, DP))."""
    st = t % _STAGES
    mbarrier.wait(v_ready.index(st), (t // _STAGES) & 1)
    mbarrier.wait(p_ready.index(b), (t // 2) & 1)
    tcgen05_copy(_scales_2d(vs_smem.index(st), DP, _BLOCK // 32), vs_buf)
    acc = t > 0
    if DP == D:
        tcgen05_mma_scaled(p_tmem.index(b), ones_smem.permute((1, 0)), den_tmem, ps_buf, ones_s_tmem,
                           "e2m1", "e2m1", use_acc=acc)
    tcgen05_mma_scaled(p_tmem.index(b), v_smem.index(st).permute((1, 0)), o_tmem, ps_buf, vs_buf,
                       "e2m1", "e2m1", use_acc=acc, mbarriers=[p_free.index(b), v_empty.index(st)])


@gluon.jit
def _mma_partition(q_smem, qs_smem, k_smem, ks_smem, v_smem, vs_smem, ones_smem,
                   s_tmem, o_tmem, den_tmem, p_tmem, ps0, ps1, qs_tmem, ks0, ks1, vs0, vs1, ones_s_tmem,
                   q_bar, k_ready, k_empty, v_ready, v_empty, s_ready, s_free, p_ready, p_free, o_bar,
                   NUM_KEYS, D: gl.constexpr, DP: gl.constexpr):
    """One warp: every tcgen05 instruction of the CTA, completion to mbarriers. Two tiles per iteration (the
    scale buffers cannot be indexed at run time). S runs two tiles ahead: QK_{j+2} is issued before P·V_j, as
    soon as Direct-P has read S_j (s_free), so a Direct-P warpgroup finds its next S ready when it finishes a
    tile; the P·V MMAs accumulate in tile order (kernel.py's order)."""
    n_tiles = (NUM_KEYS + 127) // 128
    if n_tiles > 0:   # NUM_KEYS = 0: no loads come, no MMA is issued, nobody waits on o_bar
        mbarrier.wait(q_bar, 0)
        tcgen05_copy(_scales_2d(qs_smem, _BLOCK, D // 16), qs_tmem)
        _qk(0, 0, q_smem, k_smem, ks_smem, s_tmem, qs_tmem, ks0, k_ready, k_empty, s_ready, s_free, D)
        if n_tiles > 1:
            _qk(1, 1, q_smem, k_smem, ks_smem, s_tmem, qs_tmem, ks1, k_ready, k_empty, s_ready, s_free, D)
        for j0 in range(0, n_tiles, 2):
            if j0 + 2 < n_tiles:
                _qk(j0 + 2, 0, q_smem, k_smem, ks_smem, s_tmem, qs_tmem, ks0, k_ready, k_empty, s_ready, s_free, D)
            _pv(j0, 0, v_smem, vs_smem, ones_smem, o_tmem, den_tmem, p_tmem, ps0, vs0, ones_s_tmem,
                v_ready, v_empty, p_ready, p_free, D, DP)
            if j0 + 3 < n_tiles:
                _qk(j0 + 3, 1, q_smem, k_smem, ks_smem, s_tmem, qs_tmem, ks1, k_ready, k_empty, s_ready, s_free, D)
            if j0 + 1 < n_tiles:
                _pv(j0 + 1, 1, v_smem, vs_smem, ones_smem, o_tmem, den_tmem, p_tmem, ps1, vs1, ones_s_tmem,
                    v_ready, v_empty, p_ready, p_free, D, DP)
        tcgen05_commit(o_bar)


@gluon.jit
def _load_partition(q_desc, qs_desc, k_desc, ks_desc, v_desc, vs_desc, q_smem, qs_smem, k_smem, ks_smem,
                    v_smem, vs_smem, q_bar, k_ready, k_empty, v_ready, v_empty, SQP, SKP, NUM_KEYS,
                    D: gl.constexpr, DP: gl.constexpr):
    """One warp: TMA of Q once, then K and V of each tile into the ring. (Each partition computes its own
    offsets from the program ids: values live across the partition entry spill on D = 128.)"""
    pid_g = gl.program_id(1)
    n_tiles = (NUM_KEYS + 127) // 128
    q_row = pid_g * SQP + gl.program_id(0) * 128
    k_row = pid_g * SKP
    v_row = pid_g * D
    vs_unit = pid_g * (DP // 128)
    if n_tiles > 0:   # NUM_KEYS = 0: the MMA warp waits for nothing (no load left in flight at the CTA's exit)
        mbarrier.expect(q_bar, q_desc.block_type.nbytes + qs_desc.block_type.nbytes)
        tma.async_load(q_desc, [q_row, 0], q_bar, q_smem)
        tma.async_load(qs_desc, [0, q_row // 128, 0, 0, 0], q_bar, qs_smem)
    for j in range(n_tiles):
        st = j % _STAGES
        ph = ((j // _STAGES) & 1) ^ 1
        mbarrier.wait(k_empty.index(st), ph)
        mbarrier.expect(k_ready.index(st), k_desc.block_type.nbytes + ks_desc.block_type.nbytes)
        tma.async_load(k_desc, [k_row + j * 128, 0], k_ready.index(st), k_smem.index(st))
        tma.async_load(ks_desc, [0, (k_row + j * 128) // 128, 0, 0, 0], k_ready.index(st), ks_smem.index(st))
        mbarrier.wait(v_empty.index(st), ph)
        mbarrier.expect(v_ready.index(st), v_desc.block_type.nbytes + vs_desc.block_type.nbytes)
        v_dst = v_smem.index(st).slice(0, v_desc.block_type.shape[0])   # the first D rows (D = 64: see the kernel)
        tma.async_load(v_desc, [v_row, j * 64], v_ready.index(st), v_dst)
        tma.async_load(vs_desc, [0, vs_unit, j, 0, 0], v_ready.index(st), vs_smem.index(st))


# ---------------------------------------------------------------------------------------------
# the kernel
# ---------------------------------------------------------------------------------------------

# the JIT specialises no argument that varies from call to call (a key count, the call number) on its value, and
# the record's words and the key counts not on their alignment (compile_for_target's build, whichever is passed)
@gluon.jit(do_not_specialize=["SQ", "NUM_KEYS", "HEADS", "CALL"],
           do_not_specialize_on_alignment=["REC", "FLAG", "KEY_LENS"])
def direct_p_ws_fwd(q_desc, qs_desc, k_desc, ks_desc, v_desc, vs_desc, OUT, REC, FLAG, KEY_LENS,
                    SQ, SQP, SKP, NUM_KEYS, HEADS, s_log2, affine_a, affine_b, shift, CALL,
                    D: gl.constexpr, KEY_LENGTHS: gl.constexpr):
    pid_m = gl.program_id(0)
    pid_g = gl.program_id(1)
    DP: gl.constexpr = (D + 127) // 128 * 128
    if KEY_LENGTHS:   # a key-masked call: this batch element's kept keys, gathered first (kernels/kept_keys.py)
        NUM_KEYS = gl.load(KEY_LENS + pid_g // HEADS)
    # every partition derives its tile count from this one NUM_KEYS (0 tiles: each of them does nothing)

    # shared memory: Q, the K/V ring, their scales, the 1.0 block of the denominator MMA
    q_smem = gl.allocate_shared_memory(gl.uint8, q_desc.block_type.shape, q_desc.layout)
    qs_smem = gl.allocate_shared_memory(qs_desc.dtype, qs_desc.block_type.shape, qs_desc.layout)
    k_smem = gl.allocate_shared_memory(gl.uint8, [_STAGES] + k_desc.block_type.shape, k_desc.layout)
    ks_smem = gl.allocate_shared_memory(ks_desc.dtype, [_STAGES] + ks_desc.block_type.shape, ks_desc.layout)
    # V's stage is (DP, 64): D = 64 appends 16 rows of 1.0 codes and 48 zero rows (written once, below)
    v_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([DP, _BLOCK // 2], gl.uint8)
    v_smem = gl.allocate_shared_memory(gl.uint8, [_STAGES, DP, _BLOCK // 2], v_layout)
    vs_smem = gl.allocate_shared_memory(gl.uint8, [_STAGES] + vs_desc.block_type.shape, vs_desc.layout)
    ones_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([_DEN_N, _BLOCK // 2], gl.uint8)
    ones_smem = gl.allocate_shared_memory(gl.uint8, [_DEN_N, _BLOCK // 2], ones_layout)
    # the range record: each Direct-P warpgroup's saturated blocks per row, which the epilogue adds up
    sat_smem = gl.allocate_shared_memory(gl.int32, [2, _BLOCK], gl.SwizzledSharedLayout(1, 1, 1, [0]))

    # tensor memory
    s_layout: gl.constexpr = TensorMemoryLayout((128, 128), col_stride=1)
    o_layout: gl.constexpr = TensorMemoryLayout((128, DP), col_stride=1)
    den_layout: gl.constexpr = TensorMemoryLayout((128, _DEN_N), col_stride=1)
    p_layout: gl.constexpr = TensorMemoryLayout((128, _BLOCK // 2), col_stride=1)
    sc_layout: gl.constexpr = TensorMemoryScalesLayout()
    s_tmem = allocate_tensor_memory(gl.float32, [2, 128, 128], s_layout)
    o_tmem = allocate_tensor_memory(gl.float32, [128, DP], o_layout)
    if DP == D:
        den_tmem = allocate_tensor_memory(gl.float32, [128, _DEN_N], den_layout)
    else:
        den_tmem = o_tmem.slice(D, _DEN_N)
    p_tmem = allocate_tensor_memory(gl.uint8, [2, 128, _BLOCK // 2], p_layout)
    # scales: one buffer each (Gluon: "Scales don't currently support multibuffering")
    ps0 = allocate_tensor_memory(gl.uint8, [128, _BLOCK // 32], sc_layout)
    ps1 = allocate_tensor_memory(gl.uint8, [128, _BLOCK // 32], sc_layout)
    qs_tmem = allocate_tensor_memory(qs_desc.dtype, [128, D // 16], sc_layout)
    ks0 = allocate_tensor_memory(ks_desc.dtype, [128, D // 16], sc_layout)
    ks1 = allocate_tensor_memory(ks_desc.dtype, [128, D // 16], sc_layout)
    vs0 = allocate_tensor_memory(gl.uint8, [DP, _BLOCK // 32], sc_layout)
    vs1 = allocate_tensor_memory(gl.uint8, [DP, _BLOCK // 32], sc_layout)
    ones_s_tmem = allocate_tensor_memory(gl.uint8, [_DEN_N, _BLOCK // 32], sc_layout)

    # E2M1 code 2 is 1.0 (0x22: two per byte); E8M0 127 is 2^0
    ones_reg: gl.constexpr = gl.BlockedLayout([1, 16], [4, 8], [gl.num_warps(), 1], [1, 0])
    ones_smem.store(gl.full([_DEN_N, _BLOCK // 2], 0x22, gl.uint8, ones_reg))
    ones_s_tmem.store(gl.full([_DEN_N, _BLOCK // 32], 127, gl.uint8, ones_s_tmem.get_reg_layout()))
    if DP != D:
        rows_reg: gl.constexpr = gl.BlockedLayout([1, 16], [8, 4], [gl.num_warps(), 1], [1, 0])
        r = gl.arange(0, DP - D, gl.SliceLayout(1, rows_reg))[:, None] + gl.zeros([DP - D, _BLOCK // 2], gl.int32,
                                                                                   rows_reg)
        tail = gl.where(r < _DEN_N, 0x22, 0).to(gl.uint8)
        for i in gl.static_range(_STAGES):
            v_smem.index(i).slice(D, DP - D).store(tail)
    fence_async_shared()

    q_bar = mbarrier.allocate_mbarrier()
    o_bar = mbarrier.allocate_mbarrier()
    k_ready = mbarrier.allocate_mbarrier(batch=_STAGES)
    k_empty = mbarrier.allocate_mbarrier(batch=_STAGES)
    v_ready = mbarrier.allocate_mbarrier(batch=_STAGES)
    v_empty = mbarrier.allocate_mbarrier(batch=_STAGES)
    s_ready = mbarrier.allocate_mbarrier(batch=2)
    s_free = mbarrier.allocate_mbarrier(batch=2)
    p_ready = mbarrier.allocate_mbarrier(batch=2)
    p_free = mbarrier.allocate_mbarrier(batch=2)
    mbarrier.init(q_bar, count=1)
    mbarrier.init(o_bar, count=1)
    for i in gl.static_range(_STAGES):
        mbarrier.init(k_ready.index(i), count=1)
        mbarrier.init(k_empty.index(i), count=1)
        mbarrier.init(v_ready.index(i), count=1)
        mbarrier.init(v_empty.index(i), count=1)
    for i in gl.static_range(2):
        mbarrier.init(s_ready.index(i), count=1)
        mbarrier.init(s_free.index(i), count=1)
        mbarrier.init(p_ready.index(i), count=1)
        mbarrier.init(p_free.index(i), count=1)

    gl.warp_specialize([
        (_dp_partition, (s_tmem, p_tmem, ps0, s_ready, s_free, p_ready, p_free, NUM_KEYS, sat_smem, CALL,
                         s_log2, affine_a, affine_b, shift, 0)),
        (_dp_worker, (s_tmem, p_tmem, ps1, s_ready, s_free, p_ready, p_free, NUM_KEYS, sat_smem, CALL,
                      s_log2, affine_a, affine_b, shift)),
        (_mma_partition, (q_smem, qs_smem, k_smem, ks_smem, v_smem, vs_smem, ones_smem,
                          s_tmem, o_tmem, den_tmem, p_tmem, ps0, ps1, qs_tmem, ks0, ks1, vs0, vs1, ones_s_tmem,
                          q_bar, k_ready, k_empty, v_ready, v_empty, s_ready, s_free, p_ready, p_free, o_bar,
                          NUM_KEYS, D, DP)),
        (_load_partition, (q_desc, qs_desc, k_desc, ks_desc, v_desc, vs_desc, q_smem, qs_smem, k_smem, ks_smem,
                           v_smem, vs_smem, q_bar, k_ready, k_empty, v_ready, v_empty, SQP, SKP, NUM_KEYS, D, DP)),
    ], [4, 1, 1], _WORKER_REGS)

    # epilogue (default warps): O = acc / (6 den), div_rn; den = 0 gives 0 (acc * 0 keeps a NaN), as kernel.py.
    # No key tile (NUM_KEYS = 0): den = 0 and acc = 0 by the tile count, not from TMEM, which nothing wrote.
    # In 32-column slices of O (the whole (128, D) tile at once spills around div_rn's slow path).
    has_keys = NUM_KEYS > 0
    if has_keys:
        mbarrier.wait(o_bar, 0)
    EPI_N: gl.constexpr = 32
    o_reg: gl.constexpr = o_tmem.slice(0, EPI_N).get_reg_layout()
    den_all = den_tmem.load(den_tmem.get_reg_layout())
    den = gl.convert_layout(gl.max(den_all, axis=1), gl.SliceLayout(1, o_reg))
    den = gl.where(has_keys, den, 0.0)
    den6 = gl.where(den > 0.0, 6.0 * den, 1.0)
    om = pid_m * 128 + gl.arange(0, 128, gl.SliceLayout(1, o_reg))
    rows = om < SQ
    orow = OUT + pid_g.to(gl.int64) * SQ * D + om[:, None] * D
    # the range record's non-finite outputs: NaN, or a magnitude that rounds to Inf in the output dtype
    limit: gl.constexpr = _OVERFLOW_FP16 if OUT.dtype.element_ty == gl.float16 else _OVERFLOW_BF16
    n_bad = gl.zeros([128], gl.int32, gl.SliceLayout(1, o_reg))
    for c in gl.static_range(0, D, EPI_N):
        acc = o_tmem.slice(c, EPI_N).load(o_reg)
        acc = gl.where(has_keys, acc, 0.0)
        o = gl.div_rn(acc, gl.broadcast(den6[:, None], acc)[0])
        o = gl.where((den > 0.0)[:, None], o, acc * 0.0)
        od = c + gl.arange(0, EPI_N, gl.SliceLayout(0, o_reg))
        gl.store(orow + od[None, :], o.to(OUT.dtype.element_ty), mask=rows[:, None])
        if CALL > 0:
            n_bad += gl.sum((~(gl.abs(o) < limit)).to(gl.int32), axis=1)
    if CALL > 0:   # the range record (kernel.py's CALL > 0 block): saturated blocks, empty rows, non-finite outputs
        n_empty = gl.sum((rows & (den == 0.0)).to(gl.int32), axis=0)
        n_nonfinite = gl.sum(gl.where(rows, n_bad, 0), axis=0)
        sat_reg: gl.constexpr = gl.SliceLayout(1, o_reg)
        n_sat = gl.sum(gl.where(rows, sat_smem.index(0).load(sat_reg) + sat_smem.index(1).load(sat_reg), 0), axis=0)
        if n_sat + n_empty + n_nonfinite > 0:
            _add_to_record(REC, FLAG, CALL, n_sat, n_empty, n_nonfinite, om)
        if (pid_m == 0) & (pid_g == 0):   # the pre-pass's scale range, once per call (module docstring)
            decide_scale_range(REC, FLAG, CALL, gl.zeros_like(om), _first_thread(om))


# ---------------------------------------------------------------------------------------------
# compile for sm_100a without a GPU
# ---------------------------------------------------------------------------------------------

def _desc_layouts(D: int) -> dict:
    """Block shapes and shared layouts of the six TMA descriptors (name -> (dtype string, block, layout))."""
    nv = gl.NVMMASharedLayout
    flat = nv(swizzle_byte_width=0, element_bitwidth=8, rank=5)
    dp = (D + 127) // 128 * 128
    return {
        "q_desc": ("u8", [128, D // 2], nv.get_default_for([128, D // 2], gl.uint8)),
        "qs_desc": ("fp8e4nv", [1, 1, D // 64, 2, 256], flat),
        "k_desc": ("u8", [128, D // 2], nv.get_default_for([128, D // 2], gl.uint8)),
        "ks_desc": ("fp8e4nv", [1, 1, D // 64, 2, 256], flat),
        "v_desc": ("u8", [D, 64], nv.get_default_for([D, 64], gl.uint8)),
        "vs_desc": ("u8", [1, dp // 128, 1, 2, 256], flat),
    }


# the runtime arguments after the six descriptors, in order
POINTER_ARGS = ("OUT", "REC", "FLAG", "KEY_LENS")
SCALAR_ARGS = {"SQ": "i32", "SQP": "i32", "SKP": "i32", "NUM_KEYS": "i32", "HEADS": "i32", "s_log2": "fp32",
               "affine_a": "fp32", "affine_b": "fp32", "shift": "i32", "CALL": "i32"}


def signature(D: int, out_dtype: str = "bf16") -> dict:
    """Triton signature of ``direct_p_ws_fwd`` for head dim D and an output dtype ("bf16"/"fp16")."""
    assert out_dtype in ("bf16", "fp16"), out_dtype
    sig = {name: f"tensordesc<{dt}[{','.join(map(str, block))}],{layout!r}>"
           for name, (dt, block, layout) in _desc_layouts(D).items()}
    sig.update(OUT=f"*{out_dtype}", REC="*i32", FLAG="*i32", KEY_LENS="*i32")
    sig.update(SCALAR_ARGS)
    sig.update(D="constexpr", KEY_LENGTHS="constexpr")
    return sig


def compile_for_target(head_dim: int, arch: int = 100, out_dtype: str = "bf16", key_lengths: bool = False):
    """Compile the kernel for sm_100a on this machine (Triton's bundled ptxas; no GPU): head dim, output dtype
    ("bf16"/"fp16") and per-batch key counts (KEY_LENGTHS) as the JIT would specialise them (OUT 16-byte aligned;
    the record's words and the key counts not)."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.experimental.gluon._runtime import GluonASTSource

    attrs = {(direct_p_ws_fwd.arg_names.index("OUT"),): [["tt.divisibility", 16]]}
    src = GluonASTSource(fn=direct_p_ws_fwd, signature=signature(head_dim, out_dtype),
                         constexprs={"D": head_dim, "KEY_LENGTHS": bool(key_lengths)}, attrs=attrs)
    return triton.compile(src, target=GPUTarget("cuda", arch, 32), options={"num_warps": WS_WARPS})


# ---------------------------------------------------------------------------------------------
# host side: the operands in this kernel's layouts, and a launch (needs a Blackwell GPU; not run here)
# ---------------------------------------------------------------------------------------------

def packed_block_scales(scales):
    """(G, R, C) scale bytes (R a multiple of 128, C of 4) in the tcgen05 packed-block order the kernel's
    ``_scales_2d`` view reads: (1, G*R/128, C/4, 2, 256), unit (u, kk) holding rows 128 u.., columns 4 kk.. with
    row 32 i + l, column c at byte 16 l + 4 i + c."""
    g, r, c = scales.shape
    assert r % 128 == 0 and c % 4 == 0, (r, c)
    x = scales.reshape(g * r // 128, 4, 32, c // 4, 4).permute(0, 3, 2, 1, 4)
    return x.contiguous().reshape(1, g * r // 128, c // 4, 2, 256)


def operands(ops) -> dict:
    """The pre-pass ``KernelOperands`` (prepass.py) as this kernel's tensors (name -> tensor, the descriptor bases):
    the codes as 2-D views, the scales re-ordered; D = 64 pads V's scale rows to 128 with 127 (2^0), the rows
    that scale the denominator's 1.0 codes and the zero codes after them."""
    import torch
    g, d = ops.vc.shape[0], ops.vc.shape[1]
    vs = ops.vs
    if d < 128:
        vs = torch.cat([vs, torch.full((g, 128 - d, vs.shape[2]), 127, dtype=vs.dtype, device=vs.device)], dim=1)
    return {"q_desc": ops.qc.reshape(-1, d // 2), "qs_desc": packed_block_scales(ops.qs),
            "k_desc": ops.kc.reshape(-1, d // 2), "ks_desc": packed_block_scales(ops.ks),
            "v_desc": ops.vc.reshape(-1, ops.vc.shape[2]), "vs_desc": packed_block_scales(vs)}


def descriptors(ops) -> dict:
    """Host TMA descriptors of ``operands(ops)`` with the block shapes and layouts the kernel was compiled for."""
    from triton.experimental.gluon.nvidia.blackwell import TensorDescriptor
    d = ops.vc.shape[1]
    lay = _desc_layouts(d)
    return {name: TensorDescriptor.from_tensor(t, lay[name][1], lay[name][2]) for name, t in operands(ops).items()}


def launch(ops, out, params, record=None, key_lengths=None, heads=1) -> None:
    """Run the kernel on torch's current stream (Gluon's JIT), with ``kernel.runtime_args``'s meaning: ``ops``
    the ``prepass.KernelOperands`` of ``kernel_operands(q, k, v, params.qk_layout, 0, 128, 128, record=...)``, ``out``
    (G, Sq, D) bf16/fp16, ``params`` a fast policy's ``KernelParams`` (no native positions, no anchors),
    ``record`` the call's ``fp4vis.call.RecordSlot`` (fields, flag, number) or None (record nothing), and a
    key-masked call's int32 (B,) ``key_lengths`` with its ``heads`` per batch element (None: every element has
    all ``ops.num_keys`` keys). Untested here (no Blackwell GPU)."""
    import torch
    assert not params.native_exp2, "gluon_ws: fast policies only (no native exp2 positions)"
    assert params.anchor == 0, "gluon_ws: fast policies only (m = 0, no anchors)"
    assert out.dtype in (torch.bfloat16, torch.float16), f"gluon_ws: output bf16 or fp16, not {out.dtype}"
    d = ops.vc.shape[1]
    g = ops.qc.shape[0]
    assert out.shape == (g, ops.seq_q, d) and out.is_contiguous(), (tuple(out.shape), g, ops.seq_q, d)
    assert ops.rows_q % 128 == 0 and ops.keys % 128 == 0, (ops.rows_q, ops.keys)
    stand_in = out.view(torch.int32)   # for the pointers a call does not read (CALL = 0, no key counts)
    rec, flag, call = record if record is not None else (stand_in, stand_in, 0)
    if key_lengths is not None:
        assert key_lengths.dtype == torch.int32 and key_lengths.numel() * int(heads) == g, \
            (key_lengths.dtype, key_lengths.numel(), heads, g)
    desc = descriptors(ops)
    direct_p_ws_fwd[(ops.rows_q // 128, g)](
        *(desc[name] for name in ("q_desc", "qs_desc", "k_desc", "ks_desc", "v_desc", "vs_desc")),
        out, rec, flag, stand_in if key_lengths is None else key_lengths,
        ops.seq_q, ops.rows_q, ops.keys, ops.num_keys, int(heads), float(params.s_log2), float(params.affine_a),
        float(params.affine_b), int(params.shift), int(call),
        D=d, KEY_LENGTHS=key_lengths is not None, num_warps=WS_WARPS)
