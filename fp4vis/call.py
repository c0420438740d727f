"""One attention call as the backends get it, and how one is made. ``validated_call`` checks ``fp4vis.attention``'s
arguments (a patched layer's too) once and builds the ``AttentionCall``; the registry asks each backend
``supports(call)`` and runs ``run(call)``. Nothing below
unpacks it again except a backend's custom op, whose arguments must be plain values (docs/design.md,
"Follow a tensor"). A call's key mask has one form, bool (B, Skv); ``broadcast_key_mask`` is the one translation
of SDPA's mask argument into it (the patchers translate their libraries' masks through it)."""

from __future__ import annotations

import math
import numbers
from typing import Literal, NamedTuple

import torch

from fp4vis.policy import Policy, get_policy
from fp4vis.qk_transform import QKTransform
from fp4vis.reference import check_key_mask_keeps_keys

Layout = Literal["bhsd", "bshd"]
SUPPORTED_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


class RecordSlot(NamedTuple):
    """One recorded call's place in its device's record (``fp4vis.backends.range_record.RangeRecord.start_call``):
    the record's int32 ``fields`` and host ``flag`` (pinned, mapped into the device's address space) and the call's
    ``number``. A pre-pass takes it as is; a kernel takes its ``addresses``."""

    fields: torch.Tensor
    flag: torch.Tensor
    number: int

    @property
    def addresses(self) -> tuple[int, int, int]:
        """(fields address, flag address, number): what a kernel's launch takes."""
        return self.fields.data_ptr(), self.flag.data_ptr(), self.number


class AttentionCall(NamedTuple):
    """q (B, H, Sq, D), k (B, H, Skv, D), v (B, H, Skv, Dv): validated views in SDPA's layout, one dtype and
    device; ``policy`` and ``scale`` (the softmax scale) resolved. ``qk_transform``: q and k are a layer's raw
    projections, which a backend with ``fuses_qk_transform`` normalises and rotates itself (None: q and k are
    the attention's). ``key_mask``: bool (B, Skv), True for the keys each batch element attends to (None: all;
    docs/numerics.md section 6, "Key masks"). ``record``: the range record's slot of an eager kernel call
    (``RecordSlot``), None where nothing is recorded;
    ``record_site``: under torch.compile, the call's site (``range_record.call_site``), which the backend's op
    takes instead. A NamedTuple: immutable, cheap to build on every call, and traced by torch.compile."""

    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    policy: Policy
    scale: float
    qk_transform: QKTransform | None = None
    key_mask: torch.Tensor | None = None
    record: RecordSlot | None = None
    record_site: int = 0


def sdpa_mask_shape_reason(mask: torch.Tensor, q: torch.Tensor, k: torch.Tensor) -> str | None:
    """Why ``mask`` is no SDPA attention mask of (B, H, S, D) ``q`` and ``k`` by its shape (None: it broadcasts
    to (B, H, Sq, Skv))."""
    b, h, sq, skv = q.shape[0], q.shape[1], q.shape[2], k.shape[2]
    if mask.dim() > 4 or any(n not in (1, full) for n, full in zip(mask.shape[::-1], (skv, sq, h, b))):
        return f"an attention mask of shape {shape_text(mask)} for {b}x{h}x{sq}x{skv} attention"
    return None


def broadcast_key_mask(mask, q: torch.Tensor, k: torch.Tensor, layout: str = "bhsd"
                       ) -> tuple[torch.Tensor | None, str | None]:
    """The one translation of an SDPA-form attention mask into ``attention``'s key mask: ``(key_mask, None)`` for
    a mask of ``q`` and ``k`` that is one bool per batch element and key, broadcast over heads and queries (those
    dims of size 1, or of stride 0: an expanded view), with ``key_mask`` its bool (B, Skv) view; ``(None,
    reason)`` naming the form of any other mask (an additive bias, a per-head or per-query mask). Reads dtype,
    shape and strides only: no host synchronisation, and the same answer eager and under torch.compile. The
    patchers translate their libraries' masks through it (``fp4vis.patching.masks``)."""
    if not isinstance(mask, torch.Tensor):
        return None, f"an attention mask of type {type(mask).__name__}"
    if layout == "bshd":
        q, k = q.transpose(1, 2), k.transpose(1, 2)
    b, skv = q.shape[0], k.shape[2]
    if mask.dtype != torch.bool:
        form = ("an additive attention mask (a float bias on the logits)" if mask.is_floating_point()
                else f"an attention mask of dtype {mask.dtype}")
        return None, f"{form} of shape {shape_text(mask)} (fp4vis.attention takes bool key-padding masks)"
    reason = sdpa_mask_shape_reason(mask, q, k)
    if reason is not None:
        return None, reason
    m4 = mask.view((1,) * (4 - mask.dim()) + tuple(mask.shape))
    varies = [what for dim, what in ((1, "head"), (2, "query")) if m4.shape[dim] > 1 and m4.stride(dim) != 0]
    if varies:
        return None, (f"an attention mask that varies per {' and per '.join(varies)}, of shape {shape_text(mask)} "
                      "(fp4vis.attention takes key-padding masks: one value per batch element and key)")
    return m4[:, 0, 0, :].expand(b, skv), None


def shape_text(t: torch.Tensor) -> str:
    """A tensor's shape as the mask messages write it: ``2x1x1x7``."""
    return "x".join(str(n) for n in t.shape)


