"""The Hopper pre-pass written in PyTorch (several elementwise passes over ``fp4vis.formats``): the statement the
fused Triton pre-pass (``prepass``) is checked against bit for bit on the CPU (the tests). The product path is
the Triton one; this module is not on it.

It computes exactly ``fp4vis.reference.quantize_operands``' operands in the kernel's form, written without host
synchronisation (no NaN checks, no boolean indexing): non-finite inputs become NaN operands, never a finite code;
``record`` (a ``fp4vis.call.RecordSlot``) gets the blocks whose scale leaves its format: one small launch per
operand (``scale_record.add_counts``); the decision on the call's underflows is left to what follows, as the fused
pre-pass leaves it to the attention kernel (the tests: ``scale_record.decide``)."""

from __future__ import annotations

import torch

from fp4vis.formats import (
    fp8_pow2_quantize,
    fp8_pow2_scale_counts,
    mxfp4_qdq,
    mxfp4_scale_counts,
    nvfp4_qdq,
    nvfp4_qdq_counted,
)

from ..launch_shared import cached_anchor_permutation
from ..scale_record import add_counts
from .fp8_key_scales import FP8_KEY_GROUP, fp8_key_scale_blocks
from .prepass import KernelOperands


def _nan_where_not_finite(x_hat: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """x_hat, NaN where x is NaN or Inf (the quantizers saturate Inf to a finite code)."""
    return torch.where(torch.isfinite(x), x_hat, torch.nan).contiguous()


def _qk_hat(x: torch.Tensor, layout: str, record, operand: int) -> torch.Tensor:
    """Decoded NVFP4 of x in BF16 (exact); its scale range counted into ``record`` as ``operand`` (0 q, 1 k)."""
    if record is None:
        x_hat = nvfp4_qdq(x, layout)
    else:
        x_hat, counts = nvfp4_qdq_counted(x, layout)
        add_counts(counts, record, operand)
    return _nan_where_not_finite(x_hat.to(torch.bfloat16), x)


def _fp8_values(x: torch.Tensor, group_rows: int, record, operand: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(E4M3 values as float8_e4m3fn, NaN where x is not finite; float32 scales (..., groups)) of x (its values
    are E4M3 already: the cast is exact); its scale range counted as in ``_qk_hat``."""
    vals, scales = fp8_pow2_quantize(x, group_rows)
    if record is not None:
        add_counts(fp8_pow2_scale_counts(x, group_rows), record, operand)
    return _nan_where_not_finite(vals, x).to(torch.float8_e4m3fn), scales.squeeze(-1).contiguous()


def _v6(v: torch.Tensor, record) -> torch.Tensor:
    """MXFP4 ``alpha * c`` of V in BF16 (exact), NaN where v is not finite; its scale range counted."""
    if record is not None:
        add_counts(mxfp4_scale_counts(v), record, 2)
    return _nan_where_not_finite(mxfp4_qdq(v, times_six=True).to(torch.bfloat16), v)


def _physical_keys(k: torch.Tensor, v: torch.Tensor, anchor: int) -> tuple[torch.Tensor, torch.Tensor]:
    """k, v with the keys in physical order: the anchor samples first (anchor > 0), else as given."""
    if anchor > 0:
        perm = cached_anchor_permutation(k.shape[-2], anchor, k.device)
        k, v = k.index_select(-2, perm), v.index_select(-2, perm)
    return k, v


def kernel_operands(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, qk_layout: str, anchor: int,
                    qk=None, record=None) -> KernelOperands:
    """``prepass.kernel_operands``' result, computed in PyTorch: for NVFP4 Q/K (``qk_layout`` "block16" or
    "folded64_mse") q_hat, k_hat, v6 in BF16 and no scales; for ``"fp8_e4m3"`` float8_e4m3fn q8, k8 with their
    power-of-two scales (per query row; per 32 physical keys, padded with 1.0 to whole 128-key kernel tiles).
    ``qk``: a ``fp4vis.qk_transform.QKTransform`` of raw projections q, k, applied first. ``record``: as
    ``prepass_launch.prepass``'s."""
    if qk is not None:
        q, k = qk.apply(q, k, "bhsd")
    k, v = _physical_keys(k, v, anchor)
    if qk_layout == "fp8_e4m3":
        q8, q_scale = _fp8_values(q, 1, record, 0)
        k8, k_scale = _fp8_values(k, FP8_KEY_GROUP, record, 1)
        k_scale = torch.nn.functional.pad(k_scale, (0, fp8_key_scale_blocks(k.shape[-2]) - k_scale.shape[-1]),
                                          value=1.0)
        return KernelOperands(q8, k8, _v6(v, record), q_scale, k_scale)
    return KernelOperands(_qk_hat(q, qk_layout, record, 0), _qk_hat(k, qk_layout, record, 1), _v6(v, record))
