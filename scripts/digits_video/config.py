"""The configuration of a ``train_digits_video.py`` run (``Config``: the full run; ``smoke_config``: a tiny one
for tests) and the quantities it implies (the transformer's sequence, the shortest readable motion, the
learning-rate schedule as the training record states it)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from fp4vis.zoo import moving_digits as md


@dataclass(frozen=True)
class Config:
    canvas: int = md.CANVAS
    frames: int = md.FRAMES
    vae: dict[str, Any] = field(default_factory=lambda: dict(
        base_dim=16, z_dim=8, dim_mult=[1, 2, 2], num_res_blocks=1, attn_scales=[], temperal_downsample=[True, True],
        scale_factor_temporal=4, scale_factor_spatial=4, dropout=0.0))
    transformer: dict[str, Any] = field(default_factory=lambda: dict(
        patch_size=(1, 2, 2), num_attention_heads=4, attention_head_dim=64, in_channels=8, out_channels=8,
        text_dim=64, freq_dim=256, ffn_dim=512, num_layers=4, cross_attn_norm=True, qk_norm="rms_norm_across_heads",
        eps=1e-6, rope_max_seq_len=1024))
    text_encoder: dict[str, Any] = field(default_factory=lambda: dict(
        d_model=64, d_kv=16, d_ff=128, num_layers=1, num_heads=4, relative_attention_num_buckets=8))
    scheduler_shift: float = 3.0
    vae_frames: int = 9          # VAE training clips (1 + 2 x 4 frames: the first frame and the cached chunks)
    vae_batch: int = 32
    vae_lr: float = 3e-3
    kl_weight: float = 1e-4      # on the mean KL per latent element, beside the mean L1 + MSE per pixel
    ink_weight: float = 9.0      # pixels weigh 1 + ink_weight x their brightness: a blank canvas is no optimum
    vae_share: float = 0.35      # of the training time
    vae_log_every: int = 250     # steps
    batch: int = 128
    reuse: int = 2               # passes over each epoch's encoded clips (encoding costs about what a pass does)
    lr: float = 5e-4
    warmup_steps: int = 100
    ema_decay: float = 0.999
    p_uncond: float = 0.1
    encode_batch: int = 256
    train_digits: int | None = None   # None: all; the smoke run takes a few (each epoch encodes them all)
    heldout_clips: int = 100
    stats_clips: int = 512
    reserve_share: float = 0.1   # of the budget, for saving and the final measurements
    # the final check, every prompt once: without guidance, at the demo's setting (generation) and a stronger one
    checks: tuple[tuple[int, float], ...] = ((8, 1.0), (12, 3.0), (30, 3.0))
    generation: dict[str, Any] = field(default_factory=lambda: dict(
        prompt="digit 3 moving right", height=md.CANVAS, width=md.CANVAS, frames=md.FRAMES, steps=12,
        guidance_scale=3.0, fps=8))


def smoke_config() -> Config:
    """A tiny run of the same code (32 px, 5 frames, 2 blocks of 2 heads of 32) for tests: < 1 min on a CPU."""
    return Config(
        canvas=32, frames=5,
        vae=dict(Config().vae, base_dim=8, z_dim=4),
        transformer=dict(Config().transformer, num_attention_heads=2, attention_head_dim=32, in_channels=4,
                         out_channels=4, text_dim=32, ffn_dim=64, num_layers=2),
        text_encoder=dict(Config().text_encoder, d_model=32, d_kv=8, d_ff=32, num_heads=4),
        vae_frames=5, vae_batch=4, vae_log_every=3, batch=8, warmup_steps=5, encode_batch=64, heldout_clips=8,
        stats_clips=16, checks=((2, 1.0),), train_digits=64,
        generation=dict(prompt="digit 3 moving right", height=32, width=32, frames=5, steps=4, guidance_scale=1.0,
                        fps=8))


def schedule_text(cfg: Config) -> str:
    return (f"{cfg.warmup_steps} steps linear warm-up, the peak to step {2 * cfg.warmup_steps}, then cosine to 10 % "
            "over the planned steps")


def tokens(cfg: Config) -> int:
    """The transformer's sequence: latent frames x latent pixels / the 2 x 2 patch."""
    side = cfg.canvas // cfg.vae["scale_factor_spatial"] // cfg.transformer["patch_size"][1]
    return ((cfg.frames - 1) // cfg.vae["scale_factor_temporal"] + 1) * side * side


def min_travel(cfg: Config) -> float:
    """Half the shortest motion: below it a clip reads as still."""
    return 0.5 * min(md.MIN_SPEED, md.max_speed(cfg.canvas, cfg.frames)) * (cfg.frames - 1)
