"""Wan2.1-14B over several GPUs: seconds per denoising step on one GPU against context parallelism
(Ulysses, ring) with FP4 attention, and what the split does to the latents.

    torchrun --nproc-per-node 2 benchmarks/wan_context_parallel.py --out $OUT/wan_cp.json
    torchrun --nproc-per-node 2 benchmarks/wan_context_parallel.py --sizes 720x1280x81 --out $OUT/wan_cp_720p.json
    torchrun --nproc-per-node 2 benchmarks/wan_context_parallel.py --dry-run --out /tmp/wan_cp_dry.json  # CPU, gloo
    python benchmarks/wan_context_parallel.py --dry-run --out /tmp/wan_cp_dry1.json   # one process: one-GPU runs only

The real Wan2.1-T2V-14B transformer configuration with seeded RANDOM weights (the same on every rank
and in every build: its checksum is recorded), random prompt embeddings, CFG (``--guidance``, default
5: two transformer passes per step), the initial latents of one CPU seed; nothing is downloaded and
no VAE decode is timed. For each video size (``HxWxF``, default 480x832x81 and 720x1280x81):

* ``single``: every rank runs the pipeline alone on its own GPU (no collectives; rank 0's latents are
  the reference) for each of ``--policies`` (default ``bf16`` = diffusers' own attention, ``fast``,
  ``fast_fp8qk``);
* ``ulysses=N`` over all N ranks, for each of ``--policies``;
* ``ring=N`` over all N ranks, for each of ``--ring-policies`` (default ``fast``).

Each run: a 1-step warm-up generation (not timed: kernel compilation), then ``--steps`` timed steps
(default 3). Per run: ``seconds_per_step`` (each step's end marked by ``callback_on_step_end`` after a
device synchronisation; the slowest rank's time per step), its mean and median; ``peak_memory_gib``
per rank (``torch.cuda.max_memory_allocated`` over the timed run; null on the CPU); fidelity of a
context-parallel run against the one-GPU run of the same policy: ``latents_rel_l2_vs_single`` and
``bit_identical_vs_single`` (``torch.equal`` of the final latents); and ``speedup_vs_single`` (one-GPU
seconds per step of the same policy over this run's) and ``speedup_vs_single_bf16``.

What to expect (docs/context_parallel.md): attention under Ulysses computes per head what one GPU
does, and the FP4 ring gives one GPU's attention too (key streaming on the reference backend, the
gathered sequence on the kernels), so attention is not where latents may differ; but the rest of the
transformer runs its matrix products on 1/N of the tokens, for which cuBLAS may pick other kernels,
so bit-identical latents are expected on the CPU (the dry run) and measured, not promised, on GPUs.
The JSON (date, GPUs, versions in ``environment``) is rewritten by rank 0 after every run; the other
ranks write nothing. ``--dry-run``: a 2-block transformer of 4 heads, a 32x64x5 video, 2 steps, on
the CPU with gloo (world size 1 or 2) or on GPUs: a check of the script, not a measurement.

Time on 2 H200s (estimated from one-GPU figures: ~8 s per CFG step at 480p, ~25 s at 720p, plus a
pipeline build per mode): about 5 minutes for 480x832x81 and 10 for 720x1280x81 with the defaults.
Under a 10-minute limit per command, run one size per command, or split the modes and keep the
one-GPU latents between commands:

    torchrun --nproc-per-node 2 benchmarks/wan_context_parallel.py --sizes 720x1280x81 --modes single \
        --latents-dir $OUT/lat --out $OUT/wan_cp_720p_single.json
    torchrun --nproc-per-node 2 benchmarks/wan_context_parallel.py --sizes 720x1280x81 --modes ulysses,ring \
        --latents-dir $OUT/lat --out $OUT/wan_cp_720p_cp.json
"""

from __future__ import annotations

import argparse
import gc
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch

TINY_CONFIG = dict(patch_size=(1, 2, 2), num_attention_heads=4, attention_head_dim=16, in_channels=16,
                   out_channels=16, text_dim=4096, freq_dim=32, ffn_dim=64, num_layers=2, cross_attn_norm=True,
                   qk_norm="rms_norm_across_heads", eps=1e-6, image_dim=None, added_kv_proj_dim=None,
                   rope_max_seq_len=32)
DEFAULT_SIZES = "480x832x81,720x1280x81"


