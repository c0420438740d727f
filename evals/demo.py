"""The demo: what FP4 attention does to small models that have learned something, on any CPU.

On the models fp4vis ships (``fp4vis.zoo``: a timm ViT digit classifier and a transformers ViTMAE,
trained by ``scripts/train_digits.py``) and the held-out digits shipped beside them, for each policy
(``bf16`` = the model's own attention, the baseline; the FP4 policies through ``fp4vis.patch`` on
the reference backend):

- ViT: top-1 on the held-out digits, its paired difference to BF16 with a 95 % interval, and
  agreement with BF16 (``fp4vis.evals.vit_top1``);
- MAE: masked-patch PSNR with its 95 % interval, and the paired FP4 - BF16 difference with its
  95 % interval (``fp4vis.evals.mae_psnr``, same seeded masks for every policy);
- video (``fp4vis:digits-wan``, a Wan2.1 pipeline trained by ``scripts/train_digits_video.py``), in
  float32 over a set of prompts (``fp4vis.evals.demo_video``): latents and frames against BF16 with
  intervals over the clips, the reader's digit and direction rates with theirs, the paired
  difference of each policy to ``fast``, and the layers' logit range from ``fp4vis.calibrate``;
- operator error: each attention layer re-run in isolation under the policy on the inputs it saw in
  the BF16 pass, its output's relative L2 error against the BF16 output, averaged over images and
  layers (ViT: every block; MAE: the encoder blocks, the ones the policy changes; video: the
  self-attention of every block, after 1, 4 and all denoising steps): how much the operator moves,
  beside what it costs the task.

Writes ``demo.json``, ``demo.md``, ``demo.png`` (each quality difference to BF16 with its interval),
``demo_frames.png``, ``demo_clips.png``, ``demo_wan_<policy>.mp4`` (and the evals' own reports) under
the output folder.
"""

from __future__ import annotations

import os
import tempfile
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch

from fp4vis import zoo
from fp4vis.evals.common import AttentionRecorder, error_metrics, per_sample
from fp4vis.evals.demo_defaults import DEFAULT_CLIPS, DEFAULT_LIMIT, DEMO_POLICIES, VIDEO_MODEL
from fp4vis.evals.demo_video import run_video as run_video_section
from fp4vis.evals.demo_video import text_table, video_summary
from fp4vis.evals.mae_psnr import MaeEvalConfig, load_mae, masking_noise, run_mae_eval
from fp4vis.evals.report import markdown_table, mean_ci95, write_report
from fp4vis.evals.vit_top1 import VitEvalConfig, run_vit_eval
from fp4vis.files import atomic_path
from fp4vis.services.policies import policy_applied, resolve_policies
from fp4vis.services.sources import check_model_source
from fp4vis.services.timing import Timer
from fp4vis.services.usage import UsageError
from fp4vis.zoo import PREFIX, model_path, verify
from fp4vis.zoo.digits import HELDOUT_FILE, MAE_SIZE, load_heldout, model_pixels, write_image_folder

VIT_MODEL = "digits-vit"
MAE_MODEL = "digits-mae"
BACKEND = "reference"  # the demo runs on the CPU: the exact emulation of the numerics contract
SEED = 0
BATCH_SIZE = 50
NAME = "demo"


def demo_policies(names: str | Sequence[str]) -> list[str]:
    """The policies to compare, bf16 (the baseline) first and always; unknown names raise."""
    pols = [p.name for p in resolve_policies(names)]
    return ["bf16"] + [p for p in pols if p != "bf16"]


