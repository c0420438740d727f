"""``fp4vis eval pipeline``: any diffusers text-to-image or text-to-video pipeline's per-step speed and fidelity
against BF16, or a published denoiser's speed alone (``fp4vis.evals.pipeline_eval``, the pipeline eval's generic
configuration)."""

from __future__ import annotations

import argparse

from .eval_common import eval_announcer, print_schedule_notes, run_line
from .options import Formatter, add_denoising_runs, add_prompt, add_runtime, guidance, policy_list, positive_int, seed


def speed_only_arch(s: str) -> str:
    """A published denoiser architecture's name (``fp4vis.evals.published_configs.PUBLISHED_DENOISERS``)."""
    from fp4vis.evals.published_configs import PUBLISHED_DENOISERS

    if s not in PUBLISHED_DENOISERS:
        raise argparse.ArgumentTypeError(f"unknown architecture {s!r}; known: {', '.join(PUBLISHED_DENOISERS)}")
    return s


def add_parser(esub: argparse._SubParsersAction) -> None:
    p = esub.add_parser("pipeline", formatter_class=Formatter, help="any diffusers T2I/T2V pipeline: per-step "
                                                                     "speed and fidelity vs BF16",
                        description="BF16 (diffusers' default attention), the BF16 attention baselines and each "
                                    "policy with the same seed and schedule: per-step time (mean, 95 %% interval), "
                                    "speedups against BF16 and each baseline, "
                                    "final-latent cosine/relL2 and, decoded, per-frame or per-image PSNR/SSIM vs "
                                    "BF16. --speed-only times a published transformer alone, random weights.")
    src = p.add_mutually_exclusive_group()
    src.add_argument("--model", help="Hub id or local diffusers folder (a text-to-image or text-to-video pipeline)")
    src.add_argument("--speed-only", type=speed_only_arch, metavar="ARCH",
                     help="a published denoiser with random weights, timed alone at its published size: "
                          "wan2.2-t2v-a14b, hunyuanvideo, flux.1-dev, qwen-image, cogvideox-5b (timings only; "
                          "labelled so)")
    p.add_argument("--policies", type=policy_list, default="fast")
    p.add_argument("--baselines", default="auto", metavar="auto|none|NAMES",
                   help="BF16 attention libraries run as the attention of the layers the policies patch by default "
                        "(self and joint attention), each a run attn=NAME timed as the policies are: fa4 "
                        "(flash-attn-4, text-padding masks too), sage (SageAttention), sdpa_cudnn, sdpa_flash (torch "
                        "SDPA), comma-separated (a call with a mask the library does not take keeps the model's "
                        "attention; the report counts them); auto: fa4 and sage where they can run here (the report "
                        "says why not), none: no baselines")
    add_prompt(p, required=False, help="(default: a fixed test prompt; not used by --speed-only)")
    p.add_argument("--seed", type=seed, default=0)
    p.add_argument("--steps", type=positive_int, default=10)
    p.add_argument("--height", type=positive_int, default=None, help="(default: the pipeline's or the "
                                                                     "architecture's)")
    p.add_argument("--width", type=positive_int, default=None)
    p.add_argument("--frames", type=positive_int, default=None, help="video models (default: the pipeline's, or "
                                                                     "the architecture's: 81, HunyuanVideo 129, "
                                                                     "CogVideoX-5B 49)")
    p.add_argument("--guidance", type=guidance, default=None, help="(default: the pipeline's or the "
                                                                   "architecture's)")
    add_denoising_runs(p, decode_help="decode and compare the outputs (the default with --model)",
                       no_decode_help="latents only",
                       compile_help="every run with the transformer under torch.compile, fullgraph=True (regional or "
                                    "full), compiled in its warm-up")
    p.add_argument("--cp", default=None, metavar="ulysses=N,ring=M",
                   help="every run's transformer under diffusers' context parallelism over the processes of a "
                        "torchrun launch (ulysses=N, ring=N or both; N x M processes; bf16 is then diffusers' own "
                        "context-parallel attention): torchrun --nproc-per-node 2 -m fp4vis.cli eval pipeline ... "
                        "--cp ulysses=2; rank 0 writes")
    p.add_argument("--out-dir", default="out")
    p.add_argument("--name", default=None, help="default: pipeline_fidelity, or pipeline_speed with --speed-only")
    add_runtime(p)


def run(args: argparse.Namespace, common: dict) -> dict | None:
    """``eval pipeline``: the eval, then one line per run."""
    from fp4vis.evals.pipeline_eval import PipelineEvalConfig, run_pipeline_eval
    from fp4vis.evals.timed_runs import DEFAULT_PROMPT, routing_text

    config = PipelineEvalConfig(
        args.model, speed_only=args.speed_only, policies=args.policies, prompt=args.prompt or DEFAULT_PROMPT,
        negative_prompt=args.negative_prompt, height=args.height, width=args.width, frames=args.frames,
        steps=args.steps, guidance_scale=args.guidance, seed=args.seed, decode=args.decode,
        warmup=not args.no_warmup, compile=args.compile, name=args.name, baselines=args.baselines, cp=args.cp,
        **common)
    r = run_pipeline_eval(config, say=eval_announcer(args))
    if r is None:   # a rank other than 0 of a --cp run: rank 0 reports
        return None
    emulated = print_schedule_notes(r)
    for name, entry in r["runs"].items():
        routing = (f"; {entry['baseline']['name']}: {routing_text(entry['baseline']['routing'])}"
                   if "baseline" in entry else "")
        timing = f"{entry['step_s']['mean']:.4f} s per step" if "step_s" in entry else ""
        print(run_line(name, entry, emulated, timing, routing))
    return r
