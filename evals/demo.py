"""The demo: what FP4 attention does to small models that have learned something, on any CPU.

On the models fp4vis ships (``fp4vis.zoo``: a timm ViT digit classifier and a transformers ViTMAE,
trained by ``scripts/train_digits.py``) and the held-out digits shipped beside them, for each policy
(``bf16`` = the model's own attention, the baseline; the FP4 policies through ``fp4vis.patch`` on
the reference backend):

- ViT: top-1 on the held-out digits and agreement with BF16 (``fp4vis.evals.vit_top1``);
- MAE: masked-patch PSNR with its 95 % interval, and the paired FP4 - BF16 difference with its
  95 % interval (``fp4vis.evals.mae_psnr``, same seeded masks for every policy);
- operator error: each attention layer re-run in isolation under the policy on the inputs it saw in
  the BF16 pass, its output's relative L2 error against the BF16 output, averaged over images and
  layers (ViT: every block; MAE: the encoder blocks, the ones the policy changes). That is the x of
  the plot, the quality the y: how much the operator moves, and what it costs the task.

Writes ``demo.json``, ``demo.md`` and ``demo.png`` (and the two evals' own reports) under the output
folder. The video (Wan) model is not shipped yet; the report says so.
"""

from __future__ import annotations

import os
import tempfile
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch

from fp4vis.evals.common import AttentionRecorder, error_metrics, per_sample
from fp4vis.evals.mae_psnr import load_mae, masking_noise, run_mae_eval
from fp4vis.evals.report import fmt, markdown_table, mean_ci95, write_report
from fp4vis.evals.vit_top1 import run_vit_eval
from fp4vis.files import atomic_path
from fp4vis.services import Timer, UsageError, policy_applied, resolve_policies
from fp4vis.zoo import NOT_SHIPPED, PREFIX, model_path, verify
from fp4vis.zoo.digits import HELDOUT_FILE, MAE_SIZE, load_heldout, model_pixels, write_image_folder

DEMO_POLICIES = ("bf16", "fast", "accurate", "guard")
DEFAULT_LIMIT = 200   # held-out digits per model: the demo's ~2 minutes on a 2-core CPU
VIT_MODEL = "digits-vit"
MAE_MODEL = "digits-mae"
BACKEND = "reference"  # the demo runs on the CPU: the exact emulation of the numerics contract
SEED = 0
BATCH_SIZE = 50
VIDEO_STATUS = ("not shipped yet: " + NOT_SHIPPED["digits-wan"] + ". The demo measures no video model; "
                "`fp4vis eval wan` runs the real Wan architecture with random weights (labelled so).")
NAME = "demo"


def demo_policies(names: str | Sequence[str]) -> list[str]:
    """The policies to compare, bf16 (the baseline) first and always; unknown names raise."""
    pols = [p.name for p in resolve_policies(names)]
    return ["bf16"] + [p for p in pols if p != "bf16"]


def run_demo(out_dir: str | os.PathLike, *, policies: str | Sequence[str] = DEMO_POLICIES,
             limit: int | None = DEFAULT_LIMIT, progress: bool = True,
             log: Callable[[str], Any] | None = None) -> dict[str, Any]:
    """Run the demo; returns the result and writes demo.json / .md / .png under ``out_dir``."""
    say = log or (lambda _msg: None)
    names = demo_policies(policies)
    fp4 = [p for p in names if p != "bf16"]
    if not fp4:
        raise UsageError("--policies: give at least one FP4 policy besides bf16 (the baseline, always run)")
    if limit is not None and limit < 2:
        raise UsageError(f"--limit: at least 2 images are needed for an interval, got {limit}")
    out = Path(out_dir)
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
    timings["total_s"] = total.seconds
    result = demo_result(names, digits_count=len(digits), vit=vit, mae=mae, mae_ops=mae_ops, records=records,
                         timings=timings)
    files = write_report(out, NAME, result, demo_markdown(result))
    files["plot"] = quality_error_plot(result, out / f"{NAME}.png")
    result["files"] = {k: str(v) for k, v in files.items()}
    return result


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
                timings: dict[str, float]) -> dict[str, Any]:
    """The demo's JSON: one row per policy with the ViT and MAE figures and the operator errors."""
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
    return {
        "eval": "demo", "policies": rows, "policy_names": list(names), "backend": BACKEND, "device": "cpu",
        "dtype": "bfloat16", "seed": SEED, "images": digits_count,
        "data": f"{HELDOUT_FILE.name} (fp4vis.zoo: held-out MNIST digits, never seen in training), first "
                f"{digits_count}",
        "models": {name: {"model": PREFIX + name, "weights_sha256": rec["weights_sha256"],
                          "trained": rec.get("final"), "tokens": _tokens(name, vit, mae)}
                   for name, rec in records.items()},
        "video": {"model": f"{PREFIX}digits-wan", "status": "not shipped", "note": VIDEO_STATUS},
        "operator_error": "relative L2 (fp4vis.metrics.rel_l2) of each attention layer's output re-run under the "
                          "policy on the inputs it saw in the BF16 pass, against its BF16 output; mean over "
                          "images, then over layers (ViT: all blocks; MAE: encoder blocks)",
        "seconds": timings, "reports": {"vit": vit.get("files"), "mae": mae.get("files")},
        "warnings": sorted(set(vit.get("warnings", []) + mae.get("warnings", []))),
    }


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


