"""Kernel benchmark: the Hopper Direct-P kernel against BF16 attention baselines, side by side.

Library API (the CLIs ``benchmarks/kernel_grid.py`` and ``fp4vis bench`` call these):

    rows = run_grid(shapes=GRID_D128, backends=("hopper", "fa4", "sdpa_cudnn"),
                    policies=("fast",), quick=False)
    write_results(rows, "benchmarks/results/<date>a_h200_kernel_grid.json")   # raw JSON + meta
    print(summary_table(rows))                                           # Markdown

Backends (each skipped with a reason in its row when it cannot run here):
  ``hopper``        fp4vis Hopper kernel, whole call: pre-pass (quantize, anchors) + kernel
  ``hopper_plain`` / ``hopper_overlap``  the whole call with the serial or the overlapped schedule
  ``hopper@SCHEDULE/P_PATH/NUM_WG/BLOCK_SCALES/CTAS_PER_SM/TILE_N/POLY_EXP2``, ``hopper_kernel@...``  a variant (a part
                    may be empty or left out: the default), e.g. ``hopper_kernel@serial/scalar``,
                    ``hopper@pingpong/packed/3`` or ``hopper_kernel@///lane``; see
                    ``fp4vis.kernels.hopper.config.KernelConfig``
  ``hopper_kernel`` the kernel alone on prepared operands (pre-pass excluded)
  ``prepass``       the pre-pass alone
  ``fa4``           flash-attn-4 (``flash_attn.cute``) BF16 forward, non-causal
  ``sdpa_cudnn``    torch SDPA with the cuDNN backend
  ``sdpa_flash``    torch SDPA with the flash backend
  ``sage``          SageAttention (``sageattention.sageattn``), when importable
  ``fa3`` / ``fa3_fp8``  FlashAttention-3's BF16 / FP8 forward (``flash_attn_interface``), when importable
                    (these baselines: ``fp4vis.evals.baselines``, in layout bhsd here)
  ``fa3_fp8_kernel`` FlashAttention-3's FP8 kernel alone on operands cast beforehand (its cast excluded)
  ``blackwell``     fp4vis Blackwell kernel, whole call (sm_100/103/120; on the H200 its sm_90
                    verification route where it exists: cubins given or Triton >= 3.8; not a product path,
                    and its rows say so: ``"route": "sm_90 verification (not Blackwell)"``, "jit" / "cubin" on
                    Blackwell, with a note under the summary table)
  ``reference``     the fp4vis reference emulation (the only one that runs on the CPU)

Timing, the same two ways for every backend, so that no backend's host overhead counts for or against
another: ``ms``, CUDA events around each eager call after warm-up (median over repetitions, inputs
rotated over enough copies to exceed the L2 cache; a call whose host work outlasts its GPU work is
timed at the host's pace), and ``graph_ms``, GPU time per call replayed from a CUDA graph of
``GRAPH_CALLS`` calls (``fp4vis.services.timing.time_graph``: host work excluded; the same inputs each call,
L2-warm where they fit; ``graph_error`` where a backend cannot be captured). Speedups and geo-means
are given for both (``speedup_vs_*``, ``graph_speedup_vs_*``). Errors: relative L2 against the reference emulation
(``backend="reference"``, on a sample of heads and query rows against all keys, since the
reference is slow) and against BF16 SDPA; for a policy that is not exact to docs/numerics.md (``code_rounding``
other than "exact", e.g. ``fast_bf16round``) also against the reference of its exact twin
(``rel_l2_vs_exact_reference``). ``quick=True`` runs on the CPU: the reference backend on
tiny shapes (a smoke test of the harness): the median wall time of 3 calls per shape, nothing else (no
FLOP rate: the emulation's is no kernel's; no error: the reference is what errors are measured against).
"""

from __future__ import annotations

import importlib
import math
import statistics
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, replace
from pathlib import Path

import torch

from fp4vis.evals.baselines import BASELINES, attention_function, fa3_fp8_parts, unavailable
from fp4vis.files import atomic_write
from fp4vis.policy import get_policy
from fp4vis.services.environment import environment
from fp4vis.services.outputs import write_json
from fp4vis.services.timing import time_cpu, time_cuda, time_graph

