"""Training, in one wall-clock budget (``Budget``): the fixed text encoder and its prompt embeddings, then
1. the VAE (``train_vae``, then ``latent_stats``) and 2. the transformer (``train_transformer``, flow matching
with an EMA of the weights), as the script's docstring describes."""

from __future__ import annotations

import copy
import json
import math
import time
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

from fp4vis.zoo import moving_digits as md
from fp4vis.zoo.digits import NUM_CLASSES

from .config import Config

TEXT_LEN = 512   # WanPipeline's default max_sequence_length: the embeddings are trained as the pipeline makes them


def make_text_encoder(cfg: Config, seed: int):
    """The word-level tokenizer of the prompts' vocabulary and a seeded random UMT5 encoder."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast, UMT5Config, UMT5EncoderModel

    vocab = {"<pad>": 0, "</s>": 1, "<unk>": 2}
    for w in md.VOCABULARY:
        vocab.setdefault(w, len(vocab))
    tk = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tk.pre_tokenizer = pre_tokenizers.Whitespace()
    tok = PreTrainedTokenizerFast(tokenizer_object=tk, pad_token="<pad>", eos_token="</s>", unk_token="<unk>",
                                  model_max_length=TEXT_LEN)
    torch.manual_seed(seed + 2)
    enc = UMT5EncoderModel(UMT5Config(vocab_size=32, pad_token_id=0, eos_token_id=1, decoder_start_token_id=0,
                                      **cfg.text_encoder)).eval()
    return tok, enc


@torch.no_grad()
def prompt_embeddings(tok, enc, device: torch.device) -> torch.Tensor:
    """(41, 512, text_dim): every prompt of PROMPTS, then "" (the unconditional one), encoded by
    WanPipeline's own T5 encoding with the encoder in bf16, as the pipeline runs it."""
    from diffusers import WanPipeline

    holder = WanPipeline(tokenizer=tok, text_encoder=copy.deepcopy(enc).to(device, torch.bfloat16), vae=None,
                         scheduler=None, transformer=None)
    return WanPipeline._get_t5_prompt_embeds(holder, prompt=[*md.PROMPTS, ""], max_sequence_length=TEXT_LEN,
                                             device=device).float()


def lr_at(step: int, progress: float, peak: float, warmup: int) -> float:
    """Linear warm-up over ``warmup`` steps, then cosine (over the budget's progress) to 10 % of peak."""
    if step < warmup:
        return peak * (step + 1) / warmup
    return peak * (0.1 + 0.45 * (1 + math.cos(math.pi * min(1.0, progress))))


