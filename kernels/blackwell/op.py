"""The Blackwell backend's custom op, ``torch.ops.fp4vis.blackwell_attention``: the one place a call is flattened
into plain values (the policy as its text, the range record as a compiled call's site, started in the op at run
time). torch.compile keeps it as one graph node; its body gates on the self-check, builds the ``AttentionCall``
again and runs the eager launcher.
"""

from __future__ import annotations

import torch

from fp4vis.backends import range_record
from fp4vis.call import AttentionCall

from .launch import attention, ensure_verified


@torch.library.custom_op("fp4vis::blackwell_attention", mutates_args=(), device_types="cuda")
def blackwell_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, policy: str,
                        record_site: int = 0, key_mask: torch.Tensor | None = None) -> torch.Tensor:
    """``attention`` of the call these values describe (``op_call``), behind the self-check's gate."""
    ensure_verified(q.device)
    record = range_record.start_site_call(record_site, (q, k, v)) if record_site else None
    return attention(AttentionCall(q, k, v, range_record.policy_of_text(policy), scale, key_mask=key_mask,
                                   record=record))


@blackwell_attention.register_fake
def _blackwell_attention_fake(q, k, v, scale, policy, record_site=0, key_mask=None):
    return q.new_empty(q.shape[:-1] + (v.shape[-1],))


def op_call(call: AttentionCall) -> torch.Tensor:
    """``call`` through the custom op (under torch.compile; and where autograd records, so that the missing
    backward fails at backward rather than silently)."""
    return torch.ops.fp4vis.blackwell_attention(call.q, call.k, call.v, call.scale,
                                                range_record.policy_text(call.policy), call.record_site,
                                                call.key_mask)
