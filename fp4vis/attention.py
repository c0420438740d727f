"""``fp4vis.attention``: the public entry point. It validates its arguments into one ``AttentionCall``
(``fp4vis.call.validated_call``), picks a backend (``fp4vis.backends.registry``) and runs the call there
(``run_call``: the q/k transform, the range record or check), which a patched layer enters too after its own
checks; the numerics live in the backends."""

from __future__ import annotations

from typing import Literal

import torch

from fp4vis.backends import range_record
from fp4vis.backends.registry import Backend, select_backend
from fp4vis.call import AttentionCall, Layout, default_scale, validated_call
from fp4vis.policy import Policy
from fp4vis.qk_transform import QKTransform
from fp4vis.range_report import RangeExceededError, enforce_range
from fp4vis.tracing import warn_once

RangeCheck = Literal["raise", "warn", "off"]


# default_scale and validated_call: fp4vis.call's, named here too as the entry point's own
__all__ = ["RangeExceededError", "attention", "check_range", "default_scale", "run_call", "validated_call"]


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
    if range_check not in ("raise", "warn", "off"):
        raise ValueError(f"range_check: must be 'raise', 'warn' or 'off', got {range_check!r}")
    if not isinstance(backend, str):
        raise TypeError(f"backend: expected a name, got {type(backend).__name__}")
    call = validated_call(q, k, v, policy, scale=scale, layout=layout, qk_transform=qk_transform, key_mask=key_mask)
    pol = call.policy
    grad = torch.is_grad_enabled() and (q.requires_grad or k.requires_grad or v.requires_grad)
    if call.qk_transform is not None and (pol.method == "exact" or grad):
        call = _transform_applied(call)
    if call.q.numel() == 0:
        return _no_queries_output(call, layout)
    grad_inputs = None
    if pol.method != "exact" and grad:
        _warn_straight_through(pol)
        grad_inputs = (call.q, call.k, call.v)
        call = call._replace(q=call.q.detach(), k=call.k.detach(), v=call.v.detach())
    out = run_call(call, select_backend(backend, call), range_check=range_check, layout=layout, given=(q, k, v),
                   stacklevel=3)
    if grad_inputs is not None:
        mask = None if call.key_mask is None else call.key_mask[:, None, None, :]
        exact = torch.nn.functional.scaled_dot_product_attention(*grad_inputs, attn_mask=mask, scale=call.scale)
        gradient = exact - exact.detach()
        out = out + (gradient.transpose(1, 2) if layout == "bshd" else gradient)
    return out


def run_call(call: AttentionCall, backend: Backend, *, range_check: RangeCheck, layout: Layout,
             given: tuple[torch.Tensor, torch.Tensor, torch.Tensor], stacklevel: int = 2) -> torch.Tensor:
    """A validated call (``validated_call``) on the backend chosen for it, the output in ``layout``: the q/k
    transform applied first where the backend does not fuse it, the range recorded or checked (``range_check``).
    ``fp4vis.attention`` enters the backend here after its own checks, a patched layer after its
    (``LayerState.attention``): each call is checked and its backend asked once. ``given``: q, k, v as the caller
    holds them (a later range error names them while they live); ``stacklevel``: a range warning's, as
    ``warnings.warn`` counts it from the caller."""
    if call.q.numel() == 0:
        return _no_queries_output(call, layout)
    if call.qk_transform is not None and not backend.fuses_qk_transform:
        call = _transform_applied(call)
    pol = call.policy
    checked = range_check != "off"
    if torch.compiler.is_compiling():
        # every backend's op reports the call's range itself, at run time (range_record: call sites)
        call = call._replace(record_site=range_record.call_site(backend.name, pol, range_check, layout))
        checked = False
    elif backend.records_range and checked:
        # the record works in CUDA-graph capture too: a replay reports as the captured call
        # the layer the call belongs to (a patched layer's ``range_record.layer_scope``) is named in its errors
        call = call._replace(record=range_record.record_for(call.q.device).start_call(
            backend.name, pol, range_check, layout, given, range_record.current_layer()))
        checked = False   # reported by the record
    else:
        checked = checked and not range_record.capturing()
    out, report = backend.run(call)
    if report is None and checked:
        _check_kernel_output(out, call.q, call.k, call.v, backend.name)
    enforce_range(report, pol, range_check, stacklevel=stacklevel)
    return out.transpose(1, 2) if layout == "bshd" else out


def _transform_applied(call: AttentionCall) -> AttentionCall:
    """The call with its q/k transform applied (q and k the attention's)."""
    q, k = call.qk_transform.apply(call.q, call.k, "bhsd")
    return call._replace(q=q, k=k, qk_transform=None)


def _no_queries_output(call: AttentionCall, layout: str) -> torch.Tensor:
    """No batch, heads or queries: nothing to attend (as SDPA)."""
    out = call.q.new_empty(*call.q.shape[:-1], call.v.shape[-1])
    return out.transpose(1, 2) if layout == "bshd" else out