# (B, S, H) at D = 128: the nine-shape grid plus the large video shapes
GRID_D128 = [(1, 256, 16), (1, 1024, 16), (4, 4096, 16), (1, 32768, 16), (4, 4096, 32), (1, 4096, 12),
             (1, 32768, 12), (1, 4096, 24), (1, 32768, 24), (1, 8192, 64), (1, 32760, 12), (1, 75600, 40)]
# ViT-like shapes at D = 64: ViT-B/16 at 224 (197 tokens, 12 heads), ViT-L/16 at 224 and 384
GRID_D64 = [(1, 197, 12), (64, 197, 12), (32, 197, 16), (8, 577, 16)]
QUICK_SHAPES = [(1, 64, 2), (1, 200, 2)]

L2_BYTES = 50 * 2**20
HOPPER_BACKENDS = ("hopper", "hopper_plain", "hopper_overlap", "hopper_kernel", "prepass")


@dataclass
class Shape:
    b: int
    s: int
    h: int
    d: int = 128
    skv: int | None = None

    @property
    def kv(self) -> int:
        return self.skv or self.s

    def flops(self) -> float:
        return 4.0 * self.b * self.h * self.s * self.kv * self.d

    def label(self) -> str:
        kv = f"/{self.kv}" if self.skv else ""
        return f"B{self.b} S{self.s}{kv} H{self.h} D{self.d}"


def as_shapes(shapes: Iterable, d: int = 128) -> list[Shape]:
    out = []
    for s in shapes:
        out.append(s if isinstance(s, Shape) else Shape(*s, d=d) if len(s) == 3 else Shape(*s))
    return out


# ------------------------------------------------------------------------------------------ timing

# ---------------------------------------------------------------------------------------- backends

def _kmod(name: str):
    """A module of fp4vis.kernels (imported lazily: it needs nvidia-cutlass-dsl)."""
    return importlib.import_module(f"fp4vis.kernels.{name}")


VARIANT_FIELDS = ("schedule", "p_path", "num_wg", "block_scales", "ctas_per_sm", "tile_n", "poly_exp2")


def split_variant(backend: str) -> tuple[str, dict]:
    """``"hopper_kernel@serial/scalar/3"`` -> ("hopper_kernel", {schedule: "serial", p_path: "scalar",
    num_wg: 3}): the kernel variant's fields in VARIANT_FIELDS order, empty or missing fields left at
    the defaults (hopper.config.KernelConfig); ``"hopper_kernel@///lane"`` -> {block_scales: "lane"};
    ``"hopper_kernel@////2"`` the short-sequence variant, ``"hopper_kernel@////1"`` the default kernel
    whatever the sequence lengths (without any field the kernel is picked by sequence length as the
    backend picks it: hopper.backend.SHORT_SEQ); ``"hopper_kernel@//////0"`` the FP8 P/V softmax with every
    exponential on the exponential unit (``poly_exp2``: how many of 8 go to the FMA pipe)."""
    base, _, variant = backend.partition("@")
    parts = variant.split("/") if variant else []
    kw = {f: v for f, v in zip(VARIANT_FIELDS, parts) if v}
    for f in ("num_wg", "ctas_per_sm", "tile_n", "poly_exp2"):
        if f in kw:
            kw[f] = int(kw[f])
    return base, kw


def _variant_config(pol, q: torch.Tensor, variant: dict):
    """The ``KernelConfig`` of a named kernel variant (``split_variant``'s fields), None where none is named
    (the backend's own choice, ``product_config``, the short-sequence variant by sequence length)."""
    if not variant:
        return None
    dtype = "bf16" if q.dtype == torch.bfloat16 else "fp16"
    variant = dict(variant)
    poly_exp2 = variant.pop("poly_exp2", None)   # no argument of make's: set on the made variant
    cfg = _kmod("hopper.config").KernelConfig.from_policy(pol, q.shape[-1], dtype, **variant)
    if poly_exp2 is not None:
        if not cfg.pv_fp8 or not 0 <= poly_exp2 <= 8:
            raise ValueError(f"poly_exp2: 0-8 exponentials of 8, for the FP8 P/V policies; got {poly_exp2} for "
                             f"policy {pol.name!r}")
        cfg = replace(cfg, poly_exp2=poly_exp2)
    return cfg


