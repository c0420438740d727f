"""MAE reconstruction eval: what FP4 attention costs a masked autoencoder, in PSNR.

A ViTMAE model (``ViTMAEForPreTraining``: Hub id, local directory, or ``config:default`` for the
ViTMAEConfig defaults = MAE-base) reconstructs the images of an ImageFolder-style dataset with the
SAME masks for the BF16 baseline and every FP4 policy: the masking noise of image i is drawn from a
generator seeded with ``(seed, i)``, independent of batching and sharding.

PSNR convention (stated in every report): images are compared in [0, 1] RGB pixel space after the
model's normalisation is undone and the reconstruction is clamped to [0, 1]; ``data_range = 1.0``;
PSNR is computed PER IMAGE (torchmetrics, reduction "none") and then averaged over images.

- masked-patch PSNR: over the pixels of the masked (reconstructed) patches only;
- full-image PSNR: the model's prediction for every patch, unpatchified, vs the original image;
- FP4-vs-BF16 reconstruction PSNR: the FP4 reconstruction vs the BF16 one (full image);
- the mean paired difference FP4 - BF16 of the masked-patch PSNR with its 95 % Student-t interval.

With ``norm_pix_loss`` models the predicted patches are de-normalised with the mean and variance of
the true patch, the usual way to visualise MAE reconstructions.
"""

from __future__ import annotations

import math
import os
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from fp4vis.evals.common import check_image_folder, error_metrics, image_list, images_markdown, per_sample
from fp4vis.evals.datasets import open_images, sample_indices
from fp4vis.evals.report import markdown_table, mean_ci95, write_report
from fp4vis.services.console import WarningLog
from fp4vis.services.environment import environment
from fp4vis.services.guard_plans import guard_plan_summary, load_guard_plan, plan_for
from fp4vis.services.policies import backend_in_use, check_backend, policy_applied, resolve_policies
from fp4vis.services.runtime import resolve_device, resolve_dtype
from fp4vis.services.sources import check_model_source, display_source, hub_error, is_network_error
from fp4vis.services.usage import UsageError, require

DEFAULT_CONFIG = "config:default"
PSNR_STATEMENT = ("PSNR per image in [0, 1] RGB pixel space (normalisation undone, reconstruction clamped "
                  "to [0, 1]), data_range = 1.0, torchmetrics reduction 'none', then the mean over images.")


def load_mae(source: str, *, random_weights: bool = False, device: torch.device | str = "cpu",
             dtype: torch.dtype = torch.bfloat16, seed: int = 0, mask_ratio: float | None = None):
    """ViTMAEForPreTraining from a Hub id, a local directory or a shipped ``fp4vis:<name>`` (e.g.
    ``fp4vis:digits-mae``, read from its folder); ``config:default`` builds the ViTMAEConfig defaults
    (MAE-base) with seeded random weights."""
    from transformers import ViTMAEConfig, ViTMAEForPreTraining

    from fp4vis.zoo import resolve_source

    source = resolve_source(source)

    torch.manual_seed(seed)
    if source == DEFAULT_CONFIG:
        config = ViTMAEConfig()
        if mask_ratio is not None:
            config.mask_ratio = mask_ratio
        model = ViTMAEForPreTraining(config)
        random_weights = True
    else:
        src, is_local = check_model_source(source)
        kw = {"mask_ratio": mask_ratio} if mask_ratio is not None else {}
        _require_mae(source, src, is_local)
        try:
            if random_weights:
                model = ViTMAEForPreTraining(ViTMAEConfig.from_pretrained(src, **kw))
            else:
                model = ViTMAEForPreTraining.from_pretrained(src, **kw)
        except Exception as e:
            if not is_local and is_network_error(e):
                raise hub_error(source, e) from e
            raise
    mean, std = (0.485, 0.456, 0.406), (0.229, 0.224, 0.225)
    if source != DEFAULT_CONFIG:
        try:
            from transformers import AutoImageProcessor

            proc = AutoImageProcessor.from_pretrained(check_model_source(source)[0])
            mean, std = tuple(proc.image_mean), tuple(proc.image_std)
        except Exception:  # no processor saved: ImageNet statistics, as MAE was trained with
            pass
    model.eval().to(device=device, dtype=dtype)
    return model, mean, std, random_weights


