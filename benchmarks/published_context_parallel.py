"""The published denoisers over several GPUs: seconds per denoising step on one GPU against diffusers' context
parallelism, with FP4 attention and with diffusers' own BF16 attention, and what the split does to the latents.

    torchrun --nproc-per-node 2 benchmarks/published_context_parallel.py --out $OUT/published_cp.json
    torchrun --nproc-per-node 2 benchmarks/published_context_parallel.py --archs flux.1-dev,qwen-image --ring \
        --out $OUT/published_cp_images.json
    python -m torch.distributed.run --nproc-per-node 2 benchmarks/published_context_parallel.py --dry-run \
        --out /tmp/published_cp.json        # CPU, gloo: tiny stand-ins (TINY), a check of the script
    python benchmarks/published_context_parallel.py --dry-run --out /tmp/published_cp1.json   # one-GPU runs only

Each architecture of ``fp4vis.evals.published_configs`` (``--archs``, default all) at its published size
(``--size HxW[xF]`` overrides), with seeded RANDOM weights (the same on every rank: the checksum is recorded) and
random text of the published shapes, denoised by ``fp4vis eval pipeline --speed-only``'s Euler loop
(``SpeedOnlySubject``: ``calls_per_step`` transformer calls a step, two with classifier-free guidance;
CogVideoX's guidance one call of batch 2, ``guidance_batched``); nothing is
downloaded, nothing decoded. Per architecture, one build per mode:

* ``single``: every rank runs alone on its own GPU (rank 0's latents are the reference), for each of
  ``--policies`` (default ``bf16`` = diffusers' default attention, ``fast``, ``fast_fp8qk``);
* ``ulysses=N`` over all N ranks, the same policies: ``bf16`` is then diffusers' own context-parallel attention in
  BF16, the FP4 policies ``fp4vis.patching.context_parallel``;
* ``ring=N`` with ``--ring`` (``--ring-policies``, default ``fast``; exact attention under ring runs diffusers'
  cuDNN backend, which returns the log-sum-exp).

Each run: a 1-step warm-up (not timed: kernel compilation), then ``--steps`` timed steps (default 2). Per run:
``seconds_per_step`` (the slowest rank per step), its mean and median, ``peak_memory_gib`` per rank (null on the
CPU), and against the one-GPU run of the same policy ``latents_rel_l2_vs_single`` and ``bit_identical_vs_single``
(FP4 under Ulysses computes one GPU's attention; the rest of the transformer runs its products on 1/N of the
tokens, which cuBLAS may order differently: bit identity is expected on the CPU, measured on GPUs);
``speedup_vs_single`` (same policy), ``speedup_vs_single_bf16`` and ``speedup_vs_diffusers_cp_bf16`` (this
mode's bf16 run: diffusers' own context parallelism). An architecture diffusers ships no context-parallel plan
for (HunyuanVideo and CogVideoX in diffusers 0.42), or whose heads the degree does not divide, gets its one-GPU
runs and a ``skipped`` reason for the others. Rank 0 rewrites the JSON after every run; the other ranks write nothing.

Time, estimated, not measured: one step of a 720p video model is tens of seconds on one GPU (HunyuanVideo 720p
about 19-30 s on an H200, issue 47; Wan2.1-14B 720p about 25 s a CFG step, benchmarks/wan_context_parallel.py),
FLUX.1-dev and Qwen-Image a few seconds. With the defaults (3 policies, one GPU and Ulysses, a warm-up and 2 timed
steps each) a video model takes about 10 minutes: under a 10-minute limit per command, run one architecture per
command (``--archs wan2.2-t2v-a14b``), and the image models together (``--archs flux.1-dev,qwen-image``).
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import statistics
import sys
from typing import Any

import torch

# tiny stand-ins for --dry-run: the published entry with a few small values (4 heads: Ulysses and ring of 2 divide)
TINY = {
    "wan2.2-t2v-a14b": dict(config=dict(num_attention_heads=4, attention_head_dim=16, text_dim=32, ffn_dim=32,
                                        num_layers=1, rope_max_seq_len=32), text_dim=32, text_tokens=8,
                            height=32, width=64, frames=5),
    "hunyuanvideo": dict(config=dict(num_attention_heads=4, attention_head_dim=16, num_layers=1, num_single_layers=1,
                                     num_refiner_layers=1, text_embed_dim=32, pooled_projection_dim=8,
                                     rope_axes_dim=(4, 6, 6)), text_dim=32, text_tokens=8, prompt_tokens=4,
                         pooled_dim=8, height=32, width=32, frames=5),
    "flux.1-dev": dict(config=dict(num_layers=1, num_single_layers=1, attention_head_dim=16, num_attention_heads=4,
                                   joint_attention_dim=32, pooled_projection_dim=8, axes_dims_rope=(4, 6, 6)),
                       text_dim=32, text_tokens=8, pooled_dim=8, height=64, width=32),
    "qwen-image": dict(config=dict(num_layers=1, attention_head_dim=16, num_attention_heads=4, joint_attention_dim=32,
                                   axes_dims_rope=(4, 6, 6)), text_dim=32, text_tokens=8, height=32, width=64),
    "cogvideox-5b": dict(config=dict(num_attention_heads=4, attention_head_dim=16, num_layers=1, text_embed_dim=32,
                                     time_embed_dim=16, max_text_seq_length=8), text_dim=32, text_tokens=8,
                         height=32, width=48, frames=5),
}


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    from fp4vis.evals.published_configs import PUBLISHED_DENOISERS

    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", required=True, help="JSON path (written by rank 0)")
    p.add_argument("--archs", default=",".join(PUBLISHED_DENOISERS), help="comma-separated published denoisers")
    p.add_argument("--size", default=None, help="HxW or HxWxF for every architecture (default: each one's own)")
    p.add_argument("--steps", type=int, default=2, help="timed denoising steps")
    p.add_argument("--policies", default="bf16,fast,fast_fp8qk", help="one GPU and Ulysses")
    p.add_argument("--ring", action="store_true", help="also ring=N (--ring-policies)")
    p.add_argument("--ring-policies", default="fast")
    p.add_argument("--backend", default="auto", help="fp4vis backend of the FP4 policies")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--device", default="auto", help="auto: each rank's GPU, else the CPU")
    p.add_argument("--dry-run", action="store_true", help="tiny stand-ins on the CPU (module docstring)")
    p.add_argument("--no-warmup", action="store_true")
    return p.parse_args(argv)


def architectures(args: argparse.Namespace) -> dict[str, Any]:
    """name -> PublishedDenoiser: the published entries, or their tiny stand-ins (--dry-run), at --size."""
    from fp4vis.evals.published_configs import PUBLISHED_DENOISERS

    out = {}
    for name in (a.strip() for a in args.archs.split(",") if a.strip()):
        if name not in PUBLISHED_DENOISERS:
            raise SystemExit(f"--archs: unknown {name!r}; known: {', '.join(PUBLISHED_DENOISERS)}")
        arch = PUBLISHED_DENOISERS[name]
        if args.dry_run:
            over = dict(TINY[name])
            arch = dataclasses.replace(arch, config={**arch.config, **over.pop("config")}, **over)
        if args.size:
            dims = [int(x) for x in args.size.lower().split("x")]
            arch = dataclasses.replace(arch, height=dims[0], width=dims[1],
                                       frames=dims[2] if len(dims) > 2 and arch.frames is not None else arch.frames)
        out[name] = arch
    return out


def cp_refusal(arch: Any, cp: Any) -> str | None:
    """Why diffusers' context parallelism ``cp`` cannot run this architecture (None: it can)."""
    import diffusers

    if getattr(getattr(diffusers, arch.class_name), "_cp_plan", None) is None:
        return f"diffusers {diffusers.__version__} has no context-parallel plan (_cp_plan) for {arch.class_name}"
    heads = int(arch.config["num_attention_heads"])
    if heads % cp.ulysses:
        return f"ulysses={cp.ulysses} does not divide the {heads} heads"
    return None


