"""The demo: what FP4 attention does to small models that have learned something, on any CPU.

On the models fp4vis ships (``fp4vis.zoo``: a timm ViT digit classifier and a transformers ViTMAE,
trained by ``scripts/train_digits.py``) and the held-out digits shipped beside them, for each policy
(``bf16`` = the model's own attention, the baseline; the FP4 policies through ``fp4vis.patch`` on
the reference backend):

- ViT: top-1 on the held-out digits and agreement with BF16 (``fp4vis.evals.vit_top1``);
- MAE: masked-patch PSNR with its 95 % interval, and the paired FP4 - BF16 difference with its
  95 % interval (``fp4vis.evals.mae_psnr``, same seeded masks for every policy);
- video (``fp4vis:digits-wan``, a Wan2.1 pipeline trained by ``scripts/train_digits_video.py``): one
  clip from its prompt with the same seed and initial noise under every policy
  (``fp4vis.evals.wan_fidelity``): latent cosine and relative L2 against BF16 after 1, 4 and all
  denoising steps, PSNR and SSIM of the decoded frames against BF16's, what the digit reader
  (``fp4vis.zoo.moving_digits``) sees in each clip; a strip of frames BF16 / fast / accurate side by
  side (PNG) and the clips (MP4);
- operator error: each attention layer re-run in isolation under the policy on the inputs it saw in
  the BF16 pass, its output's relative L2 error against the BF16 output, averaged over images and
  layers (ViT: every block; MAE: the encoder blocks, the ones the policy changes; video: the
  self-attention of every block, after 1, 4 and all denoising steps). That is the x of the plot, the quality
  the y: how much the operator moves, and what it costs the task.

Writes ``demo.json``, ``demo.md``, ``demo.png``, ``demo_frames.png``, ``demo_wan_<policy>.mp4`` (and
the evals' own reports) under the output folder.
"""

from __future__ import annotations

import json
import os
import tempfile
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch

from fp4vis import zoo
from fp4vis.evals.common import AttentionRecorder, error_metrics, per_sample
from fp4vis.evals.mae_psnr import load_mae, masking_noise, run_mae_eval
from fp4vis.evals.plots import frame_strip
from fp4vis.evals.report import fmt, markdown_table, mean_ci95, write_report
from fp4vis.evals.vit_top1 import run_vit_eval
from fp4vis.evals.wan_fidelity import run_wan_eval
from fp4vis.files import atomic_path
from fp4vis.services import Timer, UsageError, check_model_source, policy_applied, resolve_policies
from fp4vis.zoo import PREFIX, model_path, verify
from fp4vis.zoo import moving_digits as md
from fp4vis.zoo.digits import HELDOUT_FILE, MAE_SIZE, load_heldout, model_pixels, write_image_folder

DEMO_POLICIES = ("bf16", "fast", "accurate", "guard")
DEFAULT_LIMIT = 200   # held-out digits per model: the demo's ~2 minutes on a 2-core CPU
VIT_MODEL = "digits-vit"
MAE_MODEL = "digits-mae"
VIDEO_MODEL = PREFIX + "digits-wan"
VIDEO_LATENT_STEPS = (1, 4)   # and all steps: as the method's authors report the latent error (and the
                              # steps at which the operator error is measured: every step would double the time)
