"""``fp4vis eval vit|mae|wan|pipeline``: what FP4 attention costs in quality (and gains in speed) against the
model's own BF16 attention."""

from __future__ import annotations

import argparse

from fp4vis.services.runtime import COMPILE_MODES

from .options import (
    Formatter,
    add_runtime,
    announcer,
    guidance,
    int_list,
    main_process,
    non_negative_int,
    open_fraction,
    policy_list,
    positive_int,
    seed,
)

PROTOCOL_HELP = ("run the method's published protocol (fp4vis.evals.protocols): its model (unless --model), "
                 "sizes, image counts, seeds and policies, and its published figures beside each row")


def add_parser(sub: argparse._SubParsersAction) -> None:
    pe = sub.add_parser("eval", formatter_class=Formatter, help="quality/speed evals: vit, mae, wan, pipeline",
                        description="Measure what FP4 attention costs in quality (and gains in speed) against "
                                    "the model's own BF16 attention. Each eval writes NAME.json and NAME.md.")
    esub = pe.add_subparsers(dest="eval_command", metavar="EVAL")
    esub.required = True

    p = esub.add_parser("vit", formatter_class=Formatter, help="ViT classifier: top-1, agreement, logit and "
                                                                "per-layer attention error",
                        description="A timm or transformers classifier on an ImageFolder dataset "
                                    "(ROOT/<class>/<image>). Sharded over GPUs with `accelerate launch -m "
                                    "fp4vis.cli eval vit ...`.")
    p.add_argument("--model", default=None, help="Hub id (timm/... or a transformers id), local folder, or "
                                                 "timm:<registry name> (with --random-weights: no download)")
    p.add_argument("--data", required=True, help="ImageFolder root (ROOT/<class>/<image>) or the CIFAR-10 test set "
                                                 "(ROOT/cifar-10-batches-py)")
    p.add_argument("--protocol", choices=["paper"], default=None, help=PROTOCOL_HELP)
    p.add_argument("--resolution", type=positive_int, default=None,
                   help="input size in px (e.g. 1008: ~4k tokens for a /16 ViT); position embeddings are "
                        "interpolated. Default: the model's own")
    p.add_argument("--labels", default="auto", choices=["auto", "index", "names", "order", "none"],
                   help="how class folders map to model classes: folder = class index, = label name/synset, "
                        "sorted order, or none (agreement and logit error only)")
    p.add_argument("--policies", type=policy_list, default="fast,accurate", help="comma-separated FP4 policies")
    p.add_argument("--batch-size", type=positive_int, default=8)
    p.add_argument("--limit", type=positive_int, default=None, help="use only the first N images")
    p.add_argument("--random-weights", action="store_true", help="build the architecture with seeded random "
                                                                 "weights (numerics only; labelled in the report)")
    p.add_argument("--no-per-layer", action="store_true", help="skip the per-layer attention errors")
    p.add_argument("--seed", type=seed, default=0)
    p.add_argument("--workers", type=non_negative_int, default=0, help="DataLoader workers")
    p.add_argument("--out-dir", default="out", help="directory for NAME.json and NAME.md")
    p.add_argument("--name", default="vit_top1")
    add_runtime(p)

    p = esub.add_parser("mae", formatter_class=Formatter, help="ViTMAE reconstruction PSNR with identical masks",
                        description="Masked-patch and full-image PSNR of ViTMAE reconstructions (same seeded "
                                    "masks for BF16 and FP4), the mean FP4-BF16 difference with its 95 %% "
                                    "t-interval, and FP4-vs-BF16 reconstruction PSNR.")
    p.add_argument("--model", default=None, help="Hub id (e.g. facebook/vit-mae-base), local folder, or "
                                                 "config:default (ViTMAEConfig defaults, random weights)")
    p.add_argument("--data", required=True, help="a folder of images (e.g. COCO val2017) or an ImageFolder root")
    p.add_argument("--protocol", choices=["paper"], default=None, help=PROTOCOL_HELP)
    p.add_argument("--resolution", type=positive_int, default=None, help="input size (default: the model's)")
    p.add_argument("--mask-ratio", type=open_fraction, default=None, help="the share of patches masked, in (0, 1); "
                                                                         "default: the model's (0.75)")
    p.add_argument("--decoder", action="store_true", help="also run the MAE decoder in FP4 (default: encoder only)")
    p.add_argument("--policies", type=policy_list, default="fast,accurate")
    p.add_argument("--batch-size", type=positive_int, default=8)
    p.add_argument("--limit", type=positive_int, default=None)
    p.add_argument("--random-weights", action="store_true")
    p.add_argument("--seed", type=seed, default=0, help="seed of the masks (and of random weights)")
    p.add_argument("--workers", type=non_negative_int, default=0)
    p.add_argument("--out-dir", default="out")
    p.add_argument("--name", default="mae_psnr")
    add_runtime(p)

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
    p.add_argument("--prompt", default=None, help="default: the model's own (fp4vis:digits-wan: its training "
                                                 "record's), else a fixed test prompt; a model trained on a closed "
                                                 "set of prompts refuses any other")
    p.add_argument("--force", action="store_true", help="run a prompt the model does not know (a warning instead of "
                                                        "the error)")
    p.add_argument("--negative-prompt", default=None)
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
    dec = p.add_mutually_exclusive_group()
    dec.add_argument("--decode", dest="decode", action="store_true", default=None,
                     help="decode the videos (default: yes with --model, no with --speed-only)")
    dec.add_argument("--no-decode", dest="decode", action="store_false", help="time the denoising only")
    p.add_argument("--no-warmup", action="store_true", help="skip the untimed 1-step warm-up before each run")
    p.add_argument("--compile", nargs="?", const="regional", default=None, choices=COMPILE_MODES,
                   help="every run (BF16, the baselines, the policies) with the transformer under torch.compile, "
                        "fullgraph=True: regional (the default: diffusers' compile_repeated_blocks) or full "
                        "(transformer.compile); each run compiles in its warm-up, reported apart")
    p.add_argument("--save-videos", action="store_true", help="also write each run's MP4 to --out-dir")
    p.add_argument("--out-dir", default="out")
    p.add_argument("--name", default=None, help="default: wan_fidelity, or wan_speed with --speed-only")
    add_runtime(p)

    _add_pipeline_parser(esub)


