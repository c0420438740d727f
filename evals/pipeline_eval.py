"""FP4 attention on any diffusers text-to-image or text-to-video pipeline: per-step time against diffusers'
default attention, and fidelity to it (``fp4vis eval pipeline``).

BF16 (the pipeline's own attention, the reference of every metric) and then each policy run with the SAME
seed, size and schedule, each after an untimed 1-step warm-up (where ``compile`` compiles it). Two modes:

* ``model`` (a Hub id or a local diffusers folder): ``DiffusionPipeline.from_pretrained`` and the pipeline's
  own call, ``fp4vis.patch`` applied to the whole pipeline. A step's time is the interval between two
  ``callback_on_step_end`` calls (the device synchronised in each), so steps 2..n are timed, the whole
  denoising step (every transformer call, guidance, the scheduler) and nothing else; the call's wall time
  (text encoding, denoising, decode) is reported as end-to-end. Fidelity: the cosine and relative L2 of the
  final latents (as the pipeline holds them) against BF16 and, when decoded, per-frame (per-image) PSNR and
  SSIM of the outputs (torchmetrics, [0, 1] RGB, data_range 1.0, ``fp4vis.evals.common.frame_metrics``).
* ``speed_only`` (a name in ``fp4vis.evals.published_configs.PUBLISHED_DENOISERS``): the published denoiser
  architecture with seeded RANDOM weights, random latents and text conditioning of the published shapes
  (the text padding mask where the pipeline passes one), its transformer alone in a flow-matching Euler
  loop of ``steps`` steps (the calls per step the pipeline makes: two with classifier-free guidance). Every
  step is timed apart (device synchronised). Timings are real; the fidelity numbers describe random weights.

BF16 attention baselines (``baselines``, as ``eval wan``'s): besides BF16 (diffusers' default attention, the
reference of every metric), each baseline runs as a policy does (same warm-up, seed, compile, timing) with a BF16
attention library (``fp4vis.evals.baselines``: ``fa4`` flash-attn-4, ``sage``, ``sdpa_cudnn``, ``sdpa_flash``) as
the attention of the layers the FP4 policies patch by default (self and joint attention; Wan: ``attn1``), through
``fp4vis.patching.attention_function.attention_function_applied``; run ``attn=<name>``, after BF16 and before the
policies. A call with a key-padding mask (HunyuanVideo's text padding) goes to flash-attn-4 with its mask (each
element's kept keys, ``seqused_k``); the other libraries take no mask, and such a call keeps the model's attention
there. Each baseline run reports where its calls went (``baseline.routing``). ``"auto"`` (the default) runs fa4 and
sage where they can run here and records why not (``baselines_skipped``; on the CPU: all).

Per run: the per-step times, their mean with its 95 % t-interval (``fp4vis.evals.report.mean_ci95``), and
``speedup_vs`` {reference: its mean step / the run's} against BF16 and every baseline that ran (the shared run loop:
``fp4vis.evals.timed_runs``). Where the FP4 runs ran on the reference emulation (``reference_timed``), their times
are no speed result and the report gives no speedup.
"""

from __future__ import annotations

import contextlib
import inspect
import os
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, replace
from types import SimpleNamespace
from typing import Any

import numpy as np
import torch

from fp4vis.evals import published_configs as pc
from fp4vis.evals.baselines import BASELINES, attention_functions, run_name, select_baselines
from fp4vis.evals.common import error_metrics, frame_metrics, reference_timed
from fp4vis.evals.report import fmt, markdown_table, mean_ci95, report_writer
from fp4vis.evals.timed_runs import (
    LoopSettings,
    RunOutcome,
    ScheduledRun,
    bf16_baselines_policies,
    run_schedule,
    speedups_markdown,
)
from fp4vis.patching.attention_function import AppliedFunction, attention_function_applied
from fp4vis.pipelines.compile import compile_transformers
from fp4vis.pipelines.wan_sizes import check_cpu_size
from fp4vis.services.environment import environment
from fp4vis.services.guard_plans import guard_plan_summary, load_guard_plan, plan_for
from fp4vis.services.policies import attention_label, backend_in_use, check_backend, policy_applied, resolve_policies
from fp4vis.services.runtime import COMPILE_MODES, resolve_device, resolve_dtype
from fp4vis.services.sources import check_model_source, display_source, hub_error, is_network_error
from fp4vis.services.timing import Timer
from fp4vis.services.usage import UsageError

