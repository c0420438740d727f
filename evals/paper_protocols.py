"""The method's own evaluation protocols as presets (``fp4vis eval vit|mae|wan --protocol paper``): with
the real weights and the user's copy of the data, one command runs the published protocol and its report
sets each measured row beside the figure the method's authors published ("Hardware-Aware FP4
FlashAttention-4", R. Hu, arXiv:2609.04105, 2026; its numerics as docs/numerics.md restates them).

* ViT: ``nateraw/vit-base-patch16-224-cifar10`` on the CIFAR-10 test set at S256 (224 px, 1,000
  images), S1024 (496 px, 200) and S4096 (1008 px, 200), images drawn with seed 20260728; top-1.
* MAE: ``facebook/vit-mae-base`` on 100 COCO val2017 images (seed 20260805), 75 % masks, the 12
  encoder attention layers changed; masked-patch PSNR and its paired 95 % interval.
* Wan: Wan2.1-T2V-1.3B or 14B, 512x768, 17 frames, guidance 5.0, seed 20260805, only ``attn1``
  replaced; the final latent's cosine and relL2 against BF16 after 1, 4 and 20 steps (a run of each
  length).

The data sets are the user's (``--data``, a local path: the CIFAR-10 test set in its own format or as
an ImageFolder, COCO val2017 as a folder of images): nothing downloads unasked. Images are drawn from
the data with the protocol's seed (``fp4vis.evals.datasets.sample_indices``), so a copy with other
files or another order draws other images: the published rows are the authors' draw. The Wan prompt
is not part of what the authors published: the eval's default prompt is used and named in the report.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Any

from fp4vis.services.sources import display_source

from .report import markdown_table, write_report

PROTOCOLS = ("paper",)


@dataclass(frozen=True)
class VitRun:
    label: str          # the sequence length the authors name the run by
    resolution: int
    images: int


@dataclass(frozen=True)
class VitProtocol:
    model: str = "nateraw/vit-base-patch16-224-cifar10"
    data: str = "the CIFAR-10 test set"
    seed: int = 20260728
    policies: tuple[str, ...] = ("fast", "accurate")
    runs: tuple[VitRun, ...] = (VitRun("S256", 224, 1000), VitRun("S1024", 496, 200), VitRun("S4096", 1008, 200))
    # published top-1 (%) per run and policy
    published: dict = field(default_factory=lambda: {
        "S256": {"bf16": 98.9, "fast": 98.8, "accurate": 98.7},
        "S1024": {"bf16": 96.5, "fast": 95.0, "accurate": 97.0},
        "S4096": {"bf16": 88.5, "fast": 88.5, "accurate": 89.0}})


@dataclass(frozen=True)
class MaeProtocol:
    model: str = "facebook/vit-mae-base"
    data: str = "COCO val2017"
    images: int = 100
    seed: int = 20260805
    mask_ratio: float = 0.75
    policies: tuple[str, ...] = ("fast", "accurate")
    # published masked-patch PSNR (dB): BF16's mean; FP4 - BF16 as (mean, 95 % half-width)
    published_bf16: float = 23.9165
    published_diff: dict = field(default_factory=lambda: {"fast": (-0.020, 0.026), "accurate": (-0.024, 0.021)})


@dataclass(frozen=True)
class WanProtocol:
    model: str = "Wan-AI/Wan2.1-T2V-1.3B-Diffusers"
    height: int = 512
    width: int = 768
    frames: int = 17
    guidance_scale: float = 5.0
    seed: int = 20260805
    steps: tuple[int, ...] = (1, 4, 20)
    policies: tuple[str, ...] = ("fast",)
    # published (latent cosine, relL2) against BF16 per model size, policy and step count
    published: dict = field(default_factory=lambda: {
        "1.3B": {"fast": {1: (0.9870, 0.1803), 4: (0.9671, 0.2611), 20: (0.9136, 0.4163)}},
        "14B": {"fast": {1: (0.9938, 0.1179), 4: (0.9338, 0.3589), 20: (0.8496, 0.5337)}}})

    def size_of(self, model: str) -> str | None:
        """The published model size a checkpoint name refers to (None: no published rows)."""
        name = model.lower().replace("_", "-")
        return next((s for s in ("1.3B", "14B") if f"-{s.lower()}" in name), None)


PAPER = {"vit": VitProtocol(), "mae": MaeProtocol(), "wan": WanProtocol()}


def _delta(measured: float | None, published: float | None) -> float | None:
    return None if measured is None or published is None else measured - published


def run_vit_protocol(data: str | os.PathLike, *, model: str | None = None, protocol: VitProtocol = PAPER["vit"],
                     out_dir: str | os.PathLike | None = None, name: str = "vit_paper", **common: Any) -> dict:
    """Every run of the ViT protocol (``fp4vis.evals.vit_top1.run_vit_eval``, one report per run) and a
    report of them beside the published top-1."""
    from .vit_top1 import VitEvalConfig, run_vit_eval

    model = model or protocol.model
    result: dict[str, Any] = {"eval": "vit_protocol", "protocol": "paper", "model": display_source(model),
                              "data": display_source(str(data)), "seed": protocol.seed, "runs": {},
                              "random_weights": False}
    for run in protocol.runs:
        r = run_vit_eval(VitEvalConfig(model, data, policies=list(protocol.policies), resolution=run.resolution,
                                       limit=run.images, sample_seed=protocol.seed, labels="names",
                                       seed=protocol.seed, out_dir=out_dir, name=f"{name}_{run.label}",
                                       per_layer=False, **common))
        top1 = {"bf16": r["bf16"]["top1"], **{p: v["top1"] for p, v in r["policies"].items()}}
        result["runs"][run.label] = {
            "resolution": run.resolution, "tokens": r["tokens"], "images": r["images"],
            "top1_percent": {p: (None if v is None else 100 * v) for p, v in top1.items()},
            "published_top1_percent": protocol.published.get(run.label, {})}
    return _finish(result, out_dir, name, vit_protocol_markdown)


def vit_protocol_markdown(r: dict) -> str:
    rows = []
    for label, run in r["runs"].items():
        for pol, measured in run["top1_percent"].items():
            pub = run["published_top1_percent"].get(pol)
            rows.append([label, run["resolution"], run["images"], pol, measured, pub, _delta(measured, pub)])
    return "\n".join([f"# ViT top-1, the published protocol: {r['model']}", "",
                      f"Data: `{r['data']}`; images drawn with seed {r['seed']}; top-1 in %.", "",
                      markdown_table(["run", "px", "images", "policy", "top-1 (this run)", "published",
                                      "difference"], rows, digits=2)])


def run_mae_protocol(data: str | os.PathLike, *, model: str | None = None, protocol: MaeProtocol = PAPER["mae"],
                     out_dir: str | os.PathLike | None = None, name: str = "mae_paper", **common: Any) -> dict:
    """The MAE protocol (``fp4vis.evals.mae_psnr.run_mae_eval``) beside the published PSNR."""
    from .mae_psnr import MaeEvalConfig, run_mae_eval

    model = model or protocol.model
    r = run_mae_eval(MaeEvalConfig(model, data, policies=list(protocol.policies), limit=protocol.images,
                                   sample_seed=protocol.seed, mask_ratio=protocol.mask_ratio, seed=protocol.seed,
                                   decoder=False, out_dir=out_dir, name=f"{name}_run", **common))
    result: dict[str, Any] = {
        "eval": "mae_protocol", "protocol": "paper", "model": display_source(model),
        "data": display_source(str(data)), "seed": protocol.seed,
        "images": r["images"], "mask_ratio": r["mask_ratio"], "random_weights": r["random_weights"],
        "bf16_masked_psnr": r["bf16"]["masked_psnr"]["mean"], "published_bf16_masked_psnr": protocol.published_bf16,
        "policies": {p: {"masked_psnr_diff_vs_bf16": v["masked_psnr_diff_vs_bf16"],
                         "published_diff": protocol.published_diff.get(p)} for p, v in r["policies"].items()}}
    return _finish(result, out_dir, name, mae_protocol_markdown)


def mae_protocol_markdown(r: dict) -> str:
    rows = [["bf16", r["bf16_masked_psnr"], None, r["published_bf16_masked_psnr"], None]]
    for pol, v in r["policies"].items():
        d, pub = v["masked_psnr_diff_vs_bf16"], v["published_diff"]
        half = None if d["ci95_high"] is None else (d["ci95_high"] - d["ci95_low"]) / 2
        rows.append([pol, d["mean"], half, pub[0] if pub else None, pub[1] if pub else None])
    return "\n".join([f"# MAE masked-patch PSNR, the published protocol: {r['model']}", "",
                      f"Data: `{r['data']}`; {r['images']} images drawn with seed {r['seed']}; mask ratio "
                      f"{r['mask_ratio']}; encoder attention changed. bf16: the PSNR (dB); policies: FP4 - BF16 "
                      "(dB) and the half-width of its paired 95 % interval.", "",
                      markdown_table(["policy", "this run", "± (95 %)", "published", "published ±"], rows)])


def run_wan_protocol(*, model: str | None = None, protocol: WanProtocol = PAPER["wan"],
                     out_dir: str | os.PathLike | None = None, name: str = "wan_paper", **common: Any) -> dict:
    """The Wan protocol: one run of each length (``fp4vis.evals.wan_fidelity.run_wan_eval``, latents only)
    and the final latents' cosine / relL2 against BF16 beside the published ones of that model size.
    Fidelity only: no BF16 attention baselines (they are speed figures, and not the published protocol's)."""
    from .timed_runs import DEFAULT_PROMPT
    from .wan_fidelity import WanEvalConfig, run_wan_eval

    model = model or protocol.model
    size = protocol.size_of(model)
    result: dict[str, Any] = {"eval": "wan_protocol", "protocol": "paper", "model": model, "model_size": size,
                              "prompt": DEFAULT_PROMPT, "height": protocol.height, "width": protocol.width,
                              "frames": protocol.frames, "guidance_scale": protocol.guidance_scale,
                              "seed": protocol.seed, "steps": {}, "random_weights": False}
    published = protocol.published.get(size, {}) if size else {}
    for steps in protocol.steps:
        r = run_wan_eval(WanEvalConfig(model, policies=list(protocol.policies), prompt=DEFAULT_PROMPT,
                                       height=protocol.height, width=protocol.width, frames=protocol.frames,
                                       steps=steps, guidance_scale=protocol.guidance_scale, seed=protocol.seed,
                                       decode=False, warmup=False, baselines="none", out_dir=out_dir,
                                       name=f"{name}_{steps}steps", **common))
        result["steps"][steps] = {
            p: {"latent_cosine": run.get("latent_cosine"), "latent_rel_l2": run.get("latent_rel_l2"),
                "published": published.get(p, {}).get(steps), "error": run.get("error")}
            for p, run in r["runs"].items() if p != "bf16"}
    return _finish(result, out_dir, name, wan_protocol_markdown)


def wan_protocol_markdown(r: dict) -> str:
    rows = []
    for steps, pols in r["steps"].items():
        for pol, v in pols.items():
            pub = v["published"] or (None, None)
            rows.append([steps, pol, v["latent_cosine"], pub[0], v["latent_rel_l2"], pub[1]])
    size = f"the published rows are Wan2.1-T2V-{r['model_size']}'s" if r["model_size"] else \
        "no published rows for this model (1.3B and 14B were published)"
    return "\n".join([f"# Wan2.1 latent fidelity, the published protocol: {r['model']}", "",
                      f"{r['width']}x{r['height']}, {r['frames']} frames, guidance {r['guidance_scale']}, seed "
                      f"{r['seed']}, only attn1 replaced; prompt (not part of the published protocol): "
                      f"\"{r['prompt']}\"; {size}.", "",
                      markdown_table(["steps", "policy", "latent cosine", "published", "latent relL2", "published"],
                                     rows)])


def _finish(result: dict, out_dir: str | os.PathLike | None, name: str, markdown) -> dict:
    if out_dir is not None:
        files = write_report(out_dir, name, result, markdown(result))
        result["files"] = {k: str(v) for k, v in files.items()}
    return result