def speed_only_arch(s: str) -> str:
    """A published denoiser architecture's name (``fp4vis.evals.published_configs.PUBLISHED_DENOISERS``)."""
    from fp4vis.evals.published_configs import PUBLISHED_DENOISERS

    if s not in PUBLISHED_DENOISERS:
        raise argparse.ArgumentTypeError(f"unknown architecture {s!r}; known: {', '.join(PUBLISHED_DENOISERS)}")
    return s


def _add_pipeline_parser(esub: argparse._SubParsersAction) -> None:
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
                          "wan2.2-t2v-a14b, hunyuanvideo, flux.1-dev, qwen-image (timings only; labelled so)")
    p.add_argument("--policies", type=policy_list, default="fast")
    p.add_argument("--baselines", default="auto", metavar="auto|none|NAMES",
                   help="BF16 attention libraries run as the attention of the layers the policies patch by default "
                        "(self and joint attention), each a run attn=NAME timed as the policies are: fa4 "
                        "(flash-attn-4, text-padding masks too), sage (SageAttention), sdpa_cudnn, sdpa_flash (torch "
                        "SDPA), comma-separated (a call with a mask the library does not take keeps the model's "
                        "attention; the report counts them); auto: fa4 and sage where they can run here (the report "
                        "says why not), none: no baselines")
    p.add_argument("--prompt", default=None, help="(default: a fixed test prompt; not used by --speed-only)")
    p.add_argument("--negative-prompt", default=None)
    p.add_argument("--seed", type=seed, default=0)
    p.add_argument("--steps", type=positive_int, default=10)
    p.add_argument("--height", type=positive_int, default=None, help="(default: the pipeline's or the "
                                                                     "architecture's)")
    p.add_argument("--width", type=positive_int, default=None)
    p.add_argument("--frames", type=positive_int, default=None, help="video models (default: the pipeline's, or "
                                                                     "the architecture's: 81, HunyuanVideo 129)")
    p.add_argument("--guidance", type=guidance, default=None, help="(default: the pipeline's or the "
                                                                   "architecture's)")
    dec = p.add_mutually_exclusive_group()
    dec.add_argument("--decode", dest="decode", action="store_true", default=None,
                     help="decode and compare the outputs (the default with --model)")
    dec.add_argument("--no-decode", dest="decode", action="store_false", help="latents only")
    p.add_argument("--no-warmup", action="store_true", help="skip the untimed 1-step warm-up before each run")
    p.add_argument("--compile", nargs="?", const="regional", default=None, choices=COMPILE_MODES,
                   help="every run with the transformer under torch.compile, fullgraph=True (regional or full), "
                        "compiled in its warm-up")
    p.add_argument("--out-dir", default="out")
    p.add_argument("--name", default=None, help="default: pipeline_fidelity, or pipeline_speed with --speed-only")
    add_runtime(p)