def hopper_call(policy: str, **variant):
    """The whole call. The default variant goes through the public API (``fp4vis.attention``,
    ``backend="hopper"``: what users and the patchers run); a variant goes to the backend's launcher with its
    ``KernelConfig``."""
    import fp4vis
    from fp4vis.call import AttentionCall
    hb = _kmod("hopper.launch")
    pol = get_policy(policy)

    def call(q, k, v, scale):
        if not variant:
            return fp4vis.attention(q, k, v, policy=pol, scale=scale, backend="hopper", range_check="off")
        return hb.attention(AttentionCall(q, k, v, pol, scale), _variant_config(pol, q, variant))
    return call


def hopper_parts(policy: str, **variant):
    """(prepass(q, k, v, scale) -> operands, kernel(operands, q, scale) -> out) for the split timings: the
    backend's own two steps (``prepass.kernel_operands``, ``backend.launch``)."""
    from fp4vis.call import AttentionCall
    from fp4vis.settings import kernel_settings
    hb = _kmod("hopper.launch")
    product_config = _kmod("hopper.config").product_config
    kernel_operands = _kmod("hopper.prepass").kernel_operands
    pol = get_policy(policy)

    def pre(q, k, v, scale):
        return kernel_operands(AttentionCall(q, k, v, pol, scale), pol.kernel_params(q.shape[-1], scale),
                               kernel_settings())

    def ker(ops, q, scale):
        params, settings = pol.kernel_params(q.shape[-1], scale), kernel_settings()
        out = torch.empty_like(q)
        cfg = _variant_config(pol, q, variant) or product_config(
            params, q.shape[-1], "bf16" if q.dtype == torch.bfloat16 else "fp16",
            hb.short_sequences(ops.q.shape[-2], ops.k.shape[-2], settings), False)
        hb.launch(cfg, ops, out, params, None, settings.hopper_tvm_ffi)
        return out
    return pre, ker


def fp8_tensor_core_scores(q_hat: torch.Tensor, k_hat: torch.Tensor, matmul=None) -> torch.Tensor:
    """``raw = Q̂ K̂ᵀ`` of decoded ``fp8_e4m3`` operands (G, Sq, D), (G, Skv, D) (Skv a multiple of 32)
    as Hopper's FP8 tensor cores form it: ``matmul(q8, k8)`` of the E4M3 values (default
    ``torch._scaled_mm`` with one accumulator over D, as the kernel's QGMMA chain: ``use_fast_accum``),
    times the power-of-two scales. For ``fp4vis.reference.direct_p_attention(..., score_product=...)``:
    the reference with FP8 scores.

    The scales are recovered from the decoded values: a group's largest E4M3 value lies in [2^7, 2^8],
    so E = floor(log2 max) - 7, except where the maximum is a power of two (128 * 2^E or 256 * 2^(E-1),
    indistinguishable): there E = floor(log2 max) - 8, which doubles the group's values in the first
    case (exact: E4M3 holds 2x every value up to 256) where E + 1 would halve them (inexact for the
    smallest subnormals). A power-of-two factor on one operand of every product does not change the
    FP8 MMA's accumulation, so the scores are the kernel's."""
    from fp4vis.formats import FP8_MIN_GROUP_EXP, fp8_group_exponent, pow2
    from fp4vis.key_positions import KEY_BLOCK

    def exponent(amax):
        pow2_max = (amax.view(torch.int32) & 0x7FFFFF) == 0
        return torch.where(pow2_max & (amax > 0), (fp8_group_exponent(amax) - 1).clamp(min=FP8_MIN_GROUP_EXP),
                           fp8_group_exponent(amax))

    eq = exponent(q_hat.abs().amax(-1))                                    # (G, Sq)
    kb = k_hat.unflatten(-2, (-1, KEY_BLOCK))
    ek = exponent(kb.abs().amax(dim=(-2, -1)))                             # (G, Skv/32)
    q8 = (q_hat * pow2(-eq)[..., None]).to(torch.float8_e4m3fn)
    k8 = (kb * pow2(-ek)[..., None, None]).flatten(-3, -2).to(torch.float8_e4m3fn)
    if matmul is None:
        matmul = _scaled_mm_fast_accum
    raw = matmul(q8, k8)
    return raw * pow2(eq)[..., None] * pow2(ek).repeat_interleave(KEY_BLOCK, -1)[:, None, :]