def parse_sizes(text: str) -> list[tuple[int, int, int]]:
    """"480x832x81,720x1280x81" -> [(480, 832, 81), (720, 1280, 81)] (height, width, frames)."""
    out = []
    for part in text.split(","):
        dims = tuple(int(x) for x in part.strip().lower().split("x"))
        if len(dims) != 3 or min(dims) < 1:
            raise ValueError(f"--sizes: {part!r} is not HxWxF (e.g. 480x832x81)")
        out.append(dims)
    return out


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", required=True, help="JSON path (written by rank 0)")
    p.add_argument("--sizes", default=None, help=f"HxWxF,... (default {DEFAULT_SIZES}; dry run 32x64x5)")
    p.add_argument("--steps", type=int, default=None, help="timed denoising steps (default 3; dry run 2)")
    p.add_argument("--guidance", type=float, default=5.0)
    p.add_argument("--policies", default="bf16,fast,fast_fp8qk", help="one GPU and Ulysses")
    p.add_argument("--ring-policies", default="fast", help="ring ('' for none)")
    p.add_argument("--modes", default="single,ulysses,ring", help="which of single, ulysses, ring to run")
    p.add_argument("--backend", default="auto", help="fp4vis backend of the FP4 policies")
    p.add_argument("--range-check", default="raise", choices=["raise", "warn", "off"])
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--device", default="auto", help="auto: each rank's GPU, else the CPU")
    p.add_argument("--dry-run", action="store_true", help="tiny transformer and video (module docstring)")
    p.add_argument("--no-warmup", action="store_true")
    p.add_argument("--latents-dir", default=None,
                   help="rank 0 saves the one-GPU latents and timings here; a later invocation without the single "
                        "mode compares with them (to split a long measurement into several commands)")
    return p.parse_args(argv)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def build(args: argparse.Namespace, device: torch.device, cp: Any = None):
    """A fresh pipeline (the same seeded weights every time), with context parallelism ``cp``."""
    from fp4vis.pipelines.context_parallel import enable_context_parallel
    from fp4vis.pipelines.wan_video import build_random_wan_pipeline

    pipe = build_random_wan_pipeline("14B", device=device, dtype="bfloat16", seed=args.seed, vae=False,
                                     transformer_config=TINY_CONFIG if args.dry_run else None)
    pipe.set_progress_bar_config(disable=True)
    if cp is not None:
        # exact self-attention under ring is not measured here: the ring runs are FP4 policies, whose
        # cross-attention keeps the one-GPU backend
        enable_context_parallel(pipe.transformer, cp, exact_backend_for_ring=False)
    return pipe


def weights_checksum(pipe) -> float:
    return float(sum(p.detach().double().sum() for p in pipe.transformer.blocks[0].attn1.parameters()))


def timed_run(pipe, args: argparse.Namespace, device: torch.device, *, size, policy: str, embeds, latents,
              steps: int) -> dict[str, Any]:
    """One generation under ``policy``: seconds per step (this rank), peak memory, final latents."""
    from fp4vis.services.policies import policy_applied

    height, width, frames = size
    pe, npe = embeds
    marks: list[float] = []

    def mark(pipeline, i, t, kwargs):
        _sync(device)
        marks.append(time.perf_counter())
        return kwargs

    def run(n: int, callback=None):
        return pipe(prompt_embeds=pe, negative_prompt_embeds=npe, latents=latents.clone(), height=height,
                    width=width, num_frames=frames, num_inference_steps=n, guidance_scale=args.guidance,
                    output_type="latent", callback_on_step_end=callback).frames

    with policy_applied(pipe, policy, backend=args.backend, range_check=args.range_check), torch.no_grad():
        if not args.no_warmup:
            run(1)
        if device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(device)
        _sync(device)
        start = time.perf_counter()
        out = run(steps, mark)
    ends = [start, *marks]
    peak = torch.cuda.max_memory_allocated(device) / 2**30 if device.type == "cuda" else None
    return {"step_s": [b - a for a, b in zip(ends, ends[1:])], "peak_gib": peak, "latents": out.float().cpu()}


def _single_file(args, size: str, policy: str) -> Path | None:
    return Path(args.latents_dir) / f"single_{size}_{policy}.pt" if args.latents_dir else None


def _single_reference(args, singles, size: str, policy: str):
    """(latents, mean seconds per step) of the one-GPU run of ``policy``: from this invocation, or saved
    by an earlier one in ``--latents-dir`` (so that the modes can run as separate invocations)."""
    if (size, policy) in singles:
        return singles[size, policy]
    path = _single_file(args, size, policy)
    if path is not None and path.is_file():
        saved = torch.load(path, weights_only=True)
        singles[size, policy] = (saved["latents"], float(saved["mean_s_per_step"]))
        return singles[size, policy]
    return None


