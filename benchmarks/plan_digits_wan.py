"""A plan for a fidelity target on the shipped video model ``fp4vis:digits-wan``, on the CPU, checked on held-out
prompts (docs/plan.md):

1. ``fp4vis.evals.plan_search.search_plan`` on 10 prompts (``balanced_prompts(20)[:10]``: every digit once,
   seeds 0..9), the whole pipeline in float32 (docs/demo.md says why), FP4 on the reference backend;
2. the held-out check (``check_plan``) on 10 other prompts (``balanced_prompts(20)[10:]``: every digit once, in
   another direction, seeds 100..109): the plan, ``fast`` everywhere, the simplest plans that met the target on
   the search prompts, and the simplest with one exact step fewer (it missed there), each against BF16 with its
   95 % interval;
3. the demo's readout (``fp4vis.zoo.moving_digits.read_clips``) of every held-out clip: how many read as the
   prompted digit, BF16's own count beside each plan's.

    python benchmarks/plan_digits_wan.py --target psnr=30 --statistic lower --budget 26 \\
        --out-dir benchmarks/results --name 20261206g_cpu_plan-digits-wan
"""

from __future__ import annotations

import argparse
import dataclasses
import shlex
import sys
from pathlib import Path

import torch

from fp4vis.evals.plan_report import write_plan_report
from fp4vis.evals.plan_search import DEFAULT_BUDGET, FidelityTarget, WanRuns, check_plan, search_plan
from fp4vis.evals.report import wilson_ci95
from fp4vis.patching import GuardPlan
from fp4vis.pipelines.wan_video import GenerationConfig, generation_defaults, load_wan_pipeline
from fp4vis.zoo import moving_digits as md

MODEL = "fp4vis:digits-wan"


