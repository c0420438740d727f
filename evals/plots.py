"""Plots for the benchmark results and the demo (matplotlib, Agg backend: no display needed).

``frame_strip(rows, path)``: clips side by side, one row per label (e.g. BF16 / fast / accurate),
every ``every``-th frame, so that what a policy does to a video can be seen at a glance.

``speed_error_plot(result, path)``: one point per (backend or baseline, policy), averaged over the
shape grid: x = error against exact BF16 attention (relative L2 vs SDPA, log scale), y = speed (TFLOPS when the
rows carry it, else 1/time); a row without a measured error is a dashed line at its speed (no x is made up).
Points lower-left are slower and more accurate, upper-right faster and less accurate. The function reads
the rows of the kernel benchmark's result and tolerates the usual field names, so it also works on JSON
files written earlier.
"""

from __future__ import annotations

import json
import math
import os
from collections import defaultdict
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

from fp4vis.files import atomic_path

SPEED_KEYS = ("tflops", "TFLOPS", "tflops_s")
TIME_KEYS = ("time_ms", "ms", "median_ms", "latency_ms", "mean_ms", "time_s")
ERROR_KEYS = ("rel_l2_vs_bf16", "rel_l2", "rel_l2_vs_exact", "rel_l2_exact", "err_rel_l2", "error_rel_l2",
              "rel_l2_vs_ref")
LABEL_KEYS = ("backend", "impl", "method", "kernel", "name")


def _rows(result: Any) -> list[Mapping[str, Any]]:
    if isinstance(result, (str, os.PathLike)):
        result = json.loads(Path(result).read_text())
    if isinstance(result, Mapping):
        for key in ("rows", "results", "records", "measurements", "grid"):
            if isinstance(result.get(key), list):
                return [r for r in result[key] if isinstance(r, Mapping)]
        return []
    if isinstance(result, Iterable):
        return [r for r in result if isinstance(r, Mapping)]
    return []


def _first(row: Mapping[str, Any], keys: Iterable[str]) -> tuple[str | None, Any]:
    for k in keys:
        v = row.get(k)
        if isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v):
            return k, float(v)
    return None, None


def _label(row: Mapping[str, Any]) -> str:
    base = next((str(row[k]) for k in LABEL_KEYS if row.get(k) not in (None, "")), "?")
    pol = row.get("policy")
    label = f"{base} / {pol}" if pol not in (None, "", base) else base
    # the route a backend ran through (the Blackwell kernel's: "jit", "cubin", or its sm_90 verification build on
    # an H200), so that the plot alone does not pass one route's speed off as another's
    return f"{label} ({row['route']})" if row.get("route") else label


def summarize(result: Any) -> list[dict[str, Any]]:
    """Per label: mean speed (TFLOPS or 1/time), mean time, mean error over the rows that have them."""
    acc: dict[str, dict[str, list[float]]] = defaultdict(lambda: defaultdict(list))
    for row in _rows(result):
        if (isinstance(row.get("error"), str) or row.get("skipped")
                or row.get("status") in ("skipped", "error", "failed")):
            continue
        lab = _label(row)
        _, sp = _first(row, SPEED_KEYS)
        tk, tm = _first(row, TIME_KEYS)
        _, err = _first(row, ERROR_KEYS)
        if sp is not None:
            acc[lab]["tflops"].append(sp)
        if tm is not None:
            acc[lab]["time_ms"].append(tm * 1000 if tk == "time_s" else tm)
        if err is not None:
            acc[lab]["rel_l2"].append(err)
    out = []
    for lab, d in acc.items():
        out.append({"label": lab, **{k: (sum(v) / len(v) if v else None) for k, v in d.items()},
                    "n": max((len(v) for v in d.values()), default=0)})
    return out


def skipped_backends(result: Any) -> dict[str, str]:
    """Backends that did not run at all, with the first reason given."""
    ran = {_label(r).split(" / ")[0] for r in _rows(result) if not r.get("skipped")}
    out: dict[str, str] = {}
    for r in _rows(result):
        b = next((str(r[k]) for k in LABEL_KEYS if r.get(k)), None)
        if b and r.get("skipped") and b not in ran:
            out.setdefault(b, str(r["skipped"]))
    return out


