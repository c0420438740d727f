"""Attention time of a plan's denoising run: which share of it runs in FP4, and how long it takes.

A run is a grid of cells, one per (denoising step, attention layer); each cell is ``calls`` calls of the layer
(two under classifier-free guidance). ``AttentionTimes`` holds one per-call time per layer for exact attention
and for each FP4 policy, from one of two sources, named in every result (``source``):

* ``measured_times`` (a CUDA device): each layer shape timed on this GPU, ``fp4vis.attention`` under the policy
  against ``F.scaled_dot_product_attention`` in BF16, CUDA events (``fp4vis.services.timing.time_cuda``), random
  q, k, v of the layer's shape; milliseconds.
* ``stated_times`` (any device, the CPU's): a stated model, not a measurement: exact attention's per-call time is
  its FLOPs (``4 * batch * S_q * S_kv * heads * head_dim``, in GFLOP: relative units), an FP4 call's that times
  ``FP4_RELATIVE_TIME``, the FP4/BF16 per-call time ratio measured on the H200 (below).

The FP4 share of a plan is the share of the all-exact run's attention time its FP4 cells take
(``fp4_share``): the part of the attention work the plan hands to FP4; its predicted attention time
(``run_time``) adds each cell's time under what it runs.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

#: FP4 per-call time / BF16 SDPA (cuDNN) per-call time, the geometric mean over the five shapes of
#: benchmarks/results/20261203o_h200_kernel_grid.json (H200, Hopper kernel, eager calls, D = 128): ``fast``
#: 1.117 (slower than cuDNN there: the Hopper kernel emulates FP4 on FP8 tensor cores, docs/hopper_kernel.md).
#: Policies the grid did not time take ``fast``'s figure.
FP4_RELATIVE_TIME = {"fast": 1.117}
STATED_SOURCE = ("stated model: exact per-call time = attention FLOPs (GFLOP, relative units); FP4 per-call time = "
                 "that x the H200's FP4/BF16 per-call ratio (benchmarks/results/20261203o_h200_kernel_grid.json: "
                 "fast {ratio})")


@dataclass(frozen=True)
class LayerShape:
    """One attention call of a layer: batch, query and key lengths, heads, head dim."""

    batch: int
    s_q: int
    s_kv: int
    heads: int
    head_dim: int

    @property
    def flops(self) -> float:
        return 4.0 * self.batch * self.s_q * self.s_kv * self.heads * self.head_dim


@dataclass(frozen=True)
class AttentionTimes:
    """Per-call attention time of every layer, exact and per FP4 policy (``units``), and where it comes from."""

    exact: Mapping[str, float]
    fp4: Mapping[str, Mapping[str, float]]   # policy name -> layer -> per-call time
    calls: int                               # calls of each layer per denoising step
    source: str
    units: str

    def fp4_share(self, steps: int, exact_steps: Collection[int], exact_layers: Collection[str],
                  layer_steps: Mapping[str, Collection[int]] | None = None) -> float:
        """The share of the all-exact run's attention time that the plan's FP4 cells take (module docstring).
        ``exact_steps``: steps every layer is exact in (0 .. steps - 1); ``exact_layers``: layers exact in every
        step; ``layer_steps``: a layer -> the further steps it is exact in."""
        total = steps * sum(self.exact.values())
        fp4 = sum(t * self._fp4_steps(name, steps, exact_steps, exact_layers, layer_steps)
                  for name, t in self.exact.items())
        # rounded: plans with the same FP4 cells in another order must compare equal (the search runs only
        # candidates with strictly more share than its best, and a last-bit difference would pass for more)
        return round(fp4 / total, 12) if total > 0 else 0.0

    def run_time(self, steps: int, exact_steps: Collection[int], exact_layers: Collection[str], policy: str,
                 layer_steps: Mapping[str, Collection[int]] | None = None) -> float:
        """Predicted attention time of the run (``units``): every cell under what it runs."""
        fp4 = self.fp4[policy]
        return self.calls * sum(
            k * fp4[n] + (steps - k) * self.exact[n]
            for n in self.exact for k in [self._fp4_steps(n, steps, exact_steps, exact_layers, layer_steps)])

    @staticmethod
    def _fp4_steps(name: str, steps: int, exact_steps: Collection[int], exact_layers: Collection[str],
                   layer_steps: Mapping[str, Collection[int]] | None) -> int:
        """How many of the run's steps the layer runs in FP4."""
        if name in exact_layers:
            return 0
        return steps - len(set(exact_steps) | set((layer_steps or {}).get(name, ())))

    def to_dict(self) -> dict[str, Any]:
        return {"source": self.source, "units": self.units, "calls_per_step": self.calls,
                "exact_per_call": dict(self.exact), "fp4_per_call": {p: dict(t) for p, t in self.fp4.items()}}