DEFAULT_PROMPT = "A red fox trotting through fresh snow in a birch forest, morning light, cinematic"
# a baseline's layers: those the FP4 policies patch by default; its runs are named attn=NAME
BASELINE_LAYERS = "attn"
BASELINE_LAYER_TEXT = "the layers fp4vis.patch patches by default: self and joint attention (Wan: attn1)"


def baseline_run(name: str) -> str:
    """The run name of BF16 baseline ``name``: ``attn=fa4``."""
    return run_name(name, BASELINE_LAYERS)


@dataclass(frozen=True)
class PipelineEvalConfig:
    """What ``run_pipeline_eval`` runs: a ``model`` (Hub id, local diffusers folder) or ``speed_only`` (a
    ``PUBLISHED_DENOISERS`` name), the FP4 ``policies``, the BF16 attention ``baselines`` ("auto", "none" (or "" /
    None), or names: ``fp4vis.evals.baselines.select_baselines``; one that cannot run here is a UsageError); the
    size (None: the pipeline's default, or the
    architecture's published one; ``frames`` None for an image model), ``steps``, ``guidance_scale`` (None:
    the pipeline's default); ``decode`` None: yes with a model (never in speed-only mode); ``compile``:
    "regional" or "full" (``fp4vis.pipelines.compile.compile_transformers``), in each run's warm-up;
    ``out_dir``: where ``name``.json / .md go (``name`` None: pipeline_fidelity, or pipeline_speed); ``cp``
    (``"ulysses=2"``, a ``ContextParallel``): every run's transformers under diffusers' context parallelism over
    the processes of a torchrun launch (the bf16 run is then diffusers' own context-parallel attention)."""

    model: str | None = None
    speed_only: str | None = None
    policies: str | list[str] = "fast"
    baselines: str | list[str] | None = "auto"
    prompt: str = DEFAULT_PROMPT
    negative_prompt: str | None = None
    height: int | None = None
    width: int | None = None
    frames: int | None = None
    steps: int = 10
    guidance_scale: float | None = None
    seed: int = 0
    device: str = "auto"
    dtype: str = "bfloat16"
    backend: str = "auto"
    guard_plan: str | None = None
    decode: bool | None = None
    warmup: bool = True
    compile: str | None = None
    out_dir: str | os.PathLike | None = None
    name: str | None = None
    progress: bool = True
    cp: Any = None


@dataclass
class RunOutput:
    latents: torch.Tensor               # final latents, float32, CPU
    frames: np.ndarray | None           # (N, H, W, 3) in [0, 1]: frames of a video, or images
    step_s: list[float]                 # the timed steps' wall times
    total_s: float                      # the whole call


def _sync(dev: torch.device) -> None:
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)