VIDEO_STRIP = ("bf16", "fast", "accurate")   # the rows of the frame strip, those that ran
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
             log: Callable[[str], Any] | None = None, video_model: str | None = VIDEO_MODEL) -> dict[str, Any]:
    """Run the demo; returns the result and writes demo.json / .md / .png under ``out_dir``.
    ``video_model``: the shipped ``fp4vis:digits-wan`` or a folder written by
    scripts/train_digits_video.py; None leaves the video out."""
    say = log or (lambda _msg: None)
    names = demo_policies(policies)
    fp4 = [p for p in names if p != "bf16"]
    if not fp4:
        raise UsageError("--policies: give at least one FP4 policy besides bf16 (the baseline, always run)")
    if limit is not None and limit < 2:
        raise UsageError(f"--limit: at least 2 images are needed for an interval, got {limit}")
    out = Path(out_dir)
    video_source = check_video_model(video_model)
    records = {name: verify(name) for name in (VIT_MODEL, MAE_MODEL)}   # the shipped weights are the trained ones
    digits = load_heldout().head(limit)
    timings: dict[str, float] = {}
    with tempfile.TemporaryDirectory(prefix="fp4vis-demo-") as tmp, Timer() as total:
        data = write_image_folder(digits, Path(tmp) / "digits")
        say(f"ViT {PREFIX}{VIT_MODEL}: {len(digits)} held-out digits, policies {', '.join(names)}")
        with Timer() as t:
            vit = run_vit_eval(str(model_path(VIT_MODEL)), data, policies=fp4, batch_size=BATCH_SIZE, labels="index",
                               device="cpu", dtype="bfloat16", backend=BACKEND, per_layer=True, seed=SEED,
                               out_dir=out, name=f"{NAME}_vit_top1", progress=progress)
        timings["vit_s"] = t.seconds
        say(f"MAE {PREFIX}{MAE_MODEL}: masked-patch PSNR")
        with Timer() as t:
            mae = run_mae_eval(str(model_path(MAE_MODEL)), data, policies=fp4, batch_size=BATCH_SIZE, seed=SEED,
                               device="cpu", dtype="bfloat16", backend=BACKEND, out_dir=out,
                               name=f"{NAME}_mae_psnr", progress=progress)
        timings["mae_s"] = t.seconds
        say("MAE: per-layer attention error of the encoder")
        with Timer() as t:
            mae_ops = mae_operator_error(str(model_path(MAE_MODEL)), digits.images, fp4)
        timings["mae_operator_s"] = t.seconds
        with Timer() as t:
            video = run_video(video_model, video_source, names, out, progress=progress, say=say)
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


def video_record(video_model: str, source: str) -> dict[str, Any]:
    """The video model's training record: the shipped one checked against its weights (sha256)."""
    if zoo.is_zoo_source(video_model):
        return verify(zoo.get(video_model).name)
    record = Path(source) / "training.json"
    if not record.is_file():
        raise UsageError(f"--video-model: {source!r} has no training.json with its generation settings (size, "
                         "frames, steps, prompt); scripts/train_digits_video.py writes one")
    return json.loads(record.read_text())


