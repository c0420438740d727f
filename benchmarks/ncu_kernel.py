r"""Run the Hopper kernel (prepared operands) a few times at one shape, for Nsight Compute.

The two runs behind benchmarks/results/20261129b_h200_ncu_sections.txt and _ncu_stalls.txt:

    ncu --clock-control none -k regex:DirectP --launch-skip 1 --launch-count 1 \
        --section SpeedOfLight --section WarpStateStats --section SchedulerStats \
        --section ComputeWorkloadAnalysis --section InstructionStats \
        python benchmarks/ncu_kernel.py --variant pingpong/packed
    M='regex:smsp__average_warps_issue_stalled_.*_per_issue_active\.ratio'
    M="$M,sm__pipe_tensor_op_hmma_cycles_active.avg.pct_of_peak_sustained_active"
    M="$M,smsp__issue_active.avg.pct_of_peak_sustained_active"
    ncu --clock-control none -k regex:DirectP --launch-skip 1 --launch-count 1 --metrics "$M" \
        python benchmarks/ncu_kernel.py --variant pingpong/packed

Per-pipe utilisation (20261129c_h200_ncu_pipes-before.txt; variants packed, none,
timing_scales, timing_codes) and the stalls after the late PV wait (20261129c_h200_ncu_stalls.txt):

    M='regex:sm__inst_executed_pipe_.*\.avg\.pct_of_peak_sustained_active'
    M="$M,regex:sm__pipe_.*_cycles_active\.avg\.pct_of_peak_sustained_active"
    ncu --clock-control none -k regex:DirectP --launch-skip 1 --launch-count 1 --metrics "$M" \
        python benchmarks/ncu_kernel.py --variant pingpong/timing_codes
    M='regex:smsp__average_warps_issue_stalled_.*_per_issue_active\.ratio'
    M="$M,smsp__issue_active.avg.pct_of_peak_sustained_active,sm__inst_executed_pipe_alu.avg.pct_of_peak_sustained_active"
    ncu --clock-control none -k regex:DirectP --launch-skip 1 --launch-count 1 --metrics "$M" \
        python benchmarks/ncu_kernel.py --variant serial/packed

The timings beside them: ``benchmarks/kernel_grid.py --shapes "1,32768,12;1,8192,24;1,4096,24"
--backends "hopper_kernel@/none,hopper_kernel,hopper_kernel@/packed_alu,hopper_kernel@serial/packed,
hopper_kernel@serial/packed/1,hopper_kernel@serial/none/1,fa4"`` (20261129c_h200_kernel_variants.json) and, on the
afternoon's kernel, ``--backends "hopper_kernel@/none,hopper_kernel@/timing_scales,
hopper_kernel@/timing_codes,hopper_kernel,hopper_kernel@serial/packed,fa4"`` (20261129c_h200_kernel_stages-before.json).

Only the attention kernel is launched after the operands are prepared (pre-pass excluded).
"""

from __future__ import annotations

import argparse
import math

import torch


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shape", default="1,8192,24", help="B,S,H[,D] (D default 128)")
    ap.add_argument("--policy", default="fast")
    ap.add_argument("--variant", default="", help="SCHEDULE/P_PATH/NUM_WG (empty parts: the defaults)")
    ap.add_argument("--calls", type=int, default=4)
    a = ap.parse_args(argv)
    from fp4vis.evals.kernel_bench import hopper_parts, split_variant
    b, s, h, d = (tuple(int(x) for x in a.shape.split(",")) + (128,))[:4]
    pre, ker = hopper_parts(a.policy, **split_variant(f"hopper_kernel@{a.variant}")[1])
    g = torch.Generator(device="cuda").manual_seed(0)
    q, k, v = (torch.randn(b, h, s, d, device="cuda", generator=g, dtype=torch.bfloat16) for _ in range(3))
    scale = 1 / math.sqrt(d)
    ops = pre(q, k, v, scale)
    for _ in range(a.calls):
        ker(ops, q, scale)
    torch.cuda.synchronize()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