class SpeedOnlySubject:
    """A published architecture with random weights (module docstring), run in its own Euler loop."""

    def __init__(self, arch: pc.PublishedDenoiser, config: PipelineEvalConfig, dev: torch.device):
        self.arch, self.dev, self.config = arch, dev, config
        self.size = dict(height=config.height or arch.height, width=config.width or arch.width,
                         frames=(config.frames or arch.frames) if arch.frames is not None else None)
        self.dtype = resolve_dtype(config.dtype)
        self.module: torch.nn.Module | None = None

    def load(self) -> None:
        self.module = pc.build_denoiser(self.arch, device=self.dev, dtype=self.dtype, seed=self.config.seed)
        self.text = [pc.random_text(self.arch, seed=self.config.seed + i, device=self.dev, dtype=self.dtype)
                     for i in range(self.arch.calls_per_step)]
        g = torch.Generator().manual_seed(self.config.seed)
        self.latents = torch.randn(pc.latent_shape(self.arch, **self.size), generator=g)

    def compile(self, mode: str) -> None:
        compile_transformers(SimpleNamespace(transformer=self.module), mode)

    @torch.no_grad()
    def run(self, steps: int, label: str, decode: bool) -> RunOutput:
        from tqdm.auto import tqdm

        guidance = self.config.guidance_scale if self.config.guidance_scale is not None else self.arch.guidance
        sigmas = torch.linspace(1.0, 0.0, steps + 1).tolist()
        x = self.latents.to(self.dev)
        hw = dict(height=self.size["height"], width=self.size["width"])
        times = []
        with Timer() as total:
            for i in tqdm(range(steps), desc=f"denoise ({label})", disable=not self.config.progress):
                with Timer() as t:
                    xin = x.to(self.dtype)
                    out = [self.module(**pc.denoiser_inputs(self.arch, xin, sigmas[i], text, **hw))[0].float()
                           for text in self.text]
                    # classifier-free guidance: the first call is the prompt's, the second the negative's
                    v = out[0] if len(out) == 1 else out[1] + guidance * (out[0] - out[1])
                    x = x + (sigmas[i + 1] - sigmas[i]) * v
                    _sync(self.dev)
                times.append(t.seconds)
        return RunOutput(x.float().cpu(), None, times, total.seconds)


class PipelineSubject:
    """A diffusers pipeline, called as a user calls it (module docstring)."""

    def __init__(self, config: PipelineEvalConfig, dev: torch.device):
        self.config, self.dev = config, dev
        self.module: Any = None

    def load(self) -> None:
        from diffusers import DiffusionPipeline

        src, is_local = check_model_source(self.config.model)
        try:
            pipe = DiffusionPipeline.from_pretrained(src, dtype=resolve_dtype(self.config.dtype))
        except Exception as e:
            if not is_local and is_network_error(e):
                raise hub_error(self.config.model, e) from e
            raise
        self.module = pipe.to(self.dev)
        self.params = inspect.signature(pipe.__call__).parameters
        if "callback_on_step_end" not in self.params:
            raise UsageError(f"--model: {type(pipe).__name__} takes no callback_on_step_end, by which the eval times "
                             "steps and reads the latents")
        self.video = "num_frames" in self.params
        c = self.config
        self.size = dict(height=c.height, width=c.width, frames=c.frames if self.video else None)

    def compile(self, mode: str) -> None:
        if getattr(self.module, "transformer", None) is None:
            raise UsageError(f"--compile: {type(self.module).__name__} has no transformer to compile")
        compile_transformers(self.module, mode)

    def run(self, steps: int, label: str, decode: bool) -> RunOutput:
        c, dev = self.config, self.dev
        stamps: list[float] = []
        final: dict[str, torch.Tensor] = {}

        def on_step_end(pipeline, step_index, timestep, callback_kwargs):
            _sync(dev)
            stamps.append(time.perf_counter())
            if step_index == steps - 1:
                final["latents"] = callback_kwargs["latents"].float().cpu()
            return callback_kwargs

        kw: dict[str, Any] = dict(prompt=c.prompt, num_inference_steps=steps, output_type="np" if decode else "latent",
                                  generator=torch.Generator().manual_seed(c.seed), callback_on_step_end=on_step_end,
                                  callback_on_step_end_tensor_inputs=["latents"])
        optional = dict(negative_prompt=c.negative_prompt, height=c.height, width=c.width,
                        guidance_scale=c.guidance_scale, num_frames=c.frames)
        kw.update({k: v for k, v in optional.items() if v is not None and k in self.params})
        self.module.set_progress_bar_config(disable=not c.progress, desc=f"denoise ({label})")
        with Timer() as total:
            out = self.module(**kw)
        frames = _as_frames(out) if decode else None
        return RunOutput(final["latents"], frames, [b - a for a, b in zip(stamps, stamps[1:])], total.seconds)


