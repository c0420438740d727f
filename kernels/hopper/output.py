"""The output of one consumer warpgroup's 64 query rows: O = acc / l (Direct-P: acc / (6 l); ``pv_fp8``: times V's
per-channel 2^Ev), rounded to the output dtype and stored from registers, and the range record's counts of those
rows (docs/numerics.md section 8).

In three parts, so that the ping-pong schedule runs the loads while its last P V product is still on the tensor
cores: ``channel_scales`` (with ``pv_fp8``, V's per-channel scales: the epilogue's longest latency), ``denominators``
(the reciprocals of the row sums: for Direct-P also under that product; the FP8 P/V softmax's row sums are that
product's) and ``store``. Each thread holds pairs of adjacent columns of two rows (accumulator index
i = c + 2 r + 4 chunk), so it stores one 32-bit word per pair: half the store instructions of one per element,
and no register moves to take the upper half of a packed pair.
"""

from __future__ import annotations

import cutlass
import cutlass.cute as cute
from cutlass import Float32, Int32, const_expr

from fp4vis.formats import OVERFLOW_BF16, OVERFLOW_FP16

from .config import TILE_M_PER_WG, KernelConfig
from .ptx import abs_max_nan, count_zero_row, not_below, record_range


class OutputTile:
    """The epilogue of a consumer warpgroup (static: the kernel variant and its output dtype)."""

    def __init__(self, cfg: KernelConfig, o_dtype):
        self.cfg = cfg
        self.o_dtype = o_dtype
        self.head_dim = cfg.head_dim

    def make_factors(self, acc_o: cute.Tensor):
        """Registers for ``denominators`` and ``channel_scales``, (inv, den, col_scale): per row 1 / l and l, and with
        ``pv_fp8`` V's scale per column of this thread (index c + 2 chunk)."""
        inv = cute.make_rmem_tensor((2,), Float32)
        den = cute.make_rmem_tensor((2,), Float32)
        col_scale = cute.make_rmem_tensor((cute.size(acc_o) // 2,), Float32) if self.cfg.pv_fp8 else None
        return inv, den, col_scale

    @cute.jit
    def channel_scales(self, thr_pv, mVs, head, factors):
        """With ``pv_fp8``: V's per-channel scales of ``head`` = (h_idx, b_idx), exact (powers of two)."""
        h_idx, b_idx = head
        col_scale = factors[2]
        if const_expr(self.cfg.pv_fp8):
            tOcO = thr_pv.partition_C(cute.make_identity_tensor((TILE_M_PER_WG, self.head_dim)))
            for k in cutlass.range_constexpr(cute.size(col_scale)):
                col_scale[k] = mVs[tOcO[k % 2 + 4 * (k // 2)][1], h_idx, b_idx]

    @cute.jit
    def denominators(self, dp, factors):
        """The row denominators (``dp.row_denominator``) and their reciprocals."""
        inv, den, _ = factors
        for r in cutlass.range_constexpr(2):
            den[r] = dp.row_denominator(r)
            inv[r] = 0.0
            if den[r] != 0.0:       # 0: every probability underflowed; NaN (non-finite input) stays NaN
                inv[r] = 1.0 / den[r]

    @cute.jit
    def store(self, thr_pv, acc_o, dp, mO, rows, head, factors, record_args):
        """O of this thread's rows below Sq (``rows`` = (the warpgroup's first row, Sq)) of ``head`` = (h_idx, b_idx),
        one 32-bit word per column pair; then the range record's counts."""
        row0, seqlen_q = rows
        h_idx, b_idx = head
        inv, den, col_scale = factors
        tOcO = thr_pv.partition_C(cute.make_identity_tensor((TILE_M_PER_WG, self.head_dim)))
        for i in cutlass.range_constexpr(cute.size(acc_o)):
            acc_o[i] = acc_o[i] * inv[(i // 2) % 2]
        if const_expr(self.cfg.pv_fp8):
            for i in cutlass.range_constexpr(cute.size(acc_o)):
                acc_o[i] = acc_o[i] * col_scale[i % 2 + 2 * (i // 4)]
        r_o = cute.make_rmem_tensor_like(acc_o, self.o_dtype)
        r_o.store(acc_o.load().to(self.o_dtype))
        r_words = cute.recast_tensor(r_o, Int32)
        # this head's (S, D) output as words of two columns: the launcher's output is contiguous (B, S, H, D), so
        # every row starts on a word
        m_o = mO[None, None, h_idx, b_idx]
        words = cute.make_tensor(cute.recast_ptr(m_o.iterator, dtype=Int32),
                                 cute.make_layout((seqlen_q, self.head_dim // 2), stride=(m_o.stride[0] // 2, 1)))
        for w in cutlass.range_constexpr(cute.size(r_words)):
            row, col = tOcO[2 * w]
            if row + row0 < seqlen_q:
                words[row + row0, col // 2] = r_words[w]
        if const_expr(self.cfg.range_record):
            self.record(acc_o, den, tOcO, row0, seqlen_q, dp.lane_q, dp.saturated, record_args)

    @cute.jit
    def record(self, acc_o, den, tOcO, row0, seqlen_q, lane_q, saturated, record_args):
        """The range record of this thread's rows (docs/numerics.md section 8), as the reference counts
        them: saturated (row, block) pairs (each counted once: in "lane" mode all four threads of a
        quad computed the same pairs, so lane 0 reports them), rows of Sq whose denominator is 0
        (lane 0 of the quad) and output elements of rows of Sq that are NaN or round to Inf in the
        output dtype. Non-zero counts go to the record with the call's number (``record_range``)."""
        record, flag, call = record_args
        limit = OVERFLOW_BF16 if const_expr(self.cfg.out_dtype == "bf16") else OVERFLOW_FP16
        worst = cute.make_rmem_tensor((1,), Float32)
        worst.fill(0.0)
        for i in cutlass.range_constexpr(cute.size(acc_o)):
            if tOcO[i][0] + row0 < seqlen_q:
                worst[0] = abs_max_nan(worst[0], acc_o[i])
        nonfinite = cute.make_rmem_tensor((1,), Int32)
        nonfinite.fill(0)
        if not_below(worst[0], limit) != 0:   # rare: count the elements
            for i in cutlass.range_constexpr(cute.size(acc_o)):
                if tOcO[i][0] + row0 < seqlen_q:
                    nonfinite[0] = nonfinite[0] + not_below(abs_max_nan(Float32(0.0), acc_o[i]), limit)
        empty = Int32(0)
        for r in cutlass.range_constexpr(2):
            empty = count_zero_row(empty, den[r], tOcO[2 * r][0] + row0, seqlen_q, lane_q)
        sat = Int32(0)                       # the softmax saturates no P (P <= 2^8 < 448)
        if const_expr(saturated is not None):
            sat = saturated[0]
            if const_expr(self.cfg.block_scales != "quad"):
                sat = sat * Int32(lane_q == 0)
        record_range(record, flag, call, sat, empty, nonfinite[0])
