"""``fp4vis generate`` and ``fp4vis calibrate pipeline`` for any diffusers text-to-image or text-to-video pipeline;
Wan2.1's own (``WAN_PIPELINES``) are served by ``fp4vis.pipelines.wan_generate``, with their sizes and defaults.

``run_pipeline_generate(GenerateOptions(model, prompt, ...))`` loads the pipeline class that the model's
``model_index.json`` names (``DiffusionPipeline.from_pretrained``), calls it as a user does, with the prompt, a
CPU generator seeded with ``seed`` and only the settings given (the others are the pipeline's own call defaults),
under the policy (``policy_applied``), and writes a PNG (an image pipeline) or an MP4 (a video pipeline: its call
takes ``num_frames``) and, beside it, the JSON sidecar of ``fp4vis generate``. Every setting is checked against
the pipeline class's call signature before the weights load (``PipelineCall``), the output's suffix against
what the pipeline makes (``check_output``). ``calibration_inputs``: the same calls for ``fp4vis.calibrate``.
"""

from __future__ import annotations

import contextlib
import inspect
import os
import time
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import numpy as np
import torch

from fp4vis.pipelines.compile import compile_transformers
from fp4vis.pipelines.context_parallel import equal_shards
from fp4vis.pipelines.denoising_steps import chained_callbacks, check_steps
from fp4vis.pipelines.media_files import save_mp4, save_png
from fp4vis.pipelines.model_files import (
    check_prompt,
    has_transformer,
    model_index,
    pipeline_transformers,
    resolve_model,
)
from fp4vis.policy import Policy, get_policy
from fp4vis.services.environment import environment
from fp4vis.services.guard_plans import check_plan_policy, guard_plan_summary, load_guard_plan
from fp4vis.services.outputs import check_output_file, write_json
from fp4vis.services.policies import attention_label, check_backend, policy_applied, warn_reference_fallback
from fp4vis.services.runtime import COMPILE_MODES, derived_seed, resolve_device, resolve_dtype
from fp4vis.services.sources import check_model_source, hub_error, is_network_error
from fp4vis.services.timing import Timer
from fp4vis.services.usage import UsageError

# the pipelines fp4vis.pipelines.wan_generate serves (Wan2.1's sizes, defaults, image-to-video, --cp)
WAN_PIPELINES = ("WanPipeline", "WanImageToVideoPipeline")
# a GenerateOptions's settings that a pipeline call takes: field -> (the call's parameter, the CLI's option)
SETTINGS = {"height": ("height", "--height"), "width": ("width", "--width"), "frames": ("num_frames", "--frames"),
            "steps": ("num_inference_steps", "--steps"), "guidance_scale": ("guidance_scale", "--guidance"),
            "negative_prompt": ("negative_prompt", "--negative-prompt")}
OUTPUT_SUFFIX = {"image": ".png", "video": ".mp4"}
DEFAULT_FPS = 16   # an MP4's frame rate where neither --fps nor the pipeline's call (frame_rate) gives one


def pipeline_index(model: str) -> dict[str, Any]:
    """A model source's ``model_index.json`` (its pipeline class and components): a local folder's (or a model
    fp4vis ships), or a Hub id's (that one file fetched, as ``from_pretrained`` fetches it first)."""
    src, is_local = check_model_source(resolve_model(model))
    if is_local:
        return model_index(src)
    from diffusers import DiffusionPipeline

    try:
        return dict(DiffusionPipeline.load_config(src))
    except Exception as e:
        if is_network_error(e):
            raise hub_error(model, e) from e
        raise UsageError(f"--model: {model!r} has no readable model_index.json, so is no diffusers pipeline "
                         f"({type(e).__name__})") from None


def pipeline_class_name(model: str, index: Mapping[str, Any] | None = None) -> str:
    """The pipeline class that a model source's ``model_index.json`` (``index``, else ``pipeline_index``) names."""
    index = pipeline_index(model) if index is None else index
    name = index.get("_class_name")
    if not isinstance(name, str) or not name:
        raise UsageError(f"--model: the model_index.json of {model!r} names no pipeline class (_class_name)")
    return name