def run_demo(out_dir: str | os.PathLike, *, policies: str | Sequence[str] = DEMO_POLICIES,
             limit: int | None = DEFAULT_LIMIT, progress: bool = True,
             log: Callable[[str], Any] | None = None, video_model: str | None = VIDEO_MODEL,
             video_clips: int = DEFAULT_CLIPS) -> dict[str, Any]:
    """Run the demo; returns the result and writes demo.json / .md / .png under ``out_dir``.
    ``video_model``: the shipped ``fp4vis:digits-wan`` or a folder written by
    scripts/train_digits_video.py; None leaves the video out. ``video_clips``: prompts of the video
    section (``fp4vis.evals.demo_video``)."""
    say = log or (lambda _msg: None)
    names = demo_policies(policies)
    fp4 = [p for p in names if p != "bf16"]
    if not fp4:
        raise UsageError("--policies: give at least one FP4 policy besides bf16 (the baseline, always run)")
    if limit is not None and limit < 2:
        raise UsageError(f"--limit: at least 2 images are needed for an interval, got {limit}")
    if not 2 <= video_clips <= 40:
        raise UsageError(f"--video-clips: between 2 (an interval) and 40 (the model's prompts), got {video_clips}")
    out = Path(out_dir)
    video_source = check_video_model(video_model)
    records = {name: verify(name) for name in (VIT_MODEL, MAE_MODEL)}   # the shipped weights are the trained ones
    digits = load_heldout().head(limit)
    timings: dict[str, float] = {}
    with tempfile.TemporaryDirectory(prefix="fp4vis-demo-") as tmp, Timer() as total:
        data = write_image_folder(digits, Path(tmp) / "digits")
        say(f"ViT {PREFIX}{VIT_MODEL}: {len(digits)} held-out digits, policies {', '.join(names)}")
        with Timer() as t:
            vit = run_vit_eval(VitEvalConfig(PREFIX + VIT_MODEL, data, policies=fp4, batch_size=BATCH_SIZE,
                                             labels="index", device="cpu", dtype="bfloat16", backend=BACKEND,
                                             per_layer=True, seed=SEED, out_dir=out, name=f"{NAME}_vit_top1",
                                             progress=progress))
        timings["vit_s"] = t.seconds
        say(f"MAE {PREFIX}{MAE_MODEL}: masked-patch PSNR")
        with Timer() as t:
            mae = run_mae_eval(MaeEvalConfig(PREFIX + MAE_MODEL, data, policies=fp4, batch_size=BATCH_SIZE,
                                             seed=SEED, device="cpu", dtype="bfloat16", backend=BACKEND, out_dir=out,
                                             name=f"{NAME}_mae_psnr", progress=progress))
        timings["mae_s"] = t.seconds
        say("MAE: per-layer attention error of the encoder")
        with Timer() as t:
            mae_ops = mae_operator_error(str(model_path(MAE_MODEL)), digits.images, fp4)
        timings["mae_operator_s"] = t.seconds
        with Timer() as t:
            video = run_video_section(video_model, video_source, names, out, clips=video_clips, progress=progress,
                                      say=say)
        timings["video_s"] = t.seconds
    timings["total_s"] = total.seconds
    result = demo_result(names, digits_count=len(digits), vit=vit, mae=mae, mae_ops=mae_ops, records=records,
                         timings=timings, video=video)
    files = write_report(out, NAME, result, demo_markdown(result))
    files["plot"] = quality_error_plot(result, out / f"{NAME}.png")
    result["files"] = {k: str(v) for k, v in files.items()}
    return result


def check_video_model(video_model: str | None) -> str | None:
    """The folder of the video model, checked before any work; None when the video is left out or the
    shipped weights are not installed (the report says so)."""
    if video_model is None:
        return None
    if zoo.is_zoo_source(video_model):
        name = zoo.get(video_model, "--video-model").name
        return str(zoo.model_path(name)) if zoo.is_available(name) else None
    src, is_local = check_model_source(video_model, "--video-model")
    if not is_local or not (Path(src) / "model_index.json").is_file():
        raise UsageError(f"--video-model: {video_model!r} is not a local Wan pipeline folder (model_index.json); "
                         f"give {VIDEO_MODEL} or a folder written by scripts/train_digits_video.py")
    return src