def _scaled_mm_fast_accum(q8: torch.Tensor, k8: torch.Tensor) -> torch.Tensor:
    """float32 q8 @ k8ᵀ per head group on the FP8 tensor cores (M padded to 16 for _scaled_mm)."""
    sq = q8.shape[-2]
    pad = (-sq) % 16
    qp = torch.nn.functional.pad(q8.view(torch.uint8), (0, 0, 0, pad)).view(torch.float8_e4m3fn)
    one = torch.ones((), device=q8.device)
    return torch.stack([torch._scaled_mm(qp[g], k8[g].T, scale_a=one, scale_b=one, out_dtype=torch.float32,
                                         use_fast_accum=True)[:sq] for g in range(q8.shape[0])])


def blackwell_call(policy: str):
    """The Blackwell backend's whole call through the public API (its self-check and first-use timing run at the
    first, untimed call)."""
    import fp4vis

    def call(q, k, v, scale):
        return fp4vis.attention(q, k, v, policy=policy, scale=scale, backend="blackwell", range_check="off")
    return call


def blackwell_route() -> str:
    """The route the Blackwell backend runs through on the current GPU (``first_use.route_label``): "jit" / "cubin"
    on Blackwell, ``first_use.SM90_ROUTE`` on the H200."""
    blackwell = _kmod("blackwell.first_use"), _kmod("blackwell.route")
    return blackwell[0].route_label(blackwell[1].identity(torch.device("cuda", torch.cuda.current_device())))


def reference_call(policy: str):
    import fp4vis

    def call(q, k, v, scale):
        return fp4vis.attention(q, k, v, policy=policy, scale=scale, backend="reference", range_check="off")
    return call


def _reference_rows(q, k, v, policy, scale, max_heads=2, max_rows=512):
    """Reference output on a sample (first heads of batch 0, evenly spaced query rows), and the index."""
    import fp4vis
    h = min(q.shape[1], max_heads)
    rows = torch.linspace(0, q.shape[2] - 1, min(q.shape[2], max_rows), device=q.device).round().long().unique()
    out = fp4vis.attention(q[:1, :h, rows], k[:1, :h], v[:1, :h], policy=policy, scale=scale,
                           backend="reference", range_check="off")
    return out, (slice(0, 1), slice(0, h), rows)


# -------------------------------------------------------------------------------------------- grid

def _inputs(shape: Shape, dtype, device, n_copies: int, seed: int = 0):
    g = torch.Generator(device=device).manual_seed(seed)
    sets = []
    for _ in range(n_copies):
        q = torch.randn(shape.b, shape.h, shape.s, shape.d, device=device, generator=g, dtype=torch.float32)
        k = torch.randn(shape.b, shape.h, shape.kv, shape.d, device=device, generator=g, dtype=torch.float32)
        v = torch.randn(shape.b, shape.h, shape.kv, shape.d, device=device, generator=g, dtype=torch.float32)
        sets.append((q.to(dtype), k.to(dtype), v.to(dtype)))
    return sets


def _copies_for(shape: Shape, elt: int = 2) -> int:
    per = (2 * shape.s + 2 * shape.kv) * shape.b * shape.h * shape.d * elt
    return max(1, min(4, math.ceil(2 * L2_BYTES / max(per, 1))))


def available(backend: str) -> str | None:
    """None when ``backend`` can run here, else why not."""
    cuda = torch.cuda.is_available()
    if backend == "reference":
        return None
    if not cuda:
        return "no CUDA device"
    try:
        if split_variant(backend)[0] in HOPPER_BACKENDS:
            import fp4vis
            return fp4vis.available_backends().get("hopper")
        if backend == "blackwell":
            import fp4vis
            return fp4vis.available_backends().get("blackwell")
        if backend in BASELINES:   # fa4, fa3, fa3_fp8, sage, sdpa_cudnn, sdpa_flash (fp4vis.evals.baselines)
            return unavailable(backend)
        if backend == "fa3_fp8_kernel":
            return unavailable("fa3_fp8")
        return f"unknown backend {backend!r}"
    except Exception as exc:
        return f"{type(exc).__name__}: {exc}"
    return None


