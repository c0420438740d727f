"""The Hopper backend's custom op, ``torch.ops.fp4vis.hopper_attention``: the one place a call is flattened into plain
values (the policy as its text, a q/k transform as its tensors, the range record as a compiled call's site, started
in the op at run time). torch.compile keeps the op as one graph node (its fake gives the output's shape); its body
builds the ``AttentionCall`` again and runs the eager launcher. Eager calls do not go through it: the dispatcher
costs 30-85 us a call (benchmarks/results/20261129b_h200_prepass.json).
"""

from __future__ import annotations

import torch

from fp4vis.backends import range_record
from fp4vis.call import AttentionCall
from fp4vis.qk_transform import QKTransform

from .launch import attention, output_like


@torch.library.custom_op("fp4vis::hopper_attention", mutates_args=(), device_types="cuda")
def hopper_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, policy: str,
                     record_site: int = 0, q_norm: torch.Tensor | None = None, k_norm: torch.Tensor | None = None,
                     q_eps: float = 0.0, k_eps: float = 0.0, rope_cos: torch.Tensor | None = None,
                     rope_sin: torch.Tensor | None = None, key_mask: torch.Tensor | None = None) -> torch.Tensor:
    """``attention`` of the call these values describe (``op_call``)."""
    qk = None
    if q_norm is not None or k_norm is not None or rope_cos is not None:
        qk = QKTransform(q_norm, k_norm, q_eps, k_eps, None if rope_cos is None else (rope_cos, rope_sin))
    record = range_record.start_site_call(record_site, (q, k, v)) if record_site else None
    return attention(AttentionCall(q, k, v, range_record.policy_of_text(policy), scale, qk, key_mask, record=record))


@hopper_attention.register_fake
def _hopper_attention_fake(q, k, v, scale, policy, record_site=0, q_norm=None, k_norm=None, q_eps=0.0, k_eps=0.0,
                           rope_cos=None, rope_sin=None, key_mask=None):
    return output_like(q, v)   # the launcher's strides: compiled code that follows relies on them


def op_call(call: AttentionCall) -> torch.Tensor:
    """``call`` through the custom op (under torch.compile; and where autograd records, so that the missing
    backward fails at backward rather than silently). An eager call's record is not carried: the op has no
    record of its own outside a compiled graph's site."""
    qk = call.qk_transform
    transform = {} if qk is None else dict(
        q_norm=qk.q_weight, k_norm=qk.k_weight, q_eps=float(qk.q_eps), k_eps=float(qk.k_eps),
        rope_cos=None if qk.rope is None else qk.rope[0], rope_sin=None if qk.rope is None else qk.rope[1])
    return torch.ops.fp4vis.hopper_attention(call.q, call.k, call.v, call.scale,
                                             range_record.policy_text(call.policy), call.record_site,
                                             key_mask=call.key_mask, **transform)
