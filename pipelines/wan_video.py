"""Wan2.1 video generation with FP4 attention (diffusers ``WanPipeline`` / ``WanImageToVideoPipeline``).

    from fp4vis.pipelines.media_files import save_mp4
    from fp4vis.pipelines.wan_video import load_wan_pipeline, generate
    pipe = load_wan_pipeline("Wan-AI/Wan2.1-T2V-1.3B-Diffusers", device="cuda")
    res = generate(pipe, prompt="a red fox in the snow", policy="fast", seed=0, steps=50)
    save_mp4(res.frames, "fox.mp4")

``generate`` times the three stages separately (text encoding, denoising, VAE decode), draws the
initial latents from a CPU generator seeded with ``seed`` (identical on every device and for every
policy), and applies the policy with ``fp4vis.patch`` only for the duration of the call. ``bf16``
is the pipeline's own attention. Its settings are one ``GenerationConfig``, given as keywords (as above)
or built once and varied per call (``generate(pipe, base, policy="accurate")``).
``generate`` checks its config (policy, step indices, backend) and runs ``generate_checked``, which trusts it:
``fp4vis generate`` (``fp4vis.pipelines.wan_generate.run_generate``) resolves once and calls that directly. The
sizes and frames a model takes are checked by ``fp4vis.pipelines.wan_sizes``, step indices by
``fp4vis.pipelines.denoising_steps``.

``build_random_wan_pipeline("1.3B" | "14B")`` builds the real Wan2.1 architectures with seeded random
weights and no text encoder, for speed measurements on machines without the checkpoints.

A model source is a Hub id, a local diffusers folder or a model fp4vis ships (``fp4vis:digits-wan``,
read from its folder by the same ``from_pretrained``); ``generation_defaults`` gives the size, frames,
steps and guidance a shipped model was trained for, and Wan2.1's otherwise.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from typing import Any

import numpy as np
import torch

from fp4vis.pipelines.denoising_steps import LatentsAfterSteps, chained_callbacks, check_steps
from fp4vis.pipelines.model_files import model_index, resolve_model, training_record
from fp4vis.pipelines.wan_sizes import WAN_TRANSFORMER_CONFIGS, latent_shape, tokens_per_frame_sequence
from fp4vis.policy import Policy, get_policy
from fp4vis.services.policies import attention_label, check_backend, policy_applied
from fp4vis.services.runtime import derived_seed, resolve_device, resolve_dtype
from fp4vis.services.sources import check_model_source, hub_error, is_network_error
from fp4vis.services.timing import Timer
from fp4vis.services.usage import UsageError

WAN_TEXT_LEN, WAN_TEXT_DIM = 512, 4096


# Wan2.1 T2V 1.3B at 480p: what `fp4vis generate` does for a model that says nothing else
WAN_GENERATION = dict(height=480, width=832, frames=81, steps=50, guidance_scale=5.0, fps=16)


@dataclass
class GenerationResult:
    latents: torch.Tensor                      # final latents (float32, CPU), before VAE decode
    frames: np.ndarray | None                  # (F, H, W, 3) float32 in [0, 1], None without decode
    timings: dict[str, float]                  # text_encode_s, denoise_s, decode_s, total_s
    info: dict[str, Any] = field(default_factory=dict)
    step_latents: dict[int, torch.Tensor] = field(default_factory=dict)   # after k steps (``latents_after``)


def generation_defaults(model: str) -> dict[str, Any]:
    """Height, width, frames, steps, guidance scale and fps for ``model``: those of its training record
    (``generation``), Wan2.1's 480p settings for any other model."""
    gen = training_record(model).get("generation") or {}
    return {**WAN_GENERATION, **{k: v for k, v in gen.items() if k in WAN_GENERATION}}


def load_wan_pipeline(model: str, *, device: str | torch.device = "auto", dtype: str | torch.dtype = "bfloat16",
                      i2v: bool | None = None, text_encoder: bool = True, vae_dtype: str | torch.dtype = "float32",
                      index: Mapping[str, Any] | None = None):
    """A Wan2.1 pipeline from a Hub id or a local diffusers folder. ``i2v=None`` picks the class
    from model_index.json (local) or the id ("I2V" in the name); ``text_encoder=False`` skips the
    text encoder and tokenizer (then pass ``prompt_embeds``); ``index``: a local model's model_index.json
    already read (read here otherwise, once)."""
    from diffusers import WanImageToVideoPipeline, WanPipeline

    src, is_local = check_model_source(resolve_model(model))
    dev = resolve_device(device)
    dt, vdt = resolve_dtype(dtype), resolve_dtype(vae_dtype)
    if is_local and index is None:
        index = model_index(src)
    if i2v is None:
        if is_local:
            i2v = "ImageToVideo" in str(index.get("_class_name", ""))
        else:
            i2v = "i2v" in src.lower()
    cls = WanImageToVideoPipeline if i2v else WanPipeline
    kwargs: dict[str, Any] = {"dtype": dt}
    if is_local:  # components saved as null (e.g. a pipeline saved without its text encoder)
        for key, val in index.items():
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
    policy: str | Policy = "fast"
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
    the defaults (``generate(pipe, prompt="a red fox", steps=50)``). Checks the policy, the step indices and
    the backend, then runs ``generate_checked``."""
    cfg = GenerationConfig(**settings) if config is None else replace(config, **settings)
    check_steps(cfg.exact_steps, cfg.steps, "exact_steps")
    check_backend(cfg.backend, torch.device(pipe._execution_device))
    return generate_checked(pipe, replace(cfg, policy=get_policy(cfg.policy)))


def generate_checked(pipe, cfg: GenerationConfig) -> GenerationResult:
    """``generate`` of a config its caller has checked (``fp4vis generate``'s ``run_generate`` resolves and
    checks once, before the weights load): ``cfg.policy`` a ``Policy``, the step indices and the backend
    valid on the pipeline's device. Nothing is resolved or checked again here."""
    pol = cfg.policy
    dev = pipe._execution_device
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
        steps = handle.step_callback(cfg.steps, cfg.exact_steps or ()) if handle is not None else None
        if steps is not None:
            chain.append(steps)
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
            "exact_steps": list(steps.schedule) if steps is not None else None,   # the plan's too
            "tokens": tokens_per_frame_sequence(pipe, height=cfg.height, width=cfg.width, frames=cfg.frames)}
    return GenerationResult(latents=final, frames=video, timings=timings, info=info, step_latents=keep.latents)
