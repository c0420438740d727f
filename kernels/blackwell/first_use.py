"""The Blackwell kernel's first-use measurement: after the self-check passes on a GPU, the kernel is timed against
BF16 attention there, once per identity, and the figures are kept with the verdict (``selfcheck``'s cache).

What is timed, per shape (``measure``): the FP4 call (``kernel_fn``: pre-pass + kernel, the whole backend call),
``torch.nn.functional.scaled_dot_product_attention`` (default dispatch) on the same inputs, and flash-attn-4
(``flash_attn.cute.flash_attn_func``) where it imports; CUDA events, ``WARMUP`` calls, then the median of up to
``REPEATS`` calls (at least 3; fewer than ``REPEATS`` where they would take over ``BUDGET_S`` seconds). The shapes:
the call that triggered the check (its B, H, Sq, Skv, D, dtype and policy) and ``WAN_SHAPE``, Wan2.1-1.3B's 480p
self-attention at full length (an O(S^2) attention against an O(S) pre-pass: a shorter sequence would flatter
BF16), in BF16 with the first call's policy. A measurement that fails (flash-attn-4 missing, out of memory) is a
reason in the figures, never an error of the call; under CUDA-graph capture or torch.compile tracing nothing is
measured (``measure`` returns None: the next eager call measures).

``speedup_vs_*`` = BF16 ms / FP4 ms (> 1: FP4 is faster). On the H200 the kernel runs through its sm_90
verification route (FP4 upcast exactly to BF16 for wgmma): its figures are labelled ``SM90_ROUTE`` and say nothing
about Blackwell. ``warn_if_slower``: one warning per process and identity where FP4 is slower than BF16.
"""

from __future__ import annotations

import datetime
import math
import statistics
from collections.abc import Callable
from typing import NamedTuple

import torch

from fp4vis.policy import POLICIES, Policy
from fp4vis.tracing import warn_once

from .selfcheck import wait_for_gpu

WARMUP = 2
REPEATS = 5
BUDGET_S = 0.3          # timed calls per function: fewer than REPEATS (never fewer than 3) past this
SM90_CAPABILITY = "9.0"
SM90_ROUTE = "sm_90 verification (not Blackwell)"
SM90_NOTE = "FP4 operands upcast exactly to BF16 for wgmma: not a Blackwell figure"


class CallShape(NamedTuple):
    """A measured problem: (B, H, S, D) q with Skv keys, ``dtype`` "bf16" / "fp16", ``policy`` a Policy."""

    b: int
    h: int
    sq: int
    skv: int
    d: int
    dtype: str
    policy: Policy

    def label(self) -> str:
        return shape_text(self.b, self.h, self.sq, self.skv, self.d, self.dtype, self.policy.name)


def shape_text(b: int, h: int, sq: int, skv: int, d: int, dtype: str, policy: str) -> str:
    kv = f"/{skv}" if skv != sq else ""
    return f"B{b} H{h} S{sq}{kv} D{d} {dtype} {policy}"


# Wan2.1-1.3B 480p (480x832, 81 frames) self-attention: 21 latent frames x 30 x 52 patches = 32760 tokens
WAN_SHAPE = (1, 12, 32760, 32760, 128)
WAN_LABEL = "Wan2.1-1.3B 480p"

# timer(name, fn, shape, device) -> median ms of fn(q, k, v) on fresh inputs of ``shape``; raises when it cannot
Timer = Callable[[str, Callable, CallShape, torch.device], float]
KernelFn = Callable[..., torch.Tensor]   # (q, k, v, policy, scale) -> out, (B, H, S, D)


def call_shape(call) -> CallShape:
    """The ``CallShape`` of an ``AttentionCall`` (its q, k and policy)."""
    q, k = call.q, call.k
    return CallShape(q.shape[0], q.shape[1], q.shape[2], k.shape[2], q.shape[3],
                     "bf16" if q.dtype == torch.bfloat16 else "fp16", call.policy)


def cannot_measure_now() -> str | None:
    """Why nothing may be measured at this moment (tracing, graph capture), or None."""
    if torch.compiler.is_compiling():
        return "torch.compile is tracing"
    if torch.cuda.is_available() and torch.cuda.is_current_stream_capturing():
        return "a CUDA graph is being captured"
    return None


def route_label(identity: dict) -> str:
    """The route the figures come from: ``SM90_ROUTE`` on compute capability 9.0, else the launch kind ("jit" /
    "cubin"), with the warp-specialised kernel named where the fast-class policies took it."""
    if identity.get("capability") == SM90_CAPABILITY:
        return SM90_ROUTE
    kind = str(identity.get("route", "?"))
    return kind + (", warp-specialised kernel for fast/wan_fast" if identity.get("schedule") == "warp_specialized"
                   else "")


