"""``fp4vis generate``: a video or an image from a diffusers pipeline under an attention policy (Wan2.1's T2V and
I2V through ``fp4vis.pipelines.wan_generate``, any other through ``fp4vis.pipelines.diffusers_generate``)."""

from __future__ import annotations

import argparse
from typing import Any

from fp4vis.services.runtime import COMPILE_MODES

from .options import (
    POLICY_HELP,
    Formatter,
    add_prompt,
    add_runtime,
    announcer,
    guidance,
    int_list,
    policy,
    positive_int,
    seed,
)

DEFAULT = " (default: the model's; see above)"
WAN_ONLY = " (Wan2.1 pipelines only)"


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("generate", formatter_class=Formatter,
                       help="generate a video or an image with a diffusers pipeline (Wan2.1 T2V/I2V, any T2V/T2I)",
                       description="Generate with a diffusers pipeline under an attention policy; write an MP4 "
                                   "(a video pipeline) or a PNG (an image pipeline) and, beside it, a JSON sidecar "
                                   "of the same name (model, prompt, seed, size, steps, policy, guard plan, "
                                   "timings, versions, GPU). The pipeline class is the one the model's "
                                   "model_index.json names. Wan2.1 (WanPipeline, WanImageToVideoPipeline): size, "
                                   "frames, steps, guidance and fps default to the model's, a shipped model's "
                                   "own (fp4vis:digits-wan: 64x64, 13 frames), Wan2.1's 480p settings for any "
                                   "other (480x832, 81 frames, 50 steps, guidance 5, 16 fps). Any other "
                                   "text-to-video or text-to-image pipeline: the settings not given are the "
                                   "pipeline's own call defaults (fps: its frame_rate, else 16).")
    p.add_argument("--model", required=True, help="Hub id (e.g. Wan-AI/Wan2.1-T2V-1.3B-Diffusers), local "
                                                  "diffusers folder, or fp4vis:digits-wan (shipped)")
    add_prompt(p, required=True, help="what to show; a model trained on a closed set of prompts (fp4vis:digits-wan: "
                                      "\"digit <0-9> moving <left|right|up|down>\") refuses any other",
               force_help="generate from a prompt the model does not know (a warning instead of the error)")
    p.add_argument("--image", default=None, help="conditioning image for image-to-video (I2V) models" + WAN_ONLY)
    p.add_argument("--policy", type=policy, default="fast", help=f"one of {POLICY_HELP}")
    p.add_argument("--seed", type=seed, default=0, help="seed of the initial noise, -2**63 .. 2**64 - 1")
    p.add_argument("--frames", type=positive_int, default=None,
                   help="number of frames (video pipelines): 4k+1 for Wan2.1's VAE, at most what the transformer's "
                        "rotary embedding covers (both read from the model's config)" + DEFAULT)
    p.add_argument("--steps", type=positive_int, default=None, help="denoising steps" + DEFAULT)
    p.add_argument("--height", type=positive_int, default=None,
                   help="a multiple of 16 for Wan2.1 (the VAE's factor x the patch, from the model's config)" + DEFAULT)
    p.add_argument("--width", type=positive_int, default=None, help="as --height" + DEFAULT)
    p.add_argument("--guidance", type=guidance, default=None,
                   help="classifier-free guidance scale, >= 0 (at most 1: no guidance)" + DEFAULT)
    p.add_argument("--fps", type=positive_int, default=None, help=DEFAULT.strip())
    p.add_argument("--exact-steps", type=int_list, default=None, metavar="I,J",
                   help="denoising steps that run exact attention, e.g. 0,-1 (first and last); each in 0..steps-1 "
                        "or -steps..-1")
    p.add_argument("--output", "-o", default=None,
                   help="MP4 (a video pipeline) or PNG (an image pipeline) path; the sidecar gets the same name, "
                        ".json (default: video.mp4, or image.png)")
    p.add_argument("--cp", default=None, metavar="ulysses=N,ring=M",
                   help="context parallelism over the processes of a torchrun launch (ulysses=N, ring=N or both; "
                        "N x M processes): torchrun --nproc-per-node 2 -m fp4vis.cli generate ... --cp ulysses=2; "
                        "rank 0 writes the video or image")
    p.add_argument("--compile", nargs="?", const="regional", default=None, choices=COMPILE_MODES,
                   help="torch.compile the transformer with fullgraph=True: regional (the default: diffusers' "
                        "compile_repeated_blocks, one graph shared by the blocks) or full (the whole transformer); "
                        "the first step includes the compilation")
    add_runtime(p)


def run(args: argparse.Namespace) -> int:
    from fp4vis.pipelines.diffusers_generate import is_wan, pipeline_index, run_pipeline_generate
    from fp4vis.pipelines.wan_generate import run_generate
    from fp4vis.services.outputs import check_output_file

    index = pipeline_index(args.model)   # read once here: it picks the pipeline, and the run takes it
    if not is_wan(args.model, index):   # any other diffusers pipeline; its own checks refuse the Wan-only options
        out = run_pipeline_generate(_options(args, cp=args.cp), say=announcer(args), index=index)
        if out["output"] is None:   # a rank other than 0 of a --cp run: rank 0 reports
            return 0
        t = out["timings"]
        stages = ", ".join(f"{name} {t[key]:.2f} s" for name, key in (
            ("load", "load_s"), ("text", "text_encode_s"), ("denoise", "denoise_s"), ("decode", "decode_s"))
            if t[key] is not None)
        print(f"{out['kind']}: {out['output']}\nsidecar: {out['sidecar']}\ntimings: {stages}")
        return 0
    args.output = "video.mp4" if args.output is None else args.output
    cp = None
    if args.cp is not None:
        from fp4vis.pipelines.context_parallel import parse_cp

        cp = parse_cp(args.cp)   # the output is checked by rank 0 alone, once the ranks are up
    else:
        args.output = check_output_file(args.output, "--output")

    out = run_generate(_options(args, cp=cp), say=announcer(args), index=index)
    if out["video"] is None:  # a rank other than 0 of a --cp run: rank 0 reports
        return 0
    t = out["timings"]
    print(f"video: {out['video']}\nsidecar: {out['sidecar']}\n"
          f"timings: load {t['load_s']:.2f} s, text {t['text_encode_s']:.2f} s, denoise {t['denoise_s']:.2f} s, "
          f"decode {t['decode_s']:.2f} s")
    return 0


def _options(args: argparse.Namespace, *, cp: Any):
    """The ``GenerateOptions`` of the command line (``cp``: as the run takes it)."""
    from fp4vis.pipelines.wan_generate import GenerateOptions

    return GenerateOptions(
        model=args.model, prompt=args.prompt, output=args.output, negative_prompt=args.negative_prompt,
        image=args.image, policy=args.policy, guard_plan=args.guard_plan, seed=args.seed, height=args.height,
        width=args.width, frames=args.frames, steps=args.steps, guidance_scale=args.guidance, fps=args.fps,
        device=args.device, dtype=args.dtype, backend=args.backend, exact_steps=args.exact_steps,
        progress=not args.no_progress, cp=cp, force=args.force, compile=args.compile)
