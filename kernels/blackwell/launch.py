"""The eager launcher of the Blackwell backend and its self-check gate. ``attention(call)``: the policy's kernel
parameters, the route's ``KernelConfig`` (the serial Triton kernel, or the warp-specialised Gluon one where
``FP4VIS_BLACKWELL_WARP_SPECIALIZED`` asks and the call can take it), the pre-pass (``prepass.kernel_operands``), the
kernel's arguments and the launch on the current CUDA stream. ``ensure_verified(device)``: the first call on a
device runs the self-check (``selfcheck``) and a device whose verdict failed gets ``SelfCheckError``; later calls
look the verdict up.

Compiled kernels are cached per ``KernelConfig.key()`` and device (``KERNELS``: ``kernels/launch_shared.py``);
compile/load times are logged (logger ``fp4vis.kernels.blackwell``) and kept in ``COMPILE_TIMES``.
"""

from __future__ import annotations

import contextvars
import logging

import torch

from fp4vis.call import AttentionCall
from fp4vis.tracing import warn_once

from ..kept_keys import kept_keys
from ..launch_shared import CompiledKernels
from ..scale_record import decide, recorded
from . import cubin as cubin_mod
from . import selfcheck
from .config import WARP_SPECIALIZED_ARCHS, WS_STAGES, WS_WARPS, KernelConfig
from .prepass import kernel_operands
from .route import device_index, identity, route, warp_specialized_asked

log = logging.getLogger("fp4vis.kernels.blackwell")

KERNELS: CompiledKernels = CompiledKernels(log)   # by (KernelConfig.key(), device index)
COMPILE_TIMES = KERNELS.compile_times


# set while the self-check runs a case (``checked_attention``)
_SELF_CHECK: contextvars.ContextVar[bool] = contextvars.ContextVar("fp4vis_blackwell_self_check", default=False)


def product_config(index: int, head_dim: int, dtype: torch.dtype, native: bool, anchored: bool,
                   key_lengths: bool = False) -> KernelConfig:
    """The variant the backend runs for a call on device ``index``: the route's arch, the serial kernel, or the
    warp-specialised one where ``FP4VIS_BLACKWELL_WARP_SPECIALIZED`` asks and the call can take it."""
    r = route(index)
    if isinstance(r, str):
        raise RuntimeError(f"fp4vis blackwell: {r}")
    out = "bf16" if dtype == torch.bfloat16 else "fp16"
    if warp_specialized_asked():
        why = _no_warp_specialized(r[1], native, anchored)
        if why is None:
            return KernelConfig(head_dim, out, native, anchored, r[1], num_warps=WS_WARPS, num_stages=WS_STAGES,
                                key_lengths=key_lengths, schedule="warp_specialized")
        if not _SELF_CHECK.get():
            warn_once(("blackwell-ws-not-taken", why), f"fp4vis blackwell: FP4VIS_BLACKWELL_WARP_SPECIALIZED=1, but "
                      f"{why}: the serial Triton kernel runs")
    return KernelConfig(head_dim, out, native, anchored, r[1], key_lengths=key_lengths)


def _no_warp_specialized(arch: int, native: bool, anchored: bool) -> str | None:
    """Why a call cannot take the warp-specialised kernel, or None."""
    if arch not in WARP_SPECIALIZED_ARCHS:
        return f"this GPU's build is sm_{arch} (the warp-specialised kernel is sm_100a/sm_103a)"
    if native or anchored:
        return "the policy has native positions or an anchored row reference (it serves m = 0, affine codes)"
    return None


def _jit_launcher(cfg: KernelConfig):
    from .kernel import constexprs, direct_p_fwd
    consts = constexprs(cfg)

    def fn(grid, args):
        direct_p_fwd[grid](*args, **consts, num_warps=cfg.num_warps, num_stages=cfg.num_stages)
    return fn


def _launch_serial(base):
    """``base(grid, args)`` (a JIT or cubin launcher of ``kernel.py``) as the backend's launch of operands."""
    from .kernel import grid, runtime_args

    def fn(cfg, ops, out, params, record, key_lengths, heads):
        base(grid(cfg, ops), runtime_args(ops, out, params, record, key_lengths, heads))
    return fn


def _launch_warp_specialized(cfg, ops, out, params, record, key_lengths, heads):
    from . import gluon_ws
    gluon_ws.launch(ops, out, params, record, key_lengths, heads)


