"""GPU pre-pass of the Hopper kernel: BF16/FP16 q, k, v -> the operands the kernel reads.

* ``q_hat``, ``k_hat``: NVFP4-quantized and decoded Q and K (SPEC section 1: ``block16`` or
  ``folded64_mse``), in BF16 (exact: a decoded NVFP4 value has at most 6 significant bits).
* ``v6``: MXFP4-quantized V over 32-token blocks, decoded as ``alpha * c`` (six times the value,
  exact in BF16; the kernel applies the factors 1/6 once, at the end).
* For anchored policies K and V are first permuted so that the anchor samples occupy physical key
  positions 0..n-1 (``fp4vis.reference.anchor_permutation``), then quantized (MXFP4 blocks follow
  the physical order, as in the reference).

This is the same arithmetic as ``fp4vis.formats`` / ``fp4vis.reference.quantize_operands`` (the
CPU tests check bit equality), written without host synchronisation (no NaN checks, no boolean
indexing, the permutation built once on the host and cached per device) so that it runs inside
CUDA-graph capture and torch.compile. Non-finite inputs become NaN operands on every path (never
a finite code): the kernel propagates them and ``fp4vis.attention`` turns that into an error
naming the input.
On CUDA tensors the default is the fused Triton version (``hopper_prepass_triton``: one launch,
one read of each input, one write of each operand, anchor permutation folded into the loads); the
PyTorch formulation here (several elementwise passes) is the fallback and the CPU-checkable
statement.
"""

from __future__ import annotations

import os

import torch

from fp4vis.formats import mxfp4_qdq, nvfp4_qdq
from fp4vis.reference import anchor_permutation

NVFP4_BLOCK = 16
MXFP4_BLOCK = 32

_PERM_CACHE: dict[tuple, torch.Tensor] = {}


def cached_anchor_permutation(seq_len: int, n: int, device: torch.device,
                              dtype: torch.dtype = torch.long) -> torch.Tensor:
    """``anchor_permutation(seq_len, n)`` computed on the CPU once and kept on ``device``."""
    key = (seq_len, n, device, dtype)
    perm = _PERM_CACHE.get(key)
    if perm is None:
        perm = anchor_permutation(seq_len, n, device="cpu").to(dtype).to(device)
        _PERM_CACHE[key] = perm
    return perm


def _nan_where_not_finite(x_hat: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """x_hat, NaN where x is NaN or Inf (the quantizers saturate Inf to a finite code)."""
    return torch.where(torch.isfinite(x), x_hat, torch.nan).contiguous()


def _qk_hat(x: torch.Tensor, layout: str) -> torch.Tensor:
    """Decoded NVFP4 of x in BF16 (exact), from the project's one quantizer."""
    return _nan_where_not_finite(nvfp4_qdq(x, layout).to(torch.bfloat16), x)


_TP: list = []


def _triton_prepass():
    """The fused Triton pre-pass module, or None where Triton cannot run (no Triton); imported once."""
    if not _TP:
        try:
            from . import hopper_prepass_triton
        except Exception:  # pragma: no cover - depends on the machine
            hopper_prepass_triton = None
        _TP.append(hopper_prepass_triton)
    return _TP[0]


# The fused Triton pre-pass computes what fp4vis.formats does (exactly: see hopper_prepass_triton);
# FP4VIS_PREPASS_FUSED_FOLDED=0 sends the folded layout through fp4vis.formats instead (bit-equal by
# construction, slow).
FUSED_FOLDED = os.environ.get("FP4VIS_PREPASS_FUSED_FOLDED", "1") == "1"


def prepare_operands(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, qk_layout: str,
                     anchor: int, fused: bool | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(q_hat, k_hat, v6), BF16, (B, H, S, D) contiguous, from (B, H, S, D) inputs.

    ``fused`` (default: on CUDA tensors when Triton imports) runs the Triton pre-pass of
    ``hopper_prepass_triton``: one launch for Q, K and V, the three operands views of one buffer;
    otherwise the PyTorch formulation below (several passes). The folded-K64 Q/K quantizer is fused
    only when ``FUSED_FOLDED`` is on (see there) or ``fused`` is True."""
    tp = _triton_prepass() if (fused or fused is None) and q.is_cuda else None
    if fused and tp is None:
        raise RuntimeError("fused pre-pass needs CUDA tensors and Triton")
    if tp is not None:
        q, k, v = q.contiguous(), k.contiguous(), v.contiguous()
        perm = cached_anchor_permutation(k.shape[-2], anchor, k.device, torch.int32) if anchor > 0 else None
        if qk_layout == "block16" or FUSED_FOLDED or fused:
            return tp.prepass(q, k, v, qk_layout, perm)
        v6 = tp.mxfp4_v6(v, perm)
        if anchor > 0:
            k = k.index_select(-2, cached_anchor_permutation(k.shape[-2], anchor, k.device))
        return _qk_hat(q, qk_layout), _qk_hat(k, qk_layout), v6
    if anchor > 0:
        perm = cached_anchor_permutation(k.shape[-2], anchor, k.device)
        k = k.index_select(-2, perm)
        v = v.index_select(-2, perm)
    q_hat, k_hat = _qk_hat(q, qk_layout), _qk_hat(k, qk_layout)
    v6 = _nan_where_not_finite(mxfp4_qdq(v, times_six=True).to(torch.bfloat16), v)
    return q_hat, k_hat, v6
