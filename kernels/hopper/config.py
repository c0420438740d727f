"""Static configuration of the Hopper Direct-P kernel: tuning constants in one place and
``KernelConfig``, the compile-time description of one kernel variant (its ``key()`` names the
compiled kernel in the backend's cache). Importable without CuTe DSL.

The product variant of a call is ``product_config`` (the defaults below, the short-sequence variant where it
was measured to pay); the other variants exist for the tests and the benchmarks, which build a
``KernelConfig`` and hand it to the launcher (``backend.attention(call, config)``).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, replace
from typing import Literal, get_args

from fp4vis.key_positions import KEY_BLOCK, softmax_sums_rounded_p, softmax_tile
from fp4vis.policy import QK_FP8, KernelParams, Policy

# ------------------------------------------------------------------------------------------------
# Tuning constants (one place)
# ------------------------------------------------------------------------------------------------
TILE_M_PER_WG = 64      # query rows per consumer warpgroup (one WGMMA M)
NUM_MMA_WG = 2          # default consumer warpgroups per CTA (KernelConfig.num_wg: 2, 3 with 64-key tiles, 1 serial)
# the FP8 P/V softmax at D = 64: three consumer warpgroups of 128-key tiles (its registers fit 160 per thread), a
# third softmax beside the matrix products: against two on the H100, 6-7 % less kernel time for `fp8`, 11-14 % for
# `fp8pv` (benchmarks/results/20261206h_h100_kernel.json, hopper_kernel against hopper_kernel@//2)
PV_FP8_D64_WG = 3
# `fp8`: of every 8 scores of a row's 32-key block, those whose 2^x the FMA pipe computes (ptx.ex2_poly) in the
# softmax's whole tiles, the others on the exponential unit. Against 0 on the H100, 2 takes 9-11 % off the D = 64
# kernel and 1-2 % at D = 128, and 4 is slower (benchmarks/results/20261206h_h100_kernel.json, hopper_kernel against
# hopper_kernel@//////0 and @//////4); `fp8pv` (its Q K^T on BF16 tensor cores, twice FP8's time) ran 1-7 % slower
# with 2 at four of the five shapes (20261206h_h100_kernel_fp8pv-poly.json) and keeps 0
PV_FP8_POLY_EXP2 = 2
TILE_N = 128            # default keys per K/V tile (4 Direct-P blocks of 32); 64 also supported
# the FP8 P/V softmax's key tile is the contract's (fp4vis.key_positions.softmax_tile: 192 at D = 128, 128 at D = 64);
# a variant may name another of these for measurement, whose running maximum then differs from the reference's
PV_FP8_TILES = (128, 160, 192, 224)   # multiples of the 32-key block that fit the registers at D = 128
PV_FP8_TILE_MAX_2CTA = 192   # the two-CTA variant compiles under a 128-register launch cap: 224 keys do not fit
KV_KEYS_IN_FLIGHT = 256  # keys of K and V tiles in flight (they alternate in one pipeline): 4 stages of 128
REGS_PRODUCER = 24
REGS_CONSUMER = {1: 240, 2: 240, 3: 160}   # per consumer thread, by warpgroups per CTA (64K registers per SM)
# Short sequences (KernelConfig.ctas_per_sm = 2: one serial consumer warpgroup per CTA, two CTAs per SM):
# one CTA's prologue (barrier init, Q/K/V TMA latency) and epilogue run under the other's tiles, and a
# grid too small to fill the GPU with 128-row CTAs fills twice as many SMs.
# 64K registers per SM / (2 CTAs x 256 threads) = 128 per thread at launch; setmaxnreg moves 104 from the
# producer to the consumer (24 + 232 = 2 x 128, multiples of 8).
REGS_2CTA = (24, 232)                 # (producer, consumer) registers per thread
SMEM_1CTA = 227 * 1024                # the most dynamic shared memory one CTA may have (228 KB per SM, less 1 KB)
SMEM_2CTA = 113 * 1024                # per CTA: 228 KB per SM, less the 1 KB reserved per CTA, halved
DP_BLOCK = KEY_BLOCK    # Direct-P block: 32 consecutive keys (docs/numerics.md section 2)
# Schedules of the consumer warpgroups (KernelConfig.schedule):
#   "pingpong": each warpgroup issues O += P_{j-1} V_{j-1} and S_j = Q K_j^T back to back, then hands
#               the tensor cores to the other warpgroup (named barriers) and runs Direct-P on S_j while
#               the other one's matrix products run (FA3-style ping-pong; no extra registers);
#   "serial":   S_j, Direct-P, PV_j in order per warpgroup; the two warpgroups interleave freely;
#   "overlap":  64-key tiles, S_{j+1} issued before Direct-P of S_j (two score buffers).
Schedule = Literal["pingpong", "serial", "overlap"]
SCHEDULES: tuple[Schedule, ...] = get_args(Schedule)
DEFAULT_SCHEDULE = "pingpong"
# P path: "packed" rounds in FP32, then saturates, scales by alpha' and sums the codes on BF16 pairs;
# "packed_alu" the same with the rounding constant made on the integer ALU (the previous default);
# (exact: see DirectPAttentionSm90.direct_p); "scalar" does every step in FP32.
# Timing only (wrong results), to place time inside the kernel by leaving stages out (the device
# notes' method where counters cannot): "none" P = 1, no Direct-P; "timing_scales" the block
# scales (maxima, shuffles, exponents) but P = 1; "timing_codes" the codes with fixed block scales.
PPath = Literal["packed", "packed_alu", "scalar", "none", "timing_scales", "timing_codes"]
P_PATHS: tuple[PPath, ...] = get_args(PPath)
TIMING_P_PATHS = ("none", "timing_scales", "timing_codes")   # wrong results by design: nothing to record
DEFAULT_P_PATH = "packed"
# Block constants (KernelConfig.block_scales): the four threads of a quad hold parts of the same
# eight (row, 32-key block) pairs of a 128-key tile. "lane": each thread computes the exponent and
# constants of all eight (the same values four times); "quad": thread q of the quad computes those of
# block q (both rows) and shuffles them to the others (the same bits, fewer instructions per tile).
BlockScales = Literal["quad", "lane"]
BLOCK_SCALES_MODES: tuple[BlockScales, ...] = get_args(BlockScales)
DEFAULT_BLOCK_SCALES = "quad"
BAR_SCHED = 1           # named barriers BAR_SCHED + wg: "warpgroup wg may issue its matrix products"
# KernelConfig.eighths: the affine code as y/8 with fma.sat (relu for free); off: max(y, 0) then round
EIGHTHS_LOG2 = 3
OutDtype = Literal["bf16", "fp16"]
CodeRounding = Literal["exact", "bf16"]   # Policy.code_rounding
# pv_fp8: the FP8 WGMMA's A fragment holds, in slot k of each 32-key block, the accumulator's column
# 16 (k // 16) + 8 ((k % 4) // 2) + 2 ((k % 16) // 4) + k % 2 of the same thread; V^T stores its keys in that order
# (prepass_kernels.pv_key_order), so P goes from the scores to the A fragment by relabelling registers
PV_FP8_KEY_ORDER = tuple(16 * (k // 16) + 8 * ((k % 4) // 2) + 2 * ((k % 16) // 4) + k % 2 for k in range(32))
# KernelConfig.row_sums_mma (row_sums.py): the denominator as a product on the tensor cores, P times a
# (PV_FP8_K_BLOCK x ROW_SUM_N) block of E4M3 ones in shared memory (every byte E4M3_ONES_WORD's), one WGMMA per 32-key
# block of P, issued beside each P V product
ROW_SUM_N = 8                 # the narrowest WGMMA N
PV_FP8_K_BLOCK = 32           # keys per FP8 WGMMA (its K)
E4M3_ONES_WORD = 0x38383838   # four E4M3 1.0 bytes
ONES_ALIGN_BYTES = 256        # the ones' 32-byte-swizzled layout; they sit beside the barriers



@dataclass(frozen=True)
class KernelConfig:
    """Static (compile-time) configuration of one kernel variant."""

    head_dim: int = 128
    out_dtype: OutDtype = "bf16"
    affine_a: float = 1.5
    affine_b: float = 1.2
    shift: int = 16                  # L
    native_exp2: bool = False
    anchor: int = 0                  # 0: m_i = 0; else the first `anchor` keys are the anchors
    schedule: Schedule = "pingpong"  # see SCHEDULES
    tile_n: int = TILE_N             # keys per tile: 128, 64 (the overlapped schedule), pv_fp8: PV_FP8_TILES
    p_path: PPath = "packed"         # see P_PATHS
    num_wg: int = NUM_MMA_WG         # consumer warpgroups (64 query rows each); 3: 64-key tiles, or pv_fp8 at D = 64
    code_rounding: CodeRounding = "exact"   # Policy.code_rounding: "bf16" rounds pairs of codes on BF16x2
    qk_fp8: bool = False             # Policy.qk_format "fp8_e4m3": FP8 Q/K with power-of-two row/block scales
    block_scales: BlockScales = "quad"   # see BLOCK_SCALES_MODES ("quad" needs 128-key tiles)
    ctas_per_sm: int = 1             # 2: the short-sequence variant (num_wg 1, serial; REGS_2CTA, SMEM_2CTA)
    eighths: bool = True             # affine codes as q/8 (EIGHTHS_LOG2; only where shift >= 3)
    range_record: bool = False       # count saturated blocks, empty rows, non-finite outputs (range_check)
    key_lengths: bool = False        # a key count per batch element (key masks: kernels/kept_keys.py), else Skv
    pv_fp8: bool = False             # Policy method "fp8_pv": online softmax, E4M3 P and V (softmax_fp8.SoftmaxFP8)
    poly_exp2: int = 0               # pv_fp8: of every 8 exponentials, those on the FMA pipe (PV_FP8_POLY_EXP2)

    @property
    def overlap(self) -> bool:
        return self.schedule == "overlap"

    @property
    def row_sums_mma(self) -> bool:
        """The FP8 P/V softmax's denominator on the tensor cores (the rounded P: P times E4M3 ones beside each P V
        product), by head dim as the contract says (``softmax_sums_rounded_p``); else on the ALUs."""
        return self.pv_fp8 and softmax_sums_rounded_p(self.head_dim)

    @property
    def decide_after_epilogue(self) -> bool:
        """Where the range record's decision on the pre-pass's scale range runs: after the epilogue of CTA 0's first
        consumer thread in the three-warpgroup FP8 P/V kernel (D = 64), where in an idle producer thread it made
        ptxas schedule the key loop longer (583 instructions, not 571) and the record cost 6 % of the call; in that
        idle producer thread everywhere else (docs/hopper_kernel.md, "Measured")."""
        return self.pv_fp8 and self.num_wg == 3

    def key(self) -> tuple:
        """The fields' values in order: every field is a compile-time choice, so one compiled kernel per key."""
        return tuple(getattr(self, name) for name in self.__dataclass_fields__)

    @staticmethod
    def make(params: KernelParams, head_dim: int, out_dtype: OutDtype, *, range_record: bool = False,
             schedule: Schedule | None = None, tile_n: int | None = None, p_path: PPath | None = None,
             num_wg: int | None = None, block_scales: BlockScales | None = None,
             ctas_per_sm: int | None = None) -> KernelConfig:
        """The variant for a policy's kernel parameters (``Policy.kernel_params``), with the tiles chosen for its
        schedule: the overlapped schedule needs 64-key tiles (two 64x128 score buffers do not fit beside the
        output accumulator), and 64-key tiles hold at most 64 anchors, so the 128-anchor guard falls back to the
        default schedule. ``ctas_per_sm=2`` (short sequences) fills in its schedule ("serial") and num_wg (1)
        where they are not given, and refuses others. None: the default of each field."""
        if params.pv_fp8:   # Direct-P's fields mean nothing to the softmax: one compiled kernel for every such policy
            params = params._replace(affine_a=Policy.affine_a, affine_b=Policy.affine_b, shift=Policy.shift,
                                     code_rounding="exact")
        anchor, qk_fp8 = int(params.anchor), params.qk_layout == QK_FP8
        ctas_per_sm = ctas_per_sm or 1
        if ctas_per_sm not in (1, 2):
            raise ValueError(f"ctas_per_sm: 1 or 2, got {ctas_per_sm!r}")
        if ctas_per_sm == 2:
            schedule, num_wg = schedule or "serial", num_wg or 1
            if schedule != "serial" or num_wg != 1:
                raise ValueError(f"ctas_per_sm = 2 needs num_wg = 1 and schedule 'serial' (two CTAs share the "
                                 f"SM's registers), got num_wg {num_wg} and schedule {schedule!r}")
        schedule = schedule or DEFAULT_SCHEDULE
        p_path = p_path or DEFAULT_P_PATH
        eighths = params.shift >= EIGHTHS_LOG2
        if schedule not in SCHEDULES:
            raise ValueError(f"schedule: one of {SCHEDULES}, got {schedule!r}")
        if p_path not in P_PATHS:
            raise ValueError(f"p_path: one of {P_PATHS}, got {p_path!r}")
        if schedule == "overlap" and anchor > 64:
            schedule = DEFAULT_SCHEDULE
        if params.code_rounding not in ("exact", "bf16"):
            raise ValueError(f"code_rounding: 'exact' or 'bf16', got {params.code_rounding!r}")
        if params.code_rounding == "bf16" and not eighths:
            raise ValueError(f"code_rounding='bf16' needs the shift L >= {EIGHTHS_LOG2} (codes computed as q/8)")
        if qk_fp8 and anchor > 0:
            raise ValueError("qk_fp8 with anchors is not implemented: the anchor maximum would have to "
                             "be taken over rescaled scores")
        if params.pv_fp8 and num_wg is None and head_dim == 64:
            num_wg = PV_FP8_D64_WG
        num_wg = num_wg or NUM_MMA_WG
        if num_wg not in REGS_CONSUMER:
            raise ValueError(f"num_wg: one of {tuple(REGS_CONSUMER)}, got {num_wg!r}")
        if num_wg == 1 and schedule == "pingpong":
            raise ValueError("num_wg = 1 has no partner warpgroup to ping-pong with: use schedule 'serial' "
                             "(a measurement variant: Direct-P of one warpgroup with no other to share the SM)")
        if num_wg == 3 and anchor > 64:
            num_wg = 2     # three warpgroups need 64-key tiles, which hold at most 64 anchors
        if tile_n is None:
            tile_n = 64 if schedule == "overlap" or (num_wg == 3 and not params.pv_fp8) else 128
            if params.pv_fp8:
                tile_n = softmax_tile(head_dim)
        if num_wg == 3 and params.pv_fp8 and head_dim != 64:
            raise ValueError("num_wg = 3 with pv_fp8 needs head_dim 64 (registers: 160 per consumer thread)")
        if num_wg == 3 and not params.pv_fp8 and (tile_n != 64 or schedule == "overlap"):
            raise ValueError("num_wg = 3 needs tile_n = 64 and the pingpong or serial schedule "
                             "(registers: 160 per consumer thread)")
        if schedule == "overlap" and tile_n != 64:
            raise ValueError("schedule 'overlap' needs tile_n = 64")
        block_scales = block_scales or DEFAULT_BLOCK_SCALES
        if block_scales not in BLOCK_SCALES_MODES:
            raise ValueError(f"block_scales: one of {BLOCK_SCALES_MODES}, got {block_scales!r}")
        if params.pv_fp8 and (schedule == "overlap" or tile_n not in PV_FP8_TILES or p_path != DEFAULT_P_PATH
                              or (tile_n != 128 and num_wg == 3)
                              or (tile_n > PV_FP8_TILE_MAX_2CTA and ctas_per_sm == 2)):
            raise ValueError(f"pv_fp8 (the FP8 P/V softmax) runs key tiles of {PV_FP8_TILES} on the pingpong or "
                             "serial schedule (registers: 128 with three consumer warpgroups, at most "
                             f"{PV_FP8_TILE_MAX_2CTA} with two CTAs per SM) and has one P path; got schedule "
                             f"{schedule!r}, tile_n {tile_n}, num_wg {num_wg}, ctas_per_sm {ctas_per_sm}, "
                             f"p_path {p_path!r}")
        if tile_n != 128 or p_path in ("none", "timing_codes"):
            block_scales = "lane"   # a quad shares four blocks only in 128-key tiles; no scales to share
        return KernelConfig(head_dim=head_dim, out_dtype=out_dtype, affine_a=float(params.affine_a),
                             affine_b=float(params.affine_b), shift=int(params.shift),
                             native_exp2=bool(params.native_exp2), anchor=anchor, schedule=schedule, tile_n=tile_n,
                             p_path=p_path, num_wg=num_wg, code_rounding=params.code_rounding, qk_fp8=qk_fp8,
                             block_scales=block_scales, ctas_per_sm=ctas_per_sm, eighths=eighths,
                             range_record=bool(range_record) and p_path not in TIMING_P_PATHS,
                             pv_fp8=bool(params.pv_fp8), poly_exp2=PV_FP8_POLY_EXP2 if params.pv_fp8 and qk_fp8 else 0)

    @staticmethod
    def from_policy(policy: Policy, head_dim: int, out_dtype: OutDtype, **variant) -> KernelConfig:
        """``make`` for a policy (``variant``: ``make``'s keyword arguments)."""
        return KernelConfig.make(policy.kernel_params(head_dim, 1.0), head_dim, out_dtype, **variant)


@functools.lru_cache(maxsize=256)
def product_config(params: KernelParams, head_dim: int, out_dtype: OutDtype, short: bool,
                   range_record: bool, key_lengths: bool = False) -> KernelConfig:
    """The variant the backend runs for a call (cached: it is asked on every call): the defaults, and the
    short-sequence variant (``ctas_per_sm = 2``) where ``short`` (``backend.short_sequences``); ``key_lengths``
    for a key-masked call (it changes no tile: the kernel reads one key count per batch element)."""
    cfg = KernelConfig.make(params, head_dim, out_dtype, range_record=range_record, ctas_per_sm=2 if short else None)
    return replace(cfg, key_lengths=True) if key_lengths else cfg
