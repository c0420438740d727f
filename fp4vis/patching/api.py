"""Per-layer FP4 attention for existing models: ``fp4vis.patch`` / ``fp4vis.unpatch``.

``patch(model_or_pipeline, policy="fast", *, layers=None, guard=None, backend="auto", strict=False)``
finds the attention layers fp4vis knows how to reach, resolves one policy per layer, installs a
per-layer hook through the library's own extension point, and returns a :class:`PatchHandle`
(``handle.remove()``, or use it as a context manager). Nothing global is monkeypatched:

* diffusers Wan2.1/2.2 (``WanAttention``): an attention processor set with ``attn.set_processor``
  (``fp4vis.patching.wan``); self-attention (``attn1``) by default, cross-attention (``attn2``) when
  asked (``cross_attention=True`` or a name pattern in ``layers``).
* every other diffusers attention layer whose processor computes softmax attention through
  ``dispatch_attention_fn`` or ``F.scaled_dot_product_attention`` (FLUX, Qwen-Image, HunyuanVideo 1.0/1.5,
  LTX-Video, CogVideoX, SkyReels-V2, Mochi, SD3, PixArt, Sana's cross-attention, UNets, ...): a processor set
  with ``attn.set_processor`` that runs the layer's own processor with its SDPA calls routed to fp4vis
  (``fp4vis.patching.diffusers_attention``); self- and joint (text+image) attention by default,
  cross-attention with ``cross_attention=True``, the prompt-only attention of a ``context_embedder``
  (HunyuanVideo's token refiner) by name pattern. Key-padding masks (text padding) run FP4 with ``key_mask``.
* timm (``timm.layers.Attention``, ``AttentionRope``, ``EvaAttention``; Swin's ``WindowAttention`` found and
  kept exact): a per-instance ``forward`` (``fp4vis.patching.timm_attention``); the class is untouched.
* transformers (every attention module that goes through ``AttentionInterface``: ViT, ViTMAE, DeiT, Dinov2,
  CLIP / SigLIP vision towers, BEiT, ...): an ``AttentionInterface`` function selected through the layers'
  ``config._attn_implementation`` (``fp4vis.patching.transformers_attention``); unpatched layers that share
  the config go through the original implementation, bit for bit. MAE: encoder only by default (as in
  the paper), decoder with ``decoder=True`` or a name pattern.

Per-layer policy resolution (first to last, later steps win):

1. every default layer gets ``policy``;
2. ``layers`` entries, in their order: an ``int`` key selects the default layers with that index
   (the block index within its stack); in a model with several block stacks only those of its main
   stack, the first in module order (FLUX: ``transformer_blocks.N``, not ``single_transformer_blocks.N``;
   Wan VACE: ``blocks.N``, not ``vace_blocks.N``; HunyuanVideo: ``transformer_blocks.N``), the other
   stacks' layers by name pattern. A ``str`` key is an ``fnmatch`` pattern over the layer
   names (``handle.layers`` lists them; a pattern may also select non-default layers such as
   ``"*attn2"``). A key that selects no layer is an error. Values: a policy name, a
   :class:`~fp4vis.policy.Policy`, or ``None`` / ``"exact"`` / ``"bf16"`` for the model's own
   exact attention;
3. the guard plan: each guarded layer whose policy is a Direct-P policy gets the plan's guard policy
   (exact, ``nv_fp8`` and FP8 P/V (``fp8``, ``fp8pv``) layers stay as they are: softmax policies have no range
   to guard); the layers a plan found for a fidelity target keeps exact (``exact_layers``) are exact. Its
   exact steps (``exact_steps``) run through the pipeline call's ``callback_on_step_end=handle.step_callback()``
   (``fp4vis generate`` and ``fp4vis.pipelines.wan_video.generate`` pass it; a handle removed without it having
   been built warns that the steps did not run exact).

A layer whose resolved policy is exact is not touched at all. At call time a patched layer keeps
the model's exact attention, with one :class:`FallbackWarning` naming the layer and the reason,
when fp4vis cannot compute it (an attention mask other than a key-padding mask, causal attention,
dropout in training mode, grouped-query attention, a head dim / dtype / device / mask the backend
lacks, gradients requested, a diffusers attention backend other than the native SDPA ones);
``strict=True`` raises :class:`FallbackError` instead.

A model without any attention layer is left as it is, with a :class:`FallbackWarning` saying that there
is nothing to patch (an empty handle); attention modules none of the patchers reaches are named in a
warning (``strict=True``: ``NotImplementedError``).

Patching a layer that is already patched raises ``RuntimeError`` (no double wrap); remove the old
handle (or call ``fp4vis.unpatch``) first.
"""

