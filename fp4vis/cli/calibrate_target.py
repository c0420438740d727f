"""``fp4vis calibrate wan|pipeline --target METRIC=VALUE``: the plan that meets a fidelity target against BF16
on the prompts with the most attention time in FP4 (``fp4vis.evals.plan_search``), written as a guard plan, and
its report beside it (``<out>_report.json`` / ``.md`` / ``.png``: ``fp4vis.evals.plan_report``)."""

from __future__ import annotations

import argparse
import dataclasses
from pathlib import Path

from fp4vis.services.usage import UsageError

from .options import announcer


def report_name(out: Path) -> str:
    """The report's file name beside the plan: ``plan.json`` -> ``plan_report``."""
    return f"{out.stem}_report"


def run_target(args: argparse.Namespace, out: Path) -> int:
    from fp4vis.evals.plan_search import DEFAULT_BUDGET, FidelityTarget, WanRuns, check_plan, search_plan
    from fp4vis.pipelines.diffusers_generate import is_wan, pipeline_class_name
    from fp4vis.pipelines.model_files import check_prompt
    from fp4vis.pipelines.wan_sizes import wan_geometry
    from fp4vis.pipelines.wan_video import GenerationConfig, generation_defaults, load_wan_pipeline
    from fp4vis.services.runtime import resolve_device, resolve_dtype

    # every option is checked before the model loads
    try:
        target = FidelityTarget.parse(args.target, args.statistic)
    except ValueError as exc:
        raise UsageError(f"--{exc}") from None
    if getattr(args, "image", None) is not None:
        raise UsageError("--image: the plan search runs text-to-video pipelines; drop --image")
    if not is_wan(args.model) or pipeline_class_name(args.model) != "WanPipeline":
        raise UsageError(f"--target: the plan search runs Wan text-to-video pipelines (WanPipeline) for now; "
                         f"{args.model!r} is a {pipeline_class_name(args.model)}")
    check = args.check_prompt or []
    for prompt in [*args.prompt, *check]:
        check_prompt(args.model, prompt, force=args.force)
    gen = generation_defaults(args.model)
    given = {"height": args.height, "width": args.width, "frames": args.frames, "steps": args.steps,
             "guidance_scale": args.guidance}
    gen = {**gen, **{k: v for k, v in given.items() if v is not None}}
    wan_geometry(args.model).check(height=gen["height"], width=gen["width"], frames=gen["frames"], model=args.model,
                                   prefix="--")
    dev, dtype = resolve_device(args.device), resolve_dtype(args.dtype)
    settings = GenerationConfig(height=gen["height"], width=gen["width"], frames=gen["frames"], steps=gen["steps"],
                                guidance_scale=gen["guidance_scale"], seed=args.seed,
                                backend="auto" if dev.type == "cuda" else "reference", progress=False)
    budget = args.budget or DEFAULT_BUDGET
    say = announcer(args) or (lambda s: None)
    say(f"calibrate {args.calib_kind} --target: {args.model} on {len(args.prompt)} prompts, {gen['width']}x"
        f"{gen['height']}, {gen['frames']} frames, {gen['steps']} steps: the plan for {target.describe()} with the "
        f"most attention time in FP4 (policy {args.policy}, at most {budget} pipeline runs) -> {out}")
    pipe = load_wan_pipeline(args.model, device=dev, dtype=dtype)
    pipe.set_progress_bar_config(disable=True)
    result = search_plan(pipe, args.prompt, args.policy, target, settings=settings, budget=budget,
                         guard=not args.no_guard, say=say)
    r = result.to_dict()
    if check:
        held_settings = dataclasses.replace(settings, seed=args.seed + len(args.prompt))
        held = WanRuns(pipe, check, result.plan.policy, held_settings)
        h = check_plan(held, {"plan": result.plan}, target)
        h.pop("frames")
        h["plans"]["plan"]["fp4_share"] = result.chosen.fp4_share
        h["prompts"] = check
        r["held_out"] = h
    result.plan.save(out)
    from fp4vis.evals.plan_report import write_plan_report

    files = write_plan_report(out.parent, report_name(out), r)
    print(result.plan.summary())
    c = result.chosen
    print(f"chosen: {c.candidate.label()}: {target.statistic} {target.metric} {c.score:.6g} on the {len(args.prompt)} "
          f"prompts, FP4 share of attention time {c.fp4_share:.3f} ({result.runs} pipeline runs"
          f"{', budget exhausted' if result.exhausted else ''})")
    if check:
        p = r["held_out"]["plans"]["plan"]
        ci = p["ci95"][target.metric]
        print(f"held out ({len(check)} prompts): {target.metric} mean {ci['mean']:.6g} [95 % "
              f"{ci['ci95_low'] if ci['ci95_low'] is not None else 'n/a'}, "
              f"{ci['ci95_high'] if ci['ci95_high'] is not None else 'n/a'}], worst {p['worst'][target.metric]:.6g}: "
              f"{'meets' if p['met'] else 'misses'} the target")
    print(f"guard plan: {out}")
    print(f"report: {files['markdown']} ({Path(files['json']).name}, {Path(files['plot']).name})")
    return 0