def _as_frames(out: Any) -> np.ndarray:
    """A pipeline output's images or first video as (N, H, W, 3) float32 in [0, 1]."""
    video = getattr(out, "frames", None)
    arr = video[0] if video is not None else out.images
    if isinstance(arr, list):
        arr = np.stack([np.asarray(a, dtype=np.float32) / (255.0 if np.asarray(a).dtype == np.uint8 else 1.0)
                        for a in arr])
    arr = np.asarray(arr, dtype=np.float32)
    return arr if arr.ndim == 4 else arr[None]


def _check(config: PipelineEvalConfig) -> pc.PublishedDenoiser | None:
    """Every option checked before anything loads (UsageError naming it); the speed-only architecture."""
    if (config.model is None) == (config.speed_only is None):
        raise UsageError("give either a model (Hub id or local path) or speed_only (a published architecture: "
                         f"{', '.join(pc.PUBLISHED_DENOISERS)})")
    if config.compile is not None and config.compile not in COMPILE_MODES:
        raise UsageError(f"compile: must be one of {', '.join(COMPILE_MODES)}, got {config.compile!r}")
    if config.compile is not None and not config.warmup:
        raise UsageError("compile: needs the warm-up run (each run compiles there, outside its timing)")
    if config.speed_only is None:
        if config.steps < 2:
            raise UsageError(f"steps: at least 2 (a step is timed from the end of the one before), got {config.steps}")
        return None
    arch = pc.PUBLISHED_DENOISERS.get(config.speed_only)
    if arch is None:
        raise UsageError(f"speed_only: unknown architecture {config.speed_only!r}; known: "
                         f"{', '.join(pc.PUBLISHED_DENOISERS)}")
    if config.decode:
        raise UsageError("decode: speed-only mode runs the transformer alone (no VAE)")
    if config.frames is not None and arch.frames is None:
        raise UsageError(f"frames: {arch.title} is an image model")
    return arch


def run_pipeline_eval(config: PipelineEvalConfig, *, say: Callable[[str], Any] | None = None) -> dict[str, Any] | None:
    """Run BF16 and every policy of ``config`` (``PipelineEvalConfig``); returns the result dict and writes
    JSON/Markdown to ``config.out_dir``. ``say``: told what the eval runs once its options are checked. With
    ``config.cp``, under torchrun: every rank runs, rank 0 alone says, writes and returns the result (the others
    None)."""
    arch = _check(config)
    if config.cp is None:
        return _evaluate(config, arch, resolve_device(config.device), say)
    from fp4vis.pipelines.context_parallel import ContextParallel, distributed, parse_cp

    cp = config.cp if isinstance(config.cp, ContextParallel) else parse_cp(config.cp)
    with distributed(cp, config.device) as session:
        main = session.is_main
        result = _evaluate(replace(config, cp=cp, out_dir=config.out_dir if main else None,
                                   progress=config.progress and main), arch, session.device, say if main else None)
    return result if main else None


def _spread(subject: SpeedOnlySubject | PipelineSubject, cp: Any, dev: torch.device, dtype: torch.dtype) -> None:
    """The subject's transformers under diffusers' context parallelism ``cp`` (``enable_context_parallel``: its
    checks first); the bf16 run's exact attention under ring needs a backend that can run it."""
    from fp4vis.pipelines.context_parallel import check_exact_under_ring, enable_context_parallel
    from fp4vis.pipelines.model_files import pipeline_transformers

    check_exact_under_ring(cp, dev, dtype, "the bf16 run")
    module = subject.module
    models = [module] if isinstance(subject, SpeedOnlySubject) else pipeline_transformers(module)
    if not models:
        raise UsageError(f"--cp {cp}: {type(module).__name__} has no transformer to spread over the processes")
    for model in models:
        enable_context_parallel(model, cp)


