"""Short sequences on the H200: the Direct-P kernel's default against its short-sequence variant.

One CTA per SM (the default) against two (``KernelConfig.ctas_per_sm = 2``), and SDPA cuDNN; one run,
about 2 minutes.

    python3 benchmarks/short_seq_bench.py --out $OUT/short_seq.json [--shapes 64,197,12,64;...] [--policies fast]

Per shape (B, S, H, D; self-attention, BF16) and policy (``fast``, ``fast_fp8qk``), on operands prepared
once by the pre-pass (``prepass.kernel_operands``), the kernel alone
(``backend.launch``) with each configuration (``KernelConfig``, from ``config.product_config``):

* ``{default,short}_events_ms``: CUDA events per launch, median, inputs rotated over up to
  ``KERNEL_COPIES`` operand sets (not always past the 50 MB L2; short shapes are launch-bound here:
  this includes the host's launch path);
* ``{default,short}_graph_ms``: GPU time per launch replayed from a CUDA graph (``fp4vis.services.timing.time_graph``:
  the same operands every launch, so L2-warm where they fit);
* ``{default,short}_call_graph_ms``: the whole call (pre-pass + kernel, ``backend.attention`` with the
  configuration) from a CUDA graph, for the end-to-end picture;
* ``bit_equal`` (torch.equal of the two outputs on the same operands) and ``rel_l2_short_vs_default``
  (must be <= 1e-6 where not bit-equal: ``match``); ``rel_l2_vs_sdpa`` a sanity check of what ran;
* ``auto_ctas_per_sm``: what the backend's dispatch picks for this sequence length (``product_config`` with
  ``backend.short_sequences``: ``SHORT_SEQ``).

Per shape also SDPA cuDNN (``sdpa_cudnn_events_ms``, ``sdpa_cudnn_graph_ms``) and the ratios
``short_vs_default_graph`` (< 1: the short variant is faster) and ``{default,short}_vs_sdpa_graph``.
``occupancy``: CTAs per SM the driver allows each compiled configuration
(cuOccupancyMaxActiveBlocksPerMultiprocessor; the short variant must give 2). The JSON is rewritten
after every shape.
"""

from __future__ import annotations

import argparse
import time
import traceback

import torch

from fp4vis.services.environment import environment
from fp4vis.services.outputs import write_json
from fp4vis.services.timing import input_copies, time_events, time_graph
from fp4vis.settings import kernel_settings

SHAPES = [(1, 256, 16, 128), (1, 1024, 16, 128), (64, 197, 12, 64), (32, 197, 16, 64), (8, 577, 16, 64),
          (1, 4096, 24, 128)]
POLICIES = ("fast", "fast_fp8qk")
MATCH_REL_L2 = 1e-6    # the short variant must be bit-equal to the default, or at worst this close
KERNEL_COPIES = 8      # prepared operand sets for the kernel-alone events timing (at most; fewer where they fill L2)


def parse_shapes(text: str) -> list[tuple[int, int, int, int]]:
    """"64,197,12,64;1,256,16,128" -> [(64, 197, 12, 64), (1, 256, 16, 128)] (B, S, H, D)."""
    out = []
    for part in text.split(";"):
        if part.strip():
            dims = tuple(int(x) for x in part.split(","))
            if len(dims) != 4 or min(dims) < 1:
                raise ValueError(f"shape {part!r}: B,S,H,D expected")
            out.append(dims)
    return out


def configs(policy_name: str, d: int, skv: int) -> dict:
    """The default (one CTA per SM), short (two) and automatically dispatched configurations, built as
    ``backend.attention`` builds them (``config.product_config``)."""
    from fp4vis.kernels.hopper import launch as hb
    from fp4vis.kernels.hopper.config import product_config
    from fp4vis.policy import POLICIES as ALL
    params = ALL[policy_name].kernel_params(d, d ** -0.5)
    return dict(default=product_config(params, d, "bf16", False, False),
                short=product_config(params, d, "bf16", True, False),
                auto=product_config(params, d, "bf16", hb.short_sequences(skv, skv, kernel_settings()), False))


