"""Does a plan's time per denoising step match what the time model predicts? (docs/plan.md; a GPU run.)

On the published Wan2.1 architecture with random weights (``build_random_wan_pipeline``; no checkpoint needed),
at the published 480x832, 81 frames, guidance 5.0:

1. the time model of ``fp4vis.evals.attention_time`` on this GPU: each layer shape timed, exact (SDPA, BF16) and
   under the policy (``measured_times``);
2. BF16's time per step, measured (a pipeline run, every layer exact);
3. the prediction for a plan: BF16's time per step minus the attention time the plan's FP4 cells save
   (``AttentionTimes.run_time``), per step;
4. the plan's time per step, measured the same way (``handle.step_callback`` runs its exact steps); also
   ``fast`` everywhere, predicted and measured, as a second point.

The plan keeps ``--exact-steps`` (indices, negative from the end) and the self-attention of ``--exact-layers``
(block indices) exact; its fingerprint is the model's. Each run's first step compiles (a warm-up run of
``--warmup`` steps first). Time per step: the pipeline's denoising time over its steps (CUDA synchronised).

    python benchmarks/plan_time_check.py --size 1.3B --steps 10 --exact-steps 0,1,-1 --exact-layers 0,1 \\
        --out benchmarks/results/<date>_h200_plan-time-check.json
"""

from __future__ import annotations

import argparse
import dataclasses

import torch

from fp4vis.evals.attention_time import LayerShape, measured_times
from fp4vis.evals.plan_search import base_plan
from fp4vis.patching import GuardPlan
from fp4vis.pipelines.wan_sizes import tokens_per_frame_sequence
from fp4vis.pipelines.wan_video import GenerationConfig, build_random_wan_pipeline, generate, random_prompt_embeds
from fp4vis.policy import get_policy
from fp4vis.services.environment import environment
from fp4vis.services.outputs import write_json


def int_list(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x.strip()]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--size", default="1.3B", choices=["1.3B", "14B"])
    ap.add_argument("--policy", default="fast")
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--height", type=int, default=480)
    ap.add_argument("--width", type=int, default=832)
    ap.add_argument("--frames", type=int, default=81)
    ap.add_argument("--exact-steps", type=int_list, default=[0, 1, -1])
    ap.add_argument("--exact-layers", type=int_list, default=[0, 1])
    ap.add_argument("--out", default="out/plan_time_check.json")
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("plan_time_check: a CUDA GPU is needed (the time model is measured there)")
    dev = torch.device("cuda")
    policy = get_policy(args.policy)
    pipe = build_random_wan_pipeline(args.size, device=dev, vae=False)
    pipe.set_progress_bar_config(disable=True)
    plan, default = base_plan(pipe, policy)
    names = [s.name for s in default]
    plan.exact_steps = list(args.exact_steps)
    plan.exact_layers = [s.name for s in default if s.index in set(args.exact_layers)]
    tokens = tokens_per_frame_sequence(pipe, height=args.height, width=args.width, frames=args.frames)
    shapes = {s.name: LayerShape(1, tokens, tokens, s.num_heads, s.head_dim) for s in default}
    times = measured_times(shapes, [policy.name], calls=2, device=dev)
    pe, npe = random_prompt_embeds(0)
    cfg = GenerationConfig(prompt_embeds=pe, negative_prompt_embeds=npe, height=args.height, width=args.width,
                           frames=args.frames, steps=args.steps, guidance_scale=5.0, seed=0, backend="auto",
                           decode=False, progress=False)

    def per_step(policy_name: str, guard) -> float:
        generate(pipe, dataclasses.replace(cfg, steps=args.warmup), policy=policy_name, guard=guard)
        torch.cuda.synchronize()
        res = generate(pipe, cfg, policy=policy_name, guard=guard)
        torch.cuda.synchronize()
        return 1000.0 * res.timings["denoise_s"] / args.steps

    n = args.steps
    exact_attention = times.run_time(n, range(n), (), policy.name) / n
    bf16 = per_step("bf16", None)
    rows = {}
    everywhere = GuardPlan.from_dict(plan.to_dict())
    everywhere.exact_steps, everywhere.exact_layers = [], []
    fp4_attention = times.run_time(n, (), (), policy.name) / n
    for label, p in ((f"{policy.name} everywhere", everywhere), ("plan", plan)):
        exact_steps = {i % n for i in p.exact_steps}
        attention = times.run_time(n, exact_steps, p.exact_layers, policy.name) / n
        predicted = bf16 - (exact_attention - attention)
        measured = per_step(policy.name, p)
        rows[label] = {"exact_steps": p.exact_steps, "exact_layers": p.exact_layers,
                       "fp4_share": times.fp4_share(n, exact_steps, p.exact_layers),
                       "predicted_ms_per_step": predicted, "measured_ms_per_step": measured,
                       "relative_difference": (measured - predicted) / predicted,
                       "within_5_percent": abs(measured - predicted) <= 0.05 * predicted}
    # a second reading, not the check: the per-call model's proportion of the saving, anchored on the two measured
    # ends (BF16 and the policy everywhere), which takes in what the per-call times leave out (the fused q/k
    # transform, the processor's own work)
    ends = rows[f"{policy.name} everywhere"]["measured_ms_per_step"] - bf16
    for r in rows.values():
        saved = (exact_attention - times.run_time(n, {i % n for i in r["exact_steps"]}, r["exact_layers"],
                                                  policy.name) / n) / ((exact_attention - fp4_attention) or 1e-12)
        r["anchored_prediction_ms_per_step"] = bf16 + saved * ends
    result = {"size": args.size, "policy": policy.name, "steps": n, "height": args.height, "width": args.width,
              "frames": args.frames, "tokens": tokens, "layers": names, "bf16_ms_per_step": bf16,
              "exact_attention_ms_per_step": exact_attention, "time_model": times.to_dict(), "runs": rows,
              "environment": environment()}
    write_json(args.out, result)
    for label, r in rows.items():
        print(f"{label}: predicted {r['predicted_ms_per_step']:.1f} ms/step, measured {r['measured_ms_per_step']:.1f}"
              f" ({100 * r['relative_difference']:+.1f} %, FP4 share {r['fp4_share']:.3f})")
    print(f"BF16: {bf16:.1f} ms/step, of which attention {exact_attention:.1f} (time model) -> {args.out}")
    return 0 if all(r["within_5_percent"] for r in rows.values()) else 1


if __name__ == "__main__":
    raise SystemExit(main())
