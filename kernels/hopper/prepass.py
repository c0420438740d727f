"""GPU pre-pass of the Hopper kernel: BF16/FP16 q, k, v -> the operands the kernel reads.

* ``q_hat``, ``k_hat``: NVFP4-quantized and decoded Q and K (docs/numerics.md section 1: ``block16`` or
  ``folded64_mse``), in BF16 (exact: a decoded NVFP4 value has at most 6 significant bits).
* ``v6``: MXFP4-quantized V over 32-token blocks, decoded as ``alpha * c`` (six times the value,
  exact in BF16; the kernel applies the factors 1/6 once, at the end).
* For anchored policies K and V are first permuted so that the anchor samples occupy physical key
  positions 0..n-1 (``fp4vis.layout.anchor_permutation``), then quantized (MXFP4 blocks follow
  the physical order, as in the reference).
* FP8 Q/K (``prepare_fp8_operands``, ``qk_format="fp8_e4m3"``): ``q8``, ``k8`` float8_e4m3fn values
  and their power-of-two scales ``q_scale`` (per query row) and ``k_scale`` (per 32 physical keys,
  padded with 1.0 to whole 128-key kernel tiles), ``fp4vis.formats.fp8_pow2_quantize``; V as above.

This is the same arithmetic as ``fp4vis.formats`` / ``fp4vis.reference.quantize_operands`` (the
CPU tests check bit equality), written without host synchronisation (no NaN checks, no boolean
indexing, the permutation built once on the host and cached per device) so that it runs inside
CUDA-graph capture and torch.compile. Non-finite inputs become NaN operands on every path (never
a finite code): the kernel propagates them and ``fp4vis.attention`` turns that into an error
naming the input. Given the range record (``record``: its (fields, flag, call), ``kernels/scale_record.py``),
every path counts the blocks whose scale leaves its format into it (docs/numerics.md section 1, "Scale range").
On CUDA tensors the default is the fused Triton version (``prepass_triton``: one launch,
one read of each input, one write of each operand, anchor permutation folded into the loads; for
either kind of Q/K operand); the PyTorch formulation here (several elementwise passes) is the
fallback and the CPU-checkable statement.
"""

from __future__ import annotations

import os

import torch

from fp4vis.config import cached_setting
from fp4vis.formats import (
    fp8_pow2_quantize,
    fp8_pow2_scale_counts,
    mxfp4_qdq,
    mxfp4_scale_counts,
    nvfp4_qdq,
    nvfp4_qdq_counted,
)
from fp4vis.layout import anchor_permutation
from fp4vis.policy import QK_FP8

from .layout import FP8_KEY_GROUP, fp8_key_scale_blocks

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


def _count(counts: torch.Tensor, record: tuple | None, operand: int) -> None:
    """Add a ``*_scale_counts`` tensor to the range record (Triton, imported only where a call records)."""
    if record is not None and record[2]:
        from ..scale_record import add_counts
        add_counts(counts, record, operand)


def _qk_hat(x: torch.Tensor, layout: str, record: tuple | None = None, operand: int = 0) -> torch.Tensor:
    """Decoded NVFP4 of x in BF16 (exact), from the project's one quantizer; its scale range counted into
    ``record`` as ``operand`` (0 q, 1 k)."""
    if record is None:
        x_hat = nvfp4_qdq(x, layout)
    else:
        x_hat, counts = nvfp4_qdq_counted(x, layout)
        _count(counts, record, operand)
    return _nan_where_not_finite(x_hat.to(torch.bfloat16), x)


