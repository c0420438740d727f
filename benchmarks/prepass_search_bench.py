"""The folded-K64 contender search against the full search: GPU bits and times side by side (one H200 run, < 5 min).

    python3 benchmarks/prepass_search_bench.py --out $OUT/prepass_search.json [--skip bits,prepass,calls]

Sections (each a key of the JSON, written after every section; a failing section records its traceback
and the others still run; the table of the last lines is printed from the JSON):

1. ``bits``: on CUDA tensors, held-out seeds (1000 + i), counting differing bit patterns: the NVFP4
   pre-pass (``prepass_launch.prepass``, ``folded64_mse``) with the contender search (the default) against
   ``fp4vis.formats`` (``nvfp4_qdq`` for Q and K, ``mxfp4_qdq`` for V) and against the same launch with
   the full search (``full_search=True``: every candidate); Gaussian rows over 2^-8..2^8, tiny rows
   (E4M3-subnormal scales: the m = 0.625 contender) and small integers times powers of two (exact ties),
   at B64 S197 H12 D64, B1 S4096 H24 D128 and the Wan shapes (S32760, H12 and H40, D128), the Wan shapes
   also through the fused q/k transform (RMS norms, rotary table) against ``fp4vis.formats`` on
   ``QKTransform.apply``'s q and k (diffusers' arithmetic); the FP8 pre-pass (``fp8_prepass``) against
   ``fp4vis.formats.fp8_pow2_quantize`` (+ ``mxfp4_qdq`` for V) on the same shapes.
2. ``prepass``: per shape, CUDA events, median, inputs rotated past the L2: the copy floor (a device
   copy of the bytes the pre-pass moves: q, k, v read, the operands written; one per format), the
   NVFP4 pre-pass with the contender search and with the full search, the FP8 pre-pass, and at the Wan
   shapes the same with the q/k transform folded in (``fused_*``, the rstd launch included); each over
   its copy floor.
3. ``calls``: per shape and policy (``fast``: contender search, and full search through
   ``FP4VIS_PREPASS_FULL_SEARCH=1``; ``fast_fp8qk``): the kernel alone on prepared operands, the pre-pass
   alone and the whole ``fp4vis.attention(..., backend="hopper", range_check="off")`` call, CUDA events
   over rotated inputs and replayed from a CUDA graph (GPU time only; the same inputs every call);
   kernel / call ratios.
"""

from __future__ import annotations

import argparse
import math
import shlex
import sys
import time
import traceback

import torch

from fp4vis.services.environment import environment
from fp4vis.services.outputs import write_json
from fp4vis.services.timing import input_copies, run_sections, time_events, time_graph

SHAPES = {"vit_b64_s197_h12_d64": (64, 197, 12, 64), "b1_s4096_h24": (1, 4096, 24, 128),
          "b4_s4096_h32": (4, 4096, 32, 128), "wan13_s32760_h12": (1, 32760, 12, 128),
          "wan14_s32760_h40": (1, 32760, 40, 128)}
BIT_SHAPES = ("vit_b64_s197_h12_d64", "b1_s4096_h24", "wan13_s32760_h12", "wan14_s32760_h40")
WAN = ("wan13_s32760_h12", "wan14_s32760_h40")
SEEDS = (1000, 1001, 1002)          # held out: the tests use seeds below 1000
KINDS = ("gauss", "tiny", "ties")   # seed i takes kind i


def _mk(kind: str, shape: tuple, g: torch.Generator) -> torch.Tensor:
    """BF16 (B, H, S, D): per-row powers of two over Gaussian values (``gauss``: 2^-8..2^8; ``tiny``:
    2^-12..2^-3, E4M3-subnormal candidate scales) or small integers (``ties``)."""
    rows = shape[:-1] + (1,)
    if kind == "ties":
        x = torch.randint(-48, 49, shape, generator=g, device="cuda").float()
        e = torch.randint(-14, 4, rows, generator=g, device="cuda").float()
    else:
        x = torch.randn(*shape, generator=g, device="cuda")
        lo, hi = (-8, 8) if kind == "gauss" else (-12, -2)
        e = torch.randint(lo, hi, rows, generator=g, device="cuda").float()
    return (x * torch.exp2(e)).bfloat16()


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.view({1: torch.uint8, 2: torch.int16, 4: torch.int32}[t.element_size()])


