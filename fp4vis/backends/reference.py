"""The reference backend: the exact emulation of docs/numerics.md (``fp4vis.reference``) for every
policy, device and shape. The one backend that reports its range as a ``RangeReport`` per call.

Under torch.compile it runs as the custom op ``torch.ops.fp4vis.reference_attention`` (one graph
node: the emulation is chunked Python with data-dependent checks, which Dynamo must not trace); the
op checks the inputs and enforces the call's range_check itself, at run time."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from fp4vis.range_report import RangeExceededError, enforce_range
from fp4vis.reference import check_key_mask_keeps_keys, masked_reference_attention, reference_attention

from . import range_record
from .base import REFERENCE, Backend


class ReferenceBackend(Backend):
    name = REFERENCE

    def supports(self, call):
        return None

    def run(self, call):
        q, k, v, policy, scale, key_mask = call.q, call.k, call.v, call.policy, call.scale, call.key_mask
        if call.record_site:
            if policy.method == "exact":
                # SDPA itself, traced: differentiable (the one policy that is), where the emulation's op is not;
                # as SDPA, no input check and no float64 recompute of scores that overflow
                mask = None if key_mask is None else key_mask[:, None, None, :]
                return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale), None
            return torch.ops.fp4vis.reference_attention(q, k, v, float(scale), range_record.policy_text(policy),
                                                        call.record_site, key_mask), None
        return _forward(q, k, v, policy, scale, key_mask)


def _forward(q, k, v, policy, scale, key_mask=None):
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not bool(torch.isfinite(t).all()):
            bad = "NaN" if bool(torch.isnan(t).any()) else "Inf"
            raise ValueError(f"{name}: contains {bad}; attention inputs must be finite")
    if key_mask is not None:
        return masked_reference_attention(q, k, v, key_mask, policy, scale)
    b, h = q.shape[:2]
    out, report = reference_attention(q.flatten(0, 1), k.flatten(0, 1), v.flatten(0, 1), policy, scale)
    return out.unflatten(0, (b, h)), report


def _reference_op(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, policy: str,
                  record_site: int, key_mask: torch.Tensor | None = None) -> torch.Tensor:
    """The emulation of a compiled call: ``policy`` its ``range_record.policy_text`` (the op computes from its
    own arguments), ``record_site`` its call site (the range_check mode, and what its errors name), ``key_mask``
    its bool (B, Skv) key mask or None."""
    site = range_record.site_of(record_site)
    range_record.poll()   # as fp4vis.attention does at an eager call's start
    pol = range_record.policy_of_text(policy)
    try:
        if key_mask is not None:
            check_key_mask_keeps_keys(key_mask)
        out, report = _forward(q, k, v, pol, scale, key_mask)
        enforce_range(report, pol, site.mode, stacklevel=2)
    except (ValueError, RangeExceededError) as exc:   # named as the record names a kernel's compiled call
        exc.args = (f"{site.describe(q, k, v)}: {exc.args[0] if exc.args else exc}", *exc.args[1:])
        raise
    return out


reference_op = torch.library.custom_op("fp4vis::reference_attention", mutates_args=())(_reference_op)


@reference_op.register_fake
def _reference_op_fake(q, k, v, scale, policy, record_site, key_mask=None):
    return q.new_empty(q.shape[:-1] + (v.shape[-1],))