class Budget:
    """The step count of a phase: given, or planned from a wall-clock budget once ``plan_at`` steps have run
    (from the rate of the steps since ``plan_at // 2``: the first ones carry cuDNN's autotuning). The
    learning rate does not depend on the plan before ``plan_at`` (warm-up, then the peak) and decays over
    the planned steps after it, so that the schedule is a function of the step alone and ``--vae-steps`` /
    ``--steps`` replay it. A time budget still stops the phase at its end if the plan was too long."""

    def __init__(self, seconds: float, steps: int | None, plan_at: int):
        self.seconds, self.planned, self.plan_at, self.t0 = seconds, steps, plan_at, time.time()
        self.given = steps is not None
        self.stopped_by = "steps"
        self.t_half = 0.0
        self.seconds_used: float | None = None   # set when the phase ends

    def elapsed(self) -> float:
        return time.time() - self.t0

    def progress(self, step: int) -> float:
        if not self.planned or step <= self.plan_at:
            return 0.0
        return (step - self.plan_at) / max(1, self.planned - self.plan_at)

    def done(self, step: int) -> bool:
        if self.planned is None and step == self.plan_at // 2:
            self.t_half = self.elapsed()
        if self.planned is None and step >= self.plan_at:
            now = self.elapsed()
            rate = (step - self.plan_at // 2) / max(now - self.t_half, 1e-6)
            self.planned = max(step + 1, step + int((self.seconds - now) * rate))
        if self.planned is not None and step >= self.planned:
            return True
        if not self.given and self.elapsed() >= self.seconds:
            self.stopped_by = "time"
            return True
        return False

    def finish(self) -> None:
        self.seconds_used = self.elapsed()

    def record(self, step: int) -> dict[str, Any]:
        return {"steps": step, "planned_steps": self.planned, "stopped_by": self.stopped_by,
                "seconds": round(self.seconds_used if self.seconds_used is not None else self.elapsed(), 1)}


def autocast(device: torch.device):
    # bf16 autocast on the GPU (float32 master weights); float32 on the CPU, where bf16 is slower
    return torch.autocast(device.type, dtype=torch.bfloat16, enabled=device.type == "cuda")


def psnr_db(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Per clip PSNR (dB) of clips in [0, 1], over all frames and pixels."""
    mse = ((a.float() - b.float()) ** 2).flatten(1).mean(1).clamp(min=1e-10)
    return -10 * torch.log10(mse)


# --------------------------------------------------------------------------------------------------
# 1. the VAE


def vae_decode01(vae, z: torch.Tensor) -> torch.Tensor:
    """Latents -> grey clips (n, F, H, W) in [0, 1] (the pipeline's postprocessing: x / 2 + 0.5)."""
    return (vae.decode(z).sample.float().mean(1) / 2 + 0.5).clamp(0, 1)


@torch.no_grad()
def vae_heldout_psnr(vae, clips: torch.Tensor, device: torch.device, batch: int = 16) -> float:
    vae.eval()
    out = []
    for i in range(0, len(clips), batch):
        x = md.to_video(clips[i:i + batch].to(device))
        out.append(psnr_db(vae_decode01(vae, vae.encode(x).latent_dist.mode()).cpu(), clips[i:i + batch]))
    vae.train()
    return float(torch.cat(out).mean())


def decode_unclamped(vae, z: torch.Tensor) -> torch.Tensor:
    """``vae.decode(z)`` before its final clamp to [-1, 1], read through a forward hook on the decoder
    (which the VAE runs once per latent frame). The background's target is -1 itself, and the clamp has
    no gradient past it: trained on the clamped output, a decoder that drifts below -1 everywhere stops
    learning at the blank canvas (the first H200 run's VAE: 17.44 dB at step 100 and at step 173)."""
    if vae.config.patch_size is not None:
        raise ValueError("decode_unclamped: a patched VAE (config.patch_size) is not what this script trains")
    chunks: list[torch.Tensor] = []
    hook = vae.decoder.register_forward_hook(lambda _m, _a, out: chunks.append(out))
    try:
        vae.decode(z)
    finally:
        hook.remove()
    return torch.cat(chunks, 2)


def train_vae(cfg: Config, digits: torch.Tensor, budget: Budget, device: torch.device, seed: int, held: torch.Tensor,
              log: list[dict[str, Any]]):
    from diffusers import AutoencoderKLWan

    torch.manual_seed(seed)
    vae = AutoencoderKLWan(**cfg.vae, latents_mean=[0.0] * cfg.vae["z_dim"],
                           latents_std=[1.0] * cfg.vae["z_dim"]).to(device).train()
    opt = torch.optim.AdamW(vae.parameters(), lr=cfg.vae_lr, weight_decay=0.0, betas=(0.9, 0.99),
                            fused=device.type == "cuda")
    g = torch.Generator().manual_seed(seed + 10)
    gz = torch.Generator(device).manual_seed(seed + 11)
    step, acc, n_acc = 0, 0.0, 0
    while not budget.done(step):
        idx = torch.randint(len(digits), (cfg.vae_batch,), generator=g)
        clips, _, _ = md.make_clips(digits[idx], torch.zeros(cfg.vae_batch, dtype=torch.long), g, canvas=cfg.canvas,
                                    frames=cfg.vae_frames)
        x = md.to_video(clips.to(device))
        for group in opt.param_groups:
            group["lr"] = lr_at(step, budget.progress(step), cfg.vae_lr, cfg.warmup_steps)
        with autocast(device):
            post = vae.encode(x).latent_dist
            z = post.mean + post.std * torch.randn(post.mean.shape, generator=gz, device=device)
            xr = decode_unclamped(vae, z)
        d = xr.float() - x
        kl = 0.5 * (post.mean.float() ** 2 + post.var.float() - 1.0 - post.logvar.float()).mean()
        weight = 1.0 + cfg.ink_weight * (x + 1.0) / 2.0
        loss = (weight * (d.abs() + d * d)).mean() / weight.mean() + cfg.kl_weight * kl
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(vae.parameters(), 1.0)
        opt.step()
        step += 1
        acc, n_acc = acc + loss.detach(), n_acc + 1   # a tensor: no GPU sync per step
        if step % cfg.vae_log_every == 0 or budget.done(step):
            row = {"step": step, "train_loss": float(acc) / n_acc, "kl": float(kl.detach()),
                   "heldout_psnr_db": vae_heldout_psnr(vae, held, device), "seconds": round(budget.elapsed(), 1)}
            log.append(row)
            print(json.dumps({"vae": row}), flush=True)
            acc, n_acc = 0.0, 0
    budget.finish()
    return vae.eval(), step


@torch.no_grad()
def encode(vae, clips: torch.Tensor, device: torch.device, batch: int) -> torch.Tensor:
    """Clips (n, F, H, W) in [0, 1] -> raw latents (the posterior means), float32 on ``device``."""
    out = []
    for i in range(0, len(clips), batch):
        with autocast(device):
            out.append(vae.encode(md.to_video(clips[i:i + batch].to(device))).latent_dist.mode().float())
    return torch.cat(out)


@torch.no_grad()
def latent_stats(cfg: Config, vae, digits: torch.Tensor, device: torch.device, seed: int) -> tuple[list, list]:
    g = torch.Generator().manual_seed(seed + 12)
    idx = torch.randperm(len(digits), generator=g)[:cfg.stats_clips]
    clips, _, _ = md.make_clips(digits[idx], torch.zeros(len(idx), dtype=torch.long), g, canvas=cfg.canvas,
                                frames=cfg.frames)
    z = encode(vae, clips, device, cfg.encode_batch)
    mean = z.mean(dim=(0, 2, 3, 4))
    std = z.std(dim=(0, 2, 3, 4)).clamp(min=1e-3)
    return mean.tolist(), std.tolist()


# --------------------------------------------------------------------------------------------------
# 2. the transformer


def flow_inputs(x0: torch.Tensor, shift: float, g: torch.Generator, sigma: torch.Tensor | None = None):
    """Flow matching as Wan and its scheduler: x_s = (1 - s) x0 + s noise, target noise - x0, timestep 1000 s;
    s from a logit-normal pushed up by the scheduler's shift (the density its sampling steps follow)."""
    n = x0.shape[0]
    if sigma is None:
        u = torch.sigmoid(torch.randn(n, generator=g, device=x0.device))
        sigma = shift * u / (1 + (shift - 1) * u)
    noise = torch.randn(x0.shape, generator=g, device=x0.device)
    s = sigma.view(n, 1, 1, 1, 1)
    return (1 - s) * x0 + s * noise, noise - x0, sigma * 1000.0


@torch.no_grad()
def heldout_flow_loss(model, z_held: torch.Tensor, emb: torch.Tensor, prompts: torch.Tensor, device: torch.device,
                      seed: int, dtype: torch.dtype | None = None) -> float:
    """The flow-matching loss on held-out clips at s = 0.1, 0.3, ..., 0.9 with fixed noise (comparable across
    epochs and with the shipped model)."""
    g = torch.Generator(device).manual_seed(seed + 30)
    losses = []
    for s in (0.1, 0.3, 0.5, 0.7, 0.9):
        xt, target, t = flow_inputs(z_held, 0.0, g, sigma=torch.full((len(z_held),), s, device=device))
        with autocast(device):
            pred = model(hidden_states=xt.to(dtype or xt.dtype), timestep=t,
                         encoder_hidden_states=emb[prompts].to(dtype or emb.dtype), return_dict=False)[0]
        losses.append(float(F.mse_loss(pred.float(), target)))
    return sum(losses) / len(losses)


def wrong_prompts(prompts: torch.Tensor) -> torch.Tensor:
    """Every prompt with another digit (+ 3) and the opposite direction."""
    digit, direction = prompts // len(md.DIRECTIONS), prompts % len(md.DIRECTIONS)
    return ((digit + 3) % NUM_CLASSES) * len(md.DIRECTIONS) + (direction ^ 1)


@dataclass(frozen=True)
class TransformerData:
    """What the transformer trains on: the trained VAE and its latent statistics (``latent_stats``), the
    training digits and their labels, the prompt embeddings (``prompt_embeddings``: the empty prompt last),
    and the held-out clips' normalised latents and prompts (its held-out flow loss)."""

    vae: Any
    latents_mean: list[float]
    latents_std: list[float]
    digits: torch.Tensor
    labels: torch.Tensor
    emb: torch.Tensor
    z_held: torch.Tensor
    p_held: torch.Tensor


def train_transformer(cfg: Config, data: TransformerData, budget: Budget, device: torch.device, seed: int,
                      log: list[dict[str, Any]]):
    from diffusers import WanTransformer3DModel

    vae, digits, labels, emb, z_held, p_held = data.vae, data.digits, data.labels, data.emb, data.z_held, data.p_held
    torch.manual_seed(seed + 1)
    model = WanTransformer3DModel(**cfg.transformer).to(device).train()
    ema = copy.deepcopy(model).requires_grad_(False)
    params, ema_params = list(model.parameters()), list(ema.parameters())
    opt = torch.optim.AdamW(params, lr=cfg.lr, weight_decay=0.01, betas=(0.9, 0.99), fused=device.type == "cuda")
    mean = torch.tensor(data.latents_mean, device=device).view(1, -1, 1, 1, 1)
    std = torch.tensor(data.latents_std, device=device).view(1, -1, 1, 1, 1)
    g = torch.Generator().manual_seed(seed + 20)
    gn = torch.Generator(device).manual_seed(seed + 21)
    uncond = len(md.PROMPTS)   # the index of "" in emb
    step, epoch = 0, 0
    while not budget.done(step):
        epoch += 1
        t_enc = time.time()
        perm = torch.randperm(len(digits), generator=g)
        clips, prompts, _ = md.make_clips(digits[perm], labels[perm], g, canvas=cfg.canvas, frames=cfg.frames)
        z = (encode(vae, clips, device, cfg.encode_batch) - mean) / std
        prompts = prompts.to(device)
        t_enc = time.time() - t_enc
        loss_sum, seen = 0.0, 0
        for _ in range(cfg.reuse):
            order = torch.randperm(len(z), generator=g).to(device)
            drop = (torch.rand(len(z), generator=g) < cfg.p_uncond).to(device)
            cond = torch.where(drop, torch.full_like(prompts, uncond), prompts)[order]
            for i in range(0, len(z) - cfg.batch + 1, cfg.batch):
                if budget.done(step):
                    break
                xt, target, t = flow_inputs(z[order[i:i + cfg.batch]], cfg.scheduler_shift, gn)
                for group in opt.param_groups:
                    group["lr"] = lr_at(step, budget.progress(step), cfg.lr, cfg.warmup_steps)
                with autocast(device):
                    pred = model(hidden_states=xt, timestep=t, encoder_hidden_states=emb[cond[i:i + cfg.batch]],
                                 return_dict=False)[0]
                loss = F.mse_loss(pred.float(), target)
                opt.zero_grad(set_to_none=True)
                loss.backward()
                torch.nn.utils.clip_grad_norm_(params, 1.0)
                opt.step()
                step += 1
                decay = min(cfg.ema_decay, (1 + step) / (10 + step))
                torch._foreach_lerp_(ema_params, [p.detach() for p in params], 1 - decay)
                loss_sum, seen = loss_sum + loss.detach(), seen + 1   # a tensor: no GPU sync per step
        if seen == 0:
            break
        row = {"epoch": epoch, "steps": step, "train_loss": float(loss_sum) / seen,
               "heldout_flow_loss_ema": heldout_flow_loss(ema, z_held, emb, p_held, device, seed),
               # the same clips under other prompts: the gap is what the model reads from its prompt
               "heldout_flow_loss_ema_wrong_prompt": heldout_flow_loss(ema, z_held, emb, wrong_prompts(p_held),
                                                                       device, seed),
               "lr": opt.param_groups[0]["lr"], "encode_seconds": round(t_enc, 1),
               "seconds": round(budget.elapsed(), 1)}
        log.append(row)
        print(json.dumps({"transformer": row}), flush=True)
    budget.finish()
    return ema.eval(), step, epoch
