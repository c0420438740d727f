"""The pre-passes' GPU time against the copy floor, by part and by launch shape (one H200 run, < 3 min).

    python3 benchmarks/prepass_variants.py --out $OUT/prepass_variants.json [--shapes b1_s4096_h24,...]

GPU time only: each figure is one CUDA graph of ``n`` calls, call i on input copy i (the copies exceed
the L2 three times, so every call reads from memory), replayed and timed by CUDA events, per call
(``time_graph_rotating``); the host's launch work is not in it. The copy floor is a device copy of the
bytes the pre-pass moves, timed the same way. Per shape: the NVFP4 pre-pass (``folded64_mse``,
contender search) under every (rows per program, warps, ptxas register cap) in ``LAUNCHES``, and by part
under its default launch (Q rows alone, K rows alone, V blocks alone: the same kernel launched over one
part); the FP8 pre-pass under the register caps in ``FP8_CAPS``. Every variant's output is compared bit for bit
with the default launch's (``differing``).
"""

from __future__ import annotations

import sys

import torch

from fp4vis.services.timing import input_copies, run_shape_benchmark, time_graph

SHAPES = {"vit_b64_s197_h12_d64": (64, 197, 12, 64), "b1_s4096_h24": (1, 4096, 24, 128),
          "b4_s4096_h32": (4, 4096, 32, 128), "wan13_s32760_h12": (1, 32760, 12, 128),
          "wan14_s32760_h40": (1, 32760, 40, 128)}
LAUNCHES = ((8, 2, 0), (8, 2, 80), (8, 2, 72), (16, 2, 0), (16, 2, 80))   # (rows, warps, register cap; 0: none)
FP8_CAPS = (0, 72, 64)   # the FP8 pre-pass (its default warps) under these register caps


def time_graph_rotating(fn, copies: int) -> float:
    """GPU ms per call of fn(i), i = 0 .. copies - 1, from one CUDA graph of those calls."""
    return time_graph(fn, calls=copies, budget=0.3, n_inputs=copies)


def _inputs(b: int, s: int, h: int, d: int, copies: int) -> list:
    g = torch.Generator(device="cuda").manual_seed(5)
    return [tuple((torch.randn(b, h, s, d, generator=g, device="cuda")
                   * torch.exp2(torch.randint(-6, 6, (b, h, s, 1), generator=g, device="cuda").float())).bfloat16()
                  for _ in range(3)) for _ in range(copies)]


def _copy_floor(nbytes: int, copies: int) -> float:
    """GPU ms of a device copy of nbytes (nbytes read, nbytes written), rotating over copies buffers."""
    src = [torch.empty(nbytes, dtype=torch.uint8, device="cuda") for _ in range(copies)]
    dst = [torch.empty_like(t) for t in src]
    return time_graph_rotating(lambda i: dst[i].copy_(src[i]), copies)


def _differing(a, b) -> int:
    return sum(int((x.view(torch.int16) != y.view(torch.int16)).sum()) for x, y in zip(a, b, strict=True))


def _shape_row(name: str, b: int, s: int, h: int, d: int) -> dict:
    from fp4vis.kernels.hopper import prepass_launch as tp
    n = b * s * h * d
    copies = max(4, input_copies(3 * 2 * n))
    sets = _inputs(b, s, h, d, copies)
    row = dict(shape=name, b=b, s=s, h=h, d=d, copies=copies, copy_floor_nvfp4_ms=_copy_floor(6 * n, copies),
               copy_floor_fp8_ms=_copy_floor(5 * n, copies))
    ref = tp.prepass(*sets[0], "folded64_mse")
    ref = tuple(t.clone() for t in ref)
    launches = {}
    for block_r, warps, cap in LAUNCHES:
        key = f"r{block_r}_w{warps}" + (f"_reg{cap}" if cap else "")
        launch = tp.PrepassLaunch(block_r=block_r, num_warps=warps, max_registers=cap)
        out = tp.prepass(*sets[0], "folded64_mse", launch=launch)
        launches[key] = dict(ms=time_graph_rotating(
            lambda i, launch=launch: tp.prepass(*sets[i], "folded64_mse", launch=launch), copies),
            differing=_differing(out, ref))
        launches[key]["over_floor"] = launches[key]["ms"] / row["copy_floor_nvfp4_ms"]
    row["nvfp4"] = launches
    # parts: the same kernel over one tensor (the other parts skipped)
    parts = {}
    for part in ("q", "k", "v"):
        def one(i, part=part):
            q, k, v = sets[i]
            y = torch.empty_like(q)
            inputs, outputs = dict(q=((q, None, None), (y, None, None)), k=((None, k, None), (None, y, None)),
                                   v=((None, None, v), (None, None, y)))[part]
            tp.launch_parts(inputs, outputs, "folded64_mse", None, q.is_cuda)
        parts[part + "_ms"] = time_graph_rotating(one, copies)
    row["nvfp4_parts"] = parts
    row["fp8_ms"] = time_graph_rotating(lambda i: tp.fp8_prepass(*sets[i]), copies)
    fp8_ref = tp.fp8_prepass(*sets[0])
    fp8_caps = {}
    for cap in FP8_CAPS:
        launch = tp.PrepassLaunch(max_registers=cap)
        out = tp.fp8_prepass(*sets[0], launch=launch)
        fp8_caps[f"reg{cap}"] = dict(ms=time_graph_rotating(
            lambda i, launch=launch: tp.fp8_prepass(*sets[i], launch=launch), copies),
                                     differing=sum(int((x.view(torch.uint8) != y.view(torch.uint8)).sum())
                                                   for x, y in zip(out, fp8_ref, strict=True)))
    row["fp8_caps"] = fp8_caps
    row["fp8_over_floor"] = row["fp8_ms"] / row["copy_floor_fp8_ms"]
    return row


def main(argv=None) -> int:
    result, names = run_shape_benchmark(__doc__, "prepass_variants.py", SHAPES, _shape_row, argv,
                                        launches=[list(x) for x in LAUNCHES])
    for name in names:
        r = result.get(name, {})
        if "nvfp4" in r:
            best = min(r["nvfp4"].items(), key=lambda kv: kv[1]["ms"])
            print(f"{name}: floor {r['copy_floor_nvfp4_ms']:.3f} ms; NVFP4 " + ", ".join(
                f"{k} {v['ms']:.3f} ({v['over_floor']:.2f}x, {v['differing']} diff)" for k, v in r["nvfp4"].items())
                + f"; best {best[0]}; parts " + ", ".join(f"{k} {v:.3f}" for k, v in r["nvfp4_parts"].items())
                + f"; FP8 {r['fp8_ms']:.3f} ({r['fp8_over_floor']:.2f}x); FP8 by cap " + ", ".join(
                    f"{k} {v['ms']:.3f} ({v['differing']} diff)" for k, v in r["fp8_caps"].items()), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