def compiled_kernel(index: int, cfg: KernelConfig):
    """The launch ``fn(cfg, ops, out, params, record, key_lengths, heads)`` of ``cfg`` on device ``index``
    (compiled / loaded once; the Gluon kernel compiles at its first launch, not here: its time is that launch's)."""
    def compile_kernel():
        if cfg.warp_specialized:
            return _launch_warp_specialized
        return _launch_serial(cubin_mod.get(cfg) if route(index)[0] == "cubin" else _jit_launcher(cfg))
    return KERNELS.get((cfg.key(), index), compile_kernel,
                       lambda fn: f"fp4vis blackwell: {cfg.tag()} ready via {route(index)[0]}")


def attention(call: AttentionCall, launcher=None) -> torch.Tensor:
    """The eager launcher: ``call`` (validated (B, H, S, D) CUDA views) through the pre-pass and the kernel,
    without the self-check's gate (the self-check runs this). ``launcher(cfg, grid, args)``: another launch of the
    serial kernel (the tests inject Triton's interpreter). The call's ``record``: the kernel adds its range counts
    there and decides on the scale range the pre-pass recorded (``kernels/scale_record.py``; ``decide`` where the
    launch raised)."""
    from .kernel import grid, runtime_args
    q, k, v = call.q, call.k, call.v
    index = device_index(q.device)
    params = call.policy.kernel_params(q.shape[-1], call.scale)
    masked = call.key_mask is not None
    cfg = product_config(index, q.shape[-1], q.dtype, params.native_exp2, params.anchor > 0, masked)
    key_lengths, perm_anchor = None, params.anchor
    if masked:   # kept keys first, already in the anchored order: the pre-pass permutes nothing
        k, v, key_lengths = kept_keys(k, v, call.key_mask, params.anchor)
        perm_anchor = 0
    q, k, v = q.contiguous(), k.contiguous(), v.contiguous()
    b, h = q.shape[:2]
    try:
        ops = kernel_operands(q, k, v, params.qk_layout, perm_anchor, cfg.block_m, cfg.block_n,
                              record=recorded(call.record, call.scale))
        out = torch.empty(b * h, q.shape[-2], v.shape[-1], dtype=q.dtype, device=q.device)
        if launcher is None:
            compiled_kernel(index, cfg)(cfg, ops, out, params, call.record, key_lengths, h)
        else:
            launcher(cfg, grid(cfg, ops), runtime_args(ops, out, params, call.record, key_lengths, h))
    except BaseException:
        decide(call.record)   # no kernel decided on the pre-pass's scale range: its words must not reach the next call
        raise
    return out.unflatten(0, (b, h))


def checked_attention(q, k, v, policy, scale, key_mask=None, record=None):
    """What the self-check runs: ``attention`` of plain tensors (its warp-specialised cases add a key mask or a
    record). Its cases of other policies say nothing about the user's calls: no fallback warning from them."""
    token = _SELF_CHECK.set(True)
    try:
        return attention(AttentionCall(q, k, v, policy, float(scale), key_mask=key_mask, record=record))
    finally:
        _SELF_CHECK.reset(token)


def verdict(device: torch.device, force: bool = False, shape=None, timer=None) -> dict:
    """The self-check's verdict on ``device`` (run now where ``force`` or where none is kept) on
    ``checked_attention``. A passing verdict without first-use figures gets them
    (``first_use.measure``: ``shape``, the ``first_use.CallShape`` of the call that asked, and the Wan shape;
    ``timer``: the tests' fake in place of CUDA events)."""
    from . import first_use

    fn, ident = checked_attention, identity(device)
    return selfcheck.verdict_for(ident, fn, device, force=force,
                                 measure=lambda: first_use.measure(device, ident, fn, shape, timer))


def ensure_verified(device: torch.device, shape=None, timer=None) -> dict:
    """``verdict``, raising ``SelfCheckError`` where it failed; where FP4 was measured slower than BF16 on this GPU,
    one warning per process and identity (``first_use.warn_if_slower``)."""
    from . import first_use

    v = verdict(device, shape=shape, timer=timer)
    if not v["passed"]:
        selfcheck.raise_failed(v)
    first_use.warn_if_slower(v)
    return v