@torch.no_grad()
def mae_operator_error(source: str, images, policies: Sequence[str], *, seed: int = SEED,
                       batch_size: int = BATCH_SIZE) -> dict[str, dict[str, Any]]:
    """Per policy: the relative L2 error of each MAE encoder attention layer, re-run under the policy
    on the inputs it saw in the BF16 pass (the eval's seeded masks), against its BF16 output."""
    model, mean, std, _ = load_mae(source, device="cpu", dtype=torch.bfloat16, seed=seed)
    _, rel_l2 = error_metrics()
    mean_t, std_t = torch.tensor(mean).view(1, 3, 1, 1), torch.tensor(std).view(1, 3, 1, 1)
    num_patches = (model.config.image_size // model.config.patch_size) ** 2
    errors: dict[str, dict[str, list[float]]] = {p: {} for p in policies}
    for start in range(0, len(images), batch_size):
        x01 = model_pixels(images[start:start + batch_size], MAE_SIZE)
        noise = masking_noise(torch.arange(start, start + len(x01)), num_patches, seed)
        recorder = AttentionRecorder(model.vit)   # the encoder: the layers the policies change
        with recorder:
            model(pixel_values=((x01 - mean_t) / std_t).to(torch.bfloat16), noise=noise)
        for p in policies:
            with policy_applied(model, p, backend=BACKEND):
                rerun = recorder.rerun()
            for layer, (new, ref) in rerun.items():
                errors[p].setdefault(f"vit.{layer}", []).extend(per_sample(rel_l2, new, ref))
    return {p: {"rel_l2_mean_per_layer": {k: sum(v) / len(v) for k, v in layers.items()},
                "rel_l2_mean": sum(sum(v) / len(v) for v in layers.values()) / len(layers)}
            for p, layers in errors.items()}


def demo_result(names: Sequence[str], *, digits_count: int, vit: dict[str, Any], mae: dict[str, Any],
                mae_ops: dict[str, dict[str, Any]], records: dict[str, dict[str, Any]],
                timings: dict[str, float], video: dict[str, Any]) -> dict[str, Any]:
    """The demo's JSON: one row per policy with the ViT and MAE figures and the operator errors; the video
    section's own result (per policy, per clip) under ``video``."""
    rows: dict[str, dict[str, Any]] = {}
    for p in names:
        if p == "bf16":
            v, m = vit["bf16"], mae["bf16"]
            rows[p] = {"vit_top1": v["top1"], "vit_top1_diff_vs_bf16": None, "vit_agreement_with_bf16": 1.0,
                       "vit_attention_rel_l2": 0.0, "mae_masked_psnr": mean_ci95(m["masked_psnr_per_image"]),
                       "mae_masked_psnr_diff_vs_bf16": None, "mae_attention_rel_l2": 0.0}
            continue
        v, m = vit["policies"][p], mae["policies"][p]
        rows[p] = {"vit_top1": v["top1"], "vit_top1_diff_vs_bf16": v.get("top1_delta_vs_bf16_ci95"),
                   "vit_agreement_with_bf16": v["agreement_with_bf16"],
                   "vit_attention_rel_l2": _mean(v["per_layer"]["rel_l2_mean"]),
                   "vit_attention_rel_l2_per_layer": dict(zip(vit["layers"], v["per_layer"]["rel_l2_mean"])),
                   "vit_logit_rel_l2_mean": v["logit_rel_l2_mean"],
                   "mae_masked_psnr": mean_ci95(m["masked_psnr_per_image"]),
                   "mae_masked_psnr_diff_vs_bf16": m["masked_psnr_diff_vs_bf16"],
                   "mae_attention_rel_l2": mae_ops[p]["rel_l2_mean"],
                   "mae_attention_rel_l2_per_layer": mae_ops[p]["rel_l2_mean_per_layer"]}
    return {
        "eval": "demo", "policies": rows, "policy_names": list(names), "backend": BACKEND, "device": "cpu",
        "dtype": "bfloat16", "seed": SEED, "images": digits_count,
        "data": f"{HELDOUT_FILE.name} (fp4vis.zoo: held-out MNIST digits, never seen in training), first "
                f"{digits_count}",
        "models": {name: {"model": PREFIX + name, "weights_sha256": rec["weights_sha256"],
                          "trained": rec.get("final"), "tokens": _tokens(name, vit)}
                   for name, rec in records.items()},
        "video": video,
        "operator_error": "relative L2 (fp4vis.metrics.rel_l2) of each attention layer's output re-run under the "
                          "policy on the inputs it saw in the BF16 pass, against its BF16 output; mean over "
                          "images, then over layers (ViT: all blocks; MAE: encoder blocks; video: the "
                          "self-attention of every block, after 1, 4 and all denoising steps)",
        "seconds": timings, "reports": {"vit": vit.get("files"), "mae": mae.get("files"),
                                        "video": (video.get("files") or {}).get("report")},
        "warnings": sorted(set(vit.get("warnings", []) + mae.get("warnings", []))),
    }


def _tokens(name: str, vit: dict[str, Any]) -> str:
    if name == VIT_MODEL:
        return f"{vit['tokens']} tokens (7 x 7 patches; average pooling, no class token)"
    return "50 in the encoder (49 visible patches of 196 + cls, mask 0.75); 197 in the decoder (exact)"


def _mean(values: Sequence[float]) -> float:
    return float(sum(values) / len(values))


def _interval(ci: dict[str, Any] | None, digits: int = 3, scale: float = 1.0, sign: bool = False) -> str:
    if not ci or ci.get("ci95_low") is None:
        return "n/a"
    f = f"{'+' if sign else ''}.{digits}f"
    return f"{scale * ci['mean']:{f}} [{scale * ci['ci95_low']:{f}}, {scale * ci['ci95_high']:{f}}]"


def table_rows(result: dict[str, Any]) -> list[list[str]]:
    rows = []
    for name, r in result["policies"].items():
        top1 = "n/a" if r["vit_top1"] is None else f"{100 * r['vit_top1']:.1f}"
        d = r["vit_top1_diff_vs_bf16"]
        diff = "n/a" if d is None else f"{_interval(d, 1, 100, sign=True)} (+{d['gained']}/-{d['lost']})"
        rows.append([name, top1, diff, f"{100 * r['vit_agreement_with_bf16']:.1f}",
                     f"{r['vit_attention_rel_l2']:.4f}", _interval(r["mae_masked_psnr"]),
                     _interval(r["mae_masked_psnr_diff_vs_bf16"], sign=True), f"{r['mae_attention_rel_l2']:.4f}"])
    return rows


TABLE_HEADERS = ["policy", "ViT top-1 %", "top-1 - bf16 pts [95 %] (+gained/-lost)", "agree w/ bf16 %",
                 "ViT attn relL2", "MAE masked PSNR dB [95 %]", "PSNR - bf16 dB [95 %]", "MAE attn relL2"]


def summary_table(result: dict[str, Any]) -> str:
    """The tables the command prints (plain text, aligned columns): the image models, then the video."""
    text = (f"image models: {result['images']} held-out digits, bfloat16, mean [95 % interval]\n"
            + text_table(TABLE_HEADERS, table_rows(result)))
    if result["video"]["status"] == "measured":
        text += "\n\n" + video_summary(result["video"])
    return text


def demo_markdown(r: dict[str, Any]) -> str:
    vit, mae, video = r["models"][VIT_MODEL], r["models"][MAE_MODEL], r["video"]
    lines = [
        "# fp4vis demo: FP4 attention on small trained models", "",
        f"{r['images']} held-out handwritten digits ({r['data']}), {r['dtype']} image models on the CPU, FP4 policies "
        f"on the `{r['backend']}` backend (the exact emulation of docs/numerics.md); `bf16` is the models' own "
        "attention, the baseline.", "",
        f"- `{vit['model']}`: timm ViT classifier, {vit['tokens']}; trained to "
        f"{100 * vit['trained']['heldout_top1']:.1f} % held-out top-1 in float32.",
        f"- `{mae['model']}`: transformers ViTMAE, {mae['tokens']}; trained to "
        f"{mae['trained']['masked_psnr_db']:.2f} dB masked-patch PSNR in float32 (predicting the mean training image: "
        f"{mae['trained']['trivial_mean_image_masked_psnr_db']:.2f} dB).",
        _video_line(video), "",
        markdown_table(TABLE_HEADERS, table_rows(r)), "",
        "ViT top-1: torchmetrics micro accuracy over the digits; top-1 - bf16: the paired difference on the same "
        "digits with the 95 % interval of Agresti and Min, and the digits gained / lost; agreement: the fraction whose "
        "FP4 class equals the BF16 one. MAE masked PSNR: per image over the masked patches in [0, 1] pixels, then "
        "the mean with its 95 % Student-t interval; PSNR - bf16: the paired per-image difference with its interval "
        f"(identical seeded masks for every policy). attn relL2: {r['operator_error']}.", "",
    ]
    if video["status"] == "measured":
        lines += [f"## Video: `{video['model']}`", "",
                  f"The video section's own report: [{Path(video['files']['report']['markdown']).name}]"
                  f"({Path(video['files']['report']['markdown']).name}) (per clip, per layer).", "",
                  "```", video_summary(video), "```", "",
                  f"![the first clip under each policy]({Path(video['files']['strip']).name})", "",
                  f"![the middle frame of every clip under each policy]({Path(video['files']['sheet']).name})", ""]
        mp4 = video["files"]["mp4"]
        lines += [("Clips of the first prompt: " + ", ".join(f"[{p}]({Path(f).name})" for p, f in mp4.items()) + "."
                   if mp4 else f"Clips: not written ({video['files'].get('mp4_skipped')})."), ""]
    secs = r["seconds"]
    lines += [
        f"![quality differences to BF16 with their intervals]({NAME}.png)", "",
        f"Runtime: {secs['total_s']:.1f} s (ViT {secs['vit_s']:.1f} s, MAE {secs['mae_s']:.1f} s, MAE operator error "
        f"{secs['mae_operator_s']:.1f} s, video {secs['video_s']:.1f} s). Each eval's own report: "
        + ", ".join(f"[{Path(f['markdown']).name}]({Path(f['markdown']).name})"
                    for f in r["reports"].values() if f) + ".",
    ]
    return "\n".join(lines)


def _video_line(video: dict[str, Any]) -> str:
    if video["status"] != "measured":
        return f"- video: {video['note']}."
    t = video.get("trained") or {}
    vae = f", VAE {t['vae_heldout_psnr_db']:.1f} dB PSNR on held-out clips" if "vae_heldout_psnr_db" in t else ""
    return (f"- `{video['model']}`: diffusers Wan2.1 text-to-video pipeline of moving digits, {video['tokens']} tokens"
            f"{vae} (its training record); run in {video['dtype']}.")


def quality_error_plot(r: dict[str, Any], path: str | os.PathLike) -> Path:
    """What each FP4 policy costs each model, against BF16, with its 95 % interval: ViT top-1 (paired,
    points), MAE masked PSNR (paired, dB), and for the video (when measured) the frames' PSNR against
    BF16's and the reader's digit and direction rates (Wilson), BF16's own rate beside them. The x axis
    lists the policies, each with its operator error (the attention layers' relL2) under its name."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    video = r["video"] if r["video"]["status"] == "measured" else None
    fp4 = [p for p in r["policies"] if p != "bf16"]
    fig, axes = plt.subplots(1, 4 if video else 2, figsize=(17.0 if video else 9.0, 4.4), dpi=110)

    def bars(ax, names, cis, scale=1.0, color="C0", offset=0.0, label=None):
        for i, ci in enumerate(cis):
            if ci is None or ci.get("ci95_low") is None:
                continue
            y = scale * (ci["mean"] if "mean" in ci else ci["rate"])
            lo, hi = scale * ci["ci95_low"], scale * ci["ci95_high"]
            ax.errorbar([i + offset], [y], yerr=[[y - lo], [hi - y]], fmt="o", capsize=4, color=color, zorder=3,
                        label=label if i == 0 else None)

    def ticks(ax, names, errors):
        ax.set_xticks(range(len(names)))
        ax.set_xticklabels([f"{n}\nattn relL2 {e:.3f}" if e is not None else n for n, e in zip(names, errors)],
                           fontsize=8)
        ax.set_xlim(-0.6, len(names) - 0.4)

    ax = axes[0]
    bars(ax, fp4, [r["policies"][p]["vit_top1_diff_vs_bf16"] for p in fp4], scale=100)
    ticks(ax, fp4, [r["policies"][p]["vit_attention_rel_l2"] for p in fp4])
    ax.axhline(0.0, color="grey", lw=0.8, zorder=1)
    ax.set_title(f"{r['models'][VIT_MODEL]['model']}: {r['images']} held-out digits", fontsize=9)
    ax.set_ylabel("top-1 - BF16 (points), paired, 95 % interval")
    ax = axes[1]
    bars(ax, fp4, [r["policies"][p]["mae_masked_psnr_diff_vs_bf16"] for p in fp4])
    ticks(ax, fp4, [r["policies"][p]["mae_attention_rel_l2"] for p in fp4])
    ax.axhline(0.0, color="grey", lw=0.8, zorder=1)
    bf16_psnr = r["policies"]["bf16"]["mae_masked_psnr"]["mean"]
    ax.set_title(f"{r['models'][MAE_MODEL]['model']}: masked-patch PSNR, {r['images']} digits\n"
                 f"(BF16 itself: {bf16_psnr:.2f} dB; the axis spans a fraction of a dB)", fontsize=9)
    ax.set_ylabel("PSNR - BF16 (dB), paired, 95 % interval")
    if video:
        vp = video["policies"]
        ax = axes[2]
        # each policy against the reference FP4 policy, clip by clip: the absolute PSNRs' intervals overlap
        # and do not say whether one policy is closer to exact attention than another; the paired ones do
        ref = video["paired_with"]
        others = list(video["paired"])
        bars(ax, others, [video["paired"][p]["psnr_db"] for p in others])
        ticks(ax, others, [vp[p]["attention_rel_l2"] for p in others])
        ax.axhline(0.0, color="grey", lw=0.8, zorder=1)
        own = vp[ref]["psnr_db"]
        ax.set_title(f"{video['model']} ({video['dtype']}), {video['clips']} clips: frames' PSNR against exact\n"
                     f"attention, each policy - {ref} ({ref} itself: {own['mean']:.1f} dB "
                     f"[{own['ci95_low']:.1f}, {own['ci95_high']:.1f}])", fontsize=9)
        ax.set_ylabel(f"PSNR - {ref}'s (dB), paired over clips, 95 % interval")
        ax = axes[3]
        every = list(vp)
        bars(ax, every, [vp[p]["digit_read"] for p in every], scale=100, color="C1", offset=-0.1,
             label="prompted digit")
        bars(ax, every, [vp[p]["direction_read"] for p in every], scale=100, color="C2", offset=0.1,
             label="prompted direction")
        ticks(ax, every, [None] * len(every))   # the operator errors stand under the panel beside
        ax.set_ylim(0, 105)
        ax.legend(fontsize=8, loc="lower left")
        ax.set_title(f"{video['model']}: what the reader sees, {video['clips']} clips", fontsize=9)
        ax.set_ylabel("clips read as prompted (%), 95 % Wilson interval")
    for ax in axes:
        ax.grid(True, axis="y", alpha=0.3, zorder=0)
    note = "" if video else f"; video: {r['video']['note']}"
    fig.suptitle(f"fp4vis demo: each policy against BF16 (exact attention), {r['backend']} backend on the CPU{note}; "
                 "attn relL2: the attention layers' output error against exact attention", fontsize=10)
    fig.tight_layout()
    with atomic_path(path) as tmp:
        fig.savefig(tmp, format="png")
    plt.close(fig)
    return Path(path)
