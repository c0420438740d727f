"""Direct-P FP4 attention forward for Hopper (sm_90a), written in CuTe DSL.

What the kernel consumes (produced by ``prepass.py``):

* ``q``, ``k``: the *decoded* NVFP4 operands Q-hat and K-hat, stored as BF16 (a decoded NVFP4 value
  has at most 6 significant bits, so BF16 holds it exactly), SDPA layout (B, H, S, D) contiguous.
  For the anchored policies K-hat (and V-hat) are already anchor-permuted: the anchor samples sit
  at physical key positions 0..n-1.
* ``v``: the MXFP4 value operand as ``alpha * c`` in BF16 (exact; the two factors 1/6 of P-tilde
  and V-hat are applied once, at the end).
* With ``pv_fp8`` (policies ``fp8`` and ``fp8pv``, docs/numerics.md section 7) ``v`` is V^T, E4M3 bytes (B, H, D,
  Skv rounded up to 32) with a power-of-two scale per channel (``v_scale``, (B, H, D)), and the P path is the online
  softmax of ``softmax_fp8.SoftmaxFP8`` (E4M3 P from registers, FP8 P V WGMMA) in place of Direct-P; at D = 64 its
  row sums are a product on the tensor cores beside P V (``row_sums.py``).
* With ``qk_fp8`` (policy ``fast_fp8qk``, not exact to docs/numerics.md) ``q``, ``k`` are instead E4M3 values with
  power-of-two scales per query row (``q_scale``) and per 32-key block (``k_scale``), and S = Q K^T
  runs on FP8 WGMMA (twice BF16's rate; FP8 accumulation is not exact: docs/numerics.md section 7). The scales
  factor out exactly: they multiply the per-(row, block) constants of Direct-P, never a score.

What it computes (docs/numerics.md section 2), per query row i and key block B of 32 keys:
``raw = Q-hat K-hat^T`` in FP32 (BF16 WGMMA, exact products, FP32 sums), the block maximum, the E8M0
block exponent, the affine (or, at native positions, exp2) FMA, E2M1 round-to-nearest-even with
saturation (emulated with integer/float tricks: Hopper has no E2M1 conversion), the stored scale
``alpha'``, the exact code sums of the denominator, ``P-tilde * alpha'`` in BF16 (exact) for a BF16
PV WGMMA with FP32 accumulation, and ``O = acc / (6 * sum_B alpha'_B c_B)``.

Structure (flash-attn-4 sm90 / CUTLASS Hopper FMHA style, written from scratch for this method):
one TMA producer warpgroup and two consumer warpgroups; each consumer warpgroup owns 64 query
rows of the 128-row CTA tile, and both walk the same K/V pipeline (TMA -> SMEM, mbarriers).
There is no online maximum and no rescaling of the output accumulator: the row reference m_i is
fixed (0, or the anchor maximum plus the margin, computed from the first key tile, which holds the
anchors). One class per kernel: ``__init__`` holds the static configuration, ``__call__`` (jitted)
builds layouts/TMA atoms and launches, ``kernel`` is the device entry, warp roles are methods; Direct-P itself
is a device-side object of its own (``direct_p.DirectP``: the row state and the per-tile stages), and so is the
output (``output.OutputTile``: the epilogue and the range record's counts).
"""

from __future__ import annotations

import cutlass
import cutlass.cute as cute
import cutlass.pipeline as pipeline
import cutlass.utils as utils
import cutlass.utils.hopper_helpers as sm90_utils
from cutlass import Float32, Int32, Int64, const_expr
from cutlass.utils import LayoutEnum

from .config import (
    BAR_SCHED,
    KV_KEYS_IN_FLIGHT,
    ONES_ALIGN_BYTES,
    PV_FP8_TILES,
    REGS_2CTA,
    REGS_CONSUMER,
    REGS_PRODUCER,
    SMEM_1CTA,
    SMEM_2CTA,
    TILE_M_PER_WG,
    KernelConfig,
)
from .direct_p import direct_p_for
from .output import OutputTile
from .ptx import decide_scale_range
from .row_sums import ONES_BYTES, fill_ones, row_sum_atoms, row_sum_operands
from .softmax_fp8 import softmax_fp8_for


