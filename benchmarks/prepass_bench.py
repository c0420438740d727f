"""Pre-pass benchmark and GPU bit-check of the Hopper backend's Triton pre-passes (one H200 run, ~3 min).

    python3 benchmarks/prepass_bench.py --out $OUT/prepass.json [--old PATH_TO_OLD_MODULE] [--skip fp8,...]

Sections (each one a key of the JSON, written after every section; ``--skip`` leaves any out):

1. ``bits``: bit identity on CUDA tensors: ``prepass_triton.prepass`` (the one-launch NVFP4
   pre-pass, through its cached direct launcher) against ``fp4vis.formats`` (``nvfp4_qdq`` /
   ``mxfp4_qdq``), counting differing BF16 bit patterns: Gaussian, tie-heavy (small integers times
   powers of two) and wide-range inputs (E4M3-saturating groups too), BF16 and FP16, D = 64 and
   128, both layouts, with and without the anchor permutation, partial 32-token V blocks.
2. ``fp8bits``: the same for the fused FP8 pre-pass (``prepass_triton.fp8_prepass``, policy
   ``fast_fp8qk``): against the PyTorch formulation (``prepare_fp8_operands(..., fused=False)``) and
   against ``fp4vis.formats.fp8_pow2_quantize`` (+ ``mxfp4_qdq`` for V), counting differing values of
   each of (q8, k8, v6, q_scale, k_scale): E4M3 as uint8 bit patterns, V as BF16 bits, scales as
   float32 bits (k_scale padded with 1.0 to whole 128-key tiles). Gaussian, tie-heavy, wide-range and
   group-scaled inputs (per-group powers of two over 2^+-20, zero and tiny groups), BF16 and FP16,
   D = 64 and 128, anchor 0 and 32, Skv = 301 (not a multiple of 32 or 128), Sq != Skv, and three
   large shapes; for each case the first call (ordinary Triton launch: the cached launch state of
   that input signature is dropped before it) and the second (the direct launcher when
   ``direct_launch_on()``), each with the launch path taken and ``LAUNCH_STATE``. Also NaN/Inf inputs:
   NaN operands exactly where the (permuted) input is not finite, other rows and key blocks
   unchanged. The NVFP4 check runs both E2M1 code forms of the search (FP16 pairs, the default
   on the GPU, and float32: ``differing_qkv_f32_codes``).
3. ``prepass``: pre-pass time per shape, CUDA events around each call, median, inputs rotated over
   enough copies to exceed the 50 MB L2; host time of the Python call (perf_counter, no
   synchronisation). NVFP4: old (three launches, ``--old``: the previous module) against new, per
   tile variant; FP8 (``fp8_*`` keys): the fused pre-pass (default warps and 8 warps) and the PyTorch
   formulation, on the same shapes and inputs. ``new_f16codes_ms`` / ``new_f32codes_ms``: the NVFP4
   pre-pass with its E2M1 codes on FP16 pairs / in float32, side by side.
4. ``calls``: the whole ``torch.ops.fp4vis.hopper_attention`` call for policy ``fast`` (the row's
   top-level keys) and ``fast_fp8qk`` (the same keys nested under ``row["fast_fp8qk"]``), and SDPA
   cuDNN: GPU time (CUDA events) and host time per call, without and with a synchronisation, a
   breakdown of the host path (pre-pass launch, output allocation, config, kernel launch, custom-op
   dispatch) and the call's relative L2 distance to SDPA (a sanity check of what was timed). For
   S <= 1024 (host-bound: the issue's small-shape target) also the public ``fp4vis.attention`` call
   (``api_ms`` with ``range_check="off"``, ``api_raise_ms`` with the default check, ``api_host_us``)
   and the GPU time per call replayed from a CUDA graph (``graph_ms``, ``sdpa_cudnn_graph_ms``), and
   of its two parts alone (``prepass_graph_ms``, ``kernel_graph_ms``).

Host timings take at most 200 calls and about ``HOST_BUDGET_S`` of wall time each (at least 32
calls), so that the 32k-token shape does not dominate the run. Also recorded: the final
``direct_launch_on()`` / ``LAUNCH_STATE`` of the Triton module and the Triton launch hooks (a set hook turns
the direct launcher off), the CuTe DSL compile times, and each section's wall time.
"""

from __future__ import annotations

import argparse
import importlib.util
import sys
import time
import traceback

import torch

