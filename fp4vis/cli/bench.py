"""``fp4vis bench``: the kernel benchmark (speed and error per backend) on the shape grid."""

from __future__ import annotations

import argparse
import sys
from typing import Any

import torch

from fp4vis.services.outputs import check_output_dir
from fp4vis.services.policies import resolve_policies
from fp4vis.services.usage import UsageError

from .options import Formatter, policy_list

# the backends a full run times (``fp4vis.evals.kernel_bench`` lists what each is)
BENCH_BACKENDS = ("hopper", "hopper_kernel", "prepass", "blackwell", "fa4", "sdpa_cudnn", "sdpa_flash", "sage", "fa3",
                  "fa3_fp8", "fa3_fp8_kernel")


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("bench", formatter_class=Formatter, help="kernel benchmark: speed and error per backend",
                       description="Time every attention backend and baseline available here on the kernel "
                                   "shape grid; write JSON, a Markdown table and a speed-error plot (PNG).")
    p.add_argument("--quick", action="store_true",
                   help="tiny shapes, reference backend on the CPU: runs anywhere in seconds (a smoke test of the "
                        "harness: times only, no plot)")
    p.add_argument("--policies", type=policy_list, default="fast", help="FP4 policies of the fp4vis backends")
    p.add_argument("--backends", "--backend", default=None,
                   help="comma-separated subset of " + ", ".join(BENCH_BACKENDS) + ", reference "
                        "(default: all but the slow reference; each one that cannot run here is listed "
                        "with its reason). blackwell on an H200 runs through its sm_90 verification route: its "
                        "rows say so (\"route\" in the JSON, a note under the table), not Blackwell figures")
    p.add_argument("--grid", default="d128", choices=["d128", "d64", "all"],
                   help="shape grid: the D=128 video grid, the D=64 ViT shapes, or both")
    p.add_argument("--out-dir", default="out", help="where to write NAME.json, NAME.md and NAME.png")
    p.add_argument("--name", default=None, help="base file name (default: kernel_bench or kernel_bench_quick)")
    p.add_argument("--no-plot", action="store_true", help="skip the PNG plot")
    p.add_argument("--no-progress", action="store_true", help="hide progress bars")


def run(args: argparse.Namespace) -> int:
    from fp4vis.evals import kernel_bench as kb

    resolve_policies(args.policies)  # clear error for unknown names
    policies = tuple(p.strip() for p in args.policies.split(",") if p.strip())
    if not args.quick and not torch.cuda.is_available():
        raise UsageError("the full kernel benchmark needs a CUDA GPU (none is visible here); "
                         "run `fp4vis bench --quick` for the CPU smoke test")
    if args.quick and args.backends and {b.strip() for b in args.backends.split(",") if b.strip()} != {"reference"}:
        raise UsageError("--backends: --quick times the reference backend on the CPU only; drop --quick to time "
                         f"{args.backends} on a GPU")
    name = args.name or ("kernel_bench_quick" if args.quick else "kernel_bench")
    out_dir = check_output_dir(args.out_dir, "--out-dir")
    kwargs: dict[str, Any] = {"policies": policies, "quick": args.quick,
                              "log": None if args.no_progress else print}
    if not args.quick:
        shapes = {"d128": kb.GRID_D128, "d64": kb.GRID_D64, "all": None}[args.grid]
        if shapes is None:
            shapes = kb.as_shapes(kb.GRID_D128) + kb.as_shapes(kb.GRID_D64, d=64)
        kwargs["shapes"] = shapes
        kwargs["backends"] = tuple(b.strip() for b in args.backends.split(",")) if args.backends else BENCH_BACKENDS
    rows = kb.run_grid(**kwargs)
    json_path = kb.write_results(rows, out_dir / f"{name}.json",
                                 extra={"command": " ".join(sys.argv), "quick": args.quick})
    if args.quick:
        print("quick: the reference emulation on the CPU, median wall time of 3 calls per shape (ms); no FLOP rate "
              "and no error are measured (the reference is what errors are measured against)")
    print(kb.summary_table(rows))
    print(f"json: {json_path}\nmarkdown: {json_path.with_suffix('.md')}")
    if args.quick and not args.no_plot:
        print("plot: none in quick mode (one backend's times, no error: the table above says all of it)")
    elif not args.no_plot:
        from fp4vis.evals.plots import speed_error_plot

        try:
            png = speed_error_plot({"rows": rows}, out_dir / f"{name}.png", title="fp4vis kernel benchmark (GPU)")
            print(f"plot: {png}")
        except ImportError as e:
            print(f"fp4vis bench: plot skipped ({e}); pip install matplotlib", file=sys.stderr)
    return 0
