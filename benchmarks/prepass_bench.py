"""Pre-pass benchmark and GPU bit-check of the Hopper backend's Triton pre-pass (one H200 run).

    python3 benchmarks/prepass_bench.py --out $OUT/prepass.json [--old PATH_TO_OLD_MODULE]

1. Bit identity on CUDA tensors: ``hopper_prepass_triton.prepass`` (the one-launch pre-pass, through
   its cached direct launcher) against ``fp4vis.formats`` (``nvfp4_qdq`` / ``mxfp4_qdq``), counting
   differing BF16 bit patterns: Gaussian, tie-heavy (small integers times powers of two) and
   wide-range inputs (E4M3-saturating groups too), BF16 and FP16, D = 64 and 128, both layouts, with
   and without the anchor permutation, partial 32-token V blocks.
2. Pre-pass time, old (three launches, ``--old``: the previous module) against new, per shape and
   tile variant: CUDA events around each call, median, inputs rotated over enough copies to exceed
   the 50 MB L2; host time of the Python call (perf_counter, no synchronisation).
3. The whole ``torch.ops.fp4vis.hopper_attention`` call (policy ``fast``) and SDPA cuDNN: GPU time
   (CUDA events) and host time per call, without and with a synchronisation, and a breakdown of
   the host path (pre-pass launch, output allocation, config, kernel launch, custom-op dispatch).
"""

from __future__ import annotations

import argparse
import datetime as dt
import importlib.util
import json
import math
import platform
import statistics
import time
import traceback

import torch

SHAPES = [(1, 4096, 24, 128), (1, 32768, 24, 128), (1, 256, 16, 128), (64, 197, 12, 64)]
L2_BYTES = 50 * 2**20


def _copies(nbytes: int) -> int:
    return max(2, min(64, math.ceil(3 * L2_BYTES / max(nbytes, 1))))


def time_events(fn, n_inputs: int, budget: float = 0.25) -> float:
    """Median ms of fn(i) by CUDA events, i rotating over the inputs (fp4vis.evals.kernel_bench's timer)."""
    from fp4vis.evals.kernel_bench import time_cuda
    return statistics.median(time_cuda(fn, n_inputs, reps=2000, budget_s=budget))


def time_host(fn, n_inputs: int, reps: int = 200, sync: bool = False) -> float:
    """Median microseconds of the Python call fn(i) (sync: including the wait for the GPU)."""
    for i in range(5):
        fn(i % n_inputs)
    torch.cuda.synchronize()
    ts = []
    for i in range(reps):
        if not sync and i % 16 == 0:
            torch.cuda.synchronize()   # keep the launch queue short: measure the host path alone
        t0 = time.perf_counter()
        fn(i % n_inputs)
        if sync:
            torch.cuda.synchronize()
        ts.append(time.perf_counter() - t0)
    return statistics.median(ts) * 1e6


def _mk(kind, shape, g, dtype, dev):
    if kind == "gauss":
        x = torch.randn(*shape, generator=g, device=dev)
    elif kind == "ties":
        x = torch.randint(-48, 49, shape, generator=g, device=dev).float() * torch.exp2(
            torch.randint(-8, 4, shape[:-1] + (1,), generator=g, device=dev).float())
    else:  # wide: per-element exponents over 44 binades, some E4M3-saturating groups
        x = torch.randn(*shape, generator=g, device=dev) * torch.exp2(
            torch.randint(-30, 14, shape, generator=g, device=dev).float())
    return x.clamp(-60000, 60000).to(dtype)


def bit_check(tp, log) -> dict:
    from fp4vis.formats import mxfp4_qdq, nvfp4_qdq
    from fp4vis.kernels.hopper_prepass import cached_anchor_permutation
    dev = "cuda"
    g = torch.Generator(device=dev).manual_seed(0)
    cases, total_diff, total_vals = [], 0, 0
    configs = [(dtype, d, layout, kind, anchor, (b, h, sq, sk))
               for dtype in (torch.bfloat16, torch.float16) for d in (64, 128)
               for layout in ("folded64_mse", "block16") for kind in ("gauss", "ties", "wide")
               for anchor in (0, 32) for (b, h, sq, sk) in ((2, 3, 77, 301),)]
    configs += [(torch.bfloat16, 128, lay, "gauss", 0, (1, 24, 4096, 4096)) for lay in ("folded64_mse", "block16")]
    configs += [(torch.bfloat16, 128, "folded64_mse", "gauss", 128, (1, 8, 4096, 4093))]
    for dtype, d, layout, kind, anchor, (b, h, sq, sk) in configs:
        q = _mk(kind, (b, h, sq, d), g, dtype, dev)
        k = _mk(kind, (b, h, sk, d), g, dtype, dev)
        v = _mk(kind, (b, h, sk, d), g, dtype, dev)
        perm = cached_anchor_permutation(sk, anchor, q.device, torch.int32) if anchor else None
        for _ in range(2):   # the second call goes through the cached direct launcher
            yq, yk, yv = tp.prepass(q, k, v, layout, perm)
        kk, vv = (k[:, :, perm.long()], v[:, :, perm.long()]) if anchor else (k, v)
        ref = (nvfp4_qdq(q, layout).to(torch.bfloat16), nvfp4_qdq(kk, layout).to(torch.bfloat16),
               mxfp4_qdq(vv, times_six=True).to(torch.bfloat16))
        diffs = [int((a.view(torch.int16) != r.view(torch.int16)).sum()) for a, r in zip((yq, yk, yv), ref)]
        n = q.numel() + 2 * k.numel()
        total_diff += sum(diffs)
        total_vals += n
        cases.append(dict(dtype=str(dtype), d=d, layout=layout, kind=kind, anchor=anchor, shape=[b, h, sq, sk],
                          values=n, differing_qkv=diffs))
        if sum(diffs):
            if layout == "folded64_mse":
                cases[-1]["exact_check"] = _exact_check((q, kk), (yq, yk), ref[:2])
            log(f"  DIFF {cases[-1]}")
    log(f"bit check: {total_diff} differing of {total_vals} values over {len(cases)} cases")
    return dict(differing=total_diff, values=total_vals, cases=cases)