from __future__ import annotations

import os
import warnings
from collections.abc import Mapping
from typing import Any

from fp4vis.backends import registry
from fp4vis.policy import Policy

from .discovery import find_layers, model_id, select_layers
from .guard import AutoGuard
from .guard_plan import GuardPlan
from .handle import PatchHandle, install
from .layer import FallbackError, FallbackWarning, LayerSpec, resolve_policy

_SUPPORTED_TEXT = (
    "diffusers WanAttention (WanTransformer3DModel, WanPipeline, WanImageToVideoPipeline), "
    "diffusers attention layers whose processor calls dispatch_attention_fn or F.scaled_dot_product_attention "
    "(FLUX, Qwen-Image, HunyuanVideo, LTX-Video, CogVideoX, SkyReels-V2, Mochi, SD3, PixArt, Sana, UNets, ...), "
    "timm Attention / AttentionRope / EvaAttention (ViT, DeiT, EVA, ...), transformers attention modules that go "
    "through AttentionInterface (ViT, ViTMAE, DeiT, Dinov2, CLIP and SigLIP vision, BEiT, ...)"
)


def resolve_layer_policies(specs: list[LayerSpec], policy: Any, layers: Mapping | None,
                           plan: Any = None) -> dict[str, Policy | None]:
    """name -> Policy | None for every spec (see the module docstring for the order)."""
    base = resolve_policy(policy)
    out: dict[str, Policy | None] = {s.name: (base if s.default else None) for s in specs}
    if layers is not None:
        if not isinstance(layers, Mapping):
            raise TypeError("layers: expected a mapping {layer index or name pattern: policy}, got "
                            f"{type(layers).__name__}")
        for key, value in layers.items():
            chosen = select_layers(specs, key)
            if not chosen:
                raise ValueError(f"layers: key {key!r} matches no attention layer; layers are "
                                 f"{_names_summary(specs)}")
            pol = resolve_policy(value)
            for s in chosen:
                out[s.name] = pol
    if plan is not None:
        if base is not None and base.name != plan.policy.name:
            warnings.warn(f"guard plan was calibrated for policy {plan.policy.name!r} but the model is patched "
                          f"with {base.name!r}: its decisions may not fit this policy's range "
                          f"(calibrate again with policy={base.name!r})", RuntimeWarning, stacklevel=3)
        for s in plan.match(specs):
            if out[s.name] is not None and out[s.name].is_direct_p:
                out[s.name] = plan.guard_policy
        for s in plan.match(specs, plan.exact_layers):
            out[s.name] = None
        plan.match(specs, plan.exact_layer_steps)   # unknown names raise now, not at the step callback
    return out


def _names_summary(specs: list[LayerSpec], limit: int = 12) -> str:
    names = [f"{s.name} (index {s.index}{'' if s.default else ', not default'})" for s in specs]
    more = f" ... and {len(names) - limit} more" if len(names) > limit else ""
    return ", ".join(names[:limit]) + more if names else "(none)"


def _check_backend(backend: str, strict: bool) -> None:
    if not isinstance(backend, str):
        raise TypeError(f"backend: expected a backend name, got {type(backend).__name__}")
    if backend == "auto":
        return
    be = registry.get_backend(backend)  # unknown names raise ValueError listing the known ones
    if be is None:
        msg = (f"fp4vis.patch: backend {backend!r} is not available here "
               f"({registry.available_backends().get(backend)}); patched layers keep exact attention")
        if strict:
            raise FallbackError(msg + " (strict=True)")
        warnings.warn(msg, FallbackWarning, stacklevel=3)


def _check_guard(guard: Any) -> None:
    """``guard``: None, a GuardPlan, "auto" or a path. Never handed to ``open`` otherwise: it takes an int (a
    bool too) as a file descriptor, so ``guard=False`` would read stdin and close it."""
    if guard is not None and not isinstance(guard, (GuardPlan, str, os.PathLike)):
        raise TypeError(f"guard: expected a GuardPlan, a path to its JSON file (str or os.PathLike), 'auto' or "
                        f"None, got {type(guard).__name__}")


def _check_range_check(range_check: str) -> None:
    if range_check not in ("raise", "warn", "off"):
        raise ValueError(f"range_check: expected 'raise', 'warn' or 'off', got {range_check!r}")


