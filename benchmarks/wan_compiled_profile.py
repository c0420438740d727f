"""Where a compiled Wan2.1 step spends its GPU time, run by run (one H200 run, about 6 min).

    python3 benchmarks/wan_compiled_profile.py --out $OUT/wan_profile.json [--models 1.3B,14B]

The runs of ``fp4vis eval wan --speed-only MODEL --compile`` (random weights, 480x832, 81 frames, CFG 5;
the transformer compiled with ``compile_repeated_blocks(fullgraph=True)``): at 1.3B diffusers' default
attention, flash-attn-4 in ``attn1``, ``fast_fp8qk`` and ``fast`` (hopper backend), and the eager
flash-attn-4 and ``fast_fp8qk`` runs beside them; at 14B flash-attn-4 in ``attn1`` and ``fast_fp8qk``.
Each run compiles afresh in a one-step warm-up, then one step is timed without the profiler (wall,
synchronised) and one step is recorded by torch.profiler (CUDA kernels only). Each kernel is put in one
category by its name (``CATEGORIES``, first match): the FP4 pre-pass, kernels inductor generated,
attention, GEMMs, the eager PyTorch kernels, the rest.
The JSON keeps per run the step's wall, the kernels' total, each category's time and count, and the
40 longest kernels by name, so that a category can be checked by hand; ``compare`` subtracts one run
from another category by category (``fast_fp8qk`` minus flash-attn-4: what the FP4 step pays and saves).
"""

from __future__ import annotations

import argparse
import re
import shlex
import sys
import time
from collections import defaultdict

import torch

from fp4vis.services.environment import environment
from fp4vis.services.outputs import write_json
from fp4vis.services.timing import run_sections

CATEGORIES = (   # first match; inductor's kernels first: some are named after the attention they feed
    ("prepass", r"prepass_kernel|fp8_prepass_kernel|rms_rstd_kernel"),
    ("inductor", r"^triton_"),
    ("attention", r"DirectP|[Ff]lash|fmha|[Aa]ttention|sdpa"),
    ("gemm", r"gemm|Gemm|nvjet|xmma|cublas|cutlass"),
    ("eager_pytorch", r"^void at::|at::native|elementwise|vectorized|reduce_kernel|Reduce|CatArray|copy"),
)
HEIGHT, WIDTH, FRAMES, GUIDANCE = 480, 832, 81, 5.0


def category(name: str) -> str:
    for cat, pattern in CATEGORIES:
        if re.search(pattern, name):
            return cat
    return "other"


def kernel_table(prof) -> list[tuple[str, float, int]]:
    """(name, total ms, count) of every CUDA kernel the profiler saw, longest first."""
    totals: dict[str, list] = defaultdict(lambda: [0.0, 0])
    for ev in prof.events():
        if ev.device_type == torch.autograd.DeviceType.CUDA:
            t = totals[ev.name]
            t[0] += ev.time_range.elapsed_us() / 1e3
            t[1] += 1
    return sorted(((n, ms, c) for n, (ms, c) in totals.items()), key=lambda r: -r[1])


def summary(table: list, wall_s: float, profiled_wall_s: float) -> dict:
    cats: dict[str, dict] = {}
    for name, ms, count in table:
        c = cats.setdefault(category(name), {"ms": 0.0, "kernels": 0})
        c["ms"] += ms
        c["kernels"] += count
    return {"step_wall_ms": wall_s * 1e3, "profiled_step_wall_ms": profiled_wall_s * 1e3,
            "kernels_ms": sum(ms for _, ms, _ in table), "kernels": sum(c for _, _, c in table),
            "categories": cats,
            "top_kernels": [{"name": n[:300], "ms": ms, "count": c, "category": category(n)}
                            for n, ms, c in table[:40]]}