def _run_protocol(args: argparse.Namespace, common: dict) -> int:
    """``--protocol paper``: the published protocol's runs and its report beside the published figures."""
    from fp4vis.evals import protocols
    from fp4vis.services.usage import UsageError

    if getattr(args, "speed_only", None):
        raise UsageError("--protocol: needs the real weights (--model), not --speed-only")
    if args.eval_command == "vit":
        r = protocols.run_vit_protocol(args.data, model=args.model, **common)
        for label, run in r["runs"].items():
            for pol, top1 in run["top1_percent"].items():
                pub = run["published_top1_percent"].get(pol)
                print(f"{label} {pol}: top-1 {_fmt(top1)} % (published {_fmt(pub)} %)")
    elif args.eval_command == "mae":
        r = protocols.run_mae_protocol(args.data, model=args.model, **common)
        print(f"bf16: masked PSNR {_fmt(r['bf16_masked_psnr'])} dB (published {r['published_bf16_masked_psnr']})")
        for pol, v in r["policies"].items():
            pub = v["published_diff"]
            print(f"{pol}: FP4-BF16 {_fmt(v['masked_psnr_diff_vs_bf16']['mean'])} dB (published "
                  f"{pub[0] if pub else '—'} ± {pub[1] if pub else '—'})")
    else:
        r = protocols.run_wan_protocol(model=args.model, **common)
        for steps, pols in r["steps"].items():
            for pol, v in pols.items():
                pub = v["published"] or ("—", "—")
                print(f"{steps} steps {pol}: latent cosine {_fmt(v['latent_cosine'])} (published {pub[0]}), "
                      f"relL2 {_fmt(v['latent_rel_l2'])} (published {pub[1]})")
    for kind, path in (r.get("files") or {}).items():
        print(f"{kind}: {path}")
    return 0


def _wan_run_line(name: str, run: dict, emulated: bool = False) -> str:
    """One run of the Wan eval: its denoising time, speedups against BF16 and each baseline (none where the
    FP4 runs were the reference emulation: its times are no speed result), latent cosine."""
    if "error" in run:
        return f"{name}: FAILED {run['error']}"
    speedups = "" if emulated else ", ".join(f"{x:.2f}x vs {ref}" for ref, x in run.get("speedup_vs", {}).items()
                                             if ref != name)
    extra = f", speedup {speedups}" if speedups else ""
    if "latent_cosine" in run:
        extra += f", latent cosine {run['latent_cosine']:.5f}"
    return f"{name}: denoise {run['timings']['denoise_s']:.3f} s{extra}"