def run_grid(shapes: Sequence = GRID_D128, backends: Sequence[str] = ("hopper", "fa4", "sdpa_cudnn"),
             policies: Sequence[str] = ("fast",), quick: bool = False, dtype=torch.bfloat16,
             check_errors: bool = True, log: Callable[[str], None] | None = print,
             budget_s: float = 2.0) -> list[dict]:
    """Time every (shape, backend[, policy]) and return one dict per measurement (see module doc)."""
    device = "cpu" if quick else "cuda"
    if quick:
        shapes, backends = (shapes if shapes is not GRID_D128 else QUICK_SHAPES), ("reference",)
    rows: list[dict] = []
    reasons = {b: available(b) for b in backends}
    for shape in as_shapes(shapes):
        scale = 1.0 / math.sqrt(shape.d)
        n = 1 if quick else _copies_for(shape)
        try:
            sets = _inputs(shape, dtype, device, n)
        except torch.OutOfMemoryError as exc:
            rows.append(dict(shape=shape.label(), error=f"OOM making inputs: {exc}"))
            continue
        bf16_out = None
        if not quick and check_errors:
            try:
                bf16_out = attention_function("sdpa_cudnn")(*sets[0], scale)
            except Exception:
                bf16_out = None
        for backend in backends:
            pols = policies if split_variant(backend)[0] in HOPPER_BACKENDS + ("blackwell", "reference") else (None,)
            for pol in pols:
                row = dict(shape=shape.label(), b=shape.b, s=shape.s, skv=shape.kv, h=shape.h, d=shape.d,
                           backend=backend, policy=pol, dtype=str(dtype).replace("torch.", ""))
                if reasons[backend] is not None:
                    row["skipped"] = reasons[backend]
                    rows.append(row)
                    continue
                try:
                    _measure(row, backend, pol, sets, scale, quick, bf16_out, check_errors, budget_s)
                except Exception as exc:  # one failing backend must not sink the grid
                    row["error"] = f"{type(exc).__name__}: {str(exc)[:300]}"
                rows.append(row)
                if log:
                    log(_row_line(row))
        del sets
        if not quick:
            torch.cuda.empty_cache()
    add_speedups(rows)
    return rows


def _measure(row, backend, pol, sets, scale, quick, bf16_out, check_errors, budget_s=2.0):
    shape_flops = 4.0 * row["b"] * row["h"] * row["s"] * row["skv"] * row["d"]
    out0 = None
    base, variant = split_variant(backend)
    if base == "blackwell" and not quick:
        row["route"] = blackwell_route()
    if base in ("prepass", "hopper_kernel"):
        pre, ker = hopper_parts(pol, **variant)
        ops = [pre(q, k, v, scale) for q, k, v in sets] if base == "hopper_kernel" else None
        if base == "prepass":
            fn = lambda i: pre(*sets[i], scale)  # noqa: E731
        else:
            fn = lambda i: ker(ops[i], sets[i][0], scale)  # noqa: E731
            out0 = ker(ops[0], sets[0][0], scale)
    elif base == "fa3_fp8_kernel":
        cast, kernel = fa3_fp8_parts("bhsd")
        ops = [cast(q, k, v) for q, k, v in sets]
        fn = lambda i: kernel(ops[i], scale)  # noqa: E731
        out0 = fn(0)
    else:
        fp4vis_calls = {"hopper": lambda: hopper_call(pol, **variant),
                        "hopper_plain": lambda: hopper_call(pol, schedule="serial"),
                        "hopper_overlap": lambda: hopper_call(pol, schedule="overlap"),
                        "reference": lambda: reference_call(pol), "blackwell": lambda: blackwell_call(pol)}
        call = attention_function(base, "bhsd") if base in BASELINES else fp4vis_calls[base]()
        fn = lambda i: call(*sets[i], scale)  # noqa: E731
        out0 = call(*sets[0], scale)
    times = time_cpu(fn, len(sets)) if quick else time_cuda(fn, len(sets), budget_s=budget_s)
    ms = statistics.median(times)
    row.update(ms=round(ms, 5), ms_min=round(min(times), 5), reps=len(times))
    if not quick:
        try:
            row["graph_ms"] = round(time_graph(lambda i: fn(0), budget=min(budget_s, 0.5)), 5)
        except Exception as exc:  # noqa: BLE001 - a backend that cannot be captured says so
            row["graph_error"] = f"{type(exc).__name__}: {str(exc)[:200]}"
            torch.cuda.synchronize()
    if not backend.startswith("prepass") and not quick:   # the CPU emulation's FLOP rate is no kernel's speed
        row["tflops"] = round(shape_flops / (ms * 1e-3) / 1e12, 2)
    if out0 is not None and check_errors and not quick:
        row["finite"] = bool(torch.isfinite(out0).all())
        if bf16_out is not None:
            from fp4vis.metrics import rel_l2
            row["rel_l2_vs_bf16"] = round(rel_l2(out0, bf16_out), 6)
        if pol is not None:
            from fp4vis.metrics import rel_l2
            q, k, v = sets[0]
            ref, idx = _reference_rows(q, k, v, pol, scale)
            sample = out0[idx[0], idx[1]][:, :, idx[2]]
            row["rel_l2_vs_reference"] = float(f"{rel_l2(sample, ref):.3e}")
            twin = get_policy(pol).spec_twin()
            if twin is not get_policy(pol):  # what an inexact Hopper policy trades: vs its exact twin
                exact_ref, _ = _reference_rows(q, k, v, twin, scale)
                row["rel_l2_vs_exact_reference"] = float(f"{rel_l2(sample, exact_ref):.3e}")


