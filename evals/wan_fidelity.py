"""Wan2.1 fidelity and speed (``fp4vis eval wan``): the Wan configuration of the pipeline eval, whose run loop
(BF16, the BF16 attention baselines, the policies; warm-up, seeds, timing, speedups, comparison with BF16, the
report) is ``fp4vis.evals.timed_runs.run_eval``. What is Wan's:

* the pipeline: ``fp4vis.pipelines.wan_video`` loads it (a Hub id, a local folder, a shipped name) or, in
  speed-only mode (``speed_only="1.3B"`` or ``"14B"``), builds the real Wan2.1 architecture with seeded RANDOM
  weights and random prompt embeddings (nothing is downloaded; the report says so: the timings are real, the
  fidelity numbers describe random weights only). Its size is checked against the model's configs before any
  weights load (on the CPU, a GPU's size is refused there).
* the runs share the prompt embeddings (the prompt is encoded once, ``text_encode_s``) and the initial
  latents; each is a ``generate`` call (which applies the policy, with a guard plan's exact steps), timing the
  denoising loop (the transformer, where attention is) and the VAE decode apart. End-to-end time = text
  encoding + denoising + decode; ``speedup_denoise`` and ``speedup_end_to_end`` are BF16 time / run time, and
  the per-frame PSNR/SSIM of the decoded video is ``video``.
* ``latent_steps=(1, 4)``: the latent cosine and relative L2 after those numbers of steps too (as the method's
  authors report them); ``operator_error=True``: the BF16 run also measures each policy's operator error
  (``OperatorError``: at the end of every denoising step each self-attention layer is re-run under the policy
  on the inputs it saw in that step's last transformer call, its output's relative L2 against the BF16 output
  averaged over steps and layers); ``save_videos``: each run's MP4.
* a baseline runs ``attn1=<name>``: the library as the attention of every self-attention layer (``attn1``;
  cross-attention stays diffusers' default), in the Wan processor's layout (bshd).
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass, replace
from typing import Any

import torch

from fp4vis.evals import timed_runs
from fp4vis.evals.baselines import BASELINES
from fp4vis.evals.common import AttentionRecorder, error_metrics, reference_timed
from fp4vis.evals.report import fmt, markdown_table
from fp4vis.evals.timed_runs import DiffusionEvalConfig, EvalSubject, RunOutcome, ScheduledRun, run_eval
from fp4vis.pipelines.compile import compile_transformers
from fp4vis.pipelines.media_files import mp4_unavailable, save_mp4
from fp4vis.pipelines.wan_sizes import WAN_TRANSFORMER_CONFIGS, WanGeometry, check_cpu_size, wan_geometry
from fp4vis.pipelines.wan_video import (
    GenerationConfig,
    GenerationResult,
    build_random_wan_pipeline,
    encode_prompt,
    generate,
    initial_latents,
    load_wan_pipeline,
    random_prompt_embeds,
)
from fp4vis.services.policies import policy_applied
from fp4vis.services.sources import display_source
from fp4vis.services.timing import Timer
from fp4vis.services.usage import UsageError

BASELINE_LAYERS = "attn1"   # the layers a baseline replaces: self-attention, where a video model's time goes


class OperatorError:
    """A ``callback_on_step_end`` for the BF16 run: at the end of every denoising step, each
    self-attention layer (``attn1``) is re-run under every policy on the inputs it saw in that step's
    last transformer call, and the relative L2 of its output against the BF16 output is kept. Use it
    with its recorder active around the run: ``with cb.recorder: generate(..., callbacks=(cb,))``."""

    tensor_inputs = ["latents"]

    def __init__(self, pipe, policies: list[Any], *, guard: Any = None, backend: str = "auto",
                 steps: tuple[int, ...] | None = None):
        """``steps``: after which numbers of steps to measure (1 = the first); None: after every step."""
        self.pipe, self.policies, self.guard, self.backend = pipe, policies, guard, backend
        self.steps = None if steps is None else set(steps)
        self.recorder = AttentionRecorder(pipe.transformer, select=lambda name: name.endswith("attn1"))
        self.errors: dict[str, dict[str, list[float]]] = {p.name: {} for p in policies}
        self.seconds = 0.0   # spent in the re-runs: not part of the BF16 run's denoising time
        self._rel_l2 = error_metrics()[1]

    def __call__(self, pipeline, step_index: int, timestep, callback_kwargs: dict[str, Any]) -> dict[str, Any]:
        if self.steps is not None and step_index + 1 not in self.steps:
            return callback_kwargs
        with Timer() as t:
            for pol in self.policies:
                with policy_applied(self.pipe, pol, guard=self.guard, backend=self.backend):
                    rerun = self.recorder.rerun()
                for layer, (new, ref) in rerun.items():
                    self.errors[pol.name].setdefault(layer, []).append(float(self._rel_l2(new.float(), ref.float())))
        self.seconds += t.seconds
        return callback_kwargs

    def summary(self) -> dict[str, dict[str, Any]]:
        """Per policy: the mean over steps per layer, and its mean over layers."""
        out = {}
        for name, layers in self.errors.items():
            per_layer = {k: sum(v) / len(v) for k, v in layers.items()}
            out[name] = {"rel_l2_mean_per_layer": per_layer,
                         "rel_l2_mean": sum(per_layer.values()) / len(per_layer) if per_layer else None,
                         "steps": max((len(v) for v in layers.values()), default=0)}
        return out


@dataclass(frozen=True)
class WanEvalConfig(DiffusionEvalConfig):
    """What ``run_wan_eval`` runs (the CLI builds it from ``fp4vis eval wan``'s options; ``DiffusionEvalConfig``'s
    options, Wan2.1's defaults): a ``model`` (Hub id, local diffusers folder, shipped name) or ``speed_only``
    (``"1.3B"``, ``"14B"``: that architecture with random weights, module docstring); ``decode`` None: decode
    with a model, not in speed-only mode; ``latent_steps``: latent metrics after these numbers of steps too;
    ``operator_error``: see the module docstring (after every step, or after ``operator_error_steps``);
    ``save_videos``: each run's MP4 at ``fps`` in ``out_dir``; ``name`` None: wan_fidelity, or wan_speed in
    speed-only mode. The runs go on one process (no ``cp``)."""

    policies: str | list[str] = "wan_fast,fast,accurate"
    height: int = 480
    width: int = 832
    frames: int = 81
    guidance_scale: float = 5.0
    save_videos: bool = False
    latent_steps: tuple[int, ...] = ()
    operator_error: bool = False
    operator_error_steps: tuple[int, ...] | None = None
    fps: int = 16

    def architectures(self) -> Mapping[str, Any]:
        return WAN_TRANSFORMER_CONFIGS

    def check(self) -> None:
        if self.cp is not None:
            raise UsageError("cp: the Wan configuration runs on one process (eval pipeline --model runs a Wan "
                             "pipeline under context parallelism)")

    def subject(self, device: torch.device, policies: list[Any], plan: Any) -> EvalSubject:
        return WanSubject(self, device, policies, plan)


def run_wan_eval(config: WanEvalConfig, *, say: Callable[[str], Any] | None = None,
                 frames_sink: dict[str, Any] | None = None) -> dict[str, Any]:
    """The pipeline eval's Wan configuration (``fp4vis.evals.timed_runs.run_eval``): BF16, the BF16 baselines and
    every policy of ``config``; returns the result dict, and writes JSON/Markdown to ``config.out_dir``. ``say``:
    told what the eval runs once its options are checked (the CLI's header); ``frames_sink``: a dict that
    receives each run's decoded frames, by run name."""
    return run_eval(config, say=say, frames_sink=frames_sink)


class WanSubject(EvalSubject):
    """A Wan2.1 pipeline, loaded or built with random weights, its runs ``generate`` calls that share one
    prompt encoding and the initial latents (module docstring)."""

    eval_name = "wan_fidelity"
    command = "eval wan"
    report_names = ("wan_fidelity", "wan_speed")
    baseline_layers = BASELINE_LAYERS
    baseline_select = f"*{BASELINE_LAYERS}"
    baseline_layer_text = BASELINE_LAYERS
    frames_key = "video"

    def __init__(self, config: WanEvalConfig, device: torch.device, policies: list[Any], plan: Any):
        super().__init__(config, device)
        self.policies, self.plan = policies, plan
        c = config
        if device.type == "cpu":   # before any weights: from the configs alone
            geometry = WanGeometry.of_size(c.speed_only) if c.speed_only else wan_geometry(c.model)
            what = f"speed-only {c.speed_only}" if c.speed_only else c.model
            check_cpu_size(f"{what} on the CPU", geometry.tokens(**self.size), **self.size)
        self.latent_steps = sorted({int(k) for k in c.latent_steps if 0 < int(k) < c.steps} | {c.steps})
        self.keep = tuple(k for k in self.latent_steps if k < c.steps)
        self.mp4_skip = mp4_unavailable() if c.save_videos and self.decode and c.out_dir is not None else None
        self.cosine, self.rel_l2 = error_metrics()

    def describe(self) -> str:
        c = self.config
        what = (f"Wan2.1-T2V-{c.speed_only} architecture, random weights (speed only)" if c.speed_only else c.model)
        return f"{what}, {c.width}x{c.height}, {c.frames} frames, {c.steps} steps, guidance {c.guidance_scale}"

    def load(self) -> None:
        c, dev = self.config, self.dev
        self.text_s, self.prompt = 0.0, None
        if c.speed_only is not None:
            pipe = build_random_wan_pipeline(c.speed_only, device=dev, dtype=c.dtype, seed=c.seed, vae=self.decode)
            pe, npe = random_prompt_embeds(c.seed)
        else:
            pipe = load_wan_pipeline(c.model, device=dev, dtype=c.dtype)
            if getattr(pipe, "text_encoder", None) is not None:
                pe, npe, self.text_s = encode_prompt(pipe, c.prompt, c.negative_prompt,
                                                     guidance_scale=c.guidance_scale)
                self.prompt = c.prompt
            else:  # a pipeline saved without its text encoder: seeded embeddings of the right width
                pe, npe = random_prompt_embeds(c.seed, dim=pipe.transformer.config.text_dim, length=64)
        self.module = pipe
        self.tokens = WanGeometry.of_pipeline(pipe).tokens(**self.size)
        latents = initial_latents(pipe, **self.size, seed=c.seed)
        self.latent_frames = int(latents.shape[2])
        # what every run's generation shares: the prompt embeddings, the initial latents, the size and schedule
        self.shared = GenerationConfig(prompt_embeds=pe, negative_prompt_embeds=npe, **self.size, steps=c.steps,
                                       guidance_scale=c.guidance_scale, seed=c.seed, backend=c.backend,
                                       progress=c.progress, latents=latents, decode=self.decode)
        self.op_error = (OperatorError(pipe, self.policies, guard=self.plan, backend=c.backend,
                                       steps=c.operator_error_steps) if c.operator_error else None)

    def compile(self, mode: str) -> None:
        compile_transformers(self.module, mode)

    def policy_block(self, run: ScheduledRun) -> AbstractContextManager:
        return nullcontext()   # generate applies the policy, and a guard plan's exact steps with it

    def baseline_label(self, baseline: str) -> str:
        return f"{BASELINES[baseline].label} in {BASELINE_LAYERS}"

    def execute(self, run: ScheduledRun, label: str, warmup: bool) -> GenerationResult:
        if warmup:
            return generate(self.module, replace(self.shared, policy=run.policy, guard=run.guard, steps=1,
                                                 decode=False, label=label))
        timed = replace(self.shared, policy=run.policy, guard=run.guard, latents_after=self.keep, label=label)
        if run.name == "bf16" and self.op_error is not None:
            with self.op_error.recorder:
                return generate(self.module, replace(timed, callbacks=(self.op_error,)))
        return generate(self.module, timed)

    def fields(self) -> dict[str, Any]:
        c, cfg = self.config, self.module.transformer.config
        fields: dict[str, Any] = {
            "model": display_source(c.model) if c.model else f"Wan2.1-T2V-{c.speed_only} architecture",
            "prompt": self.prompt, "negative_prompt": c.negative_prompt, "latent_frames": self.latent_frames,
            "dtype": str(self.module.transformer.dtype).replace("torch.", ""),
            "transformer": {"num_layers": cfg.num_layers, "num_attention_heads": cfg.num_attention_heads,
                            "attention_head_dim": cfg.attention_head_dim, "ffn_dim": cfg.ffn_dim},
            "latent_steps": self.latent_steps}
        if self.mp4_skip:
            fields["mp4_skipped"] = self.mp4_skip
            fields["warnings"] = [f"MP4 clips not written: {self.mp4_skip}"]
        try:
            import fp4vis

            fields["backends_available"] = fp4vis.available_backends()
        except Exception as e:  # informational only
            fields["backends_available"] = {"error": str(e)}
        return fields

    def timings(self, outcome: RunOutcome) -> dict[str, Any]:
        t = dict(outcome.output.timings)
        if outcome.run.name == "bf16" and self.op_error is not None:   # the re-runs ran inside the timed BF16 loop
            t["denoise_s"] -= self.op_error.seconds
            t["operator_error_s"] = self.op_error.seconds
        t["text_encode_s"] = self.text_s
        t["total_s"] = self.text_s + t["denoise_s"] + t["decode_s"]
        t["warmup_s"] = outcome.warmup_s
        return {"timings": t, "step_s": t["denoise_s"] / self.config.steps}

    def speedups(self, timings: dict[str, Any], bf16: dict[str, Any]) -> dict[str, float]:
        return {"speedup_denoise": bf16["denoise_s"] / timings["denoise_s"],
                "speedup_end_to_end": bf16["total_s"] / timings["total_s"]}

    def extras(self, outcome: RunOutcome, reference: GenerationResult | None) -> dict[str, Any]:
        c, res, name = self.config, outcome.output, outcome.run.name
        out: dict[str, Any] = {}
        if reference is not None:
            after = {**{k: (res.step_latents[k], reference.step_latents[k]) for k in self.keep},
                     c.steps: (res.latents, reference.latents)}
            out["latents_after_steps"] = [{"steps": k, "cosine": self.cosine(a, b), "rel_l2": self.rel_l2(a, b)}
                                          for k, (a, b) in after.items()]
            if self.op_error is not None and name in self.op_error.errors:
                out["attention_rel_l2"] = self.op_error.summary()[name]
        if c.save_videos and self.decode and c.out_dir is not None and not self.mp4_skip:
            clip = os.path.join(c.out_dir, f"{self.report_name()}_{name.replace('=', '-')}.mp4")
            out["mp4"] = str(save_mp4(res.frames, clip, fps=c.fps))
        return out

    @staticmethod
    def markdown(result: dict[str, Any]) -> str:
        return wan_markdown(result)


def wan_markdown(r: dict[str, Any]) -> str:
    """The Wan configuration's Markdown report."""
    warn = ("\n**Random weights (speed only)**: the real Wan2.1 architecture with seeded random weights and "
            "random prompt embeddings; no checkpoint was loaded. Timings are real; the fidelity columns "
            "describe random weights and say nothing about video quality.\n" if r["random_weights"] else "")
    lines = [f"# Wan2.1 fidelity and speed: {r['model']}", warn + timed_runs.partial_note(r),
             f"{r['width']}x{r['height']}, {r['frames']} frames ({r['latent_frames']} latent frames, {r['tokens']} "
             f"tokens per self-attention), {r['steps']} steps, guidance {r['guidance_scale']}, seed {r['seed']}, "
             f"{r['dtype']} transformer, backend `{r['backend']}`{timed_runs.compiled_note(r.get('compile'))}; same "
             f"seed, latents and prompt embeddings for every run; "
             f"{'warm-up run before each timed run' if r['warmup'] else 'no warm-up'}.", ""]
    emulated = reference_timed(r)

    def cells(run: dict[str, Any]) -> list[Any]:
        t, v = run["timings"], run.get("video") or {}
        speed = [] if emulated else [run.get("speedup_denoise"), run.get("speedup_end_to_end")]
        return [t["denoise_s"], run["step_s"], t["decode_s"] if r["decode"] else None, t["total_s"], *speed,
                run.get("latent_cosine"), run.get("latent_rel_l2"), v.get("psnr_mean"), v.get("ssim_mean")]

    lines += timed_runs.runs_table(r, ["run", "denoise (s)", "per step (s)", "VAE decode (s)", "end-to-end (s)",
                                       *([] if emulated else ["speedup (denoise)", "speedup (e2e)"]),
                                       "latent cosine", "latent relL2", "PSNR vs BF16 (dB)", "SSIM vs BF16"], cells)
    lines += timed_runs.baselines_markdown(r, f"every `{BASELINE_LAYERS}` layer (self-attention; cross-attention "
                                           "stays diffusers' default), diffusers' math around it",
                                           "the denoising loop (per step: the same ratio)")
    steps_rows = [[name] + [f"{fmt(a['cosine'], 6)} / {fmt(a['rel_l2'], 4)}" for a in run["latents_after_steps"]]
                  for name, run in r["runs"].items() if "latents_after_steps" in run]
    if steps_rows and len(r.get("latent_steps", [])) > 1:
        lines += ["", "Latent cosine / relL2 against BF16 after k denoising steps (same initial noise):", "",
                  markdown_table(["run"] + [f"after {k} step{'s' if k > 1 else ''}" for k in r["latent_steps"]],
                                 steps_rows)]
    op_rows = [[name, run["attention_rel_l2"]["rel_l2_mean"], run["attention_rel_l2"]["steps"]]
               for name, run in r["runs"].items() if "attention_rel_l2" in run]
    if op_rows:
        lines += ["", "Operator error: each self-attention layer re-run under the policy on the inputs of the BF16 "
                  "run's last transformer call of a step; relL2 against its BF16 output, mean over the steps measured "
                  "and the layers.", "", markdown_table(["policy", "self-attention relL2", "steps measured"], op_rows)]
    text = next(iter(r["runs"].values()))["timings"]["text_encode_s"]
    lines += timed_runs.peak_memory_lines(r)
    lines += ["", f"Text encoding (once, shared by all runs): {text:.3f} s. End-to-end = text encoding + denoising "
              "+ VAE decode. PSNR/SSIM: per frame (torchmetrics, [0, 1] RGB, data_range 1.0), then the mean over "
              "frames. Denoising time: the wall time of the pipeline's loop, every run measured the same way "
              "(launches back to back, one wait at the end, and for fp4vis' kernels one per transformer forward "
              "for the range check); at Wan2.1's own sizes a step is seconds of GPU work, which host overhead "
              "does not change."]
    return "\n".join(lines)
