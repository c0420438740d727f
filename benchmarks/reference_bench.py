"""Time and peak memory of the reference emulation (``backend="reference"``).

Each (device, shape, policy) runs in a fresh subprocess so that its peak resident memory (CPU,
``ru_maxrss``) or peak allocated memory (CUDA, ``torch.cuda.max_memory_allocated``) is its own.
Writes raw JSON (date, machine, versions) and prints a table.

    python benchmarks/reference_bench.py --device cpu --out benchmarks/results/$(date +%Y%m%d)a_cpu_reference.json
    python benchmarks/reference_bench.py --device cuda --out benchmarks/results/$(date +%Y%m%d)a_h200_reference.json
"""

from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys
import time

SHAPES = {"B1_S4096_H24_D128": (1, 4096, 24, 128), "B1_S32760_H12_D128": (1, 32760, 12, 128),
          "B1_S32768_H24_D128": (1, 32768, 24, 128)}  # the last: the "fits a 24 GB CPU machine" check


def run_one(device: str, shape: tuple[int, int, int, int], policy: str) -> dict:
    import torch

    import fp4vis

    b, s, h, d = shape
    g = torch.Generator(device=device).manual_seed(0)
    q, k, v = (torch.randn(b, h, s, d, device=device, dtype=torch.bfloat16, generator=g) for _ in range(3))
    if device == "cuda":
        fp4vis.attention(q[:, :, :256], k[:, :, :256], v[:, :, :256], policy=policy, backend="reference")
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
    start = time.perf_counter()
    out = fp4vis.attention(q, k, v, policy=policy, backend="reference")
    if device == "cuda":
        torch.cuda.synchronize()
    seconds = time.perf_counter() - start
    if device == "cuda":
        peak = torch.cuda.max_memory_allocated() - base
        peak_kind = "cuda max_memory_allocated above the inputs"
    else:
        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
        peak_kind = "process max RSS (inputs, torch and the run)"
    return {"policy": policy, "shape": dict(zip("BSHD", shape, strict=True)), "seconds": seconds,
            "ns_per_score": seconds / (b * h * s * s) * 1e9, "peak_bytes": int(peak), "peak_kind": peak_kind,
            "finite": bool(torch.isfinite(out).all())}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    parser.add_argument("--shapes", nargs="+", default=list(SHAPES)[:2], choices=list(SHAPES))
    parser.add_argument("--policies", nargs="+", default=["fast", "accurate"])
    parser.add_argument("--long-policies", nargs="+", default=None,
                        help="policies for the S32760 shape (default: --policies)")
    parser.add_argument("--out", required=False)
    parser.add_argument("--one", nargs=3, metavar=("DEVICE", "SHAPE", "POLICY"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.one:
        device, shape, policy = args.one
        print(json.dumps(run_one(device, SHAPES[shape], policy)))
        return
    rows = []
    for shape in args.shapes:
        pols = args.long_policies if (args.long_policies and "S327" in shape) else args.policies
        for policy in pols:
            res = subprocess.run([sys.executable, __file__, "--one", args.device, shape, policy],
                                 capture_output=True, text=True, check=True)
            row = json.loads(res.stdout.strip().splitlines()[-1])
            rows.append(row)
            print(f"{args.device:5s} {shape:20s} {policy:9s} {row['seconds']:9.2f} s "
                  f"{row['ns_per_score']:8.2f} ns/score  peak {row['peak_bytes'] / 2**30:6.2f} GiB", flush=True)
    if args.out:
        from fp4vis.services.environment import environment
        from fp4vis.services.outputs import write_json

        write_json(args.out, {"environment": dict(environment(), device=args.device), "results": rows})
        print("wrote", args.out)


if __name__ == "__main__":
    main()
