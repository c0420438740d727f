"""3. The trained parts as a ``WanPipeline`` (``build_pipeline``), and the final metrics of the saved folder
loaded back as users load it (``measure``; ``generation_checks``: clips generated from the prompts and read
back by ``fp4vis:digits-vit``)."""

from __future__ import annotations

import copy
import json
import time
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from fp4vis.zoo import moving_digits as md

from .config import Config, min_travel
from .training import (
    autocast,
    encode,
    flow_inputs,
    heldout_flow_loss,
    psnr_db,
    vae_decode01,
    vae_heldout_psnr,
)


def build_pipeline(cfg: Config, vae, transformer, tok, enc):
    from diffusers import FlowMatchEulerDiscreteScheduler, WanPipeline
    from diffusers.utils import logging as diffusers_logging

    from fp4vis.pipelines.wan_video import keep_fp32

    level = diffusers_logging.get_verbosity()
    diffusers_logging.set_verbosity_error()   # its warning on .to(bf16) is what keep_fp32 answers
    try:
        shipped = keep_fp32(copy.deepcopy(transformer).cpu().to(torch.bfloat16))   # Wan runs in bf16, fp32 parts stay
    finally:
        diffusers_logging.set_verbosity(level)
    return WanPipeline(tokenizer=tok, text_encoder=enc.cpu(), vae=copy.deepcopy(vae).cpu().float(),
                       scheduler=FlowMatchEulerDiscreteScheduler(shift=cfg.scheduler_shift), transformer=shipped)


@torch.no_grad()
def generation_checks(pipe, cfg: Config, checks, prompts_to_check: list[int], reader, device: torch.device,
                      seed: int) -> list[dict[str, Any]]:
    """Clips generated from ``prompts_to_check`` (indices into PROMPTS, one clip each, one seeded generator)
    at every (steps, guidance) of ``checks``, read back: how often the prompted digit and direction."""
    names = [md.PROMPTS[i] for i in prompts_to_check]
    rows = []
    for steps, guidance in checks:
        t0 = time.time()
        frames = pipe(prompt=names, negative_prompt=[""] * len(names), height=cfg.canvas, width=cfg.canvas,
                      num_frames=cfg.frames, num_inference_steps=steps, guidance_scale=guidance,
                      generator=torch.Generator(device).manual_seed(seed), output_type="np").frames
        scores = md.reading_scores(md.read_clips(md.from_frames(frames), reader, min_travel=min_travel(cfg)),
                                   prompts_to_check)
        rows.append({"steps": steps, "guidance_scale": guidance, **scores, "seconds": round(time.time() - t0, 1)})
        print(json.dumps({"generated": rows[-1]}), flush=True)
    return rows


def check_prompts(n: int) -> list[int]:
    """Every prompt once (n = 40), or n of them spread over the digits and directions."""
    return md.balanced_prompts(n)


@torch.no_grad()
def measure(cfg: Config, folder: Path, device: torch.device, seed: int, held_vae, held_clips, held_prompts, emb,
            prompts_to_check: list[int]) -> dict[str, Any]:
    """The final metrics, on the saved folder loaded back as users load it."""
    from fp4vis.pipelines.wan_video import load_wan_pipeline

    pipe = load_wan_pipeline(str(folder), device=device, dtype="bfloat16")
    pipe.set_progress_bar_config(disable=True)
    vae = pipe.vae
    mean = torch.tensor(vae.config.latents_mean, device=device).view(1, -1, 1, 1, 1)
    std = torch.tensor(vae.config.latents_std, device=device).view(1, -1, 1, 1, 1)
    z_held = (encode(vae, held_clips, device, cfg.encode_batch) - mean) / std
    reader = md.load_reader(device)
    real = md.reading_scores(md.read_clips(held_clips, reader, min_travel=min_travel(cfg)), held_prompts)
    with autocast(device):
        recon = torch.cat([vae_decode01(vae, z_held[i:i + 16] * std + mean).cpu() for i in range(0, len(z_held), 16)])
    reconstructed = md.reading_scores(md.read_clips(recon, reader, min_travel=min_travel(cfg)), held_prompts)
    final: dict[str, Any] = {
        "vae_heldout_psnr_db": vae_heldout_psnr(vae, held_vae, device),
        "blank_canvas_psnr_db": float(psnr_db(torch.zeros_like(held_vae), held_vae).mean()),
        "reader_on_vae_reconstructions": reconstructed,
        "heldout_flow_loss": heldout_flow_loss(pipe.transformer, z_held, emb, held_prompts.to(device), device, seed,
                                               dtype=torch.bfloat16),
        "heldout_flow_loss_of_predicting_zero": float(sum(
            F.mse_loss(torch.zeros_like(z_held), flow_inputs(z_held, 0.0, torch.Generator(device).manual_seed(0),
                                                             sigma=torch.full((len(z_held),), s, device=device))[1])
            for s in (0.1, 0.3, 0.5, 0.7, 0.9)) / 5),
        "heldout_clips": len(held_clips),
        "reader_on_real_heldout_clips": real,
    }
    final["generated"] = generation_checks(pipe, cfg, cfg.checks, prompts_to_check, reader, device, seed)
    return final
