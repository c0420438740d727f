"""Launch configuration of the Hopper pre-pass's kernels (``prepass_kernels.py``), measured on the H200: rows,
warps and register caps per program by head dim, and how a call may launch otherwise (``PrepassLaunch``).

The host launcher (``prepass_launch.py``) imports these names and reads ``FP8_BLOCK_Q``, ``RMS_THREADS`` and
``RMS_BLOCK_T`` through its own module, where a benchmark overrides them (``benchmarks/wan_qk_bench.py``)."""

from __future__ import annotations

from typing import NamedTuple

# Warps per program of the FP8 pre-pass: 4 at D = 128; 2 at D = 64, where 4 would spread each 32-key
# FP8/MXFP4 block over twice the threads it fills (measured on the H200,
# benchmarks/results/20261129f_h200_prepass_d64-tune.json: 7-10 % faster at ViT shapes).
NUM_WARPS = 4
NUM_WARPS_D64 = 2
# ptxas's register cap of the FP8 pre-pass at D = 128: 72 (from 90: 5 -> 7 programs of 4 warps per SM) takes 11-12 %
# less GPU time at S >= 16k per head group and 9 % at B1 S4096 H24, 0 differing
# (benchmarks/results/20261203j_h200_prepass_variants.json; 2 values spilled, outside any loop); at D = 64 no cap
# changes it
FP8_MAX_REGISTERS = {128: 72, 64: None}
# Rows and warps per program of the NVFP4 pre-pass, by head dim: 16 values per thread either way (each
# 32-value group over two threads, one shuffle per candidate sum). At D = 128, 8 rows on 2 warps take 9-11 % less GPU
# time than 16 on 4, and 16 on 2 or 32 on 4 more (every shape of benchmarks/results/20261203g_h200_prepass_variants-
# before.json and 20261203h_h200_prepass_variants.json); a register cap of 80 (20 -> 24 warps per SM) 2-3 % less
# (20261203i and j; ptxas then spills 12 values outside the candidate loop; 72 measured the same, within 0.4 %).
# At D = 64, 16 rows on 2 warps (4 warps: two shuffle levels per sum, 15-19 % slower,
# 20261129f_h200_prepass_d64-tune.json; 8 rows: 15-19 % slower, 20261203g and h).
NVFP4_LAUNCH = {128: (8, 2, 80), 64: (16, 2, None)}
FP8_BLOCK_Q = 32     # query rows per program of the FP8 pre-pass (as many values as a 32-key block)
# keys per program of the FP8 P/V policies' V pass: the channel maxima (64 keys x D values on 4 warps), then the
# E4M3 bytes (128 keys: each channel's row of V^T written as 128 consecutive bytes)
V_AMAX_KEYS = 64
V_VALUE_KEYS = 128
RMS_THREADS = 128     # threads of torch's vectorized CUDA rms_norm block (32 x 4 warps): its sum order
RMS_BLOCK_T = 8       # tokens per program of the rstd launch


def default_warps(d: int) -> int:
    """Warps per program of the FP8 pre-pass for head dimension d."""
    return NUM_WARPS if d >= 128 else NUM_WARPS_D64


def nvfp4_launch(d: int) -> tuple[int, int, int | None]:
    """(rows, warps, ptxas's register cap) per program of the NVFP4 pre-pass for head dimension d."""
    return NVFP4_LAUNCH[128] if d >= 128 else NVFP4_LAUNCH[64]


class PrepassLaunch(NamedTuple):
    """How a pre-pass launches, where a call does not take the defaults: ``block_r`` rows (NVFP4) and ``num_warps``
    per program and ptxas's register cap ``max_registers`` (0: none) for measurement (None: the tables above),
    and ``direct``: call the cached compiled kernel straight (``prepass_launch``'s host path;
    FP4VIS_PREPASS_DIRECT_LAUNCH)."""

    block_r: int | None = None
    num_warps: int | None = None
    max_registers: int | None = None
    direct: bool = True


DEFAULT_LAUNCH = PrepassLaunch()