def _exact_check(xs, ys, refs, limit=8) -> list:
    """For folded64 groups where the kernel and fp4vis.formats differ: the candidate errors summed
    exactly (fractions); records which of the two picked the first exact minimum."""
    from fractions import Fraction

    from fp4vis.formats import FOLDED_MSE_MULTIPLIERS, e2m1_round, e4m3_round
    out = []
    for x, y, r in zip(xs, ys, refs):
        d = x.shape[-1]
        bad_rows = (y.view(torch.int16) != r.view(torch.int16)).reshape(-1, d).any(-1).nonzero().flatten()
        for row in bad_rows.tolist()[:limit]:
            xr = x.reshape(-1, d)[row].float().to(torch.bfloat16).float().cpu()
            yr, rr = y.reshape(-1, d)[row].float().cpu(), r.reshape(-1, d)[row].float().cpu()
            for j in range(d // 32):
                idx = list(range(16 * j, 16 * j + 16)) + list(range(d // 2 + 16 * j, d // 2 + 16 * j + 16))
                if torch.equal(yr[idx], rr[idx]):
                    continue
                g = xr[idx]
                base = (g.abs().max().double() / 6).float()
                cands = e4m3_round(base * torch.tensor(FOLDED_MSE_MULTIPLIERS))
                errs = []
                for sc in cands.tolist():
                    vals = e2m1_round(g / sc) if sc > 0 else torch.zeros_like(g)
                    errs.append(sum((Fraction(a) * Fraction(sc) - Fraction(b)) ** 2
                                    for a, b in zip(vals.tolist(), g.tolist())))
                first = min(range(12), key=lambda i: (errs[i], i))
                sc_best = cands[first].item()

                def picks(vals, sc_best=sc_best, g=g):
                    ref_vals = (e2m1_round(g / sc_best) * sc_best) if sc_best > 0 else torch.zeros_like(g)
                    return bool(torch.equal(vals.to(torch.bfloat16).float(), ref_vals.to(torch.bfloat16).float()))

                out.append(dict(row=row, group=j, exact_best_scale=sc_best, kernel_exact=picks(yr[idx]),
                                reference_exact=picks(rr[idx]), base_x1_25_gt_448=bool(base * 1.25 > 448),
                                exact_errors_equal_to_min=[i for i in range(12) if errs[i] == errs[first]]))
    return out


def old_prepass(old, q, k, v, layout, perm):
    return old.nvfp4_qdq(q, layout), old.nvfp4_qdq(k, layout, perm), old.mxfp4_v6(v, perm)


def bench_shapes(tp, old, log) -> list:
    rows = []
    for shape in SHAPES:
        rows.append(_prepass_one(tp, old, shape, log))
        torch.cuda.empty_cache()
    return rows


def _prepass_one(tp, old, shape, log) -> dict:
    b, s, h, d = shape
    variants = [(16, 4), (32, 8)]
    nbytes = 3 * b * h * s * d * 2
    n = _copies(nbytes)
    ins = [tuple(torch.randn(b, h, s, d, device="cuda", dtype=torch.bfloat16) for _ in range(3)) for _ in range(n)]
    row = dict(shape=[b, s, h, d], copies=n, bytes_moved=2 * nbytes)
    for layout in ("folded64_mse", "block16"):
        tag = "" if layout == "folded64_mse" else "_block16"
        if old is not None:
            row["old_ms" + tag] = time_events(lambda i, lay=layout: old_prepass(old, *ins[i], lay, None), n)
            row["old_host_us" + tag] = time_host(lambda i, lay=layout: old_prepass(old, *ins[i], lay, None), n)
        for br, nw in variants if layout == "folded64_mse" else [(tp.BLOCK_R, tp.NUM_WARPS)]:
            row[f"new_r{br}_w{nw}_ms" + tag] = time_events(
                lambda i, lay=layout, br=br, nw=nw: tp.prepass(*ins[i], lay, None, br, nw), n)
        row["new_host_us" + tag] = time_host(lambda i, lay=layout: tp.prepass(*ins[i], lay, None), n)
    log(f"{row}")
    return row


def bench_calls(log) -> list:
    rows = []
    for shape in SHAPES:
        rows.append(_call_one(shape, log))
        torch.cuda.empty_cache()
    return rows


def _call_one(shape, log) -> dict:
    import torch.nn.functional as F

    from fp4vis.kernels import hopper_backend as hb
    from fp4vis.kernels.hopper_prepass import prepare_kernel_operands
    from fp4vis.policy import POLICIES
    b, s, h, d = shape
    row = dict(shape=[b, s, h, d])
    n = _copies(3 * b * h * s * d * 2)
    ins = [tuple(torch.randn(b, h, s, d, device="cuda", dtype=torch.bfloat16) for _ in range(3)) for _ in range(n)]
    try:
        scale = d ** -0.5
        kw = hb.policy_args(POLICIES["fast"], d, scale)
        op = torch.ops.fp4vis.hopper_attention

        def call(i):
            return op(*ins[i], scale, **kw)

        call(0)
        torch.cuda.synchronize()
        row["call_ms"] = time_events(call, n)
        row["call_host_us"] = time_host(call, n)
        row["call_host_sync_us"] = time_host(call, n, sync=True)
        raw = getattr(hb.hopper_attention, "_init_fn", None)
        if raw is not None:
            row["call_nodispatch_host_us"] = time_host(lambda i: raw(*ins[i], scale, **kw), n)
        row["prepass_host_us"] = time_host(lambda i: prepare_kernel_operands(*ins[i], kw["qk_fmt"], kw["anchor"]), n)
        row["empty_host_us"] = time_host(lambda i: torch.empty(ins[i][0].shape, dtype=torch.bfloat16,
                                                               device="cuda"), n)
        m = min(n, 4)
        ops = [prepare_kernel_operands(*ins[i], kw["qk_fmt"], kw["anchor"]) for i in range(m)]
        outs = [torch.empty_like(ins[i][0]) for i in range(m)]
        from fp4vis.kernels.hopper_fwd import DirectPConfig
        cfg_args = (d, "bf16", kw["affine_a"], kw["affine_b"], kw["shift"], kw["native_exp2"], kw["anchor"])
        row["config_host_us"] = time_host(lambda i: DirectPConfig.make(*cfg_args), n)
        cfg = DirectPConfig.make(*cfg_args)

        def kern(i):
            hb.run_kernel(*ops[i], outs[i], cfg, scale * hb.LOG2E, kw["margin_raw"])

        row["kernel_ms"] = time_events(kern, m)
        row["kernel_host_us"] = time_host(kern, m)
    except Exception as exc:
        row["hopper_error"] = f"{type(exc).__name__}: {exc}"
        log(traceback.format_exc())
    try:
        from torch.nn.attention import SDPBackend, sdpa_kernel

        def sd(i):
            return F.scaled_dot_product_attention(*ins[i])

        with sdpa_kernel([SDPBackend.CUDNN_ATTENTION]):
            row["sdpa_cudnn_ms"] = time_events(sd, n)
            row["sdpa_cudnn_host_us"] = time_host(sd, n)
            row["sdpa_cudnn_host_sync_us"] = time_host(sd, n, sync=True)
    except Exception as exc:
        row["sdpa_error"] = f"{type(exc).__name__}: {exc}"
    log(f"{row}")
    return row


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--old", default=None, help="path of the previous hopper_prepass_triton.py (three launches)")
    ap.add_argument("--skip", default="", help="comma list of: bits,prepass,calls")
    a = ap.parse_args()
    lines = []

    def log(msg):
        print(msg, flush=True)
        lines.append(msg)

    import triton

    from fp4vis.kernels import hopper_prepass_triton as tp
    tp.FAST_LAUNCH = True   # check the direct launcher too (bit check: second call; host timings)
    old = None
    if a.old:
        spec = importlib.util.spec_from_file_location("old_prepass_triton", a.old)
        old = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(old)
    meta = dict(date=dt.datetime.now(dt.UTC).isoformat(), gpu=torch.cuda.get_device_name(),
                torch=torch.__version__, triton=triton.__version__, python=platform.python_version(),
                defaults=dict(block_r=tp.BLOCK_R, num_warps=tp.NUM_WARPS))
    res = dict(meta=meta)
    skip = set(a.skip.split(","))
    t0 = time.perf_counter()
    for name, fn in (("bits", lambda: bit_check(tp, log)), ("prepass", lambda: bench_shapes(tp, old, log)),
                     ("calls", lambda: bench_calls(log))):
        if name in skip:
            continue
        try:
            res[name] = fn()
        except Exception as exc:
            res[name + "_error"] = f"{type(exc).__name__}: {exc}"
            log(traceback.format_exc())
        log(f"[{name} done at {time.perf_counter() - t0:.1f} s]")
        with open(a.out, "w") as f:
            json.dump(res, f, indent=1)
    res["fast_launch"] = tp.FAST_LAUNCH
    res["launch_state"] = tp.LAUNCH_STATE
    with open(a.out, "w") as f:
        json.dump(res, f, indent=1)


if __name__ == "__main__":
    main()
