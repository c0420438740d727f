"""Variants of the VAE phase of ``scripts/train_digits_video.py`` (the one that makes ``fp4vis:digits-wan``),
trained alone for a fixed wall-clock time and measured as the training measures its VAE: the PSNR of
held-out clips (9 and 13 frames), the blank canvas's PSNR beside it, and how often ``fp4vis:digits-vit``
reads the reconstructed clips as the right digit and direction. It is how the shipped VAE's settings were
chosen; several variants can share one GPU (one process each).

    python benchmarks/digits_wan_vae_variants.py ink0 170 out/ink0.json --data out/digits_video/digits_train.npz
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import replace
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "scripts"))

import train_digits_video as T  # noqa: E402

from fp4vis.services.environment import environment  # noqa: E402
from fp4vis.services.outputs import write_json  # noqa: E402
from fp4vis.zoo import moving_digits as md  # noqa: E402

VARIANTS = {   # changes to the script's Config
    "shipped": {},
    "ink0": {"ink_weight": 0.0, "vae_lr": 1e-3},        # plain L1 + MSE (before the clamp), the first run's lr
    "ink9_lr1e-3": {"vae_lr": 1e-3},
    "ink9_b16": {"vae_batch": 16},
}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("variant", choices=sorted(VARIANTS))
    p.add_argument("seconds", type=float, help="wall-clock training time")
    p.add_argument("out", help="the JSON to write")
    p.add_argument("--data", default=str(T.DEFAULT_DATA))
    p.add_argument("--device", default="cuda")
    args = p.parse_args(argv)
    cfg = replace(T.Config(), **VARIANTS[args.variant])
    device = torch.device(args.device)
    torch.backends.cudnn.benchmark = True
    digits, _, data = T.load_data(Path(args.data), False)
    held9, _ = T.heldout_clips(cfg, cfg.vae_frames, 0)
    held13, prompts = T.heldout_clips(cfg, cfg.frames, 0)
    log: list[dict] = []
    vae, steps = T.train_vae(cfg, digits.to(device), T.Budget(args.seconds, None, 2 * cfg.warmup_steps), device, 0,
                             held9, log)
    with torch.no_grad():
        z = T.encode(vae, held13, device, 64)
        recon = torch.cat([T.vae_decode01(vae, z[i:i + 16]).cpu() for i in range(0, len(z), 16)])
    reading = md.read_clips(recon, md.load_reader(device), min_travel=T.min_travel(cfg))
    result = {"variant": args.variant, "changes": VARIANTS[args.variant], "seconds": args.seconds, "steps": steps,
              "log": log, "heldout_psnr_db_13_frames": float(T.psnr_db(recon, held13).mean()),
              "blank_canvas_psnr_db": float(T.psnr_db(torch.zeros_like(held13), held13).mean()),
              "reader_on_reconstructions": md.reading_scores(reading, prompts), "data_sha256": data["file_sha256"],
              "environment": environment()}
    write_json(Path(args.out), result)
    print(json.dumps({k: v for k, v in result.items() if k not in ("log", "environment")}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