# ------------------------------------------------------------------------------------------------- timing

def cuda_event_timer(name: str, fn: Callable, shape: CallShape, device: torch.device) -> float:
    """The real timer: inputs of ``shape`` made on ``device`` (seeded Gaussian), ``WARMUP`` calls, then CUDA
    events around each of up to ``REPEATS`` calls (``BUDGET_S``); the median ms."""
    device = torch.device(device)
    if device.type != "cuda":
        raise RuntimeError(f"the timer needs a CUDA device, got {device}")
    dtype = torch.bfloat16 if shape.dtype == "bf16" else torch.float16
    g = torch.Generator(device=device).manual_seed(0)
    q, k, v = (torch.randn(shape.b, shape.h, s, shape.d, device=device, generator=g, dtype=dtype)
               for s in (shape.sq, shape.skv, shape.skv))
    for _ in range(WARMUP):
        fn(q, k, v)
    times: list[float] = []
    while len(times) < REPEATS and (len(times) < 3 or sum(times) + statistics.median(times) <= BUDGET_S * 1e3):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn(q, k, v)
        end.record()
        # a deadline, not end.synchronize(): this is the first long run of a kernel (a hang says so)
        wait_for_gpu(device, f"the first-use timing of {name} at {shape.label()}", event=end)
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def _fa4_fn(scale: float) -> Callable:
    """flash-attn-4 over (B, H, S, D) tensors (it takes (B, S, H, D): transposed views); its first call raises
    ImportError where it is not installed (the timer's warm-up: the figure's reason)."""
    def fn(q, k, v):
        from flash_attn.cute import flash_attn_func

        out = flash_attn_func(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), softmax_scale=scale,
                              causal=False)
        return (out[0] if isinstance(out, tuple) else out).transpose(1, 2)
    return fn


def _one_shape(label: str, shape: CallShape, kernel_fn: KernelFn, device, timer: Timer) -> dict:
    scale = 1.0 / math.sqrt(shape.d)
    row: dict = {"label": label, "b": shape.b, "h": shape.h, "sq": shape.sq, "skv": shape.skv, "d": shape.d,
                 "dtype": shape.dtype, "policy": shape.policy.name}
    reasons: dict[str, str] = {}
    builders = {"kernel": lambda: (lambda q, k, v: kernel_fn(q, k, v, shape.policy, scale)),
                "sdpa": lambda: (lambda q, k, v: torch.nn.functional.scaled_dot_product_attention(q, k, v,
                                                                                                   scale=scale)),
                "fa4": lambda: _fa4_fn(scale)}
    for name, build in builders.items():
        row[f"{name}_ms"] = None
        try:
            row[f"{name}_ms"] = round(float(timer(name, build(), shape, device)), 4)
        except Exception as exc:  # noqa: BLE001 - a failed measurement is a figure's reason, never the call's error
            reasons[name] = f"{type(exc).__name__}: {str(exc)[:200]}"
            if torch.cuda.is_available() and torch.device(device).type == "cuda":
                torch.cuda.empty_cache()
    for base in ("sdpa", "fa4"):
        ok = row["kernel_ms"] and row[f"{base}_ms"]
        row[f"speedup_vs_{base}"] = round(row[f"{base}_ms"] / row["kernel_ms"], 3) if ok else None
    if reasons:
        row["reasons"] = reasons
    return row


def measure(device, identity: dict, kernel_fn: KernelFn, shape: CallShape | None = None,
            timer: Timer | None = None) -> dict | None:
    """The figures of ``kernel_fn`` on ``device`` (``identity``: the self-check's), for ``shape`` (the first call's,
    where there is one) and ``WAN_SHAPE``; None where nothing may be measured now (``cannot_measure_now``).
    ``timer``: default ``cuda_event_timer`` (the tests inject a fake)."""
    if cannot_measure_now() is not None:
        return None
    timer = timer or cuda_event_timer
    policy = shape.policy if shape is not None else POLICIES["wan_fast"]
    wan = CallShape(*WAN_SHAPE, "bf16", policy)
    shapes = [("first call", shape)] if shape is not None else []
    if shape is None or tuple(shape[:6]) != tuple(wan[:6]):
        shapes.append((WAN_LABEL, wan))
    return {"gpu": identity.get("device", "?"), "capability": identity.get("capability", "?"),
            "route": route_label(identity), "launch": identity.get("route", "?"),
            "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
            "method": f"CUDA events, {WARMUP} warm-up calls, median of up to {REPEATS}; whole calls (FP4: pre-pass "
                      "+ kernel); SDPA default dispatch and flash-attn-4 on the same inputs",
            "shapes": [_one_shape(label, s, kernel_fn, device, timer) for label, s in shapes]}