from fp4vis.layout import LOG2E
from fp4vis.services.environment import environment
from fp4vis.services.outputs import write_json
from fp4vis.services.timing import HOST_BUDGET_S, input_copies, time_events, time_graph, time_host

SHAPES = [(1, 4096, 24, 128), (1, 32768, 24, 128), (1, 256, 16, 128), (1, 1024, 16, 128), (64, 197, 12, 64),
          (8, 577, 16, 64)]
SMALL_S = 1024       # the small-shape target (whole call within 1.25x of SDPA cuDNN) is S <= 1024
CALL_POLICIES = ("fast", "fast_fp8qk")   # whole-call section: "fast" keys top-level, others nested
SECTIONS = ("bits", "fp8bits", "prepass", "calls")
SKIP_PARTS = ("fp8prepass", "fp8calls")   # the FP8 parts of the prepass / calls sections
SKIP_HELP = ("comma list of what to leave out: bits (NVFP4 bit check), fp8bits (FP8 bit check), "
             "prepass (all pre-pass timings), fp8prepass (only the FP8 pre-pass timings), calls (the "
             "whole-call section), fp8calls (only its fast_fp8qk part), fp8 (= fp8bits,fp8prepass,fp8calls: "
             "the run as before the FP8 path)")


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
    from fp4vis.kernels.hopper.prepass import cached_anchor_permutation
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
        f32_form = tp.prepass(q, k, v, layout, perm, f16_codes=False) if hasattr(tp, "f16_codes_default") else None
        kk, vv = (k[:, :, perm.long()], v[:, :, perm.long()]) if anchor else (k, v)
        ref = (nvfp4_qdq(q, layout).to(torch.bfloat16), nvfp4_qdq(kk, layout).to(torch.bfloat16),
               mxfp4_qdq(vv, times_six=True).to(torch.bfloat16))
        diffs = [int((a.view(torch.int16) != r.view(torch.int16)).sum()) for a, r in zip((yq, yk, yv), ref)]
        n = q.numel() + 2 * k.numel()
        total_diff += sum(diffs)
        total_vals += n
        cases.append(dict(dtype=str(dtype), d=d, layout=layout, kind=kind, anchor=anchor, shape=[b, h, sq, sk],
                          values=n, differing_qkv=diffs))
        if f32_form is not None:   # the other E2M1 code form (float32 when the default is FP16 pairs)
            diffs32 = [int((a.view(torch.int16) != r.view(torch.int16)).sum()) for a, r in zip(f32_form, ref)]
            cases[-1]["f16_codes_default"] = tp.f16_codes_default()
            cases[-1]["differing_qkv_f32_codes"] = diffs32
            total_diff += sum(diffs32)
            total_vals += n
        if sum(diffs):
            if layout == "folded64_mse":
                cases[-1]["exact_check"] = _exact_check((q, kk), (yq, yk), ref[:2])
            log(f"  DIFF {cases[-1]}")
    log(f"bit check: {total_diff} differing of {total_vals} values over {len(cases)} cases")
    return dict(differing=total_diff, values=total_vals, cases=cases, fast_launch=tp.direct_launch_on(),
                launch_state=tp.LAUNCH_STATE)


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


FP8_OPERANDS = ("q8", "k8", "v6", "q_scale", "k_scale")


def _bits(t: torch.Tensor) -> torch.Tensor:
    """Bit patterns of an operand: E4M3 as uint8, BF16/FP16 as int16, float32 as int32 (signed zeros
    and NaN codes count)."""
    if t.dtype == torch.float8_e4m3fn:
        return t.view(torch.uint8)
    if t.dtype in (torch.bfloat16, torch.float16):
        return t.view(torch.int16)
    return t.view(torch.int32) if t.dtype == torch.float32 else t


def _ndiff(a: torch.Tensor, r: torch.Tensor) -> int:
    """Number of differing bit patterns of a and r; -1 where their shapes or dtypes differ."""
    if a.shape != r.shape or a.dtype != r.dtype:
        return -1
    return int((_bits(a) != _bits(r)).sum())


