"""Wan2.1 fidelity and speed: what FP4 attention costs a video model and what it gains.

The BF16 baseline (the pipeline's own attention) and every policy run with the SAME seed, initial
latents and prompt embeddings (the prompt is encoded once). For each run we time, separately, the
denoising loop (the transformer, where attention is) and the VAE decode; the text encoding is timed
once. End-to-end time = text encoding + denoising + decode. Speedups are BF16 time / policy time.
Against BF16 we report the latent cosine and relative L2 (``fp4vis.metrics``) after all steps and,
with ``latent_steps=(1, 4)``, after those numbers of steps too (as the method's authors report them);
when the video is decoded, per-frame PSNR and SSIM (torchmetrics, frames in [0, 1], data_range
1.0). With ``operator_error=True`` the BF16 run also measures each policy's operator error: at the end
of every denoising step each self-attention layer is re-run under the policy on the inputs it saw in
that step's last transformer call, and its output's relative L2 against the BF16 output is averaged
over steps and layers.

BF16 attention baselines (``baselines``): besides BF16 (diffusers' default attention, the reference of
every metric), each baseline runs as a policy does (same warm-up, seed, latents, prompt embeddings and
timing) with a BF16 attention library as the attention of every self-attention layer (``attn1``), through
``fp4vis.patching.attention_function.attention_function_applied``: ``fa4 (flash-attn-4, what a user who wants speed
switches to) and ``sage`` (SageAttention), from ``fp4vis.evals.baselines``; run ``attn1=<name>``, after
BF16 and before the policies. ``"auto"`` (the default) runs those of them that can run here and records
why the others were skipped (``baselines_skipped``; on the CPU: all). Every run carries ``speedup_vs``,
its denoising-loop speedup (per step the same ratio) against BF16 and against every baseline that ran.

Speed-only mode (``speed_only="1.3B"`` or ``"14B"``) builds the real Wan2.1 architecture with seeded
RANDOM weights and random prompt embeddings (nothing is downloaded; the report says so): the timings
are real, the fidelity numbers describe random weights only. A warm-up generation (1 step, not
timed) precedes each timed run so that kernel compilation is not counted.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass, replace
from typing import Any

from fp4vis.evals.baselines import BASELINES, attention_function, run_name, select_baselines
from fp4vis.evals.common import AttentionRecorder, error_metrics, frame_metrics, reference_timed
from fp4vis.evals.report import fmt, markdown_table, report_writer
from fp4vis.evals.timed_runs import (
    LoopSettings,
    RunOutcome,
    ScheduledRun,
    bf16_baselines_policies,
    run_schedule,
    speedups_markdown,
)
from fp4vis.patching.attention_function import attention_function_applied
from fp4vis.pipelines.compile import compile_transformers
from fp4vis.pipelines.media_files import mp4_unavailable, save_mp4
from fp4vis.pipelines.wan_sizes import WAN_TRANSFORMER_CONFIGS, check_cpu_size, tokens_per_frame_sequence, wan_tokens
from fp4vis.pipelines.wan_video import (
    GenerationConfig,
    build_random_wan_pipeline,
    encode_prompt,
    generate,
    initial_latents,
    load_wan_pipeline,
    random_prompt_embeds,
)
from fp4vis.services.environment import environment
from fp4vis.services.guard_plans import guard_plan_summary, load_guard_plan, plan_for
from fp4vis.services.policies import attention_label, backend_in_use, check_backend, policy_applied, resolve_policies
from fp4vis.services.runtime import COMPILE_MODES, resolve_device
from fp4vis.services.sources import display_source
from fp4vis.services.timing import Timer
from fp4vis.services.usage import UsageError

DEFAULT_PROMPT = "A red fox trotting through fresh snow in a birch forest, morning light, cinematic"
BASELINE_LAYERS = "attn1"   # the layers a baseline replaces: self-attention, where a video model's time goes


def baseline_run(name: str) -> str:
    """The run name of BF16 baseline ``name``: ``attn1=fa4``."""
    return run_name(name, BASELINE_LAYERS)


def baseline_attention(pipe, baseline: str | None) -> AbstractContextManager:
    """The block of a run: ``baseline``'s attention in the ``attn1`` layers (the Wan processor's layout, bshd),
    or the model as it is (None)."""
    if baseline is None:
        return nullcontext()
    return attention_function_applied(pipe, {"bshd": attention_function(baseline, "bshd")},
                                      select=f"*{BASELINE_LAYERS}")


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
class WanEvalConfig:
    """What ``run_wan_eval`` runs (the CLI builds it from ``fp4vis eval wan``'s options): a ``model`` (Hub id,
    local diffusers folder, shipped name) or ``speed_only`` (``"1.3B"``, ``"14B"``: that architecture with
    random weights, module docstring), the FP4 ``policies``, the BF16 attention ``baselines`` ("auto", "none"
    (or "" / None), or names: ``fp4vis.evals.baselines.select_baselines``; one that cannot run here is a
    UsageError), the prompt, size and schedule every run shares, and the runtime. ``decode`` None: decode
    with a model, not in speed-only mode; ``latent_steps``: latent metrics after these numbers of steps too;
    ``operator_error``: see the module docstring (after every step, or after ``operator_error_steps``);
    ``compile``: every run with the transformer compiled (``compile_transformers``: "regional" or "full"),
    each compiled afresh in its warm-up, whose time (``warmup_s``) the run reports apart; ``out_dir``: where
    ``name``.json / .md go (and with ``save_videos`` each run's MP4 at ``fps``); ``name`` None: wan_fidelity,
    or wan_speed in speed-only mode."""

    model: str | None = None
    speed_only: str | None = None
    policies: str | list[str] = "wan_fast,fast,accurate"
    prompt: str = DEFAULT_PROMPT
    negative_prompt: str | None = None
    height: int = 480
    width: int = 832
    frames: int = 81
    steps: int = 10
    guidance_scale: float = 5.0
    seed: int = 0
    device: str = "auto"
    dtype: str = "bfloat16"
    backend: str = "auto"
    guard_plan: str | None = None
    decode: bool | None = None
    warmup: bool = True
    save_videos: bool = False
    out_dir: str | os.PathLike | None = None
    name: str | None = None
    progress: bool = True
    latent_steps: tuple[int, ...] = ()
    operator_error: bool = False
    operator_error_steps: tuple[int, ...] | None = None
    fps: int = 16
    baselines: str | list[str] | None = "auto"
    compile: str | None = None


def run_wan_eval(config: WanEvalConfig, *, say: Callable[[str], Any] | None = None,
                 frames_sink: dict[str, Any] | None = None) -> dict[str, Any]:
    """Run BF16, the BF16 baselines and every policy of ``config`` (``WanEvalConfig``); returns the result
    dict, and writes JSON/Markdown to ``config.out_dir``. ``say``: told what the eval runs once its options
    are checked (the CLI's header); ``frames_sink``: a dict that receives each run's decoded frames, by run
    name."""
    if (config.model is None) == (config.speed_only is None):
        raise UsageError("give either a model (Hub id or local path) or speed_only='1.3B' / '14B'")
    if config.compile is not None and config.compile not in COMPILE_MODES:
        raise UsageError(f"compile: must be one of {', '.join(COMPILE_MODES)}, got {config.compile!r}")
    if config.compile is not None and not config.warmup:
        raise UsageError("compile: needs the warm-up run (each run compiles there, outside its timing)")
    dev = resolve_device(config.device)
    check_backend(config.backend, dev)
    pols = resolve_policies(config.policies, allow_bf16=False)
    baseline_names, baselines_skipped = select_baselines(config.baselines, dev)
    plan = load_guard_plan(config.guard_plan)
    cosine, rel_l2 = error_metrics()
    random_weights = config.speed_only is not None
    decode = not random_weights if config.decode is None else config.decode
    text_s = 0.0
    size = dict(height=config.height, width=config.width, frames=config.frames)
    if random_weights and dev.type == "cpu" and config.speed_only in WAN_TRANSFORMER_CONFIGS:   # before building it
        check_cpu_size(f"speed-only {config.speed_only} on the CPU", wan_tokens(config.speed_only, **size), **size)
    what = (f"Wan2.1-T2V-{config.speed_only} architecture, random weights (speed only)" if random_weights
            else config.model)
    bf16_runs = ", ".join(["bf16 (the model's attention)"] + [baseline_run(b) for b in baseline_names])
    header = (f"eval wan: {what}, {config.width}x{config.height}, {config.frames} frames, {config.steps} steps, "
              f"guidance {config.guidance_scale}; runs {bf16_runs}, then {', '.join(p.name for p in pols)} on the "
              f"{backend_in_use(config.backend, dev)} backend"
              + (f"; every run compiled ({config.compile}, fullgraph), in its warm-up" if config.compile else ""))
    if random_weights:
        if say is not None:
            say(header)
        pipe = build_random_wan_pipeline(config.speed_only, device=dev, dtype=config.dtype, seed=config.seed,
                                         vae=decode)
        pe, npe = random_prompt_embeds(config.seed)
        prompt_used = None
    else:
        pipe = load_wan_pipeline(config.model, device=dev, dtype=config.dtype)
        prompt = config.prompt
        if getattr(pipe, "text_encoder", None) is not None:
            pe, npe, text_s = encode_prompt(pipe, prompt, config.negative_prompt,
                                            guidance_scale=config.guidance_scale)
        else:  # a pipeline saved without its text encoder: seeded embeddings of the right width
            dim = pipe.transformer.config.text_dim
            pe, npe = random_prompt_embeds(config.seed, dim=dim, length=64)
            prompt = None
        prompt_used = prompt
    if config.compile is not None:
        compile_transformers(pipe, config.compile)
    latents = initial_latents(pipe, **size, seed=config.seed)
    tokens = tokens_per_frame_sequence(pipe, **size)
    if dev.type == "cpu":
        check_cpu_size(f"{config.model or config.speed_only} on the CPU", tokens, **size)
    if say is not None and not random_weights:
        say(header)
    # what every run's generation shares: the prompt embeddings, the initial latents, the size and schedule
    shared = GenerationConfig(prompt_embeds=pe, negative_prompt_embeds=npe, **size, steps=config.steps,
                              guidance_scale=config.guidance_scale, seed=config.seed, backend=config.backend,
                              progress=config.progress, latents=latents, decode=decode)

    runs: dict[str, Any] = {}
    cfg = pipe.transformer.config
    result: dict[str, Any] = {
        "eval": "wan_fidelity", "mode": "speed_only" if random_weights else "fidelity",
        "model": display_source(config.model) if config.model else f"Wan2.1-T2V-{config.speed_only} architecture",
        "random_weights": random_weights,
        "prompt": prompt_used, "negative_prompt": config.negative_prompt, **size,
        "latent_frames": int(latents.shape[2]), "tokens": tokens, "steps": config.steps,
        "guidance_scale": config.guidance_scale, "seed": config.seed,
        "dtype": str(pipe.transformer.dtype).replace("torch.", ""), "backend": config.backend, "device": dev.type,
        "decode": decode, "warmup": config.warmup, "compile": config.compile,
        "guard_plan": guard_plan_summary(plan),
        "transformer": {"num_layers": cfg.num_layers, "num_attention_heads": cfg.num_attention_heads,
                        "attention_head_dim": cfg.attention_head_dim, "ffn_dim": cfg.ffn_dim},
        "latent_steps": sorted({int(k) for k in config.latent_steps if 0 < int(k) < config.steps} | {config.steps}),
        "baselines": baseline_names, "baselines_skipped": baselines_skipped, "baseline_layers": BASELINE_LAYERS,
        "runs": runs, "complete": False, "warnings": [],
    }
    mp4_skip = mp4_unavailable() if config.save_videos and decode and config.out_dir is not None else None
    if mp4_skip:
        result["mp4_skipped"] = mp4_skip
        result["warnings"].append(f"MP4 clips not written: {mp4_skip}")
    op_error = (OperatorError(pipe, pols, guard=plan, backend=config.backend, steps=config.operator_error_steps)
                if config.operator_error else None)
    keep = tuple(k for k in result["latent_steps"] if k < config.steps)
    try:
        import fp4vis

        result["backends_available"] = fp4vis.available_backends()
    except Exception as e:  # informational only
        result["backends_available"] = {"error": str(e)}
    name = config.name or ("wan_speed" if random_weights else "wan_fidelity")

    write = report_writer(config.out_dir, name, result, wan_markdown)

    # what each run's bar says: the baseline in attn1, else the policy and its backend (generate's default)
    schedule, references = bf16_baselines_policies(
        pols, baseline_names, BASELINE_LAYERS, guard_for=lambda pol: plan_for(plan, pol),
        policy_label=lambda pol, guard: attention_label(pol, config.backend, dev, guard),
        baseline_label=lambda b: f"{BASELINES[b].label} in {BASELINE_LAYERS}")
    reference: dict[str, Any] = {}   # the BF16 run's generation

    def execute(run: ScheduledRun, warmup: bool):
        if warmup:
            return generate(pipe, replace(shared, policy=run.policy, guard=run.guard, steps=1, decode=False,
                                          label=f"{run.label}; warm-up, untimed"))
        timed = replace(shared, policy=run.policy, guard=run.guard, latents_after=keep, label=run.label)
        if run.name == "bf16" and op_error is not None:
            with op_error.recorder:
                return generate(pipe, replace(timed, callbacks=(op_error,)))
        return generate(pipe, timed)

    def record(outcome: RunOutcome) -> dict[str, Any]:
        run_key, baseline, res = outcome.run.name, outcome.run.baseline, outcome.output
        t = dict(res.timings)
        if run_key == "bf16" and op_error is not None:   # the re-runs ran inside the timed BF16 loop
            t["denoise_s"] -= op_error.seconds
            t["operator_error_s"] = op_error.seconds
        t["text_encode_s"] = text_s
        t["total_s"] = text_s + t["denoise_s"] + t["decode_s"]
        t["warmup_s"] = outcome.warmup_s
        run: dict[str, Any] = {"timings": t, "step_s": t["denoise_s"] / config.steps}
        if baseline is not None:
            run["baseline"] = {"name": baseline, "attention": BASELINES[baseline].description,
                               "layers": BASELINE_LAYERS}
        if outcome.peak_memory_gib is not None:
            run["peak_memory_gib"] = outcome.peak_memory_gib
        if run_key == "bf16":
            reference["res"] = res
        else:
            ref = reference["res"]
            rt = runs["bf16"]["timings"]
            run["speedup_denoise"] = rt["denoise_s"] / t["denoise_s"]
            run["speedup_end_to_end"] = rt["total_s"] / t["total_s"]
            run["latent_cosine"] = cosine(res.latents, ref.latents)
            run["latent_rel_l2"] = rel_l2(res.latents, ref.latents)
            after = {**{k: (res.step_latents[k], ref.step_latents[k]) for k in keep},
                     config.steps: (res.latents, ref.latents)}
            run["latents_after_steps"] = [{"steps": k, "cosine": cosine(a, b), "rel_l2": rel_l2(a, b)}
                                          for k, (a, b) in after.items()]
            if decode:
                run["video"] = frame_metrics(res.frames, ref.frames)
            if op_error is not None and run_key in op_error.errors:
                run["attention_rel_l2"] = op_error.summary()[run_key]
        if config.save_videos and decode and config.out_dir is not None and not mp4_skip:
            clip = os.path.join(config.out_dir, f"{name}_{run_key.replace('=', '-')}.mp4")
            run["mp4"] = str(save_mp4(res.frames, clip, fps=config.fps))
        if frames_sink is not None and res.frames is not None:
            frames_sink[run_key] = res.frames
        return run

    run_schedule(schedule, LoopSettings(config.warmup, config.compile is not None, dev, references), result,
                 execute=execute, context=lambda run: baseline_attention(pipe, run.baseline), record=record,
                 write=write)

    result["complete"] = True
    write()
    if config.out_dir is None:
        result["environment"] = environment()
    return result


def _compiled_note(mode: str | None) -> str:
    if mode is None:
        return ", eager (not compiled)"
    how = {"regional": "compile_repeated_blocks", "full": "compile"}[mode]
    return (f", **compiled** (`transformer.{how}(fullgraph=True)`, every run: the BF16 baselines too; each run "
            "compiles in its warm-up)")


def wan_markdown(r: dict[str, Any]) -> str:
    warn = ("\n**Random weights (speed only)**: the real Wan2.1 architecture with seeded random weights and "
            "random prompt embeddings; no checkpoint was loaded. Timings are real; the fidelity columns "
            "describe random weights and say nothing about video quality.\n" if r["random_weights"] else "")
    partial = ("" if r.get("complete", True) else
               "\n**Partial results**: the run was interrupted; only the runs listed below finished.\n")
    lines = [f"# Wan2.1 fidelity and speed: {r['model']}", warn + partial,
             f"{r['width']}x{r['height']}, {r['frames']} frames ({r['latent_frames']} latent frames, {r['tokens']} "
             f"tokens per self-attention), {r['steps']} steps, guidance {r['guidance_scale']}, seed {r['seed']}, "
             f"{r['dtype']} transformer, backend `{r['backend']}`{_compiled_note(r.get('compile'))}; same seed, "
             f"latents and prompt embeddings for every run; "
             f"{'warm-up run before each timed run' if r['warmup'] else 'no warm-up'}.", ""]
    emulated = reference_timed(r)
    rows = []
    for name, run in r["runs"].items():
        if "error" in run:
            rows.append([name, "failed: " + run["error"].splitlines()[0][:120]] + [None] * (7 if emulated else 9))
            continue
        t = run["timings"]
        v = run.get("video") or {}
        speed = [] if emulated else [run.get("speedup_denoise"), run.get("speedup_end_to_end")]
        rows.append([name, t["denoise_s"], run["step_s"], t["decode_s"] if r["decode"] else None, t["total_s"],
                     *speed, run.get("latent_cosine"), run.get("latent_rel_l2"), v.get("psnr_mean"),
                     v.get("ssim_mean")])
    lines.append(markdown_table(["run", "denoise (s)", "per step (s)", "VAE decode (s)", "end-to-end (s)",
                                 *([] if emulated else ["speedup (denoise)", "speedup (e2e)"]), "latent cosine",
                                 "latent relL2", "PSNR vs BF16 (dB)", "SSIM vs BF16"], rows))
    if emulated:
        lines += ["", "The FP4 runs ran the reference emulation (exact numerics, float64 element math on the "
                  f"{r.get('device', 'cpu').upper()}), not a kernel: their times say what the emulation costs, not "
                  "what FP4 attention gains, so no speedup is given."]
    lines += _baselines_markdown(r)
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
    mem = {n: run["peak_memory_gib"] for n, run in r["runs"].items() if "peak_memory_gib" in run}
    if mem:
        lines += ["", "Peak GPU memory (GiB): " + ", ".join(f"{n} {v:.1f}" for n, v in mem.items()) + "."]
    lines += ["", f"Text encoding (once, shared by all runs): {text:.3f} s. End-to-end = text encoding + denoising "
              "+ VAE decode. PSNR/SSIM: per frame (torchmetrics, [0, 1] RGB, data_range 1.0), then the mean over "
              "frames. Denoising time: the wall time of the pipeline's loop, every run measured the same way "
              "(launches back to back, one wait at the end, and for fp4vis' kernels one per transformer forward "
              "for the range check); at Wan2.1's own sizes a step is seconds of GPU work, which host overhead "
              "does not change."]
    return "\n".join(lines)


def _baselines_markdown(r: dict[str, Any]) -> list[str]:
    """What the BF16 baselines are, why any were skipped, and every run's denoising speedup against BF16
    and each baseline that ran (the table only where one ran: else it repeats the speedup column)."""
    ran = r.get("baselines") or []
    skipped = r.get("baselines_skipped") or {}
    if not ran and not skipped:
        return []
    layers = r.get("baseline_layers", BASELINE_LAYERS)
    lines = [""]
    if ran:
        what = "; ".join(f"`{baseline_run(b)}`: {BASELINES[b].description if b in BASELINES else b}" for b in ran)
        lines.append(f"BF16 baselines: a BF16 attention library as the attention of every `{layers}` layer "
                     f"(self-attention; cross-attention stays diffusers' default), diffusers' math around it: "
                     f"{what}. `bf16` is diffusers' default attention, the reference of every fidelity column.")
    if skipped:
        lines.append("Baselines skipped: " + "; ".join(f"`{b}` ({why})" for b, why in skipped.items()) + ".")
    refs = ["bf16"] + [baseline_run(b) for b in ran]
    return lines + speedups_markdown(r["runs"], refs, "the denoising loop (per step: the same ratio)")
