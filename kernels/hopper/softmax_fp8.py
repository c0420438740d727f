"""The FP8 P/V softmax on the score tiles of one consumer warpgroup (docs/numerics.md section 7, policies ``fp8``
and ``fp8pv``): the device-side twin of ``direct_p.DirectP`` for ``KernelConfig.pv_fp8``, with the same row
state, the same per-tile entry (``tile``) and the same register order, so the kernel's schedules run either.

Per key tile (``cfg.tile_n``: ``fp4vis.key_positions.softmax_tile``, 192 keys at D = 128, 128 at D = 64) and row:
the tile maximum of t = raw * s (s the softmax scale times log2 e, times 2^Eq 2^Ek for FP8 Q/K: positive, so the
maximum of the raw block maxima times s is the maximum of the products), the running maximum m_j = max(m_{j-1},
that), P = 2^(t - m_j + 8) (one FFMA and one MUFU.EX2 per score; in whole tiles ``cfg.poly_exp2`` of every 8 on the
FMA pipe instead: ``ptx.ex2_poly``, ``config.PV_FP8_POLY_EXP2``),
and P rounded to E4M3 (``cvt.rn.satfinite.e4m3x2``: P <= 256, never saturated) straight into the A fragment of the
P V WGMMA: slot k of a 32-key block is the accumulator column ``config.PV_FP8_KEY_ORDER[k]`` of the same thread, and
V^T holds its keys in that order, so no value moves between registers or threads. The denominator
(``cfg.row_sums_mma``, by head dim: ``fp4vis.key_positions.softmax_sums_rounded_p``):

* on the ALUs (D = 128): the unrounded P summed per 8-key block as a tree into this thread's part of ``row_l``,
  the quad's four parts added in the epilogue;
* on the tensor cores (D = 64): the kernel issues, beside each P V product, P times a block of E4M3 ones
  (``after_pv``), so the tensor cores sum the tile's rounded P into ``acc_l`` (about one ALU instruction per score
  fewer), and the next tile adds that sum to the row's float32 ``row_l`` once the product is complete. A tile's sum
  starts from zero: Hopper's FP8 WGMMA adds to its accumulator with truncation, and a sum carried over every key
  (far larger than each tile's part) came out low, failing the kernel's tests (docs/hopper_kernel.md).

The output accumulator is multiplied by 2^(m_{j-1} - m_j) just before the kernel issues the tile's P V product
(``before_pv``), when no product writes it. A row whose tiles are all masked keeps m = -inf and gets l = 0 (its
output 0, counted as an empty row).
"""

from __future__ import annotations

from dataclasses import dataclass

import cutlass.cute as cute
from cutlass import Float32, Int32, const_expr

from fp4vis.key_positions import P_E4M3_LOG2

from .direct_p import DirectP
from .ptx import (
    defined_here,
    e4m3x4,
    ex2_approx,
    ex2_poly,
    fma_rn,
    fmax_nan,
    order_before_wait,
    select_f32,
)


def softmax_fp8_for(cfg, s_log2: Float32, lane_q: Int32, acc_o: cute.Tensor, row_sums=None) -> SoftmaxFP8:
    """The softmax object of a ``pv_fp8`` kernel variant, its row state made in registers (m = -inf, l = 0). With
    ``cfg.row_sums_mma``, ``row_sums`` = (acc_l, product): the accumulator of the row-sum product (64 x
    ``ROW_SUM_N``, every column the tile's row sum) and the product's (TiledMma with ACCUMULATE off, one with it
    on, B fragment of the ones)."""
    row_m = cute.make_rmem_tensor((2,), Float32)      # the running row maximum of t (log2 units)
    row_l = cute.make_rmem_tensor((2,), Float32)      # the denominator relative to row_m (see the module's notes)
    row_corr = cute.make_rmem_tensor((2,), Float32)   # 2^(m_{j-1} - m_j) of the last tile, for ``before_pv``
    row_m.fill(-Float32.inf)
    row_l.fill(0.0)
    row_corr.fill(1.0)
    acc_l, product = row_sums if row_sums is not None else (None, None)
    if const_expr(acc_l is not None):
        acc_l.fill(0.0)
    return SoftmaxFP8(cfg, s_log2, lane_q, row_m, row_l, None, None, acc_o, row_corr, acc_l, product)


