"""One patched attention layer: what a patcher reaches (``LayerSpec``), what the layer consults on
every call (``LayerState``), and the rules for when it keeps the model's exact attention
(``fallback_reason``: one ``FallbackWarning`` per layer and reason, ``FallbackError`` with
``strict=True``). The patchers (``fp4vis.patching.patchers``) build on this module.

Masks: ``fp4vis.attention`` takes one form, the key-padding mask (``key_mask``: bool (B, Skv), True for the keys
each batch element attends to). ``broadcast_key_mask`` recognises it in SDPA's mask argument from the mask's shape
and strides alone (one bool per batch element and key, broadcast over heads and queries), so that the decision
needs no host synchronisation and traces under torch.compile; any other form comes back as the reason the layer
keeps exact attention. A patcher hands the key mask it passes to ``LayerState.select`` (the backend check sees
it: a kernel without masks keeps the layer exact) and to ``LayerState.attention``; a mask a patcher cannot hand
over goes to ``select(mask=...)``, which always keeps exact attention."""

from __future__ import annotations

import contextlib
import functools
import warnings
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch

from fp4vis.backends import range_record, registry
from fp4vis.call import AttentionCall
from fp4vis.policy import Policy, get_policy
from fp4vis.tracing import warn_once

#: policy values that mean "keep the model's own exact attention"
EXACT_NAMES = ("exact", "bf16", "none")
#: the attribute of a patched module that holds its LayerState
STATE_ATTR = "_fp4vis_state"


class FallbackWarning(UserWarning):
    """A patched layer keeps exact attention for a reason named in the message."""


class FallbackError(RuntimeError):
    """Raised instead of :class:`FallbackWarning` when ``strict=True``."""


@dataclass(eq=False)
class LayerSpec:
    """One attention layer a patcher can reach."""

    name: str               # qualified name relative to the object given to patch()
    module: torch.nn.Module
    index: int              # position within its stack (the block index)
    group: str              # "self" | "joint" | "cross" | "text" (diffusers), "encoder" | "decoder" (MAE), ...
    default: bool           # patched by the base policy without being named
    patcher: str            # the patcher's name in fp4vis.patching.patchers.PATCHERS
    num_heads: int
    head_dim: int
    component: str = ""     # pipeline component ("transformer", "transformer_2") or ""
    local_name: str = ""    # name inside its component
    stack: str | None = None   # the block list it is in ("transformer_blocks"); None: its index is unique


def block_position(name: str) -> tuple[str, int] | None:
    """``(stack, index)`` of a layer named like ``"transformer_blocks.3.attn"``: the path of the block list and
    the block's position in it (the last all-digit part of the name); None for a name without one."""
    parts = name.split(".")
    for i in range(len(parts) - 1, -1, -1):
        if parts[i].isdigit():
            return ".".join(parts[:i]), int(parts[i])
    return None


def resolve_policy(value: Any) -> Policy | None:
    """A ``layers`` value or base policy -> Policy, or None for the model's own exact attention."""
    if value is None:
        return None
    if isinstance(value, str) and value.lower() in EXACT_NAMES:
        return None
    pol = get_policy(value)
    return None if pol.method == "exact" else pol


UNSET = object()  # "no override" (None already means exact attention)


