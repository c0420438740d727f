"""FP4 attention on any diffusers text-to-image or text-to-video pipeline: per-step time against diffusers'
default attention, and fidelity to it (``fp4vis eval pipeline``): the generic configuration of the pipeline
eval, whose run loop (BF16, the BF16 attention baselines, the policies; warm-up, seeds, timing, speedups,
comparison with BF16, the report) is ``fp4vis.evals.timed_runs.run_eval``. Two modes:

* ``model`` (a Hub id or a local diffusers folder): ``DiffusionPipeline.from_pretrained`` and the pipeline's
  own call, ``fp4vis.patch`` applied to the whole pipeline (``PipelineSubject``). A step's time is the interval
  between two ``callback_on_step_end`` calls (the device synchronised in each), so steps 2..n are timed, the
  whole denoising step (every transformer call, guidance, the scheduler) and nothing else; the call's wall time
  (text encoding, denoising, decode) is reported as end-to-end. Fidelity: the cosine and relative L2 of the
  final latents (as the pipeline holds them) against BF16 and, when decoded, per-frame (per-image) PSNR and
  SSIM of the outputs (``frames``: torchmetrics, [0, 1] RGB, data_range 1.0).
* ``speed_only`` (a name in ``fp4vis.evals.published_configs.PUBLISHED_DENOISERS``; ``SpeedOnlySubject``): the
  published denoiser architecture with seeded RANDOM weights, random latents and text conditioning of the
  published shapes (the text padding mask where the pipeline passes one), its transformer alone in a
  flow-matching Euler loop of ``steps`` steps (the calls per step the pipeline makes: two with classifier-free
  guidance; CogVideoX's one call of batch 2, the latents twice and the texts stacked, as its pipeline does it).
  Every step is timed apart (device synchronised). Timings are real; the fidelity numbers describe
  random weights.

A baseline runs ``attn=<name>``: the library (``fp4vis.evals.baselines``) as the attention of the layers the FP4
policies patch by default (self and joint attention; Wan: ``attn1``). A call with a key-padding mask
(HunyuanVideo's text padding) goes to flash-attn-4 with its mask (each element's kept keys, ``seqused_k``); the
other libraries take no mask, and such a call keeps the model's attention there. Each baseline run reports where
its calls went (``baseline.routing``). Per run: the per-step times, their mean with its 95 % t-interval
(``step_s``, ``fp4vis.evals.report.mean_ci95``) and ``speedup_step`` against BF16.
"""

from __future__ import annotations

import inspect
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from types import SimpleNamespace
from typing import Any

import numpy as np
import torch

from fp4vis.evals import published_configs as pc
from fp4vis.evals import timed_runs
from fp4vis.evals.common import reference_timed
from fp4vis.evals.report import fmt, mean_ci95
from fp4vis.evals.timed_runs import DiffusionEvalConfig, EvalSubject, RunOutcome, ScheduledRun, run_eval
from fp4vis.pipelines.compile import compile_transformers
from fp4vis.pipelines.wan_sizes import check_cpu_size
from fp4vis.services.runtime import resolve_dtype
from fp4vis.services.sources import check_model_source, display_source, hub_error, is_network_error
from fp4vis.services.timing import Timer
from fp4vis.services.usage import UsageError

BASELINE_LAYER_TEXT = "the layers fp4vis.patch patches by default: self and joint attention (Wan: attn1)"


@dataclass(frozen=True)
class PipelineEvalConfig(DiffusionEvalConfig):
    """What ``run_pipeline_eval`` runs (``DiffusionEvalConfig``'s options): a ``model`` (Hub id, local diffusers
    folder) or ``speed_only`` (a ``PUBLISHED_DENOISERS`` name); the size None: the pipeline's default, or the
    architecture's published one (``frames`` None for an image model); ``guidance_scale`` None: the pipeline's
    or the architecture's; ``name`` None: pipeline_fidelity, or pipeline_speed."""

    def architectures(self) -> Mapping[str, pc.PublishedDenoiser]:
        return pc.PUBLISHED_DENOISERS

    def check(self) -> None:
        if self.speed_only is None:
            if self.steps < 2:
                raise UsageError(f"steps: at least 2 (a step is timed from the end of the one before), got "
                                 f"{self.steps}")
            return
        arch = pc.PUBLISHED_DENOISERS[self.speed_only]
        if self.decode:
            raise UsageError("decode: speed-only mode runs the transformer alone (no VAE)")
        if self.frames is not None and arch.frames is None:
            raise UsageError(f"frames: {arch.title} is an image model")

    def subject(self, device: torch.device, policies: list[Any], plan: Any) -> EvalSubject:
        if self.speed_only is None:
            return PipelineSubject(self, device)
        subject = SpeedOnlySubject(pc.PUBLISHED_DENOISERS[self.speed_only], self, device)
        subject.check_size()
        return subject