def readout(frames, prompts: list[int], reader, gen: dict) -> dict:
    travel = 0.5 * min(md.MIN_SPEED, md.max_speed(gen["height"], gen["frames"])) * (gen["frames"] - 1)
    seen = md.read_clips(md.from_frames(frames), reader, min_travel=travel)
    right = sum(int(seen.digit[i]) == p // len(md.DIRECTIONS) for i, p in enumerate(prompts))
    return wilson_ci95(right, len(prompts))


def check_only(pipe, args, target, settings, gen, held_idx) -> int:
    """The held-out check alone, of the plan keeping the first ``--check-first`` steps exact, and of ``fast``
    everywhere: JSON and Markdown (``<name>_held-out``)."""
    from fp4vis.evals.plan_search import base_plan
    from fp4vis.evals.report import markdown_table, write_report
    from fp4vis.policy import get_policy

    plan, _ = base_plan(pipe, get_policy("fast"))
    fast = GuardPlan.from_dict(plan.to_dict())
    plan.exact_steps = list(range(args.check_first))
    held = WanRuns(pipe, [md.PROMPTS[i] for i in held_idx], plan.policy, dataclasses.replace(settings, seed=100))
    label = f"plan: first {args.check_first} steps exact"
    h = check_plan(held, {label: plan, "fast everywhere": fast}, target)
    frames = h.pop("frames")
    reader = md.load_reader()
    h["bf16_digit_read"] = readout(frames["bf16"], held_idx, reader, gen)
    n = settings.steps
    for name, p in h["plans"].items():
        p["digit_read"] = readout(frames[name], held_idx, reader, gen)
        p["fp4_share"] = (n - len(p["exact_steps"])) / n
    h["prompts"] = [md.PROMPTS[i] for i in held_idx]
    h["seeds"] = [100 + i for i in range(len(held_idx))]
    h["command"] = "python " + " ".join(shlex.quote(a) for a in sys.argv)
    from fp4vis.evals.plan_report import HELD_OUT_HEADERS, held_out_rows

    md_text = "\n".join([f"# Held out: {target.describe()} on {len(held_idx)} prompts the plan was not chosen on",
                          "", markdown_table(HELD_OUT_HEADERS, held_out_rows(h)), "",
                          "Mean over the prompts with its 95 % Student-t interval; worst: the lowest prompt; digit "
                          "read: clips the reader of fp4vis.zoo.moving_digits reads as the prompted digit.", "",
                          f"Command: `{h['command']}`"])
    files = write_report(args.out_dir, f"{args.name}_held-out", h, md_text)
    print(*(str(f) for f in files.values()), sep="\n")
    return 0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--target", default="psnr=30")
    ap.add_argument("--statistic", default="lower", choices=["mean", "worst", "lower"],
                    help="lower: the search judges the mean by the lower end of its 95 %% interval (a margin)")
    ap.add_argument("--budget", type=int, default=DEFAULT_BUDGET)
    ap.add_argument("--out-dir", default="out/plan")
    ap.add_argument("--name", default="plan-digits-wan")
    ap.add_argument("--prompts", type=int, default=10, help="search prompts, and as many held out (at most 20)")
    ap.add_argument("--check-first", type=int, default=None, metavar="A",
                    help="no search: check the plan that keeps the first A steps exact on the held-out prompts")
    args = ap.parse_args(argv)
    target = FidelityTarget.parse(args.target, args.statistic)
    gen = generation_defaults(MODEL)
    both = md.balanced_prompts(20)
    search_idx, held_idx = both[:args.prompts], both[10:10 + args.prompts]
    pipe = load_wan_pipeline(MODEL, device="cpu", dtype="float32")
    pipe.set_progress_bar_config(disable=True)
    settings = GenerationConfig(height=gen["height"], width=gen["width"], frames=gen["frames"], steps=gen["steps"],
                                guidance_scale=gen["guidance_scale"], seed=0, backend="reference", progress=False)
    if args.check_first is not None:
        return check_only(pipe, args, target, settings, gen, held_idx)
    result = search_plan(pipe, [md.PROMPTS[i] for i in search_idx], "fast", target, settings=settings,
                         budget=args.budget, say=lambda s: print(s, flush=True))
    r = result.to_dict()
    chosen = f"plan: {result.chosen.candidate.label()}"
    checked = {chosen: result.plan}
    fast = GuardPlan.from_dict(result.plan.to_dict())
    fast.exact_steps, fast.exact_layers, fast.exact_layer_steps, fast.guarded = [], [], {}, []
    checked["fast everywhere"] = fast
    simplest = dict(result.simplest)
    first = simplest.get("exact but the last k")
    if first is not None and 0 < first.candidate.first < result.steps:
        # the simplest plan with one exact step fewer (it missed on the search prompts): does it miss held out too?
        fewer = dataclasses.replace(first.candidate, first=first.candidate.first - 1)
        simplest["one step fewer"] = next((m for m in result.measured if m.candidate == fewer), None)
    for family, m in simplest.items():
        if m is not None and m.fp4_share > 0 and m.candidate != result.chosen.candidate:
            p = GuardPlan.from_dict(result.plan.to_dict())
            p.exact_steps, p.exact_layers, p.exact_layer_steps = m.candidate.exact_steps(), [], {}
            p.guarded = result.plan.guarded if m.candidate.guard else []
            checked[f"simplest: {family} ({m.candidate.label()})"] = p
    held = WanRuns(pipe, [md.PROMPTS[i] for i in held_idx], result.plan.policy,
                   dataclasses.replace(settings, seed=100))
    h = check_plan(held, checked, target)
    reader = md.load_reader()
    frames = h.pop("frames")
    h["bf16_digit_read"] = readout(frames["bf16"], held_idx, reader, gen)
    shares = {chosen: result.chosen.fp4_share, "fast everywhere": 1.0}
    shares |= {f"simplest: {k} ({m.candidate.label()})": m.fp4_share for k, m in simplest.items() if m}
    for label, p in h["plans"].items():
        p["digit_read"] = readout(frames[label], held_idx, reader, gen)
        p["fp4_share"] = shares.get(label, 0.0)
    h["prompts"] = [md.PROMPTS[i] for i in held_idx]
    h["seeds"] = [100 + i for i in range(len(held_idx))]
    r["held_out"] = h
    r["search_prompts"] = [md.PROMPTS[i] for i in search_idx]
    r["generation"] = {**gen, "dtype": "float32", "backend": "reference", "device": "cpu",
                       "threads": torch.get_num_threads()}
    r["command"] = "python " + " ".join(shlex.quote(a) for a in [sys.argv[0], *(argv or sys.argv[1:])])
    files = write_plan_report(args.out_dir, args.name, r)
    result.plan.save(Path(args.out_dir) / f"{args.name}_plan.json")
    print(*(str(f) for f in files.values()), sep="\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
