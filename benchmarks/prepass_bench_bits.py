"""The GPU bit checks of ``prepass_bench.py`` (its ``bits`` and ``fp8bits`` sections; the module docstring there
says what they compare): the Hopper backend's Triton pre-passes on CUDA tensors against ``fp4vis.formats`` and the
PyTorch statement, counting differing bit patterns, through both launch paths."""

from __future__ import annotations

import traceback

import torch

from fp4vis.policy import QK_FP8
from fp4vis.settings import kernel_settings


def backend_switches() -> dict:
    """``prepass_launch.prepass``'s ``f16_codes`` and ``full_search`` as the backend passes them
    (FP4VIS_PREPASS_F16_CODES, FP4VIS_PREPASS_FULL_SEARCH: ``fp4vis.settings.kernel_settings``)."""
    settings = kernel_settings()
    return dict(f16_codes=settings.prepass_f16_codes, full_search=settings.prepass_full_search)


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
    from fp4vis.kernels.launch_shared import cached_anchor_permutation
    dev = "cuda"
    g = torch.Generator(device=dev).manual_seed(0)
    cases, total_diff, total_vals = [], 0, 0
    switches = backend_switches()
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
            yq, yk, yv = tp.prepass(q, k, v, layout, perm, **switches)
        f32_form = tp.prepass(q, k, v, layout, perm, **dict(switches, f16_codes=False))
        kk, vv = (k[:, :, perm.long()], v[:, :, perm.long()]) if anchor else (k, v)
        ref = (nvfp4_qdq(q, layout).to(torch.bfloat16), nvfp4_qdq(kk, layout).to(torch.bfloat16),
               mxfp4_qdq(vv, times_six=True).to(torch.bfloat16))
        diffs = [int((a.view(torch.int16) != r.view(torch.int16)).sum()) for a, r in zip((yq, yk, yv), ref)]
        n = q.numel() + 2 * k.numel()
        total_diff += sum(diffs)
        total_vals += n
        cases.append(dict(dtype=str(dtype), d=d, layout=layout, kind=kind, anchor=anchor, shape=[b, h, sq, sk],
                          values=n, differing_qkv=diffs))
        # the other E2M1 code form (float32 where the backend's is FP16 pairs)
        diffs32 = [int((a.view(torch.int16) != r.view(torch.int16)).sum()) for a, r in zip(f32_form, ref)]
        cases[-1]["f16_codes_default"] = switches["f16_codes"]
        cases[-1]["differing_qkv_f32_codes"] = diffs32
        total_diff += sum(diffs32)
        total_vals += n
        if sum(diffs):
            if layout == "folded64_mse":
                cases[-1]["exact_check"] = _exact_check((q, kk), (yq, yk), ref[:2])
            log(f"  DIFF {cases[-1]}")
    log(f"bit check: {total_diff} differing of {total_vals} values over {len(cases)} cases")
    return dict(differing=total_diff, values=total_vals, cases=cases, fast_launch=tp.FAST_LAUNCH,
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
    from fp4vis.kernels.hopper.fp8_key_scales import fp8_key_scale_blocks
    qv, qs = fp8_pow2_quantize(q, 1)
    kv, ks = fp8_pow2_quantize(kk, 32)
    ks = ks.squeeze(-1)
    ks = torch.nn.functional.pad(ks, (0, fp8_key_scale_blocks(kk.shape[-2]) - ks.shape[-1]), value=1.0)
    return (qv.to(torch.float8_e4m3fn), kv.to(torch.float8_e4m3fn),
            mxfp4_qdq(vv, times_six=True).to(torch.bfloat16), qs.squeeze(-1).contiguous(), ks.contiguous())


def _fp8_calls(tp, q, k, v, perm, n_calls=2):
    """n_calls calls of the fused FP8 pre-pass, the first through the ordinary Triton launch (the
    signature's cached launch state, whose last entry is the direct launch's compiled kernel, is
    dropped first); per call (outputs, launch path, LAUNCH_STATE after the call). The path is
    "unknown" where the module keeps its state under another key than ``fp8_meta_key`` (default launch)."""
    metas = tp.FP8_LAUNCH_STATE
    key = tp.fp8_meta_key(q, k, v, perm)
    metas.pop(key, None)
    out = []
    for _ in range(n_calls):
        meta = metas.get(key)
        cached, fast = meta is not None and meta[-1] is not None, tp.FAST_LAUNCH
        ops = tp.fp8_prepass(q, k, v, perm)
        if q.is_cuda:
            torch.cuda.synchronize()   # a launch fault shows here, at its call
        direct = cached and fast and tp.FAST_LAUNCH   # turned off where the direct call raised
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
    """The fused FP8 pre-pass (first and second call) against its PyTorch statement
    (``prepass_torch.kernel_operands``) and against fp4vis.formats, per operand (q8, k8, v6, q_scale, k_scale)
    the number of differing values."""
    from fp4vis.kernels.hopper import prepass_torch
    from fp4vis.kernels.launch_shared import cached_anchor_permutation
    g = torch.Generator(device=dev).manual_seed(1)
    res = dict(operands=list(FP8_OPERANDS), fast_launch_at_start=tp.FAST_LAUNCH,
               launch_state_at_start=tp.LAUNCH_STATE)
    cases, total_diff, total_vals, mismatched, torch_formats = [], 0, 0, 0, 0
    paths = {}
    for dtype, d, kind, anchor, (b, h, sq, sk) in configs or _fp8_configs():
        perm = cached_anchor_permutation(sk, anchor, torch.device(dev), torch.int32) if anchor else None
        q, k, v = _fp8_inputs(kind, b, h, sq, sk, d, dtype, perm, g, dev)
        kk, vv = (k[:, :, perm.long()], v[:, :, perm.long()]) if anchor else (k, v)
        plain = prepass_torch.kernel_operands(q, k, v, QK_FP8, anchor)
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
    res.update(fast_launch=tp.FAST_LAUNCH, launch_state=tp.LAUNCH_STATE)
    log(f"FP8 bit check: {total_diff} differing of {total_vals} compared values (fused vs torch and vs formats, "
        f"two calls) over {len(cases)} cases, {mismatched} shape/dtype mismatches, torch vs formats "
        f"{torch_formats}; paths {paths}; non-finite {res.get('nonfinite', {}).get('bad')}; "
        f"LAUNCH_STATE {tp.LAUNCH_STATE!r}")
    return res


def _fp8_nonfinite(tp, dev: str) -> dict:
    """NaN/Inf in q, k, v: both calls of the fused FP8 pre-pass give NaN exactly where the (physical)
    input is not finite, and rows / key blocks without a non-finite value equal fp4vis.formats
    (tests/kernels/hopper/test_hopper_prepass.py statement, on the GPU's conversions)."""
    from fp4vis.kernels.launch_shared import cached_anchor_permutation
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


if __name__ == "__main__":   # a module of prepass_bench.py, not run alone: --help says so
    import argparse
    argparse.ArgumentParser(description=__doc__ + "\n\nRun them through prepass_bench.py (python3 "
                            "benchmarks/prepass_bench.py --out OUT.json --skip ...).",
                            formatter_class=argparse.RawDescriptionHelpFormatter).parse_args()
    raise SystemExit("prepass_bench_bits.py is a module of prepass_bench.py: run that script")