def run_pipeline_eval(config: PipelineEvalConfig, *, say: Callable[[str], Any] | None = None,
                      frames_sink: dict[str, Any] | None = None) -> dict[str, Any] | None:
    """The pipeline eval of ``config`` (``fp4vis.evals.timed_runs.run_eval``): a ``PipelineEvalConfig``, or any
    other configuration of it (``fp4vis.evals.wan_fidelity.WanEvalConfig``)."""
    return run_eval(config, say=say, frames_sink=frames_sink)


@dataclass
class RunOutput:
    latents: torch.Tensor               # final latents, float32, CPU
    frames: np.ndarray | None           # (N, H, W, 3) in [0, 1]: frames of a video, or images
    step_s: list[float]                 # the timed steps' wall times
    total_s: float                      # the whole call


def _sync(dev: torch.device) -> None:
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)


class DiffusersSubject(EvalSubject):
    """What the generic configuration's two subjects share: per-step timings, the report, its names."""

    eval_name = "pipeline_eval"
    command = "eval pipeline"
    report_names = ("pipeline_fidelity", "pipeline_speed")
    baseline_layers = "attn"   # those the FP4 policies patch by default
    baseline_layer_text = BASELINE_LAYER_TEXT

    @staticmethod
    def markdown(result: dict[str, Any]) -> str:
        return pipeline_markdown(result)

    def run(self, steps: int, label: str, decode: bool) -> RunOutput:
        raise NotImplementedError

    def execute(self, run: ScheduledRun, label: str, warmup: bool) -> RunOutput:
        return self.run(1, label, decode=False) if warmup else self.run(self.config.steps, label, self.decode)

    def timings(self, outcome: RunOutcome) -> dict[str, Any]:
        res = outcome.output
        return {"timings": {"denoise_s": sum(res.step_s), "total_s": res.total_s, "warmup_s": outcome.warmup_s,
                            "steps_timed": len(res.step_s), "step_s_each": res.step_s},
                "step_s": mean_ci95(res.step_s)}

    def speedups(self, timings: dict[str, Any], bf16: dict[str, Any]) -> dict[str, float]:
        return {"speedup_step": bf16["denoise_s"] / timings["denoise_s"]}


class SpeedOnlySubject(DiffusersSubject):
    """A published architecture with random weights (module docstring), run in its own Euler loop."""

    def __init__(self, arch: pc.PublishedDenoiser, config: PipelineEvalConfig, dev: torch.device):
        super().__init__(config, dev)
        self.arch = arch
        self.size = dict(height=config.height or arch.height, width=config.width or arch.width,
                         frames=(config.frames or arch.frames) if arch.frames is not None else None)
        self.dtype = resolve_dtype(config.dtype)

    def check_size(self) -> None:
        """The size the architecture takes, and on the CPU a size the reference emulation can run, before it
        is built."""
        try:
            pc.check_size(self.arch, **self.size)
        except ValueError as e:
            raise UsageError(str(e)) from None
        self.tokens = pc.tokens(self.arch, **self.size)
        if self.dev.type == "cpu":
            check_cpu_size(f"speed-only {self.config.speed_only} on the CPU", self.tokens,
                           height=self.size["height"], width=self.size["width"], frames=self.size["frames"] or 1)

    def describe(self) -> str:
        return f"{self.arch.title} architecture, random weights (speed only), {self.config.steps} steps"

    def load(self) -> None:
        self.module = pc.build_denoiser(self.arch, device=self.dev, dtype=self.dtype, seed=self.config.seed)
        arch = self.arch
        texts = [pc.random_text(arch, seed=self.config.seed + i, device=self.dev, dtype=self.dtype)
                 for i in range(2 if arch.guidance_batched else arch.calls_per_step)]
        # one call of batch 2: the negative's text first, as the pipeline stacks them
        self.text = [pc.stack_text(texts[::-1])] if arch.guidance_batched else texts
        self.generation_inputs = pc.generation_inputs(arch, **self.size, device=self.dev)
        g = torch.Generator().manual_seed(self.config.seed)
        self.latents = torch.randn(pc.latent_shape(arch, **self.size), generator=g)

    def compile(self, mode: str) -> None:
        compile_transformers(SimpleNamespace(transformer=self.module), mode)

    def transformers(self) -> list[torch.nn.Module]:
        return [self.module]

    def fields(self) -> dict[str, Any]:
        arch, c = self.arch, self.config
        return {"model": f"{arch.title} architecture", "pipeline": None,
                "guidance_scale": arch.guidance if c.guidance_scale is None else c.guidance_scale,
                "architecture": {"name": c.speed_only, "class": arch.class_name, "source": arch.source,
                                 "config": arch.config, "text_tokens": arch.text_tokens,
                                 "text_mask": arch.prompt_tokens is not None, "prompt_tokens": arch.prompt_tokens,
                                 "calls_per_step": arch.calls_per_step,
                                 "batch_per_call": 2 if arch.guidance_batched else 1, "notes": list(arch.notes)}}

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
                    if self.arch.guidance_batched:
                        xin = torch.cat([xin, xin])
                    out = [self.module(**pc.denoiser_inputs(self.arch, xin, sigmas[i], text, **hw),
                                       **self.generation_inputs)[0].float() for text in self.text]
                    if self.arch.guidance_batched:   # (negative, prompt) halves into the two calls' order
                        out = list(out[0].chunk(2))[::-1]
                    # classifier-free guidance: the first output is the prompt's, the second the negative's
                    v = out[0] if len(out) == 1 else out[1] + guidance * (out[0] - out[1])
                    x = x + (sigmas[i + 1] - sigmas[i]) * v
                    _sync(self.dev)
                times.append(t.seconds)
        return RunOutput(x.float().cpu(), None, times, total.seconds)


