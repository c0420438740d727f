"""Wan2.1 video generation with FP4 attention (diffusers ``WanPipeline`` / ``WanImageToVideoPipeline``).

    from fp4vis.pipelines.wan_video import load_wan_pipeline, generate, save_mp4
    pipe = load_wan_pipeline("Wan-AI/Wan2.1-T2V-1.3B-Diffusers", device="cuda")
    res = generate(pipe, prompt="a red fox in the snow", policy="fast", seed=0, steps=50)
    save_mp4(res.frames, "fox.mp4")

``generate`` times the three stages separately (text encoding, denoising, VAE decode), draws the
initial latents from a CPU generator seeded with ``seed`` (identical on every device and for every
policy), and applies the policy with ``fp4vis.patch`` only for the duration of the call. ``bf16``
is the pipeline's own attention. Its settings are one ``GenerationConfig``, given as keywords (as above)
or built once and varied per call (``generate(pipe, base, policy="accurate")``).
``run_generate(GenerateConfig(model, prompt, ...))`` is the ``fp4vis generate`` command: it also writes
the MP4 (imageio-ffmpeg) and a JSON sidecar (model, prompt, seed, frames, steps, policy, guard
plan, timings, versions, GPU); with ``cp="ulysses=2"`` (or ``ring``, or both) under torchrun it spreads
each transformer pass over the ranks (``fp4vis.pipelines.context_parallel``) and rank 0 writes.

``build_random_wan_pipeline("1.3B" | "14B")`` builds the real Wan2.1 architectures with seeded random
weights and no text encoder, for speed measurements on machines without the checkpoints.

A model source is a Hub id, a local diffusers folder or a model fp4vis ships (``fp4vis:digits-wan``,
read from its folder by the same ``from_pretrained``); ``generation_defaults`` gives the size, frames,
steps and guidance a shipped model was trained for, and Wan2.1's otherwise.
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import numpy as np
import torch

from fp4vis.files import atomic_path
from fp4vis.policy import get_policy
from fp4vis.services.environment import environment
from fp4vis.services.guard_plans import check_plan_policy, guard_plan_summary, load_guard_plan
from fp4vis.services.outputs import check_output_file, write_json
from fp4vis.services.policies import attention_label, check_backend, policy_applied, warn_reference_fallback
from fp4vis.services.runtime import COMPILE_MODES, derived_seed, resolve_device, resolve_dtype
from fp4vis.services.sources import check_model_source, hub_error, is_network_error
from fp4vis.services.timing import Timer
from fp4vis.services.usage import UsageError

GENERATE_POLICIES = ("fast", "accurate", "wan_fast", "bf16", "guard", "nv_fp8")

# transformer configs of the published Wan2.1 T2V checkpoints (diffusers format)
WAN_TRANSFORMER_CONFIGS: dict[str, dict[str, Any]] = {
    "1.3B": dict(patch_size=(1, 2, 2), num_attention_heads=12, attention_head_dim=128, in_channels=16,
                 out_channels=16, text_dim=4096, freq_dim=256, ffn_dim=8960, num_layers=30, cross_attn_norm=True,
                 qk_norm="rms_norm_across_heads", eps=1e-6, image_dim=None, added_kv_proj_dim=None,
                 rope_max_seq_len=1024),
    "14B": dict(patch_size=(1, 2, 2), num_attention_heads=40, attention_head_dim=128, in_channels=16,
                out_channels=16, text_dim=4096, freq_dim=256, ffn_dim=13824, num_layers=40, cross_attn_norm=True,
                qk_norm="rms_norm_across_heads", eps=1e-6, image_dim=None, added_kv_proj_dim=None,
                rope_max_seq_len=1024),
}
WAN_TEXT_LEN, WAN_TEXT_DIM = 512, 4096


# Wan2.1 T2V 1.3B at 480p: what `fp4vis generate` does for a model that says nothing else
WAN_GENERATION = dict(height=480, width=832, frames=81, steps=50, guidance_scale=5.0, fps=16)


def compile_transformers(pipe, mode: str, backend: str = "inductor") -> None:
    """torch.compile the pipeline's transformers in place with ``fullgraph=True``, as diffusers documents:
    ``"regional"``, ``ModelMixin.compile_repeated_blocks`` (the Wan blocks share one graph, compiled once:
    diffusers' advice for diffusion transformers, a fraction of the compile time), or ``"full"``,
    ``ModelMixin.compile`` (the whole transformer, one graph). Each compiles at its first call; patched and
    unpatched layers alike (docs/patching.md, "torch.compile"). ``backend``: torch.compile's (the tests'
    "aot_eager" traces the same graphs without generating code)."""
    if mode not in COMPILE_MODES:
        raise UsageError(f"compile: must be one of {', '.join(COMPILE_MODES)}, got {mode!r}")
    for name in ("transformer", "transformer_2"):
        transformer = getattr(pipe, name, None)
        if transformer is None:
            continue
        if mode == "regional":
            transformer.compile_repeated_blocks(fullgraph=True, backend=backend)
        else:
            transformer.compile(fullgraph=True, backend=backend)


@dataclass
class GenerationResult:
    latents: torch.Tensor                      # final latents (float32, CPU), before VAE decode
    frames: np.ndarray | None                  # (F, H, W, 3) float32 in [0, 1], None without decode
    timings: dict[str, float]                  # text_encode_s, denoise_s, decode_s, total_s
    info: dict[str, Any] = field(default_factory=dict)
    step_latents: dict[int, torch.Tensor] = field(default_factory=dict)   # after k steps (``latents_after``)


def training_record(model: str) -> dict[str, Any]:
    """The training record (``training.json``) of a model folder: the shipped ``fp4vis:digits-wan`` and any
    run of scripts/train_digits_video.py; {} for any other model (a Hub id, a folder without one)."""
    record = Path(os.path.expanduser(_resolve(model))) / "training.json"
    return json.loads(record.read_text()) if record.is_file() else {}


def generation_defaults(model: str) -> dict[str, Any]:
    """Height, width, frames, steps, guidance scale and fps for ``model``: those of its training record
    (``generation``), Wan2.1's 480p settings for any other model."""
    gen = training_record(model).get("generation") or {}
    return {**WAN_GENERATION, **{k: v for k, v in gen.items() if k in WAN_GENERATION}}


