"""Pre-pass benchmark and GPU bit-check of the Hopper backend's Triton pre-passes (one H200 run, ~3 min).

    python3 benchmarks/prepass_bench.py --out $OUT/prepass.json [--old PATH_TO_OLD_MODULE] [--skip fp8,...]

Sections (each one a key of the JSON, written after every section; ``--skip`` leaves any out; the bit checks,
1 and 2, are ``prepass_bench_bits.py``):

1. ``bits``: bit identity on CUDA tensors: ``prepass_launch.prepass`` (the one-launch NVFP4
   pre-pass, through its cached direct launcher) against ``fp4vis.formats`` (``nvfp4_qdq`` /
   ``mxfp4_qdq``), counting differing BF16 bit patterns: Gaussian, tie-heavy (small integers times
   powers of two) and wide-range inputs (E4M3-saturating groups too), BF16 and FP16, D = 64 and
   128, both layouts, with and without the anchor permutation, partial 32-token V blocks.
2. ``fp8bits``: the same for the fused FP8 pre-pass (``prepass_launch.fp8_prepass``, policy
   ``fast_fp8qk``): against the PyTorch statement (``prepass_torch.kernel_operands(..., "fp8_e4m3", ...)``) and
   against ``fp4vis.formats.fp8_pow2_quantize`` (+ ``mxfp4_qdq`` for V), counting differing values of
   each of (q8, k8, v6, q_scale, k_scale): E4M3 as uint8 bit patterns, V as BF16 bits, scales as
   float32 bits (k_scale padded with 1.0 to whole 128-key tiles). Gaussian, tie-heavy, wide-range and
   group-scaled inputs (per-group powers of two over 2^+-20, zero and tiny groups), BF16 and FP16,
   D = 64 and 128, anchor 0 and 32, Skv = 301 (not a multiple of 32 or 128), Sq != Skv, and three
   large shapes; for each case the first call (ordinary Triton launch: the cached launch state of
   that input signature is dropped before it) and the second (the direct launcher while
   ``FAST_LAUNCH``), each with the launch path taken and ``LAUNCH_STATE``. Also NaN/Inf inputs:
   NaN operands exactly where the (permuted) input is not finite, other rows and key blocks
   unchanged. The NVFP4 check runs both E2M1 code forms of the search (the backend's,
   FP4VIS_PREPASS_F16_CODES: FP16 pairs by default on the GPU, and float32: ``differing_qkv_f32_codes``).
   The pre-pass calls take the switches the backend passes (``fp4vis.settings.kernel_settings``).
3. ``prepass``: pre-pass time per shape, CUDA events around each call, median, inputs rotated over
   enough copies to exceed the 50 MB L2; host time of the Python call (perf_counter, no
   synchronisation). NVFP4: old (three launches, ``--old``: the previous module) against new, per
   tile variant (``PrepassLaunch``); FP8 (``fp8_*`` keys): the fused pre-pass (default warps and 2, 4, 8 warps)
   and the PyTorch statement, on the same shapes and inputs. ``new_f16codes_ms`` / ``new_f32codes_ms``: the NVFP4
   pre-pass with its E2M1 codes on FP16 pairs / in float32, side by side.
4. ``calls``: the whole ``torch.ops.fp4vis.hopper_attention`` call for policy ``fast`` (the row's
   top-level keys) and ``fast_fp8qk`` (the same keys nested under ``row["fast_fp8qk"]``), and SDPA
   cuDNN: GPU time (CUDA events) and host time per call, without and with a synchronisation, a
   breakdown of the host path as the backend's ``attention`` takes it (pre-pass launch
   ``prepass.kernel_operands``, output allocation, config ``config.product_config``, kernel launch
   ``backend.launch``, custom-op dispatch) and the call's relative L2 distance to SDPA (a sanity check of what
   was timed). For
   S <= 1024 (host-bound: the issue's small-shape target) also the public ``fp4vis.attention`` call
   (``api_ms`` with ``range_check="off"``, ``api_raise_ms`` with the default check, ``api_host_us``)
   and the GPU time per call replayed from a CUDA graph (``graph_ms``, ``sdpa_cudnn_graph_ms``), and
   of its two parts alone (``prepass_graph_ms``, ``kernel_graph_ms``).

Host timings take at most 200 calls and about ``HOST_BUDGET_S`` of wall time each (at least 32
calls), so that the 32k-token shape does not dominate the run. Also recorded: the final
``FAST_LAUNCH`` / ``LAUNCH_STATE`` of the Triton module and the Triton launch hooks (a set hook turns
the direct launcher off), the CuTe DSL compile times, and each section's wall time.
"""