@dataclass
class SoftmaxFP8(DirectP):
    """Online softmax with E4M3 P of one thread's two rows (r0, r0 + 8); ``acc_o``: the output accumulator it
    rescales when the row maximum moves; ``acc_l`` (``cfg.row_sums_mma``): the last tile's row sums, made by the
    tensor cores, and ``row_l`` the whole row's before it; else ``row_l`` this thread's part of the row sums."""

    acc_o: cute.Tensor | None = None
    row_corr: cute.Tensor | None = None
    acc_l: cute.Tensor | None = None
    row_sum_product: tuple | None = None   # static: the row sums' two TiledMmas and the ones (``after_pv``)

    RUNTIME_FIELDS = DirectP.RUNTIME_FIELDS + ("acc_o", "row_corr", "acc_l")
    DENOMINATOR_SCALE = 1.0   # O = acc / l (Direct-P's 1/6 factors are its own)

    def tile(self, acc_s, r_p, tile_scales, kv_limit, tile_idx, masked: bool, wait_pv: bool = False):
        """P of one 64 x ``tile_n`` score tile into the A fragment r_p (E4M3 words) and the tile's 2^(m_{j-1} - m_j)
        for ``before_pv``. Reads the scores only (see ``DirectP.tile``); with ``wait_pv`` every P
        is made before waiting for the P V product in flight, and r_p is written after it. Plain Python, unrolled
        while the kernel is traced (its loops and dictionaries are over compile-time indices)."""
        _, s_pair, _ = self.multipliers(tile_scales)
        idx, vals, mx = self.block_maxima(acc_s, kv_limit, masked)
        n_poly = 0 if masked else self.cfg.poly_exp2   # masked tiles: -inf scores must give P = 0 exactly
        corr = [Float32(1.0), Float32(1.0)]
        p = {}   # P by accumulator index
        l_acc = [Float32(0.0), Float32(0.0)]   # the tile's P summed on the ALUs (without cfg.row_sums_mma)
        for r in range(2):
            t = mx[r, 0] * s_pair[r, 0]
            for b in range(1, self.nb):
                t = fmax_nan(t, mx[r, b] * s_pair[r, b])
            t = fmax_nan(t, cute.arch.shuffle_sync_bfly(t, offset=1))
            t = fmax_nan(t, cute.arch.shuffle_sync_bfly(t, offset=2))
            m_old = self.row_m[r]
            m_new = fmax_nan(m_old, t)
            # every key so far masked: keep m = -inf, and make P = 0 rather than NaN from (-inf) - (-inf)
            m_use = select_f32(Int32(m_new == -Float32.inf), Float32(0.0), m_new)
            corr[r] = ex2_approx(m_old - m_use)
            self.row_m[r] = m_new
            bias = Float32(P_E4M3_LOG2) - m_use
            for b in range(self.nb):
                ys = (fma_rn(vals[r, b][t8], s_pair[r, b], bias) for t8 in range(8))   # lazily: each beside its 2^y
                block = [ex2_poly(y) if (t8 * n_poly) % 8 < n_poly else ex2_approx(y) for t8, y in enumerate(ys)]
                for t8 in range(8):
                    p[idx[r, b][t8]] = block[t8]
                if const_expr(self.cfg.row_sums_mma):
                    if const_expr(wait_pv):   # half of each block pinned: ptxas keeps the block before the wait
                        order_before_wait(block[4:], kv_limit)
                else:   # a tree per block: short dependency chains for the denominator's adds
                    pairs = [block[2 * i] + block[2 * i + 1] for i in range(4)]
                    l_acc[r] = l_acc[r] + ((pairs[0] + pairs[1]) + (pairs[2] + pairs[3]))
        # A fragment word w = r + 2 kh + 4 kb holds slots 16 kh + 4 lane_q + 0..3 of key block kb: the
        # accumulator's columns (chunk 4 kb + 2 kh, c = 0, 1) and (chunk 4 kb + 2 kh + 1, c = 0, 1) of row r
        words = {}
        for r in range(2):
            for kb in range(self.nb):
                for kh in range(2):
                    i0 = 2 * r + 4 * (4 * kb + 2 * kh)
                    words[r + 2 * kh + 4 * kb] = e4m3x4(p[i0], p[i0 + 1], p[i0 + 4], p[i0 + 5])
        if const_expr(wait_pv):
            if const_expr(not self.cfg.row_sums_mma):
                order_before_wait([l_acc[0] + l_acc[1]], kv_limit)   # kv_limit >= 1: never stores
            cute.nvgpu.warpgroup.wait_group(0)
        r_p4 = cute.recast_tensor(r_p, Int32)
        for w, word in words.items():
            r_p4[w] = defined_here(word) if wait_pv else word
        for r in range(2):
            if const_expr(self.cfg.row_sums_mma):   # the last tile's sum (its product is complete), relative to m_j
                self.row_l[r] = (self.row_l[r] + self.acc_l[2 * r]) * corr[r]
            else:
                self.row_l[r] = self.row_l[r] * corr[r] + l_acc[r]
            self.row_corr[r] = corr[r]

    def row_denominator(self, r: int) -> Float32:
        """l of this thread's row r0 + 8 r once the last P V product is complete: with ``cfg.row_sums_mma``
        ``row_l`` and the last tile's sum (column 0 of ``acc_l``: accumulator index 2 r), else the quad's parts."""
        if const_expr(self.cfg.row_sums_mma):
            return self.row_l[r] + self.acc_l[2 * r]
        return super().row_denominator(r)

    def after_pv(self, r_p):
        """With ``cfg.row_sums_mma``, issued right after the P V product, in its WGMMA group: acc_l = P times ones,
        the tile's row sums of the rounded P (from zero: the first key block's WGMMA does not accumulate)."""
        if const_expr(self.cfg.row_sums_mma):
            sum_mma, sum_mma_acc, ones = self.row_sum_product
            for kb in range(cute.size(r_p, mode=[2])):   # every key block against the same ones
                cute.gemm(sum_mma if kb == 0 else sum_mma_acc, self.acc_l, r_p[None, None, kb], ones, self.acc_l)

    def before_pv(self):
        """The output accumulator times the last tile's 2^(m_{j-1} - m_j), right before the P V product of that
        tile is issued (no product in flight reads or writes it then; in the ping-pong schedule while the tensor
        cores compute the next scores). Every tile, unconditionally: a warp-uniform branch that skips it where no
        row's maximum moved measured 2-11 % slower on the H100
        (benchmarks/results/20261206b_h100_kernel_rescale-branch.json)."""
        for i in range(cute.size(self.acc_o)):
            self.acc_o[i] = self.acc_o[i] * self.row_corr[(i // 2) % 2]
