"""The FP8 P/V call's pre-pass by part, and the V pass's launch shapes, in GPU time (one H100 run, < 1 min).

    python3 benchmarks/fp8_values_variants.py --out $OUT/fp8_values.json [--shapes flux,ltx]

Per shape (B, S, H, D of a model's attention): the FP8 Q/K pre-pass (``prepass_launch.fp8_prepass``, given no V),
the whole V pass (``prepass_launch.fp8_values``: the zeroed maxima, ``channel_amax_kernel``, ``fp8_values_kernel``),
the channel maxima alone, and ``fp8_values_kernel`` alone under each (channels at a time, keys, warps) in
``LAUNCHES``, its V^T bytes compared with the first launch's (``differing``); beside them a read of V (a sum) and a
device copy of V's bytes. Each figure is one CUDA graph of calls on rotating input copies that exceed the L2
(``time_graph``), per call.
"""

from __future__ import annotations

import sys

import torch

from fp4vis.services.timing import input_copies, run_shape_benchmark, time_graph

SHAPES = {"flux": (1, 4608, 24, 128), "wan14": (1, 32760, 40, 128), "cog": (2, 17776, 48, 64),
          "ltx": (2, 6144, 32, 64)}
LAUNCHES = ((64, 128, 4), (64, 256, 4), (32, 256, 4), (16, 256, 4), (32, 128, 4))   # (channels, keys, warps)


def _timed(fn, copies: int) -> float:
    return time_graph(fn, calls=copies, budget=0.3, n_inputs=copies)


def _shape_row(name: str, b: int, s: int, h: int, d: int) -> dict:
    from fp4vis.kernels.hopper import prepass_launch as tp
    from fp4vis.kernels.hopper.prepass_kernels import channel_amax_kernel, fp8_values_kernel
    n = b * s * h * d
    copies = max(3, input_copies(3 * 2 * n))
    g = torch.Generator(device="cuda").manual_seed(5)
    sets = [tuple(torch.randn(b, h, s, d, generator=g, device="cuda").bfloat16() for _ in range(3))
            for _ in range(copies)]
    src = [torch.empty(n * 2, dtype=torch.uint8, device="cuda") for _ in range(copies)]
    dst = [torch.empty_like(t) for t in src]
    row = dict(shape=name, b=b, s=s, h=h, d=d, copies=copies,
               copy_v_bytes_ms=_timed(lambda i: dst[i].copy_(src[i]), copies),
               read_v_ms=_timed(lambda i: sets[i][2].sum(), copies),
               qk_prepass_ms=_timed(lambda i: tp.fp8_prepass(sets[i][0], sets[i][1], sets[i][2][..., :0, :]), copies),
               v_pass_ms=_timed(lambda i: tp.fp8_values(sets[i][2]), copies))
    sp = -(-s // 32) * 32
    amax = [torch.zeros((b, h, d), dtype=torch.int32, device="cuda") for _ in range(copies)]
    vts = [torch.empty((b, h, d, sp), dtype=torch.float8_e4m3fn, device="cuda") for _ in range(copies)]
    scales = torch.empty((b, h, d), dtype=torch.float32, device="cuda")

    def args(v):
        return (h, v.stride(0), v.stride(1), v.stride(2), d)

    def maxima(i):
        v = sets[i][2]
        channel_amax_kernel[(b * h, -(-s // tp.V_AMAX_KEYS))](v, amax[i], s, *args(v), tp.V_AMAX_KEYS,
                                                              tp.row_align(v), num_warps=4)

    row["amax_ms"] = _timed(maxima, copies)
    values, ref = {}, None
    for wanted, keys, warps in LAUNCHES:
        channels = min(wanted, d)

        def launch(i, channels=channels, keys=keys, warps=warps):
            v = sets[i][2]
            fp8_values_kernel[(b * h, -(-sp // keys))](v, vts[i], amax[i], scales, *tp.record_words(None, v.device),
                                                       s, sp, *args(v), channels, keys, tp.row_align(v),
                                                       num_warps=warps, enable_fp_fusion=False)
        ms = _timed(launch, copies)
        launch(0)
        bits = vts[0].view(torch.uint8).clone()
        ref = bits if ref is None else ref
        values[f"{channels}/{keys}/{warps}"] = dict(ms=ms, differing=int((bits != ref).sum()))
    row["values_kernel"] = values
    return row


def main(argv=None) -> int:
    result, names = run_shape_benchmark(__doc__, "fp8_values_variants.py", SHAPES, _shape_row, argv,
                                        launches=[list(x) for x in LAUNCHES])
    for name in names:
        r = result.get(name, {})
        if "values_kernel" in r:
            print(f"{name}: Q/K {r['qk_prepass_ms'] * 1e3:.1f} us, V pass {r['v_pass_ms'] * 1e3:.1f} (maxima "
                  f"{r['amax_ms'] * 1e3:.1f}; read of V {r['read_v_ms'] * 1e3:.1f}); values kernel " + ", ".join(
                      f"{k} {v['ms'] * 1e3:.1f} ({v['differing']} diff)" for k, v in r["values_kernel"].items()),
                  flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