# ------------------------------------------------------------------------------------------------- output

def _ms(x) -> str:
    return "—" if x is None else f"{x:.4g}"


def _ratio(x) -> str:
    """2.00x, 0.50x, 0.013x (two significant digits below 0.1)."""
    return "—" if x is None else f"{x:.2f}x" if x >= 0.1 else f"{x:.2g}x"


def _where(timing: dict) -> str:
    where = f"{timing.get('gpu', '?')} (sm_{str(timing.get('capability', '?')).replace('.', '')}, route "
    if timing.get("route") == SM90_ROUTE:
        return where + f"{SM90_ROUTE}: {SM90_NOTE})"
    return where + f"{timing.get('route', '?')})"


def format_timing(timing: dict | None) -> str:
    """The figures as printed by ``fp4vis selfcheck``: one line per shape (ms, ratios, reasons) and the ratio
    against BF16 in words."""
    if not timing:
        return "first-use timing: not measured yet (it runs after the self-check, on an eager call)"
    lines = [f"first-use timing on {_where(timing)}, {timing.get('date', '?')}",
             f"  {timing.get('method', '')}",
             f"  {'shape':<54} {'FP4 ms':>9} {'SDPA ms':>9} {'FA4 ms':>9} {'vs SDPA':>8} {'vs FA4':>8}"]
    for r in timing.get("shapes", []):
        name = f"{r['label']}: " + shape_text(*(r[f] for f in ("b", "h", "sq", "skv", "d", "dtype", "policy")))
        lines.append(f"  {name:<54} {_ms(r['kernel_ms']):>9} {_ms(r['sdpa_ms']):>9} {_ms(r['fa4_ms']):>9} "
                     f"{_ratio(r['speedup_vs_sdpa']):>8} {_ratio(r['speedup_vs_fa4']):>8}")
        for name, why in r.get("reasons", {}).items():
            lines.append(f"    {name} not measured: {why}")
    lines.append(summary(timing))
    return "\n".join(lines)


def summary(timing: dict | None) -> str:
    """One line: FP4 against BF16 (SDPA, and flash-attn-4 where measured) per shape, on which GPU and route."""
    if not timing:
        return "not measured yet"
    parts = []
    for r in timing.get("shapes", []):
        if r.get("speedup_vs_sdpa") is None:
            parts.append(f"{r['label']}: not measured ({'; '.join(r.get('reasons', {}).values()) or '?'})")
            continue
        fa4 = f", {_ratio(r['speedup_vs_fa4'])} flash-attn-4" if r.get("speedup_vs_fa4") is not None else ""
        parts.append(f"{r['label']}: FP4 {r['kernel_ms']:.4g} ms = {_ratio(r['speedup_vs_sdpa'])} BF16 SDPA{fa4}")
    return f"FP4 vs BF16 on {_where(timing)}: " + "; ".join(parts)


def slower_shapes(timing: dict | None) -> list[tuple[str, str, float]]:
    """(shape label, BF16 baseline, ratio) wherever FP4 was slower than a BF16 baseline."""
    out = []
    for r in (timing or {}).get("shapes", []):
        for base, name in (("sdpa", "SDPA"), ("fa4", "flash-attn-4")):
            ratio = r.get(f"speedup_vs_{base}")
            if ratio is not None and ratio < 1.0:
                out.append((r["label"], name, ratio))
    return out


def warn_if_slower(verdict: dict) -> bool:
    """Warn once per process and identity (the verdict's) where the verdict's figures have FP4 slower than BF16;
    True when it warned. (Runs on every eager call: nothing is built unless FP4 was slower.)"""
    timing = verdict.get("timing")
    slow = slower_shapes(timing)
    if not slow:
        return False
    key = tuple(sorted((k, str(x)) for k, x in verdict.get("identity", {}).items()))
    what = ", ".join(f"{_ratio(ratio)} {name} at {label}" for label, name, ratio in slow)
    return warn_once(("blackwell-first-use-slower", key),
                     f"fp4vis: the Blackwell FP4 kernel is slower than BF16 attention on {_where(timing)}: {what} "
                     "(speedup = BF16 ms / FP4 ms; `fp4vis selfcheck --cached` shows the figures)")