class PipelineSubject(DiffusersSubject):
    """A diffusers pipeline, called as a user calls it (module docstring)."""

    def describe(self) -> str:
        return f"{self.config.model}, {self.config.steps} steps"

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
        if "num_frames" not in self.params:   # an image model
            self.size["frames"] = None

    def compile(self, mode: str) -> None:
        if getattr(self.module, "transformer", None) is None:
            raise UsageError(f"--compile: {type(self.module).__name__} has no transformer to compile")
        compile_transformers(self.module, mode)

    def fields(self) -> dict[str, Any]:
        return {"model": display_source(self.config.model), "pipeline": type(self.module).__name__}

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


def calls_text(arch: dict[str, Any]) -> str:
    """The transformer calls a step makes, as a report's ``architecture`` field gives them."""
    calls, batch = arch["calls_per_step"], arch.get("batch_per_call", 1)   # a report without it: batch 1
    if batch == 1:
        return f"{calls} transformer call(s)"
    return (f"{calls} transformer call{'' if calls == 1 else 's'} of batch {batch} (classifier-free guidance: the "
            "negative's and the prompt's halves)")


def pipeline_markdown(r: dict[str, Any]) -> str:
    """The generic configuration's Markdown report."""
    warn = ("\n**Random weights (speed only)**: the published architecture with seeded random weights, random "
            "latents and text conditioning of the published shapes; no checkpoint was loaded. Timings are real; the "
            "fidelity columns describe random weights and say nothing about output quality.\n"
            if r["random_weights"] else "")
    size = f"{r['width']}x{r['height']}" if r.get("width") else "the pipeline's default size"
    frames = f", {r['frames']} frames" if r.get("frames") else ""
    toks = f" ({r['tokens']} tokens per sequence)" if r.get("tokens") else ""
    lines = [f"# FP4 attention in a diffusers pipeline: {r['model']}", warn + timed_runs.partial_note(r),
             f"{size}{frames}{toks}, {r['steps']} steps, guidance {fmt(r['guidance_scale'])}, seed {r['seed']}, "
             f"{r['dtype']}, backend `{r['backend']}`{timed_runs.compiled_note(r.get('compile'))}; same seed for "
             f"every run; {'an untimed warm-up before each run' if r['warmup'] else 'no warm-up'}.", ""]
    arch = r.get("architecture")
    if arch:
        mask = (f"a padding mask ({arch['prompt_tokens']} prompt tokens)" if arch["text_mask"] else "no mask")
        lines += [f"Architecture: `{arch['class']}` from {arch['source']}; text of {arch['text_tokens']} tokens, "
                  f"{mask}; {calls_text(arch)} per step. "
                  + " ".join(n[0].upper() + n[1:] + "." for n in arch["notes"]), ""]
    emulated = reference_timed(r)

    def cells(run: dict[str, Any]) -> list[Any]:
        s, f, cos = run["step_s"], run.get("frames") or {}, run.get("latent_cosine")
        ci = "n/a" if s["ci95_low"] is None else f"{fmt(s['ci95_low'])} – {fmt(s['ci95_high'])}"
        return [s["mean"], ci, run["timings"]["total_s"], *([] if emulated else [run.get("speedup_step")]),
                None if cos is None else fmt(cos, 6), run.get("latent_rel_l2"), f.get("psnr_mean"), f.get("ssim_mean")]

    lines += timed_runs.runs_table(r, ["run", "per step (s)", "95 % interval", "call (s)",
                                       *([] if emulated else ["speedup per step"]), "latent cosine", "latent relL2",
                                       "PSNR vs BF16 (dB)", "SSIM vs BF16"], cells)
    how = ("each step's wall time, device synchronised (the transformer's calls, guidance, the Euler update)"
           if r["random_weights"] else "the intervals between consecutive step ends (callback_on_step_end, device "
           "synchronised: steps 2..n, each a whole denoising step)")
    call = ("the loop's wall time" if r["random_weights"] else "the pipeline call's wall time (text encoding, "
            "denoising, decode)")
    lines += ["", f"Per step: the mean of {how}, with its 95 % t-interval; call: {call}. Latent cosine / relL2: the "
              "final latents against BF16's. PSNR/SSIM: per frame or image (torchmetrics, [0, 1] RGB, data_range "
              "1.0), mean."]
    lines += timed_runs.baselines_markdown(r, f"{BASELINE_LAYER_TEXT}; a call with a key-padding mask (text padding) "
                                           "goes to flash-attn-4 with its mask and keeps the model's attention under "
                                           "the other libraries (they take no mask)", "the mean step")
    return "\n".join(lines + timed_runs.peak_memory_lines(r))