def add_speedups(rows: list[dict]) -> None:
    """speedup_vs_fa4 / speedup_vs_sdpa_cudnn for every timed row (baseline ms / row ms), and
    graph_speedup_vs_* from the GPU times (graph_ms) where both rows have one."""
    base, graph = {}, {}
    for r in rows:
        if r.get("backend") in ("fa4", "sdpa_cudnn") and "ms" in r:
            base[(r["shape"], r["backend"])] = r["ms"]
            if "graph_ms" in r:
                graph[(r["shape"], r["backend"])] = r["graph_ms"]
    pre = {(r["shape"], r.get("policy"), r["backend"]): r["ms"] for r in rows
           if r.get("backend") == "prepass" and "ms" in r}
    for r in rows:
        if "ms" not in r:
            continue
        if r.get("backend") == "hopper" and (r["shape"], r.get("policy"), "prepass") in pre:
            r["prepass_fraction"] = round(pre[(r["shape"], r.get("policy"), "prepass")] / r["ms"], 4)
        for b in ("fa4", "sdpa_cudnn"):
            if (r["shape"], b) in base:
                r[f"speedup_vs_{b}"] = round(base[(r["shape"], b)] / r["ms"], 3)
            if (r["shape"], b) in graph and "graph_ms" in r:
                r[f"graph_speedup_vs_{b}"] = round(graph[(r["shape"], b)] / r["graph_ms"], 3)


def _row_line(r: dict) -> str:
    if "ms" not in r:
        return f"{r['shape']:24s} {r['backend']:14s} {str(r.get('policy') or ''):9s} " \
               f"{r.get('skipped') or r.get('error')}"
    extra = " ".join(f"{k}={r[k]}" for k in ("tflops", "rel_l2_vs_reference", "rel_l2_vs_bf16") if k in r)
    return f"{r['shape']:24s} {r['backend']:14s} {str(r.get('policy') or ''):9s} {r['ms']:10.4f} ms {extra}"


# ------------------------------------------------------------------------------------------ output

def geo_mean_speedup(rows: list[dict], backend: str = "hopper", policy: str = "fast", baseline: str = "fa4",
                     min_s: int = 4096, d: int = 128, timing: str = "events") -> float | None:
    """Geo-mean speedup over ``baseline`` at S >= min_s and head dim d; ``timing="graph"``: of the GPU
    times (CUDA graphs) instead of the eager per-call times."""
    key = f"{'graph_' if timing == 'graph' else ''}speedup_vs_{baseline}"
    vals = [r[key] for r in rows
            if r.get("backend") == backend and r.get("policy") == policy and r.get("s", 0) >= min_s
            and r.get("d") == d and key in r]
    return math.exp(sum(math.log(v) for v in vals) / len(vals)) if vals else None