def run_mode(args: argparse.Namespace, device: torch.device, arch: Any, mode: tuple[str, Any, list[str]],
             record, references: dict[Any, Any]) -> None:
    """Every policy of one (name, ContextParallel or None, policies) mode on one build of ``arch``."""
    from fp4vis.evals import published_configs as pc
    from fp4vis.evals.pipeline_eval import PipelineEvalConfig, SpeedOnlySubject
    from fp4vis.pipelines.context_parallel import enable_context_parallel, gathered
    from fp4vis.services.policies import policy_applied

    label, cp, policies = mode
    config = PipelineEvalConfig(speed_only=arch.title, steps=args.steps, seed=args.seed, device=str(device),
                                progress=False)
    subject = SpeedOnlySubject(arch, config, device)
    subject.load()
    checksum = gathered(float(sum(p.detach().double().sum() for p in subject.module.parameters())))
    if cp is not None:
        enable_context_parallel(subject.module, cp)
    try:
        for policy in policies:
            tokens = pc.tokens(arch, height=arch.height, width=arch.width, frames=arch.frames)
            row: dict[str, Any] = {"arch": arch.title, "mode": label, "policy": policy, "tokens": tokens,
                                   "backend": "diffusers" if policy == "bf16" else args.backend,
                                   "weights_checksum_per_rank": checksum}
            with policy_applied(subject.module, policy, backend=args.backend), torch.no_grad():
                if not args.no_warmup:
                    subject.run(1, f"{policy}; warm-up", decode=False)
                if device.type == "cuda":
                    torch.cuda.reset_peak_memory_stats(device)
                res = subject.run(args.steps, policy, decode=False)
            per_rank = gathered(res.step_s)
            step_s = [max(r[i] for r in per_rank) for i in range(args.steps)] if cp is not None else per_rank[0]
            row.update(seconds_per_step=step_s, mean_s_per_step=statistics.fmean(step_s),
                       median_s_per_step=statistics.median(step_s), seconds_per_step_per_rank=per_rank,
                       peak_memory_gib=gathered(torch.cuda.max_memory_allocated(device) / 2**30
                                                if device.type == "cuda" else None),
                       latents_finite=bool(torch.isfinite(res.latents).all()))
            references[label, policy] = (res.latents, row["mean_s_per_step"])
            compare(row, res.latents, references)
            record(row)
    finally:
        del subject
        gc.collect()
        if device.type == "cuda":
            torch.cuda.empty_cache()