def _announcer(args: argparse.Namespace):
    """``say`` of an eval: the line saying what it runs (``announcer``), then, on a device without an FP4 kernel,
    the one warning that the policies run on the reference (``warn_reference_fallback``)."""
    from fp4vis.services.policies import warn_reference_fallback
    from fp4vis.services.runtime import resolve_device

    header = announcer(args)

    def say(text: str) -> None:
        if header is not None:
            header(text)
        for name in filter(None, (p.strip() for p in args.policies.split(","))):
            if warn_reference_fallback(args.backend, resolve_device(args.device), name,
                                       f"fp4vis eval {args.eval_command}"):
                break
    return say


def _check_wan_eval_options(args: argparse.Namespace, size: dict[str, int]) -> None:
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


def _run_pipeline(args: argparse.Namespace, common: dict) -> dict:
    """``eval pipeline``: the eval, then one line per run."""
    from fp4vis.evals.common import reference_timed
    from fp4vis.evals.pipeline_eval import DEFAULT_PROMPT, PipelineEvalConfig, routing_text, run_pipeline_eval

    config = PipelineEvalConfig(
        args.model, speed_only=args.speed_only, policies=args.policies, prompt=args.prompt or DEFAULT_PROMPT,
        negative_prompt=args.negative_prompt, height=args.height, width=args.width, frames=args.frames,
        steps=args.steps, guidance_scale=args.guidance, seed=args.seed, decode=args.decode,
        warmup=not args.no_warmup, compile=args.compile, name=args.name, baselines=args.baselines, **common)
    r = run_pipeline_eval(config, say=_announcer(args))
    for why in (f"{b}: {reason}" for b, reason in r["baselines_skipped"].items()):
        print(f"baseline skipped, {why}")
    emulated = reference_timed(r)
    if emulated:
        print("FP4 runs on the reference emulation: times are the emulation's, no speedup is given")
    for name, run in r["runs"].items():
        if "error" in run:
            print(f"{name}: FAILED {run['error']}")
            continue
        line = f"{name}: {run['step_s']['mean']:.4f} s per step"
        speedups = ", ".join(f"{x:.2f}x vs {ref}" for ref, x in run.get("speedup_vs", {}).items() if ref != name)
        if speedups and not emulated:
            line += f", speedup {speedups}"
        if "baseline" in run:
            line += f"; {run['baseline']['name']}: {routing_text(run['baseline']['routing'])}"
        if "latent_cosine" in run:
            line += f", latent cosine {run['latent_cosine']:.5f}"
        if "frames" in run:
            line += f", PSNR {run['frames']['psnr_mean']:.2f} dB, SSIM {run['frames']['ssim_mean']:.4f}"
        print(line)
    return r


def _fmt(x) -> str:
    return "—" if x is None else f"{x:.4g}"