def smem_bytes(cfg) -> int:
    """Dynamic shared memory of a configuration (``DirectPAttentionSm90.dynamic_smem_bytes``)."""
    from fp4vis.kernels.hopper.kernel import DirectPAttentionSm90
    return DirectPAttentionSm90(cfg).dynamic_smem_bytes()


def occupancy(cfg) -> dict:
    """CTAs per SM the driver allows the compiled kernel of ``cfg`` (compiled and cached by ``launch``
    before), with its registers and shared memory; through the DLPack compile where the TVM-FFI function
    does not expose its library."""
    import cuda.bindings.driver as drv

    from fp4vis.kernels.hopper import launch as hb
    from fp4vis.kernels.hopper.kernel import DirectPAttentionSm90

    def check(res):
        err, *val = res
        if err != drv.CUresult.CUDA_SUCCESS:
            raise RuntimeError(f"{err}")
        return val[0] if len(val) == 1 else val

    dummy = [torch.zeros(1, 1, 128, cfg.head_dim, device="cuda", dtype=torch.bfloat16) for _ in range(4)]
    if cfg.qk_fp8:
        dummy[0], dummy[1] = dummy[0].to(torch.uint8), dummy[1].to(torch.uint8)
    scales = torch.ones(1, 1, 128, device="cuda")
    # the kernel's tensors as ``launch`` passes them: no key counts, MXFP4 V (this benchmark's policies)
    tensors = (*dummy, scales, scales, None, None)
    fn = hb.compiled_kernel(cfg, tensors, True).fn   # the one ``launch`` compiled and cached (by cfg.key())
    try:
        lib = fn.library
    except Exception:   # the TVM-FFI function: compile the same kernel on the DLPack path
        lib = hb.compile_kernel(cfg, tensors, False).fn.library
    clib = drv.CUlibrary(int(lib))
    n = check(drv.cuLibraryGetKernelCount(clib))
    kernels = check(drv.cuLibraryEnumerateKernels(n, clib))
    func = check(drv.cuKernelGetFunction(kernels[0]))
    smem = smem_bytes(cfg)
    threads = DirectPAttentionSm90(cfg).threads
    a = drv.CUfunction_attribute
    return dict(ctas_per_sm=check(drv.cuOccupancyMaxActiveBlocksPerMultiprocessor(func, threads, smem)),
                threads=threads, smem_bytes=smem, kernels_in_library=n,
                num_regs=check(drv.cuFuncGetAttribute(a.CU_FUNC_ATTRIBUTE_NUM_REGS, func)),
                max_dynamic_smem=check(drv.cuFuncGetAttribute(a.CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES, func)),
                carveout=check(drv.cuFuncGetAttribute(a.CU_FUNC_ATTRIBUTE_PREFERRED_SHARED_MEMORY_CARVEOUT, func)))


def bench_shape(shape, policies, budget: float, occ: dict, log) -> dict:
    import torch.nn.functional as F
    b, s, h, d = shape
    scale = d ** -0.5
    row = dict(shape=[b, s, h, d])
    n = input_copies(3 * b * h * s * d * 2)
    g = torch.Generator(device="cuda").manual_seed(0)
    ins = [tuple(torch.randn(b, h, s, d, device="cuda", dtype=torch.bfloat16, generator=g) for _ in range(3))
           for _ in range(n)]
    ref = F.scaled_dot_product_attention(*ins[0], scale=scale).float()
    for name in policies:
        sub = row.setdefault(name, {})
        try:
            bench_policy(name, ins, scale, ref, budget, occ, sub)
        except Exception as exc:
            sub["error"] = f"{type(exc).__name__}: {exc}"
            log(traceback.format_exc())
        torch.cuda.empty_cache()
    try:
        from torch.nn.attention import SDPBackend, sdpa_kernel

        def sd(i):
            return F.scaled_dot_product_attention(*ins[i], scale=scale)

        with sdpa_kernel([SDPBackend.CUDNN_ATTENTION]):
            row["sdpa_cudnn_events_ms"] = time_events(sd, n, budget)
            row["sdpa_cudnn_graph_ms"] = time_graph(sd, budget=budget)
        for name in policies:
            sub = row[name]
            for which in ("default", "short"):
                if f"{which}_graph_ms" in sub:
                    sub[f"{which}_vs_sdpa_graph"] = sub[f"{which}_graph_ms"] / row["sdpa_cudnn_graph_ms"]
    except Exception as exc:
        row["sdpa_error"] = f"{type(exc).__name__}: {exc}"
    return row


