"""What the per-tensor NVFP4 scale (``qk_global_scale``, docs/numerics.md section 1) would cost and change,
side by side in one run on the GPU: the evidence for its default (docs/numerics.md, "Scale range").

    python3 benchmarks/qk_global_scale_cost.py --out $OUT/qk_global_scale.json

Cost. The scale needs amax over the whole of q and of k before either is quantized: at least one more
read of both, a reduction each, ahead of the pre-pass (the multiply itself folds into the pre-pass, and
1/(G_q G_k) into the softmax scale). Per shape (B, S, H, D; BF16, self-attention), GPU time per call from
CUDA graphs over rotated inputs (``fp4vis.services.timing.time_graph``):
* ``fast_ms``: the whole ``fp4vis.attention(..., policy="fast", backend="hopper")`` call today;
* ``amax_ms``: ``q.abs().amax()`` and ``k.abs().amax()`` (PyTorch's reductions), the least the scale adds;
* ``fa4_ms``, ``sdpa_ms``: flash-attn-4's BF16 forward and SDPA (cuDNN), where they run;
* ``amax_share``: amax_ms / fast_ms.

Effect. The operator error of ``fast`` against exact attention (relL2, the reference on the GPU) with and
without the scale, on iid Gaussian inputs of the same shapes (the first two heads): ``rel_l2_fast``,
``rel_l2_fast_global``.
"""

from __future__ import annotations

import argparse
import traceback

import torch

import fp4vis
from fp4vis.evals.baselines import attention_function, unavailable
from fp4vis.services.environment import environment
from fp4vis.services.outputs import write_json
from fp4vis.services.timing import input_copies, time_graph

# B, S, H, D: ViT-B/16 at 224 (batch 64), the grid's S4096 H24, Wan2.1 1.3B and 14B self-attention at 480x832x81
SHAPES = [(64, 197, 12, 64), (1, 4096, 24, 128), (1, 32760, 12, 128), (1, 32760, 40, 128)]


def measure(shape) -> dict:
    b, s, h, d = shape
    copies = input_copies(3 * b * h * s * d * 2)
    g = torch.Generator(device="cuda").manual_seed(0)
    sets = [tuple(torch.randn(b, h, s, d, device="cuda", generator=g, dtype=torch.bfloat16) for _ in range(3))
            for _ in range(copies)]
    row: dict = {"shape": list(shape), "input_copies": copies}
    row["fast_ms"] = time_graph(lambda i: fp4vis.attention(*sets[i], policy="fast", backend="hopper",
                                                           range_check="off"), n_inputs=copies)
    row["amax_ms"] = time_graph(lambda i: (sets[i][0].abs().amax(), sets[i][1].abs().amax()), n_inputs=copies)
    row["amax_share"] = row["amax_ms"] / row["fast_ms"]
    for name, key in (("fa4", "fa4_ms"), ("sdpa_cudnn", "sdpa_ms")):
        if unavailable(name, "cuda") is None:
            fn = attention_function(name)
            row[key] = time_graph(lambda i, fn=fn: fn(*sets[i]), n_inputs=copies)
    q, k, v = (t[:1, :2] for t in sets[0])
    exact = fp4vis.attention(q, k, v, policy="bf16").float()
    for key, policy in (("rel_l2_fast", fp4vis.get_policy("fast")),
                        ("rel_l2_fast_global", fp4vis.get_policy("fast").replace(name="fast_global",
                                                                                 qk_global_scale=True))):
        out = fp4vis.attention(q, k, v, policy=policy, backend="reference")
        row[key] = fp4vis.rel_l2(out.float(), exact)
    return row


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    rows = []
    for shape in SHAPES:
        try:
            rows.append(measure(shape))
        except Exception:   # one shape's failure is recorded, the others still run
            rows.append({"shape": list(shape), "error": traceback.format_exc()})
        write_json(args.out, {"environment": environment(), "rows": rows})
        print(rows[-1], flush=True)


if __name__ == "__main__":
    main()