def _require_mae(source: str, src: str, is_local: bool) -> None:
    """A checkpoint of another kind would load into ViTMAEForPreTraining as newly initialised weights
    (transformers only warns): refuse it before loading."""
    from transformers import AutoConfig

    try:
        model_type = AutoConfig.from_pretrained(src).model_type
    except Exception as e:
        if not is_local and is_network_error(e):
            raise hub_error(source, e) from e
        raise UsageError(f"model: {source!r} has no transformers config.json (a ViTMAE checkpoint has one with "
                         f"model_type 'vit_mae'; {type(e).__name__})") from None
    if model_type != "vit_mae":
        raise UsageError(f"model: {source!r} is a {model_type!r} model, not a ViTMAE (model_type 'vit_mae'); "
                         "the MAE eval and calibration need a ViTMAEForPreTraining checkpoint")


class _Indexed(torch.utils.data.Dataset):
    def __init__(self, base):
        self.base = base

    def __len__(self):
        return len(self.base)

    def __getitem__(self, i):
        x, _ = self.base[i]
        return x, i


def masking_noise(indices: torch.Tensor, num_patches: int, seed: int) -> torch.Tensor:
    """The MAE masking noise of each image, from a generator seeded with (seed, image index)."""
    rows = []
    for i in indices.tolist():
        # modulo 2**64, as torch counts seeds: any seed the CLI accepts, the same masks as before for the rest
        g = torch.Generator().manual_seed((int(seed) * 1_000_003 + int(i)) % 2**64)
        rows.append(torch.rand(num_patches, generator=g))
    return torch.stack(rows)


