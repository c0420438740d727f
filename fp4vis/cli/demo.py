"""``fp4vis demo``: FP4 attention on the small trained models fp4vis ships, on the CPU in about two
minutes, with no network: ViT top-1 and agreement, MAE masked PSNR with its interval, and each
policy's operator error; JSON, Markdown and a PNG plot."""

from __future__ import annotations

import argparse
import sys

from .options import Formatter, policy_list, positive_int


def add_parser(sub: argparse._SubParsersAction) -> None:
    from fp4vis.evals.demo import DEFAULT_LIMIT, DEMO_POLICIES

    p = sub.add_parser("demo", formatter_class=Formatter,
                       help="FP4 attention on the shipped trained models (CPU, ~2 min, no network)",
                       description="Run the shipped digit models (fp4vis:digits-vit, fp4vis:digits-mae) on "
                                   "their held-out digits under each policy on the reference backend: ViT "
                                   "top-1 and agreement with BF16, MAE masked-patch PSNR with its 95 %% "
                                   "interval, and each policy's attention-layer error; write demo.json, demo.md "
                                   "and demo.png. The video model is not shipped yet.")
    p.add_argument("--out-dir", default="out/demo", help="where to write demo.json, demo.md, demo.png and the "
                                                        "evals' own reports")
    p.add_argument("--limit", type=positive_int, default=DEFAULT_LIMIT,
                   help="held-out digits per model (500 ship; balanced over the digits)")
    p.add_argument("--policies", type=policy_list, default=",".join(DEMO_POLICIES),
                   help="comma-separated policies; bf16 (the baseline) always runs")
    p.add_argument("--no-progress", action="store_true", help="hide progress bars and stage messages")


def run(args: argparse.Namespace) -> int:
    from fp4vis.evals.demo import run_demo, summary_table
    from fp4vis.services import check_output_dir

    out_dir = check_output_dir(args.out_dir, "--out-dir")
    log = None if args.no_progress else (lambda msg: print(msg, file=sys.stderr, flush=True))
    r = run_demo(out_dir, policies=args.policies, limit=args.limit, progress=not args.no_progress, log=log)
    print(summary_table(r))
    print(f"video model: {r['video']['note']}")
    print(f"{r['images']} digits per model, {r['seconds']['total_s']:.1f} s")
    for kind, path in r["files"].items():
        print(f"{kind}: {path}")
    return 0
