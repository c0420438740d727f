r"""Run the NVFP4 pre-pass (and the FP8 one) a few times at one shape, for Nsight Compute.

The run behind benchmarks/results/20261203j_h200_ncu_prepass.txt (B1 S4096 H24 D128):

    ncu --clock-control none -k regex:^prepass_kernel --launch-skip 1 --launch-count 1 \
        --section SpeedOfLight --section Occupancy --section LaunchStats --section SchedulerStats \
        --section WarpStateStats --section InstructionStats --section MemoryWorkloadAnalysis \
        python benchmarks/ncu_prepass.py

``-k regex:fp8_prepass_kernel`` profiles the FP8 pre-pass of the same run.
"""

from __future__ import annotations

import argparse

import torch


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shape", default="1,4096,24,128", help="B,S,H,D")
    ap.add_argument("--calls", type=int, default=3)
    a = ap.parse_args(argv)
    from fp4vis.kernels.hopper import prepass_launch as tp
    b, s, h, d = (int(x) for x in a.shape.split(","))
    g = torch.Generator(device="cuda").manual_seed(0)
    q, k, v = (torch.randn(b, h, s, d, generator=g, device="cuda").bfloat16() for _ in range(3))
    for _ in range(a.calls):
        tp.prepass(q, k, v, "folded64_mse")
        tp.fp8_prepass(q, k, v)
    torch.cuda.synchronize()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