def _evaluate(config: PipelineEvalConfig, arch: pc.PublishedDenoiser | None, dev: torch.device,
              say: Callable[[str], Any] | None) -> dict[str, Any]:
    """``run_pipeline_eval`` on this process's device ``dev``."""
    check_backend(config.backend, dev)
    pols = resolve_policies(config.policies, allow_bf16=False)
    baseline_names, baselines_skipped = select_baselines(config.baselines, dev)
    plan = load_guard_plan(config.guard_plan)
    cosine, rel_l2 = error_metrics()
    random_weights = arch is not None
    decode = False if random_weights else (config.decode is None or config.decode)
    if random_weights:
        subject: SpeedOnlySubject | PipelineSubject = SpeedOnlySubject(arch, config, dev)
        try:
            pc.check_size(arch, **subject.size)
        except ValueError as e:
            raise UsageError(str(e)) from None
        tokens = pc.tokens(arch, **subject.size)
        if dev.type == "cpu":   # before building it
            check_cpu_size(f"speed-only {config.speed_only} on the CPU", tokens, height=subject.size["height"],
                           width=subject.size["width"], frames=subject.size["frames"] or 1)
        what = f"{arch.title} architecture, random weights (speed only)"
    else:
        subject = PipelineSubject(config, dev)
        tokens = None
        what = config.model
    if say is not None:
        bf16_runs = ", ".join(["bf16 (the model's attention)"] + [baseline_run(b) for b in baseline_names])
        say(f"eval pipeline: {what}, {config.steps} steps; runs {bf16_runs}, then "
            f"{', '.join(p.name for p in pols)} on the {backend_in_use(config.backend, dev)} backend"
            + (f"; every run compiled ({config.compile}, fullgraph), in its warm-up" if config.compile else ""))
    subject.load()
    if config.cp is not None:
        _spread(subject, config.cp, dev, resolve_dtype(config.dtype))
    if config.compile is not None:
        subject.compile(config.compile)
    runs: dict[str, Any] = {}
    result: dict[str, Any] = {
        "eval": "pipeline_eval", "mode": "speed_only" if random_weights else "fidelity",
        "model": f"{arch.title} architecture" if random_weights else display_source(config.model),
        "pipeline": None if random_weights else type(subject.module).__name__,
        "random_weights": random_weights, "prompt": None if random_weights else config.prompt,
        **subject.size, "tokens": tokens, "steps": config.steps, "guidance_scale": config.guidance_scale,
        "seed": config.seed, "dtype": config.dtype, "backend": config.backend, "device": dev.type,
        "decode": decode, "warmup": config.warmup, "compile": config.compile, "guard_plan": guard_plan_summary(plan),
        "baselines": baseline_names, "baselines_skipped": baselines_skipped, "baseline_layers": BASELINE_LAYERS,
        "context_parallel": config.cp.to_dict() if config.cp is not None else None, "runs": runs, "complete": False,
        "warnings": []}
    if random_weights:
        result["architecture"] = {"name": config.speed_only, "class": arch.class_name, "source": arch.source,
                                  "config": arch.config, "text_tokens": arch.text_tokens,
                                  "text_mask": arch.prompt_tokens is not None, "prompt_tokens": arch.prompt_tokens,
                                  "calls_per_step": arch.calls_per_step, "notes": list(arch.notes)}
        result["guidance_scale"] = arch.guidance if config.guidance_scale is None else config.guidance_scale
    name = config.name or ("pipeline_speed" if random_weights else "pipeline_fidelity")

    write = report_writer(config.out_dir, name, result, pipeline_markdown)

    schedule, references = bf16_baselines_policies(
        pols, baseline_names, BASELINE_LAYERS, guard_for=lambda pol: plan_for(plan, pol),
        policy_label=lambda pol, guard: attention_label(pol, config.backend, dev, guard),
        baseline_label=lambda b: f"{BASELINES[b].label} as the attention")
    reference: dict[str, RunOutput] = {}
    applied: dict[str, AppliedFunction] = {}   # run name -> where its baseline's calls went

    @contextlib.contextmanager
    def run_block(run: ScheduledRun) -> Iterator[None]:
        with policy_applied(subject.module, run.policy, guard=run.guard, backend=config.backend):
            if run.baseline is None:
                yield
                return
            with attention_function_applied(subject.module, attention_functions(run.baseline)) as fn_applied:
                applied[run.name] = fn_applied
                yield

    def execute(run: ScheduledRun, warmup: bool) -> RunOutput:
        if warmup:
            return subject.run(1, f"{run.label}; warm-up, untimed", decode=False)
        return subject.run(config.steps, run.label, decode)

    def record(outcome: RunOutcome) -> dict[str, Any]:
        res = outcome.output
        run: dict[str, Any] = {"timings": {"denoise_s": sum(res.step_s), "total_s": res.total_s,
                                           "warmup_s": outcome.warmup_s, "steps_timed": len(res.step_s),
                                           "step_s_each": res.step_s},
                               "step_s": mean_ci95(res.step_s)}
        if outcome.run.baseline is not None:
            b = outcome.run.baseline
            run["baseline"] = {"name": b, "attention": BASELINES[b].description, "layers": BASELINE_LAYER_TEXT,
                               "routing": applied[outcome.run.name].summary()}
        if outcome.peak_memory_gib is not None:
            run["peak_memory_gib"] = outcome.peak_memory_gib
        if not reference:
            reference["res"] = res
        else:
            ref = reference["res"]
            run["speedup_step"] = runs["bf16"]["timings"]["denoise_s"] / run["timings"]["denoise_s"]
            run["latent_cosine"] = cosine(res.latents, ref.latents)
            run["latent_rel_l2"] = rel_l2(res.latents, ref.latents)
            if res.frames is not None and ref.frames is not None:
                run["frames"] = frame_metrics(res.frames, ref.frames)
        return run

    run_schedule(schedule, LoopSettings(config.warmup, config.compile is not None, dev, references), result,
                 execute=execute, context=run_block, record=record, write=write)
    result["complete"] = True
    write()
    if config.out_dir is None:
        result["environment"] = environment()
    return result