def _diff_examples(a: torch.Tensor, r: torch.Tensor, x: torch.Tensor | None, limit: int = 4) -> list:
    """The first differing positions of a and r (flat index, both bit patterns, the input there)."""
    if a.shape != r.shape or a.dtype != r.dtype:
        return [dict(shape=list(a.shape), dtype=str(a.dtype), ref_shape=list(r.shape), ref_dtype=str(r.dtype))]
    ab, rb = _bits(a).flatten(), _bits(r).flatten()
    idx = (ab != rb).nonzero().flatten()[:limit].tolist()
    return [dict(index=i, got=int(ab[i]), ref=int(rb[i]),
                 input=None if x is None else float(x.flatten()[i].float())) for i in idx]


def _mk_groups(shape, group_rows, dtype, g, dev):
    """Rows grouped as the FP8 pre-pass groups them (tests/kernels/hopper/test_hopper_prepass.py): each
    group scaled by its own power of two (BF16 2^-20..2^20, FP16 within its range) around
    8-significant-bit integers (RNE ties, carries into the next binade) with per-element exponents over
    14 binades (E4M3 subnormals, underflow to +-0); the first group all zero, the second tiny (float32
    subnormals for BF16)."""
    x = torch.randint(-255, 256, shape, generator=g, device=dev).float()
    x = x * torch.exp2(-torch.randint(0, 14, shape, generator=g, device=dev).float())
    lo, hi, tiny = (-20, 20, -136) if dtype == torch.bfloat16 else (-16, 8, -24)
    rows = shape[-2]
    ge = torch.randint(lo, hi + 1, tuple(shape[:-2]) + (-(-rows // group_rows),), generator=g, device=dev).float()
    if ge.shape[-1] > 1:
        ge[..., 1] = tiny
    x = x * torch.exp2(ge.repeat_interleave(group_rows, -1)[..., :rows, None])
    x[..., :group_rows, :] = 0.0
    return x.to(dtype)


def _fp8_inputs(kind, b, h, sq, sk, d, dtype, perm, g, dev):
    """q, k, v (logical key order) of one FP8 case; 'groups' builds K and V in physical order (the
    pre-pass's 32-key groups) and scatters them back through the anchor permutation."""
    if kind != "groups":
        return tuple(_mk(kind, (b, h, s, d), g, dtype, dev) for s in (sq, sk, sk))
    q = _mk_groups((b, h, sq, d), 1, dtype, g, dev)
    kv = []
    for _ in range(2):
        x = _mk_groups((b, h, sk, d), 32, dtype, g, dev)
        if perm is not None:
            y = torch.empty_like(x)
            y[:, :, perm.long()] = x
            x = y
        kv.append(x)
    return (q, *kv)


def _fp8_formats_ref(q, kk, vv):
    """(q8, k8, v6, q_scale, k_scale) from fp4vis.formats for q and physical-order kk, vv."""
    from fp4vis.formats import fp8_pow2_quantize, mxfp4_qdq
    from fp4vis.kernels.hopper.layout import fp8_key_scale_blocks
    qv, qs = fp8_pow2_quantize(q, 1)
    kv, ks = fp8_pow2_quantize(kk, 32)
    ks = ks.squeeze(-1)
    ks = torch.nn.functional.pad(ks, (0, fp8_key_scale_blocks(kk.shape[-2]) - ks.shape[-1]), value=1.0)
    return (qv.to(torch.float8_e4m3fn), kv.to(torch.float8_e4m3fn),
            mxfp4_qdq(vv, times_six=True).to(torch.bfloat16), qs.squeeze(-1).contiguous(), ks.contiguous())


def _fp8_meta_key(tp, q, k, v, perm) -> tuple:
    """The key under which ``fp8_prepass`` keeps its launch state for these inputs (default warps): the
    module's own ``fp8_meta_key`` where it has one (an ``--old`` module may not)."""
    if hasattr(tp, "fp8_meta_key"):
        return tp.fp8_meta_key(q, k, v, perm)
    return (q.shape, k.shape, v.shape, q.dtype, k.dtype, v.dtype, perm is not None, None, q.device)


def _fp8_calls(tp, q, k, v, perm, n_calls=2):
    """n_calls calls of the fused FP8 pre-pass, the first through the ordinary Triton launch (the
    signature's cached launch state, whose last entry is the direct launch's compiled kernel, is
    dropped first); per call (outputs, launch path, LAUNCH_STATE after the call). The path is
    "unknown" where the module keeps its state under another key than ``_fp8_meta_key``."""
    metas = getattr(tp, "_FP8_META", {})
    key = _fp8_meta_key(tp, q, k, v, perm)
    metas.pop(key, None)
    out = []
    for _ in range(n_calls):
        meta = metas.get(key)
        cached, fast = meta is not None and meta[-1] is not None, tp.direct_launch_on()
        ops = tp.fp8_prepass(q, k, v, perm)
        if q.is_cuda:
            torch.cuda.synchronize()   # a launch fault shows here, at its call
        direct = cached and fast and tp.direct_launch_on()   # turned off where the direct call raised
        path = "direct" if direct else ("triton" if key in metas else "unknown")
        out.append((ops, path, tp.LAUNCH_STATE))
    return out


def _fp8_configs():
    configs = [(dtype, d, kind, anchor, (2, 3, 77, 301))
               for dtype in (torch.bfloat16, torch.float16) for d in (64, 128)
               for kind in ("gauss", "ties", "wide", "groups") for anchor in (0, 32)]
    configs += [(torch.bfloat16, 128, "gauss", 0, (1, 24, 4096, 4096)),
                (torch.bfloat16, 128, "wide", 32, (1, 8, 4096, 4093)),
                (torch.float16, 64, "ties", 0, (64, 12, 197, 197))]
    return configs


def fp8_bit_check(tp, log, dev: str = "cuda", configs: list | None = None) -> dict:
    """The fused FP8 pre-pass (first and second call) against prepare_fp8_operands(fused=False) and
    against fp4vis.formats, per operand (q8, k8, v6, q_scale, k_scale) the number of differing values."""
    from fp4vis.kernels.hopper.prepass import cached_anchor_permutation, prepare_fp8_operands
    g = torch.Generator(device=dev).manual_seed(1)
    res = dict(operands=list(FP8_OPERANDS), fast_launch_at_start=tp.direct_launch_on(),
               launch_state_at_start=tp.LAUNCH_STATE)
    cases, total_diff, total_vals, mismatched, torch_formats = [], 0, 0, 0, 0
    paths = {}
    for dtype, d, kind, anchor, (b, h, sq, sk) in configs or _fp8_configs():
        perm = cached_anchor_permutation(sk, anchor, torch.device(dev), torch.int32) if anchor else None
        q, k, v = _fp8_inputs(kind, b, h, sq, sk, d, dtype, perm, g, dev)
        kk, vv = (k[:, :, perm.long()], v[:, :, perm.long()]) if anchor else (k, v)
        plain = prepare_fp8_operands(q, k, v, anchor, fused=False)
        ref = _fp8_formats_ref(q, kk, vv)
        case = dict(dtype=str(dtype), d=d, kind=kind, anchor=anchor, shape=[b, h, sq, sk],
                    values=q.numel() + 2 * k.numel(), scales=ref[3].numel() + ref[4].numel(),
                    torch_vs_formats=[_ndiff(a, r) for a, r in zip(plain, ref)])
        torch_formats += sum(max(x, 0) for x in case["torch_vs_formats"])
        bad = any(x != 0 for x in case["torch_vs_formats"])
        for name, (ops, path, state) in zip(("first", "second"), _fp8_calls(tp, q, k, v, perm)):
            rec = dict(path=path, launch_state=state, vs_torch=[_ndiff(a, r) for a, r in zip(ops, plain)],
                       vs_formats=[_ndiff(a, r) for a, r in zip(ops, ref)])
            paths[f"{name}:{path}"] = paths.get(f"{name}:{path}", 0) + 1
            for x in rec["vs_torch"] + rec["vs_formats"]:
                total_diff += max(x, 0)
                mismatched += x < 0
            if any(rec["vs_formats"]):
                rec["examples_vs_formats"] = {
                    op: _diff_examples(a, r, x) for op, a, r, x, n in
                    zip(FP8_OPERANDS, ops, ref, (q, kk, vv, None, None), rec["vs_formats"]) if n}
            bad = bad or any(rec["vs_torch"]) or any(rec["vs_formats"])
            case[name] = rec
            total_vals += 2 * (case["values"] + case["scales"])   # compared twice: vs torch, vs formats
        cases.append(case)
        if bad:
            log(f"  FP8 DIFF {case}")
    res.update(differing=total_diff, compared=total_vals, shape_or_dtype_mismatches=mismatched,
               torch_vs_formats_differing=torch_formats, paths=paths, cases=cases)
    try:
        res["nonfinite"] = _fp8_nonfinite(tp, dev)
    except Exception as exc:
        res["nonfinite_error"] = f"{type(exc).__name__}: {exc}"
        log(traceback.format_exc())
    res.update(fast_launch=tp.direct_launch_on(), launch_state=tp.LAUNCH_STATE)
    log(f"FP8 bit check: {total_diff} differing of {total_vals} compared values (fused vs torch and vs formats, "
        f"two calls) over {len(cases)} cases, {mismatched} shape/dtype mismatches, torch vs formats "
        f"{torch_formats}; paths {paths}; non-finite {res.get('nonfinite', {}).get('bad')}; "
        f"LAUNCH_STATE {tp.LAUNCH_STATE!r}")
    return res


def _fp8_nonfinite(tp, dev: str) -> dict:
    """NaN/Inf in q, k, v: both calls of the fused FP8 pre-pass give NaN exactly where the (physical)
    input is not finite, and rows / key blocks without a non-finite value equal fp4vis.formats
    (tests/kernels/hopper/test_hopper_prepass.py statement, on the GPU's conversions)."""
    from fp4vis.kernels.hopper.prepass import cached_anchor_permutation
    g = torch.Generator(device=dev).manual_seed(2)
    b, h, sq, sk, d = 1, 2, 21, 77, 128
    out, bad = [], 0
    for dtype in (torch.bfloat16, torch.float16):
        for anchor in (0, 32):
            q, k, v = (torch.randn(b, h, s, d, generator=g, device=dev).to(dtype) for s in (sq, sk, sk))
            q[0, 1, 4, 7], q[0, 0, 2, 3] = float("nan"), -float("inf")
            k[0, 1, 10, 5], k[0, 0, 50, 0], k[0, 0, 51, 1] = float("inf"), -float("nan"), float("nan")
            v[0, 0, 7, 2] = float("nan")
            perm = cached_anchor_permutation(sk, anchor, torch.device(dev), torch.int32) if anchor else None
            kk, vv = (k[:, :, perm.long()], v[:, :, perm.long()]) if anchor else (k, v)
            rq8, rk8, _, rqs, rks = _fp8_formats_ref(q, kk, vv)
            nb = -(-sk // 32)
            row_ok = torch.isfinite(q).all(-1)
            key_pad = torch.nn.functional.pad(torch.isfinite(kk), (0, 0, 0, 32 * nb - sk), value=True)
            blk_ok = key_pad.unflatten(-2, (nb, 32)).all(-1).all(-1)
            key_ok = blk_ok.repeat_interleave(32, -1)[..., :sk]
            for call, ((q8, k8, v6, qs, ks), path, _) in enumerate(_fp8_calls(tp, q, k, v, perm)):
                nan = [int((torch.isnan(t.float()) != ~torch.isfinite(x)).sum()) for t, x in
                       ((q8, q), (k8, kk), (v6, vv))]
                finite = [int((_bits(q8)[row_ok] != _bits(rq8)[row_ok]).sum()),
                          int((_bits(qs)[row_ok] != _bits(rqs)[row_ok]).sum()),
                          int((_bits(k8)[key_ok] != _bits(rk8)[key_ok]).sum()),
                          int((_bits(ks[..., :nb])[blk_ok] != _bits(rks[..., :nb])[blk_ok]).sum())]
                bad += sum(nan) + sum(finite)
                out.append(dict(dtype=str(dtype), anchor=anchor, call=call + 1, path=path,
                                nan_mismatch_q8_k8_v6=nan, finite_groups_differing_q8_qscale_k8_kscale=finite))
    return dict(bad=bad, cases=out)


def old_prepass(old, q, k, v, layout, perm):
    return old.nvfp4_qdq(q, layout), old.nvfp4_qdq(k, layout, perm), old.mxfp4_v6(v, perm)


def bench_shapes(tp, old, log, fp8: bool = True) -> list:
    rows = []
    for shape in SHAPES:
        rows.append(_prepass_one(tp, old, shape, log, fp8))
        torch.cuda.empty_cache()
    return rows


def _prepass_one(tp, old, shape, log, fp8: bool = True) -> dict:
    b, s, h, d = shape
    variants = [(16, 4), (32, 8)] + ([(16, 2), (32, 4)] if d == 64 else [])
    nbytes = 3 * b * h * s * d * 2
    n = input_copies(nbytes)
    ins = [tuple(torch.randn(b, h, s, d, device="cuda", dtype=torch.bfloat16) for _ in range(3)) for _ in range(n)]
    row = dict(shape=[b, s, h, d], copies=n, bytes_moved=2 * nbytes)
    for layout in ("folded64_mse", "block16"):
        tag = "" if layout == "folded64_mse" else "_block16"
        if old is not None:
            row["old_ms" + tag] = time_events(lambda i, lay=layout: old_prepass(old, *ins[i], lay, None), n)
            row["old_host_us" + tag] = time_host(lambda i, lay=layout: old_prepass(old, *ins[i], lay, None), n)
        for br, nw in variants if layout == "folded64_mse" else [tp.nvfp4_launch(d)[:2]]:
            row[f"new_r{br}_w{nw}_ms" + tag] = time_events(
                lambda i, lay=layout, br=br, nw=nw: tp.prepass(*ins[i], lay, None, br, nw), n)
        if hasattr(tp, "f16_codes_default"):   # the E2M1 codes in float32 instead of on FP16 pairs, same launch
            row["f16_codes_default"] = tp.f16_codes_default()
            row["new_f32codes_ms" + tag] = time_events(
                lambda i, lay=layout: tp.prepass(*ins[i], lay, None, None, None, False), n)
            row["new_f16codes_ms" + tag] = time_events(
                lambda i, lay=layout: tp.prepass(*ins[i], lay, None, None, None, True), n)
        row["new_host_us" + tag] = time_host(lambda i, lay=layout: tp.prepass(*ins[i], lay, None), n)
    if fp8:
        try:
            _fp8_prepass_times(tp, ins, n, row)
        except Exception as exc:
            row["fp8_error"] = f"{type(exc).__name__}: {exc}"
            log(traceback.format_exc())
    log(f"{row}")
    return row


def _fp8_prepass_times(tp, ins, n, row) -> None:
    """FP8 pre-pass keys of a prepass row: the fused pre-pass with the default warps (fp8_ms,
    fp8_host_us) and with 2, 4 and 8 warps (fp8_w{2,4,8}_ms), the PyTorch formulation (fp8_torch_ms),
    bytes read + written."""
    from fp4vis.kernels.hopper.prepass import prepare_fp8_operands
    outs = tp.fp8_prepass(*ins[0])
    row["fp8_bytes_moved"] = sum(t.numel() * t.element_size() for t in ins[0] + tuple(outs))
    del outs
    row["fp8_ms"] = time_events(lambda i: tp.fp8_prepass(*ins[i]), n)
    for warps in (2, 4, 8):
        row[f"fp8_w{warps}_ms"] = time_events(lambda i, w=warps: tp.fp8_prepass(*ins[i], None, w), n)
    row["fp8_host_us"] = time_host(lambda i: tp.fp8_prepass(*ins[i]), n)
    row["fp8_torch_ms"] = time_events(lambda i: prepare_fp8_operands(*ins[i], 0, fused=False), n)


def bench_calls(log, policies=CALL_POLICIES) -> list:
    rows = []
    for shape in SHAPES:
        rows.append(_call_one(shape, log, policies))
        torch.cuda.empty_cache()
    return rows


def _call_one(shape, log, policies=CALL_POLICIES) -> dict:
    """One whole-call row: per policy (``fast``: the row's top-level keys, as before; others: the
    same keys under ``row[policy]``) and SDPA cuDNN."""
    import torch.nn.functional as F
    b, s, h, d = shape
    row = dict(shape=[b, s, h, d])
    n = input_copies(3 * b * h * s * d * 2)
    ins = [tuple(torch.randn(b, h, s, d, device="cuda", dtype=torch.bfloat16) for _ in range(3)) for _ in range(n)]
    ref = None
    try:
        ref = F.scaled_dot_product_attention(*ins[0]).float()
    except Exception as exc:
        row["sdpa_ref_error"] = f"{type(exc).__name__}: {exc}"
    for name in policies:
        sub = row if name == "fast" else row.setdefault(name, {})
        try:
            _call_policy(name, ins, n, d, ref, sub)
        except Exception as exc:
            sub["hopper_error"] = f"{type(exc).__name__}: {exc}"
            log(traceback.format_exc())
        torch.cuda.empty_cache()
    del ref
    try:
        from torch.nn.attention import SDPBackend, sdpa_kernel

        def sd(i):
            return F.scaled_dot_product_attention(*ins[i])

        with sdpa_kernel([SDPBackend.CUDNN_ATTENTION]):
            row["sdpa_cudnn_ms"] = time_events(sd, n)
            row["sdpa_cudnn_host_us"] = time_host(sd, n)
            row["sdpa_cudnn_host_sync_us"] = time_host(sd, n, sync=True)
            if s <= SMALL_S:
                row["sdpa_cudnn_graph_ms"] = time_graph(sd)
    except Exception as exc:
        row["sdpa_error"] = f"{type(exc).__name__}: {exc}"
    log(f"{row}")
    return row


def _call_policy(name, ins, n, d, ref, row) -> None:
    """Whole-call keys of policy ``name`` into ``row``: GPU and host time of the custom op, of its
    undispatched body, and of each part of the host path as ``hopper_attention_eager`` runs it."""
    from fp4vis.kernels.hopper import backend as hb
    from fp4vis.kernels.hopper.config import DirectPConfig
    from fp4vis.kernels.hopper.prepass import prepare_kernel_operands
    from fp4vis.policy import POLICIES, QK_FP8
    scale = d ** -0.5
    policy = POLICIES[name]
    kw = hb.policy_args(policy, d, scale)
    op = torch.ops.fp4vis.hopper_attention

    def call(i):
        return op(*ins[i], scale, **kw)

    out = call(0)
    torch.cuda.synchronize()
    if ref is not None:
        row["rel_l2_vs_sdpa"] = float((out.float() - ref).norm() / ref.norm())
    del out
    row["call_ms"] = time_events(call, n)
    row["call_host_us"] = time_host(call, n)
    row["call_host_sync_us"] = time_host(call, n, sync=True)
    if ins[0][0].shape[-2] <= SMALL_S:
        try:
            _public_api_times(name, ins, n, scale, kw, row)
        except Exception as exc:   # keep the rest of the row
            row["api_error"] = f"{type(exc).__name__}: {exc}"
    raw = getattr(hb.hopper_attention, "_init_fn", None)
    if raw is not None:
        row["call_nodispatch_host_us"] = time_host(lambda i: raw(*ins[i], scale, **kw), n)
    row["prepass_host_us"] = time_host(lambda i: prepare_kernel_operands(*ins[i], kw["qk_fmt"], kw["anchor"]), n)
    row["empty_host_us"] = time_host(lambda i: torch.empty(ins[i][0].shape, dtype=torch.bfloat16,
                                                           device="cuda"), n)
    m = min(n, 4)
    ops = [prepare_kernel_operands(*ins[i], kw["qk_fmt"], kw["anchor"]) for i in range(m)]
    outs = [torch.empty_like(ins[i][0]) for i in range(m)]

    def config():   # as hopper_attention_eager builds it (cached; the short-sequence variant by key length)
        return hb.kernel_config(d, "bf16", kw["affine_a"], kw["affine_b"], kw["shift"], kw["native_exp2"],
                                kw["anchor"], "", "", 0, kw["code_rounding"], kw["qk_fmt"] == QK_FP8, "", 0,
                                hb.short_sequences(ins[0][0].shape[-2], ins[0][1].shape[-2]))

    row["config_host_us"] = time_host(lambda i: config(), n)
    cfg = config()
    row["ctas_per_sm"] = cfg.ctas_per_sm
    row["config_matches_policy"] = cfg.key() == DirectPConfig.from_policy(
        policy, d, "bf16", ctas_per_sm=cfg.ctas_per_sm).key()

    def kern(i):
        hb.run_kernel(*ops[i], outs[i], cfg, scale * LOG2E, kw["margin_raw"])

    row["kernel_ms"] = time_events(kern, m)
    row["kernel_host_us"] = time_host(kern, m)
    if ins[0][0].shape[-2] <= SMALL_S:   # the graph-replayed call split: pre-pass alone, kernel alone
        row["prepass_graph_ms"] = time_graph(lambda i: prepare_kernel_operands(*ins[i], kw["qk_fmt"], kw["anchor"]))
        row["kernel_graph_ms"] = time_graph(kern)


def _public_api_times(name, ins, n, scale, kw, row) -> None:
    """Small shapes: what a user's call costs. ``fp4vis.attention`` (backend "hopper") per call, CUDA
    events (host-bound here, so this is its host path), with ``range_check="off"`` and with the default
    "raise" (one output check and host synchronisation per call); its host time alone; and the GPU
    time of the undispatched call replayed from a CUDA graph (no host work at all)."""
    import fp4vis
    from fp4vis.kernels.hopper import backend as hb

    def api(check):
        return lambda i: fp4vis.attention(*ins[i], policy=name, scale=scale, backend="hopper", range_check=check)

    row["api_ms"] = time_events(api("off"), n)
    row["api_host_us"] = time_host(api("off"), n)
    row["api_raise_ms"] = time_events(api("raise"), n)
    row["graph_ms"] = time_graph(lambda i: hb.hopper_attention_eager(*ins[i], scale, **kw))


def _launch_hooks(tp) -> dict:
    """Triton's launch hooks now (a hook set when a signature is first launched keeps the direct
    launcher off: LAUNCH_STATE says so) and whether the Triton module counts them as clear."""
    import triton
    rt = getattr(getattr(triton, "knobs", None), "runtime", None)
    if rt is None:
        from triton.compiler import CompiledKernel as rt

    def desc(hook):
        calls = getattr(hook, "calls", None)
        return None if hook is None else [repr(c) for c in calls] if isinstance(calls, list) else repr(hook)

    out = dict(enter=desc(getattr(rt, "launch_enter_hook", None)), exit=desc(getattr(rt, "launch_exit_hook", None)))
    if hasattr(tp, "_hooks_clear"):
        out["clear"] = tp._hooks_clear()
    return out


def _parse_skip(text: str, ap) -> set:
    skip = {w.strip() for w in text.split(",") if w.strip()}
    if "fp8" in skip:
        skip |= {"fp8bits", "fp8prepass", "fp8calls"}
    unknown = skip - set(SECTIONS) - set(SKIP_PARTS) - {"fp8"}
    if unknown:
        ap.error(f"--skip: unknown {sorted(unknown)} ({SKIP_HELP})")
    return skip


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--old", default=None, help="path of an earlier kernels/hopper/prepass_triton.py")
    ap.add_argument("--skip", default="", help=SKIP_HELP)
    a = ap.parse_args()
    skip = _parse_skip(a.skip, ap)
    lines = []

    def log(msg):
        print(msg, flush=True)
        lines.append(msg)


    from fp4vis.kernels.hopper import prepass_triton as tp
    tp.FAST_LAUNCH = True   # check the direct launcher too (bit checks: second call; host timings)
    old = None
    if a.old:
        spec = importlib.util.spec_from_file_location("old_prepass_triton", a.old)
        old = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(old)
    meta = dict(environment(), defaults=dict(nvfp4_launch=getattr(tp, "NVFP4_LAUNCH", None), num_warps=tp.NUM_WARPS,
                              num_warps_d64=getattr(tp, "NUM_WARPS_D64", None),
                              fp8_block_q=getattr(tp, "FP8_BLOCK_Q", None)),
                host_budget_s=HOST_BUDGET_S, skip=sorted(skip), launch_hooks_at_start=_launch_hooks(tp))
    res = dict(meta=meta)
    policies = tuple(p for p in CALL_POLICIES if not (p == "fast_fp8qk" and "fp8calls" in skip))
    sections = dict(bits=lambda: bit_check(tp, log), fp8bits=lambda: fp8_bit_check(tp, log),
                    prepass=lambda: bench_shapes(tp, old, log, fp8="fp8prepass" not in skip),
                    calls=lambda: bench_calls(log, policies))
    t0 = time.perf_counter()
    res["section_s"] = {}
    for name in SECTIONS:
        if name in skip:
            continue
        t1 = time.perf_counter()
        try:
            res[name] = sections[name]()
        except Exception as exc:
            res[name + "_error"] = f"{type(exc).__name__}: {exc}"
            log(traceback.format_exc())
        res["section_s"][name] = round(time.perf_counter() - t1, 2)
        log(f"[{name} done at {time.perf_counter() - t0:.1f} s]")
        write_json(a.out, res)
    res["fast_launch"] = tp.direct_launch_on()
    res["launch_state"] = tp.LAUNCH_STATE
    res["launch_hooks"] = _launch_hooks(tp)
    hb = sys.modules.get("fp4vis.kernels.hopper.backend")
    if hb is not None:
        res["compile_s"] = {str(k): round(v, 2) for k, v in getattr(hb, "COMPILE_TIMES", {}).items()}
    res["total_s"] = round(time.perf_counter() - t0, 2)
    write_json(a.out, res)


if __name__ == "__main__":
    main()