def is_wan(model: str, index: Mapping[str, Any] | None = None) -> bool:
    """Whether ``fp4vis.pipelines.wan_generate`` serves ``model`` (its pipeline is one of ``WAN_PIPELINES``);
    ``index``: its ``pipeline_index``, where already read."""
    return pipeline_class_name(model, index) in WAN_PIPELINES


@dataclass(frozen=True)
class PipelineCall:
    """What a pipeline class's ``__call__`` takes, read from the class before any weights load: whether it makes
    a video (it takes ``num_frames``) or an image, its defaults, and the keyword arguments of the settings given
    (``arguments``). ``of`` refuses a pipeline that is no text-to-image or text-to-video one."""

    class_name: str
    parameters: Mapping[str, inspect.Parameter]

    @classmethod
    def of(cls, class_name: str, model: str = "the model") -> PipelineCall:
        import diffusers

        pipeline = getattr(diffusers, class_name, None)
        if not isinstance(pipeline, type):
            raise UsageError(f"--model: {model!r} is a {class_name}, a pipeline class diffusers "
                             f"{diffusers.__version__} does not have")
        params = dict(inspect.signature(pipeline.__call__).parameters)
        missing = [n for n in ("prompt", "num_inference_steps", "output_type") if n not in params]
        if missing:
            raise UsageError(f"--model: {class_name} is no text-to-image or text-to-video pipeline (its call takes "
                             f"no {missing[0]})")
        variadic = (inspect.Parameter.VAR_POSITIONAL, inspect.Parameter.VAR_KEYWORD)
        needs = [n for n, p in params.items() if n not in ("self", "prompt") and p.kind not in variadic
                 and p.default is inspect.Parameter.empty]
        if needs:
            raise UsageError(f"--model: {class_name} needs {needs[0]!r}, which generate does not give (text-to-image "
                             "and text-to-video pipelines only)")
        return cls(class_name, params)

    @property
    def kind(self) -> str:
        return "video" if "num_frames" in self.parameters else "image"

    def default(self, name: str) -> Any:
        """The call's default of parameter ``name`` (None where it has none, or no such parameter)."""
        p = self.parameters.get(name)
        return None if p is None or p.default is inspect.Parameter.empty else p.default

    def arguments(self, **given: Any) -> dict[str, Any]:
        """The call's keyword arguments for the settings given (``SETTINGS`` fields; None: not given, the call's
        default applies). A setting the call does not take is a UsageError naming its option."""
        out = {}
        for field, value in given.items():
            if value is None:
                continue
            param, option = SETTINGS[field]
            if param not in self.parameters:
                raise UsageError(f"{option}: {self.class_name} is {'an' if self.kind == 'image' else 'a'} "
                                 f"{self.kind} pipeline whose call takes no {param}")
            out[param] = value
        return out


def describe(settings: Mapping[str, Any]) -> str:
    """The settings given (``PipelineCall.arguments``' keys) as the CLI names them: ``height 32, steps 2``;
    the pipeline's defaults for the rest."""
    option = {param: opt.lstrip("-") for param, opt in SETTINGS.values()}
    given = [f"{option[k]} {v}" for k, v in settings.items() if k in option and k != "negative_prompt"]
    return ", ".join(given) + (" (the rest: the pipeline's defaults)" if given else "the pipeline's defaults")


def default_output(call: PipelineCall) -> str:
    return f"{call.kind}{OUTPUT_SUFFIX[call.kind]}"


def check_output(path: str | os.PathLike, call: PipelineCall, option: str = "--output") -> Path:
    """Before any work: ``path`` ends as what the pipeline makes is written (``OUTPUT_SUFFIX``) and can be
    written (``check_output_file``); a UsageError naming ``option`` otherwise."""
    suffix = OUTPUT_SUFFIX[call.kind]
    if Path(str(path)).suffix.lower() != suffix:
        raise UsageError(f"{option}: {call.class_name} makes {'an' if call.kind == 'image' else 'a'} {call.kind}, "
                         f"written as {suffix[1:].upper()}: give a path ending in {suffix}, got {str(path)!r}")
    return check_output_file(path, option)


