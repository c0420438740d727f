"""Does subtracting the mean key (per head and channel, over the keys; softmax is unchanged by it) make the `fp8`
policy more accurate where K has outlier channels? The reference on the CPU, against exact attention.

    python benchmarks/fp8_mean_key.py        # prints a table, writes benchmarks/results/<date>a_cpu_fp8-mean-key.json

K gets `bias` added to 8 channels and 2 channels scaled by 1 + bias (iid Gaussian q, k, v otherwise; B1 H4 S1024
D128, BF16); the mean is subtracted in float32 and rounded to BF16 again, as a pre-pass would read it."""

from __future__ import annotations

import datetime as dt
import json
import platform
import sys

import torch

import fp4vis


def main() -> int:
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
        print(f"bias {bias:5.1f}  fp8 {plain:.4f}  mean key subtracted {mean_sub:.4f}")
    out = f"benchmarks/results/{dt.datetime.now(dt.UTC):%Y%m%d}a_cpu_fp8-mean-key.json"
    meta = {"date": dt.datetime.now(dt.UTC).isoformat(timespec="seconds"), "machine": platform.machine(),
            "torch": torch.__version__, "command": "python benchmarks/fp8_mean_key.py"}
    with open(out, "w") as f:
        json.dump({"meta": meta, "rows": rows}, f, indent=1)
    print(f"wrote {out}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