def patch(model_or_pipeline: Any, policy: Any = "fast", *, layers: Mapping | None = None, guard: Any = None,
          backend: str = "auto", strict: bool = False, cross_attention: bool = False, decoder: bool = False,
          range_check: str = "raise", guard_rule: Any = None) -> PatchHandle:
    """Route the attention layers of a model or pipeline through fp4vis, per layer.

    Args:
        model_or_pipeline: a diffusers transformer, UNet or pipeline, a timm model, or a transformers
            model (any ``nn.Module`` holding supported attention layers).
        policy: base policy of the default layers (a name, a Policy, or None/"exact").
        layers: ``{index or name pattern: policy}`` overrides, applied in order (module docstring).
        guard: a :class:`~fp4vis.patching.guard_plan.GuardPlan`, a path to its JSON (str or os.PathLike; anything
            else is a TypeError), or ``"auto"`` (each layer
            calibrates on its first call with ``guard_rule`` and switches to the guard policy when
            the rule says so; ``handle.guard_plan`` collects the result).
        backend: ``"auto"`` | ``"reference"`` | ``"hopper"`` | ``"blackwell"`` (passed to
            ``fp4vis.attention``).
        strict: raise :class:`FallbackError` where a layer would fall back to exact attention,
            and on unsupported attention modules next to supported ones.
        cross_attention: diffusers: patch the cross-attention layers (``attn2``) with the base policy too
            (default: exact).
        decoder: ViTMAE: patch the decoder with the base policy too (default: encoder only).
        range_check: passed to ``fp4vis.attention`` ("raise", "warn", "off").
        guard_rule: the :class:`~fp4vis.patching.guard_plan.GuardRule` for ``guard="auto"``.
    """
    _check_backend(backend, strict)
    _check_range_check(range_check)
    _check_guard(guard)
    specs, unsupported = find_layers(model_or_pipeline, cross_attention=cross_attention, decoder=decoder)
    if not specs and not unsupported:
        warnings.warn(f"fp4vis.patch: {type(model_or_pipeline).__name__} has no attention layer: nothing to patch",
                      FallbackWarning, stacklevel=2)
    elif not specs:
        raise NotImplementedError(
            f"fp4vis.patch: no supported attention layer in {type(model_or_pipeline).__name__}; found unsupported "
            f"attention modules: {', '.join(f'{n} ({c})' for n, c in unsupported[:8])}. "
            f"Supported are: {_SUPPORTED_TEXT}.")
    if unsupported:
        msg = (f"fp4vis.patch: these attention modules are unsupported and keep their own attention: "
               f"{', '.join(f'{n} ({c})' for n, c in unsupported[:8])}"
               f"{' ...' if len(unsupported) > 8 else ''}. Supported are: {_SUPPORTED_TEXT}.")
        if strict:
            raise NotImplementedError(msg)
        warnings.warn(msg, FallbackWarning, stacklevel=2)

    plan = None
    auto = None
    if isinstance(guard, str) and guard == "auto":
        auto = AutoGuard(rule=guard_rule, model_id=model_id(model_or_pipeline),
                         base_policy=resolve_policy(policy) or "fast")
        auto.plan.architecture = {s.name: [s.num_heads, s.head_dim] for s in specs}
    elif guard is not None:
        plan = guard if isinstance(guard, GuardPlan) else GuardPlan.load(guard)

    if plan is not None:
        plan.check_model(specs, model_id(model_or_pipeline))
    policies = resolve_layer_policies(specs, policy, layers, plan)
    if guard is not None and not any(p is not None and p.is_direct_p for p in policies.values()):
        names = sorted({p.name for p in policies.values() if p is not None})
        what = repr(guard) if isinstance(guard, str) else "a guard plan"
        warnings.warn(f"fp4vis.patch: guard={what} guards Direct-P layers and none is patched with one (policies: "
                      f"{', '.join(names) or 'none'}); it changes nothing (softmax policies such as fp8 have no "
                      "representable range to guard)", RuntimeWarning, stacklevel=2)
    if specs and layers is None and resolve_policy(policy) is not None and not any(s.default for s in specs):
        groups = sorted({s.group for s in specs})
        warnings.warn(f"fp4vis.patch: none of the {len(specs)} attention layers of {type(model_or_pipeline).__name__} "
                      f"is a default layer (groups: {', '.join(groups)}): nothing is patched; pass "
                      "cross_attention=True or name layers in layers=", FallbackWarning, stacklevel=2)
    return install(model_or_pipeline, specs, policies, backend=backend, strict=strict,
                    range_check=range_check, plan=plan, auto=auto)