from __future__ import annotations

import argparse
import importlib.util
import sys
import time
import traceback

import torch
from prepass_bench_bits import backend_switches, bit_check, fp8_bit_check  # this folder is on sys.path

from fp4vis.policy import QK_FP8
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
    switches = backend_switches()   # f16_codes, full_search as the backend passes them
    for layout in ("folded64_mse", "block16"):
        tag = "" if layout == "folded64_mse" else "_block16"
        if old is not None:
            row["old_ms" + tag] = time_events(lambda i, lay=layout: old_prepass(old, *ins[i], lay, None), n)
            row["old_host_us" + tag] = time_host(lambda i, lay=layout: old_prepass(old, *ins[i], lay, None), n)
        for br, nw in variants if layout == "folded64_mse" else [tp.nvfp4_launch(d)[:2]]:
            launch = tp.PrepassLaunch(block_r=br, num_warps=nw)
            row[f"new_r{br}_w{nw}_ms" + tag] = time_events(
                lambda i, lay=layout, launch=launch: tp.prepass(*ins[i], lay, None, **switches, launch=launch), n)
        # the E2M1 codes in float32 instead of on FP16 pairs, same launch
        row["f16_codes_default"] = switches["f16_codes"]
        for f16, key in ((False, "new_f32codes_ms"), (True, "new_f16codes_ms")):
            row[key + tag] = time_events(
                lambda i, lay=layout, f16=f16: tp.prepass(*ins[i], lay, None, **dict(switches, f16_codes=f16)), n)
        row["new_host_us" + tag] = time_host(lambda i, lay=layout: tp.prepass(*ins[i], lay, None, **switches), n)
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
    fp8_host_us) and with 2, 4 and 8 warps (fp8_w{2,4,8}_ms), the PyTorch statement (fp8_torch_ms),
    bytes read + written."""
    from fp4vis.kernels.hopper import prepass_torch
    outs = tp.fp8_prepass(*ins[0])
    row["fp8_bytes_moved"] = sum(t.numel() * t.element_size() for t in ins[0] + tuple(outs))
    del outs
    row["fp8_ms"] = time_events(lambda i: tp.fp8_prepass(*ins[i]), n)
    for warps in (2, 4, 8):
        launch = tp.PrepassLaunch(num_warps=warps)
        row[f"fp8_w{warps}_ms"] = time_events(lambda i, launch=launch: tp.fp8_prepass(*ins[i], launch=launch), n)
    row["fp8_host_us"] = time_host(lambda i: tp.fp8_prepass(*ins[i]), n)
    row["fp8_torch_ms"] = time_events(lambda i: prepass_torch.kernel_operands(*ins[i], QK_FP8, 0), n)


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
    undispatched body, and of each part of the host path as the backend's ``attention`` runs it."""
    from fp4vis.backends.range_record import policy_text
    from fp4vis.call import AttentionCall
    from fp4vis.kernels.hopper import launch as hb
    from fp4vis.kernels.hopper import op as hop  # registers torch.ops.fp4vis.hopper_attention
    from fp4vis.kernels.hopper.config import KernelConfig, product_config
    from fp4vis.kernels.hopper.prepass import kernel_operands
    from fp4vis.policy import POLICIES
    from fp4vis.settings import kernel_settings
    scale = d ** -0.5
    policy = POLICIES[name]
    params, settings, text = policy.kernel_params(d, scale), kernel_settings(), policy_text(policy)
    op = torch.ops.fp4vis.hopper_attention

    def call(i):
        return op(*ins[i], scale, text)

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
            _public_api_times(name, ins, n, scale, row)
        except Exception as exc:   # keep the rest of the row
            row["api_error"] = f"{type(exc).__name__}: {exc}"
    raw = getattr(hop.hopper_attention, "_init_fn", None)
    if raw is not None:
        row["call_nodispatch_host_us"] = time_host(lambda i: raw(*ins[i], scale, text), n)

    def prepass(i):   # the backend's pre-pass of the call
        return kernel_operands(AttentionCall(*ins[i], policy, scale), params, settings)

    row["prepass_host_us"] = time_host(prepass, n)
    row["empty_host_us"] = time_host(lambda i: torch.empty(ins[i][0].shape, dtype=torch.bfloat16,
                                                           device="cuda"), n)
    m = min(n, 4)
    ops = [prepass(i) for i in range(m)]
    outs = [torch.empty_like(ins[i][0]) for i in range(m)]

    def config():   # as the backend's attention chooses it (cached; the short-sequence variant by key length)
        return product_config(params, d, "bf16",
                              hb.short_sequences(ins[0][0].shape[-2], ins[0][1].shape[-2], settings), False)

    row["config_host_us"] = time_host(lambda i: config(), n)
    cfg = config()
    row["ctas_per_sm"] = cfg.ctas_per_sm
    row["config_matches_policy"] = cfg.key() == KernelConfig.from_policy(
        policy, d, "bf16", ctas_per_sm=cfg.ctas_per_sm).key()

    def kern(i):
        hb.launch(cfg, ops[i], outs[i], params, None, settings.hopper_tvm_ffi)

    row["kernel_ms"] = time_events(kern, m)
    row["kernel_host_us"] = time_host(kern, m)
    if ins[0][0].shape[-2] <= SMALL_S:   # the graph-replayed call split: pre-pass alone, kernel alone
        row["prepass_graph_ms"] = time_graph(prepass)
        row["kernel_graph_ms"] = time_graph(kern)