def pipeline_markdown(r: dict[str, Any]) -> str:
    """The eval's Markdown report."""
    warn = ("\n**Random weights (speed only)**: the published architecture with seeded random weights, random "
            "latents and text conditioning of the published shapes; no checkpoint was loaded. Timings are real; the "
            "fidelity columns describe random weights and say nothing about output quality.\n"
            if r["random_weights"] else "")
    partial = "" if r.get("complete", True) else "\n**Partial results**: only the runs listed below finished.\n"
    size = f"{r['width']}x{r['height']}" if r.get("width") else "the pipeline's default size"
    frames = f", {r['frames']} frames" if r.get("frames") else ""
    toks = f" ({r['tokens']} tokens per sequence)" if r.get("tokens") else ""
    compiled = (f", **compiled** ({r['compile']}, fullgraph, in each run's warm-up)" if r.get("compile")
                else ", eager (not compiled)")
    lines = [f"# FP4 attention in a diffusers pipeline: {r['model']}", warn + partial,
             f"{size}{frames}{toks}, {r['steps']} steps, guidance {fmt(r['guidance_scale'])}, seed {r['seed']}, "
             f"{r['dtype']}, backend `{r['backend']}`{compiled}; same seed for every run; "
             f"{'an untimed warm-up before each run' if r['warmup'] else 'no warm-up'}.", ""]
    arch = r.get("architecture")
    if arch:
        mask = (f"a padding mask ({arch['prompt_tokens']} prompt tokens)" if arch["text_mask"] else "no mask")
        lines += [f"Architecture: `{arch['class']}` from {arch['source']}; text of {arch['text_tokens']} tokens, "
                  f"{mask}; {arch['calls_per_step']} transformer call(s) per step. "
                  + " ".join(n[0].upper() + n[1:] + "." for n in arch["notes"]), ""]
    emulated = reference_timed(r)
    rows = []
    for name, run in r["runs"].items():
        if "error" in run:
            rows.append([name, "failed: " + run["error"].splitlines()[0][:120]] + [None] * (6 if emulated else 7))
            continue
        s, f = run["step_s"], run.get("frames") or {}
        ci = "n/a" if s["ci95_low"] is None else f"{fmt(s['ci95_low'])} – {fmt(s['ci95_high'])}"
        speed = [] if emulated else [run.get("speedup_step")]
        cos = run.get("latent_cosine")
        rows.append([name, s["mean"], ci, run["timings"]["total_s"], *speed, None if cos is None else fmt(cos, 6),
                     run.get("latent_rel_l2"), f.get("psnr_mean"), f.get("ssim_mean")])
    lines.append(markdown_table(["run", "per step (s)", "95 % interval", "call (s)",
                                 *([] if emulated else ["speedup per step"]), "latent cosine", "latent relL2",
                                 "PSNR vs BF16 (dB)", "SSIM vs BF16"], rows))
    if emulated:
        lines += ["", "The FP4 runs ran the reference emulation (exact numerics, float64 element math), not a "
                  "kernel: their times say what the emulation costs, not what FP4 attention gains, so no speedup "
                  "is given."]
    how = ("each step's wall time, device synchronised (the transformer's calls, guidance, the Euler update)"
           if r["random_weights"] else "the intervals between consecutive step ends (callback_on_step_end, device "
           "synchronised: steps 2..n, each a whole denoising step)")
    call = ("the loop's wall time" if r["random_weights"] else "the pipeline call's wall time (text encoding, "
            "denoising, decode)")
    lines += ["", f"Per step: the mean of {how}, with its 95 % t-interval; call: {call}. Latent cosine / relL2: the "
              "final latents against BF16's. PSNR/SSIM: per frame or image (torchmetrics, [0, 1] RGB, data_range "
              "1.0), mean."]
    lines += _baselines_markdown(r, emulated)
    mem = {n: run["peak_memory_gib"] for n, run in r["runs"].items() if "peak_memory_gib" in run}
    if mem:
        lines += ["", "Peak GPU memory (GiB): " + ", ".join(f"{n} {v:.1f}" for n, v in mem.items()) + "."]
    return "\n".join(lines)


