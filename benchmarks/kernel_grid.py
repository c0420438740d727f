"""Benchmark the Hopper Direct-P kernel against flash-attn-4, SDPA (cuDNN) and SageAttention.

    python benchmarks/kernel_grid.py                       # full grid on the H200 (D=128 + D=64)
    python benchmarks/kernel_grid.py --quick               # CPU smoke test (reference, tiny shapes)
    python benchmarks/kernel_grid.py --shapes 1,4096,24 --policies fast,guard

Writes raw JSON (date, GPU, versions) and a Markdown summary to benchmarks/results/ (or --out).
All the logic lives in ``fp4vis.evals.kernel_bench``.
"""

from __future__ import annotations

import argparse
import sys

from fp4vis.evals import kernel_bench as kb
from fp4vis.services.outputs import new_result_path


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="CPU-only: time the reference on tiny shapes")
    ap.add_argument("--shapes", default=None, help="B,S,H[,D] triples separated by ';' (default: the grid)")
    ap.add_argument("--d64", action="store_true", help="also run the D=64 ViT-like shapes")
    ap.add_argument("--policies", default="fast")
    ap.add_argument("--backends", default="hopper,prepass,hopper_kernel,fa4,sdpa_cudnn,sage")
    ap.add_argument("--budget", type=float, default=2.0, help="seconds of timed calls per measurement")
    ap.add_argument("--out", default=None, help="JSON path (default: benchmarks/results/<date><run>_<machine>_kernel"
                                                "[_quick].json, the day's next run letter)")
    ap.add_argument("--run", default=None, help="the default output's run letter (default: the day's next one)")
    a = ap.parse_args(argv)
    if a.shapes:
        shapes = [tuple(int(x) for x in s.split(",")) for s in a.shapes.split(";")]
        shapes = kb.as_shapes(shapes)
    else:
        shapes = kb.as_shapes(kb.GRID_D128) + (kb.as_shapes(kb.GRID_D64, d=64) if a.d64 else [])
    if a.quick:
        shapes = kb.as_shapes(kb.QUICK_SHAPES, d=64)
    out = a.out or new_result_path("kernel", "quick" if a.quick else None, machine="cpu" if a.quick else None,
                                   run=a.run)
    rows: list[dict] = []
    for shape in shapes:  # one shape at a time, results rewritten after each (a cut-off run keeps them)
        rows += kb.run_grid([shape], a.backends.split(","), a.policies.split(","), quick=a.quick,
                            budget_s=a.budget)
        kb.add_speedups(rows)
        path = kb.write_results(rows, out)
    print(kb.summary_table(rows))
    print(f"wrote {path}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
