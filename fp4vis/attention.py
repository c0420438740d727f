"""``fp4vis.attention``: the public entry point. It validates, normalises the layout, picks a
backend (``fp4vis.backends.registry``) and enforces the range check; the numerics live in the backends."""

from __future__ import annotations

import math
import numbers
from typing import Literal

import torch

from fp4vis.backends import range_record
from fp4vis.backends.registry import select_backend
from fp4vis.call import AttentionCall
from fp4vis.policy import Policy, get_policy
from fp4vis.qk_transform import QKTransform
from fp4vis.range_report import RangeExceededError, enforce_range
from fp4vis.reference import check_key_mask_keeps_keys
from fp4vis.tracing import warn_once

Layout = Literal["bhsd", "bshd"]
RangeCheck = Literal["raise", "warn", "off"]
SUPPORTED_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


__all__ = ["RangeExceededError", "attention", "check_range"]


def check_range() -> None:
    """Wait for the GPU kernels launched so far and raise ``RangeExceededError`` (or warn, for calls
    made with ``range_check="warn"``) for the earliest call that went past its policy's range, or
    ``ValueError`` for one whose q, k or v held NaN or Inf; nothing when none did. The kernels record
    their range on the device and ``fp4vis.attention`` reports it at the next call, a patched model
    at the end of its forward (docs/numerics.md section 8): call this where a program needs the
    answer before then (after its last call, say). No synchronisation when no kernel call was
    recorded since the last check."""
    range_record.check()


def _check_kernel_output(out: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, backend: str) -> None:
    """docs/numerics.md section 6 for kernel backends without the range record,
    with one host synchronisation: the kernels propagate
    NaN/Inf inputs to the output (they never quantize them to finite codes), so a finite output
    means finite inputs; otherwise name the bad input (or report a kernel bug)."""
    if bool(torch.isfinite(out).all()):
        return
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not bool(torch.isfinite(t).all()):
            bad = "NaN" if bool(torch.isnan(t).any()) else "Inf"
            raise ValueError(f"{name}: contains {bad}; attention inputs must be finite")
    raise RuntimeError(f"fp4vis: the {backend} backend produced a non-finite output from finite inputs "
                       "(a bug: please report it with the shapes and policy)")


def _warn_straight_through(policy: Policy) -> None:
    warn_once(("straight-through", policy.name),
              f"fp4vis.attention: policy {policy.name!r} has no gradient of its own; the output is FP4 "
              "attention and its gradient is exact attention's (straight-through)")


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


def attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    policy: str | Policy = "fast",
    scale: float | None = None,
    layout: Layout = "bhsd",
    backend: str = "auto",
    range_check: RangeCheck = "raise",
    qk_transform: QKTransform | None = None,
    key_mask: torch.Tensor | None = None,
) -> torch.Tensor:
    """FP4 attention (non-causal; a key-padding mask as ``key_mask``), SDPA-compatible.

    Args:
        q: (B, H, Sq, D) for ``layout="bhsd"`` (SDPA's), (B, Sq, H, D) for ``"bshd"``.
        k, v: (B, H, Skv, D) / (B, Skv, H, Dv) likewise; Skv may differ from Sq.
        policy: "fast", "wan_fast", "accurate", "guard", the Hopper policies "fp8", "fp8pv", "fast_fp8qk",
            "fast_bf16round", the controls "nv_fp8", "bf16", or a ``Policy``.
        scale: softmax scale; default ``1/sqrt(D)``.
        layout: "bhsd" or "bshd"; the output has the same layout.
        backend: "auto" (the GPU kernel when it supports the call, else the reference, with one
            warning), "reference", "hopper" or "blackwell" (these raise when they cannot run).
        range_check: when a Direct-P policy is driven past its range (saturated P blocks, rows
            that underflow, non-finite output): "raise" RangeExceededError, "warn", or "off".
            The reference reports it from this call. The GPU kernels record it on the device and
            the error comes later, without a host synchronisation per call: at the start of the
            next ``fp4vis.attention`` call, at the end of a patched model's forward, or at
            ``fp4vis.check_range()`` (docs/numerics.md section 8); the message names the call and,
            in a patched model, the layer. "off": no record and no check at all. Under
            torch.compile (``fullgraph=True`` works) the same holds: the backend's op polls and
            records at run time; in CUDA-graph replays only ``fp4vis.check_range()`` or the next
            eager call reads the record.
        qk_transform: q and k are a layer's raw projections and this ``QKTransform`` (RMS norms
            across heads, rotary embedding) makes the attention's q and k from them. A backend that
            fuses it (the Hopper kernel's pre-pass) reads the projections and never writes the
            normed q and k; every other path applies it first (``QKTransform.apply``: the same values).
        key_mask: bool, (B, Skv) or SDPA's broadcast form (B, 1, 1, Skv): True for the keys each batch element
            attends to (a key-padding mask, as diffusers' image and video models pass). A masked key contributes
            nothing: each element's result is, bit for bit, the unmasked call on its kept keys in their order
            (docs/numerics.md section 6, "Key masks"). Other masks (additive, per query) are a TypeError or
            ValueError naming the form. The kernels gather each element's kept keys first, on the device
            (``kernels/kept_keys.py``: CUDA graphs and torch.compile take it). An element that masks every key is
            a ValueError (a host synchronisation; in CUDA-graph capture and compiled calls it is not checked and
            such an element's output rows are 0).

    Returns:
        The attention output, q's dtype, in ``layout``.

    Gradients: only ``policy="bf16"`` is differentiable. For the FP4 policies, when autograd is
    recording and an input requires grad, the output's value is the FP4 attention and its gradient
    is exact attention's (a straight-through estimate), with one warning per policy; a patched
    model keeps the model's own attention for such calls instead (``fp4vis.patch``).

    Non-finite inputs raise ValueError naming the tensor (docs/numerics.md section 6). The reference checks
    them first; the Hopper kernel propagates them to the output (NaN or Inf in q row i gives a NaN
    output row i; in k or v, NaN in that head), its range record counts the non-finite outputs and
    the later check names the tensor where the inputs are still alive then (the Blackwell kernel
    keeps the same record). A backend without the record has its output checked at once (one host
    synchronisation). With
    ``range_check="off"`` and in CUDA-graph capture nothing is checked and the NaNs are returned, as
    SDPA does.
    """
    if not torch.compiler.is_compiling():   # compiled calls poll in their backend's op (range_record)
        range_record.poll()
    pol = get_policy(policy)
    if layout not in ("bhsd", "bshd"):
        raise ValueError(f"layout: must be 'bhsd' or 'bshd', got {layout!r}")
    if range_check not in ("raise", "warn", "off"):
        raise ValueError(f"range_check: must be 'raise', 'warn' or 'off', got {range_check!r}")
    if not isinstance(backend, str):
        raise TypeError(f"backend: expected a name, got {type(backend).__name__}")
    _validate(q, k, v, layout)
    if scale is None:
        scale = default_scale(q.shape[-1])
    elif isinstance(scale, bool) or not isinstance(scale, numbers.Real) or not (math.isfinite(scale) and scale > 0):
        raise ValueError(f"scale: must be a finite positive number, got {scale!r}")
    if qk_transform is not None and not isinstance(qk_transform, QKTransform):
        raise TypeError(f"qk_transform: expected a QKTransform, got {type(qk_transform).__name__}")
    if key_mask is not None:
        key_mask = _key_mask(key_mask, q, k, layout)
    grad = torch.is_grad_enabled() and (q.requires_grad or k.requires_grad or v.requires_grad)
    if qk_transform is not None and (pol.method == "exact" or grad):
        q, k = qk_transform.apply(q, k, layout)
        qk_transform = None
    given = (q, k, v)
    if layout == "bshd":
        q, k, v = (t.transpose(1, 2) for t in (q, k, v))
    if q.numel() == 0:  # no batch, heads or queries: nothing to attend (as SDPA)
        out = q.new_empty(*q.shape[:-1], v.shape[-1])
        return out.transpose(1, 2) if layout == "bshd" else out
    grad_inputs = None
    if pol.method != "exact" and grad:
        _warn_straight_through(pol)
        grad_inputs, (q, k, v) = (q, k, v), (q.detach(), k.detach(), v.detach())
    call = AttentionCall(q, k, v, pol, float(scale), qk_transform, key_mask)
    chosen = select_backend(backend, call)
    if qk_transform is not None and not chosen.fuses_qk_transform:
        q_applied, k_applied = qk_transform.apply(q, k, "bhsd")
        call = call._replace(q=q_applied, k=k_applied, qk_transform=None)
    checked = range_check != "off"
    if torch.compiler.is_compiling():
        # every backend's op reports the call's range itself, at run time (range_record: call sites)
        call = call._replace(record_site=range_record.call_site(chosen.name, pol, range_check, layout))
        checked = False
    elif chosen.records_range and checked:
        # the record works in CUDA-graph capture too: a replay reports as the captured call
        # the layer the call belongs to (a patched layer's ``range_record.layer_scope``) is named in its errors
        call = call._replace(record=range_record.record_for(q.device).start_call(
            chosen.name, pol, range_check, layout, given, range_record.current_layer()))
        checked = False   # reported by the record
    else:
        checked = checked and not range_record.capturing()
    out, report = chosen.run(call)
    if grad_inputs is not None:
        mask = None if key_mask is None else key_mask[:, None, None, :]
        exact = torch.nn.functional.scaled_dot_product_attention(*grad_inputs, attn_mask=mask, scale=float(scale))
        out = out + (exact - exact.detach())
    if report is None and checked:
        _check_kernel_output(out, call.q, call.k, call.v, chosen.name)
    enforce_range(report, pol, range_check, stacklevel=2)
    return out.transpose(1, 2) if layout == "bshd" else out


def _key_mask(mask, q: torch.Tensor, k: torch.Tensor, layout: str) -> torch.Tensor:
    """The key mask as a bool (B, Skv) tensor, checked (docs/numerics.md section 6, "Key masks")."""
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
    if not (torch.compiler.is_compiling() or range_record.capturing()):   # (the docstring of ``attention``)
        check_key_mask_keeps_keys(mask)
    return mask


def default_scale(head_dim: int) -> float:
    """The softmax scale ``attention`` takes when none is given, ``1/sqrt(D)``. One expression for every
    caller that must give the same bits (``D ** -0.5`` differs in the last bit for some D, e.g. 128)."""
    return 1.0 / math.sqrt(head_dim)