def validated_call(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, policy: str | Policy, *,
                   scale: float | None = None, layout: Layout = "bhsd", qk_transform: QKTransform | None = None,
                   key_mask: torch.Tensor | None = None) -> AttentionCall:
    """The call that ``attention``'s arguments describe, checked as ``attention`` checks them (its errors): q, k,
    v as views in SDPA's layout, the policy and the scale resolved, the key mask as bool (B, Skv). A patched
    layer builds its call here too (``fp4vis.patching.layer.LayerState.select``)."""
    pol = get_policy(policy)
    if layout not in ("bhsd", "bshd"):
        raise ValueError(f"layout: must be 'bhsd' or 'bshd', got {layout!r}")
    _validate(q, k, v, layout)
    if scale is None:
        scale = default_scale(q.shape[-1])
    elif isinstance(scale, bool) or not isinstance(scale, numbers.Real) or not (math.isfinite(scale) and scale > 0):
        raise ValueError(f"scale: must be a finite positive number, got {scale!r}")
    if qk_transform is not None and not isinstance(qk_transform, QKTransform):
        raise TypeError(f"qk_transform: expected a QKTransform, got {type(qk_transform).__name__}")
    if key_mask is not None:
        key_mask = checked_key_mask(key_mask, q, k, layout)
    if layout == "bshd":
        q, k, v = (t.transpose(1, 2) for t in (q, k, v))
    return AttentionCall(q, k, v, pol, float(scale), qk_transform, key_mask)


def _validate(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layout: str) -> None:
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name}: expected a torch.Tensor, got {type(t).__name__}")
        if t.is_meta:
            raise ValueError(f"{name}: is a meta tensor (no data); attention needs real tensors")
        if t.dtype not in SUPPORTED_DTYPES:
            raise TypeError(f"{name}: dtype {t.dtype} is not supported; use bfloat16, float16 or float32")
        if t.dim() != 4:
            raise ValueError(f"{name}: expected a 4-D tensor in layout {layout!r}, got shape {tuple(t.shape)}")
        if t.device != q.device:
            raise ValueError(f"{name}: on {t.device}, but q is on {q.device}")
        if t.dtype != q.dtype:
            raise TypeError(f"{name}: dtype {t.dtype} differs from q's {q.dtype}")
    seq_dim, head_dim = (2, 1) if layout == "bhsd" else (1, 2)
    if not (q.shape[0] == k.shape[0] == v.shape[0]):
        raise ValueError(f"batch sizes differ: q {q.shape[0]}, k {k.shape[0]}, v {v.shape[0]}")
    if not (q.shape[head_dim] == k.shape[head_dim] == v.shape[head_dim]):
        raise ValueError(f"head counts differ: q {q.shape[head_dim]}, k {k.shape[head_dim]}, "
                         f"v {v.shape[head_dim]} (grouped-query attention is not supported: repeat k and v)")
    if q.shape[-1] != k.shape[-1]:
        raise ValueError(f"head dims differ: q {q.shape[-1]}, k {k.shape[-1]}")
    if k.shape[seq_dim] != v.shape[seq_dim]:
        raise ValueError(f"k and v sequence lengths differ: {k.shape[seq_dim]} vs {v.shape[seq_dim]}")
    if k.shape[seq_dim] == 0:
        raise ValueError("k: has no keys (sequence length 0)")
    if q.shape[-1] == 0 or v.shape[-1] == 0:
        raise ValueError("q/v: head dim is 0")


def checked_key_mask(mask, q: torch.Tensor, k: torch.Tensor, layout: str) -> torch.Tensor:
    """``attention``'s ``key_mask``, (B, Skv) or (B, 1, 1, Skv), as the bool (B, Skv) key-padding mask, checked
    (docs/numerics.md section 6, "Key masks"); a patcher's mask comes here in that form
    (``broadcast_key_mask``)."""
    if not isinstance(mask, torch.Tensor):
        raise TypeError(f"key_mask: expected a bool tensor, got {type(mask).__name__}")
    if mask.dtype != torch.bool:
        raise TypeError(f"key_mask: dtype {mask.dtype}; only a bool key-padding mask is supported (True: attend), "
                        "not an additive or float mask")
    if mask.device != q.device:
        raise ValueError(f"key_mask: on {mask.device}, but q is on {q.device}")
    b, skv = q.shape[0], k.shape[2 if layout == "bhsd" else 1]
    if mask.dim() == 4 and mask.shape[1] == 1 and mask.shape[2] == 1:
        mask = mask[:, 0, 0]
    if tuple(mask.shape) != (b, skv):
        raise ValueError(f"key_mask: expected shape (B, Skv) = ({b}, {skv}) or ({b}, 1, 1, {skv}), got "
                         f"{tuple(mask.shape)} (only key-padding masks: one per batch element and key)")
    # not while compiling nor in CUDA-graph capture (fp4vis.attention's docstring; range_record.capturing, which
    # sits above this module)
    if not (torch.compiler.is_compiling() or (torch.cuda.is_available() and torch.cuda.is_current_stream_capturing())):
        check_key_mask_keeps_keys(mask)
    return mask


def default_scale(head_dim: int) -> float:
    """The softmax scale ``attention`` takes when none is given, ``1/sqrt(D)``. One expression for every
    caller that must give the same bits (``D ** -0.5`` differs in the last bit for some D, e.g. 128)."""
    return 1.0 / math.sqrt(head_dim)
