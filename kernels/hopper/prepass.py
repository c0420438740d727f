"""GPU pre-pass of the Hopper kernel: BF16/FP16 q, k, v -> the operands the kernel reads (``KernelOperands``),
in one fused Triton launch (``prepass_launch``: one read of each input, one write of each operand, the anchor
permutation and a layer's q/k transform folded into the loads).

* ``q``, ``k`` (NVFP4 Q/K): NVFP4-quantized and decoded Q and K (docs/numerics.md section 1: ``block16`` or
  ``folded64_mse``), in BF16 (exact: a decoded NVFP4 value has at most 6 significant bits); no scales.
* FP8 Q/K (``qk_format="fp8_e4m3"``): float8_e4m3fn values and their power-of-two scales ``q_scale`` (per query
  row) and ``k_scale`` (per 32 physical keys, padded with 1.0 to whole 128-key kernel tiles).
* ``v6``: MXFP4-quantized V over 32-token blocks, decoded as ``alpha * c`` (six times the value, exact in BF16;
  the kernel applies the factors 1/6 once, at the end).
* For anchored policies K and V are read in physical order: the anchor samples first
  (``fp4vis.key_positions.anchor_permutation``), and the MXFP4 blocks follow that order, as in the reference.

The same arithmetic as ``fp4vis.reference.quantize_operands``: ``prepass_torch`` states it in PyTorch and the
CPU tests check the two bit for bit (Triton's interpreter). No host synchronisation (CUDA-graph capture,
torch.compile). Non-finite inputs become NaN operands (never a finite code): the kernel propagates them and
``fp4vis.attention`` turns that into an error naming the input. Given the call's range record
(``fp4vis.call.RecordSlot``), the launch counts the blocks whose scale leaves its format into
it (docs/numerics.md section 1, "Scale range").
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from fp4vis.policy import QK_FP8

from ..kept_keys import kept_keys
from ..launch_shared import cached_anchor_permutation
from ..scale_record import recorded
from .prepass_launch import DEFAULT_LAUNCH, PrepassLaunch, fp8_prepass, fp8_values, fusable_transform, prepass

NO_DIRECT_LAUNCH = PrepassLaunch(direct=False)   # FP4VIS_PREPASS_DIRECT_LAUNCH=0


class KernelOperands(NamedTuple):
    """What the kernel reads, (B, H, S, D) contiguous: q and k (decoded NVFP4 in BF16, or float8_e4m3fn), v6, and
    for FP8 Q/K the float32 scales (None for NVFP4: the kernel reads decoded values); for a key-masked call the
    int32 (B,) count of each batch element's kept keys, which k and v6 hold first (``kept_keys``). FP8 P/V
    policies: v6 is V^T in E4M3 ((B, H, D, S') from ``prepass_launch.fp8_values``) and ``v_scale`` its float32
    (B, H, D) per-channel scales."""

    q: torch.Tensor
    k: torch.Tensor
    v6: torch.Tensor
    q_scale: torch.Tensor | None = None
    k_scale: torch.Tensor | None = None
    key_lengths: torch.Tensor | None = None
    v_scale: torch.Tensor | None = None


def kernel_operands(call, params, settings) -> KernelOperands:
    """The operands of an ``fp4vis.call.AttentionCall`` (its q, k, v views: any (B, H, S, D) strides with unit
    stride along D are read in place; its range record) for its ``fp4vis.policy.KernelParams``. ``settings``: the
    ``fp4vis.settings.KernelSettings`` of the launch. The call's q/k transform folds into the launch where
    ``prepass_launch.fusable_transform`` accepts it (decided here, at run time: under torch.compile this runs in the
    op); otherwise it is applied first, in PyTorch, as the unpatched layer applies it. A key-masked call's kept keys
    are gathered first (``kept_keys``, in the anchored order where the policy has anchors; the q/k transform applied
    before, at the keys' own positions), and the pre-pass reads them in that order."""
    q, k, v, qk = call.q, call.k, call.v, call.qk_transform
    if qk is not None and (call.key_mask is not None or fusable_transform(q, k, qk) is not None):
        q, k = qk.apply(q, k, "bhsd")
        qk = None
    key_lengths = None
    if call.key_mask is not None:
        k, v, key_lengths = kept_keys(k, v, call.key_mask, params.anchor)
        perm = None
    else:
        perm = cached_anchor_permutation(k.shape[-2], params.anchor, k.device, torch.int32) if params.anchor else None
    q, k, v = (t if t.stride(-1) == 1 else t.contiguous() for t in (q, k, v))
    launch = DEFAULT_LAUNCH if settings.prepass_direct_launch else NO_DIRECT_LAUNCH
    record = recorded(call.record, call.scale)
    v_in = v[..., :0, :] if params.pv_fp8 else v   # FP8 P/V: V takes its own pass (fp8_values), the Q/K pass none
    if params.qk_layout == QK_FP8:
        ops = KernelOperands(*fp8_prepass(q, k, v_in, perm, qk, record, launch), key_lengths=key_lengths)
    else:
        # E2M1 codes on FP16 pairs are PTX: Triton's interpreter (the CPU tests) takes the float32 form
        ops = KernelOperands(*prepass(q, k, v_in, params.qk_layout, perm, settings.prepass_f16_codes and q.is_cuda,
                                      qk, settings.prepass_full_search, record, launch), key_lengths=key_lengths)
    if params.pv_fp8:
        vt, v_scale = fp8_values(v, record)
        ops = ops._replace(v6=vt, v_scale=v_scale)
    return ops