def _public_api_times(name, ins, n, scale, row) -> None:
    """Small shapes: what a user's call costs. ``fp4vis.attention`` (backend "hopper") per call, CUDA
    events (host-bound here, so this is its host path), with ``range_check="off"`` and with the default
    "raise" (one output check and host synchronisation per call); its host time alone; and the GPU
    time of the undispatched call (the backend's ``attention``) replayed from a CUDA graph (no host work at all)."""
    import fp4vis
    from fp4vis.call import AttentionCall
    from fp4vis.kernels.hopper import launch as hb
    from fp4vis.policy import POLICIES

    def api(check):
        return lambda i: fp4vis.attention(*ins[i], policy=name, scale=scale, backend="hopper", range_check=check)

    row["api_ms"] = time_events(api("off"), n)
    row["api_host_us"] = time_host(api("off"), n)
    row["api_raise_ms"] = time_events(api("raise"), n)
    row["graph_ms"] = time_graph(lambda i: hb.attention(AttentionCall(*ins[i], POLICIES[name], scale)))


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
    if hasattr(tp, "launch_hooks_clear"):
        out["clear"] = tp.launch_hooks_clear()
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
    ap.add_argument("--old", default=None,
                    help="path of an earlier version of kernels/hopper/prepass_launch.py")
    ap.add_argument("--skip", default="", help=SKIP_HELP)
    a = ap.parse_args()
    skip = _parse_skip(a.skip, ap)
    lines = []

    def log(msg):
        print(msg, flush=True)
        lines.append(msg)


    from fp4vis.kernels.hopper import prepass_launch as tp
    tp.FAST_LAUNCH = True   # check the direct launcher too (bit checks: second call; host timings)
    old = None
    if a.old:
        spec = importlib.util.spec_from_file_location("old_prepass_launch", a.old)
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
    res["fast_launch"] = tp.FAST_LAUNCH
    res["launch_state"] = tp.LAUNCH_STATE
    res["launch_hooks"] = _launch_hooks(tp)
    hb = sys.modules.get("fp4vis.kernels.hopper.backend")
    if hb is not None:
        res["compile_s"] = {str(k): round(v, 2) for k, v in getattr(hb, "COMPILE_TIMES", {}).items()}
    res["total_s"] = round(time.perf_counter() - t0, 2)
    write_json(a.out, res)


if __name__ == "__main__":
    main()