def known_prompts(model: str) -> tuple[tuple[str, ...], str] | None:
    """(the prompts, their grammar) of a model trained on a closed set of prompts: a training record whose
    clips state their prompt grammar (scripts/train_digits_video.py: ``digit <0-9> moving
    <left|right|up|down>``, the 40 of ``fp4vis.zoo.moving_digits.PROMPTS``); None for a model that takes any
    text."""
    grammar = (training_record(model).get("clips") or {}).get("prompt")
    if not grammar:
        return None
    from fp4vis.zoo import moving_digits as md

    return md.PROMPTS, grammar


def check_prompt(model: str, prompt: str, *, force: bool = False, option: str = "--prompt") -> None:
    """A model that knows a closed set of prompts (``known_prompts``) refuses any other (its text encoder
    has no word for it, and the clip would show some digit anyway): a UsageError giving the grammar, or
    with ``force`` a warning."""
    known = known_prompts(model)
    if known is None or " ".join(str(prompt).split()) in known[0]:
        return
    prompts, grammar = known
    message = (f"{option}: {model} was trained on {len(prompts)} prompts, \"{grammar}\" (e.g. \"{prompts[13]}\"), "
               f"and knows no other; got {prompt!r}")
    if not force:
        raise UsageError(message + " (--force generates anyway)")
    import warnings

    warnings.warn(message + "; generating anyway (--force)", UserWarning, stacklevel=2)


class LatentsAfterSteps:
    """A ``callback_on_step_end`` keeping a copy of the latents after ``steps`` denoising steps (1 = after
    the first step), float32 on the CPU."""

    def __init__(self, steps: tuple[int, ...]):
        self.steps, self.latents = set(int(s) for s in steps), {}

    @property
    def tensor_inputs(self) -> list[str]:
        return ["latents"]

    def __call__(self, pipeline, step_index: int, timestep, callback_kwargs: dict[str, Any]) -> dict[str, Any]:
        if step_index + 1 in self.steps:
            self.latents[step_index + 1] = callback_kwargs["latents"].detach().float().cpu()
        return callback_kwargs


def _resolve(model: str) -> str:
    from fp4vis import zoo

    return zoo.resolve_source(model, "model") if zoo.is_zoo_source(model) else model


def _model_index(path: str) -> dict[str, Any]:
    f = Path(path) / "model_index.json"
    if not f.is_file():
        raise UsageError(f"model: {path!r} is not a diffusers pipeline folder (no model_index.json); save one "
                         "with pipe.save_pretrained(dir) or pass a Hub id such as Wan-AI/Wan2.1-T2V-1.3B-Diffusers")
    return json.loads(f.read_text())


def load_wan_pipeline(model: str, *, device: str | torch.device = "auto", dtype: str | torch.dtype = "bfloat16",
                      i2v: bool | None = None, text_encoder: bool = True, vae_dtype: str | torch.dtype = "float32"):
    """A Wan2.1 pipeline from a Hub id or a local diffusers folder. ``i2v=None`` picks the class
    from model_index.json (local) or the id ("I2V" in the name); ``text_encoder=False`` skips the
    text encoder and tokenizer (then pass ``prompt_embeds``)."""
    from diffusers import WanImageToVideoPipeline, WanPipeline

    src, is_local = check_model_source(_resolve(model))
    dev = resolve_device(device)
    dt, vdt = resolve_dtype(dtype), resolve_dtype(vae_dtype)
    if i2v is None:
        if is_local:
            i2v = "ImageToVideo" in str(_model_index(src).get("_class_name", ""))
        else:
            i2v = "i2v" in src.lower()
    cls = WanImageToVideoPipeline if i2v else WanPipeline
    kwargs: dict[str, Any] = {"dtype": dt}
    if is_local:  # components saved as null (e.g. a pipeline saved without its text encoder)
        for key, val in _model_index(src).items():
            if not key.startswith("_") and (val is None or (isinstance(val, list) and val[0] is None)):
                kwargs[key] = None
    if not text_encoder:
        kwargs.update(text_encoder=None, tokenizer=None)
    try:
        from diffusers import AutoencoderKLWan

        vae = AutoencoderKLWan.from_pretrained(src, subfolder="vae", dtype=vdt)
        pipe = cls.from_pretrained(src, vae=vae, **kwargs)
    except Exception as e:
        if not is_local and is_network_error(e):
            raise hub_error(model, e) from e
        raise
    pipe.to(dev)
    pipe.fp4vis_source = model  # recorded in sidecars
    return pipe