def reconstruct(model, pixels01: torch.Tensor, mean: torch.Tensor, std: torch.Tensor, noise: torch.Tensor,
                interpolate: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(reconstruction in [0, 1], mask [B, N] with 1 = masked, raw predicted patches)."""
    x = ((pixels01 - mean) / std).to(next(model.parameters()).dtype)
    out = model(pixel_values=x, noise=noise.to(x.device), interpolate_pos_encoding=interpolate)
    pred = out.logits.float()
    if model.config.norm_pix_loss:
        target = model.patchify(x.float(), interpolate_pos_encoding=interpolate)
        pred = pred * (target.var(dim=-1, keepdim=True) + 1e-6) ** 0.5 + target.mean(dim=-1, keepdim=True)
    img = model.unpatchify(pred, original_image_size=tuple(pixels01.shape[-2:]))
    img = (img * std + mean).clamp(0, 1)
    return img, out.mask.float(), out.logits.float()


def _patches(model, img: torch.Tensor) -> torch.Tensor:
    return model.patchify(img, interpolate_pos_encoding=True)


def calibration_inputs(model, mean, std, data: str | os.PathLike, *, limit: int, resolution: int | None,
                       seed: int) -> list[dict[str, Any]]:
    """Model inputs for ``fp4vis.calibrate``: the first ``limit`` images of an ImageFolder with the
    eval's seeded masks (image i gets the mask of index i)."""
    from torchvision import transforms as T

    size = model.config.image_size
    native = int(size if isinstance(size, int) else size[0])
    res = resolution or native
    n_patches = (res // int(model.config.patch_size)) ** 2
    ds = open_images(check_image_folder(data),
                     transform=T.Compose([T.Resize(res), T.CenterCrop(res), T.ToTensor(), T.Normalize(mean, std)]))
    device, dtype = next(model.parameters()).device, next(model.parameters()).dtype
    inputs = []
    for i in range(min(limit, len(ds))):
        noise = masking_noise(torch.tensor([i]), n_patches, seed).to(device)
        inputs.append({"pixel_values": ds[i][0].unsqueeze(0).to(device, dtype), "noise": noise,
                       "interpolate_pos_encoding": res != native})
    return inputs


@dataclass(frozen=True)
class MaeEvalConfig:
    """What ``run_mae_eval`` runs (the CLI builds it from ``fp4vis eval mae``'s options): the ViTMAE ``model``
    on the images of ``data``, BF16 and each of ``policies``, with the same masks (seeded by ``seed`` and the
    image's index; ``mask_ratio`` None: the model's). ``limit`` images: the first ones, or drawn at random
    with ``sample_seed`` (the protocols' subsets); ``decoder``: the decoder's attention under the policy too
    (default: the encoder's alone); ``out_dir``: where ``<name>.json`` / ``.md`` go (None: nothing written)."""

    model: str
    data: str | os.PathLike
    policies: str | list[str] = "fast,accurate"
    resolution: int | None = None
    batch_size: int = 8
    limit: int | None = None
    random_weights: bool = False
    mask_ratio: float | None = None
    seed: int = 0
    device: str = "auto"
    dtype: str = "bfloat16"
    backend: str = "auto"
    guard_plan: str | None = None
    decoder: bool = False
    num_workers: int = 0
    out_dir: str | os.PathLike | None = None
    name: str = "mae_psnr"
    progress: bool = True
    sample_seed: int | None = None


def run_mae_eval(config: MaeEvalConfig, *, say: Callable[[str], Any] | None = None) -> dict[str, Any]:
    """Run the eval of ``config`` (``MaeEvalConfig``; see the module docstring); returns the result dict and,
    with ``config.out_dir``, writes ``<name>.json``/``.md``. ``say``: told what the eval runs, once the model
    and the images are loaded (the CLI's header)."""
    from accelerate import Accelerator
    from torch.utils.data import DataLoader, Subset
    from torchmetrics.functional.image import peak_signal_noise_ratio as psnr
    from torchvision import transforms as T
    from tqdm.auto import tqdm

    require("torchvision", what="the MAE eval")
    dev = resolve_device(config.device)
    check_backend(config.backend, dev)
    pols = resolve_policies(config.policies, allow_bf16=False)
    root = check_image_folder(config.data)
    plan = load_guard_plan(config.guard_plan)
    if config.mask_ratio is not None and not 0 < config.mask_ratio < 1:
        raise UsageError(f"mask ratio must be in (0, 1), got {config.mask_ratio}")
    acc = Accelerator(cpu=dev.type == "cpu")
    mdtype = resolve_dtype(config.dtype)
    mae, mean_t, std_t, random_weights = load_mae(config.model, random_weights=config.random_weights,
                                                  device=acc.device, dtype=mdtype, seed=config.seed,
                                                  mask_ratio=config.mask_ratio)
    cfg = mae.config
    native = int(cfg.image_size if isinstance(cfg.image_size, int) else cfg.image_size[0])
    patch = int(cfg.patch_size if isinstance(cfg.patch_size, int) else cfg.patch_size[0])
    res = int(config.resolution or native)
    if res % patch:
        raise UsageError(f"resolution {res} is not a multiple of the patch size {patch}")
    num_patches = (res // patch) ** 2
    tf = T.Compose([T.Resize(res, interpolation=T.InterpolationMode.BICUBIC), T.CenterCrop(res), T.ToTensor()])
    dataset: Any = open_images(root, transform=tf)
    indices = sample_indices(len(dataset), config.limit, config.sample_seed)
    files = image_list(dataset, indices)
    if len(indices) < len(dataset):
        dataset = Subset(dataset, indices)
    loader = acc.prepare_data_loader(DataLoader(_Indexed(dataset), batch_size=config.batch_size, shuffle=False,
                                                num_workers=config.num_workers))
    if say is not None:   # what runs, once the model and the images are loaded (the CLI's header)
        say(f"eval mae: {config.model} at {res} px ({num_patches} patches, {mae.config.mask_ratio:.0%} masked), "
            f"{len(indices)} images from {root}; bf16 (the model's attention) and {', '.join(p.name for p in pols)} "
            f"on the {backend_in_use(config.backend, acc.device)} backend{' with a guard plan' if plan else ''}")
    mean = torch.tensor(mean_t, device=acc.device).view(1, 3, 1, 1)
    std = torch.tensor(std_t, device=acc.device).view(1, 3, 1, 1)
    cosine, rel_l2 = error_metrics()
    interp = res != native

    cols: dict[str, list[torch.Tensor]] = {"index": [], "bf16/masked": [], "bf16/full": []}
    for p in pols:
        for k in ("masked", "full", "vs_bf16", "pred_cos", "pred_rel"):
            cols[f"{p.name}/{k}"] = []

    def masked_psnr(img, orig, mask):
        a, b = _patches(mae, img), _patches(mae, orig)
        sel = mask.bool()
        n_masked = int(sel[0].sum())
        return psnr(a[sel].reshape(a.shape[0], n_masked * a.shape[-1]),
                    b[sel].reshape(b.shape[0], n_masked * b.shape[-1]), data_range=1.0, reduction="none", dim=1)

    def full_psnr(img, ref):
        return psnr(img, ref, data_range=1.0, reduction="none", dim=(1, 2, 3))

    with torch.no_grad(), WarningLog() as wlog:
        for x, idx in tqdm(loader, desc="mae eval", disable=not (config.progress and acc.is_local_main_process)):
            x = x.to(acc.device, torch.float32)
            noise = masking_noise(idx.cpu(), num_patches, config.seed)
            ref_img, ref_mask, ref_pred = reconstruct(mae, x, mean, std, noise, interp)
            batch: dict[str, torch.Tensor] = {"index": idx.to(acc.device),
                                              "bf16/masked": masked_psnr(ref_img, x, ref_mask),
                                              "bf16/full": full_psnr(ref_img, x)}
            for p in pols:
                with policy_applied(mae, p, guard=plan_for(plan, p), backend=config.backend, decoder=config.decoder):
                    img, mask, pred = reconstruct(mae, x, mean, std, noise, interp)
                if not torch.equal(mask, ref_mask):  # same noise must give the same mask
                    raise RuntimeError("MAE masks differ between BF16 and FP4 runs")
                batch[f"{p.name}/masked"] = masked_psnr(img, x, mask)
                batch[f"{p.name}/full"] = full_psnr(img, x)
                batch[f"{p.name}/vs_bf16"] = full_psnr(img, ref_img)
                batch[f"{p.name}/pred_cos"] = torch.tensor(per_sample(cosine, pred, ref_pred), device=acc.device)
                batch[f"{p.name}/pred_rel"] = torch.tensor(per_sample(rel_l2, pred, ref_pred), device=acc.device)
            # gather per batch: accelerate drops the samples it duplicated to even out the last batch
            for k, v in acc.gather_for_metrics(batch).items():
                cols[k].append(v.cpu())

    g = {k: torch.cat(v).double() for k, v in cols.items()}
    n = int(g["index"].numel())

    def stats(t: torch.Tensor) -> dict[str, float]:
        finite = t[torch.isfinite(t)]
        return {"mean": float(finite.mean()) if finite.numel() else math.inf, "min": float(t.min()),
                "max": float(t.max())}

    result: dict[str, Any] = {
        "eval": "mae_psnr", "model": display_source(config.model), "random_weights": random_weights,
        "data": display_source(str(root)), "images": n,
        "image_files": files,
        "resolution": res, "native_resolution": native, "patch_size": patch, "tokens_encoder":
        int(round(num_patches * (1 - cfg.mask_ratio))) + 1, "mask_ratio": cfg.mask_ratio,
        "norm_pix_loss": bool(cfg.norm_pix_loss), "seed": config.seed, "dtype": str(mdtype).replace("torch.", ""),
        "backend": config.backend, "decoder_patched": config.decoder, "num_processes": acc.num_processes,
        "guard_plan": guard_plan_summary(plan), "psnr_reduction": PSNR_STATEMENT,
        "image_index": g["index"].long().tolist(),
        "bf16": {"masked_psnr": stats(g["bf16/masked"]), "full_psnr": stats(g["bf16/full"]),
                 "masked_psnr_per_image": g["bf16/masked"].tolist(), "full_psnr_per_image": g["bf16/full"].tolist()},
        "policies": {},
    }
    for p in pols:
        diff = (g[f"{p.name}/masked"] - g["bf16/masked"]).tolist()
        result["policies"][p.name] = {
            "guard_plan_applied": plan_for(plan, p) is not None,
            "masked_psnr": stats(g[f"{p.name}/masked"]), "full_psnr": stats(g[f"{p.name}/full"]),
            "masked_psnr_diff_vs_bf16": mean_ci95(diff),
            "recon_psnr_vs_bf16": stats(g[f"{p.name}/vs_bf16"]),
            "pred_cosine_mean": float(g[f"{p.name}/pred_cos"].mean()),
            "pred_rel_l2_mean": float(g[f"{p.name}/pred_rel"].mean()),
            "masked_psnr_per_image": g[f"{p.name}/masked"].tolist(),
            "full_psnr_per_image": g[f"{p.name}/full"].tolist(),
            "recon_psnr_vs_bf16_per_image": g[f"{p.name}/vs_bf16"].tolist(),
        }
    result["warnings"] = wlog.messages
    result["environment"] = environment()
    if config.out_dir is not None and acc.is_main_process:
        written = write_report(config.out_dir, config.name, result, mae_markdown(result))
        result["files"] = {k: str(v) for k, v in written.items()}
    return result


def mae_markdown(r: dict[str, Any]) -> str:
    warn = ("\n**Random weights**: ViTMAE built from its configuration with seeded random weights (no "
            "pretrained checkpoint). The PSNR against the photos is meaningless for such a model; the "
            "FP4-vs-BF16 numbers measure the numerics of FP4 attention on this architecture.\n"
            if r["random_weights"] else "")
    lines = [f"# MAE reconstruction PSNR: {r['model']}", warn,
             f"{r['images']} images from `{r['data']}` at {r['resolution']} px, mask ratio {r['mask_ratio']} "
             f"(identical seeded masks for every run, seed {r['seed']}), {r['dtype']} baseline, backend "
             f"`{r['backend']}`, decoder {'patched' if r['decoder_patched'] else 'exact (encoder only patched)'}."
             + images_markdown(r.get("image_files")),
             "", f"**PSNR reduction**: {r['psnr_reduction']}", ""]
    rows = [["bf16 (baseline)", r["bf16"]["masked_psnr"]["mean"], None, None, r["bf16"]["full_psnr"]["mean"], None]]
    for name, p in r["policies"].items():
        d = p["masked_psnr_diff_vs_bf16"]
        ci = (f"[{d['ci95_low']:.4f}, {d['ci95_high']:.4f}]" if d.get("ci95_low") is not None else "n/a (n < 2)")
        rows.append([name, p["masked_psnr"]["mean"], d["mean"], ci, p["full_psnr"]["mean"],
                     p["recon_psnr_vs_bf16"]["mean"]])
    lines.append(markdown_table(["policy", "masked-patch PSNR (dB)", "FP4 − BF16 (dB)", "95 % t-interval",
                                 "full-image PSNR (dB)", "FP4 vs BF16 recon PSNR (dB)"], rows))
    return "\n".join(lines)
