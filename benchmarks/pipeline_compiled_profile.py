"""Where a compiled step of a published architecture spends its GPU time, run by run: the denoiser of
``fp4vis eval pipeline --speed-only ARCH --compile`` (random weights, the architecture's published size, its own
Euler loop), one step per run.

    python3 benchmarks/pipeline_compiled_profile.py --out $OUT/profile.json [--arch cogvideox-5b]
        [--runs attn=fa4,fp8]

Runs: ``attn=<baseline>`` (a BF16 attention library in the layers the policies patch, as the eval's baselines),
``bf16`` (diffusers' default attention) or a policy (``fp4vis.patch`` on the hopper backend). Each run compiles
afresh (``compile_repeated_blocks(fullgraph=True)``) in a one-step warm-up, then one step is timed without the
profiler (wall, synchronised) and one is recorded by torch.profiler (CUDA kernels only). The kernels are put in
categories as ``wan_compiled_profile`` puts them (``CATEGORIES``: the pre-pass, inductor's kernels, attention,
GEMMs, eager PyTorch, the rest); the JSON keeps per run the step's wall, the kernels' total, each category's time
and count and the 40 longest kernels, and every later run minus the first, category by category (``compare``).
"""

from __future__ import annotations

import argparse
import shlex
import sys
import time

import torch
from wan_compiled_profile import CATEGORIES, compare, kernel_table, summary  # this folder is on sys.path

from fp4vis.evals.pipeline_eval import PipelineEvalConfig
from fp4vis.evals.timed_runs import baseline_applied
from fp4vis.services.environment import environment
from fp4vis.services.outputs import write_json
from fp4vis.services.policies import policy_applied


def profile_runs(arch: str, runs: list[str], range_check: str = "raise") -> dict:
    config = PipelineEvalConfig(speed_only=arch, steps=1, compile="regional", backend="hopper", progress=False)
    subject = config.subject(torch.device("cuda"), [], None)
    subject.load()
    subject.compile("regional")
    out = {"tokens": subject.tokens, "size": subject.size, "runs": {}}
    for run in runs:
        baseline = run.split("=", 1)[1] if "=" in run else None
        with policy_applied(subject.module, "bf16" if baseline else run, backend="hopper", range_check=range_check), \
                baseline_applied(subject.module, baseline):
            torch._dynamo.reset()
            t0 = time.perf_counter()
            subject.run(1, run, decode=False)    # warm-up: compiles
            warm = time.perf_counter() - t0
            wall = subject.run(1, run, decode=False).step_s[0]
            with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
                pwall = subject.run(1, run, decode=False).step_s[0]
        r = out["runs"][run] = dict(summary(kernel_table(prof), wall, pwall), warmup_s=warm)
        print(f"{arch} {run}: step {r['step_wall_ms']:.1f} ms, kernels {r['kernels_ms']:.1f} ms; "
              + ", ".join(f"{k} {v['ms']:.1f} ({v['kernels']})" for k, v in r["categories"].items()), flush=True)
    first = runs[0]
    out["compare"] = {run: compare(out["runs"], run, first) for run in runs[1:]}
    for run, c in out["compare"].items():
        print(f"{run} - {first} per step: wall {c['step_wall_ms']:+.1f} ms, kernels {c['kernels_ms']:+.1f} ms; "
              + ", ".join(f"{k} {v:+.1f}" for k, v in c["categories_ms"].items()), flush=True)
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--arch", default="cogvideox-5b")
    ap.add_argument("--runs", default="attn=fa4,fp8")
    ap.add_argument("--range-check", default="raise", choices=("raise", "warn", "off"), help="the policies' runs'")
    args = ap.parse_args(argv)
    result = {"command": "python3 benchmarks/pipeline_compiled_profile.py " + shlex.join(sys.argv[1:] if argv is None
                                                                                          else argv),
              "date": time.strftime("%Y-%m-%d"), "environment": environment(), "categories": dict(CATEGORIES),
              "arch": args.arch}
    result.update(profile_runs(args.arch, args.runs.split(","), args.range_check))
    write_json(args.out, result)
    return 0


if __name__ == "__main__":
    sys.exit(main())