def build_random_wan_pipeline(size: str = "1.3B", *, device: str | torch.device = "auto",
                              dtype: str | torch.dtype = "bfloat16", seed: int = 0, vae: bool = True,
                              transformer_config: dict[str, Any] | None = None):
    """The real Wan2.1 T2V architecture (``"1.3B"`` or ``"14B"``) with seeded RANDOM weights, no text
    encoder (pass ``prompt_embeds``), the default Wan VAE (random too) and Wan's UniPC flow scheduler.
    Weights are created directly on the target device. For speed measurements only."""
    from diffusers import AutoencoderKLWan, UniPCMultistepScheduler, WanPipeline, WanTransformer3DModel

    if transformer_config is None:
        if size not in WAN_TRANSFORMER_CONFIGS:
            raise UsageError(f"size: unknown Wan2.1 size {size!r}; use one of {', '.join(WAN_TRANSFORMER_CONFIGS)}")
        transformer_config = WAN_TRANSFORMER_CONFIGS[size]
    dev = resolve_device(device)
    dt = resolve_dtype(dtype)
    torch.manual_seed(seed)
    default = torch.get_default_dtype()
    try:
        with torch.device(dev):
            torch.set_default_dtype(dt)  # build in the target dtype: no FP32 copy of 14B parameters
            transformer = WanTransformer3DModel(**transformer_config)
            torch.set_default_dtype(torch.float32)
            keep_fp32(transformer)
            # without decoding, a minimal VAE stands in (the pipeline only reads its scale factors)
            vae_model = AutoencoderKLWan() if vae else AutoencoderKLWan(
                base_dim=3, z_dim=16, dim_mult=[1, 1, 1, 1], num_res_blocks=1, temperal_downsample=[False, True, True])
    finally:
        torch.set_default_dtype(default)
    scheduler = UniPCMultistepScheduler(prediction_type="flow_prediction", use_flow_sigmas=True, flow_shift=3.0,
                                        num_train_timesteps=1000)
    pipe = WanPipeline(tokenizer=None, text_encoder=None, vae=vae_model, scheduler=scheduler, transformer=transformer)
    pipe.fp4vis_source = f"random:{size}"
    pipe.fp4vis_random_weights = True
    return pipe


def keep_fp32(model: torch.nn.Module) -> torch.nn.Module:
    """Put the submodules that diffusers keeps in FP32 (``_keep_in_fp32_modules``: rope, time
    embedder, norms, modulation tables) back in FP32, as ``from_pretrained(dtype=...)`` does."""
    names = getattr(model, "_keep_in_fp32_modules", None) or []
    for mod_name, mod in model.named_modules():
        if any(n in mod_name.split(".") for n in names):
            mod.to(torch.float32)
    for n in names:  # parameters registered directly on the model (e.g. scale_shift_table)
        p = getattr(model, n, None)
        if isinstance(p, torch.nn.Parameter):
            p.data = p.data.float()
    return model


def encode_prompt(pipe, prompt: str, negative_prompt: str | None = None, *, guidance_scale: float = 5.0,
                  max_sequence_length: int = 512) -> tuple[torch.Tensor, torch.Tensor | None, float]:
    """(prompt_embeds, negative_prompt_embeds or None, seconds) with the pipeline's text encoder."""
    if getattr(pipe, "text_encoder", None) is None or getattr(pipe, "tokenizer", None) is None:
        raise UsageError("this pipeline has no text encoder: pass prompt embeddings (or load the model with "
                         "its text encoder)")
    from diffusers import WanPipeline

    # WanPipeline's T5 encoding for every Wan pipeline: the I2V pipeline's own copy needs ftfy (diffusers
    # imports it only when installed but calls it unconditionally); the T2V one uses it when present
    encode = WanPipeline._get_t5_prompt_embeds
    dev = pipe._execution_device
    with Timer() as t, torch.no_grad():
        pe = encode(pipe, prompt=prompt, max_sequence_length=max_sequence_length, device=dev)
        npe = (encode(pipe, prompt=negative_prompt or "", max_sequence_length=max_sequence_length, device=dev)
               if guidance_scale > 1.0 else None)
    return pe, npe, t.seconds


def random_prompt_embeds(seed: int = 0, *, length: int = WAN_TEXT_LEN, dim: int = WAN_TEXT_DIM,
                         dtype: torch.dtype = torch.bfloat16) -> tuple[torch.Tensor, torch.Tensor]:
    """Seeded stand-ins for UMT5 embeddings (speed runs with random weights)."""
    g = torch.Generator().manual_seed(derived_seed(seed, 7))
    pe = torch.randn(1, length, dim, generator=g) * 0.1
    npe = torch.randn(1, length, dim, generator=g) * 0.1
    return pe.to(dtype), npe.to(dtype)


# diffusers' Wan pipelines refuse a height or width that is not a multiple of 16 (check_inputs), whatever the
# VAE and the patch size allow
PIPELINE_SIZE_MULTIPLE = 16