def compare(row: dict[str, Any], latents: torch.Tensor, references: dict[Any, Any]) -> None:
    """A run's fidelity and speed against the one-GPU runs and this mode's bf16 (diffusers' own attention)."""
    single = references.get(("single", row["policy"]))
    if row["mode"] != "single" and single is not None:
        ref = single[0]
        row["latents_rel_l2_vs_single"] = float((latents - ref).norm() / ref.norm().clamp_min(1e-30))
        row["bit_identical_vs_single"] = bool(torch.equal(latents, ref))
        row["speedup_vs_single"] = single[1] / row["mean_s_per_step"]
    for key, ref in (("speedup_vs_single_bf16", ("single", "bf16")), ("speedup_vs_diffusers_cp_bf16",
                                                                       (row["mode"], "bf16"))):
        if ref in references and not (key.endswith("cp_bf16") and row["mode"] == "single"):
            row[key] = references[ref][1] / row["mean_s_per_step"]


def main(argv: list[str] | None = None) -> dict[str, Any]:
    from fp4vis.pipelines.context_parallel import ContextParallel, distributed, torchrun_env
    from fp4vis.services.environment import environment
    from fp4vis.services.outputs import write_json
    from fp4vis.services.runtime import resolve_device

    args = parse_args(argv)
    archs = architectures(args)
    policies = [p.strip() for p in args.policies.split(",") if p.strip()]
    env = torchrun_env()
    world = env[1] if env is not None else 1
    result: dict[str, Any] = {
        "benchmark": "published_context_parallel", "random_weights": True, "dry_run": args.dry_run,
        "world_size": world, "architectures": {n: {"class": a.class_name, "height": a.height, "width": a.width,
                                                    "frames": a.frames, "calls_per_step": a.calls_per_step,
                                                    "guidance_batched": a.guidance_batched}
                                                for n, a in archs.items()},
        "steps": args.steps, "seed": args.seed, "backend": args.backend, "warmup": not args.no_warmup,
        "runs": [], "skipped": {},
        "notes": "seconds_per_step: the slowest rank per step; latents compared with the one-GPU run of the same "
                 "policy (rank 0's); bf16 under context parallelism is diffusers' own attention",
    }
    main_rank = env is None or env[0] == 0

    def record(row: dict[str, Any]) -> None:
        result["runs"].append(row)
        if main_rank:
            result["environment"] = environment()
            write_json(args.out, result)
            extra = (f", relL2 vs one GPU {row['latents_rel_l2_vs_single']:.2e}, bit-identical "
                     f"{row['bit_identical_vs_single']}" if "bit_identical_vs_single" in row else "")
            print(f"[{row['arch']} {row['mode']} {row['policy']}] {row['mean_s_per_step']:.3f} s/step{extra}",
                  flush=True)

    modes = [("ulysses", ContextParallel(ulysses=world), policies)]
    if args.ring:
        modes.append(("ring", ContextParallel(ring=world), [p.strip() for p in args.ring_policies.split(",")]))

    def run_all(device: torch.device, parallel: bool) -> None:
        for name, arch in archs.items():
            references: dict[Any, Any] = {}
            run_mode(args, device, arch, ("single", None, policies), record, references)
            for _, cp, pols in modes if parallel else ():
                why = cp_refusal(arch, cp)
                if why is not None:
                    result["skipped"][f"{name} {cp}"] = why
                    continue
                run_mode(args, device, arch, (str(cp), cp, pols), record, references)

    if world == 1:
        run_all(resolve_device("cpu" if args.dry_run else args.device), False)
        result["skipped"]["context parallelism"] = "needs torchrun with 2 or more processes"
    else:
        with distributed(modes[0][1], "cpu" if args.dry_run else args.device) as session:
            run_all(session.device, True)
    if main_rank:
        result["environment"] = environment()
        write_json(args.out, result)
    return result


if __name__ == "__main__":
    main(sys.argv[1:])
