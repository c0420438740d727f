"""Direct-P on the score tiles of one consumer warpgroup (docs/numerics.md section 2): a device-side object, as
flash-attn-4 keeps its softmax apart from its kernel classes. ``DirectP`` holds the thread's row state (the row
reference m_i, the denominator's code sums l_i, the saturated-pair count of the range record) and turns each
64 x N score tile in registers into the PV operand ``P-tilde * alpha'`` (exact in BF16).

One tile, stage by stage over all (row, 32-key block) pairs so that the 8 independent chains (block max -> two
shuffles -> exponent -> constants -> codes) overlap (one warp per scheduler runs Direct-P at a time and is
otherwise latency-bound): ``block_maxima``, ``block_constants`` (per quad or per thread: ``cfg.block_scales``),
``codes``. ``DirectPTiming`` leaves stages out for the timing-only P paths (``config.TIMING_P_PATHS``: wrong
results by design); the product kernel builds ``DirectP``.

Register index i = c + 2 r + 4 chunk of a thread's accumulator is (row r0 + 8 r, column 8 chunk + 2 lane_q + c):
the same order in the accumulator and in the PV A fragment, so elements i, i+1 (c = 0, 1) form one BF16 pair.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import cutlass
import cutlass.cute as cute
from cutlass import Float32, Int32, const_expr

from .config import DP_BLOCK, EIGHTHS_LOG2, TIMING_P_PATHS, KernelConfig
from .fp8_key_scales import FP8_KEY_TILE
from .ptx import (
    add_bf16x2,
    bf16x2_splat_pow2,
    bf16x2_sum,
    block_constants,
    block_exponent,
    clamp_exponent,
    count_saturated,
    e2m1_bf16x2_eighths,
    e2m1_grid_eighths,
    e2m1_relu_round,
    e2m1_round_eighths,
    ex2_approx,
    fma_rn,
    fma_rn_sat,
    fmax_nan,
    mask_key,
    mul_bf16x2,
    order_before_wait,
    pack_sat_bf16x2,
    pow2_of_splat,
    quad_broadcast,
    select_by_lane,
    select_f32,
)

P_ONES = 0x3F803F80   # a BF16 pair (1, 1): P = 1 on the timing paths


def direct_p_for(cfg: KernelConfig, s_log2: Float32, lane_q: Int32) -> DirectP:
    """The Direct-P object of a kernel variant (the timing paths' where ``cfg.p_path`` is one of them), its row
    state made in registers."""
    row_m = cute.make_rmem_tensor((2,), Float32)      # the row reference m_i (0 without anchors)
    row_l = cute.make_rmem_tensor((2,), Float32)      # sum_B alpha'_B c_B, this thread's part
    row_m.fill(0.0)
    row_l.fill(0.0)
    saturated = None                                  # the range record: saturated pairs this thread saw
    if const_expr(cfg.range_record):
        saturated = cute.make_rmem_tensor((1,), Int32)
        saturated.fill(0)
    cls = DirectPTiming if cfg.p_path in TIMING_P_PATHS else DirectP
    return cls(cfg, s_log2, lane_q, row_m, row_l, saturated)


@dataclass
class DirectP:
    """Direct-P of one thread's two rows (r0, r0 + 8) of a consumer warpgroup's score tiles. The DSL carries its
    run-time fields (``RUNTIME_FIELDS``: the scale, the lane, the row state) through the kernel's dynamic loops
    (``__extract_mlir_values__``); ``cfg`` stays a compile-time constant."""

    cfg: KernelConfig            # static: the kernel variant
    s_log2: Float32               # the softmax scale times log2 e
    lane_q: Int32                 # column pair inside each 8-column chunk of the accumulator
    row_m: cute.Tensor            # the row reference m_i (0 without anchors)
    row_l: cute.Tensor            # sum_B alpha'_B c_B, this thread's part
    saturated: cute.Tensor | None = None   # the range record's saturated pairs (cfg.range_record)
    qk_scales: tuple | None = None         # qk_fp8: (2^Eq of the two rows, this head's k_scale (N,))

    RUNTIME_FIELDS = ("s_log2", "lane_q", "row_m", "row_l", "saturated", "qk_scales")
    DENOMINATOR_SCALE = 6.0   # O = acc / (6 l): the two factors 1/6 of P-tilde and V-hat, applied once

    def __extract_mlir_values__(self) -> list:
        values, self._counts = [], []
        for name in self.RUNTIME_FIELDS:
            field_values = cutlass.extract_mlir_values(getattr(self, name))
            values += field_values
            self._counts.append(len(field_values))
        return values

    def __new_from_mlir_values__(self, values) -> DirectP:
        fields, start = {}, 0
        for name, count in zip(self.RUNTIME_FIELDS, self._counts):
            fields[name] = cutlass.new_from_mlir_values(getattr(self, name), values[start:start + count])
            start += count
        return dataclasses.replace(self, **fields)

    @property
    def tile_n(self) -> int:
        return self.cfg.tile_n

    @property
    def nb(self) -> int:
        """32-key blocks per tile."""
        return self.cfg.tile_n // DP_BLOCK

    @property
    def eighths(self) -> bool:
        return self.cfg.eighths and self.cfg.shift >= EIGHTHS_LOG2

    @property
    def bf16codes(self) -> bool:
        return self.cfg.code_rounding == "bf16"

    @property
    def packed(self) -> bool:
        return (self.cfg.p_path in ("packed", "packed_alu") and self.eighths) or self.bf16codes

    # ------------------------------------------------------------------ per call
    def tile_scales(self, j, whole: bool = False):
        """qk_fp8: (2^Eq of the two rows, [2^Ek of key tile j's 32-key blocks]), the loads issued at the
        top of a step so that their latency hides under the matrix products; None without qk_fp8. k_scale is
        padded to whole 128-key tiles: a longer tile that may reach past the padding (``whole`` false: the first
        and last tiles) clamps its block index, the blocks past it holding keys past Skv only; a whole tile before
        the last lies inside Skv, and its loads are one base and constant offsets."""
        if const_expr(self.qk_scales is None):
            return None
        row_qs, head_ks = self.qk_scales
        blocks = [j * self.nb + b for b in range(self.nb)]
        if const_expr(FP8_KEY_TILE % self.tile_n != 0 and not whole):
            blocks = [cutlass.min(blk, head_ks.shape[0] - 1) for blk in blocks]
        return row_qs, [head_ks[blk] for blk in blocks]

    @cute.jit
    def anchor_reference(self, acc_s, m_offset, kv_limit):
        """m_i = max over the anchor keys (physical positions < anchor) + margin (docs/numerics.md section 4)."""
        n_anchor = self.cfg.anchor
        for r in cutlass.range_constexpr(2):
            a = -Float32.inf
            for ch in cutlass.range_constexpr(self.tile_n // 8):
                for c in cutlass.range_constexpr(2):
                    if const_expr(ch * 8 < n_anchor):
                        col = ch * 8 + 2 * self.lane_q + c
                        v = mask_key(acc_s[c + 2 * r + 4 * ch], col,
                                     cutlass.min(kv_limit, Int32(n_anchor)))
                        a = cute.arch.fmax(a, v)
            a = cute.arch.fmax(a, cute.arch.shuffle_sync_bfly(a, offset=1))
            a = cute.arch.fmax(a, cute.arch.shuffle_sync_bfly(a, offset=2))
            self.row_m[r] = a + m_offset

    def before_pv(self):
        """What runs right before the kernel issues a P V product: nothing for Direct-P (a fixed row reference, no
        output to rescale; ``softmax_fp8.SoftmaxFP8`` rescales its output there)."""

    def after_pv(self, r_p):
        """What the kernel issues right after a P V product, in its group: nothing for Direct-P (its row sums are the
        exact code sums; ``softmax_fp8.SoftmaxFP8`` sums its P on the tensor cores there)."""

    def row_denominator(self, r: int) -> Float32:
        """The denominator of this thread's row r0 + 8 r, 6 l: the quad's four partial sums of ``row_l``."""
        lt = self.row_l[r]
        lt = lt + cute.arch.shuffle_sync_bfly(lt, offset=1)
        lt = lt + cute.arch.shuffle_sync_bfly(lt, offset=2)
        return lt * self.DENOMINATOR_SCALE

    @cute.jit
    def tile_masked_if_last(self, acc_s, r_p, tile_scales, seqlen_k, j, n_tiles, partial_last):
        """``tile`` of key tile j (serial and overlapped schedules): the masked variant (keys >= Skv) only
        for a partial last tile."""
        kv_limit = seqlen_k - j * self.tile_n
        if partial_last and j == n_tiles - 1:
            self.tile(acc_s, r_p, tile_scales, kv_limit, j, True)
        else:
            self.tile(acc_s, r_p, tile_scales, kv_limit, j, False)

    @cute.jit
    def tile(self, acc_s, r_p, tile_scales, kv_limit, tile_idx, masked: cutlass.Constexpr,
             wait_pv: cutlass.Constexpr = False):
        """Direct-P on one 64 x N score tile held in registers: reads the scores (never writes them: a
        non-WGMMA write to accumulator registers would make ptxas serialise the WGMMAs in flight), writes
        P-tilde * alpha' into the PV A-fragment r_p and adds sum_B alpha'_B c_B to row_l. ``wait_pv``: a PV
        product that reads r_p is in flight (ping-pong): r_p is written only after it completes.

        ``tile_scales`` (qk_fp8): the scores are raw / (2^Eq 2^Ek); the powers of two go into each (row,
        block) pair's two multipliers (s for the exponent, A s for the codes), exactly."""
        mults = self.multipliers(tile_scales)
        idx, vals, mx = self.block_maxima(acc_s, kv_limit, masked)
        consts = self.block_constants(mx, mults, tile_scales)
        self.codes(r_p, (idx, vals), consts, mults, (kv_limit, tile_idx), wait_pv)

    # ------------------------------------------------------------------ the stages of a tile
    def multipliers(self, tile_scales):
        """(score multipliers per row, per (row, block) pair for the exponent, per pair for the affine code)."""
        cfg = self.cfg
        a_s = self.s_log2 * cfg.affine_a
        if const_expr(self.eighths):
            a_s = self.s_log2 * (cfg.affine_a / 8.0)
        rbs = [(r, b) for r in range(2) for b in range(self.nb)]
        s_pair = {rb: self.s_log2 for rb in rbs}
        a_pair = {rb: a_s for rb in rbs}
        s_rows = [self.s_log2, self.s_log2]
        if const_expr(tile_scales is not None):
            row_qs, k_scales = tile_scales
            for r in range(2):
                s_rows[r], a_row = self.s_log2 * row_qs[r], a_s * row_qs[r]
                for b in range(self.nb):
                    s_pair[r, b], a_pair[r, b] = s_rows[r] * k_scales[b], a_row * k_scales[b]
        return s_rows, s_pair, a_pair

    def block_maxima(self, acc_s, kv_limit, masked: bool, maxima: bool = True):
        """(register indices, scores (keys past ``kv_limit`` masked where ``masked``), this thread's partial
        maxima) of each (row, block) pair."""
        idx, vals, mx = {}, {}, {}
        for r in range(2):
            for b in range(self.nb):
                idx[r, b] = [c + 2 * r + 4 * (4 * b + cb) for cb in range(4) for c in range(2)]
                v = [acc_s[i] for i in idx[r, b]]
                if const_expr(masked):
                    for t in range(8):
                        v[t] = mask_key(v[t], 32 * b + 8 * (t // 2) + 2 * self.lane_q + (t % 2), kv_limit)
                vals[r, b] = v
                if const_expr(maxima):
                    m4 = [fmax_nan(v[2 * i], v[2 * i + 1]) for i in range(4)]
                    mx[r, b] = fmax_nan(fmax_nan(m4[0], m4[1]), fmax_nan(m4[2], m4[3]))
        return idx, vals, mx

    def block_constants(self, mx, mults, tile_scales):
        """(consts[r, b] = (alpha', affine constant, native constant), BF16 (alpha', alpha') splats where made, the
        rows' NaN flags), for the ``multipliers``. NaN scores (non-finite inputs: the pre-pass turns them
        into NaN operands) must not become codes 0 silently: a per-row flag, max.NaN over the block maxima
        (0 or a finite score otherwise), is added times 0 to the denominator, which is then NaN and so is
        the row."""
        cfg = self.cfg
        s_rows, s_pair, _ = mults
        nan_flag = [Float32(0.0), Float32(0.0)]
        consts, splats = {}, {}
        rbs = [(r, b) for r in range(2) for b in range(self.nb)]
        if const_expr(cfg.block_scales == "quad"):
            mx_own = [self.quad_block_max(mx, r) for r in range(2)]
            self.quad_block_constants(mx_own, s_rows, tile_scales, nan_flag, consts, splats)
        else:
            for off in (1, 2):
                for rb in rbs:
                    mx[rb] = fmax_nan(mx[rb], cute.arch.shuffle_sync_bfly(mx[rb], offset=off))
            for r, b in rbs:
                nan_flag[r] = fmax_nan(nan_flag[r], mx[r, b])
            for r, b in rbs:
                u = self.exponent(mx[r, b], self.row_m[r], s_pair[r, b])
                consts[r, b] = block_constants(u, cfg.shift, cfg.affine_a, cfg.affine_b, self.eighths)
        return consts, splats, nan_flag

    def codes(self, r_p, scores, constants, mults, where, wait_pv):
        """The codes of every pair (``scores``: ``block_maxima``'s indices and values; ``constants``:
        ``block_constants``'; ``where``: (kv_limit, the tile's index)): the affine (or, at native positions,
        exp2) FMA, E2M1 rounding, P-tilde * alpha' into r_p and the code sums into row_l. Packed path: after
        the FP32 grid rounding the pair is packed to BF16 (exact: codes/8), saturated at 6/8, multiplied by
        (8 alpha', 8 alpha') (a power of two: exact) and its codes summed on pairs (at most 4 codes/8 per
        half, multiples of 1/16 up to 3: exact in BF16). It computes every pair before waiting for the PV in
        flight and writes r_p after the wait; the other paths wait first."""
        cfg = self.cfg
        idx, vals = scores
        consts, splats, nan_flag = constants
        _, s_pair, a_pair = mults
        kv_limit, tile_idx = where
        late_wait = const_expr(wait_pv and self.packed)
        if const_expr(wait_pv and not late_wait):
            cute.nvgpu.warpgroup.wait_group(0)
        r_p2 = cute.recast_tensor(r_p, Int32)
        l_acc = [Float32(0.0), Float32(0.0)]
        scaled = {}
        for r in range(2):
            for b in range(self.nb):
                m = self.row_m[r]
                alpha, kaff, knat = consts[r, b]
                if const_expr(cfg.native_exp2):
                    # quarter = (global block index) % 4; a 64-key tile holds half the cycle
                    if const_expr(self.tile_n == 128):
                        quarter = Int32(b)
                    else:
                        quarter = (tile_idx % 2) * 2 + b
                    nat_even = Int32(self.lane_q == quarter)
                    nat_odd = Int32(self.lane_q == 0)
                codes = [Float32(0.0)] * 8
                for t in range(8):
                    cb = t // 2
                    d = vals[r, b][t]
                    if const_expr(cfg.anchor > 0):
                        d = d - m   # (raw - m) first, as the reference does
                    if const_expr(self.eighths):
                        y = fma_rn_sat(d, a_pair[r, b], kaff)
                    else:
                        y = fma_rn(d, a_pair[r, b], kaff)
                    if const_expr(cfg.native_exp2):
                        # native iff pair % 8 == quarter or pair % 8 == 4, pair = 4*cb + lane_q
                        yn = ex2_approx(fma_rn(d, s_pair[r, b], knat))
                        if const_expr(cb % 2 == 0):
                            y = select_f32(nat_even, yn, y)
                        else:
                            y = select_f32(nat_odd, yn, y)
                    if const_expr(self.bf16codes):
                        codes[t] = y                      # rounded in pairs below
                    elif const_expr(self.packed):
                        # FFMA constant: affine codes only (y8 <= 1 by fma.sat); exp2 values can be inf
                        codes[t] = e2m1_grid_eighths(y, cfg.p_path != "packed_alu" and not cfg.native_exp2)
                    elif const_expr(self.eighths):
                        codes[t] = e2m1_round_eighths(y)
                    else:
                        codes[t] = e2m1_relu_round(y)
                if const_expr(self.packed):
                    alpha2 = splats[r, b] if (r, b) in splats else bf16x2_splat_pow2(alpha)
                    if const_expr(self.bf16codes):
                        pairs = [e2m1_bf16x2_eighths(codes[2 * cb], codes[2 * cb + 1]) for cb in range(4)]
                    else:
                        pairs = [pack_sat_bf16x2(codes[2 * cb], codes[2 * cb + 1]) for cb in range(4)]
                    for cb in range(4):
                        scaled[idx[r, b][2 * cb] // 2] = (pairs[cb], alpha2)
                    csum = bf16x2_sum(add_bf16x2(add_bf16x2(pairs[0], pairs[1]), add_bf16x2(pairs[2], pairs[3])))
                else:
                    csum = codes[0]
                    for t in range(1, 8):
                        csum = csum + codes[t]
                    for t in range(8):
                        r_p[idx[r, b][t]] = (codes[t] * alpha).to(r_p.element_type)
                l_acc[r] = l_acc[r] + alpha * csum
        if const_expr(late_wait):
            order_before_wait([l_acc[0] + l_acc[1]], kv_limit)   # kv_limit >= 1: never stores
            cute.nvgpu.warpgroup.wait_group(0)
        for i, (pair, alpha2) in scaled.items():
            r_p2[i] = mul_bf16x2(pair, alpha2)
        self.add_to_denominator(l_acc, nan_flag)

    def add_to_denominator(self, l_acc, nan_flag):
        for r in range(2):
            self.row_l[r] = self.row_l[r] + (l_acc[r] + fma_rn(nan_flag[r], Float32(0.0), Float32(0.0)))

    # ------------------------------------------------------------------ block constants
    def quad_block_max(self, mx, r):
        """``block_scales="quad"``: the maximum of key block q of row r over the quad, in thread q
        (a reduce-scatter: 3 shuffles per row instead of the butterfly's 8, which gives every
        thread every block maximum). ``mx[r, b]``: this thread's partial maxima of the 4 blocks."""
        hi = self.lane_q & 2
        lo = self.lane_q & 1
        # with the thread two lanes away: keep blocks 2 hi, 2 hi + 1, send the other two
        k0 = fmax_nan(select_f32(hi, mx[r, 2], mx[r, 0]),
                      cute.arch.shuffle_sync_bfly(select_f32(hi, mx[r, 0], mx[r, 2]), offset=2))
        k1 = fmax_nan(select_f32(hi, mx[r, 3], mx[r, 1]),
                      cute.arch.shuffle_sync_bfly(select_f32(hi, mx[r, 1], mx[r, 3]), offset=2))
        # with the neighbour (same two blocks): keep block 2 hi + lo
        return fmax_nan(select_f32(lo, k1, k0), cute.arch.shuffle_sync_bfly(select_f32(lo, k0, k1), offset=1))

    def exponent(self, mx, m, s2):
        """``block_exponent`` of one (row, block) pair; with the range record, a saturated pair (e > 254,
        before the clamp) also counts in ``saturated``."""
        if self.saturated is None:
            return block_exponent(mx, m, s2, self.cfg.anchor > 0)
        e = block_exponent(mx, m, s2, self.cfg.anchor > 0, unclamped=True)
        self.saturated[0] = count_saturated(self.saturated[0], e)
        return clamp_exponent(e)

    def quad_block_constants(self, mx_own, s_rows, tile_scales, nan_flag, consts, splats):
        """``block_scales="quad"``: thread q of each quad computes the exponent and constants of key
        block q for both rows from ``mx_own`` (``quad_block_max``) and the quad's shuffles hand them
        to the other three threads; the same operations as the per-thread form, so the same bits.
        Fills ``consts[r, b]`` and, on the packed path, ``splats[r, b]`` = (alpha', alpha') in BF16 (alpha' is
        read back off the pair). The NaN flag is taken over the owned blocks only: the quad's four threads
        together see every block, and the denominator is summed over the quad at the end."""
        cfg = self.cfg
        k_own = None
        if tile_scales is not None:
            k_own = select_by_lane(self.lane_q, tile_scales[1])
        own = []
        for r in range(2):
            nan_flag[r] = fmax_nan(nan_flag[r], mx_own[r])
            s_own = s_rows[r] if k_own is None else s_rows[r] * k_own
            u = self.exponent(mx_own[r], self.row_m[r], s_own)
            alpha, kaff, knat = block_constants(u, cfg.shift, cfg.affine_a, cfg.affine_b, self.eighths)
            own.append((alpha, kaff, knat, bf16x2_splat_pow2(alpha) if self.packed else None))
        for r in range(2):
            alpha, kaff, knat, splat = own[r]
            for b in range(self.nb):
                if self.packed:
                    splats[r, b] = quad_broadcast(splat, b)
                    alpha_b = pow2_of_splat(splats[r, b])
                else:
                    alpha_b = quad_broadcast(alpha, b)
                knat_b = quad_broadcast(knat, b) if cfg.native_exp2 else None   # read only at native positions
                consts[r, b] = (alpha_b, quad_broadcast(kaff, b), knat_b)


class DirectPTiming(DirectP):
    """The timing-only P paths (``config.TIMING_P_PATHS``), which place time inside the kernel by leaving stages
    out (the device notes' method where counters cannot): ``none`` P = 1, no Direct-P; ``timing_scales`` the
    block maxima, shuffles and exponents but P = 1; ``timing_codes`` the codes with fixed block constants. Wrong
    results by design; never the product's."""

    @cute.jit
    def tile(self, acc_s, r_p, tile_scales, kv_limit, tile_idx, masked: cutlass.Constexpr,
             wait_pv: cutlass.Constexpr = False):
        cfg = self.cfg
        if const_expr(cfg.p_path == "none"):
            if const_expr(wait_pv):
                cute.nvgpu.warpgroup.wait_group(0)
            r_p2 = cute.recast_tensor(r_p, Int32)
            for i in cutlass.range_constexpr(cute.size(r_p2)):
                r_p2[i] = Int32(P_ONES)
            for r in cutlass.range_constexpr(2):
                self.row_l[r] = self.row_l[r] + (1.0 + acc_s[r] * 0.0)   # keeps S (and its WGMMAs) alive
        else:
            mults = self.multipliers(tile_scales)
            timing_codes = cfg.p_path == "timing_codes"
            idx, vals, mx = self.block_maxima(acc_s, kv_limit, masked, maxima=not timing_codes)
            if const_expr(timing_codes):   # fixed block constants: no maxima, shuffles or exponent chain
                nan_flag = [Float32(0.0), Float32(0.0)]
                consts = {(r, b): block_constants(Int32(127), cfg.shift, cfg.affine_a, cfg.affine_b, self.eighths)
                          for r in range(2) for b in range(self.nb)}
                self.codes(r_p, (idx, vals), (consts, {}, nan_flag), mults, (kv_limit, tile_idx), wait_pv)
            else:
                consts, _, nan_flag = self.block_constants(mx, mults, tile_scales)
                if const_expr(wait_pv):
                    cute.nvgpu.warpgroup.wait_group(0)
                r_p2 = cute.recast_tensor(r_p, Int32)
                for i in cutlass.range_constexpr(cute.size(r_p2)):
                    r_p2[i] = Int32(P_ONES)
                l_acc = [Float32(0.0), Float32(0.0)]
                for r in cutlass.range_constexpr(2):   # keeps the scales alive
                    for b in cutlass.range_constexpr(self.nb):
                        l_acc[r] = l_acc[r] + consts[r, b][0] + fma_rn(consts[r, b][1], Float32(0.0), Float32(0.0))
                self.add_to_denominator(l_acc, nan_flag)
