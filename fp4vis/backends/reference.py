"""The reference backend: the exact emulation of docs/numerics.md (``fp4vis.reference``) for every
policy, device and shape. The one backend that reports its range (a ``RangeReport`` per call)."""

from __future__ import annotations

import functools

import torch

from fp4vis.reference import reference_attention

from .base import REFERENCE, Backend


class ReferenceBackend(Backend):
    name = REFERENCE

    def unsupported_reason(self, q, k, v, policy, scale):
        return None

    def forward(self, q, k, v, policy, scale):
        return _eager_forward()(q, k, v, policy, scale)


def _forward(q, k, v, policy, scale):
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not bool(torch.isfinite(t).all()):
            bad = "NaN" if bool(torch.isnan(t).any()) else "Inf"
            raise ValueError(f"{name}: contains {bad}; attention inputs must be finite")
    b, h = q.shape[:2]
    out, report = reference_attention(q.flatten(0, 1), k.flatten(0, 1), v.flatten(0, 1), policy, scale)
    return out.unflatten(0, (b, h)), report


@functools.cache
def _eager_forward():
    """The emulation is chunked Python with data-dependent checks: torch.compile runs it eagerly (one
    graph break) instead of tracing every chunk. Wrapped at first use, not at import:
    ``torch.compiler.disable`` imports torch._dynamo (seconds)."""
    return torch.compiler.disable(_forward)
