"""The report beside a plan found for a fidelity target (``fp4vis.evals.plan_search``): the candidates tried, the
Pareto front of fidelity against FP4 share of attention time, as Markdown, JSON and a plot, and the held-out
check where one ran.

``write_plan_report(out_dir, name, result)`` takes ``SearchResult.to_dict()`` (with ``held_out``, the
``check_plan`` figures without their frames, where the check ran) and writes ``name.json``, ``name.md`` and
``name.png``; everything in them comes from that dictionary, so a saved JSON can be drawn again.
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from fp4vis.evals.report import markdown_table, write_report
from fp4vis.files import atomic_path


def pareto(candidates: Sequence[Mapping[str, Any]]) -> list[Mapping[str, Any]]:
    """The candidates no other one beats on both FP4 share and score (ties kept), by FP4 share."""
    front = [c for c in candidates
             if not any(o["fp4_share"] >= c["fp4_share"] and o["score"] >= c["score"]
                        and (o["fp4_share"], o["score"]) != (c["fp4_share"], c["score"]) for o in candidates)]
    return sorted(front, key=lambda c: (-c["fp4_share"], -c["score"]))


def _ci(c: Mapping[str, Any] | None, digits: int) -> str:
    if not c or c.get("mean") is None:
        return "n/a"
    if c.get("ci95_low") is None:
        return f"{c['mean']:.{digits}f}"
    return f"{c['mean']:.{digits}f} [{c['ci95_low']:.{digits}f}, {c['ci95_high']:.{digits}f}]"


DIGITS = {"latent_cosine": 5, "psnr_db": 2, "ssim": 4}


def candidate_rows(r: Mapping[str, Any]) -> list[list[Any]]:
    front = {id(c) for c in pareto(r["candidates"])}
    rows = []
    for c in sorted(r["candidates"], key=lambda c: (-c["fp4_share"], -c["score"])):
        mark = ("chosen" if c["label"] == r["chosen"]["label"] else "") + (" pareto" if id(c) in front else "")
        rows.append([c["label"], c["role"], f"{c['fp4_share']:.3f}", f"{c['predicted_attention_time_vs_exact']:.3f}",
                     *(f"{c['mean'][m]:.{d}f}" for m, d in DIGITS.items()), f"{c['worst']['psnr_db']:.2f}",
                     "yes" if c["met"] else "no", mark.strip()])
    return rows


CANDIDATE_HEADERS = ["candidate", "why measured", "FP4 share", "attention time / BF16's", "latent cos (mean)",
                     "PSNR dB (mean)", "SSIM (mean)", "PSNR dB (worst)", "meets", ""]


def held_out_rows(h: Mapping[str, Any]) -> list[list[Any]]:
    rows = []
    for label, p in h["plans"].items():
        read = p.get("digit_read")
        rows.append([label, f"{p['fp4_share']:.3f}" if "fp4_share" in p else "",
                     *(_ci(p["ci95"][m], d) for m, d in DIGITS.items()), f"{p['worst']['psnr_db']:.2f}",
                     "yes" if p["met"] else "no", f"{read['k']}/{read['n']}" if read else ""])
    if h.get("bf16_digit_read"):
        b = h["bf16_digit_read"]
        rows.append(["bf16 (the reference)", "0.000", "1", "inf", "1", "inf", "", f"{b['k']}/{b['n']}"])
    return rows


HELD_OUT_HEADERS = ["plan", "FP4 share", "latent cos [95 %]", "PSNR dB [95 %]", "SSIM [95 %]", "PSNR dB (worst)",
                    "meets", "digit read"]


def plan_markdown(r: Mapping[str, Any]) -> str:
    chosen, tm = r["chosen"], r["time_model"]
    lines = [f"# A plan for {r['target_text']}", "",
             f"Model `{r['plan']['model_id']}`, policy `{r['plan']['policy']['name']}`, {r['steps']} denoising steps, "
             f"{r['plan']['fidelity']['num_prompts']} prompts; {r['runs']} pipeline runs of a budget of {r['budget']}"
             f"{' (exhausted: the best plan measured)' if r['budget_exhausted'] else ''}.", "",
             f"Chosen: **{chosen['label']}** (exact steps {chosen['exact_steps'] or 'none'}, exact layers "
             f"{', '.join(chosen['exact_layers']) or 'none'}): {r['target']['statistic']} {r['target']['metric']} "
             f"{chosen['score']:.5g}, FP4 share of attention time {chosen['fp4_share']:.3f}.", "",
             f"Layers by sensitivity (each exact alone): {', '.join(r['layer_order'])}.", "",
             "## Candidates tried (Pareto: no other candidate has both more FP4 share and a higher score)", "",
             markdown_table(CANDIDATE_HEADERS, candidate_rows(r)), "",
             f"FP4 share: the share of the all-exact run's attention time that the plan's FP4 cells (step, layer) "
             f"take. Attention time / BF16's: the plan's predicted attention time over the all-exact run's. "
             f"Time model: {tm['source']} ({tm['units']}, {tm['calls_per_step']} calls per layer and step).",
             "", "Simplest plans that meet the target (all steps exact but the last k / the first k): "
             + "; ".join(f"{k}: {v['label']} (FP4 share {v['fp4_share']:.3f})" if v else f"{k}: none"
                         for k, v in r["simplest"].items()) + "."]
    h = r.get("held_out")
    if h:
        lines += ["", f"## Held out: {h['num_prompts']} prompts the plan was not chosen on", "",
                  markdown_table(HELD_OUT_HEADERS, held_out_rows(h)), "",
                  "Mean over the prompts with its 95 % Student-t interval; worst: the lowest prompt; digit read: clips "
                  "the reader of fp4vis.zoo.moving_digits reads as the prompted digit (where it ran)."]
    if r.get("command"):
        lines += ["", f"Command: `{r['command']}`"]
    return "\n".join(lines)


def pareto_plot(r: Mapping[str, Any], path: str | os.PathLike) -> Path:
    """Score against FP4 share for every candidate, the Pareto front, the target and the chosen plan."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    cands = r["candidates"]
    fig, ax = plt.subplots(figsize=(7.0, 4.6), dpi=120)
    roles = sorted({c["role"] for c in cands})
    for i, role in enumerate(roles):
        pts = [c for c in cands if c["role"] == role]
        ax.scatter([c["fp4_share"] for c in pts], [c["score"] for c in pts], s=30, color=f"C{i % 10}", label=role,
                   zorder=3)
    front = pareto(cands)
    ax.plot([c["fp4_share"] for c in front], [c["score"] for c in front], color="k", lw=1.0, ls=":",
            label="Pareto front", zorder=2)
    ax.axhline(r["target"]["value"], color="C3", lw=1.0, ls="--", label=f"target ({r['target_text']})")
    ch = r["chosen"]
    ax.scatter([ch["fp4_share"]], [ch["score"]], s=140, facecolors="none", edgecolors="k", lw=1.5,
               label=f"chosen: {ch['label']}", zorder=4)
    ax.set_xlabel("FP4 share of attention time (time model: " + r["time_model"]["source"][:40] + " ...)")
    ax.set_ylabel(f"{r['target']['statistic']} {r['target']['metric']} against BF16")
    ax.set_title(f"plan search: {r['plan']['model_id']}, {r['steps']} steps, "
                 f"{r['plan']['fidelity']['num_prompts']} prompts", fontsize=10)
    ax.grid(True, alpha=0.3, zorder=0)
    ax.legend(fontsize=7, loc="best")
    fig.tight_layout()
    path = Path(path)
    with atomic_path(path) as tmp:
        fig.savefig(tmp, format="png")
    plt.close(fig)
    return path


def write_plan_report(out_dir: str | os.PathLike, name: str, result: Mapping[str, Any]) -> dict[str, Path]:
    """``name.json``, ``name.md`` and ``name.png`` under ``out_dir`` (module docstring)."""
    markdown = plan_markdown(result) + f"\n\n![fidelity against FP4 share, every candidate]({name}.png)"
    files = write_report(out_dir, name, dict(result), markdown)
    files["plot"] = pareto_plot(result, Path(out_dir) / f"{name}.png")
    return files
