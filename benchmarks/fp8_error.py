"""What the FP8 P/V policy ``fp8`` costs in accuracy, and why (docs/numerics.md section 7). The reference on the CPU,
against exact attention.

    python benchmarks/fp8_error.py --out benchmarks/results/<date><run>_cpu_fp8-error.json   # two tables, and the JSON

1. The floor each format sets: iid Gaussian q, k, v (B4 S1024 D128, float64), softmax attention with one operand
   rounded as the policy rounds it (E4M3 P scaled by 2^8, V in E4M3 with its per-channel scale, FP8 Q/K with their
   per-row and per-32-key scales), then P and V together (the floor of any E4M3 P·V) and all three; beside them Q/K
   in INT8 with the same groups (symmetric, scale = group maximum / 127: SageAttention2's Hopper kernel takes INT8
   Q/K with FP8 P·V), alone and with E4M3 P and V. INT8 is an analysis here, not a policy. The denominator sums the
   unrounded P (the contract's at D = 128, FlashAttention-3's); beside it, E4M3 P with the denominator over the
   rounded P (the contract's at D = 64, where the kernel sums on the tensor cores), and the distance between the
   two.
2. The mean key: K gets ``bias`` added to 8 channels and 2 channels scaled by 1 + bias (B1 H4 S1024 D128, BF16);
   ``fp8`` with and without the mean key subtracted (in float32, rounded to BF16 again, as a pre-pass would read
   it). Softmax is unchanged by the subtraction."""

from __future__ import annotations

import argparse
import datetime as dt
import json
import math
import platform
import sys

import torch

import fp4vis
from fp4vis.files import atomic_write
from fp4vis.formats import e4m3_round, fp8_channel_quantize, fp8_pow2_qdq
from fp4vis.key_positions import P_E4M3_LOG2


def format_floor() -> dict:
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(4, 1024, 128, generator=g, dtype=torch.float64) for _ in range(3))
    p_scale = 2.0 ** P_E4M3_LOG2

    def softmax_attention(q, k, v, p_round=False, den_rounded=False):
        t = (q @ k.mT) / math.sqrt(q.shape[-1])
        p = torch.exp(t - t.amax(-1, keepdim=True))
        num = (e4m3_round((p * p_scale).float()).double() / p_scale) if p_round else p
        return num @ v / (num if den_rounded else p).sum(-1, keepdim=True)

    def v8(v):
        vals, scales = fp8_channel_quantize(v)
        return (vals * scales).double()

    def qk8(x, rows):
        return fp8_pow2_qdq(x, rows).double()

    def int8(x, rows):   # symmetric INT8, one scale per group of `rows` rows (as qk8's groups)
        g = x.unflatten(-2, (-1, rows))
        scale = g.abs().amax((-2, -1), keepdim=True) / 127
        return (torch.round(g / scale).clamp(-127, 127) * scale).flatten(-3, -2)

    exact = softmax_attention(q, k, v)
    runs = {"P in E4M3": softmax_attention(q, k, v, p_round=True), "V in E4M3": softmax_attention(q, k, v8(v)),
            "Q/K in FP8": softmax_attention(qk8(q, 1), qk8(k, 32), v),
            "P and V in E4M3": softmax_attention(q, k, v8(v), p_round=True),
            "all three": softmax_attention(qk8(q, 1), qk8(k, 32), v8(v), p_round=True),
            "Q/K in INT8": softmax_attention(int8(q, 1), int8(k, 32), v),
            "INT8 Q/K, E4M3 P and V": softmax_attention(int8(q, 1), int8(k, 32), v8(v), p_round=True),
            "P in E4M3, rounded P summed": softmax_attention(q, k, v, p_round=True, den_rounded=True),
            "P and V in E4M3, rounded P summed": softmax_attention(q, k, v8(v), p_round=True, den_rounded=True)}
    floor = {name: round(float((out - exact).norm() / exact.norm()), 5) for name, out in runs.items()}
    a, b = runs["P in E4M3"], runs["P in E4M3, rounded P summed"]
    floor["between the two denominators"] = round(float((a - b).norm() / exact.norm()), 5)
    return floor


def mean_key() -> list[dict]:
    rows = []
    for bias in (0.0, 3.0, 10.0, 30.0):
        g = torch.Generator().manual_seed(int(bias))
        q, k, v = (torch.randn(1, 4, 1024, 128, generator=g) for _ in range(3))
        k[..., :8] += bias
        k[..., 8:10] *= 1 + bias
        q, k, v = (t.bfloat16() for t in (q, k, v))
        exact = fp4vis.attention(q, k, v, policy="bf16")
        centred = (k.float() - k.float().mean(-2, keepdim=True)).bfloat16()
        plain = fp4vis.rel_l2(fp4vis.attention(q, k, v, policy="fp8", backend="reference"), exact)
        mean_sub = fp4vis.rel_l2(fp4vis.attention(q, centred, v, policy="fp8", backend="reference"), exact)
        rows.append({"bias": bias, "rel_l2": round(plain, 5), "rel_l2_mean_key_subtracted": round(mean_sub, 5)})
    return rows


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", required=True,
                    help="the JSON to write: benchmarks/results/<UTC date><run>_cpu_fp8-error.json, the run letter "
                         "the day's next")
    a = ap.parse_args(argv)
    floor = format_floor()
    for name, err in floor.items():
        print(f"{name:36s} relL2 {err:.4f}")
    rows = mean_key()
    for r in rows:
        print(f"bias {r['bias']:5.1f}  fp8 {r['rel_l2']:.4f}  "
              f"mean key subtracted {r['rel_l2_mean_key_subtracted']:.4f}")
    out = a.out
    meta = {"date": dt.datetime.now(dt.UTC).isoformat(timespec="seconds"), "machine": platform.machine(),
            "torch": torch.__version__, "fp4vis": fp4vis.__version__,
            "command": f"python benchmarks/fp8_error.py --out {a.out}"}
    atomic_write(out, json.dumps({"meta": meta, "format_floor": floor, "mean_key": rows}, indent=1))
    print(f"wrote {out}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