def load_pipeline(model: str, *, device: str | torch.device = "auto", dtype: str | torch.dtype = "bfloat16"):
    """The pipeline that ``model``'s ``model_index.json`` names (``DiffusionPipeline.from_pretrained``), every
    component in ``dtype``, on ``device``; a Hub id that cannot be reached says what to do (``hub_error``)."""
    from diffusers import DiffusionPipeline

    src, is_local = check_model_source(resolve_model(model))
    try:
        pipe = DiffusionPipeline.from_pretrained(src, dtype=resolve_dtype(dtype))
    except Exception as e:
        if not is_local and is_network_error(e):
            raise hub_error(model, e) from e
        raise
    return pipe.to(resolve_device(device))


def calibration_inputs(prompts: list[str], settings: Mapping[str, Any], *, seed: int) -> list[dict[str, Any]]:
    """Pipeline keyword arguments for ``fp4vis.calibrate``: one latent-output call per prompt with ``settings``
    (``PipelineCall.arguments``) and a CPU generator seeded with seed + i for prompt i."""
    return [dict(prompt=p, generator=torch.Generator().manual_seed(derived_seed(seed, i)), output_type="latent",
                 **settings) for i, p in enumerate(prompts)]


def _sync(dev: torch.device) -> None:
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)


class StageClock:
    """The stages of one pipeline call, timed from outside it: text encoding (the forwards of the
    ``text_encoder*`` components, hooked), denoising (from the last text encoding to the last
    ``callback_on_step_end``, this object) and decoding (from there to the call's end); the device synchronised
    at each mark. Without a step callback, denoising and decoding are one span (``denoise_s``; ``decode_s``
    None)."""

    def __init__(self, pipe, dev: torch.device):
        self.pipe, self.dev = pipe, dev
        self.text_s, self.text_end, self.last_step = 0.0, None, None

    def __call__(self, pipeline, step_index, timestep, callback_kwargs):
        _sync(self.dev)
        self.last_step = time.perf_counter()
        return callback_kwargs

    @contextlib.contextmanager
    def hooked(self) -> Iterator[StageClock]:
        started: list[float] = []

        def before(module, args):
            _sync(self.dev)
            started.append(time.perf_counter())

        def after(module, args, output):
            _sync(self.dev)
            self.text_end = time.perf_counter()
            self.text_s += self.text_end - started.pop()

        handles = []
        for name, component in self.pipe.components.items():
            if name.startswith("text_encoder") and isinstance(component, torch.nn.Module):
                handles += [component.register_forward_pre_hook(before), component.register_forward_hook(after)]
        try:
            yield self
        finally:
            for h in handles:
                h.remove()

    def timings(self, start: float, end: float) -> dict[str, float | None]:
        denoised = self.last_step if self.last_step is not None else end
        denoise_from = self.text_end if self.text_end is not None else start
        return {"text_encode_s": self.text_s, "denoise_s": denoised - denoise_from,
                "decode_s": end - self.last_step if self.last_step is not None else None, "total_s": end - start}


def _raised_in(exc: BaseException, function: str) -> bool:
    tb = exc.__traceback__
    while tb is not None:
        if tb.tb_frame.f_code.co_name == function:
            return True
        tb = tb.tb_next
    return False


@dataclass(frozen=True)
class PipelineRun:
    """One ``fp4vis generate`` of a pipeline other than Wan's, resolved and checked: the options, the pipeline's
    call, the settings given to it, the policy and guard plan, the number of steps and the context parallelism
    (None: one process)."""

    config: Any
    call: PipelineCall
    settings: dict[str, Any]
    policy: Policy
    plan: Any
    steps: int
    cp: Any = None