def routing_text(routing: dict[str, Any]) -> str:
    """Where a baseline run's attention calls went (``AppliedFunction.summary``), in words: per layer for eager
    calls; under torch.compile the calls Dynamo traced (a block graph shared by the blocks: no per-layer count)."""
    traced, parts = routing["traced"], []
    compiled = traced["calls_on_function"] or traced["calls_kept"]
    if routing["calls_on_function"] or routing["calls_kept"] or not compiled:
        parts.append(f"its function in {len(routing['layers_on_function'])} of {routing['layers']} layers "
                     f"({routing['calls_on_function']} calls)")
        if routing["layers_kept"]:
            reasons = sorted({why for whys in routing["layers_kept"].values() for why in whys})
            parts.append(f"the model's attention kept in {len(routing['layers_kept'])} layers "
                         f"({sum(routing['calls_kept'].values())} calls: {'; '.join(reasons)})")
    if compiled:
        kept = "".join(f", {n} kept: {why}" for why, n in traced["calls_kept"].items())
        parts.append(f"compiled, the calls traced (shared block graphs): {traced['calls_on_function']} on its "
                     f"function{kept}")
    return "; ".join(parts)


def _baselines_markdown(r: dict[str, Any], emulated: bool) -> list[str]:
    """What the BF16 baselines are and where their calls went, why any were skipped, and the speedup table."""
    ran, skipped = r.get("baselines") or [], r.get("baselines_skipped") or {}
    lines = []
    if ran:
        what = "; ".join(f"`{name}`: {run['baseline']['attention']}, {routing_text(run['baseline']['routing'])}"
                         for name, run in r["runs"].items() if "baseline" in run)
        lines += ["", f"BF16 baselines: a BF16 attention library as the attention of {BASELINE_LAYER_TEXT}; a call "
                  "with a key-padding mask (text padding) goes to flash-attn-4 with its mask and keeps the model's "
                  "attention under the other libraries (they take no mask). "
                  f"{what}. `bf16` is diffusers' default attention, the reference of every fidelity column."]
    if skipped:
        lines += ["", "Baselines skipped: " + "; ".join(f"`{b}` ({why})" for b, why in skipped.items()) + "."]
    if not emulated:
        lines += speedups_markdown(r["runs"], ["bf16"] + [baseline_run(b) for b in ran], "the mean step")
    return lines
