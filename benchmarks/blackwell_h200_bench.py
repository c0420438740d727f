"""Time the Blackwell kernel's sm_90 build on the H200, once, for the record (not a product figure:
the sm_90 lowering upcasts FP4 to BF16 for wgmma, and the pre-pass is the PyTorch formulation).

    FP4VIS_BLACKWELL_CUBINS=DIR python benchmarks/blackwell_h200_bench.py OUT.json

Per shape and policy: the kernel alone (pre-pass operands prepared once; CUDA events, median of
``--iters`` launches after warm-up), the whole ``fp4vis.attention`` call (pre-pass included), and
SDPA (BF16, torch's default choice) on the same inputs. Raw JSON with date, GPU, driver, versions.
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import platform
import statistics

import torch


def _events(fn, iters: int, warmup: int = 3) -> list[float]:
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(iters):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b))
    return times


def bench_shape(shape, iters: int) -> list[dict]:
    import fp4vis
    from fp4vis.kernels.blackwell import launch as bl
    from fp4vis.kernels.blackwell.kernel import grid, runtime_args
    from fp4vis.kernels.blackwell.prepass import prepare
    from fp4vis.policy import POLICIES

    b, h, sq, skv, d = shape
    g = torch.Generator(device="cuda").manual_seed(0)
    q, k, v = (torch.randn(b, h, s, d, device="cuda", generator=g, dtype=torch.bfloat16) for s in (sq, skv, skv))
    sdpa = _events(lambda: torch.nn.functional.scaled_dot_product_attention(q, k, v), iters)
    rows = []
    index = torch.cuda.current_device()
    scale = 1 / math.sqrt(d)
    for name in ("fast", "guard"):
        pol = POLICIES[name]
        params = pol.kernel_params(d, scale)   # as launch.attention builds the launch
        cfg = bl.kernel_config(index, d, q.dtype, params.native_exp2, params.anchor > 0)
        ops = prepare(q, k, v, params.qk_layout, params.anchor, cfg.block_m, cfg.block_n)
        out = torch.empty(b * h, sq, d, dtype=q.dtype, device="cuda")
        fn = bl.get_kernel(index, cfg)
        launch = (grid(cfg, ops), runtime_args(ops, out, params))
        kern = _events(lambda fn=fn, launch=launch: fn(*launch), iters)
        call = _events(lambda pol=pol: fp4vis.attention(q, k, v, policy=pol, backend="blackwell", range_check="off"),
                       max(3, iters // 3), warmup=1)
        flops = 4.0 * b * h * sq * skv * d
        row = dict(shape=dict(B=b, H=h, Sq=sq, Skv=skv, D=d), policy=name, config=cfg.tag(),
                   kernel_ms=statistics.median(kern), kernel_ms_all=kern, call_ms=statistics.median(call),
                   sdpa_bf16_ms=statistics.median(sdpa), kernel_tflops=flops / statistics.median(kern) / 1e9)
        rows.append(row)
        print(json.dumps({k2: v2 for k2, v2 in row.items() if k2 != "kernel_ms_all"}), flush=True)
        del ops, out
    return rows


def main(argv=None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("out")
    ap.add_argument("--iters", type=int, default=10)
    a = ap.parse_args(argv)
    import triton

    from fp4vis.kernels.blackwell import route as br

    rows = []
    for shape in [(1, 24, 4096, 4096, 128), (1, 12, 32760, 32760, 128), (1, 16, 1024, 1024, 64)]:
        rows += bench_shape(shape, a.iters)
        torch.cuda.empty_cache()
    props = torch.cuda.get_device_properties(0)
    rec = {"date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
           "gpu": torch.cuda.get_device_name(0), "sm_count": props.multi_processor_count,
           "capability": list(torch.cuda.get_device_capability(0)), "driver": br.driver_version(),
           "torch": torch.__version__, "triton_runtime": triton.__version__, "route": str(br.route(0)),
           "cubin_triton": "3.8.0 (compiled on the CPU, launched through CuPy)", "python": platform.python_version(),
           "fp4vis_source": br._source_hash(), "iters": a.iters,
           "note": "sm_90 verification build: FP4 upcast to BF16 + wgmma; not a Blackwell figure", "rows": rows}
    with open(a.out, "w") as f:
        json.dump(rec, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