class DirectPAttentionSm90:
    """Direct-P FP4 attention forward, non-causal, for sm_90a.

    Host entry: ``__call__(q, k, v, o, q_scale, k_scale, key_lengths, v_scale, s_log2, m_offset, range_record,
    range_flag, call_number, stream)`` with q/k/v/o in
    SDPA's layout (B, H, S, D), D contiguous, BF16 q/k/v (with ``qk_fp8``: q, k E4M3 bytes as uint8),
    ``o`` in ``out_dtype``; ``q_scale`` (B, H, Sq) and ``k_scale`` (B, H, key blocks padded to whole
    128-key tiles) float32 powers of two (read only with ``qk_fp8``); ``s_log2 = scale * log2(e)``;
    ``m_offset`` the anchor margin in raw-score units (ignored without anchors); ``key_lengths`` (int32 (B,), or
    None) and ``v_scale`` (float32 (B, H, D) with ``pv_fp8``, else None). With
    ``cfg.range_record``, ``range_record`` is the address of the device record's int32 fields and
    ``range_flag`` that of the host-visible flag (``fp4vis.backends.range_record``): threads whose rows
    saw saturated P blocks, empty rows or non-finite outputs add their counts there and store
    ``call_number`` into the flag (read only then; 0 otherwise). The kernel works on
    (S, D, H, B) / (N, H, B) views, made here from the layouts (no per-call view on the host).
    """

    def __init__(self, cfg: KernelConfig):
        if cfg.head_dim not in (64, 128):
            raise ValueError(f"head_dim: the Hopper kernel supports D = 64 and 128, got {cfg.head_dim}")
        if cfg.tile_n not in ((64, 128) + (PV_FP8_TILES if cfg.pv_fp8 else ())):
            raise ValueError(f"tile_n: 64 or 128 ({PV_FP8_TILES} with pv_fp8), got {cfg.tile_n}")
        if cfg.anchor > cfg.tile_n:
            raise ValueError(f"anchor: at most tile_n = {cfg.tile_n} anchor samples (one key tile), got {cfg.anchor}")
        if cfg.block_scales == "quad" and (cfg.tile_n != 128 or cfg.p_path in ("none", "timing_codes")):
            raise ValueError(f"block_scales: 'quad' needs 128-key tiles and block scales (tile_n {cfg.tile_n}, "
                             f"p_path {cfg.p_path!r}); KernelConfig.make picks 'lane' there")
        if cfg.ctas_per_sm not in (1, 2) or (cfg.ctas_per_sm == 2 and (cfg.num_wg != 1 or cfg.schedule != "serial")):
            raise ValueError(f"ctas_per_sm: 1, or 2 with num_wg = 1 and schedule 'serial', got {cfg.ctas_per_sm} "
                             f"(num_wg {cfg.num_wg}, schedule {cfg.schedule!r})")
        self.cfg = cfg
        self.head_dim = cfg.head_dim
        self.o_dtype = cutlass.BFloat16 if cfg.out_dtype == "bf16" else cutlass.Float16
        self.in_dtype = cutlass.Float8E4M3FN if cfg.pv_fp8 else cutlass.BFloat16     # V and P
        self.qk_dtype = cutlass.Float8E4M3FN if cfg.qk_fp8 else cutlass.BFloat16
        # K and V tiles alternate through one ring of stages the size of the larger tile; a tile of half that
        # size (FP8 beside BF16) sees a view of the ring with twice the stages and uses the even ones
        k_tile, v_tile = (cfg.tile_n * cfg.head_dim * (1 if fp8 else 2) for fp8 in (cfg.qk_fp8, cfg.pv_fp8))
        self.stage_bytes = max(k_tile, v_tile)
        self.k_slot_factor = self.stage_bytes // k_tile
        self.v_slot_factor = self.stage_bytes // v_tile
        self.acc_dtype = Float32
        self.num_wg = cfg.num_wg
        self.tile_m = TILE_M_PER_WG * cfg.num_wg
        self.tile_n = cfg.tile_n
        self.qk_tiler = (TILE_M_PER_WG, cfg.tile_n, cfg.head_dim)
        self.pv_tiler = (TILE_M_PER_WG, cfg.head_dim, cfg.tile_n)
        self.threads = 128 * (cfg.num_wg + 1)
        self.kv_stages = 2 * -(-KV_KEYS_IN_FLIGHT // cfg.tile_n)   # K and V of at least KV_KEYS_IN_FLIGHT keys
        self.buffer_align_bytes = 1024
        self.regs_producer, self.regs_consumer = REGS_PRODUCER, REGS_CONSUMER[cfg.num_wg]
        if cfg.ctas_per_sm == 2:
            self.regs_producer, self.regs_consumer = REGS_2CTA
        # as many K/V stages as fit beside the barriers and Q (docs/hopper_kernel.md), at least K_j's and V_j's
        smem = SMEM_2CTA if cfg.ctas_per_sm == 2 else SMEM_1CTA
        self.kv_stages = min(self.kv_stages, (smem - self.dynamic_smem_bytes(0)) // self.stage_bytes)
        if self.kv_stages < 2:
            raise ValueError(f"tile_n {cfg.tile_n}: fewer than two K/V stages fit in {smem} bytes of shared memory")

    def dynamic_smem_bytes(self, kv_stages: int | None = None) -> int:
        """Shared memory of the layout ``__call__`` builds: the barriers (the first aligned 1 KB), the Q
        tile and ``kv_stages`` (default: the kernel's) stages of the K/V ring."""
        stages = self.kv_stages if kv_stages is None else kv_stages
        q_bytes = self.tile_m * self.head_dim * (1 if self.cfg.qk_fp8 else 2)
        return self.buffer_align_bytes + q_bytes + stages * self.stage_bytes

    # ---------------------------------------------------------------- host side
    @cute.jit
    def __call__(self, mQ: cute.Tensor, mK: cute.Tensor, mV: cute.Tensor, mO: cute.Tensor,
                 mQs: cute.Tensor, mKs: cute.Tensor, mKeyLens: cute.Tensor | None, mVs: cute.Tensor | None,
                 s_log2: Float32, m_offset: Float32, range_record: Int64, range_flag: Int64, call_number: Int32,
                 stream):
        # (B, H, S, D) -> (S, D, H, B); (B, H, N) -> (N, H, B)
        mQ, mK, mV, mO = [cute.make_tensor(t.iterator, cute.select(t.layout, mode=[2, 3, 1, 0]))
                          for t in (mQ, mK, mV, mO)]
        mQs, mKs = [cute.make_tensor(t.iterator, cute.select(t.layout, mode=[2, 1, 0])) for t in (mQs, mKs)]
        if const_expr(self.cfg.pv_fp8):   # (B, H, D) -> (D, H, B)
            mVs = cute.make_tensor(mVs.iterator, cute.select(mVs.layout, mode=[2, 1, 0]))
        if const_expr(self.cfg.qk_fp8):   # E4M3 bytes arrive as uint8
            mQ = cute.make_tensor(cute.recast_ptr(mQ.iterator, dtype=self.qk_dtype), mQ.layout)
            mK = cute.make_tensor(cute.recast_ptr(mK.iterator, dtype=self.qk_dtype), mK.layout)
        K_MAJOR = cute.nvgpu.warpgroup.OperandMajorMode.K
        MN_MAJOR = cute.nvgpu.warpgroup.OperandMajorMode.MN
        if const_expr(self.cfg.pv_fp8):
            # V^T bytes: (B, H, D, S') -> (N = D, K = S', H, B), K contiguous, as the FP8 WGMMA needs
            mVt = cute.make_tensor(cute.recast_ptr(mV.iterator, dtype=self.in_dtype), mV.layout)
        else:
            # V as the B operand of P V: (N = D, K = S, H, B), N contiguous.
            mVt = cute.make_tensor(mV.iterator, cute.make_layout(
                (mV.shape[1], mV.shape[0], mV.shape[2], mV.shape[3]),
                stride=(mV.stride[1], mV.stride[0], mV.stride[2], mV.stride[3])))
        v_major = K_MAJOR if self.cfg.pv_fp8 else MN_MAJOR

        qk_mma = sm90_utils.make_trivial_tiled_mma(
            self.qk_dtype, self.qk_dtype, K_MAJOR, K_MAJOR, self.acc_dtype, (1, 1, 1),
            self.qk_tiler[:2])
        # a second copy whose ACCUMULATE flag stays on (the first k-block uses qk_mma with it off):
        # flags are set once at kernel start, never inside staged control flow
        qk_mma_acc = sm90_utils.make_trivial_tiled_mma(
            self.qk_dtype, self.qk_dtype, K_MAJOR, K_MAJOR, self.acc_dtype, (1, 1, 1),
            self.qk_tiler[:2])
        pv_mma = sm90_utils.make_trivial_tiled_mma(
            self.in_dtype, self.in_dtype, K_MAJOR, v_major, self.acc_dtype, (1, 1, 1),
            self.pv_tiler[:2], cute.nvgpu.warpgroup.OperandSource.RMEM)
        sum_mma, sum_mma_acc, ones_sl = row_sum_atoms(self.in_dtype) if self.cfg.row_sums_mma else (None,) * 3

        q_sl = sm90_utils.make_smem_layout_a(LayoutEnum.ROW_MAJOR, self.qk_tiler, self.qk_dtype, self.num_wg)
        k_sl = sm90_utils.make_smem_layout_b(LayoutEnum.ROW_MAJOR, self.qk_tiler, self.qk_dtype,
                                             self.kv_stages * self.k_slot_factor)
        v_sl = sm90_utils.make_smem_layout_b(LayoutEnum.ROW_MAJOR if self.cfg.pv_fp8 else LayoutEnum.COL_MAJOR,
                                             self.pv_tiler, self.in_dtype, self.kv_stages * self.v_slot_factor)

        g2s = cute.nvgpu.cpasync.CopyBulkTensorTileG2SOp()
        tma_q, tQ = cute.nvgpu.cpasync.make_tiled_tma_atom(
            g2s, mQ, cute.slice_(q_sl, (None, None, 0)), (TILE_M_PER_WG, self.head_dim))
        tma_k, tK = cute.nvgpu.cpasync.make_tiled_tma_atom(
            g2s, mK, cute.slice_(k_sl, (None, None, 0)), (self.tile_n, self.head_dim))
        tma_v, tV = cute.nvgpu.cpasync.make_tiled_tma_atom(
            g2s, mVt, cute.slice_(v_sl, (None, None, 0)), (self.head_dim, self.tile_n))
        self.q_bytes = cute.size_in_bytes(self.qk_dtype, cute.slice_(q_sl, (None, None, 0)))
        self.k_bytes = cute.size_in_bytes(self.qk_dtype, cute.slice_(k_sl, (None, None, 0)))
        self.kv_bytes = cute.size_in_bytes(self.in_dtype, cute.slice_(v_sl, (None, None, 0)))

        @cute.struct
        class SharedStorage:
            q_mbar: cute.struct.MemRange[cutlass.Int64, self.num_wg * 2]
            kv_mbar: cute.struct.MemRange[cutlass.Int64, self.kv_stages * 2]
            if const_expr(self.cfg.row_sums_mma):
                sOnes: cute.struct.Align[cute.struct.MemRange[self.in_dtype, cute.cosize(ones_sl)], ONES_ALIGN_BYTES]
            sQ: cute.struct.Align[cute.struct.MemRange[self.qk_dtype, cute.cosize(q_sl)],
                                  self.buffer_align_bytes]
            sKV: cute.struct.Align[cute.struct.MemRange[self.in_dtype, cute.cosize(v_sl)],
                                   self.buffer_align_bytes]

        self.shared_storage = SharedStorage
        if const_expr(self.cfg.ctas_per_sm == 2 and SharedStorage.size_in_bytes() > SMEM_2CTA):
            raise ValueError(f"ctas_per_sm = 2: {SharedStorage.size_in_bytes()} bytes of shared memory per CTA, "
                             f"more than the {SMEM_2CTA} two CTAs per SM leave each")
        grid = (cute.ceil_div(mQ.shape[0], self.tile_m), mQ.shape[2], mQ.shape[3])
        # two CTAs per SM: ptxas caps the launch at 128 registers per thread (setmaxnreg rebalances them);
        # the carveout is given (all shared memory), else the DSL asks the device for it while compiling
        self.kernel(qk_mma, qk_mma_acc, pv_mma, sum_mma, sum_mma_acc, tma_q, tQ, tma_k, tK, tma_v, tV, mO, mQs, mKs,
                    mKeyLens, mVs, s_log2, m_offset, range_record, range_flag, call_number, q_sl, k_sl, v_sl,
                    ones_sl).launch(
            grid=grid, block=[self.threads, 1, 1], smem=SharedStorage.size_in_bytes(),
            stream=stream, min_blocks_per_mp=self.cfg.ctas_per_sm,
            preferred_smem_carveout=100 if self.cfg.ctas_per_sm > 1 else None)

    # ---------------------------------------------------------------- device side
    @cute.kernel
    def kernel(self, qk_mma: cute.TiledMma, qk_mma_acc: cute.TiledMma, pv_mma: cute.TiledMma,
               sum_mma: cute.TiledMma | None, sum_mma_acc: cute.TiledMma | None, tma_q: cute.CopyAtom,
               tQ: cute.Tensor, tma_k: cute.CopyAtom, tK: cute.Tensor, tma_v: cute.CopyAtom, tV: cute.Tensor,
               mO: cute.Tensor, mQs: cute.Tensor, mKs: cute.Tensor,
               mKeyLens: cute.Tensor | None, mVs: cute.Tensor | None, s_log2: Float32, m_offset: Float32,
               range_record: Int64,
               range_flag: Int64, call_number: Int32, q_sl: cute.ComposedLayout, k_sl: cute.ComposedLayout,
               v_sl: cute.ComposedLayout, ones_sl: cute.ComposedLayout | None):
        tidx, _, _ = cute.arch.thread_idx()
        m_blk, h_idx, b_idx = cute.arch.block_idx()
        warp_idx = cute.arch.make_warp_uniform(cute.arch.warp_idx())
        wg_idx = cute.arch.make_warp_uniform(tidx // 128)

        smem = utils.SmemAllocator()
        storage = smem.allocate(self.shared_storage)
        q_pipe = pipeline.PipelineTmaAsync.create(
            barrier_storage=storage.q_mbar.data_ptr(), num_stages=self.num_wg,
            producer_group=pipeline.CooperativeGroup(pipeline.Agent.Thread, 1),
            consumer_group=pipeline.CooperativeGroup(pipeline.Agent.Thread, 4),
            tx_count=self.q_bytes, defer_sync=True)
        kv_pipe = pipeline.PipelineTmaAsync.create(
            barrier_storage=storage.kv_mbar.data_ptr(), num_stages=self.kv_stages,
            producer_group=pipeline.CooperativeGroup(pipeline.Agent.Thread, 1),
            consumer_group=pipeline.CooperativeGroup(pipeline.Agent.Thread, 4 * self.num_wg),
            tx_count=max(self.k_bytes, self.kv_bytes), defer_sync=True)
        row_sums = None
        if const_expr(self.cfg.row_sums_mma):   # the ones, written before the CTA's first barrier, seen by WGMMA
            sOnes = storage.sOnes.get_tensor(ones_sl.outer, swizzle=ones_sl.inner)
            fill_ones(storage.sOnes.get_tensor(cute.make_layout(ONES_BYTES)), tidx, self.threads)
            row_sums = (sum_mma, sum_mma_acc, sOnes)
        pipeline.pipeline_init_arrive(cluster_shape_mn=(1, 1, 1), is_relaxed=True)
        pipeline.pipeline_init_wait(cluster_shape_mn=(1, 1, 1))

        sQ = storage.sQ.get_tensor(q_sl.outer, swizzle=q_sl.inner)
        sV = storage.sKV.get_tensor(v_sl.outer, swizzle=v_sl.inner)
        sK = cute.make_tensor(cute.recast_ptr(sV.iterator, k_sl.inner, dtype=self.qk_dtype), k_sl.outer)

        seqlen_q = tQ.shape[0]
        seqlen_k = tK.shape[0]
        if const_expr(self.cfg.key_lengths):   # a key-masked call: this batch element's kept keys, gathered first
            seqlen_k = mKeyLens[b_idx]
        n_tiles = cute.ceil_div(seqlen_k, self.tile_n)

        if wg_idx == 0:
            cute.arch.warpgroup_reg_dealloc(self.regs_producer)
            if warp_idx == 0:
                self.producer(tma_q, tQ, tma_k, tK, tma_v, tV, sQ, sK, sV, q_pipe, kv_pipe,
                              m_blk, h_idx, b_idx, n_tiles)
            # the pre-pass's scale range (it ran before), once per call: an idle thread (warp 1) of CTA 0, or
            if const_expr(self.cfg.range_record and not self.cfg.decide_after_epilogue):
                if tidx == 32 and m_blk == 0 and h_idx == 0 and b_idx == 0:
                    decide_scale_range(range_record, range_flag, call_number)
        else:
            cute.arch.warpgroup_reg_alloc(self.regs_consumer)
            self.consumer(qk_mma, qk_mma_acc, pv_mma, sQ, sK, sV, q_pipe, kv_pipe, mO, mQs, mKs, mVs, s_log2, m_offset,
                          (range_record, range_flag, call_number), tidx, wg_idx - 1, m_blk, h_idx, b_idx, seqlen_q,
                          seqlen_k, n_tiles, row_sums)
            if const_expr(self.cfg.range_record and self.cfg.decide_after_epilogue):   # its first consumer thread
                if tidx == 128 and m_blk == 0 and h_idx == 0 and b_idx == 0:   # after its epilogue
                    decide_scale_range(range_record, range_flag, call_number)

    @cute.jit
    def producer(self, tma_q, tQ, tma_k, tK, tma_v, tV, sQ, sK, sV, q_pipe, kv_pipe,
                 m_blk, h_idx, b_idx, n_tiles):
        """TMA producer warp: both Q tiles once, then K_j, V_j alternating through the pipeline."""
        gQ = cute.local_tile(tQ[None, None, h_idx, b_idx], (TILE_M_PER_WG, self.head_dim), (None, 0))
        gK = cute.local_tile(tK[None, None, h_idx, b_idx], (self.tile_n, self.head_dim), (None, 0))
        gV = cute.local_tile(tV[None, None, h_idx, b_idx], (self.head_dim, self.tile_n), (0, None))
        tQsQ, tQgQ = cute.nvgpu.cpasync.tma_partition(
            tma_q, 0, cute.make_layout(1), cute.group_modes(sQ, 0, 2), cute.group_modes(gQ, 0, 2))
        tKsK, tKgK = cute.nvgpu.cpasync.tma_partition(
            tma_k, 0, cute.make_layout(1), cute.group_modes(sK, 0, 2), cute.group_modes(gK, 0, 2))
        tVsV, tVgV = cute.nvgpu.cpasync.tma_partition(
            tma_v, 0, cute.make_layout(1), cute.group_modes(sV, 0, 2), cute.group_modes(gV, 0, 2))

        q_state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Producer, self.num_wg)
        for w in cutlass.range_constexpr(self.num_wg):
            q_pipe.producer_acquire(q_state)
            cute.copy(tma_q, tQgQ[None, m_blk * self.num_wg + w], tQsQ[None, q_state.index],
                      tma_bar_ptr=q_pipe.producer_get_barrier(q_state))
            q_state.advance()

        kv_state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Producer, self.kv_stages)
        for j in cutlass.range(n_tiles, unroll=1):
            self.acquire_stage(kv_pipe, kv_state, self.k_slot_factor, self.k_bytes)
            cute.copy(tma_k, tKgK[None, j], tKsK[None, kv_state.index * self.k_slot_factor],
                      tma_bar_ptr=kv_pipe.producer_get_barrier(kv_state))
            kv_state.advance()
            self.acquire_stage(kv_pipe, kv_state, self.v_slot_factor, self.kv_bytes)
            cute.copy(tma_v, tVgV[None, j], tVsV[None, kv_state.index * self.v_slot_factor],
                      tma_bar_ptr=kv_pipe.producer_get_barrier(kv_state))
            kv_state.advance()

    @staticmethod
    def acquire_stage(kv_pipe, kv_state, slot_factor: int, tile_bytes: int):
        """Wait for a free stage of the K/V ring and expect the bytes of the tile loaded into it: a tile of half
        the stage (``slot_factor`` 2) moves fewer bytes than the pipeline's transaction count."""
        if const_expr(slot_factor == 1):
            kv_pipe.producer_acquire(kv_state)
        else:
            kv_pipe.sync_object_empty.wait(kv_state.index, kv_state.phase)
            kv_pipe.sync_object_full.arrive_and_expect_tx(kv_state.index, tile_bytes)

    @cute.jit
    def consumer(self, qk_mma, qk_mma_acc, pv_mma, sQ, sK, sV, q_pipe, kv_pipe, mO, mQs, mKs, mVs, s_log2, m_offset,
                 record_args, tidx, wg, m_blk, h_idx, b_idx, seqlen_q, seqlen_k, n_tiles, row_sums):
        """One consumer warpgroup: 64 query rows against every key tile (``row_sums``: with ``cfg.row_sums_mma``, the
        row-sum product's two TiledMmas, ACCUMULATE off and on, and the ones in shared memory)."""
        tid_wg = tidx % 128
        lane_q = tidx % 4   # column pair inside each 8-column chunk of the accumulator
        thr_qk = qk_mma.get_slice(tid_wg)
        thr_pv = pv_mma.get_slice(tid_wg)
        tSrQ = thr_qk.make_fragment_A(thr_qk.partition_A(sQ))
        tSrK = thr_qk.make_fragment_B(thr_qk.partition_B(sK))
        tOrV = thr_pv.make_fragment_B(thr_pv.partition_B(sV))

        acc_s = thr_qk.make_fragment_C(thr_qk.partition_shape_C((TILE_M_PER_WG, self.tile_n)))
        acc_o = thr_pv.make_fragment_C(thr_pv.partition_shape_C((TILE_M_PER_WG, self.head_dim)))
        acc_o.fill(0.0)
        qk_mma.set(cute.nvgpu.warpgroup.Field.ACCUMULATE, False)
        qk_mma_acc.set(cute.nvgpu.warpgroup.Field.ACCUMULATE, True)
        pv_mma.set(cute.nvgpu.warpgroup.Field.ACCUMULATE, True)
        r_p = cute.make_rmem_tensor(thr_pv.partition_shape_A((TILE_M_PER_WG, self.tile_n)), self.in_dtype)
        if const_expr(self.cfg.pv_fp8):   # this thread's rows: the running maximum, l_i (maybe on the tensor cores)
            dp = softmax_fp8_for(self.cfg, s_log2, lane_q, acc_o, row_sum_operands(row_sums, tid_wg))
        else:                             # this thread's rows: m_i, l_i, the saturated count
            dp = direct_p_for(self.cfg, s_log2, lane_q)
        if const_expr(self.cfg.qk_fp8):
            dp.qk_scales = (self.query_scales(thr_qk, mQs, wg, m_blk, h_idx, b_idx, seqlen_q), mKs[None, h_idx, b_idx])

        q_state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, self.num_wg)
        for w in cutlass.range_constexpr(1, self.num_wg):   # stage wg, phase 0
            if wg >= w:
                q_state.advance()
        q_pipe.consumer_wait(q_state)
        q_stage = q_state.index

        kv_state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, self.kv_stages)
        partial_last = seqlen_k % self.tile_n != 0
        if const_expr(self.cfg.overlap):
            # S_0 first; then every step issues S_{j+1} = Q K_{j+1}^T before Direct-P of S_j, so the
            # tensor cores compute the next scores while the ALUs make this tile's probabilities.
            acc_s1 = thr_qk.make_fragment_C(thr_qk.partition_shape_C((TILE_M_PER_WG, self.tile_n)))
            kv_pipe.consumer_wait(kv_state)
            cute.nvgpu.warpgroup.fence()
            self.qk_gemm(qk_mma, qk_mma_acc, tSrQ, tSrK, q_stage, kv_state.index, acc_s)
            cute.nvgpu.warpgroup.commit_group()
            cute.nvgpu.warpgroup.wait_group(0)
            kv_pipe.consumer_release(kv_state)
            kv_state.advance()
            if const_expr(self.cfg.anchor > 0):
                dp.anchor_reference(acc_s, m_offset, seqlen_k)
            for jj in cutlass.range(n_tiles // 2, unroll=1):
                kv_state = self.overlap_step(
                    2 * jj, acc_s, acc_s1, kv_state, qk_mma, qk_mma_acc, pv_mma, tSrQ, tSrK, tOrV, q_stage,
                    kv_pipe, acc_o, r_p, dp, seqlen_k, n_tiles, partial_last)
                kv_state = self.overlap_step(
                    2 * jj + 1, acc_s1, acc_s, kv_state, qk_mma, qk_mma_acc, pv_mma, tSrQ, tSrK, tOrV, q_stage,
                    kv_pipe, acc_o, r_p, dp, seqlen_k, n_tiles, partial_last)
            if n_tiles % 2 == 1:
                kv_state = self.overlap_step(
                    n_tiles - 1, acc_s, acc_s1, kv_state, qk_mma, qk_mma_acc, pv_mma, tSrQ, tSrK, tOrV, q_stage,
                    kv_pipe, acc_o, r_p, dp, seqlen_k, n_tiles, partial_last)
        elif const_expr(self.cfg.schedule == "pingpong"):
            kv_state = self.pingpong_loop(qk_mma, qk_mma_acc, pv_mma, tSrQ, tSrK, tOrV, q_stage, kv_pipe, kv_state,
                                          acc_s, acc_o, r_p, dp, m_offset, wg, seqlen_k, n_tiles)
        else:
            for j in cutlass.range(n_tiles, unroll=1):
                # S = Q K^T
                tile_scales = dp.tile_scales(j)
                kv_pipe.consumer_wait(kv_state)
                cute.nvgpu.warpgroup.fence()
                self.qk_gemm(qk_mma, qk_mma_acc, tSrQ, tSrK, q_stage, kv_state.index, acc_s)
                cute.nvgpu.warpgroup.commit_group()
                cute.nvgpu.warpgroup.wait_group(0)
                kv_pipe.consumer_release(kv_state)
                kv_state.advance()

                if const_expr(self.cfg.anchor > 0):
                    if j == 0:
                        dp.anchor_reference(acc_s, m_offset, seqlen_k)
                dp.tile_masked_if_last(acc_s, r_p, tile_scales, seqlen_k, j, n_tiles, partial_last)

                # O += P V
                kv_pipe.consumer_wait(kv_state)
                dp.before_pv()
                cute.nvgpu.warpgroup.fence()
                self.pv_product(pv_mma, acc_o, r_p, tOrV[None, None, None, kv_state.index * self.v_slot_factor], dp)
                cute.nvgpu.warpgroup.commit_group()
                cute.nvgpu.warpgroup.wait_group(0)
                kv_pipe.consumer_release(kv_state)
                kv_state.advance()

        # the epilogue's loads (and Direct-P's row sums) while the ping-pong's last P V product runs, its stores after
        out = OutputTile(self.cfg, self.o_dtype)
        factors = out.make_factors(acc_o)
        out.channel_scales(thr_pv, mVs, (h_idx, b_idx), factors)
        if const_expr(not self.cfg.row_sums_mma):   # row sums of the ALUs: ready before the last product
            out.denominators(dp, factors)
        if const_expr(self.cfg.schedule == "pingpong"):
            cute.nvgpu.warpgroup.wait_group(0)
            kv_pipe.consumer_release(kv_state)
        if const_expr(self.cfg.row_sums_mma):       # the tensor cores': that product's
            out.denominators(dp, factors)
        out.store(thr_pv, acc_o, dp, mO, ((m_blk * self.num_wg + wg) * TILE_M_PER_WG, seqlen_q), (h_idx, b_idx),
                  factors, record_args)

    @cute.jit
    def pingpong_loop(self, qk_mma, qk_mma_acc, pv_mma, tSrQ, tSrK, tOrV, q_stage, kv_pipe, kv_state, acc_s,
                      acc_o, r_p, dp, m_offset, wg, seqlen_k, n_tiles):
        """The ping-pong schedule. Per key tile j one "tensor phase" issues S_j = Q K_j^T and
        O += P_{j-1} V_{j-1} together, then Direct-P of S_j runs on the ALUs. Named barrier
        BAR_SCHED + w means "warpgroup w may issue": each warpgroup waits for its own before a
        tensor phase and signals the next one's (round robin) right after issuing, so Direct-P
        runs under the other warpgroups' matrix products. Counts balance: each warpgroup syncs
        n + 1 times; the last warpgroup signals warpgroup 0 once up front and after its first n
        phases, every other warpgroup signals its successor after all n + 1. Returns with the last P V product in
        flight and the state of its V tile: the caller issues the epilogue's loads under it, then waits."""
        last = self.num_wg - 1
        own_bar = BAR_SCHED + wg
        other_bar = BAR_SCHED + (wg + 1) % self.num_wg
        n_sched = 256      # the waiting warpgroup and the signalling one
        if wg == last:
            cute.arch.barrier_arrive(barrier_id=other_bar, number_of_threads=n_sched)
        # Tile 0 (S_0 alone) and the last tile are peeled, with the masked Direct-P (exact for a
        # whole tile too), so that the loop body has no branch: across a branch ptxas loses track
        # of which WGMMA group is complete and waits for all of them before Direct-P (SASS: the
        # "WARPGROUP.DEPBAR.LE gsb0, 0x0" of PV_{j-1} hoisted to its first instruction).
        k_state = kv_state.clone()          # K_j (stream position 2j)
        tile_scales = dp.tile_scales(0)
        kv_pipe.consumer_wait(k_state)
        cute.arch.barrier(barrier_id=own_bar, number_of_threads=n_sched)
        cute.nvgpu.warpgroup.fence()
        self.qk_gemm(qk_mma, qk_mma_acc, tSrQ, tSrK, q_stage, k_state.index, acc_s)
        cute.nvgpu.warpgroup.commit_group()
        cute.arch.barrier_arrive(barrier_id=other_bar, number_of_threads=n_sched)
        cute.nvgpu.warpgroup.wait_group(0)
        kv_pipe.consumer_release(k_state)
        if const_expr(self.cfg.anchor > 0):
            dp.anchor_reference(acc_s, m_offset, seqlen_k)
        dp.tile(acc_s, r_p, tile_scales, seqlen_k, 0, True, False)
        k_state, v_state = self.next_tile_states(k_state)
        # tiles 1 .. n-2 are whole
        for j in cutlass.range(1, n_tiles - 1, unroll=1):
            self.pingpong_step(qk_mma, qk_mma_acc, pv_mma, tSrQ, tSrK, tOrV, q_stage, kv_pipe, k_state, v_state,
                               acc_s, acc_o, r_p, dp, seqlen_k, j, own_bar, other_bar, n_sched, False)
            k_state, v_state = self.next_tile_states(k_state)
        if n_tiles > 1:    # the last tile, masked (exact for a whole tile too)
            self.pingpong_step(qk_mma, qk_mma_acc, pv_mma, tSrQ, tSrK, tOrV, q_stage, kv_pipe, k_state, v_state,
                               acc_s, acc_o, r_p, dp, seqlen_k, n_tiles - 1, own_bar, other_bar, n_sched, True)
            k_state, v_state = self.next_tile_states(k_state)
        # the last tensor phase: O += P_{n-1} V_{n-1}
        kv_pipe.consumer_wait(v_state)
        cute.arch.barrier(barrier_id=own_bar, number_of_threads=n_sched)
        dp.before_pv()
        cute.nvgpu.warpgroup.fence()
        self.pv_product(pv_mma, acc_o, r_p, tOrV[None, None, None, v_state.index * self.v_slot_factor], dp)
        cute.nvgpu.warpgroup.commit_group()
        if wg != last:
            cute.arch.barrier_arrive(barrier_id=other_bar, number_of_threads=n_sched)
        return v_state   # its product in flight: the caller waits for it and releases V_{n-1}

    @staticmethod
    def next_tile_states(k_state):
        """From K_j's pipeline state (stream position 2j): the states of K_{j+1} and V_j."""
        v_state = k_state.clone()
        v_state.advance()
        k_state.advance()
        k_state.advance()
        return k_state, v_state

    @cute.jit
    def pingpong_step(self, qk_mma, qk_mma_acc, pv_mma, tSrQ, tSrK, tOrV, q_stage, kv_pipe, k_state, v_state,
                      acc_s, acc_o, r_p, dp, seqlen_k, j, own_bar, other_bar, n_sched, masked: cutlass.Constexpr):
        """One tensor phase (S_j = Q K_j^T, then O += P_{j-1} V_{j-1} as a second group) and
        Direct-P of S_j, which starts once S_j is done while PV_{j-1} still runs; P_j goes into r_p
        (which PV_{j-1} reads) only after wait_group(0), inside ``dp.tile``."""
        tile_scales = dp.tile_scales(j, whole=not masked)
        kv_pipe.consumer_wait(k_state)
        kv_pipe.consumer_wait(v_state)
        cute.arch.barrier(barrier_id=own_bar, number_of_threads=n_sched)
        cute.nvgpu.warpgroup.fence()
        self.qk_gemm(qk_mma, qk_mma_acc, tSrQ, tSrK, q_stage, k_state.index, acc_s)
        cute.nvgpu.warpgroup.commit_group()
        if const_expr(self.cfg.pv_fp8):   # the output rescaled while S_j computes (no P V product in flight)
            dp.before_pv()
            cute.nvgpu.warpgroup.fence()
        self.pv_product(pv_mma, acc_o, r_p, tOrV[None, None, None, v_state.index * self.v_slot_factor], dp)
        cute.nvgpu.warpgroup.commit_group()
        cute.arch.barrier_arrive(barrier_id=other_bar, number_of_threads=n_sched)
        cute.nvgpu.warpgroup.wait_group(1)
        kv_pipe.consumer_release(k_state)
        dp.tile(acc_s, r_p, tile_scales, seqlen_k - j * self.tile_n, j, masked, True)
        kv_pipe.consumer_release(v_state)

    @staticmethod
    def pv_product(pv_mma, acc_o, r_p, tOrV_stage, dp):
        """O += P V from the A fragment r_p, and in the same WGMMA group what the P path adds (``dp.after_pv``: the
        FP8 P/V softmax's row sums)."""
        cute.gemm(pv_mma, acc_o, r_p, tOrV_stage, acc_o)
        dp.after_pv(r_p)

    @cute.jit
    def qk_gemm(self, qk_mma, qk_mma_acc, tSrQ, tSrK, q_stage, k_stage, acc):
        """acc = Q K^T over the head dim (k-blocks of 16, 32 in FP8): the first block overwrites acc
        (qk_mma, ACCUMULATE off), the others add (qk_mma_acc)."""
        for kb in cutlass.range_constexpr(cute.size(tSrQ, mode=[2])):
            mma = qk_mma if kb == 0 else qk_mma_acc
            cute.gemm(mma, acc, tSrQ[None, None, kb, q_stage], tSrK[None, None, kb, k_stage * self.k_slot_factor],
                      acc)

    @cute.jit
    def overlap_step(self, j, acc_cur, acc_next, v_state, qk_mma, qk_mma_acc, pv_mma, tSrQ, tSrK, tOrV,
                     q_stage, kv_pipe, acc_o, r_p, dp, seqlen_k, n_tiles, partial_last):
        """One key tile in the overlapped schedule: S_j is in acc_cur, V_j at v_state; issue
        S_{j+1} into acc_next, Direct-P on S_j, O += P V_j; returns the state of V_{j+1}."""
        tile_scales = dp.tile_scales(j)
        k_state = v_state.clone()
        k_state.advance()
        has_next = j + 1 < n_tiles
        if has_next:
            kv_pipe.consumer_wait(k_state)
            cute.nvgpu.warpgroup.fence()
            self.qk_gemm(qk_mma, qk_mma_acc, tSrQ, tSrK, q_stage, k_state.index, acc_next)
            cute.nvgpu.warpgroup.commit_group()
        dp.tile_masked_if_last(acc_cur, r_p, tile_scales, seqlen_k, j, n_tiles, partial_last)
        kv_pipe.consumer_wait(v_state)
        dp.before_pv()
        cute.nvgpu.warpgroup.fence()
        self.pv_product(pv_mma, acc_o, r_p, tOrV[None, None, None, v_state.index * self.v_slot_factor], dp)
        cute.nvgpu.warpgroup.commit_group()
        cute.nvgpu.warpgroup.wait_group(0)
        kv_pipe.consumer_release(v_state)
        if has_next:
            kv_pipe.consumer_release(k_state)
        k_state.advance()
        return k_state

    @cute.jit
    def query_scales(self, thr_qk, mQs, wg, m_blk, h_idx, b_idx, seqlen_q):
        """qk_fp8: 2^Eq of this thread's two query rows (register i = c + 2 r + 4 chunk holds row
        r0 + 8 r); 1 for rows past Sq."""
        row_qs = cute.make_rmem_tensor((2,), Float32)
        row_qs.fill(1.0)
        tScS = thr_qk.partition_C(cute.make_identity_tensor((TILE_M_PER_WG, self.tile_n)))
        row0 = (m_blk * self.num_wg + wg) * TILE_M_PER_WG
        for r in cutlass.range_constexpr(2):
            row = row0 + tScS[2 * r][0]
            if row < seqlen_q:
                row_qs[r] = mQs[row, h_idx, b_idx]
        return row_qs