def speed_error_plot(result: Any, path: str | os.PathLike, *, title: str = "fp4vis kernel benchmark") -> Path:
    """Write the speed-error scatter to ``path`` (PNG) and return the path."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    pts = summarize(result)
    use_tflops = any(p.get("tflops") for p in pts)
    fig, ax = plt.subplots(figsize=(7.0, 4.6), dpi=120)
    plotted = 0
    points = []
    for i, p in enumerate(sorted(pts, key=lambda p: p["label"])):
        y = p.get("tflops") if use_tflops else (1000.0 / p["time_ms"] if p.get("time_ms") else None)
        x = p.get("rel_l2")
        if y is None:
            continue
        if x is None or x <= 0:   # no error measured (or exactly 0 on a log axis): a speed line, not a made-up x
            ax.axhline(y, color=f"C{i % 10}", ls="--", lw=1.0, zorder=2, label=f"{p['label']} (no error measured)")
        else:
            ax.scatter([x], [y], s=46, color=f"C{i % 10}", label=p["label"], zorder=3)
            points.append((x, y, p["label"]))
        plotted += 1
    # each point's label on the side facing the middle of the plot (log x), so none runs off the figure
    mid = (math.log(min(x for x, _, _ in points)) + math.log(max(x for x, _, _ in points))) / 2 if points else 0.0
    for x, y, label in points:
        right = math.log(x) > mid
        ax.annotate(label, (x, y), textcoords="offset points", xytext=(-5 if right else 5, 4), fontsize=7,
                    ha="right" if right else "left")
    has_err = any((p.get("rel_l2") or 0) > 0 for p in pts)
    if has_err:
        ax.set_xscale("log")
    ax.set_xlabel("relative L2 error vs exact BF16 attention (mean over shapes)\ndashed: speed of a row without "
                  "an error" if has_err else "no error measured in this run: the dashed lines are speeds only")
    ax.set_ylabel("TFLOPS (mean over shapes)" if use_tflops else "calls per second (1 / mean time)")
    ax.set_title(title, fontsize=10)
    ax.grid(True, which="both", alpha=0.3, zorder=0)
    if plotted == 0:
        ax.text(0.5, 0.5, "no timed rows in the result", transform=ax.transAxes, ha="center")
    elif plotted <= 12:
        ax.legend(fontsize=7, loc="best")
    skipped = skipped_backends(result)
    if skipped:
        note = "not run here: " + "; ".join(f"{b} ({r[:60]})" for b, r in skipped.items())
        fig.text(0.01, 0.005, note, fontsize=6, ha="left", va="bottom", wrap=True)
        fig.tight_layout(rect=(0, 0.05, 1, 1))
    else:
        fig.tight_layout()
    path = Path(path)
    with atomic_path(path) as tmp:
        fig.savefig(tmp, format=path.suffix.lstrip(".") or "png")
    plt.close(fig)
    return path


def frame_strip(rows: Mapping[str, Any], path: str | os.PathLike, *, every: int = 2, title: str | None = None,
                columns: list[str] | None = None) -> Path:
    """Write a PNG of clips (label -> frames (F, H, W, 3) or (F, H, W) in [0, 1]), one row per label,
    frames 0, every, 2 * every, ... in columns, and return the path. ``columns``: the column titles
    (default "frame i"), e.g. for a sheet of one frame of several clips."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    if not rows:
        raise ValueError("frame_strip: no clips to draw")
    clips = {k: np.clip(np.asarray(v, dtype=np.float32), 0, 1) for k, v in rows.items()}
    picks = list(range(0, next(iter(clips.values())).shape[0], every))
    h, w = next(iter(clips.values())).shape[1:3]
    size = (0.25 + 0.9 * len(picks) * w / max(h, w), 0.35 + 0.95 * len(clips) * h / max(h, w))
    fig, axes = plt.subplots(len(clips), len(picks), squeeze=False, dpi=100, figsize=size)
    for r, (label, frames) in enumerate(clips.items()):
        for c, f in enumerate(picks):
            ax = axes[r][c]
            ax.imshow(frames[f], cmap="gray" if frames.ndim == 3 else None, vmin=0, vmax=1, interpolation="nearest")
            ax.set_xticks([])
            ax.set_yticks([])
            if r == 0:
                ax.set_title(columns[c] if columns else f"frame {f}", fontsize=7)
            if c == 0:
                ax.set_ylabel(label, fontsize=8)
    if title:
        fig.suptitle(title, fontsize=8)
    fig.tight_layout(pad=0.3)
    path = Path(path)
    with atomic_path(path) as tmp:
        fig.savefig(tmp, format="png")
    plt.close(fig)
    return path
