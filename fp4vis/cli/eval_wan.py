"""``fp4vis eval wan``: a Wan2.1 pipeline's fidelity against BF16 and its end-to-end speed
(``fp4vis.evals.wan_fidelity``, the pipeline eval's Wan configuration)."""

from __future__ import annotations

import argparse

from .eval_common import PROTOCOL_HELP, eval_announcer, print_schedule_notes, run_line
from .options import (
    Formatter,
    add_denoising_runs,
    add_prompt,
    add_runtime,
    guidance,
    int_list,
    policy_list,
    positive_int,
    seed,
)


def add_parser(esub: argparse._SubParsersAction) -> None:
    p = esub.add_parser("wan", formatter_class=Formatter, help="Wan2.1 fidelity vs BF16 and end-to-end speed",
                        description="BF16 (diffusers' default attention), the BF16 attention baselines and each "
                                    "policy with identical seed, latents and prompt embeddings: wall times "
                                    "(denoise, VAE decode, text encoding), speedups against BF16 and each "
                                    "baseline, final-latent cosine/relL2, per-frame PSNR/SSIM vs BF16. Size, "
                                    "frames and guidance default to the model's (fp4vis:digits-wan: its own; any "
                                    "other: 480x832, 81 frames, guidance 5).")
    src = p.add_mutually_exclusive_group()
    src.add_argument("--model", help="Hub id, local diffusers folder, or fp4vis:digits-wan (shipped)")
    src.add_argument("--speed-only", choices=["1.3B", "14B"],
                     help="the real Wan2.1 architecture with random weights (timings only; labelled so)")
    p.add_argument("--protocol", choices=["paper"], default=None, help=PROTOCOL_HELP)
    p.add_argument("--policies", type=policy_list, default="wan_fast,fast,accurate")
    p.add_argument("--baselines", default="auto", metavar="auto|none|NAMES",
                   help="BF16 attention libraries run as the attention of every self-attention layer (attn1), "
                        "each a run attn1=NAME timed as the policies are: fa4 (flash-attn-4), sage "
                        "(SageAttention), sdpa_cudnn, sdpa_flash (torch SDPA), comma-separated; auto: fa4 and "
                        "sage where they can run here (the report says why not), none: no baselines")
    add_prompt(p, required=False, help="default: the model's own (fp4vis:digits-wan: its training record's), else "
                                       "a fixed test prompt; a model trained on a closed set of prompts refuses any "
                                       "other",
               force_help="run a prompt the model does not know (a warning instead of the error)")
    p.add_argument("--seed", type=seed, default=0)
    p.add_argument("--frames", type=positive_int, default=None, help="(default: the model's)")
    p.add_argument("--steps", type=positive_int, default=10)
    p.add_argument("--height", type=positive_int, default=None, help="(default: the model's)")
    p.add_argument("--width", type=positive_int, default=None, help="(default: the model's)")
    p.add_argument("--guidance", type=guidance, default=None, help=">= 0, at most 1: no classifier-free guidance "
                                                                   "(default: the model's)")
    p.add_argument("--latent-steps", type=int_list, default=(), metavar="K,L",
                   help="also the latent cosine/relL2 after K, L denoising steps (e.g. 1,4), each in 1..steps")
    p.add_argument("--operator-error", action="store_true",
                   help="each self-attention layer re-run under every policy on the BF16 run's inputs, every step")
    add_denoising_runs(p, decode_help="decode the videos (default: yes with --model, no with --speed-only)",
                       no_decode_help="time the denoising only",
                       compile_help="every run (BF16, the baselines, the policies) with the transformer under "
                                    "torch.compile, fullgraph=True: regional (the default: diffusers' "
                                    "compile_repeated_blocks) or full (transformer.compile); each run compiles in its "
                                    "warm-up, reported apart")
    p.add_argument("--save-videos", action="store_true", help="also write each run's MP4 to --out-dir")
    p.add_argument("--out-dir", default="out")
    p.add_argument("--name", default=None, help="default: wan_fidelity, or wan_speed with --speed-only")
    add_runtime(p)


def check_options(args: argparse.Namespace, size: dict[str, int]) -> None:
    """Before anything loads: --latent-steps within the run's steps, and the size and frames the model's VAE
    and transformer can take (read from its configs, or the --speed-only architecture's)."""
    from fp4vis.pipelines.wan_sizes import WanGeometry, wan_geometry
    from fp4vis.services.usage import UsageError

    bad = [k for k in args.latent_steps if not 1 <= k <= args.steps]
    if bad:
        raise UsageError(f"--latent-steps: {bad[0]} steps is not within the run's {args.steps} (each K in "
                         f"1..{args.steps}: the latents after K steps)")
    geometry = wan_geometry(args.model) if args.model else WanGeometry.of_size(args.speed_only)
    geometry.check(**size, model=args.model or f"Wan2.1 {args.speed_only}", prefix="--")


def run(args: argparse.Namespace, common: dict) -> dict:
    """The eval (prompt, size and steps checked before anything loads), then one line per run."""
    from fp4vis.evals.timed_runs import DEFAULT_PROMPT
    from fp4vis.evals.wan_fidelity import WanEvalConfig, run_wan_eval
    from fp4vis.pipelines.model_files import check_prompt, training_record
    from fp4vis.pipelines.wan_video import WAN_GENERATION, generation_defaults

    gen = generation_defaults(args.model) if args.model else WAN_GENERATION
    own = (training_record(args.model).get("generation") or {}).get("prompt") if args.model else None
    prompt = args.prompt or own or DEFAULT_PROMPT
    if args.model:
        check_prompt(args.model, prompt, force=args.force)
    size = dict(height=args.height or gen["height"], width=args.width or gen["width"],
                frames=args.frames or gen["frames"])
    check_options(args, size)
    config = WanEvalConfig(
        args.model, speed_only=args.speed_only, policies=args.policies, prompt=prompt,
        negative_prompt=args.negative_prompt, **size, steps=args.steps,
        guidance_scale=gen["guidance_scale"] if args.guidance is None else args.guidance, seed=args.seed,
        decode=args.decode, warmup=not args.no_warmup, save_videos=args.save_videos, name=args.name,
        latent_steps=args.latent_steps, operator_error=args.operator_error, fps=gen["fps"],
        baselines=args.baselines, compile=args.compile, **common)
    r = run_wan_eval(config, say=eval_announcer(args))
    emulated = print_schedule_notes(r)
    for name, entry in r["runs"].items():
        timing = f"denoise {entry['timings']['denoise_s']:.3f} s" if "timings" in entry else ""
        print(run_line(name, entry, emulated, timing))
    return r