class LayerState:
    """What a patched layer consults on every call. Patchers call :meth:`select` with the layer's
    q, k, v and then either :meth:`attention` (a Policy came back) or their exact path (None)."""

    def __init__(self, spec: LayerSpec, policy: Policy | None, *, backend: str, range_check: str,
                 strict: bool, handle: Any):
        self.name = spec.name
        self.index = spec.index
        self.group = spec.group
        self.policy = policy
        self.backend = backend
        self.range_check = range_check
        self.strict = strict
        self.override: Any = UNSET       # a per-step override: Policy, None (exact) or UNSET
        self.recorder: Callable | None = None   # calibration: recorder(state, q, k, scale, layout)
        self.auto: Any = None             # guard="auto": an object with .decide(state, q, k, scale, layout)
        self.warned: set[str] = set()
        self.calls = 0                    # eager FP4 calls (for tests and summaries)
        self.fallbacks = 0
        # a strong reference: the patched module keeps its handle alive, so that unpatch(model)
        # finds it even when the caller dropped the handle
        self.handle = handle

    def active_policy(self) -> Policy | None:
        return self.policy if self.override is UNSET else self.override

    def needs_qkv(self) -> bool:
        """False when the layer would run the model's exact attention untouched."""
        return self.active_policy() is not None or self.recorder is not None or self.auto is not None

    def select(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, layout: str = "bhsd",
               scale: float | None = None, mask: Any = None, dropout_p: float = 0.0,
               is_causal: bool = False, extra_reason: str | None = None,
               key_mask: torch.Tensor | None = None) -> Policy | None:
        """Record calibration statistics, then return the policy for this call or None (exact). ``key_mask``: the
        bool (B, Skv) key-padding mask the patcher will hand to :meth:`attention`; ``mask``: one it cannot hand
        over (the call keeps exact attention)."""
        if self.recorder is not None:
            self.recorder(self, q, k, scale, layout)
        if self.auto is not None:
            self.auto.decide(self, q, k, scale, layout)
        pol = self.active_policy()
        if pol is None:
            return None
        reason = extra_reason or call_reason(q, k, v, layout=layout, mask=mask, dropout_p=dropout_p,
                                             is_causal=is_causal) or kernel_reason(
            q, k, v, pol, layout=layout, scale=scale, backend=self.backend, key_mask=key_mask)
        if reason is not None:
            self.fallback(reason)
            return None
        return pol

    def fallback(self, reason: str) -> None:
        msg = f"fp4vis: layer {self.name!r} keeps exact attention: {reason}"
        if self.strict:
            raise FallbackError(msg + " (strict=True)")
        if torch.compiler.is_compiling():   # no per-call state in a graph; the warning issued while tracing
            warn_once(("fallback", self.name, reason), msg, FallbackWarning)
            return
        self.fallbacks += 1
        if reason not in self.warned:
            self.warned.add(reason)
            warnings.warn(msg, FallbackWarning, stacklevel=3)

    def attention(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, policy: Policy, *,
                  layout: str = "bhsd", scale: float | None = None, qk_transform: Any = None,
                  key_mask: torch.Tensor | None = None) -> torch.Tensor:
        """``fp4vis.attention`` with the layer's backend and range check, labelled with the layer's name;
        ``qk_transform``: q and k are raw projections, ``key_mask``: a bool (B, Skv) key-padding mask
        (``fp4vis.attention``'s arguments).

        Under torch.compile the call is neither counted nor labelled: the graph would hold the count and
        the name as constants, so every layer would need a graph of its own, where diffusers' regional
        compilation (``compile_repeated_blocks``) shares one among the blocks. Its errors come from the
        backend's op at run time and name the call, not the layer (docs/patching.md)."""
        from fp4vis.attention import attention as fp4_attention
        call = functools.partial(fp4_attention, q, k, v, policy=policy, scale=scale, layout=layout,
                                 backend=self.backend, range_check=self.range_check, qk_transform=qk_transform,
                                 key_mask=key_mask)
        if torch.compiler.is_compiling():
            return call()
        with self.fp4_call():
            return call()

    @contextlib.contextmanager
    def fp4_call(self) -> Iterator[None]:
        """One eager FP4 call of this layer (counted); errors raised in it (range, bad input) start with the
        layer's name: a model has dozens. An earlier call's deferred range error passes unchanged: its
        message names that call's layer. ``attention`` and the context-parallel paths run inside it."""
        from fp4vis.attention import RangeExceededError
        self.calls += 1
        try:
            with range_record.layer_scope(self.name):   # the record names this layer in the call's errors
                yield
        except (range_record.DeferredRangeError, range_record.DeferredInputError):
            raise
        except (RangeExceededError, ValueError, RuntimeError) as exc:
            exc.args = (range_record.labelled(exc.args[0] if exc.args else str(exc), self.name), *exc.args[1:])
            raise

    def __reduce_ex__(self, protocol):
        # a patched layer holds hooks into its library (processors, bound forwards, the handle): copying
        # or pickling them would give a model whose patch no handle can remove
        raise TypeError(f"fp4vis: layer {self.name!r} is patched; copy.deepcopy, pickle and torch.save of a "
                        "patched model are not supported: remove the patch first (handle.remove() or "
                        "fp4vis.unpatch(model)), then copy or save, and patch again")

    def __repr__(self) -> str:
        pol = self.active_policy()
        return f"LayerState({self.name!r}, index={self.index}, policy={pol.name if pol else 'exact'})"


def _to_bhsd(t: torch.Tensor, layout: str) -> torch.Tensor:
    return t if layout == "bhsd" else t.transpose(1, 2)


def _shape_text(t: torch.Tensor) -> str:
    return "x".join(str(n) for n in t.shape)


