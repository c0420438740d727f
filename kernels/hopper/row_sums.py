"""The FP8 P/V softmax's denominator on the tensor cores (``KernelConfig.row_sums_mma``: D = 64, where the contract
sums the rounded P, docs/numerics.md section 7): P times a (``PV_FP8_K_BLOCK`` x ``ROW_SUM_N``) block of E4M3 ones,
one m64n8k32 WGMMA per 32-key block of the P V product's A fragment. Every piece of it apart from the per-tile use
(``softmax_fp8.SoftmaxFP8.after_pv``): the host-side atoms and layout, the ones in shared memory, each consumer
thread's operands.
"""

from __future__ import annotations

import cutlass
import cutlass.cute as cute
import cutlass.utils.hopper_helpers as sm90_utils
from cutlass import Float32, Int32, const_expr
from cutlass.utils import LayoutEnum

from .config import E4M3_ONES_WORD, PV_FP8_K_BLOCK, ROW_SUM_N, TILE_M_PER_WG

ONES_BYTES = ROW_SUM_N * PV_FP8_K_BLOCK   # one block of ones that every key block's WGMMA reads: 256 bytes


def row_sum_atoms(in_dtype):
    """Host side: (TiledMma with ACCUMULATE off for the first key block, one with it on for the others, as for
    Q K^T; the ones' shared-memory layout, 32-byte swizzled K-major)."""
    k_major = cute.nvgpu.warpgroup.OperandMajorMode.K
    sum_mma, sum_mma_acc = (sm90_utils.make_trivial_tiled_mma(
        in_dtype, in_dtype, k_major, k_major, Float32, (1, 1, 1), (TILE_M_PER_WG, ROW_SUM_N),
        cute.nvgpu.warpgroup.OperandSource.RMEM) for _ in range(2))
    ones_sl = sm90_utils.make_smem_layout_b(LayoutEnum.ROW_MAJOR, (TILE_M_PER_WG, ROW_SUM_N, PV_FP8_K_BLOCK),
                                            in_dtype, 1)
    return sum_mma, sum_mma_acc, ones_sl


@cute.jit
def fill_ones(ones_bytes: cute.Tensor, tidx, threads: cutlass.Constexpr):
    """Every byte of the ones E4M3 1.0 (then their swizzled layout does not matter), one word per thread and round,
    by all ``threads`` of the CTA before its first barrier; then made visible to the WGMMAs (the async proxy)."""
    words = cute.recast_tensor(ones_bytes, Int32)
    n_words = ONES_BYTES // 4
    for i in cutlass.range_constexpr(-(-n_words // threads)):
        w = tidx + i * threads
        if w < n_words:
            words[w] = Int32(E4M3_ONES_WORD)
    cute.arch.fence_proxy("async.shared", space="cta")


def row_sum_operands(row_sums, tid_wg):
    """This consumer thread's (accumulator, (TiledMma ACCUMULATE off, on, B fragment of the ones)) of the product,
    from ``row_sums`` = (the two TiledMmas, the ones in shared memory); None without ``row_sums``."""
    if const_expr(row_sums is None):
        return None
    sum_mma, sum_mma_acc, sOnes = row_sums
    thr_sum = sum_mma.get_slice(tid_wg)
    acc_l = thr_sum.make_fragment_C(thr_sum.partition_shape_C((TILE_M_PER_WG, ROW_SUM_N)))
    sum_mma.set(cute.nvgpu.warpgroup.Field.ACCUMULATE, False)
    sum_mma_acc.set(cute.nvgpu.warpgroup.Field.ACCUMULATE, True)
    ones = thr_sum.make_fragment_B(thr_sum.partition_B(sOnes))[None, None, 0, 0]
    return acc_l, (sum_mma, sum_mma_acc, ones)