def bench_policy(name, ins, scale, ref, budget: float, occ: dict, sub: dict) -> None:
    """One policy's keys (module doc) into ``sub``: both configurations on the same prepared operands."""
    from fp4vis.call import AttentionCall
    from fp4vis.kernels.hopper import launch as hb
    from fp4vis.kernels.hopper.prepass import kernel_operands
    from fp4vis.metrics import rel_l2
    from fp4vis.policy import POLICIES as ALL
    from fp4vis.settings import kernel_settings
    d, s = ins[0][0].shape[-1], ins[0][1].shape[-2]
    pol, settings = ALL[name], kernel_settings()
    params = pol.kernel_params(d, scale)
    cfgs = configs(name, d, s)
    sub["auto_ctas_per_sm"] = cfgs["auto"].ctas_per_sm
    m = min(len(ins), KERNEL_COPIES)
    ops = [kernel_operands(AttentionCall(*ins[i], pol, scale), params, settings) for i in range(m)]
    outs = [torch.empty_like(ins[i][0]) for i in range(m)]
    res = {}
    for which in ("default", "short"):
        cfg = cfgs[which]
        sub[f"{which}_key"] = list(cfg.key())

        def kern(i, cfg=cfg):
            hb.launch(cfg, ops[i], outs[i], params, None, settings.hopper_tvm_ffi)

        def call(i, cfg=cfg):
            return hb.attention(AttentionCall(*ins[i], pol, scale), cfg)

        kern(0)
        torch.cuda.synchronize()
        res[which] = outs[0].clone()
        if cfg.key() not in occ:
            try:
                occ[cfg.key()] = dict(key=list(cfg.key()), **occupancy(cfg))
            except Exception as exc:
                occ[cfg.key()] = dict(key=list(cfg.key()), error=f"{type(exc).__name__}: {exc}")
        sub[f"{which}_occupancy"] = occ[cfg.key()].get("ctas_per_sm")
        sub[f"{which}_events_ms"] = time_events(kern, m, budget)
        sub[f"{which}_graph_ms"] = time_graph(kern, budget=budget)
        sub[f"{which}_call_graph_ms"] = time_graph(call, budget=budget)
    sub["bit_equal"] = bool(torch.equal(res["default"], res["short"]))
    sub["rel_l2_short_vs_default"] = float(rel_l2(res["short"], res["default"]))
    sub["match"] = sub["bit_equal"] or sub["rel_l2_short_vs_default"] <= MATCH_REL_L2
    sub["finite"] = bool(torch.isfinite(res["short"]).all())
    sub["rel_l2_vs_sdpa"] = float((res["short"].float() - ref).norm() / ref.norm())
    sub["short_vs_default_graph"] = sub["short_graph_ms"] / sub["default_graph_ms"]


