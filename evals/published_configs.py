"""Published denoiser architectures as plain data (``PUBLISHED_DENOISERS``), for ``fp4vis eval pipeline
--speed-only ARCH``: the transformer's config as its published ``transformer/config.json`` gives it, the
pipeline's default size, its text length and text-mask form, and how many transformer calls a step makes
(two with classifier-free guidance; CogVideoX: one of batch 2). Nothing here downloads: the values are copied
from the model cards and configs named beside each entry.

``family`` says how a transformer of the entry is called (``denoiser_inputs``): the latent layout it
consumes (video latents ``(B, C, F, H, W)``, CogVideoX's ``(B, F, C, H, W)``, or FLUX-style packed 2x2 patches
``(B, tokens, 4C)``), its timestep scale, and the text conditioning its pipeline passes (embeddings, a padding
mask, pooled embeddings, embedded guidance); ``generation_inputs`` the inputs a pipeline computes once per
generation from the size alone (CogVideoX's rotary embeddings).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

FAMILIES = ("wan", "hunyuanvideo", "flux", "qwenimage", "cogvideox")


@dataclass(frozen=True)
class PublishedDenoiser:
    """One published architecture: ``class_name`` (a diffusers model class) built from ``config``;
    ``height``/``width``/``frames`` the default size (``frames`` None: an image model); ``text_tokens`` the
    text length the pipeline passes, ``prompt_tokens`` how many of them are a prompt's where the pipeline
    pads to ``text_tokens`` and passes the padding mask (None: no mask); ``calls_per_step``: transformer
    calls per denoising step (2: classifier-free guidance, a call of batch 1 each); ``guidance_batched``:
    classifier-free guidance as the pipeline's one call of batch 2 (the latents twice, the negative's and the
    prompt's text stacked; ``calls_per_step`` stays 1); ``guidance``: the pipeline's default scale."""

    title: str
    family: str
    class_name: str
    config: dict[str, Any]
    source: str
    height: int
    width: int
    frames: int | None
    text_tokens: int
    text_dim: int
    prompt_tokens: int | None = None
    pooled_dim: int | None = None
    calls_per_step: int = 1
    guidance_batched: bool = False
    guidance: float = 5.0
    steps: int = 50
    notes: tuple[str, ...] = field(default_factory=tuple)


PUBLISHED_DENOISERS: dict[str, PublishedDenoiser] = {
    # Wan-AI/Wan2.2-T2V-A14B-Diffusers, transformer/config.json (transformer_2, the low-noise expert, has the
    # same config); model card: 720p (1280x720), 81 frames; UMT5 text of 512 tokens, zero-padded, no mask;
    # guidance 4.0 (two calls per step)
    "wan2.2-t2v-a14b": PublishedDenoiser(
        title="Wan2.2-T2V-A14B", family="wan", class_name="WanTransformer3DModel",
        config=dict(patch_size=(1, 2, 2), num_attention_heads=40, attention_head_dim=128, in_channels=16,
                    out_channels=16, text_dim=4096, freq_dim=256, ffn_dim=13824, num_layers=40, cross_attn_norm=True,
                    qk_norm="rms_norm_across_heads", eps=1e-6, image_dim=None, added_kv_proj_dim=None,
                    rope_max_seq_len=1024),
        source="Wan-AI/Wan2.2-T2V-A14B-Diffusers transformer/config.json",
        height=720, width=1280, frames=81, text_tokens=512, text_dim=4096, calls_per_step=2, guidance=4.0, steps=40,
        notes=("one of the two experts (high-noise, low-noise: the same architecture) is built and timed",)),
    # hunyuanvideo-community/HunyuanVideo, transformer/config.json; pipeline defaults 720x1280, 129 frames,
    # LLaVA-Llama text cropped to 256 tokens with its padding mask, CLIP pooled 768, embedded guidance 6.0
    "hunyuanvideo": PublishedDenoiser(
        title="HunyuanVideo", family="hunyuanvideo", class_name="HunyuanVideoTransformer3DModel",
        config=dict(in_channels=16, out_channels=16, num_attention_heads=24, attention_head_dim=128, num_layers=20,
                    num_single_layers=40, num_refiner_layers=2, mlp_ratio=4.0, patch_size=2, patch_size_t=1,
                    qk_norm="rms_norm", guidance_embeds=True, text_embed_dim=4096, pooled_projection_dim=768,
                    rope_theta=256.0, rope_axes_dim=(16, 56, 56)),
        source="hunyuanvideo-community/HunyuanVideo transformer/config.json",
        height=720, width=1280, frames=129, text_tokens=256, text_dim=4096, prompt_tokens=64, pooled_dim=768,
        guidance=6.0, steps=50),
    # black-forest-labs/FLUX.1-dev, transformer/config.json; model card 1024x1024; T5 text of 512 tokens, no
    # mask; CLIP pooled 768; embedded guidance 3.5, 28 steps
    "flux.1-dev": PublishedDenoiser(
        title="FLUX.1-dev", family="flux", class_name="FluxTransformer2DModel",
        config=dict(patch_size=1, in_channels=64, out_channels=None, num_layers=19, num_single_layers=38,
                    attention_head_dim=128, num_attention_heads=24, joint_attention_dim=4096,
                    pooled_projection_dim=768, guidance_embeds=True, axes_dims_rope=(16, 56, 56)),
        source="black-forest-labs/FLUX.1-dev transformer/config.json",
        height=1024, width=1024, frames=None, text_tokens=512, text_dim=4096, pooled_dim=768, guidance=3.5,
        steps=28),
    # Qwen/Qwen-Image, transformer/config.json; model card: 1328x1328 for 1:1; Qwen2.5-VL text (3584 wide) of the
    # prompt's own length (a batch of one is not padded: the pipeline drops the all-ones mask), 128 tokens here;
    # true CFG 4.0 (two calls per step), 50 steps
    "qwen-image": PublishedDenoiser(
        title="Qwen-Image", family="qwenimage", class_name="QwenImageTransformer2DModel",
        config=dict(patch_size=2, in_channels=64, out_channels=16, num_layers=60, attention_head_dim=128,
                    num_attention_heads=24, joint_attention_dim=3584, guidance_embeds=False,
                    axes_dims_rope=(16, 56, 56)),
        source="Qwen/Qwen-Image transformer/config.json",
        height=1328, width=1328, frames=None, text_tokens=128, text_dim=3584, calls_per_step=2, guidance=4.0,
        steps=50),
    # THUDM/CogVideoX-5b, transformer/config.json; pipeline (CogVideoXPipeline) defaults 480x720, 49 frames; T5
    # text padded to 226 tokens, no mask passed; guidance 6.0 as one call of batch 2 (negative and prompt
    # stacked), 50 steps; rotary embeddings computed once per generation (generation_inputs)
    "cogvideox-5b": PublishedDenoiser(
        title="CogVideoX-5B", family="cogvideox", class_name="CogVideoXTransformer3DModel",
        config=dict(num_attention_heads=48, attention_head_dim=64, in_channels=16, out_channels=16,
                    flip_sin_to_cos=True, freq_shift=0, time_embed_dim=512, text_embed_dim=4096, num_layers=42,
                    attention_bias=True, sample_width=90, sample_height=60, sample_frames=49, patch_size=2,
                    patch_size_t=None, temporal_compression_ratio=4, max_text_seq_length=226,
                    activation_fn="gelu-approximate", timestep_activation_fn="silu", norm_elementwise_affine=True,
                    norm_eps=1e-5, spatial_interpolation_scale=1.875, temporal_interpolation_scale=1.0,
                    use_rotary_positional_embeddings=True, use_learned_positional_embeddings=False),
        source="THUDM/CogVideoX-5b transformer/config.json",
        height=480, width=720, frames=49, text_tokens=226, text_dim=4096, guidance_batched=True, guidance=6.0,
        steps=50),
}

VAE_SPATIAL = 8    # every entry's VAE: 8x spatial, 4x temporal compression, 16 latent channels
VAE_TEMPORAL = 4
LATENT_CHANNELS = 16


def check_size(arch: PublishedDenoiser, *, height: int, width: int, frames: int | None, prefix: str = "") -> None:
    """The size an architecture's VAE and patching take (ValueError naming the option otherwise)."""
    for option, v in (("height", height), ("width", width)):
        if v % 16:
            raise ValueError(f"{prefix}{option}: {arch.title} takes multiples of 16 px (8x VAE, 2x2 patches), "
                             f"got {v}")
    if arch.frames is None and frames not in (None, 1):
        raise ValueError(f"{prefix}frames: {arch.title} is an image model, got {frames} frames")
    if arch.frames is not None and (frames is None or frames < 1 or (frames - 1) % VAE_TEMPORAL):
        raise ValueError(f"{prefix}frames: {arch.title} takes 4k+1 frames (4x temporal VAE), got {frames}")