def run_pipeline_generate(config: Any, *, say: Callable[[str], Any] | None = None,
                          index: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """``fp4vis generate`` on a pipeline other than Wan's: ``config`` is a
    ``fp4vis.pipelines.wan_generate.GenerateOptions`` whose settings left None are the pipeline's own call
    defaults, and whose ``output`` None is ``image.png`` or ``video.mp4``; its Wan-only field ``image`` is refused;
    ``index``: the model's ``pipeline_index`` where the caller has read it. Everything is resolved and checked once,
    before the weights load; ``say`` is told what runs once they have. With ``cp`` (``"ulysses=2"``, a
    ``ContextParallel``) under torchrun, every rank runs the pipeline with its transformers under diffusers' context
    parallelism (``fp4vis.pipelines.context_parallel``) and rank 0 alone decodes and writes (the others return
    ``output`` None). Returns {"output", "kind", "sidecar", "timings"}."""
    c = config
    index = pipeline_index(c.model) if index is None else index
    class_name = pipeline_class_name(c.model, index)
    if c.image is not None:
        raise UsageError(f"--image: image-to-video conditioning is for Wan2.1 pipelines ({', '.join(WAN_PIPELINES)}); "
                         f"{c.model!r} is a {class_name}")
    call = PipelineCall.of(class_name, c.model)
    settings = call.arguments(height=c.height, width=c.width, frames=c.frames, steps=c.steps,
                              guidance_scale=c.guidance_scale, negative_prompt=c.negative_prompt)
    if c.fps is not None and call.kind == "image":
        raise UsageError(f"--fps: {call.class_name} is an image pipeline (no video to time)")
    policy = get_policy(c.policy)   # the one resolution of the name (unknown: the standard message)
    check_prompt(c.model, c.prompt, force=c.force)
    steps = settings.get("num_inference_steps", call.default("num_inference_steps"))
    check_steps(c.exact_steps, steps, "--exact-steps")
    if c.exact_steps and "callback_on_step_end" not in call.parameters:
        raise UsageError(f"--exact-steps: {call.class_name}'s call takes no callback_on_step_end, by which the "
                         "attention is switched per step")
    if c.compile is not None and c.compile not in COMPILE_MODES:
        raise UsageError(f"--compile: must be one of {', '.join(COMPILE_MODES)}, got {c.compile!r}")
    if c.compile is not None and not has_transformer(index):
        raise UsageError(f"--compile: {call.class_name} has no transformer to compile")
    plan = load_guard_plan(c.guard_plan)
    if plan is not None and plan.step_indices():
        check_steps(tuple(plan.step_indices()), steps, "--guard-plan: its exact_steps")
        if "callback_on_step_end" not in call.parameters:
            raise UsageError(f"--guard-plan: the plan keeps steps exact and {call.class_name}'s call takes no "
                             "callback_on_step_end, by which the attention is switched per step")
    check_plan_policy(plan, policy)
    run = PipelineRun(c, call, settings, policy, plan, steps)
    if c.cp is None:
        return _run_pipeline(run, resolve_device(c.device), say=say)
    from fp4vis.pipelines.context_parallel import ContextParallel, distributed, parse_cp

    cp = c.cp if isinstance(c.cp, ContextParallel) else parse_cp(c.cp)
    if not has_transformer(index):
        raise UsageError(f"--cp {cp}: {call.class_name} has no transformer to spread over the processes")
    with distributed(cp, c.device) as session:
        return _run_pipeline(replace(run, cp=cp), session.device, main=session.is_main,
                             say=say if session.is_main else None)


def _run_pipeline(run: PipelineRun, dev: torch.device, *, main: bool = True,
                  say: Callable[[str], Any] | None = None) -> dict[str, Any]:
    """``run_pipeline_generate`` of the checked ``run`` on this process's device ``dev``; ``main``: the process that
    decodes and writes."""
    c, call, policy, plan = run.config, run.call, run.policy, run.plan
    check_backend(c.backend, dev)
    path = c.output if c.output is not None else default_output(call)
    if run.cp is None:
        output = check_output(path, call)
    else:   # rank 0 alone touches the output folder; every rank stops on its error
        from fp4vis.pipelines.context_parallel import agree, check_exact_under_ring

        output = agree(lambda: check_output(path, call))
        exact = "--policy bf16" if policy.method == "exact" else "--exact-steps" if c.exact_steps else None
        check_exact_under_ring(run.cp, dev, resolve_dtype(c.dtype), exact)
    rate = call.default("frame_rate")
    fps = c.fps or (rate if isinstance(rate, int) and rate > 0 else DEFAULT_FPS)
    with Timer() as tload:
        pipe = load_pipeline(c.model, device=dev, dtype=c.dtype)
    if run.cp is not None:
        from fp4vis.pipelines.context_parallel import enable_context_parallel

        for transformer in pipeline_transformers(pipe):
            enable_context_parallel(transformer, run.cp)
    if c.compile is not None:
        compile_transformers(pipe, c.compile)
    label = attention_label(policy, c.backend, dev, plan)
    if say is not None:
        exact = f", exact attention in steps {', '.join(map(str, c.exact_steps))}" if c.exact_steps else ""
        spread = f"; context parallelism {run.cp} over {run.cp.degree} processes" if run.cp is not None else ""
        say(f"generate: {c.model} ({call.class_name}), \"{c.prompt}\", {describe(run.settings)}, seed "
            f"{c.seed}; attention: {label}{exact}{spread}"
            f"{f'; transformer compiled ({c.compile}, fullgraph) in the first step' if c.compile else ''} -> {output}")
    warn_reference_fallback(c.backend, dev, policy, "fp4vis generate")   # after the line saying what runs
    pictures, timings = _generate(pipe, run, label, main)
    timings = {"load_s": tload.seconds, **timings}
    if not main:
        return {"output": None, "kind": call.kind, "sidecar": None, "timings": timings}
    if call.kind == "video":
        out = save_mp4(pictures, output, fps=fps, progress=c.progress)
    else:
        out = save_png(pictures[0], output)
    sidecar = {
        "model": c.model, "pipeline": call.class_name, "kind": call.kind, "prompt": c.prompt,
        "negative_prompt": c.negative_prompt, "seed": c.seed,
        "frames": len(pictures) if call.kind == "video" else None, "height": int(pictures.shape[1]),
        "width": int(pictures.shape[2]), "steps": run.steps,
        "guidance_scale": run.settings.get("guidance_scale", call.default("guidance_scale")),
        "fps": fps if call.kind == "video" else None, "call_arguments": run.settings,
        "policy": policy.name, "backend": c.backend,
        "dtype": str(resolve_dtype(c.dtype)).replace("torch.", ""), "guard_plan": c.guard_plan,
        "guard_plan_content": guard_plan_summary(plan), "exact_steps": list(c.exact_steps) if c.exact_steps else None,
        "context_parallel": run.cp.to_dict() if run.cp is not None else None,
        "compile": c.compile, "timings": timings, call.kind: str(out), "environment": environment(),
    }
    side = write_json(out.with_suffix(".json"), sidecar)
    return {"output": out, "kind": call.kind, "sidecar": side, "timings": sidecar["timings"]}


def _generate(pipe, run: PipelineRun, label: str, main: bool = True) -> tuple[np.ndarray | None,
                                                                         dict[str, float | None]]:
    """One call of ``pipe`` under the run's policy and guard plan: its pictures, (N, H, W, 3) in [0, 1] (a video's
    frames, or the image; None where not ``main``: a rank of a context-parallel run that does not write, whose
    call stops at the latents), and its stages' times (``StageClock``). A ValueError of the pipeline's own input
    checks (``check_inputs``) is the user's: a UsageError; so is an unequal split of the sequence under context
    parallelism."""
    c, call, steps = run.config, run.call, run.steps
    dev = pipe._execution_device
    clock = StageClock(pipe, torch.device(dev))
    kw: dict[str, Any] = dict(prompt=c.prompt, generator=torch.Generator().manual_seed(c.seed),
                              output_type="np" if main else "latent", **run.settings)
    pipe.set_progress_bar_config(disable=not c.progress, desc=f"denoise ({label})")
    policy, plan = run.policy, run.plan
    with policy_applied(pipe, policy, guard=plan, backend=c.backend) as handle:
        callbacks: list[Any] = []
        exact = handle.step_callback(steps, c.exact_steps or ()) if handle is not None else None
        if exact is not None:
            callbacks.append(exact)
        if "callback_on_step_end" in call.parameters:
            callbacks.append(clock)
            kw["callback_on_step_end"] = chained_callbacks(callbacks)
        with clock.hooked():
            start = time.perf_counter()
            try:
                with equal_shards(run.cp):
                    out = pipe(**kw)
            except ValueError as e:
                if _raised_in(e, "check_inputs"):
                    raise UsageError(f"{call.class_name} refuses these settings: {e}") from None
                raise
            _sync(torch.device(dev))
            end = time.perf_counter()
    if not main:
        return None, clock.timings(start, end)
    if call.kind == "video":
        pictures = np.asarray(out.frames[0], dtype=np.float32)
    else:
        pictures = np.asarray(out.images[0], dtype=np.float32)[None]
    return pictures, clock.timings(start, end)