def _fp8_values(x: torch.Tensor, group_rows: int, record: tuple | None = None,
                operand: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """(E4M3 values as float8_e4m3fn, NaN where x is not finite; float32 scales (..., groups)) of
    x, from the project's one quantizer (its values are E4M3 already: the cast is exact); its scale range
    counted as in ``_qk_hat``."""
    vals, scales = fp8_pow2_quantize(x, group_rows)
    if record is not None:
        _count(fp8_pow2_scale_counts(x, group_rows), record, operand)
    return _nan_where_not_finite(vals, x).to(torch.float8_e4m3fn), scales.squeeze(-1).contiguous()


def _v6(v: torch.Tensor, record: tuple | None = None) -> torch.Tensor:
    """MXFP4 ``alpha * c`` of V in BF16 (exact), NaN where v is not finite; its scale range counted into
    ``record``."""
    if record is not None:
        _count(mxfp4_scale_counts(v), record, 2)
    return _nan_where_not_finite(mxfp4_qdq(v, times_six=True).to(torch.bfloat16), v)


def _physical_keys(k: torch.Tensor, v: torch.Tensor, anchor: int) -> tuple[torch.Tensor, torch.Tensor]:
    """k, v with the keys in physical order: the anchor samples first (anchor > 0), else as given."""
    if anchor > 0:
        perm = cached_anchor_permutation(k.shape[-2], anchor, k.device)
        k = k.index_select(-2, perm)
        v = v.index_select(-2, perm)
    return k, v


def _int32_permutation(k: torch.Tensor, anchor: int) -> torch.Tensor | None:
    """The anchor permutation as the Triton pre-pass reads it (int32), None without anchors."""
    return cached_anchor_permutation(k.shape[-2], anchor, k.device, torch.int32) if anchor > 0 else None


_TP: list = []


def _triton_prepass():
    """The fused Triton pre-pass module, or None where Triton cannot run (no Triton); imported once."""
    if not _TP:
        try:
            from . import prepass_triton
        except Exception:  # pragma: no cover - depends on the machine
            prepass_triton = None
        _TP.append(prepass_triton)
    return _TP[0]


def _fused_module(x: torch.Tensor, fused: bool | None):
    """The Triton pre-pass module where the fused path is asked for (``fused``) or is the default
    (None: CUDA tensors), else None; raises where it is asked for and cannot run. CPU tensors run it
    only under Triton's interpreter (TRITON_INTERPRET=1: the CPU tests check the dispatch too)."""
    runnable = x.is_cuda or (bool(fused) and os.environ.get("TRITON_INTERPRET") == "1")
    tp = _triton_prepass() if (fused or fused is None) and runnable else None
    if fused and tp is None:
        raise RuntimeError("fused pre-pass needs CUDA tensors and Triton")
    return tp


def _unit_stride(t: torch.Tensor) -> torch.Tensor:
    """t as the Triton pre-pass reads it: any (B, H, S, D) view whose D values are adjacent."""
    return t if t.stride(-1) == 1 else t.contiguous()


def _with_transform(q: torch.Tensor, k: torch.Tensor, qk, tp) -> tuple[torch.Tensor, torch.Tensor, object]:
    """(q, k, the transform left for the Triton pre-pass): ``qk`` (a ``fp4vis.qk_transform.QKTransform``
    of raw (B, H, S, D) projections, or None) stays for the pre-pass where it folds into it
    (``prepass_triton.fusable_transform``); otherwise it is applied here, in PyTorch, as the
    unpatched layer applies it, and the pre-pass gets ordinary q and k (also with FP4VIS_PREPASS_FUSED_QK=0)."""
    if qk is None or (tp is not None and cached_setting("FP4VIS_PREPASS_FUSED_QK")
                      and tp.fusable_transform(q, k, qk) is None):
        return q, k, qk
    return (*qk.apply(q, k, "bhsd"), None)


def prepare_operands(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, qk_layout: str, anchor: int,
                     fused: bool | None = None, qk=None,
                     record: tuple | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(q_hat, k_hat, v6), BF16, (B, H, S, D) contiguous, from (B, H, S, D) inputs (views: the fused
    path reads them in place). ``qk``: see ``_with_transform``; ``record``: the module docstring.

    ``fused`` (default: on CUDA tensors when Triton imports) runs the Triton pre-pass of
    ``prepass_triton``: one launch for Q, K and V, the three operands views of one buffer;
    otherwise the PyTorch formulation below (several passes). The folded-K64 Q/K quantizer is fused
    only when ``fused`` is True or FP4VIS_PREPASS_FUSED_FOLDED is on (the default; 0 sends the folded
    layout through ``fp4vis.formats``: the same bits, slow)."""
    tp = _fused_module(q, fused)
    one_launch = tp is not None and (qk_layout == "block16" or fused or cached_setting("FP4VIS_PREPASS_FUSED_FOLDED"))
    q, k, qk = _with_transform(q, k, qk, tp if one_launch else None)
    if tp is not None:
        q, k, v = _unit_stride(q), _unit_stride(k), _unit_stride(v)
        perm = _int32_permutation(k, anchor)
        if one_launch:
            return tp.prepass(q, k, v, qk_layout, perm, qk=qk, record=record)
        q, k, v = q.contiguous(), k.contiguous(), v.contiguous()
        v6 = tp.mxfp4_v6(v, perm, record)
        if anchor > 0:
            k = k.index_select(-2, cached_anchor_permutation(k.shape[-2], anchor, k.device))
        return _qk_hat(q, qk_layout, record, 0), _qk_hat(k, qk_layout, record, 1), v6
    k, v = _physical_keys(k, v, anchor)
    return _qk_hat(q, qk_layout, record, 0), _qk_hat(k, qk_layout, record, 1), _v6(v, record)


def _fp8_fusable(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> bool:
    """The shapes the fused FP8 pre-pass handles: one head dim D, a power of two (Triton's ranges;
    the kernel's 64 and 128 among them), and V shaped like K (its blocks are K's programs)."""
    d = q.shape[-1]
    return d > 0 and d & (d - 1) == 0 and k.shape[-1] == d and v.shape == k.shape


def prepare_fp8_operands(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, anchor: int,
                         fused: bool | None = None, qk=None, record: tuple | None = None):
    """(q8, k8, v6, q_scale, k_scale) for ``qk_format="fp8_e4m3"`` from (B, H, S, D) inputs (Sq may
    differ from Skv), all contiguous:

    * q8 (B, H, Sq, D), k8 (B, H, Skv, D): float8_e4m3fn E4M3 values of x / 2^E, E per query row
      and per 32 physical keys (anchor-permuted order; a partial last block uses its valid keys);
    * v6: BF16 MXFP4 ``alpha * c`` of V in physical order, as ``prepare_operands``;
    * q_scale (B, H, Sq), k_scale (B, H, 4 * ceil(Skv / 128)): float32 2^E, k_scale padded with
      1.0 to whole 128-key kernel tiles so the kernel reads it without predicates.

    NaN or Inf in q or k gives NaN in q8 / k8 at that position (the scales are then unspecified).
    ``fused`` as in ``prepare_operands`` (the Triton pre-pass where D is a power of two and V is
    shaped like K; the PyTorch formulation otherwise, through ``fp4vis.formats.fp8_pow2_quantize``).
    No host synchronisation on either path (CUDA-graph capture). ``qk``: see ``_with_transform``; ``record``:
    the module docstring."""
    tp = _fused_module(q, fused)
    if tp is not None and not _fp8_fusable(q, k, v):
        if fused:
            raise ValueError(f"fused FP8 pre-pass: needs one head dim, a power of two, and v shaped like k; "
                             f"got q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)}")
        tp = None
    q, k, qk = _with_transform(q, k, qk, tp)
    if tp is not None:
        q, k, v = _unit_stride(q), _unit_stride(k), _unit_stride(v)
        return tp.fp8_prepass(q, k, v, _int32_permutation(k, anchor), qk=qk, record=record)
    k, v = _physical_keys(k, v, anchor)
    q8, q_scale = _fp8_values(q, 1, record, 0)
    k8, k_scale = _fp8_values(k, FP8_KEY_GROUP, record, 1)
    k_scale = torch.nn.functional.pad(k_scale, (0, fp8_key_scale_blocks(k.shape[-2]) - k_scale.shape[-1]),
                                      value=1.0)
    return q8, k8, _v6(v, record), q_scale, k_scale


def prepare_kernel_operands(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, qk_fmt: str, anchor: int,
                            fused: bool | None = None, qk=None, record: tuple | None = None):
    """(q_hat, k_hat, v6, q_scale, k_scale) for the kernel, whichever the Q/K format: the FP8 operands
    of ``prepare_fp8_operands`` for ``"fp8_e4m3"``, else ``prepare_operands`` with both scales None
    (the NVFP4 operands are decoded values: the kernel reads no scales). ``qk``: a
    ``fp4vis.qk_transform.QKTransform`` of raw projections q, k (``_with_transform``). ``record``: the range
    record's (fields, flag, call) that the scale range is counted into (module docstring)."""
    if qk_fmt == QK_FP8:
        return prepare_fp8_operands(q, k, v, anchor, fused, qk, record)
    return (*prepare_operands(q, k, v, qk_fmt, anchor, fused, qk, record), None, None)
