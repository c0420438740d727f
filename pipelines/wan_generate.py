"""``fp4vis generate`` on a Wan pipeline: ``run_generate(GenerateOptions(model, prompt, ...))`` resolves the
options once (``GenerateRun``: the policy, the guard plan, the model's defaults and model_index.json; the step
indices, the backend and the sizes checked), loads a Wan pipeline, generates (``fp4vis.pipelines.wan_video.
generate_checked``, which trusts the run) and writes the MP4 (imageio-ffmpeg) and a JSON sidecar (model, prompt,
seed, frames, steps, policy, guard plan, timings, versions, GPU); with ``cp="ulysses=2"`` (or ``ring``, or both)
under torchrun it spreads each transformer pass over the ranks (``fp4vis.pipelines.context_parallel``) and rank 0
writes. On the CPU, sizes made for a GPU are warned about first (``warn_if_impractical_on_cpu``).
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import torch

from fp4vis.pipelines.compile import compile_transformers
from fp4vis.pipelines.denoising_steps import check_steps
from fp4vis.pipelines.media_files import save_mp4
from fp4vis.pipelines.model_files import check_prompt, model_index, resolve_model
from fp4vis.pipelines.wan_sizes import CPU_PRACTICAL_TOKENS, tokens_per_frame_sequence, wan_geometry
from fp4vis.pipelines.wan_video import GenerationConfig, generate_checked, generation_defaults, load_wan_pipeline
from fp4vis.policy import Policy, get_policy
from fp4vis.services.environment import environment
from fp4vis.services.guard_plans import check_plan_policy, guard_plan_summary, load_guard_plan
from fp4vis.services.outputs import check_output_file, write_json
from fp4vis.services.policies import attention_label, check_backend, warn_reference_fallback
from fp4vis.services.runtime import COMPILE_MODES, resolve_device, resolve_dtype
from fp4vis.services.sources import check_model_source
from fp4vis.services.timing import Timer
from fp4vis.services.usage import UsageError

# the settings a model's training record gives (``generation_defaults``) where a GenerateOptions leaves them None
MODEL_DEFAULTS = ("height", "width", "frames", "steps", "guidance_scale", "fps")


@dataclass(frozen=True)
class GenerateOptions:
    """What ``fp4vis generate`` is asked to make, as given (``run_generate``; the CLI builds it from its
    options; ``fp4vis.pipelines.diffusers_generate.run_pipeline_generate`` takes it too). ``height``,
    ``width``, ``frames``, ``steps``, ``guidance_scale`` and ``fps`` left None come from
    ``generation_defaults(model)``; ``image`` (image-to-video) and ``guard_plan`` are paths; ``force``: a
    prompt the model does not know generates, with a warning (``check_prompt``); ``compile``: a mode of
    ``compile_transformers`` (the first step then includes the compilation); ``cp`` (``"ulysses=2"``,
    ``"ring=2"``, ``"ulysses=2,ring=2"`` or a ``ContextParallel``): context parallelism over the processes of
    a torchrun launch (``fp4vis.pipelines.context_parallel``). Not to be confused with
    ``fp4vis.pipelines.wan_video.GenerationConfig``, the settings of one ``generate`` call on a loaded pipeline."""

    model: str
    prompt: str
    output: str | os.PathLike = "video.mp4"
    negative_prompt: str | None = None
    image: str | None = None
    policy: str = "fast"
    guard_plan: str | None = None
    seed: int = 0
    height: int | None = None
    width: int | None = None
    frames: int | None = None
    steps: int | None = None
    guidance_scale: float | None = None
    fps: int | None = None
    device: str = "auto"
    dtype: str = "bfloat16"
    backend: str = "auto"
    exact_steps: tuple[int, ...] | None = None
    progress: bool = True
    cp: Any = None
    force: bool = False
    compile: str | None = None


@dataclass(frozen=True)
class GenerateRun:
    """A ``GenerateOptions`` resolved once by ``run_generate``, which the layers below trust: ``options`` with
    the model's defaults filled in (and ``cp`` a ``ContextParallel`` or None), the ``Policy``, the loaded guard
    ``plan`` (None without one), and a local model's ``model_index.json`` (``index``; None for a Hub id)."""

    options: GenerateOptions
    policy: Policy
    plan: Any
    index: Mapping[str, Any] | None