def stated_times(shapes: Mapping[str, LayerShape], policies: Sequence[str], calls: int) -> AttentionTimes:
    """The stated model (module docstring), on any device."""
    exact = {name: s.flops / 1e9 for name, s in shapes.items()}
    ratio = {p: FP4_RELATIVE_TIME.get(p, FP4_RELATIVE_TIME["fast"]) for p in policies}
    fp4 = {p: {name: t * ratio[p] for name, t in exact.items()} for p in policies}
    text = STATED_SOURCE.format(ratio=FP4_RELATIVE_TIME["fast"])
    if any(p not in FP4_RELATIVE_TIME for p in policies):
        text += "; " + ", ".join(p for p in policies if p not in FP4_RELATIVE_TIME) + " take fast's ratio"
    return AttentionTimes(exact=exact, fp4=fp4, calls=calls, source=text, units="GFLOP-equivalent")


def time_shape(shape: LayerShape, policies: Sequence[str], *, device: torch.device, backend: str = "auto"
               ) -> dict[str, float]:
    """Per-call median milliseconds of one layer shape on ``device`` (CUDA): ``exact`` (SDPA, BF16) and each
    policy (``fp4vis.attention``), random q, k, v."""
    import torch.nn.functional as F

    from fp4vis import attention
    from fp4vis.services.timing import time_cuda

    g = torch.Generator(device=device).manual_seed(0)
    q, k, v = (torch.randn(shape.batch, shape.heads, s, shape.head_dim, generator=g, device=device,
                           dtype=torch.bfloat16) for s in (shape.s_q, shape.s_kv, shape.s_kv))
    calls = {"exact": lambda i: F.scaled_dot_product_attention(q, k, v)}
    calls |= {p: (lambda i, p=p: attention(q, k, v, policy=p, backend=backend, range_check="off")) for p in policies}
    out = {}
    for name, fn in calls.items():
        times = sorted(time_cuda(fn, 1))
        out[name] = times[len(times) // 2]
    return out


def measured_times(shapes: Mapping[str, LayerShape], policies: Sequence[str], calls: int, *, device: torch.device,
                   backend: str = "auto") -> AttentionTimes:
    """Every distinct layer shape timed on ``device`` (CUDA), exact (SDPA, BF16) and under each policy."""
    per_shape = {shape: time_shape(shape, policies, device=device, backend=backend)
                 for shape in dict.fromkeys(shapes.values())}
    name = torch.cuda.get_device_name(device)
    return AttentionTimes(exact={n: per_shape[s]["exact"] for n, s in shapes.items()},
                          fp4={p: {n: per_shape[s][p] for n, s in shapes.items()} for p in policies}, calls=calls,
                          source=f"measured on {name}: per-call median of CUDA-event timings, random BF16 q, k, v "
                                 f"of each layer's shape; exact = F.scaled_dot_product_attention, FP4 = "
                                 f"fp4vis.attention (backend {backend})", units="ms")


def attention_times(shapes: Mapping[str, LayerShape], policies: Sequence[str], calls: int, *,
                    device: torch.device) -> AttentionTimes:
    """Measured on a CUDA device, the stated model elsewhere."""
    if torch.device(device).type == "cuda":
        return measured_times(shapes, policies, calls, device=torch.device(device))
    return stated_times(shapes, policies, calls)
