"""Launch-shape sweep of the fused FP8 pre-pass (``prepass_triton.fp8_prepass``) on the GPU.

    python3 benchmarks/fp8_prepass_tune.py --out $OUT/fp8_prepass_tune.json

Times (CUDA events, median, inputs rotated past the L2) every (query rows per program, warps) pair at
a few shapes and checks each variant's output bit for bit against the default's. Only the Q-row
programs' tile (``FP8_BLOCK_Q``) and the warps (``PrepassLaunch.num_warps``) vary; K/V programs are one 32-key
block each.
"""

from __future__ import annotations

import argparse
import math
import statistics

import torch

SHAPES = [(1, 4096, 24, 128), (4, 4096, 16, 128), (1, 32768, 12, 128), (1, 256, 16, 128), (64, 197, 12, 64)]
VARIANTS = [(32, 4), (32, 2), (64, 4), (16, 4), (16, 2), (64, 8)]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True)
    a = ap.parse_args(argv)
    from fp4vis.kernels.hopper import prepass_triton as tp
    from fp4vis.services.environment import environment
    from fp4vis.services.outputs import write_json
    from fp4vis.services.timing import time_cuda
    default_block = tp.FP8_BLOCK_Q
    rows = []
    for b, s, h, d in SHAPES:
        per = 3 * b * h * s * d * 2
        n = max(2, min(16, math.ceil(3 * 50 * 2**20 / per)))
        ins = [tuple(torch.randn(b, h, s, d, device="cuda", dtype=torch.bfloat16) for _ in range(3)) for _ in range(n)]
        ref = [t.clone() for t in tp.fp8_prepass(*ins[0])]
        for block_q, warps in VARIANTS:
            tp.FP8_BLOCK_Q = block_q
            tp._FP8_META.clear()
            try:
                launch = tp.PrepassLaunch(num_warps=warps)
                out = tp.fp8_prepass(*ins[0], launch=launch)
                same = all(torch.equal(x.view(torch.uint8), y.view(torch.uint8)) for x, y in zip(out, ref))
                ms = statistics.median(time_cuda(lambda i, ins=ins, lc=launch: tp.fp8_prepass(*ins[i], launch=lc), n,
                                                 budget_s=0.3))
                rows.append(dict(shape=[b, s, h, d], block_q=block_q, num_warps=warps, ms=round(ms, 5),
                                 gbps=round(per * 5 / 3 / (ms * 1e-3) / 1e9, 1), bit_equal_to_default=same))
            finally:
                tp.FP8_BLOCK_Q = default_block
                tp._FP8_META.clear()
            print(rows[-1], flush=True)
        ins = ref = None   # free the copies before the next shape
    write_json(a.out, {"meta": environment(), "rows": rows})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