def broadcast_key_mask(mask: Any, q: torch.Tensor, k: torch.Tensor, layout: str = "bhsd"
                       ) -> tuple[torch.Tensor | None, str | None]:
    """``(key_mask, None)`` for an SDPA-form attention mask of ``q`` and ``k`` that is one bool per batch
    element and key, broadcast over heads and queries (those dims of size 1, or of stride 0: an expanded view),
    with ``key_mask`` its bool (B, Skv) view; ``(None, reason)`` naming the form of any other mask (an additive
    bias, a per-head or per-query mask). Reads dtype, shape and strides only: no host synchronisation, and the
    same answer eager and under torch.compile."""
    if not isinstance(mask, torch.Tensor):
        return None, f"an attention mask of type {type(mask).__name__}"
    qb, kb = _to_bhsd(q, layout), _to_bhsd(k, layout)
    b, h, sq, skv = qb.shape[0], qb.shape[1], qb.shape[2], kb.shape[2]
    shape = _shape_text(mask)
    if mask.dtype != torch.bool:
        form = ("an additive attention mask (a float bias on the logits)" if mask.is_floating_point()
                else f"an attention mask of dtype {mask.dtype}")
        return None, f"{form} of shape {shape} (fp4vis.attention takes bool key-padding masks)"
    if mask.dim() > 4 or any(n not in (1, full) for n, full in zip(mask.shape[::-1], (skv, sq, h, b))):
        return None, f"an attention mask of shape {shape} for {b}x{h}x{sq}x{skv} attention"
    m4 = mask.view((1,) * (4 - mask.dim()) + tuple(mask.shape))
    varies = [what for dim, what in ((1, "head"), (2, "query")) if m4.shape[dim] > 1 and m4.stride(dim) != 0]
    if varies:
        return None, (f"an attention mask that varies per {' and per '.join(varies)}, of shape {shape} "
                      "(fp4vis.attention takes key-padding masks: one value per batch element and key)")
    return m4[:, 0, 0, :].expand(b, skv), None


def fallback_reason(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, policy: Policy, *, layout: str,
                    scale: float | None, mask: Any = None, dropout_p: float = 0.0, is_causal: bool = False,
                    backend: str = "auto") -> str | None:
    """Why fp4vis cannot compute this call (None when it can): ``call_reason``, then ``kernel_reason``.
    ``mask``: a mask the patcher cannot hand to ``fp4vis.attention``."""
    return call_reason(q, k, v, layout=layout, mask=mask, dropout_p=dropout_p, is_causal=is_causal) or \
        kernel_reason(q, k, v, policy, layout=layout, scale=scale, backend=backend)


def call_reason(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, layout: str, mask: Any = None,
                dropout_p: float = 0.0, is_causal: bool = False) -> str | None:
    """Why no fp4vis policy computes this call, whatever the backend (None when one can)."""
    if mask is not None:
        return "attention mask given (this layer's patcher hands fp4vis.attention no mask)"
    if is_causal:
        return "causal attention (fp4vis.attention is non-causal)"
    if dropout_p and dropout_p > 0:
        return f"attention dropout p={dropout_p:g} in training mode"
    if torch.is_grad_enabled() and (q.requires_grad or k.requires_grad or v.requires_grad):
        return "gradients requested (FP4 attention has no gradient; the model's attention keeps its own)"
    qb, kb, vb = (_to_bhsd(t, layout) for t in (q, k, v))
    if qb.shape[1] != kb.shape[1] or kb.shape[1] != vb.shape[1]:
        return (f"grouped-query attention ({qb.shape[1]} query heads, {kb.shape[1]} key heads, "
                f"{vb.shape[1]} value heads)")
    if qb.shape[-1] != kb.shape[-1]:
        return f"query and key head dims differ (q {qb.shape[-1]}, k {kb.shape[-1]})"
    if any(t.dtype not in (torch.float16, torch.bfloat16, torch.float32) or t.dtype != q.dtype for t in (q, k, v)):
        return f"dtypes {q.dtype}/{k.dtype}/{v.dtype} (fp4vis takes one of float16, bfloat16, float32)"
    return None


def kernel_reason(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, policy: Policy, *, layout: str,
                  scale: float | None, backend: str = "auto", key_mask: torch.Tensor | None = None) -> str | None:
    """Why the layer's backend cannot run ``policy`` on this call (``backend_reason``; only the kernels' policies
    are asked), ``key_mask`` included: the bool (B, Skv) key-padding mask the patcher will hand over."""
    if policy.method != "exact":
        qb, kb, vb = (_to_bhsd(t, layout) for t in (q, k, v))
        return backend_reason(qb, kb, vb, policy, scale, backend, key_mask)
    return None


def backend_reason(q, k, v, policy, scale, backend: str, key_mask: torch.Tensor | None = None) -> str | None:
    """Ask the backend registry whether the backend can run these bhsd tensors.

    An explicit backend must support the call. With ``"auto"`` the question goes to the kernel that
    ``fp4vis.backends.registry`` would pick for this GPU: when that kernel lacks the call (a head dim, a
    dtype), the layer keeps exact attention rather than dropping to the slow reference emulation.
    Without a kernel for the device (CPU, other GPUs) auto means the reference, which runs anything.
    """
    if backend == "auto":
        name = registry.kernel_backend_name(q.device)
        if name is None or registry.get_backend(name) is None:
            return None  # the dispatcher uses the reference and says so
    else:
        name = backend
    try:
        be = registry.get_backend(name)
    except Exception as exc:  # noqa: BLE001 - report any lookup problem as the reason
        return f"backend {name!r} unavailable ({exc})"
    if be is None:
        return f"backend {name!r} unavailable"
    try:
        return be.supports(AttentionCall(q, k, v, policy, scale if scale is not None else q.shape[-1] ** -0.5,
                                         key_mask=key_mask))
    except Exception as exc:  # noqa: BLE001
        return f"backend {name!r} cannot check these inputs ({exc})"
