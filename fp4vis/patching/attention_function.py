"""Another attention function in a diffusers model's attention layers, for the duration of a ``with`` block: a BF16
attention library (flash-attn-4, SageAttention, a torch SDPA backend) as the baseline fp4vis is timed against
(``fp4vis.evals.baselines``), in every layer ``fp4vis.patch`` reaches, Wan's and the other diffusers layers alike::

    with attention_function_applied(pipe, flash_attn_bhsd) as applied:
        images = pipe(prompt).images
    applied.summary()   # how many layers and calls the function computed, which kept the model's attention

``fn(q, k, v, scale)`` takes (B, H, S, D) tensors (``scale`` None: 1/sqrt(D)) and returns the attention in that
layout; a mapping ``{"bhsd": f, "bshd": g}`` gives one function per layout, each layer calling the one in its own
(the others get the one it has, transposed: views). Which layers: ``select`` None, the ones the FP4 policies patch
by default (self and joint attention; Wan: ``attn1``); else a key as ``fp4vis.patch``'s ``layers`` takes it (an
fnmatch pattern over the layer names, ``"*attn2"``; an int: that block of the main stack).

Per layer, through the patcher that reaches it (nothing global is touched):

* a Wan layer (``fp4vis.patching.wan``) gets a ``WanFunctionAttnProcessor``: diffusers' Wan math with the
  function as its attention, (B, S, H, D) tensors;
* any other diffusers layer (``fp4vis.patching.diffusers_attention``) gets a ``FunctionAttnProcessor``: its own
  processor runs, and its SDPA calls without a mask, non-causal, of (B, H, S, D) tensors of one head count go to
  the function, the others on to SDPA unchanged. A call with a key-padding mask (the text padding of
  HunyuanVideo's, Qwen-Image's and Mochi's joint attention) goes to a function that takes one
  (``fn.takes_key_mask``: ``fn(q, k, v, scale, key_mask)`` with a bool (B, Skv) mask, as flash-attn-4's
  baseline does) and keeps SDPA with its mask for the others.

On exit (also after an exception) the previous processor objects are set back. A layer patched by fp4vis is
refused (remove its handle first); layers of other libraries (timm, transformers) are refused naming them.

What ran where (:class:`AppliedFunction`): per layer, the eager calls the function computed and the calls kept on
the model's attention, by reason. Under torch.compile no call is counted at run time (per-layer counts in a graph
would give every layer a graph of its own, where regional compilation shares one): the calls seen while Dynamo
traced are counted instead (``traced``), without layer names (a shared block graph is traced once).

The function runs inside the traced graph under torch.compile (``fullgraph=True``): a library whose Python
Dynamo cannot trace must come as a custom op (``fp4vis.evals.baselines`` wraps its libraries so).
"""

from __future__ import annotations

import contextlib
import itertools
from collections import Counter
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch

from fp4vis.tracing import constant_at_trace_time

from .discovery import find_layers, select_layers
from .layer import LayerSpec

__all__ = ["LAYOUTS", "AppliedFunction", "attention_function_applied"]

LAYOUTS = ("bhsd", "bshd")
AttentionFn = Callable[..., torch.Tensor]
_PATCHERS = ("wan", "diffusers")   # the patchers whose layers take a function
ROUTED = ""                        # the key of the calls the function computed in ``traced``

_tokens = itertools.count(1)
_TRACING: dict[int, AppliedFunction] = {}   # token -> the block's record, while its block runs


@constant_at_trace_time
def _note_traced(token: int, reason: str) -> bool:
    """Count one SDPA call Dynamo traces (``reason``: ``ROUTED``, or why it kept SDPA); runs at trace time only."""
    applied = _TRACING.get(token)
    if applied is not None:
        applied.traced[reason] += 1
    return True


@dataclass
class AppliedFunction:
    """What an ``attention_function_applied`` block ran where: ``layers`` (the selected layers' names), per
    layer the eager ``calls`` the function computed and the eager calls ``kept`` on the model's attention by
    reason; ``traced``: the calls seen while torch.compile traced, ``ROUTED`` for the function's, else the
    reason they kept the model's attention (module docstring)."""

    layers: list[str]
    calls: dict[str, int] = field(default_factory=dict)
    kept: dict[str, Counter] = field(default_factory=dict)
    traced: Counter = field(default_factory=Counter)

    def __post_init__(self) -> None:
        for name in self.layers:
            self.calls.setdefault(name, 0)
            self.kept.setdefault(name, Counter())
        self.token = next(_tokens)

    def tally(self, layer: str) -> Callable[[str | None], None]:
        """The counter of one layer's calls: told None for a call the function computed, else the reason."""
        return _LayerTally(self, layer)

    def summary(self) -> dict[str, Any]:
        """A JSON-able account: the layers selected, those whose calls the function computed, those that kept
        the model's attention (with the reasons), the eager calls each way, and the traced ones."""
        kept = Counter()
        for reasons in self.kept.values():
            kept.update(reasons)
        traced_kept = {r: n for r, n in self.traced.items() if r != ROUTED}
        return {"layers": len(self.layers),
                "layers_on_function": [n for n in self.layers if self.calls[n]],
                "layers_kept": {n: sorted(r) for n, r in self.kept.items() if r},
                "calls_on_function": sum(self.calls.values()), "calls_kept": dict(kept),
                "traced": {"calls_on_function": self.traced[ROUTED], "calls_kept": traced_kept}}