# the other attentions whose geo-mean over flash-attn-4 the summary gives beside fp4vis's
PEERS = ("fa3", "fa3_fp8", "fa3_fp8_kernel", "sage", "sdpa_cudnn")


def summary_table(rows: list[dict]) -> str:
    """Markdown: one line per shape, ms of each backend, the Hopper speedups and errors (those columns only
    where a Hopper row was timed: a CPU run has nothing to put there)."""
    shapes = list(dict.fromkeys(r["shape"] for r in rows if "shape" in r))
    cols = list(dict.fromkeys((r["backend"], r.get("policy")) for r in rows if "backend" in r))
    head = ["shape"] + [f"{b}{'/' + p if p else ''} ms" for b, p in cols]
    if not any(r.get("backend") == "hopper" and "ms" in r for r in rows):
        lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
        for s in shapes:
            cells = [s]
            for b, p in cols:
                r = next((x for x in rows if x.get("shape") == s and x.get("backend") == b
                          and x.get("policy") == p), None)
                cells.append(f"{r['ms']:.4g}" if r and "ms" in r else "—")
            lines.append("| " + " | ".join(cells) + " |")
        return "\n".join(lines + route_notes(rows))
    # the last five columns describe the first "hopper" row of each shape: name its policy
    first = next((f"hopper/{p}" if p else "hopper" for b, p in cols if b == "hopper"), "hopper")
    lines = ["| " + " | ".join(head) + f" | {first} vs fa4 | {first} vs cuDNN | {first} pre-pass share | "
             f"{first} relL2 vs ref | {first} relL2 vs bf16 |", "|" + "---|" * (len(head) + 5)]
    for s in shapes:
        cells = [s]
        hop = None
        for b, p in cols:
            r = next((x for x in rows if x.get("shape") == s and x.get("backend") == b and x.get("policy") == p),
                     None)
            cells.append(f"{r['ms']:.4g}" if r and "ms" in r else "—")
            if r and b == "hopper" and hop is None and "ms" in r:
                hop = r
        cells += [f"{hop.get('speedup_vs_fa4', '—')}", f"{hop.get('speedup_vs_sdpa_cudnn', '—')}",
                  f"{hop.get('prepass_fraction', '—')}", f"{hop.get('rel_l2_vs_reference', '—')}",
                  f"{hop.get('rel_l2_vs_bf16', '—')}"] if hop else ["—"] * 5
        lines.append("| " + " | ".join(cells) + " |")
    gms = [(b, p, geo_mean_speedup(rows, b, p)) for b, p in cols
           if (b in ("hopper", "hopper_kernel", "blackwell") and p) or b in PEERS]
    if any(gm is not None for _, _, gm in gms):
        lines.append("")
    for b, p, gm in gms:
        if gm is not None:
            graph = geo_mean_speedup(rows, b, p, timing="graph")
            name = f"{b}/{p}" if p else b
            lines.append(f"Geo-mean speedup of {name} over flash-attn-4 at S >= 4096, D = 128: {gm:.3f}x per eager "
                         f"call" + (f", {graph:.3f}x in GPU time (CUDA graphs)" if graph is not None else ""))
    return "\n".join(lines + route_notes(rows))


def route_notes(rows: list[dict]) -> list[str]:
    """Under the summary: the route of the Blackwell rows (on the H200 not a Blackwell figure)."""
    routes = sorted({r["route"] for r in rows if r.get("backend") == "blackwell" and r.get("route")})
    notes = [f"blackwell rows: route {r}" + (" (the FP4 operands upcast exactly to BF16 for wgmma: these times "
                                             "say nothing about Blackwell)" if r.startswith("sm_90") else "")
             for r in routes]
    return [""] + notes if notes else []


def write_results(rows: list[dict], path: str | Path, extra: dict | None = None) -> Path:
    """Write ``{"meta": environment(), "rows": rows}`` as JSON and the Markdown summary beside it."""
    path = Path(path)
    write_json(path, {"meta": {**environment(), **(extra or {})}, "rows": rows})
    atomic_write(path.with_suffix(".md"), summary_table(rows) + "\n")
    return path
