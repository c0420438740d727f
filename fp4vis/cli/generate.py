"""``fp4vis generate``: a video from a Wan2.1 pipeline (T2V or I2V) under an attention policy."""

from __future__ import annotations

import argparse

from fp4vis.services.runtime import COMPILE_MODES

from .options import POLICY_HELP, Formatter, add_runtime, announcer, guidance, int_list, policy, positive_int, seed

DEFAULT = " (default: the model's; see above)"


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("generate", formatter_class=Formatter, help="generate a video with Wan2.1 (T2V or I2V)",
                       description="Generate a video with a Wan2.1 pipeline under an attention policy; write an "
                                   "MP4 and, beside it, a JSON sidecar of the same name (model, prompt, seed, "
                                   "frames, steps, policy, guard plan, timings, versions, GPU). Size, frames, "
                                   "steps, guidance and fps default to the model's: a shipped model's own "
                                   "(fp4vis:digits-wan: 64x64, 13 frames), Wan2.1's 480p settings for any "
                                   "other (480x832, 81 frames, 50 steps, guidance 5, 16 fps).")
    p.add_argument("--model", required=True, help="Hub id (e.g. Wan-AI/Wan2.1-T2V-1.3B-Diffusers), local "
                                                  "diffusers folder, or fp4vis:digits-wan (shipped)")
    p.add_argument("--prompt", required=True, help="what to show; a model trained on a closed set of prompts "
                                                   "(fp4vis:digits-wan: \"digit <0-9> moving <left|right|up|down>\") "
                                                   "refuses any other")
    p.add_argument("--force", action="store_true", help="generate from a prompt the model does not know (a warning "
                                                        "instead of the error)")
    p.add_argument("--negative-prompt", default=None)
    p.add_argument("--image", default=None, help="conditioning image for image-to-video (I2V) models")
    p.add_argument("--policy", type=policy, default="fast", help=f"one of {POLICY_HELP}")
    p.add_argument("--seed", type=seed, default=0, help="seed of the initial noise, -2**63 .. 2**64 - 1")
    p.add_argument("--frames", type=positive_int, default=None,
                   help="number of frames: 4k+1 for Wan2.1's VAE, at most what the transformer's rotary embedding "
                        "covers (both read from the model's config)" + DEFAULT)
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
    p.add_argument("--output", "-o", default="video.mp4", help="MP4 path (the sidecar gets the same name, .json)")
    p.add_argument("--cp", default=None, metavar="ulysses=N,ring=M",
                   help="context parallelism over the processes of a torchrun launch (ulysses=N, ring=N or both; "
                        "N x M processes): torchrun --nproc-per-node 2 -m fp4vis.cli generate ... --cp ulysses=2; "
                        "rank 0 writes the video")
    p.add_argument("--compile", nargs="?", const="regional", default=None, choices=COMPILE_MODES,
                   help="torch.compile the transformer with fullgraph=True: regional (the default: diffusers' "
                        "compile_repeated_blocks, one graph shared by the blocks) or full (the whole transformer); "
                        "the first step includes the compilation")
    add_runtime(p)


def run(args: argparse.Namespace) -> int:
    from fp4vis.pipelines.wan_generate import GenerateConfig, run_generate
    from fp4vis.services.outputs import check_output_file

    cp = None
    if args.cp is not None:
        from fp4vis.pipelines.context_parallel import parse_cp

        cp = parse_cp(args.cp)   # the output is checked by rank 0 alone, once the ranks are up
    else:
        args.output = check_output_file(args.output, "--output")

    config = GenerateConfig(
        model=args.model, prompt=args.prompt, output=args.output, negative_prompt=args.negative_prompt,
        image=args.image, policy=args.policy, guard_plan=args.guard_plan, seed=args.seed, height=args.height,
        width=args.width, frames=args.frames, steps=args.steps, guidance_scale=args.guidance, fps=args.fps,
        device=args.device, dtype=args.dtype, backend=args.backend, exact_steps=args.exact_steps,
        progress=not args.no_progress, cp=cp, force=args.force, compile=args.compile)
    out = run_generate(config, say=announcer(args))
    if out["video"] is None:  # a rank other than 0 of a --cp run: rank 0 reports
        return 0
    t = out["timings"]
    print(f"video: {out['video']}\nsidecar: {out['sidecar']}\n"
          f"timings: load {t['load_s']:.2f} s, text {t['text_encode_s']:.2f} s, denoise {t['denoise_s']:.2f} s, "
          f"decode {t['decode_s']:.2f} s")
    return 0