def run_video(video_model: str | None, source: str | None, names: Sequence[str], out: Path, *, progress: bool,
              say: Callable[[str], Any]) -> dict[str, Any]:
    """The video part: one clip from the model's own prompt and settings under every policy (same seed and
    noise), through ``run_wan_eval``; the frames read back by the digit reader; a frame strip."""
    if video_model is None:
        return {"model": None, "status": "left out", "note": "left out (--no-video)"}
    if source is None:
        return {"model": video_model, "status": "missing",
                "note": f"the weights of {video_model} are not installed here ({zoo.get(video_model).path}); "
                        "scripts/train_digits_video.py writes them"}
    record = video_record(video_model, source)
    gen = record["generation"]
    say(f"video {video_model}: \"{gen['prompt']}\", {gen['width']}x{gen['height']}, {gen['frames']} frames, "
        f"{gen['steps']} steps, policies {', '.join(names)}")
    frames: dict[str, Any] = {}
    r = run_wan_eval(source, policies=[p for p in names if p != "bf16"], prompt=gen["prompt"], height=gen["height"],
                     width=gen["width"], frames=gen["frames"], steps=gen["steps"],
                     guidance_scale=gen["guidance_scale"], seed=SEED, device="cpu", dtype="bfloat16",
                     backend=BACKEND, warmup=False, save_videos=True, out_dir=out, name=f"{NAME}_wan",
                     progress=progress, latent_steps=VIDEO_LATENT_STEPS, operator_error=True,
                     operator_error_steps=(*VIDEO_LATENT_STEPS, gen["steps"]), fps=gen.get("fps", 8),
                     frames_sink=frames, baselines="none")   # the BF16 baselines are GPU speed figures
    target = md.PROMPTS.index(gen["prompt"]) if gen["prompt"] in md.PROMPTS else None
    reader = md.load_reader()
    reading = {}
    for p, f in frames.items():
        seen = md.read_clips(md.from_frames(f), reader, min_travel=_min_travel(gen))
        d = int(seen.direction[0])
        reading[p] = {"digit": int(seen.digit[0]), "direction": md.DIRECTIONS[d] if d != md.STILL else "still",
                      "digit_frames": float((seen.digit_frames[0] == target // len(md.DIRECTIONS)).float().mean())
                      if target is not None else None}
    strip = frame_strip({p: frames[p] for p in VIDEO_STRIP if p in frames}, out / f"{NAME}_frames.png",
                        title=f"\"{gen['prompt']}\", seed {SEED}, {gen['steps']} steps")
    return {"model": video_model, "status": "measured", "prompt": gen["prompt"], "generation": gen,
            "tokens": r["tokens"], "latent_steps": r["latent_steps"], "eval": r, "reading": reading,
            "weights_sha256": record.get("weights_sha256"), "trained": record.get("final"),
            "files": {"strip": str(strip), "report": r.get("files"),
                      "mp4": {p: run.get("mp4") for p, run in r["runs"].items() if run.get("mp4")}},
            "mp4_skipped": r.get("mp4_skipped")}


def _min_travel(gen: dict[str, Any]) -> float:
    """Half the shortest motion of the model's clips: below it the reader says 'still'."""
    return 0.5 * min(md.MIN_SPEED, md.max_speed(gen["height"], gen["frames"])) * (gen["frames"] - 1)


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
    """The demo's JSON: one row per policy with the ViT, MAE and video figures and the operator errors."""
    rows: dict[str, dict[str, Any]] = {}
    for p in names:
        if p == "bf16":
            v, m = vit["bf16"], mae["bf16"]
            rows[p] = {"vit_top1": v["top1"], "vit_agreement_with_bf16": 1.0, "vit_attention_rel_l2": 0.0,
                       "mae_masked_psnr": mean_ci95(m["masked_psnr_per_image"]), "mae_masked_psnr_diff_vs_bf16": None,
                       "mae_attention_rel_l2": 0.0}
            continue
        v, m = vit["policies"][p], mae["policies"][p]
        rows[p] = {"vit_top1": v["top1"], "vit_agreement_with_bf16": v["agreement_with_bf16"],
                   "vit_attention_rel_l2": _mean(v["per_layer"]["rel_l2_mean"]),
                   "vit_attention_rel_l2_per_layer": dict(zip(vit["layers"], v["per_layer"]["rel_l2_mean"])),
                   "vit_logit_rel_l2_mean": v["logit_rel_l2_mean"],
                   "mae_masked_psnr": mean_ci95(m["masked_psnr_per_image"]),
                   "mae_masked_psnr_diff_vs_bf16": m["masked_psnr_diff_vs_bf16"],
                   "mae_attention_rel_l2": mae_ops[p]["rel_l2_mean"],
                   "mae_attention_rel_l2_per_layer": mae_ops[p]["rel_l2_mean_per_layer"]}
    if video["status"] == "measured":
        for p in names:
            rows[p].update(_video_row(video, p))
        video = {k: v for k, v in video.items() if k != "eval"}   # its report has the whole run
    return {
        "eval": "demo", "policies": rows, "policy_names": list(names), "backend": BACKEND, "device": "cpu",
        "dtype": "bfloat16", "seed": SEED, "images": digits_count,
        "data": f"{HELDOUT_FILE.name} (fp4vis.zoo: held-out MNIST digits, never seen in training), first "
                f"{digits_count}",
        "models": {name: {"model": PREFIX + name, "weights_sha256": rec["weights_sha256"],
                          "trained": rec.get("final"), "tokens": _tokens(name, vit, mae)}
                   for name, rec in records.items()},
        "video": video,
        "operator_error": "relative L2 (fp4vis.metrics.rel_l2) of each attention layer's output re-run under the "
                          "policy on the inputs it saw in the BF16 pass, against its BF16 output; mean over "
                          "images, then over layers (ViT: all blocks; MAE: encoder blocks; video: the "
                          "self-attention of every block, after 1, 4 and all denoising steps)",
        "seconds": timings, "reports": {"vit": vit.get("files"), "mae": mae.get("files"),
                                        "video": (video.get("files") or {}).get("report")},
        "warnings": sorted(set(vit.get("warnings", []) + mae.get("warnings", [])
                               + (video.get("warnings") or []))),
    }


def _video_row(video: dict[str, Any], policy: str) -> dict[str, Any]:
    """The video figures of one policy: latent cosine / relL2 against BF16 after k steps, decoded-frame
    PSNR / SSIM against BF16, the self-attention operator error, what the reader saw."""
    read = video["reading"].get(policy, {})
    seen = {"video_read_digit": read.get("digit"), "video_read_direction": read.get("direction"),
            "video_digit_frames_as_prompted": read.get("digit_frames")}
    if policy == "bf16":
        exact = {str(k): 1.0 for k in video["latent_steps"]}
        return {"video_latent_cosine_after": exact, "video_latent_rel_l2_after": {k: 0.0 for k in exact},
                "video_psnr_db": None, "video_ssim": 1.0, "video_attention_rel_l2": 0.0, **seen}
    run = video["eval"]["runs"][policy]
    if "error" in run:
        return {"video_error": run["error"], **seen}
    after = {str(a["steps"]): a for a in run["latents_after_steps"]}
    return {"video_latent_cosine_after": {k: a["cosine"] for k, a in after.items()},
            "video_latent_rel_l2_after": {k: a["rel_l2"] for k, a in after.items()},
            "video_psnr_db": run["video"]["psnr_mean"], "video_ssim": run["video"]["ssim_mean"],
            "video_attention_rel_l2": run["attention_rel_l2"]["rel_l2_mean"],
            "video_attention_rel_l2_per_layer": run["attention_rel_l2"]["rel_l2_mean_per_layer"], **seen}


def _tokens(name: str, vit: dict[str, Any], mae: dict[str, Any]) -> str:
    if name == VIT_MODEL:
        return f"{vit['tokens']} tokens (7 x 7 patches; average pooling, no class token)"
    return "50 in the encoder (49 visible patches of 196 + cls, mask 0.75); 197 in the decoder (exact)"


def _mean(values: Sequence[float]) -> float:
    return float(sum(values) / len(values))


def _interval(ci: dict[str, Any] | None) -> str:
    if not ci or ci.get("ci95_low") is None:
        return "n/a"
    return f"{ci['mean']:.3f} [{ci['ci95_low']:.3f}, {ci['ci95_high']:.3f}]"


def table_rows(result: dict[str, Any]) -> list[list[Any]]:
    rows = []
    for name, r in result["policies"].items():
        top1 = None if r["vit_top1"] is None else 100 * r["vit_top1"]
        rows.append([name, top1, 100 * r["vit_agreement_with_bf16"], r["vit_attention_rel_l2"],
                     _interval(r["mae_masked_psnr"]), _interval(r["mae_masked_psnr_diff_vs_bf16"]),
                     r["mae_attention_rel_l2"]])
    return rows


TABLE_HEADERS = ["policy", "ViT top-1 %", "agree w/ bf16 %", "ViT attn relL2", "MAE masked PSNR dB [95 %]",
                 "PSNR - bf16 dB [95 %]", "MAE attn relL2"]


def video_headers(result: dict[str, Any]) -> list[str]:
    steps = result["video"]["latent_steps"]
    return (["policy"] + [f"cos @{k}" for k in steps] + [f"relL2 @{steps[-1]}", "frames PSNR dB", "SSIM",
                                                           "attn relL2", "reads as"])


def video_table_rows(result: dict[str, Any]) -> list[list[Any]]:
    steps = [str(k) for k in result["video"]["latent_steps"]]
    rows = []
    for name, r in result["policies"].items():
        if "video_error" in r:
            rows.append([name, "failed: " + r["video_error"][:80]] + [None] * (len(steps) + 4))
            continue
        cos = r["video_latent_cosine_after"]
        psnr = "inf (itself)" if name == "bf16" else r["video_psnr_db"]
        read = f"{r['video_read_digit']} {r['video_read_direction']}" if r.get("video_read_digit") is not None else None
        rows.append([name, *(cos[k] for k in steps), r["video_latent_rel_l2_after"][steps[-1]], psnr,
                     r["video_ssim"], r["video_attention_rel_l2"], read])
    return rows


def _text_table(headers: list[str], rows: list[list[Any]], digits: int = 4) -> str:
    cells = [headers] + [[fmt(c, digits) if not isinstance(c, str) else c for c in row] for row in rows]
    widths = [max(len(row[i]) for row in cells) for i in range(len(headers))]
    lines = ["  ".join(c.ljust(w) for c, w in zip(row, widths)).rstrip() for row in cells]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)


def summary_table(result: dict[str, Any]) -> str:
    """The short tables the command prints (plain text, aligned columns): the image models, then the video."""
    text = _text_table(TABLE_HEADERS, table_rows(result))
    if result["video"]["status"] == "measured":
        v = result["video"]
        text += (f"\n\nvideo {v['model']}: \"{v['prompt']}\", {v['tokens']} tokens, latents and frames against "
                 "bf16\n" + _text_table(video_headers(result), video_table_rows(result), 6))
    return text


def demo_markdown(r: dict[str, Any]) -> str:
    vit, mae, video = r["models"][VIT_MODEL], r["models"][MAE_MODEL], r["video"]
    lines = [
        "# fp4vis demo: FP4 attention on small trained models", "",
        f"{r['images']} held-out handwritten digits ({r['data']}), {r['dtype']} models on the CPU, FP4 policies on "
        f"the `{r['backend']}` backend (the exact emulation of docs/numerics.md); `bf16` is the models' own "
        "attention, the baseline.", "",
        f"- `{vit['model']}`: timm ViT classifier, {vit['tokens']}; trained to "
        f"{100 * vit['trained']['heldout_top1']:.1f} % held-out top-1 in float32.",
        f"- `{mae['model']}`: transformers ViTMAE, {mae['tokens']}; trained to "
        f"{mae['trained']['masked_psnr_db']:.2f} dB masked-patch PSNR in float32 (predicting the mean training image: "
        f"{mae['trained']['trivial_mean_image_masked_psnr_db']:.2f} dB).",
        _video_line(video), "",
        markdown_table(TABLE_HEADERS, table_rows(r)), "",
        "ViT top-1: torchmetrics micro accuracy over the digits; agreement: the fraction whose FP4 class equals the "
        "BF16 one. MAE masked PSNR: per image over the masked patches in [0, 1] pixels, then the mean with its 95 % "
        "Student-t interval; PSNR - bf16: the paired per-image difference with its interval (identical seeded masks "
        f"for every policy). attn relL2: {r['operator_error']}.", "",
    ]
    if video["status"] == "measured":
        g = video["generation"]
        mp4 = video["files"]["mp4"]
        lines += [
            f"## Video: `{video['model']}`", "",
            f"One clip of \"{video['prompt']}\": {g['width']}x{g['height']}, {g['frames']} frames "
            f"({video['tokens']} tokens per self-attention), {g['steps']} steps of the pipeline's scheduler, "
            f"guidance {g['guidance_scale']}, seed {r['seed']}: the same initial noise and prompt embeddings for every "
            "policy.", "",
            markdown_table(video_headers(r), video_table_rows(r), digits=6), "",
            "cos @k / relL2 @k: the latents after k denoising steps against BF16's (fp4vis.metrics). Frames PSNR / "
            "SSIM: the decoded frames against BF16's (torchmetrics, per frame in [0, 1], then the mean). attn relL2: "
            "the operator error of the transformer's self-attention (every block, after 1, 4 and all steps). Reads as: "
            "the digit "
            "and direction the reader (fp4vis:digits-vit on 28 px crops around the digit, fp4vis.zoo.moving_digits) "
            "sees in the clip.", "",
            f"![frames, rows {' / '.join(p for p in VIDEO_STRIP if p in r['policies'])}]"
            f"({Path(video['files']['strip']).name})", "",
            ("Clips: " + ", ".join(f"[{p}]({Path(f).name})" for p, f in mp4.items()) + "." if mp4 else
             f"Clips: not written ({video.get('mp4_skipped')})."), "",
        ]
    secs = r["seconds"]
    lines += [
        f"![quality against operator error]({NAME}.png)", "",
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
    gen = next((c for c in t.get("generated", []) if c["steps"] == video["generation"]["steps"]), None)
    read = (f"; generated from {gen['clips']} prompts at these settings, its clips read as the prompted digit "
            f"{100 * gen['digit_accuracy']:.0f} % and direction {100 * gen['direction_accuracy']:.0f} % of the time"
            if gen else "")
    vae = f", VAE {t['vae_heldout_psnr_db']:.1f} dB PSNR on held-out clips" if "vae_heldout_psnr_db" in t else ""
    return (f"- `{video['model']}`: diffusers Wan2.1 text-to-video pipeline of moving digits, {video['tokens']} tokens"
            f"{vae}{read} (its training record).")


def quality_error_plot(r: dict[str, Any], path: str | os.PathLike) -> Path:
    """One panel per model, one point per policy: ViT top-1, MAE masked PSNR - BF16 (95 % interval) and the
    video's decoded-frame PSNR against BF16 (when measured), against the operator error of that model's
    attention layers."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    video = r["video"]["status"] == "measured"
    fig, axes = plt.subplots(1, 3 if video else 2, figsize=(14.5 if video else 10.0, 4.2), dpi=120)
    ax_vit, ax_mae = axes[0], axes[1]
    for i, (name, row) in enumerate(r["policies"].items()):
        label_at = (5, 4 - 11 * (i % 3))   # policies close together keep readable labels
        color = f"C{i}"                     # one colour per policy in every panel
        x = row["vit_attention_rel_l2"]
        y = None if row["vit_top1"] is None else 100 * row["vit_top1"]
        if y is not None:
            ax_vit.scatter([x], [y], s=46, zorder=3, color=color)
            ax_vit.annotate(name, (x, y), textcoords="offset points", xytext=label_at, fontsize=8)
        d = row["mae_masked_psnr_diff_vs_bf16"] or {"mean": 0.0, "ci95_low": None}
        x = row["mae_attention_rel_l2"]
        err = None if d.get("ci95_low") is None else [[d["mean"] - d["ci95_low"]], [d["ci95_high"] - d["mean"]]]
        ax_mae.errorbar([x], [d["mean"]], yerr=err, fmt="o", capsize=4, zorder=3, color=color)
        ax_mae.annotate(name, (x, d["mean"]), textcoords="offset points", xytext=label_at, fontsize=8)
        if video and row.get("video_psnr_db") is not None:
            x, y = row["video_attention_rel_l2"], row["video_psnr_db"]
            axes[2].scatter([x], [y], s=46, zorder=3, color=color)
            axes[2].annotate(name, (x, y), textcoords="offset points", xytext=label_at, fontsize=8)
    ax_vit.set_title(f"{r['models'][VIT_MODEL]['model']}: {r['images']} held-out digits", fontsize=9)
    ax_vit.set_xlabel("attention output relL2 vs BF16 (mean over layers)")
    ax_vit.set_ylabel("top-1 (%)")
    ax_mae.set_title(f"{r['models'][MAE_MODEL]['model']}: masked-patch PSNR", fontsize=9)
    ax_mae.set_xlabel("encoder attention output relL2 vs BF16 (mean over layers)")
    ax_mae.set_ylabel("PSNR - BF16 (dB), paired, 95 % interval")
    ax_mae.axhline(0.0, color="grey", lw=0.8, zorder=1)
    if video:
        axes[2].set_title(f"{r['video']['model']}: \"{r['video']['prompt']}\"", fontsize=9)
        axes[2].set_xlabel("self-attention relL2 vs BF16 (mean over layers, steps)")
        axes[2].set_ylabel("frames' PSNR vs BF16 (dB, mean)")
        axes[2].set_xlim(0, axes[2].get_xlim()[1] * 1.1)   # from zero, as the other panels: close errors stay close
    for ax in axes:
        ax.grid(True, alpha=0.3, zorder=0)
    note = "" if video else f"; video: {r['video']['note']}"
    fig.suptitle(f"fp4vis demo, {r['backend']} backend on the CPU{note}", fontsize=10)
    fig.tight_layout()
    with atomic_path(path) as tmp:
        fig.savefig(tmp, format="png")
    plt.close(fig)
    return Path(path)
