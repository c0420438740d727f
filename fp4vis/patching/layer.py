"""One patched attention layer: what a patcher reaches (``LayerSpec``), what the layer consults on
every call (``LayerState``), and the rules for when it keeps the model's exact attention (``call_reason``,
then the backend's answer: one ``FallbackWarning`` per layer and reason, ``FallbackError`` with ``strict=True``). The
patchers (``fp4vis.patching.patchers``) build on this module.

One FP4 call of a layer is checked once: ``LayerState.select`` builds its ``AttentionCall``
(``fp4vis.call.validated_call``, the checks of ``fp4vis.attention``) and asks the layer's backend once
whether it runs it; ``LayerState.attention`` runs that call through ``fp4vis.attention.run_call``, the entry
``fp4vis.attention`` itself runs its calls through.

Masks: ``fp4vis.attention`` takes one form, the key-padding mask (``key_mask``: bool (B, Skv), True for the keys
each batch element attends to); ``fp4vis.call.broadcast_key_mask`` translates SDPA's mask argument into it
(``fp4vis.patching.masks``: the forms known only by their values). A patcher hands the key mask to
``LayerState.select`` (the backend check sees it: a kernel without masks keeps the layer exact), and the reason
a mask it cannot hand over keeps exact attention as ``extra_reason``."""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any, NamedTuple

import torch

from fp4vis.attention import RangeExceededError, run_call
from fp4vis.backends import range_record, registry
from fp4vis.backends.base import Backend
from fp4vis.call import AttentionCall, validated_call
from fp4vis.policy import Policy, get_policy
from fp4vis.qk_transform import QKTransform
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


class LayerCall(NamedTuple):
    """One FP4 call of a patched layer as ``LayerState.select`` decided it: the validated ``call`` (SDPA's
    layout), the ``backend`` that runs it (asked once), the ``layout`` the layer hands and takes back, and q, k, v
    as the layer holds them (``given``: a later range error names them while they live)."""

    call: AttentionCall
    backend: Backend
    layout: str
    given: tuple[torch.Tensor, torch.Tensor, torch.Tensor]

    @property
    def policy(self) -> Policy:
        return self.call.policy


class LayerState:
    """What a patched layer consults on every call. Patchers call :meth:`select` with the layer's
    q, k, v and then either :meth:`attention` (a ``LayerCall`` came back) or their exact path (None).

    Which backend: an explicit one must support the call. With ``"auto"`` the question goes to the kernel that
    ``fp4vis.backends.registry`` picks for this GPU: when that kernel lacks the call (a head dim, a dtype), the
    layer keeps exact attention rather than dropping to the slow reference emulation. Without a kernel for the
    device (CPU, other GPUs) auto means the reference, which runs anything (``registry.ask_backend``)."""

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
               scale: float | None = None, dropout_p: float = 0.0, is_causal: bool = False,
               extra_reason: str | None = None, key_mask: torch.Tensor | None = None,
               qk_transform: QKTransform | None = None) -> LayerCall | None:
        """Record calibration statistics, then return this call for :meth:`attention` or None (exact attention,
        with the layer's fallback for a reason). ``key_mask``: the bool (B, Skv) key-padding mask of the call;
        ``qk_transform``: q and k are raw projections (``fp4vis.attention``'s arguments); ``extra_reason``: why
        the patcher keeps this call exact (a mask it cannot hand over)."""
        if self.recorder is not None:
            self.recorder(self, q, k, scale, layout)
        if self.auto is not None:
            self.auto.decide(self, q, k, scale, layout)
        pol = self.active_policy()
        if pol is None:
            return None
        reason = extra_reason or call_reason(q, k, v, layout=layout, dropout_p=dropout_p, is_causal=is_causal)
        if reason is None:
            call = self._validated(q, k, v, pol, layout, scale, qk_transform, key_mask)
            try:   # the one question to the backend; "auto" asks the kernel for this GPU (class docstring)
                backend, reason = registry.ask_backend(self.backend, call)
            except Exception as exc:  # noqa: BLE001 - a backend that cannot answer keeps the layer exact
                reason = f"backend {self.backend!r} cannot check these inputs ({exc})"
        if reason is not None:
            self.fallback(reason)
            return None
        return LayerCall(call, backend, layout, (q, k, v))

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

    def attention(self, layer_call: LayerCall) -> torch.Tensor:
        """The FP4 output of a call that :meth:`select` returned, in its layout: ``fp4vis.attention.run_call`` with
        the layer's range check, labelled with the layer's name.

        Under torch.compile the call is neither counted nor labelled: the graph would hold the count and
        the name as constants, so every layer would need a graph of its own, where diffusers' regional
        compilation (``compile_repeated_blocks``) shares one among the blocks. Its errors come from the
        backend's op at run time and name the call, not the layer (docs/patching.md)."""
        if torch.compiler.is_compiling():
            return self._run(layer_call)
        with self.fp4_call():
            range_record.poll()   # an earlier call's deferred range error, as fp4vis.attention reports it
            return self._run(layer_call)

    def attention_of(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, policy: Policy, *,
                     layout: str, scale: float | None = None, key_mask: torch.Tensor | None = None) -> torch.Tensor:
        """The FP4 output of q, k, v that no :meth:`select` saw (context parallelism: the heads or keys of other
        ranks): checked and its backend picked as ``fp4vis.attention`` does (an explicit backend that cannot run
        it raises), then run as :meth:`attention`."""
        call = self._validated(q, k, v, policy, layout, scale, None, key_mask)
        if torch.compiler.is_compiling():
            backend = registry.select_backend(self.backend, call)
        else:
            with self.labelled_errors():
                backend = registry.select_backend(self.backend, call)
        return self.attention(LayerCall(call, backend, layout, (q, k, v)))

    def _validated(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, policy: Policy, layout: str,
                   scale: float | None, qk_transform: QKTransform | None,
                   key_mask: torch.Tensor | None) -> AttentionCall:
        """``fp4vis.call.validated_call``, its errors labelled with the layer's name (eager calls)."""
        if torch.compiler.is_compiling():
            return validated_call(q, k, v, policy, scale=scale, layout=layout, qk_transform=qk_transform,
                                  key_mask=key_mask)
        with self.labelled_errors():
            return validated_call(q, k, v, policy, scale=scale, layout=layout, qk_transform=qk_transform,
                                  key_mask=key_mask)

    def _run(self, layer_call: LayerCall) -> torch.Tensor:
        return run_call(layer_call.call, layer_call.backend, range_check=self.range_check, layout=layer_call.layout,
                        given=layer_call.given)

    @contextlib.contextmanager
    def fp4_call(self) -> Iterator[None]:
        """One eager FP4 call of this layer (counted), in the layer's ``range_record.layer_scope`` and
        ``labelled_errors``. ``attention`` and the context-parallel paths run inside it."""
        self.calls += 1
        with self.labelled_errors(), range_record.layer_scope(self.name):   # the record names the layer too
            yield

    @contextlib.contextmanager
    def labelled_errors(self) -> Iterator[None]:
        """Errors raised in it (range, bad input) start with the layer's name: a model has dozens. An earlier
        call's deferred range error passes unchanged: its message names that call's layer."""
        try:
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


def call_reason(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, layout: str, dropout_p: float = 0.0,
                is_causal: bool = False) -> str | None:
    """Why no fp4vis policy computes this call, whatever the backend (None when one can)."""
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