def _runs(model: str, compiled: bool, which: tuple[str, ...]) -> dict:
    from fp4vis.evals.timed_runs import baseline_applied
    from fp4vis.pipelines.compile import compile_transformers
    from fp4vis.pipelines.wan_video import (
        GenerationConfig,
        build_random_wan_pipeline,
        generate,
        initial_latents,
        random_prompt_embeds,
    )

    pipe = build_random_wan_pipeline(model, device=torch.device("cuda"), dtype="bfloat16", seed=0, vae=False)
    if compiled:
        compile_transformers(pipe, "regional")
    pe, npe = random_prompt_embeds(0)
    latents = initial_latents(pipe, height=HEIGHT, width=WIDTH, frames=FRAMES, seed=0)
    common = GenerationConfig(prompt_embeds=pe, negative_prompt_embeds=npe, height=HEIGHT, width=WIDTH, frames=FRAMES,
                              guidance_scale=GUIDANCE, seed=0, backend="hopper", progress=False, latents=latents,
                              steps=1, decode=False)
    out = {}
    for run in which:
        baseline = run.split("=", 1)[1] if run.startswith("attn1=") else None
        policy = "bf16" if baseline is not None or run == "bf16" else run
        with baseline_applied(pipe, baseline, "*attn1"):
            if compiled:
                torch._dynamo.reset()
            t0 = time.perf_counter()
            generate(pipe, common, policy=policy)          # warm-up: compiles
            warm = time.perf_counter() - t0
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            generate(pipe, common, policy=policy)
            torch.cuda.synchronize()
            wall = time.perf_counter() - t0
            with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
                t0 = time.perf_counter()
                generate(pipe, common, policy=policy)
                torch.cuda.synchronize()
                pwall = time.perf_counter() - t0
        out[run] = dict(summary(kernel_table(prof), wall, pwall), warmup_s=warm)
        r = out[run]
        print(f"{model} {'compiled' if compiled else 'eager'} {run}: step {r['step_wall_ms']:.1f} ms, kernels "
              f"{r['kernels_ms']:.1f} ms; " + ", ".join(f"{k} {v['ms']:.1f}" for k, v in r["categories"].items()),
              flush=True)
    del pipe
    torch.cuda.empty_cache()
    return out


def compare(runs: dict, a: str, b: str) -> dict:
    """Run a minus run b, per category (ms per step) and in wall and kernel totals."""
    ra, rb = runs[a], runs[b]
    cats = sorted(set(ra["categories"]) | set(rb["categories"]))
    return {"a": a, "b": b, "step_wall_ms": ra["step_wall_ms"] - rb["step_wall_ms"],
            "kernels_ms": ra["kernels_ms"] - rb["kernels_ms"],
            "categories_ms": {c: ra["categories"].get(c, {}).get("ms", 0.0) - rb["categories"].get(c, {}).get("ms", 0.0)
                              for c in cats},
            "wall_ratio_b_over_a": rb["step_wall_ms"] / ra["step_wall_ms"]}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--models", default="1.3B,14B")
    args = ap.parse_args(argv)
    result = {"command": "python3 benchmarks/wan_compiled_profile.py " + shlex.join(sys.argv[1:] if argv is None
                                                                                        else argv),
              "environment": environment(), "categories": dict(CATEGORIES), "height": HEIGHT, "width": WIDTH,
              "frames": FRAMES, "guidance_scale": GUIDANCE}
    sections = []
    for model in args.models.split(","):
        key = model.lower().replace(".", "")
        if model == "1.3B":
            sections.append((f"{key}_compiled", lambda m=model: _runs(m, True, ("bf16", "attn1=fa4", "fast_fp8qk",
                                                                                "fast"))))
            sections.append((f"{key}_eager", lambda m=model: _runs(m, False, ("attn1=fa4", "fast_fp8qk"))))
        else:
            sections.append((f"{key}_compiled", lambda m=model: _runs(m, True, ("attn1=fa4", "fast_fp8qk"))))
    run_sections(result, sections, args.out)
    comparisons = {}
    for name, runs in list(result.items()):
        if isinstance(runs, dict) and "attn1=fa4" in runs and "fast_fp8qk" in runs:
            comparisons[name] = compare(runs, "fast_fp8qk", "attn1=fa4")
    result["compare_fast_fp8qk_minus_fa4"] = comparisons
    write_json(args.out, result)
    for name, c in comparisons.items():
        print(f"{name}: fast_fp8qk - fa4 per step: wall {c['step_wall_ms']:+.1f} ms, "
              f"kernels {c['kernels_ms']:+.1f} ms; "
              + ", ".join(f"{k} {v:+.1f}" for k, v in c["categories_ms"].items()), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