class _LayerTally:
    """One layer's counter (``AppliedFunction.tally``). Under torch.compile it reads nothing of the layer's (its
    name in a graph would make the layer's graph its own): the call goes to ``_note_traced``."""

    def __init__(self, applied: AppliedFunction, layer: str):
        self.applied = applied
        self.token = applied.token
        self.layer = layer

    def __call__(self, reason: str | None) -> None:
        if torch.compiler.is_compiling():
            _note_traced(self.token, ROUTED if reason is None else reason)
        elif reason is None:
            self.applied.calls[self.layer] += 1
        else:
            self.applied.kept[self.layer][reason] += 1


def _per_layout(fn: AttentionFn | Mapping[str, AttentionFn]) -> dict[str, AttentionFn]:
    """``fn`` -> one function per layout, a missing one being another's with its tensors transposed (views)."""
    fns = dict(fn) if isinstance(fn, Mapping) else {"bhsd": fn}
    bad = [k for k in fns if k not in LAYOUTS]
    if bad or not fns:
        raise ValueError(f"fn: expected a function of (B, H, S, D) tensors or a mapping of layouts "
                         f"({', '.join(LAYOUTS)}) to functions, got keys {sorted(fns)}")
    if not all(callable(f) for f in fns.values()):
        raise TypeError("fn: expected a callable fn(q, k, v, scale) (or a mapping of layouts to them)")
    for layout in LAYOUTS:
        if layout not in fns:
            fns[layout] = _transposed(next(iter(fns.values())))
    return fns


def _transposed(fn: AttentionFn) -> AttentionFn:
    takes_key_mask = bool(getattr(fn, "takes_key_mask", False))

    def transposed(q, k, v, scale=None, *key_mask):   # key_mask: where ``fn`` takes one
        return fn(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), scale, *key_mask).transpose(1, 2)
    transposed.__name__ = getattr(fn, "__name__", "fn")
    transposed.takes_key_mask = takes_key_mask
    return transposed


class _WanCall:
    """A Wan layer's attention call, ``fn(q, k, v)`` on (B, S, H, D) tensors, counted by the layer's tally."""

    def __init__(self, fn: AttentionFn, tally: Callable[[str | None], None]):
        self.fn = fn
        self.tally = tally
        self.__name__ = getattr(fn, "__name__", "fn")

    def __call__(self, q, k, v):
        self.tally(None)
        return self.fn(q, k, v, None)


def _selected(model: Any, select: Any) -> list[LayerSpec]:
    specs, _ = find_layers(model)
    chosen = [s for s in specs if s.default] if select is None else select_layers(specs, select)
    if not chosen:
        what = "is a default layer" if select is None else f"matches {select!r}"
        raise ValueError(f"attention_function_applied: no attention layer of {type(model).__name__} that "
                         f"fp4vis reaches {what}" + (f" (layers: {', '.join(s.name for s in specs)})" if specs else ""))
    other = [s for s in chosen if s.patcher not in _PATCHERS]
    if other:
        raise NotImplementedError(f"attention_function_applied: layer {other[0].name!r} is a {other[0].patcher} "
                                  "layer; another attention function goes into diffusers layers only")
    return chosen


def _install(spec: LayerSpec, fns: dict[str, AttentionFn], tally: Callable[[str | None], None]) -> Callable[[], None]:
    """Set the layer's function processor; returns what sets its previous processor back."""
    attn = spec.module
    if spec.patcher == "wan":
        from .wan import FP4WanAttnProcessor, WanFunctionAttnProcessor

        original = attn.processor
        if isinstance(original, FP4WanAttnProcessor):
            raise RuntimeError(f"layer {spec.name!r} already has an fp4vis processor; remove its patch handle first")
        attn.set_processor(WanFunctionAttnProcessor(_WanCall(fns["bshd"], tally), original))
        return lambda: attn.set_processor(original)
    from .diffusers_attention import install_function, restore_processor

    original = install_function(spec.name, attn, fns["bhsd"], tally)
    return lambda: restore_processor(attn, original)


@contextlib.contextmanager
def attention_function_applied(model: Any, fn: AttentionFn | Mapping[str, AttentionFn], select: Any = None
                               ) -> Iterator[AppliedFunction]:
    """Run a block with the attention of ``model``'s selected layers computed by ``fn`` (module docstring);
    yields the :class:`AppliedFunction` that counts where the calls went. ``model``: a diffusers model or
    pipeline. The previous processors are set back on exit, also after an exception."""
    fns = _per_layout(fn)
    specs = _selected(model, select)
    applied = AppliedFunction([s.name for s in specs])
    restores: list[Callable[[], None]] = []
    _TRACING[applied.token] = applied
    try:
        for spec in specs:
            restores.append(_install(spec, fns, applied.tally(spec.name)))
        yield applied
    finally:
        for restore in reversed(restores):
            restore()
        _TRACING.pop(applied.token, None)