@dataclass(frozen=True)
class WanGeometry:
    """What a Wan pipeline's VAE and transformer need of a video's size, read from their configs: the VAE's
    scale factors (frames per latent frame after the first, pixels per latent pixel), the transformer's patch
    (latent frames, rows, columns per token) and its rotary embedding's positions per axis
    (``rope_max_seq_len``: latent frames per patch, and rows and columns per patch, beyond it fail)."""

    temporal: int
    spatial: int
    patch: tuple[int, int, int]
    rope_max_seq_len: int

    @classmethod
    def of_pipeline(cls, pipe) -> WanGeometry:
        transformer = getattr(pipe, "transformer", None)
        cfg = (transformer if transformer is not None else pipe.transformer_2).config
        return cls(int(pipe.vae_scale_factor_temporal), int(pipe.vae_scale_factor_spatial),
                   tuple(int(x) for x in cfg.patch_size), int(cfg.rope_max_seq_len))

    @classmethod
    def of_size(cls, size: str) -> WanGeometry:
        """The Wan2.1 architecture ``size`` that ``build_random_wan_pipeline`` builds (default VAE)."""
        cfg = WAN_TRANSFORMER_CONFIGS[size]
        return cls(*WAN_VAE_SCALE, tuple(cfg["patch_size"]), int(cfg["rope_max_seq_len"]))

    def size_multiple(self, axis: int) -> int:
        """Height (axis 1) or width (axis 2) must be a multiple of this: the VAE's factor times the patch,
        and of the pipeline's 16."""
        return math.lcm(self.spatial * self.patch[axis], PIPELINE_SIZE_MULTIPLE)

    def max_size(self, axis: int) -> int:
        """The largest height (axis 1) or width (axis 2) the rotary embedding covers."""
        most = self.rope_max_seq_len * self.spatial * self.patch[axis]
        return most // self.size_multiple(axis) * self.size_multiple(axis)

    def latent_frames(self, frames: int) -> int:
        return (frames - 1) // self.temporal + 1

    @property
    def max_frames(self) -> int:
        return (self.rope_max_seq_len * self.patch[0] - 1) * self.temporal + 1

    def check(self, *, height: int, width: int, frames: int, model: str = "the model", prefix: str = "") -> None:
        """A UsageError naming the option (``prefix`` + frames/height/width: ``--`` at the command line) and
        what the model needs, for a size its pipeline cannot generate."""
        tf, pt = self.temporal, self.patch[0]
        if frames < 1 or (frames - 1) % tf or self.latent_frames(frames) % pt:
            each = "" if pt == 1 else f", with (frames - 1) / {tf} + 1 a multiple of its patch's {pt}"
            raise UsageError(f"{prefix}frames: {model} needs frames = {tf}k + 1 (its VAE encodes {tf} frames per "
                             f"latent frame after the first: 1, {tf + 1}, {2 * tf + 1}, ...{each}), got {frames}")
        if frames > self.max_frames:
            raise UsageError(f"{prefix}frames: at most {self.max_frames} for {model} (its transformer's rotary "
                             f"embedding has {self.rope_max_seq_len} positions in time, rope_max_seq_len), got "
                             f"{frames}")
        for axis, option, value in ((1, "height", height), (2, "width", width)):
            multiple = self.size_multiple(axis)
            if value < 1 or value % multiple:
                raise UsageError(f"{prefix}{option}: must be a multiple of {multiple} for {model} (its VAE's "
                                 f"{self.spatial} px per latent pixel x the transformer's patch of "
                                 f"{self.patch[axis]}, and diffusers' Wan pipelines take multiples of "
                                 f"{PIPELINE_SIZE_MULTIPLE}), got {value}")
            if value > self.max_size(axis):
                raise UsageError(f"{prefix}{option}: at most {self.max_size(axis)} for {model} (its "
                                 f"transformer's rotary embedding has {self.rope_max_seq_len} positions per axis, "
                                 f"rope_max_seq_len, of {self.spatial * self.patch[axis]} px), got {value}")


def _config(cls, src: str, subfolder: str) -> dict[str, Any]:
    """A component's config as its class reads it (defaults of the keys a saved config lacks), without
    its weights (``load_config``)."""
    import inspect

    params = inspect.signature(cls.__init__).parameters
    defaults = {k: p.default for k, p in params.items() if p.default is not inspect.Parameter.empty}
    return {**defaults, **cls.load_config(src, subfolder=subfolder)}


def wan_geometry(model: str) -> WanGeometry:
    """A Wan pipeline's ``WanGeometry`` from its VAE's and transformer's configs alone (``load_config``:
    no weights), before it is loaded."""
    from diffusers import AutoencoderKLWan, WanTransformer3DModel

    src, is_local = check_model_source(_resolve(model))
    transformer = "transformer"
    if is_local:
        index = _model_index(src)
        if index.get("transformer", [None])[0] is None and index.get("transformer_2", [None])[0] is not None:
            transformer = "transformer_2"   # a Wan2.2 pipeline of its low-noise expert alone
    try:
        vae = _config(AutoencoderKLWan, src, "vae")
        cfg = _config(WanTransformer3DModel, src, transformer)
    except Exception as e:
        if not is_local and is_network_error(e):
            raise hub_error(model, e) from e
        if is_local and isinstance(e, OSError):
            raise UsageError(f"model: {model!r} has no readable vae and {transformer} configs ({e})") from None
        raise
    return WanGeometry(int(vae["scale_factor_temporal"]), int(vae["scale_factor_spatial"]),
                       tuple(int(x) for x in cfg["patch_size"]), int(cfg["rope_max_seq_len"]))


def check_steps(indices: tuple[int, ...] | None, steps: int, option: str = "exact_steps") -> None:
    """Denoising step indices exist: ``0 .. steps - 1``, or ``-steps .. -1`` counted from the end (-1: the
    last). A UsageError naming ``option`` otherwise (the step callback would skip it without a word)."""
    bad = [i for i in indices or () if not -steps <= i < steps]
    if bad:
        raise UsageError(f"{option}: step {bad[0]} does not exist in {steps} denoising step"
                         f"{'s' if steps > 1 else ''} (indices 0..{steps - 1}, or -{steps}..-1 from the end)")


