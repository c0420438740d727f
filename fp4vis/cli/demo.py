"""``fp4vis demo``: FP4 attention on the small trained models fp4vis ships, on the CPU with no
network: ViT top-1 and MAE masked PSNR with their paired differences to BF16, the video model's latent
and frame fidelity and what its clips show, over several prompts with intervals, and each policy's
operator error; JSON, Markdown, a PNG plot, frame sheets and MP4 clips."""

from __future__ import annotations

import argparse
import sys

from .options import Formatter, policy_list, positive_int


def add_parser(sub: argparse._SubParsersAction) -> None:
    from fp4vis.evals.demo_defaults import DEFAULT_CLIPS, DEFAULT_LIMIT, DEMO_POLICIES, VIDEO_MODEL

    p = sub.add_parser("demo", formatter_class=Formatter,
                       help="FP4 attention on the shipped trained models (CPU, ~3 min, no network)",
                       description="Run the shipped digit models (fp4vis:digits-vit, fp4vis:digits-mae) on "
                                   "their held-out digits, and the video model (fp4vis:digits-wan, in float32) on "
                                   "--video-clips prompts, under each policy on the reference backend: ViT top-1 "
                                   "and MAE masked-patch PSNR with their paired differences to BF16 (95 %% "
                                   "intervals), the video's latent cosine after 1, 4 and all steps and its frames' "
                                   "PSNR / SSIM against BF16 and how often its clips read as the prompted digit "
                                   "and direction (intervals over the clips), the layers' logit range, and each "
                                   "policy's attention-layer error; write demo.json, demo.md, demo.png, "
                                   "demo_frames.png, demo_clips.png and the first clip of each policy (MP4).")
    p.add_argument("--out-dir", default="out/demo", help="where to write demo.json, demo.md, demo.png, the frame "
                                                        "strip, the clips and the evals' own reports")
    p.add_argument("--limit", type=positive_int, default=DEFAULT_LIMIT,
                   help="held-out digits per model (500 ship; balanced over the digits)")
    p.add_argument("--policies", type=policy_list, default=",".join(DEMO_POLICIES),
                   help="comma-separated policies; bf16 (the baseline) always runs")
    video = p.add_mutually_exclusive_group()
    video.add_argument("--video-model", default=VIDEO_MODEL,
                       help="the video model: the shipped one, or a folder written by scripts/train_digits_video.py")
    video.add_argument("--no-video", action="store_true", help="leave the video model out")
    p.add_argument("--video-clips", type=positive_int, default=DEFAULT_CLIPS,
                   help="prompts of the video model, spread over the digits and directions (2 to 40; the time "
                        "grows with them: about 16 s of a quiet 2-core CPU per clip)")
    p.add_argument("--no-progress", action="store_true", help="hide progress bars and stage messages")


def run(args: argparse.Namespace) -> int:
    from fp4vis.evals.demo import run_demo, summary_table
    from fp4vis.services.outputs import check_output_dir

    out_dir = check_output_dir(args.out_dir, "--out-dir")
    log = None if args.no_progress else (lambda msg: print(msg, file=sys.stderr, flush=True))
    r = run_demo(out_dir, policies=args.policies, limit=args.limit, progress=not args.no_progress, log=log,
                 video_model=None if args.no_video else args.video_model, video_clips=args.video_clips)
    print(summary_table(r))
    if r["video"]["status"] != "measured":
        print(f"video model: {r['video']['note']}")
    elif r["video"]["files"].get("mp4_skipped"):
        print(f"warning: MP4 clips not written: {r['video']['files']['mp4_skipped']}")
    print(f"{r['images']} digits per model, {r['seconds']['total_s']:.1f} s")
    for kind, path in r["files"].items():
        print(f"{kind}: {path}")
    if r["video"]["status"] == "measured":
        print(f"frames: {r['video']['files']['strip']}\nclips sheet: {r['video']['files']['sheet']}")
        for policy, path in r["video"]["files"]["mp4"].items():
            print(f"clip {policy}: {path}")
    return 0
