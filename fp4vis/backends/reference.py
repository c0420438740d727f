"""The reference backend: the exact emulation of docs/numerics.md (``fp4vis.reference``) for every
policy, device and shape. The one backend that reports its range as a ``RangeReport`` per call.

Under torch.compile it runs as the custom op ``torch.ops.fp4vis.reference_attention`` (one graph
node: the emulation is chunked Python with data-dependent checks, which Dynamo must not trace); the
op checks the inputs and enforces the call's range_check itself, at run time."""

from __future__ import annotations

import torch

from fp4vis.reference import RangeExceededError, enforce_range, reference_attention

from . import range_record
from .base import REFERENCE, Backend


class ReferenceBackend(Backend):
    name = REFERENCE

    def unsupported_reason(self, q, k, v, policy, scale):
        return None

    def forward(self, q, k, v, policy, scale, record_site: int = 0):
        if record_site:
            return torch.ops.fp4vis.reference_attention(q, k, v, float(scale), record_site), None
        return _forward(q, k, v, policy, scale)


def _forward(q, k, v, policy, scale):
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not bool(torch.isfinite(t).all()):
            bad = "NaN" if bool(torch.isnan(t).any()) else "Inf"
            raise ValueError(f"{name}: contains {bad}; attention inputs must be finite")
    b, h = q.shape[:2]
    out, report = reference_attention(q.flatten(0, 1), k.flatten(0, 1), v.flatten(0, 1), policy, scale)
    return out.unflatten(0, (b, h)), report


def _reference_op(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, record_site: int) -> torch.Tensor:
    site = range_record.site_of(record_site)
    range_record.poll()   # as fp4vis.attention does at an eager call's start
    try:
        out, report = _forward(q, k, v, site.policy, scale)
        enforce_range(report, site.policy, site.mode, stacklevel=2)
    except (ValueError, RangeExceededError) as exc:   # as a patched layer's eager call names itself
        exc.args = (range_record.labelled(str(exc), site.layer), *exc.args[1:])
        raise
    return out


reference_op = torch.library.custom_op("fp4vis::reference_attention", mutates_args=())(_reference_op)


@reference_op.register_fake
def _reference_op_fake(q, k, v, scale, record_site):
    return q.new_empty(q.shape[:-1] + (v.shape[-1],))