def run_generate(config: GenerateOptions, *, say: Callable[[str], Any] | None = None,
                 index: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """``fp4vis generate``: load, generate, write the MP4 and its JSON sidecar (same name, .json) of ``config``
    (``GenerateOptions``); ``say`` is told what runs once the model is loaded (the CLI's header; rank 0 alone
    under ``cp``); ``index``: the model's model_index.json where the caller has read it (the CLI, to pick the
    pipeline). A prompt the model does not know is refused (``check_prompt``; ``force``: a warning), and
    so, before loading, are step indices that do not exist and sizes or frames the model's VAE and
    transformer cannot take (``check_steps``, ``wan_geometry``: errors name the options).

    Under ``cp`` every rank denoises, rank 0 alone decodes and writes (the others return ``video`` None)."""
    given = {k: getattr(config, k) for k in MODEL_DEFAULTS}
    gen = {**generation_defaults(config.model), **{k: v for k, v in given.items() if v is not None}}
    config = replace(config, **{k: gen[k] for k in MODEL_DEFAULTS})
    policy = get_policy(config.policy)   # the one resolution of the name: the layers below take the Policy
    check_prompt(config.model, config.prompt, force=config.force)
    check_steps(config.exact_steps, config.steps, "--exact-steps")
    if config.compile is not None and config.compile not in COMPILE_MODES:
        raise UsageError(f"compile: must be one of {', '.join(COMPILE_MODES)}, got {config.compile!r}")
    plan = load_guard_plan(config.guard_plan)
    check_plan_policy(plan, policy, "guard_plan")
    if plan is not None:
        check_steps(tuple(plan.step_indices()), config.steps, "guard_plan: its exact_steps")
    if config.image is not None and not Path(config.image).is_file():
        raise UsageError(f"image: file {config.image!r} does not exist")
    src, is_local = check_model_source(resolve_model(config.model))
    if is_local and index is None:
        index = model_index(src)
    run = GenerateRun(config, policy, plan, index if is_local else None)
    if config.cp is None:
        return _run_generate(run, resolve_device(config.device), say=say)
    from fp4vis.pipelines.context_parallel import ContextParallel, distributed, parse_cp

    cp = config.cp if isinstance(config.cp, ContextParallel) else parse_cp(config.cp)
    with distributed(cp, config.device) as session:
        run = replace(run, options=replace(config, cp=cp, progress=config.progress and session.is_main))
        return _run_generate(run, session.device, main=session.is_main, say=say if session.is_main else None)


def _run_generate(run: GenerateRun, dev: torch.device, *, main: bool = True,
                  say: Callable[[str], Any] | None = None) -> dict[str, Any]:
    """``run_generate`` of the resolved ``run`` on this process's device ``dev``; ``main``: the process that
    decodes and writes."""
    c, policy, plan = run.options, run.policy, run.plan
    check_backend(c.backend, dev)
    pil = None
    if c.image is not None:
        from PIL import Image

        pil = Image.open(c.image).convert("RGB")
    if c.cp is None:
        output = check_output_file(c.output, "output")
    else:  # rank 0 alone touches the output folder; every rank stops on its error
        from fp4vis.pipelines.context_parallel import agree, check_exact_under_ring

        output = agree(lambda: check_output_file(c.output, "output"))
        exact = ("--policy bf16" if policy.method == "exact" else "--exact-steps" if c.exact_steps else None)
        check_exact_under_ring(c.cp, dev, resolve_dtype(c.dtype), exact)
    # the size against the model's configs, before its weights load
    wan_geometry(c.model, run.index).check(height=c.height, width=c.width, frames=c.frames, model=c.model, prefix="--")
    pipeline_class = str((run.index or {}).get("_class_name", ""))
    if pil is not None and run.index is not None and "ImageToVideo" not in pipeline_class:
        raise UsageError(f"image: {c.model!r} is a text-to-video model ({pipeline_class}); "
                         "drop --image, or give an image-to-video checkpoint")
    with Timer() as tload:
        pipe = load_wan_pipeline(c.model, device=dev, dtype=c.dtype, i2v=True if pil is not None else None,
                                 index=run.index)
    if pil is None and type(pipe).__name__ == "WanImageToVideoPipeline":
        raise UsageError(f"{c.model!r} is an image-to-video model: pass --image")
    if say is not None:
        exact = f", exact attention in steps {', '.join(map(str, c.exact_steps))}" if c.exact_steps else ""
        say(f"generate: {c.model}, \"{c.prompt}\"{' from ' + str(c.image) if c.image else ''}, {c.width}x{c.height}, "
            f"{c.frames} frames, {c.steps} steps, guidance {c.guidance_scale}, seed {c.seed}; attention: "
            f"{attention_label(policy, c.backend, dev, plan)}{exact}"
            f"{f'; transformer compiled ({c.compile}, fullgraph) in the first step' if c.compile else ''} -> {output}")
    warn_reference_fallback(c.backend, dev, policy, "fp4vis generate")   # after the line saying what runs
    if dev.type == "cpu":
        warn_if_impractical_on_cpu(pipe, policy, height=c.height, width=c.width, frames=c.frames, steps=c.steps,
                                   guidance_scale=c.guidance_scale)
    if c.cp is not None:
        from fp4vis.pipelines.context_parallel import check_tokens, enable_context_parallel

        check_tokens(tokens_per_frame_sequence(pipe, height=c.height, width=c.width, frames=c.frames), c.cp)
        enable_context_parallel(pipe.transformer, c.cp)
    if c.compile is not None:
        compile_transformers(pipe, c.compile)
    res = generate_checked(pipe, GenerationConfig(
        prompt=c.prompt, negative_prompt=c.negative_prompt, image=pil, height=c.height, width=c.width,
        frames=c.frames, steps=c.steps, guidance_scale=c.guidance_scale, seed=c.seed, policy=policy, guard=plan,
        backend=c.backend, progress=c.progress, exact_steps=c.exact_steps, decode=main))
    timings = {"load_s": tload.seconds, **res.timings}
    if not main:
        return {"video": None, "sidecar": None, "timings": timings, "result": res}
    out = save_mp4(res.frames, output, fps=c.fps, progress=c.progress)
    sidecar = {
        "model": c.model, "pipeline": type(pipe).__name__, "prompt": c.prompt, "negative_prompt": c.negative_prompt,
        "image": c.image, "seed": c.seed, "frames": c.frames, "height": c.height, "width": c.width, "steps": c.steps,
        "guidance_scale": c.guidance_scale, "fps": c.fps, "policy": policy.name, "backend": c.backend,
        "dtype": str(resolve_dtype(c.dtype)).replace("torch.", ""), "guard_plan": c.guard_plan,
        "guard_plan_content": guard_plan_summary(plan), "exact_steps": res.info["exact_steps"],
        "tokens": res.info["tokens"], "context_parallel": c.cp.to_dict() if c.cp is not None else None,
        "compile": c.compile,
        "timings": timings, "video": str(out), "environment": environment(),
    }
    side = write_json(out.with_suffix(".json"), sidecar)
    return {"video": out, "sidecar": side, "timings": sidecar["timings"], "result": res}


_CPU_PROBE_TOKENS = 1024


def warn_if_impractical_on_cpu(pipe, policy: str | Policy, *, height: int, width: int, frames: int, steps: int,
                               guidance_scale: float) -> float | None:
    """Sizes made for a GPU (81 frames at 480x832: 32760 tokens) take hours or days on a CPU: warn, with
    an estimate measured here and the options that make a CPU run practical. The estimate is attention
    alone, a lower bound: one call of the policy at ``_CPU_PROBE_TOKENS`` tokens timed on this CPU, scaled
    by the square of the sequence, the layers, the steps and the CFG passes. Returns it (seconds), or None
    below ``CPU_PRACTICAL_TOKENS``."""
    import time
    import warnings

    from fp4vis.attention import attention

    tokens = tokens_per_frame_sequence(pipe, height=height, width=width, frames=frames)
    if tokens <= CPU_PRACTICAL_TOKENS:
        return None
    cfg = pipe.transformer.config
    heads, head_dim = int(cfg.num_attention_heads), int(cfg.attention_head_dim)
    q = torch.randn(1, heads, _CPU_PROBE_TOKENS, head_dim)
    name = getattr(policy, "name", policy)   # a Policy (run_generate's) or its name
    t0 = time.perf_counter()
    attention(q, q, q, policy=policy, backend="reference", range_check="off")
    probe = time.perf_counter() - t0
    passes = steps * (2 if guidance_scale > 1.0 else 1) * int(cfg.num_layers)
    estimate = probe * (tokens / _CPU_PROBE_TOKENS) ** 2 * passes
    warnings.warn(f"generate on the CPU: {frames} frames at {height}x{width} are {tokens} tokens per sequence; "
                  f"{steps} steps would take at least {estimate / 3600:.1f} h of attention alone here (one "
                  f"{_CPU_PROBE_TOKENS}-token call of {name!r} took {probe:.2f} s). Sizes made for a GPU: use "
                  "--device cuda, or e.g. --frames 9 --height 128 --width 128 --steps 8 on the CPU",
                  UserWarning, stacklevel=3)
    return estimate
