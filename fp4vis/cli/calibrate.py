"""``fp4vis calibrate wan|pipeline|vit|mae``: record per-layer logit statistics on calibration inputs and
write a guard plan."""

from __future__ import annotations

import argparse
from typing import Any

from .options import Formatter, announcer, finite_float, guidance, policy, positive_int, seed


def add_parser(sub: argparse._SubParsersAction) -> None:
    pc = sub.add_parser("calibrate", formatter_class=Formatter, help="calibrate a guard plan (which layers to guard)",
                        description="Run the model's exact attention on calibration inputs, record per-layer "
                                    "logit statistics and write a guard plan (JSON) for --guard-plan.")
    csub = pc.add_subparsers(dest="calib_kind", metavar="KIND")
    csub.required = True
    for kind, helptext in (("wan", "a Wan2.1 pipeline on prompts"),
                           ("pipeline", "any diffusers text-to-image or text-to-video pipeline on prompts"),
                           ("vit", "a ViT classifier on images"), ("mae", "a ViTMAE on images")):
        p = csub.add_parser(kind, formatter_class=Formatter, help=helptext)
        p.add_argument("--model", required=True, help="Hub id or local folder" + (
            " (vit: also timm:<name>; mae: also config:default)" if kind in ("vit", "mae") else ""))
        p.add_argument("--policy", type=policy, default="fast",
                       help="the Direct-P policy the plan protects (generate's and eval's default too; a plan "
                            "applies only to its policy)")
        p.add_argument("--out", "-o", default="guard_plan.json", help="where to write the plan")
        p.add_argument("--threshold", type=finite_float, default=None, help="guard when the statistic (log2 units) "
                                                                     "reaches this (default: 0.75 x the limit)")
        p.add_argument("--fraction", type=finite_float, default=None, help="threshold as a fraction of the limit, "
                                                                         "in (0, 1.5]")
        p.add_argument("--seed", type=seed, default=0)
        if kind in ("wan", "pipeline"):
            # Wan2.1: a short clip at its 480p size; any other pipeline: its own call defaults (None)
            wan = kind == "wan"
            same = "" if wan else " (default: the pipeline's)"
            p.add_argument("--prompt", action="append", required=True, help="calibration prompt (repeatable)")
            p.add_argument("--frames", type=positive_int, default=17 if wan else None, help="video pipelines" + same)
            p.add_argument("--steps", type=positive_int, default=None,
                           help="denoising steps of each calibration run (default 4; with --target: the model's)")
            p.add_argument("--height", type=positive_int, default=480 if wan else None, help=same.strip())
            p.add_argument("--width", type=positive_int, default=832 if wan else None, help=same.strip())
            p.add_argument("--guidance", type=guidance, default=5.0 if wan else None,
                           help="classifier-free guidance scale, >= 0 (at most 1: no guidance)" + same)
            if wan:
                p.add_argument("--image", default=None, help="conditioning image: calibrate an image-to-video "
                                                             "(I2V) pipeline, its image branch included")
            p.add_argument("--force", action="store_true", help="calibrate on prompts a model trained on a closed "
                                                                "set of prompts (fp4vis:digits-wan) does not know")
            t = p.add_argument_group("a plan for a fidelity target (which steps and layers stay exact; "
                                     "docs/plan.md)")
            t.add_argument("--target", default=None, metavar="METRIC=VALUE",
                           help="search the plan that meets this against BF16 on the prompts with the most attention "
                                "time in FP4: psnr=30 (frames' PSNR, dB), cosine=0.99 (latents), ssim=0.95")
            t.add_argument("--statistic", choices=["mean", "worst", "lower"], default="lower",
                           help="the target's statistic over the prompts: the lower end of the mean's 95 %% interval "
                                "(default: a margin for prompts the plan was not chosen on), the mean, or the worst "
                                "prompt's")
            t.add_argument("--budget", type=positive_int, default=None,
                           help="pipeline runs the search may make besides BF16's (default 24)")
            t.add_argument("--check-prompt", action="append", default=None,
                           help="a held-out prompt to check the plan on (repeatable): the report gives each figure "
                                "with its 95 %% interval there")
            t.add_argument("--no-guard", action="store_true", help="do not try the guard policy on the FP4 layers")
        else:
            p.add_argument("--data", required=True, help="ImageFolder root: ROOT/<class>/<image>")
            p.add_argument("--limit", type=positive_int, default=16, help="calibration images")
            p.add_argument("--resolution", type=positive_int, default=None)
            p.add_argument("--random-weights", action="store_true")
            if kind == "mae":
                p.add_argument("--decoder", action="store_true", help="also calibrate the decoder layers")
        p.add_argument("--device", default="auto")
        p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
        p.add_argument("--no-progress", action="store_true")