def latent_shape(pipe, *, height: int, width: int, frames: int, batch: int = 1) -> tuple[int, ...]:
    geometry = WanGeometry.of_pipeline(pipe)
    geometry.check(height=height, width=width, frames=frames)
    sf = geometry.spatial
    # noise channels = the VAE latent channels (I2V transformers take more inputs: noise + condition)
    return (batch, pipe.vae.config.z_dim, geometry.latent_frames(frames), height // sf, width // sf)


def initial_latents(pipe, *, height: int, width: int, frames: int, seed: int) -> torch.Tensor:
    """The initial noise, from a CPU generator: the same on every device and for every policy."""
    g = torch.Generator().manual_seed(int(seed))
    return torch.randn(latent_shape(pipe, height=height, width=width, frames=frames), generator=g,
                       dtype=torch.float32)


def tokens_per_frame_sequence(pipe, *, height: int, width: int, frames: int) -> int:
    """Self-attention sequence length of the transformer for this video size (arithmetic only: also for a size
    that this pipeline's rotary embedding cannot generate, as the CPU estimate asks of a small model)."""
    geometry = WanGeometry.of_pipeline(pipe)
    p = geometry.patch
    sf = geometry.spatial
    return (geometry.latent_frames(frames) // p[0]) * (height // sf // p[1]) * (width // sf // p[2])


WAN_VAE_SCALE = (4, 8)   # the Wan2.1 VAE's downsampling in time and space (build_random_wan_pipeline's too)


def wan_tokens(size: str, *, height: int, width: int, frames: int) -> int:
    """``tokens_per_frame_sequence`` of the Wan2.1 architecture ``size`` before it is built."""
    p = WAN_TRANSFORMER_CONFIGS[size]["patch_size"]
    tf, sf = WAN_VAE_SCALE
    return ((frames - 1) // tf + 1) // p[0] * (height // sf // p[1]) * (width // sf // p[2])


def check_cpu_size(what: str, tokens: int, *, height: int, width: int, frames: int) -> None:
    """A measurement at a GPU's size on the CPU is refused before any work (UsageError): above
    CPU_PRACTICAL_TOKENS a step takes hours there (the reference emulation; ``warn_if_impractical_on_cpu``
    measures it), so such a run is not one to wait for."""
    if tokens > CPU_PRACTICAL_TOKENS:
        raise UsageError(f"{what}: {frames} frames at {height}x{width} are {tokens} tokens per sequence, a GPU's "
                         f"size: on the CPU a step takes hours. Run it on a GPU (--device cuda), or at most "
                         f"{CPU_PRACTICAL_TOKENS} tokens here (e.g. --height 128 --width 128 --frames 9)")


@torch.no_grad()
def calibration_inputs(pipe, prompts: list[str], *, height: int, width: int, frames: int, steps: int,
                       guidance_scale: float, seed: int, image: Any = None) -> list[dict[str, Any]]:
    """Pipeline keyword arguments for ``fp4vis.calibrate``: one short latent-output run per prompt, with
    the prompt encoded once and seeded initial latents (seed + i for prompt i); ``image`` (a PIL
    image) conditions an image-to-video pipeline, whose image branch is then calibrated too."""
    device = pipe._execution_device
    inputs = []
    for i, prompt in enumerate(prompts):
        pe, npe, _ = encode_prompt(pipe, prompt, guidance_scale=guidance_scale)
        lat = initial_latents(pipe, height=height, width=width, frames=frames, seed=derived_seed(seed, i))
        inputs.append(dict(prompt_embeds=pe, negative_prompt_embeds=npe, latents=lat.to(device), height=height,
                           width=width, num_frames=frames, num_inference_steps=steps, guidance_scale=guidance_scale,
                           output_type="latent", **({"image": image} if image is not None else {})))
    return inputs


def decode_latents(pipe, latents: torch.Tensor) -> np.ndarray:
    """Final latents -> video frames (F, H, W, 3) float32 in [0, 1] (the pipeline's own decode) of the
    first clip of the batch."""
    return decode_clips(pipe, latents[:1])[0]


@torch.no_grad()
def decode_clips(pipe, latents: torch.Tensor) -> np.ndarray:
    """Final latents (N, C, T, H, W) -> the frames of every clip (N, F, H, W, 3) float32 in [0, 1], in one
    VAE call (a third of the CPU time of one call per clip)."""
    vae = pipe.vae
    lat = latents.to(device=next(vae.parameters()).device, dtype=vae.dtype)
    mean = torch.tensor(vae.config.latents_mean).view(1, vae.config.z_dim, 1, 1, 1).to(lat)
    inv_std = 1.0 / torch.tensor(vae.config.latents_std).view(1, vae.config.z_dim, 1, 1, 1).to(lat)
    video = vae.decode(lat / inv_std + mean, return_dict=False)[0]
    frames = pipe.video_processor.postprocess_video(video, output_type="np")
    return np.asarray(frames, dtype=np.float32)


@dataclass(frozen=True, eq=False)
class GenerationConfig:
    """One generation (``generate``): a prompt, or its embeddings (a pipeline without a text encoder), and
    ``image`` for an image-to-video pipeline; the size and schedule; the seed of the initial noise, or the
    initial ``latents`` themselves; the attention (``policy``, a ``guard`` plan, the ``backend``, per-layer
    ``layers``); and what the call does besides: ``exact_steps`` (e.g. ``(0, -1)``) runs those denoising
    steps with the model's exact attention (fp4vis' per-step callback); ``latents_after`` keeps the latents
    after those numbers of steps (``step_latents``); ``callbacks``: more ``callback_on_step_end`` callbacks
    (``PipelineCallback`` objects), run after fp4vis' own; ``label``: what the denoising bar says runs,
    ``denoise (<label>)`` (default: ``attention_label``, the policy and the backend that runs it; a caller
    that changed the model's attention itself says so)."""

    prompt: str | None = None
    negative_prompt: str | None = None
    prompt_embeds: torch.Tensor | None = None
    negative_prompt_embeds: torch.Tensor | None = None
    image: Any = None
    height: int = 480
    width: int = 832
    frames: int = 81
    steps: int = 50
    guidance_scale: float = 5.0
    seed: int = 0
    policy: str = "fast"
    guard: Any = None
    backend: str = "auto"
    decode: bool = True
    progress: bool = True
    latents: torch.Tensor | None = None
    layers: Any = None
    max_sequence_length: int = 512
    exact_steps: tuple[int, ...] | None = None
    latents_after: tuple[int, ...] = ()
    callbacks: tuple[Any, ...] = ()
    label: str | None = None


def generate(pipe, config: GenerationConfig | None = None, /, **settings: Any) -> GenerationResult:
    """One generation of ``config`` (``GenerationConfig``; see the module docstring). ``settings``, fields of
    the config by name, replace its values (``generate(pipe, base, policy="accurate")``) or, without a config,
    the defaults (``generate(pipe, prompt="a red fox", steps=50)``)."""
    cfg = GenerationConfig(**settings) if config is None else replace(config, **settings)
    pol = get_policy(cfg.policy)
    check_steps(cfg.exact_steps, cfg.steps, "exact_steps")
    dev = pipe._execution_device
    check_backend(cfg.backend, torch.device(dev))
    timings = {"text_encode_s": 0.0}
    prompt_embeds, negative_prompt_embeds = cfg.prompt_embeds, cfg.negative_prompt_embeds
    if prompt_embeds is None:
        if cfg.prompt is None:
            raise UsageError("give a prompt or prompt_embeds")
        prompt_embeds, negative_prompt_embeds, timings["text_encode_s"] = encode_prompt(
            pipe, cfg.prompt, cfg.negative_prompt, guidance_scale=cfg.guidance_scale,
            max_sequence_length=cfg.max_sequence_length)
    if cfg.guidance_scale > 1.0 and negative_prompt_embeds is None:
        negative_prompt_embeds = torch.zeros_like(prompt_embeds)
    latents = cfg.latents
    if latents is None:
        latents = initial_latents(pipe, height=cfg.height, width=cfg.width, frames=cfg.frames, seed=cfg.seed)
    label = cfg.label or attention_label(pol, cfg.backend, torch.device(dev), cfg.guard)
    pipe.set_progress_bar_config(disable=not cfg.progress, desc=f"denoise ({label})")
    kwargs: dict[str, Any] = {}
    if cfg.image is not None:
        kwargs["image"] = cfg.image
    keep = LatentsAfterSteps(tuple(cfg.latents_after))
    with policy_applied(pipe, pol, guard=cfg.guard, backend=cfg.backend, layers=cfg.layers) as handle:
        chain: list[Any] = []
        if cfg.exact_steps and handle is not None:
            from fp4vis.patching.wan import exact_steps as step_callback

            chain.append(step_callback(handle, steps=tuple(cfg.exact_steps), num_inference_steps=cfg.steps))
        chain += [*cfg.callbacks, *([keep] if cfg.latents_after else [])]
        if chain:
            kwargs["callback_on_step_end"] = _chained(chain)
        with Timer() as t:
            out = pipe(prompt_embeds=prompt_embeds.to(dev), negative_prompt_embeds=(
                negative_prompt_embeds.to(dev) if negative_prompt_embeds is not None else None),
                latents=latents.to(dev), height=cfg.height, width=cfg.width, num_frames=cfg.frames,
                num_inference_steps=cfg.steps, guidance_scale=cfg.guidance_scale, output_type="latent",
                generator=torch.Generator().manual_seed(cfg.seed), **kwargs)
    timings["denoise_s"] = t.seconds
    final = out.frames.float().cpu()
    video = None
    timings["decode_s"] = 0.0
    if cfg.decode:
        from tqdm.auto import tqdm

        with Timer() as t, tqdm(total=1, desc=f"VAE decode ({cfg.frames} frames)", disable=not cfg.progress) as bar:
            video = decode_latents(pipe, final)
            bar.update(1)
        timings["decode_s"] = t.seconds
    timings["total_s"] = timings["text_encode_s"] + timings["denoise_s"] + timings["decode_s"]
    info = {"policy": pol.name, "height": cfg.height, "width": cfg.width, "frames": cfg.frames, "steps": cfg.steps,
            "guidance_scale": cfg.guidance_scale, "seed": cfg.seed, "backend": cfg.backend,
            "exact_steps": list(cfg.exact_steps) if cfg.exact_steps else None,
            "tokens": tokens_per_frame_sequence(pipe, height=cfg.height, width=cfg.width, frames=cfg.frames)}
    return GenerationResult(latents=final, frames=video, timings=timings, info=info, step_latents=keep.latents)


def _chained(callbacks: list[Any]):
    """One ``callback_on_step_end`` for several (diffusers' MultiPipelineCallbacks takes PipelineCallback
    objects only); each gets the callback_kwargs the one before returned."""
    if len(callbacks) == 1:
        return callbacks[0]

    def call(pipeline, step_index, timestep, callback_kwargs):
        for cb in callbacks:
            callback_kwargs = cb(pipeline, step_index, timestep, callback_kwargs)
        return callback_kwargs

    return call


def mp4_unavailable() -> str | None:
    """Why ``save_mp4`` cannot write here (imageio-ffmpeg finds no ffmpeg), or None when it can."""
    try:
        import imageio_ffmpeg

        imageio_ffmpeg.get_ffmpeg_exe()
    except Exception as e:   # ImportError, or RuntimeError: no bundled or system ffmpeg
        return f"no ffmpeg for imageio-ffmpeg ({type(e).__name__}: {e}); pip install imageio-ffmpeg"
    return None


def save_mp4(frames: np.ndarray, path: str | os.PathLike, fps: int = 16, progress: bool = False) -> Path:
    """Write (F, H, W, 3) frames in [0, 1] (or diffusers' batched (1, F, H, W, 3)) as an H.264 MP4 through
    imageio-ffmpeg, atomically: a failed write leaves no partial file under ``path``. ``progress``: a bar
    over the frames written."""
    import imageio.v2 as imageio
    from tqdm.auto import tqdm

    frames = np.asarray(frames)
    if frames.ndim == 5 and frames.shape[0] == 1:   # diffusers' batched output (1, F, H, W, 3)
        frames = frames[0]
    if frames.ndim != 4 or frames.shape[-1] != 3:
        raise ValueError(f"frames: expected (F, H, W, 3) or (1, F, H, W, 3), got shape {frames.shape}")
    u8 = (np.clip(frames, 0, 1) * 255).round().astype(np.uint8)
    h, w = u8.shape[1:3]
    # macro_block_size=1 keeps odd-sized test videos as they are (H.264 wants even sizes: pad by one)
    if h % 2 or w % 2:
        u8 = np.pad(u8, ((0, 0), (0, h % 2), (0, w % 2), (0, 0)), mode="edge")
    path = Path(path)
    with atomic_path(path) as tmp, imageio.get_writer(str(tmp), format="FFMPEG", mode="I", fps=fps,
                                                      codec="libx264", macro_block_size=1, quality=8,
                                                      pixelformat="yuv420p") as writer:
        for f in tqdm(u8, desc=f"write {path.name}", unit="frame", disable=not progress):
            writer.append_data(f)
    return path


# the settings a model's training record gives (``generation_defaults``) where a GenerateConfig leaves them None
MODEL_DEFAULTS = ("height", "width", "frames", "steps", "guidance_scale", "fps")


@dataclass(frozen=True)
class GenerateConfig:
    """What ``fp4vis generate`` makes (``run_generate``; the CLI builds it from its options). ``height``,
    ``width``, ``frames``, ``steps``, ``guidance_scale`` and ``fps`` left None come from
    ``generation_defaults(model)``; ``image`` (image-to-video) and ``guard_plan`` are paths; ``force``: a
    prompt the model does not know generates, with a warning (``check_prompt``); ``compile``: a mode of
    ``compile_transformers`` (the first step then includes the compilation); ``cp`` (``"ulysses=2"``,
    ``"ring=2"``, ``"ulysses=2,ring=2"`` or a ``ContextParallel``): context parallelism over the processes of
    a torchrun launch (``fp4vis.pipelines.context_parallel``)."""

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


def run_generate(config: GenerateConfig, *, say: Callable[[str], Any] | None = None) -> dict[str, Any]:
    """``fp4vis generate``: load, generate, write the MP4 and its JSON sidecar (same name, .json) of ``config``
    (``GenerateConfig``); ``say`` is told what runs once the model is loaded (the CLI's header; rank 0 alone
    under ``cp``). A prompt the model does not know is refused (``check_prompt``; ``force``: a warning), and
    so, before loading, are step indices that do not exist and sizes or frames the model's VAE and
    transformer cannot take (``check_steps``, ``wan_geometry``: errors name the options).

    Under ``cp`` every rank denoises, rank 0 alone decodes and writes (the others return ``video`` None)."""
    given = {k: getattr(config, k) for k in MODEL_DEFAULTS}
    gen = {**generation_defaults(config.model), **{k: v for k, v in given.items() if v is not None}}
    config = replace(config, **{k: gen[k] for k in MODEL_DEFAULTS})
    if config.policy not in GENERATE_POLICIES:
        get_policy(config.policy)  # raises the standard message for unknown names
    check_prompt(config.model, config.prompt, force=config.force)
    check_steps(config.exact_steps, config.steps, "--exact-steps")
    if config.cp is None:
        return _run_generate(config, resolve_device(config.device), say=say)
    from fp4vis.pipelines.context_parallel import ContextParallel, distributed, parse_cp

    cp = config.cp if isinstance(config.cp, ContextParallel) else parse_cp(config.cp)
    with distributed(cp, config.device) as session:
        return _run_generate(replace(config, cp=cp, progress=config.progress and session.is_main), session.device,
                             main=session.is_main, say=say if session.is_main else None)


def _run_generate(config: GenerateConfig, dev: torch.device, *, main: bool = True,
                  say: Callable[[str], Any] | None = None) -> dict[str, Any]:
    """``run_generate`` on this process's device ``dev`` once the model's defaults are in ``config`` (and
    ``config.cp`` is a ``ContextParallel`` or None); ``main``: the process that decodes and writes."""
    c = config
    check_backend(c.backend, dev)
    if c.compile is not None and c.compile not in COMPILE_MODES:
        raise UsageError(f"compile: must be one of {', '.join(COMPILE_MODES)}, got {c.compile!r}")
    plan = load_guard_plan(c.guard_plan)
    check_plan_policy(plan, c.policy, "guard_plan")
    pil = None
    if c.image is not None:
        if not Path(c.image).is_file():
            raise UsageError(f"image: file {c.image!r} does not exist")
        from PIL import Image

        pil = Image.open(c.image).convert("RGB")
    if c.cp is None:
        output = check_output_file(c.output, "output")
    else:  # rank 0 alone touches the output folder; every rank stops on its error
        from fp4vis.pipelines.context_parallel import agree, check_exact_under_ring

        output = agree(lambda: check_output_file(c.output, "output"))
        exact = ("--policy bf16" if get_policy(c.policy).method == "exact"
                 else "--exact-steps" if c.exact_steps else None)
        check_exact_under_ring(c.cp, dev, resolve_dtype(c.dtype), exact)
    # the size against the model's configs, before its weights load
    wan_geometry(c.model).check(height=c.height, width=c.width, frames=c.frames, model=c.model, prefix="--")
    src, is_local = check_model_source(_resolve(c.model))
    if pil is not None and is_local and "ImageToVideo" not in str(_model_index(src).get("_class_name", "")):
        raise UsageError(f"image: {c.model!r} is a text-to-video model ({_model_index(src).get('_class_name')}); "
                         "drop --image, or give an image-to-video checkpoint")
    with Timer() as tload:
        pipe = load_wan_pipeline(c.model, device=dev, dtype=c.dtype, i2v=True if pil is not None else None)
    if pil is None and type(pipe).__name__ == "WanImageToVideoPipeline":
        raise UsageError(f"{c.model!r} is an image-to-video model: pass --image")
    if say is not None:
        exact = f", exact attention in steps {', '.join(map(str, c.exact_steps))}" if c.exact_steps else ""
        say(f"generate: {c.model}, \"{c.prompt}\"{' from ' + str(c.image) if c.image else ''}, {c.width}x{c.height}, "
            f"{c.frames} frames, {c.steps} steps, guidance {c.guidance_scale}, seed {c.seed}; attention: "
            f"{attention_label(c.policy, c.backend, dev, plan)}{exact}"
            f"{f'; transformer compiled ({c.compile}, fullgraph) in the first step' if c.compile else ''} -> {output}")
    warn_reference_fallback(c.backend, dev, c.policy, "fp4vis generate")   # after the line saying what runs
    if dev.type == "cpu":
        warn_if_impractical_on_cpu(pipe, c.policy, height=c.height, width=c.width, frames=c.frames, steps=c.steps,
                                   guidance_scale=c.guidance_scale)
    if c.cp is not None:
        from fp4vis.pipelines.context_parallel import check_tokens, enable_context_parallel

        check_tokens(tokens_per_frame_sequence(pipe, height=c.height, width=c.width, frames=c.frames), c.cp)
        enable_context_parallel(pipe.transformer, c.cp)
    if c.compile is not None:
        compile_transformers(pipe, c.compile)
    res = generate(pipe, GenerationConfig(
        prompt=c.prompt, negative_prompt=c.negative_prompt, image=pil, height=c.height, width=c.width,
        frames=c.frames, steps=c.steps, guidance_scale=c.guidance_scale, seed=c.seed, policy=c.policy, guard=plan,
        backend=c.backend, progress=c.progress, exact_steps=c.exact_steps, decode=main))
    timings = {"load_s": tload.seconds, **res.timings}
    if not main:
        return {"video": None, "sidecar": None, "timings": timings, "result": res}
    out = save_mp4(res.frames, output, fps=c.fps, progress=c.progress)
    sidecar = {
        "model": c.model, "pipeline": type(pipe).__name__, "prompt": c.prompt, "negative_prompt": c.negative_prompt,
        "image": c.image, "seed": c.seed, "frames": c.frames, "height": c.height, "width": c.width, "steps": c.steps,
        "guidance_scale": c.guidance_scale, "fps": c.fps, "policy": get_policy(c.policy).name, "backend": c.backend,
        "dtype": str(resolve_dtype(c.dtype)).replace("torch.", ""), "guard_plan": c.guard_plan,
        "guard_plan_content": guard_plan_summary(plan), "exact_steps": res.info["exact_steps"],
        "tokens": res.info["tokens"], "context_parallel": c.cp.to_dict() if c.cp is not None else None,
        "compile": c.compile,
        "timings": timings, "video": str(out), "environment": environment(),
    }
    side = write_json(out.with_suffix(".json"), sidecar)
    return {"video": out, "sidecar": side, "timings": sidecar["timings"], "result": res}


CPU_PRACTICAL_TOKENS = 4096   # above this many tokens per sequence on the CPU generate warns, the Wan eval refuses
_CPU_PROBE_TOKENS = 1024


def warn_if_impractical_on_cpu(pipe, policy: str, *, height: int, width: int, frames: int, steps: int,
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
    t0 = time.perf_counter()
    attention(q, q, q, policy=policy, backend="reference", range_check="off")
    probe = time.perf_counter() - t0
    passes = steps * (2 if guidance_scale > 1.0 else 1) * int(cfg.num_layers)
    estimate = probe * (tokens / _CPU_PROBE_TOKENS) ** 2 * passes
    warnings.warn(f"generate on the CPU: {frames} frames at {height}x{width} are {tokens} tokens per sequence; "
                  f"{steps} steps would take at least {estimate / 3600:.1f} h of attention alone here (one "
                  f"{_CPU_PROBE_TOKENS}-token call of {policy!r} took {probe:.2f} s). Sizes made for a GPU: use "
                  "--device cuda, or e.g. --frames 9 --height 128 --width 128 --steps 8 on the CPU",
                  UserWarning, stacklevel=3)
    return estimate
