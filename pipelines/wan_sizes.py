"""What a Wan pipeline takes, read from its configs before its weights load: ``WanGeometry`` (the VAE's scale
factors, the transformer's patch and rotary positions) and its size checks, ``wan_geometry(model)`` from a model
source's configs alone, the latent shape and tokens per sequence of a video size, and the CPU's size limit
(``check_cpu_size``). ``WAN_TRANSFORMER_CONFIGS``: the published Wan2.1 architectures
(``fp4vis.pipelines.wan_video.build_random_wan_pipeline`` builds them). Where a model source's folder is and what
its ``model_index.json`` says: ``fp4vis.pipelines.model_files``.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from fp4vis.pipelines.model_files import model_index, resolve_model
from fp4vis.services.sources import check_model_source, hub_error, is_network_error
from fp4vis.services.usage import UsageError

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

    def tokens(self, *, height: int, width: int, frames: int) -> int:
        """Self-attention sequence length at this size (arithmetic only: also for a size the rotary embedding
        cannot generate, as the CPU's size limit asks of it)."""
        p, sf = self.patch, self.spatial
        return (self.latent_frames(frames) // p[0]) * (height // sf // p[1]) * (width // sf // p[2])

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


def wan_geometry(model: str, index: Mapping[str, Any] | None = None) -> WanGeometry:
    """A Wan pipeline's ``WanGeometry`` from its VAE's and transformer's configs alone (``load_config``:
    no weights), before it is loaded; ``index``: a local model's ``model_index.json`` already read."""
    from diffusers import AutoencoderKLWan, WanTransformer3DModel

    src, is_local = check_model_source(resolve_model(model))
    transformer = "transformer"
    if is_local:
        index = model_index(src) if index is None else index
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


def latent_shape(pipe, *, height: int, width: int, frames: int, batch: int = 1) -> tuple[int, ...]:
    geometry = WanGeometry.of_pipeline(pipe)
    geometry.check(height=height, width=width, frames=frames)
    sf = geometry.spatial
    # noise channels = the VAE latent channels (I2V transformers take more inputs: noise + condition)
    return (batch, pipe.vae.config.z_dim, geometry.latent_frames(frames), height // sf, width // sf)


def tokens_per_frame_sequence(pipe, *, height: int, width: int, frames: int) -> int:
    """Self-attention sequence length of the loaded pipeline's transformer for this video size
    (``WanGeometry.tokens``)."""
    return WanGeometry.of_pipeline(pipe).tokens(height=height, width=width, frames=frames)


WAN_VAE_SCALE = (4, 8)   # the Wan2.1 VAE's downsampling in time and space (build_random_wan_pipeline's too)
CPU_PRACTICAL_TOKENS = 4096   # above this many tokens per sequence on the CPU generate warns, the evals refuse


def check_cpu_size(what: str, tokens: int, *, height: int, width: int, frames: int) -> None:
    """A measurement at a GPU's size on the CPU is refused before any work (UsageError): above
    CPU_PRACTICAL_TOKENS a step takes hours there (the reference emulation; ``warn_if_impractical_on_cpu``
    measures it), so such a run is not one to wait for."""
    if tokens > CPU_PRACTICAL_TOKENS:
        raise UsageError(f"{what}: {frames} frames at {height}x{width} are {tokens} tokens per sequence, a GPU's "
                         f"size: on the CPU a step takes hours. Run it on a GPU (--device cuda), or at most "
                         f"{CPU_PRACTICAL_TOKENS} tokens here (e.g. --height 128 --width 128 --frames 9)")