def run(args: argparse.Namespace) -> int:
    from fp4vis.patching.guard import calibrate
    from fp4vis.patching.guard_plan import GuardRule
    from fp4vis.policy import get_policy
    from fp4vis.services.outputs import check_output_file
    from fp4vis.services.runtime import resolve_device, resolve_dtype
    from fp4vis.services.usage import UsageError

    # every option is checked before the model loads (minutes on a real checkpoint)
    if not get_policy(args.policy).is_direct_p:
        why = (" (its online row maximum has no range to guard: run it without a plan)"
               if get_policy(args.policy).is_fp8_pv else "")
        raise UsageError(f"--policy: {args.policy!r} is not a Direct-P policy{why}; a guard plan protects one "
                         "(fast, wan_fast, accurate, ...)")
    try:
        rule = GuardRule(**{k: v for k, v in (("fraction", args.fraction), ("threshold", args.threshold))
                            if v is not None})
    except ValueError as exc:
        option, _, reason = str(exc).partition(": ")
        raise UsageError(f"--{option}: {reason}") from None
    out = check_output_file(args.out, "--out")
    if args.calib_kind in ("wan", "pipeline"):
        if args.target is not None:
            from .calibrate_target import run_target

            return run_target(args, out)
        for option in ("budget", "check_prompt", "no_guard"):
            if getattr(args, option) not in (None, False):
                raise UsageError(f"--{option.replace('_', '-')}: only with --target")
        args.steps = 4 if args.steps is None else args.steps
    if args.calib_kind == "wan":
        from fp4vis.pipelines.model_files import check_prompt
        from fp4vis.pipelines.wan_sizes import wan_geometry

        for prompt in args.prompt:
            check_prompt(args.model, prompt, force=args.force)
        wan_geometry(args.model).check(height=args.height, width=args.width, frames=args.frames, model=args.model,
                                       prefix="--")
    if args.calib_kind == "pipeline":
        call, settings = _pipeline_settings(args)
    if args.calib_kind in ("vit", "mae"):
        from fp4vis.evals.common import check_image_folder

        check_image_folder(args.data)
    image = None
    if args.calib_kind == "wan" and args.image is not None:
        from pathlib import Path

        from PIL import Image
        if not Path(args.image).is_file():
            raise UsageError(f"--image: file {args.image!r} does not exist")
        try:
            image = Image.open(args.image).convert("RGB")
        except Exception as exc:  # noqa: BLE001 - any unreadable file is the user's
            raise UsageError(f"--image: {args.image!r} is not an image ({type(exc).__name__})") from None
    dev, dtype = resolve_device(args.device), resolve_dtype(args.dtype)
    kw: dict[str, Any] = {"rule": rule, "model_id": args.model}
    if args.calib_kind == "wan":
        from fp4vis.pipelines.wan_video import calibration_inputs, load_wan_pipeline

        target = load_wan_pipeline(args.model, device=dev, dtype=dtype)
        i2v = type(target).__name__ == "WanImageToVideoPipeline"
        if image is None and i2v:
            raise UsageError(f"--model: {args.model!r} is an image-to-video model: pass --image")
        if image is not None and not i2v:
            raise UsageError(f"--image: {args.model!r} is a text-to-video model ({type(target).__name__}); drop "
                             "--image, or give an image-to-video checkpoint")
        target.set_progress_bar_config(disable=args.no_progress)
        what = (f"{len(args.prompt)} prompt{'s' if len(args.prompt) > 1 else ''}, {args.width}x{args.height}, "
                f"{args.frames} frames, {args.steps} steps")
        inputs = calibration_inputs(target, args.prompt, height=args.height, width=args.width, frames=args.frames,
                                    steps=args.steps, guidance_scale=args.guidance, seed=args.seed, image=image)
    elif args.calib_kind == "pipeline":
        from fp4vis.pipelines.diffusers_generate import calibration_inputs, describe, load_pipeline

        target = load_pipeline(args.model, device=dev, dtype=dtype)
        target.set_progress_bar_config(disable=args.no_progress)
        what = (f"{len(args.prompt)} prompt{'s' if len(args.prompt) > 1 else ''} ({call.class_name}), "
                f"{describe(settings)}")
        inputs = calibration_inputs(args.prompt, settings, seed=args.seed)
    elif args.calib_kind == "vit":
        from fp4vis.evals.vit_top1 import calibration_inputs, load_classifier

        clf = load_classifier(args.model, resolution=args.resolution, random_weights=args.random_weights,
                              device=dev, dtype=dtype, seed=args.seed)
        target, inputs = clf.model, calibration_inputs(clf, args.data, limit=args.limit)
        what = f"{len(inputs)} images from {args.data}"
    else:
        from fp4vis.evals.mae_psnr import calibration_inputs, load_mae

        target, mean, std, _ = load_mae(args.model, random_weights=args.random_weights, device=dev, dtype=dtype,
                                        seed=args.seed)
        kw["decoder"] = args.decoder
        inputs = calibration_inputs(target, mean, std, args.data, limit=args.limit, resolution=args.resolution,
                                    seed=args.seed)
        what = f"{len(inputs)} images from {args.data}"
    if (say := announcer(args)) is not None:
        say(f"calibrate {args.calib_kind}: {args.model} on {what}: the model's exact attention, each layer's "
            f"logit statistics against policy {args.policy}'s range -> {out}")
    plan = calibrate(target, inputs, policy=args.policy, **kw)
    plan.save(out)
    print(plan.summary())
    print(f"guarded layers: {', '.join(plan.guarded) if plan.guarded else 'none'}")
    print(f"guard plan: {out}")
    return 0


def _pipeline_settings(args: argparse.Namespace) -> tuple[Any, dict[str, Any]]:
    """``calibrate pipeline``'s checks before the model loads: its pipeline's call (``PipelineCall``) and the
    keyword arguments of the settings given (a UsageError naming an option its call does not take)."""
    from fp4vis.pipelines.diffusers_generate import PipelineCall, pipeline_class_name
    from fp4vis.pipelines.model_files import check_prompt

    call = PipelineCall.of(pipeline_class_name(args.model), args.model)
    settings = call.arguments(height=args.height, width=args.width, frames=args.frames, steps=args.steps,
                              guidance_scale=args.guidance)
    for prompt in args.prompt:
        check_prompt(args.model, prompt, force=args.force)
    return call, settings