def summary_line(row: dict, policies) -> str:
    parts = [f"{'x'.join(map(str, row['shape'])):>16s}"] + ([row["error"]] if "error" in row else [])
    if "sdpa_cudnn_graph_ms" in row:
        parts.append(f"sdpa {row['sdpa_cudnn_graph_ms'] * 1e3:7.1f} us")
    for name in policies:
        sub = row.get(name, {})
        if "error" in sub:
            parts.append(f"{name}: {sub['error'][:80]}")
        elif "short_graph_ms" in sub:
            parts.append(f"{name}: default {sub['default_graph_ms'] * 1e3:7.1f} us, "
                         f"short {sub['short_graph_ms'] * 1e3:7.1f} us ({sub['short_vs_default_graph']:.2f}x), "
                         f"equal={sub['bit_equal']}, "
                         f"occ {sub['default_occupancy']}/{sub['short_occupancy']}, auto {sub['auto_ctas_per_sm']}")
    return " | ".join(parts)


def meta() -> dict:
    from fp4vis.kernels.hopper import config as hf
    from fp4vis.kernels.hopper import launch as hb
    return dict(environment(), short_seq=hb.SHORT_SEQ, regs_2cta=list(hf.REGS_2CTA), smem_2cta=hf.SMEM_2CTA,
                tvm_ffi=kernel_settings().hopper_tvm_ffi)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", required=True, help="JSON file to write")
    ap.add_argument("--shapes", default=None, help="B,S,H,D;B,S,H,D;... (default: the six ViT/video shapes)")
    ap.add_argument("--policies", default=",".join(POLICIES))
    ap.add_argument("--budget", type=float, default=0.25, help="seconds per timing")
    ap.add_argument("--dry-run", action="store_true",
                    help="build the configurations and print the plan (no GPU needed)")
    a = ap.parse_args(argv)
    try:
        shapes = parse_shapes(a.shapes) if a.shapes else SHAPES
    except ValueError as exc:
        ap.error(f"--shapes: {exc}")
    policies = tuple(p.strip() for p in a.policies.split(",") if p.strip())
    from fp4vis.policy import POLICIES as ALL
    unknown = [p for p in policies if p not in ALL]
    if unknown:
        ap.error(f"--policies: unknown {unknown}")
    res = dict(meta=meta(), shapes=[list(s) for s in shapes], policies=list(policies))
    if a.dry_run:
        plan = []
        for b, s, h, d in shapes:
            for name in policies:
                c = configs(name, d, s)
                plan.append(dict(shape=[b, s, h, d], policy=name, auto_ctas_per_sm=c["auto"].ctas_per_sm,
                                 **{f"{w}_key": list(c[w].key()) for w in ("default", "short")},
                                 short_smem_bytes=smem_bytes(c["short"]), default_smem_bytes=smem_bytes(c["default"])))
                print(plan[-1], flush=True)
        res["plan"] = plan
        write_json(a.out, res)
        return 0
    if not torch.cuda.is_available():
        ap.error("needs a CUDA (sm_90) device; --dry-run checks the plan without one")
    lines = []

    def log(msg):
        print(msg, flush=True)
        lines.append(msg)

    occ: dict = {}
    res["rows"] = []
    t0 = time.perf_counter()
    for shape in shapes:
        try:
            row = bench_shape(shape, policies, a.budget, occ, log)
        except Exception as exc:   # keep the other shapes
            row = dict(shape=list(shape), error=f"{type(exc).__name__}: {exc}")
            log(traceback.format_exc())
        res["rows"].append(row)
        log(summary_line(row, policies))
        res["occupancy"] = list(occ.values())
        res["total_s"] = round(time.perf_counter() - t0, 2)
        write_json(a.out, res)
        torch.cuda.empty_cache()
    from fp4vis.kernels.hopper import launch as hb
    res["compile_s"] = {str(k): round(v, 2) for k, v in hb.COMPILE_TIMES.items()}
    res["log"] = lines
    write_json(a.out, res)
    bad = [r["shape"] for r in res["rows"] if not all(r.get(p, {}).get("match", False) for p in policies)]
    if bad:
        print(f"MISMATCH or error (short vs default) at {bad}", flush=True)
    return 1 if bad else 0


if __name__ == "__main__":
    raise SystemExit(main())