def _ndiff(a: torch.Tensor, b: torch.Tensor) -> int:
    if a.shape != b.shape or a.dtype != b.dtype:
        return -1
    return int((_bits(a) != _bits(b)).sum())


def _transform(h: int, d: int, s: int, g: torch.Generator):
    """A Wan layer's q/k transform: BF16 norm weights over H*D, a float32 rotary table."""
    from fp4vis.qk_transform import QKTransform
    w = tuple((1 + 0.2 * torch.randn(h * d, generator=g, device="cuda")).bfloat16() for _ in range(2))
    ang = torch.rand(1, s, 1, d // 2, generator=g, device="cuda").repeat_interleave(2, -1) * 50
    return QKTransform(w[0], w[1], 1e-6, 1e-6, (ang.cos(), ang.sin()))


def _raw(b: int, s: int, h: int, d: int, g: torch.Generator, kind: str = "gauss") -> tuple:
    """(q, k, v) as (B, H, S, D) views of (B, S, H*D) projections, as a patched layer hands them over."""
    return tuple(_mk(kind, (b, s, h, d), g).transpose(1, 2) for _ in range(3))


def bits() -> dict:
    from fp4vis import formats as fm
    from fp4vis.kernels.hopper import prepass_launch as tp
    cases, total = [], {"nvfp4_vs_formats": 0, "nvfp4_vs_full_search": 0, "fp8_vs_formats": 0, "values": 0}
    for name in BIT_SHAPES:
        b, s, h, d = SHAPES[name]
        for seed, kind in zip(SEEDS, KINDS):
            g = torch.Generator(device="cuda").manual_seed(seed)
            q, k, v = _raw(b, s, h, d, g, kind)
            got = tp.prepass(q, k, v, "folded64_mse")
            full = tp.prepass(q, k, v, "folded64_mse", full_search=True)
            ref = (fm.nvfp4_qdq(q, "folded64_mse").bfloat16(), fm.nvfp4_qdq(k, "folded64_mse").bfloat16(),
                   fm.mxfp4_qdq(v, times_six=True).bfloat16())
            row = dict(shape=name, seed=seed, kind=kind, transform=False, values=3 * q.numel(),
                       nvfp4_vs_formats=[_ndiff(a, r) for a, r in zip(got, ref)],
                       nvfp4_vs_full_search=[_ndiff(a, f) for a, f in zip(got, full)])
            del got, full, ref
            q8, k8, v6, qs, ks = tp.fp8_prepass(q, k, v)
            qv, qsr = fm.fp8_pow2_quantize(q, 1)
            kv, ksr = fm.fp8_pow2_quantize(k, 32)
            nb = ksr.shape[-2]
            row["fp8_vs_formats"] = [_ndiff(q8, qv.to(torch.float8_e4m3fn)), _ndiff(k8, kv.to(torch.float8_e4m3fn)),
                                     _ndiff(v6, fm.mxfp4_qdq(v, times_six=True).bfloat16()),
                                     _ndiff(qs, qsr.squeeze(-1)), _ndiff(ks[..., :nb].contiguous(), ksr.squeeze(-1))]
            del q8, k8, v6, qs, ks, qv, kv
            if name in WAN and kind == "gauss":   # the q/k transform folded in: against formats on the made q, k
                tr = _transform(h, d, s, g)
                got = tp.prepass(q, k, v, "folded64_mse", qk=tr)
                full = tp.prepass(q, k, v, "folded64_mse", qk=tr, full_search=True)
                qn, kn = tr.apply(q.transpose(1, 2), k.transpose(1, 2))
                ref = (fm.nvfp4_qdq(qn.transpose(1, 2), "folded64_mse").bfloat16(),
                       fm.nvfp4_qdq(kn.transpose(1, 2), "folded64_mse").bfloat16())
                row["transform"] = True
                row["nvfp4_vs_formats"] += [_ndiff(a, r) for a, r in zip(got[:2], ref)]
                row["nvfp4_vs_full_search"] += [_ndiff(a, f) for a, f in zip(got, full)]
                del got, full, ref, qn, kn
            for key in ("nvfp4_vs_formats", "nvfp4_vs_full_search", "fp8_vs_formats"):
                total[key] += sum(max(n, 0) for n in row[key]) + sum(1 for n in row[key] if n < 0)
            total["values"] += row["values"]
            cases.append(row)
            print(row, flush=True)
            torch.cuda.empty_cache()
    return dict(total, cases=cases)


def _floor_ms(nbytes: int) -> float:
    """A device copy of nbytes / 2 bytes: nbytes of traffic, read and written."""
    src = torch.empty(nbytes // 2, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    return time_events(lambda i: dst.copy_(src), 1)


def prepass_times() -> list:
    rows = []
    for name, shape in SHAPES.items():
        rows.append(_prepass_row(name, *shape))
        print(rows[-1], flush=True)
        torch.cuda.empty_cache()
    return rows


def _prepass_row(name: str, b: int, s: int, h: int, d: int) -> dict:
    from fp4vis.kernels.hopper import prepass_launch as tp
    g = torch.Generator(device="cuda").manual_seed(7)
    n = b * s * h * d
    copies = input_copies(3 * 2 * n)
    sets = [_raw(b, s, h, d, g) for _ in range(copies)]
    # NVFP4: 3 BF16 tensors in and out; FP8: in 3 BF16, out E4M3 q, k, BF16 v (scales negligible)
    row = dict(shape=name, b=b, s=s, h=h, d=d, copy_floor_nvfp4_ms=_floor_ms(12 * n),
               copy_floor_fp8_ms=_floor_ms(10 * n))
    row["contenders_ms"] = time_events(lambda i: tp.prepass(*sets[i], "folded64_mse"), copies)
    row["full_search_ms"] = time_events(lambda i: tp.prepass(*sets[i], "folded64_mse", full_search=True), copies)
    row["fp8_ms"] = time_events(lambda i: tp.fp8_prepass(*sets[i]), copies)
    if name in WAN:
        tr = _transform(h, d, s, g)
        row["fused_contenders_ms"] = time_events(lambda i: tp.prepass(*sets[i], "folded64_mse", qk=tr), copies)
        row["fused_full_search_ms"] = time_events(
            lambda i: tp.prepass(*sets[i], "folded64_mse", qk=tr, full_search=True), copies)
        row["fused_fp8_ms"] = time_events(lambda i: tp.fp8_prepass(*sets[i], qk=tr), copies)
    for key in [k for k in row if k.endswith("_ms") and not k.startswith("copy")]:
        floor = row["copy_floor_fp8_ms"] if "fp8" in key else row["copy_floor_nvfp4_ms"]
        row[key.replace("_ms", "_over_floor")] = row[key] / floor
    row["full_over_contenders"] = row["full_search_ms"] / row["contenders_ms"]
    return row


def call_times() -> list:
    rows = []
    for name, (b, s, h, d) in SHAPES.items():
        g = torch.Generator(device="cuda").manual_seed(11)
        copies = input_copies(3 * 2 * b * s * h * d)
        sets = [tuple(t.contiguous() for t in _raw(b, s, h, d, g)) for _ in range(copies)]
        row = dict(shape=name, b=b, s=s, h=h, d=d)
        for policy, full in (("fast", False), ("fast", True), ("fast_fp8qk", False)):
            try:
                r = _call_policy(policy, full, sets, 1.0 / math.sqrt(d))
            except Exception:
                r = {"error": traceback.format_exc()[-2000:]}
            row[policy + ("_full_search" if full else "")] = r
        rows.append(row)
        print(row, flush=True)
        sets.clear()
        torch.cuda.empty_cache()
    return rows


def _call_policy(policy: str, full: bool, sets: list, scale: float) -> dict:
    """Kernel alone, pre-pass alone and the whole call of one policy (``full``: the full search)."""
    import fp4vis
    from fp4vis import settings
    from fp4vis.evals.kernel_bench import hopper_parts
    copies = len(sets)
    with settings.overridden(FP4VIS_PREPASS_FULL_SEARCH="1" if full else "0"):
        pre, ker = hopper_parts(policy)
        ops = [pre(q, k, v, scale) for q, k, v in sets]

        def call(i):
            return fp4vis.attention(*sets[i], policy=policy, backend="hopper", range_check="off")

        r = dict(kernel_ms=time_events(lambda i: ker(ops[i], sets[i][0], scale), copies),
                 prepass_ms=time_events(lambda i: pre(*sets[i], scale), copies),
                 call_ms=time_events(call, copies),
                 kernel_graph_ms=time_graph(lambda i: ker(ops[0], sets[0][0], scale)),
                 prepass_graph_ms=time_graph(lambda i: pre(*sets[0], scale)),
                 call_graph_ms=time_graph(call))
    r["kernel_over_call"] = r["kernel_ms"] / r["call_ms"]
    r["kernel_over_call_graph"] = r["kernel_graph_ms"] / r["call_graph_ms"]
    return r


def _table(res: dict) -> list[str]:
    """The short table printed last: bits totals, then per shape pre-pass over floor and kernel / call."""
    lines = []
    b = res.get("bits")
    if isinstance(b, dict) and "values" in b:
        lines.append(f"bits: {b['values']} values; differing NVFP4 vs formats {b['nvfp4_vs_formats']}, "
                     f"vs full search {b['nvfp4_vs_full_search']}, FP8 vs formats {b['fp8_vs_formats']}")
    elif b is not None:
        lines.append(f"bits: ERROR {str(b)[-300:]}")
    pre = {r["shape"]: r for r in res.get("prepass", []) if isinstance(r, dict) and "shape" in r}
    calls = {r["shape"]: r for r in res.get("calls", []) if isinstance(r, dict) and "shape" in r}
    lines.append(f"{'shape':22s} {'floor ms':>8s} {'contend':>8s} {'full':>8s} {'x floor':>11s} {'fp8 xfl':>7s} "
                 f"{'fused x floor':>13s} | {'fast kern/call (graph)':>22s} {'full-search':>11s} {'fp8qk':>13s}")

    def f(x, spec=".3f"):
        return format(x, spec) if isinstance(x, (int, float)) else "-"

    def kc(r):
        return f"{f(r.get('kernel_over_call'), '.2f')} ({f(r.get('kernel_over_call_graph'), '.2f')})"

    for name in SHAPES:
        p, c = pre.get(name, {}), calls.get(name, {})
        fused = (f"{f(p.get('fused_contenders_over_floor'), '.2f')}/{f(p.get('fused_full_search_over_floor'), '.2f')}"
                 if "fused_contenders_ms" in p else "-")
        over = f"{f(p.get('contenders_over_floor'), '.2f')}/{f(p.get('full_search_over_floor'), '.2f')}"
        lines.append(f"{name:22s} {f(p.get('copy_floor_nvfp4_ms')):>8s} {f(p.get('contenders_ms')):>8s} "
                     f"{f(p.get('full_search_ms')):>8s} {over:>11s} {f(p.get('fp8_over_floor'), '.2f'):>7s} "
                     f"{fused:>13s} | {kc(c.get('fast', {})):>22s} {kc(c.get('fast_full_search', {})):>11s} "
                     f"{kc(c.get('fast_fp8qk', {})):>13s}")
    return lines


@torch.no_grad()
def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--skip", default="", help="comma list of sections to leave out: bits, prepass, calls")
    a = ap.parse_args(argv)
    skip = set(filter(None, a.skip.split(",")))
    res = run_sections({"date": time.strftime("%Y-%m-%d %H:%M:%S %Z"),
                        "command": shlex.join([sys.executable] + sys.argv), "env": environment()},
                       (("bits", bits), ("prepass", prepass_times), ("calls", call_times)), a.out, skip)
    try:
        from fp4vis.kernels.hopper import prepass_launch as tp
        res["launch_state"] = tp.LAUNCH_STATE
        write_json(a.out, res)
    except Exception:
        pass
    print("\n".join(_table(res)), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
