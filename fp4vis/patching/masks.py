"""The attention masks a patched layer may be handed, sorted into what ``fp4vis.attention`` can compute.

``fp4vis.attention`` takes no mask but a key-padding mask (``key_mask``: bool (B, Skv), True for the keys each
batch element attends to). A library hands its attention masks in SDPA's form instead: a bool tensor (True
attends) or a float one added to the logits, broadcast to (B, H, Sq, Skv). ``key_padding_mask`` tells which of
them only remove keys, the same for every head and query of a batch element, and returns that key mask; any
other mask (a causal or per-query mask, a per-head one, an additive bias such as a relative position bias, a
mask that removes every key of a batch element) comes back as the reason the layer keeps exact attention.

A bool mask broadcast over heads and queries (sizes 1 or stride 0) is one by its shape alone
(``fp4vis.call.broadcast_key_mask``, the one translation into the key mask: no host synchronisation, the same
under torch.compile). transformers hands its masks materialised instead, (B, 1, Sq, Skv), bool (sdpa) or 0 /
-inf-like floats (eager): those are told apart by their values, one host synchronisation that the layers of one
forward share (they are handed the same mask tensor; under torch.inference_mode, whose tensors have no version
counter to show an in-place change, one per layer). Under torch.compile the values are not known while tracing, so
such a mask keeps exact attention."""

from __future__ import annotations

import weakref

import torch

from fp4vis.call import broadcast_key_mask, sdpa_mask_shape_reason, shape_text

__all__ = ["key_padding_mask"]

# the last mask classified by its values: (weak reference to it, its version, the shapes asked for, the answer)
_LAST: list = [None, -1, None, None]


def key_padding_mask(mask, q: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor | None, str | None]:
    """``(key_mask, None)`` for an SDPA-form ``mask`` that is a key-padding mask of (B, H, S, D) ``q`` and ``k``
    (``key_mask`` None when the values show it removes no key), ``(None, reason)`` for any other mask."""
    if mask is None:
        return None, None
    key_mask, structural_reason = broadcast_key_mask(mask, q, k)
    if key_mask is not None:
        return key_mask, None
    if not isinstance(mask, torch.Tensor):
        return None, structural_reason
    shape_reason = sdpa_mask_shape_reason(mask, q, k)
    if shape_reason is not None:
        return None, shape_reason
    b, skv = q.shape[0], k.shape[2]
    if mask.dtype != torch.bool and not mask.is_floating_point():
        return None, f"an attention mask of dtype {mask.dtype} (SDPA takes bool or float masks)"
    m4 = mask.reshape((1,) * (4 - mask.dim()) + tuple(mask.shape))
    if m4.shape[1] > 1 and m4.stride(1) != 0:
        kind = "a per-head attention bias" if mask.is_floating_point() else "a per-head attention mask"
        return None, f"{kind} of shape {shape_text(mask)} (such as a relative position bias; fp4vis.attention takes " \
                     "key-padding masks only)"
    if torch.compiler.is_compiling():
        return None, f"{structural_reason}; under torch.compile a mask's values cannot show it is a key-padding mask"
    if mask.is_inference():   # no version counter: an in-place change would go unseen, so no reuse
        return _classify(m4, b, skv)
    key = (m4.shape, b, skv, q.device)
    if _LAST[0] is not None and _LAST[0]() is mask and _LAST[1] == mask._version and _LAST[2] == key:
        return _LAST[3]
    answer = _classify(m4, b, skv)
    _LAST[:] = [weakref.ref(mask), mask._version, key, answer]
    return answer


def _classify(m4: torch.Tensor, b: int, skv: int) -> tuple[torch.Tensor | None, str | None]:
    if m4.dtype == torch.bool:
        keep, values_ok = m4, torch.ones((), dtype=torch.bool, device=m4.device)
    else:   # additive: 0 keeps a key, -inf (or the dtype's lowest value, transformers' eager form) removes it
        keep = m4 == 0
        values_ok = (keep | (m4 <= torch.finfo(m4.dtype).min)).all()
    rows = keep[:, :1, :1, :]
    same_rows = (keep == rows).all()
    key_mask = rows[:, 0, 0, :].expand(b, skv)
    kept = key_mask.any(-1)
    values_ok, same_rows, removes_none, keeps_some = torch.stack(
        [values_ok, same_rows, key_mask.all(), kept.all()]).tolist()   # one synchronisation
    if not values_ok:
        return None, (f"an additive attention bias of shape {shape_text(m4)} (values other than 0 and -inf, such as a "
                      "position bias; fp4vis.attention takes key-padding masks only)")
    if not same_rows:
        return None, (f"an attention mask of shape {shape_text(m4)} that differs between queries or heads (causal or "
                      "per-query; fp4vis.attention takes key-padding masks only)")
    if not keeps_some:
        first = int((~kept).nonzero()[0, 0])
        return None, f"an attention mask that removes every key of batch element {first}"
    return (None if removes_none else key_mask.contiguous()), None