def latent_shape(arch: PublishedDenoiser, *, height: int, width: int, frames: int | None) -> tuple[int, ...]:
    """The latents the transformer consumes, batch 1: ``(1, 16, F', H/8, W/8)`` for a video model (CogVideoX:
    ``(1, F', 16, H/8, W/8)``, its pipeline's layout), the packed ``(1, H/16 * W/16, 64)`` for FLUX and
    Qwen-Image."""
    h, w = height // VAE_SPATIAL, width // VAE_SPATIAL
    if arch.family in ("flux", "qwenimage"):
        return (1, (h // 2) * (w // 2), LATENT_CHANNELS * 4)
    latent_frames = (frames - 1) // VAE_TEMPORAL + 1
    if arch.family == "cogvideox":
        return (1, latent_frames, LATENT_CHANNELS, h, w)
    return (1, LATENT_CHANNELS, latent_frames, h, w)


def tokens(arch: PublishedDenoiser, *, height: int, width: int, frames: int | None) -> int:
    """Image/video tokens per sequence (the self-attention length without the text): every video entry
    patches 2x2 in space and leaves the latent frames whole."""
    shape = latent_shape(arch, height=height, width=width, frames=frames)
    if len(shape) == 3:
        return shape[1]
    latent_frames = shape[1] if arch.family == "cogvideox" else shape[2]
    return latent_frames * (shape[3] // 2) * (shape[4] // 2)


def build_denoiser(arch: PublishedDenoiser, *, device: torch.device, dtype: torch.dtype, seed: int) -> torch.nn.Module:
    """The architecture with seeded random weights, created on ``device`` in ``dtype`` (no FP32 copy), the
    modules diffusers keeps in FP32 put back in FP32."""
    import diffusers

    from fp4vis.pipelines.wan_video import keep_fp32

    cls = getattr(diffusers, arch.class_name)
    torch.manual_seed(seed)
    default = torch.get_default_dtype()
    try:
        with torch.device(device):
            torch.set_default_dtype(dtype)
            model = cls(**arch.config)
    finally:
        torch.set_default_dtype(default)
    return keep_fp32(model).eval().requires_grad_(False)


def random_text(arch: PublishedDenoiser, *, seed: int, device: torch.device, dtype: torch.dtype) -> dict[str, Any]:
    """Seeded random text conditioning of the published shapes: ``embeds`` (1, text_tokens, text_dim), with
    the padding zeroed and ``mask`` (1, text_tokens) where the pipeline passes a padding mask, ``pooled``
    (1, pooled_dim) where it passes pooled embeddings."""
    g = torch.Generator().manual_seed(seed)
    embeds = torch.randn(1, arch.text_tokens, arch.text_dim, generator=g)
    text: dict[str, Any] = {"embeds": embeds, "mask": None, "pooled": None}
    if arch.prompt_tokens is not None:
        mask = torch.zeros(1, arch.text_tokens, dtype=torch.bool)
        mask[:, : arch.prompt_tokens] = True
        text["embeds"] = embeds * mask[..., None]
        text["mask"] = mask.to(device)
    if arch.pooled_dim is not None:
        text["pooled"] = torch.randn(1, arch.pooled_dim, generator=g).to(device, dtype)
    text["embeds"] = text["embeds"].to(device, dtype)
    return text


def stack_text(texts: list[dict[str, Any]]) -> dict[str, Any]:
    """``random_text``'s conditionings stacked along the batch, in the order given (one call of batch
    ``len(texts)``)."""
    return {key: None if texts[0][key] is None else torch.cat([t[key] for t in texts]) for key in texts[0]}


def generation_inputs(arch: PublishedDenoiser, *, height: int, width: int, frames: int | None,
                      device: torch.device) -> dict[str, Any]:
    """The keyword arguments a pipeline computes once per generation from the size alone and passes to every
    transformer call: CogVideoX's rotary embeddings, by diffusers' own functions as ``CogVideoXPipeline``
    calls them (CogVideoX 1.0: ``patch_size_t`` None); nothing for the other families."""
    if arch.family != "cogvideox":
        return {}
    from diffusers.models.embeddings import get_3d_rotary_pos_embed
    from diffusers.pipelines.cogvideo.pipeline_cogvideox import get_resize_crop_region_for_grid

    c = arch.config
    if c.get("patch_size_t") is not None:
        raise ValueError(f"config: {arch.title}: the rotary embeddings of CogVideoX 1.5 (patch_size_t) are not "
                         "computed here")
    p = c["patch_size"]
    grid = (height // (VAE_SPATIAL * p), width // (VAE_SPATIAL * p))
    crops = get_resize_crop_region_for_grid(grid, c["sample_width"] // p, c["sample_height"] // p)
    latent_frames = (frames - 1) // VAE_TEMPORAL + 1
    rotary = get_3d_rotary_pos_embed(embed_dim=c["attention_head_dim"], crops_coords=crops, grid_size=grid,
                                     temporal_size=latent_frames, device=device)
    return {"image_rotary_emb": rotary}


def denoiser_inputs(arch: PublishedDenoiser, latents: torch.Tensor, sigma: float, text: dict[str, Any], *,
                    height: int, width: int) -> dict[str, Any]:
    """The keyword arguments of one transformer call at noise level ``sigma`` (in [0, 1]), as the
    architecture's diffusers pipeline passes them, less those of ``generation_inputs`` (computed once)."""
    dev = latents.device
    t = torch.full((latents.shape[0],), float(sigma), device=dev)
    kw: dict[str, Any] = {"hidden_states": latents, "encoder_hidden_states": text["embeds"], "return_dict": False}
    if arch.family == "wan":
        kw["timestep"] = t * 1000
    elif arch.family == "hunyuanvideo":
        kw.update(timestep=t * 1000, encoder_attention_mask=text["mask"], pooled_projections=text["pooled"],
                  guidance=torch.full_like(t, arch.guidance * 1000))
    elif arch.family == "flux":
        h, w = height // (2 * VAE_SPATIAL), width // (2 * VAE_SPATIAL)
        img_ids = torch.zeros(h, w, 3, device=dev)
        img_ids[..., 1] += torch.arange(h, device=dev)[:, None]
        img_ids[..., 2] += torch.arange(w, device=dev)[None, :]
        kw.update(timestep=t, pooled_projections=text["pooled"], guidance=torch.full_like(t, arch.guidance),
                  img_ids=img_ids.reshape(h * w, 3), txt_ids=torch.zeros(arch.text_tokens, 3, device=dev))
    elif arch.family == "qwenimage":
        kw.update(timestep=t, encoder_hidden_states_mask=text["mask"],
                  img_shapes=[[(1, height // (2 * VAE_SPATIAL), width // (2 * VAE_SPATIAL))]])
    elif arch.family == "cogvideox":
        # the pipeline passes the scheduler's integer timesteps (0..999); the float t * 1000 embeds the same way
        kw["timestep"] = t * 1000
    else:
        raise ValueError(f"family: unknown {arch.family!r}; known: {', '.join(FAMILIES)}")
    return kw
