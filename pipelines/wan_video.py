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
``fp4vis generate`` is ``fp4vis.pipelines.wan_generate.run_generate``; the sizes, frames and steps a model takes
are checked by ``fp4vis.pipelines.wan_sizes``.

``build_random_wan_pipeline("1.3B" | "14B")`` builds the real Wan2.1 architectures with seeded random
weights and no text encoder, for speed measurements on machines without the checkpoints.

A model source is a Hub id, a local diffusers folder or a model fp4vis ships (``fp4vis:digits-wan``,
read from its folder by the same ``from_pretrained``); ``generation_defaults`` gives the size, frames,
steps and guidance a shipped model was trained for, and Wan2.1's otherwise.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import numpy as np
import torch

from fp4vis.files import atomic_path
from fp4vis.pipelines.wan_sizes import (
    WAN_TRANSFORMER_CONFIGS,
    check_steps,
    latent_shape,
    model_index,
    resolve_model,
    tokens_per_frame_sequence,
)
from fp4vis.policy import get_policy
from fp4vis.services.policies import attention_label, check_backend, policy_applied
from fp4vis.services.runtime import COMPILE_MODES, derived_seed, resolve_device, resolve_dtype
from fp4vis.services.sources import check_model_source, hub_error, is_network_error
from fp4vis.services.timing import Timer
from fp4vis.services.usage import UsageError

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
    record = Path(os.path.expanduser(resolve_model(model))) / "training.json"
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


def load_wan_pipeline(model: str, *, device: str | torch.device = "auto", dtype: str | torch.dtype = "bfloat16",
                      i2v: bool | None = None, text_encoder: bool = True, vae_dtype: str | torch.dtype = "float32"):
    """A Wan2.1 pipeline from a Hub id or a local diffusers folder. ``i2v=None`` picks the class
    from model_index.json (local) or the id ("I2V" in the name); ``text_encoder=False`` skips the
    text encoder and tokenizer (then pass ``prompt_embeds``)."""
    from diffusers import WanImageToVideoPipeline, WanPipeline

    src, is_local = check_model_source(resolve_model(model))
    dev = resolve_device(device)
    dt, vdt = resolve_dtype(dtype), resolve_dtype(vae_dtype)
    if i2v is None:
        if is_local:
            i2v = "ImageToVideo" in str(model_index(src).get("_class_name", ""))
        else:
            i2v = "i2v" in src.lower()
    cls = WanImageToVideoPipeline if i2v else WanPipeline
    kwargs: dict[str, Any] = {"dtype": dt}
    if is_local:  # components saved as null (e.g. a pipeline saved without its text encoder)
        for key, val in model_index(src).items():
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


def initial_latents(pipe, *, height: int, width: int, frames: int, seed: int) -> torch.Tensor:
    """The initial noise, from a CPU generator: the same on every device and for every policy."""
    g = torch.Generator().manual_seed(int(seed))
    return torch.randn(latent_shape(pipe, height=height, width=width, frames=frames), generator=g,
                       dtype=torch.float32)


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
            kwargs["callback_on_step_end"] = chained_callbacks(chain)
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


def chained_callbacks(callbacks: list[Any]):
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