def run_mode(args, device, mode: str, cp, policies, sizes, steps, record, singles) -> None:
    """Every (size, policy) of one mode on one pipeline build; ``record`` appends and writes a run."""
    from fp4vis.pipelines.context_parallel import gathered, is_main_process
    from fp4vis.pipelines.wan_video import initial_latents, random_prompt_embeds

    pipe = build(args, device, cp)
    checksums = gathered(weights_checksum(pipe))
    try:
        for size in sizes:
            embeds = tuple(e.to(device) for e in random_prompt_embeds(args.seed))
            latents = initial_latents(pipe, height=size[0], width=size[1], frames=size[2], seed=args.seed).to(device)
            for policy in policies:
                row: dict[str, Any] = {"size": "x".join(map(str, size)), "mode": mode, "policy": policy,
                                       "backend": "diffusers" if policy == "bf16" else args.backend,
                                       "weights_checksum_per_rank": checksums}
                try:
                    res = timed_run(pipe, args, device, size=size, policy=policy, embeds=embeds, latents=latents,
                                    steps=steps)
                except Exception as exc:   # a one-GPU run fails alone; a parallel one takes every rank down
                    row["error"] = f"{type(exc).__name__}: {exc}"
                    record(row)
                    if cp is not None:
                        raise
                    continue
                per_rank = gathered(res["step_s"])
                step_s = [max(r[i] for r in per_rank) for i in range(steps)] if cp is not None else per_rank[0]
                row.update(seconds_per_step=step_s, mean_s_per_step=statistics.fmean(step_s),
                           median_s_per_step=statistics.median(step_s), seconds_per_step_per_rank=per_rank,
                           peak_memory_gib=gathered(res["peak_gib"]),
                           latents_finite=bool(torch.isfinite(res["latents"]).all()))
                if cp is None:
                    singles[row["size"], policy] = (res["latents"], row["mean_s_per_step"])
                    path = _single_file(args, row["size"], policy)
                    if path is not None and is_main_process():
                        path.parent.mkdir(parents=True, exist_ok=True)
                        torch.save({"latents": res["latents"], "mean_s_per_step": row["mean_s_per_step"]}, path)
                else:
                    ref = _single_reference(args, singles, row["size"], policy)
                    if ref is not None:
                        lat = res["latents"]
                        row["latents_rel_l2_vs_single"] = float((lat - ref[0]).norm() / ref[0].norm().clamp_min(1e-30))
                        row["bit_identical_vs_single"] = bool(torch.equal(lat, ref[0]))
                        row["speedup_vs_single"] = ref[1] / row["mean_s_per_step"]
                bf16 = _single_reference(args, singles, row["size"], "bf16")
                if bf16 is not None:
                    row["speedup_vs_single_bf16"] = bf16[1] / row["mean_s_per_step"]
                record(row)
    finally:
        del pipe
        gc.collect()
        if device.type == "cuda":
            torch.cuda.empty_cache()


def main(argv: list[str] | None = None) -> dict[str, Any]:
    from fp4vis.pipelines.context_parallel import ContextParallel, Session, distributed, torchrun_env
    from fp4vis.services.environment import environment
    from fp4vis.services.outputs import write_json
    from fp4vis.services.runtime import resolve_device

    args = parse_args(argv)
    sizes = parse_sizes(args.sizes or ("32x64x5" if args.dry_run else DEFAULT_SIZES))
    steps = args.steps or (2 if args.dry_run else 3)
    modes = [m.strip() for m in args.modes.split(",") if m.strip()]
    policies = [p.strip() for p in args.policies.split(",") if p.strip()]
    ring_policies = [p.strip() for p in args.ring_policies.split(",") if p.strip()]
    env = torchrun_env()
    world = env[1] if env is not None else 1

    result: dict[str, Any] = {
        "benchmark": "wan_context_parallel", "model": "Wan2.1-T2V-14B architecture" + (
            " (dry run: a 2-block, 4-head transformer)" if args.dry_run else ""),
        "random_weights": True, "dry_run": args.dry_run, "world_size": world, "sizes": [list(s) for s in sizes],
        "steps": steps, "guidance_scale": args.guidance, "seed": args.seed, "backend": args.backend,
        "range_check": args.range_check, "warmup": not args.no_warmup, "runs": [],
        "notes": "seconds_per_step: the slowest rank per step; latents compared with the one-GPU run of the same "
                 "policy (rank 0's); peak memory per rank in GiB (null on the CPU)",
    }

    def record(row: dict[str, Any]) -> None:
        result["runs"].append(row)
        if is_main:
            result["environment"] = environment()
            write_json(args.out, result)
            msg = row.get("error") or (f"{row['mean_s_per_step']:.3f} s/step" + (
                f", relL2 vs one GPU {row['latents_rel_l2_vs_single']:.2e}, bit-identical "
                f"{row['bit_identical_vs_single']}" if "bit_identical_vs_single" in row else ""))
            print(f"[{row['size']} {row['mode']} {row['policy']}] {msg}", flush=True)

    singles: dict[Any, Any] = {}
    parallel = [("ulysses", ContextParallel(ulysses=world), policies), ("ring", ContextParallel(ring=world),
                                                                           ring_policies)]
    if world == 1:
        is_main = True
        device = resolve_device(args.device)
        if "single" in modes:
            run_mode(args, device, "single", None, policies, sizes, steps, record, singles)
        result["skipped"] = "context-parallel runs need torchrun with 2 or more processes"
    else:
        with distributed(parallel[0][1], args.device) as session:
            session: Session
            is_main = session.is_main
            if "single" in modes:
                run_mode(args, session.device, "single", None, policies, sizes, steps, record, singles)
            for mode, cp, pols in parallel:
                if mode in modes and pols:
                    run_mode(args, session.device, str(cp), cp, pols, sizes, steps, record, singles)
    if is_main:
        result["environment"] = environment()
        write_json(args.out, result)
    return result


if __name__ == "__main__":
    main(sys.argv[1:])