def summary_table(result: dict[str, Any]) -> str:
    """The short table the command prints (plain text, aligned columns)."""
    cells = [TABLE_HEADERS] + [[fmt(c, 4) if not isinstance(c, str) else c for c in row]
                               for row in table_rows(result)]
    widths = [max(len(row[i]) for row in cells) for i in range(len(TABLE_HEADERS))]
    lines = ["  ".join(c.ljust(w) for c, w in zip(row, widths)).rstrip() for row in cells]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)


def demo_markdown(r: dict[str, Any]) -> str:
    vit, mae = r["models"][VIT_MODEL], r["models"][MAE_MODEL]
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
        f"- video: `{r['video']['model']}` is {r['video']['note']}", "",
        markdown_table(TABLE_HEADERS, table_rows(r)), "",
        "ViT top-1: torchmetrics micro accuracy over the digits; agreement: the fraction whose FP4 class equals the "
        "BF16 one. MAE masked PSNR: per image over the masked patches in [0, 1] pixels, then the mean with its 95 % "
        "Student-t interval; PSNR - bf16: the paired per-image difference with its interval (identical seeded masks "
        f"for every policy). attn relL2: {r['operator_error']}.", "",
        f"![quality against operator error]({NAME}.png)", "",
        f"Runtime: {r['seconds']['total_s']:.1f} s (ViT {r['seconds']['vit_s']:.1f} s, "
        f"MAE {r['seconds']['mae_s']:.1f} s, MAE operator error {r['seconds']['mae_operator_s']:.1f} s). "
        "Each eval's own report: "
        + ", ".join(f"[{Path(f['markdown']).name}]({Path(f['markdown']).name})"
                    for f in r["reports"].values() if f) + ".",
    ]
    return "\n".join(lines)


def quality_error_plot(r: dict[str, Any], path: str | os.PathLike) -> Path:
    """Two panels, one point per policy: ViT top-1 and MAE masked PSNR - BF16 (95 % interval) against
    the operator error of that model's attention layers."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax_vit, ax_mae) = plt.subplots(1, 2, figsize=(10.0, 4.2), dpi=120)
    for i, (name, row) in enumerate(r["policies"].items()):
        label_at = (5, 4 - 11 * (i % 3))   # policies close together keep readable labels
        x = row["vit_attention_rel_l2"]
        y = None if row["vit_top1"] is None else 100 * row["vit_top1"]
        if y is not None:
            ax_vit.scatter([x], [y], s=46, zorder=3)
            ax_vit.annotate(name, (x, y), textcoords="offset points", xytext=label_at, fontsize=8)
        d = row["mae_masked_psnr_diff_vs_bf16"] or {"mean": 0.0, "ci95_low": None}
        x = row["mae_attention_rel_l2"]
        err = None if d.get("ci95_low") is None else [[d["mean"] - d["ci95_low"]], [d["ci95_high"] - d["mean"]]]
        ax_mae.errorbar([x], [d["mean"]], yerr=err, fmt="o", capsize=4, zorder=3)
        ax_mae.annotate(name, (x, d["mean"]), textcoords="offset points", xytext=label_at, fontsize=8)
    ax_vit.set_title(f"{r['models'][VIT_MODEL]['model']}: {r['images']} held-out digits", fontsize=9)
    ax_vit.set_xlabel("attention output relL2 vs BF16 (mean over layers)")
    ax_vit.set_ylabel("top-1 (%)")
    ax_mae.set_title(f"{r['models'][MAE_MODEL]['model']}: masked-patch PSNR", fontsize=9)
    ax_mae.set_xlabel("encoder attention output relL2 vs BF16 (mean over layers)")
    ax_mae.set_ylabel("PSNR - BF16 (dB), paired, 95 % interval")
    ax_mae.axhline(0.0, color="grey", lw=0.8, zorder=1)
    for ax in (ax_vit, ax_mae):
        ax.grid(True, alpha=0.3, zorder=0)
    fig.suptitle(f"fp4vis demo, {r['backend']} backend on the CPU; video model: not shipped yet", fontsize=10)
    fig.tight_layout()
    with atomic_path(path) as tmp:
        fig.savefig(tmp, format="png")
    plt.close(fig)
    return Path(path)