def run(args: argparse.Namespace) -> int:
    from fp4vis.services.outputs import check_output_dir
    from fp4vis.services.usage import UsageError

    args.out_dir = check_output_dir(args.out_dir, "--out-dir")
    common = dict(device=args.device, dtype=args.dtype, backend=args.backend, guard_plan=args.guard_plan,
                  out_dir=args.out_dir, progress=not args.no_progress)
    if getattr(args, "protocol", None) is not None:
        return _run_protocol(args, common)
    if args.eval_command in ("vit", "mae") and args.model is None:
        raise UsageError("--model: required (or --protocol paper, which names its model)")
    if args.eval_command in ("wan", "pipeline") and args.model is None and args.speed_only is None:
        raise UsageError("--model or --speed-only: one is required"
                         + (" (or --protocol paper)" if args.eval_command == "wan" else ""))
    if args.eval_command == "vit":
        from fp4vis.evals.vit_top1 import VitEvalConfig, run_vit_eval

        config = VitEvalConfig(args.model, args.data, policies=args.policies, resolution=args.resolution,
                               batch_size=args.batch_size, limit=args.limit, labels=args.labels,
                               random_weights=args.random_weights, per_layer=not args.no_per_layer, seed=args.seed,
                               num_workers=args.workers, name=args.name, **common)
        r = run_vit_eval(config, say=_announcer(args))
        if not main_process():
            return 0
        base = r["bf16"]["top1"]
        print(f"bf16 (baseline): {'top-1 ' + format(base, '.4f') if base is not None else 'no labels: top-1 n/a'}, "
              "the model's own attention")
        for pol, p in r["policies"].items():
            top1 = f"top-1 {p['top1']:.4f}, " if p["top1"] is not None else ""
            print(f"{pol}: {top1}agreement {p['agreement_with_bf16']:.4f}, logit cosine {p['logit_cosine_mean']:.5f}, "
                  f"relL2 {p['logit_rel_l2_mean']:.4f}")
    elif args.eval_command == "mae":
        from fp4vis.evals.mae_psnr import MaeEvalConfig, run_mae_eval

        config = MaeEvalConfig(args.model, args.data, policies=args.policies, resolution=args.resolution,
                               batch_size=args.batch_size, limit=args.limit, random_weights=args.random_weights,
                               mask_ratio=args.mask_ratio, seed=args.seed, decoder=args.decoder,
                               num_workers=args.workers, name=args.name, **common)
        r = run_mae_eval(config, say=_announcer(args))
        if not main_process():
            return 0
        print(f"bf16 (baseline): masked-patch PSNR {r['bf16']['masked_psnr']['mean']:.3f} dB, the model's own "
              "attention")
        for pol, p in r["policies"].items():
            d = p["masked_psnr_diff_vs_bf16"]
            print(f"{pol}: masked-patch PSNR {p['masked_psnr']['mean']:.3f} dB, FP4-BF16 {d['mean']:+.4f} dB, "
                  f"recon PSNR vs BF16 {p['recon_psnr_vs_bf16']['mean']:.2f} dB")
    elif args.eval_command == "pipeline":
        r = _run_pipeline(args, common)
    else:
        from fp4vis.evals.wan_fidelity import DEFAULT_PROMPT, WanEvalConfig, run_wan_eval
        from fp4vis.pipelines.wan_video import WAN_GENERATION, check_prompt, generation_defaults, training_record

        gen = generation_defaults(args.model) if args.model else WAN_GENERATION
        own = (training_record(args.model).get("generation") or {}).get("prompt") if args.model else None
        prompt = args.prompt or own or DEFAULT_PROMPT
        if args.model:
            check_prompt(args.model, prompt, force=args.force)
        size = dict(height=args.height or gen["height"], width=args.width or gen["width"],
                    frames=args.frames or gen["frames"])
        _check_wan_eval_options(args, size)
        config = WanEvalConfig(
            args.model, speed_only=args.speed_only, policies=args.policies, prompt=prompt,
            negative_prompt=args.negative_prompt, **size, steps=args.steps,
            guidance_scale=gen["guidance_scale"] if args.guidance is None else args.guidance, seed=args.seed,
            decode=args.decode, warmup=not args.no_warmup, save_videos=args.save_videos, name=args.name,
            latent_steps=args.latent_steps, operator_error=args.operator_error, fps=gen["fps"],
            baselines=args.baselines, compile=args.compile, **common)
        r = run_wan_eval(config, say=_announcer(args))
        for why in (f"{b}: {reason}" for b, reason in r["baselines_skipped"].items()):
            print(f"baseline skipped, {why}")
        from fp4vis.evals.common import reference_timed

        emulated = reference_timed(r)
        if emulated:
            print("FP4 runs on the reference emulation: times are the emulation's, no speedup is given")
        for name, run in r["runs"].items():
            print(_wan_run_line(name, run, emulated))
    for kind, path in (r.get("files") or {}).items():
        print(f"{kind}: {path}")
    return 0
