"""transformers ViT and ViTMAE through ``AttentionInterface``.

transformers 5 attention modules pick their attention function per call from
``self.config._attn_implementation`` through ``ALL_ATTENTION_FUNCTIONS``. fp4vis registers one
function per base implementation, ``"fp4vis_<base>"`` (``fp4vis_sdpa``, ``fp4vis_eager``, ...), with
``AttentionInterface.register`` and points the ``_attn_implementation`` of the configs of the
patched layers at it. The function reads the calling module's ``_fp4vis_state`` attribute: a
patched layer gets fp4vis attention with its own policy, any other module that shares the config
gets the base implementation itself (bit-identical). ``remove()`` restores the configs' original
value once no patched layer uses them.

ViTMAE: the decoder builds its layers from a *deep copy* of the model config, so changing the
attention implementation after construction (``model.set_attn_implementation``, or the model
config) reaches only the encoder. fp4vis sets it on the config each patched layer actually holds,
so the decoder is reached when asked: ``decoder=True`` (the base policy on the decoder too) or a
name pattern like ``"decoder.*"`` in ``layers``. By default only the encoder is patched, as in
the paper.

Layers: ``ViTAttention`` / ``ViTMAEAttention`` modules; group ``"encoder"`` or ``"decoder"``; the
index is the position within the group (the block index).
"""

from __future__ import annotations

import sys
from typing import Any

import torch
from transformers import AttentionInterface
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

from .layer import LayerSpec, LayerState

__all__ = ["find_layers", "install", "uninstall", "SUPPORTED_CLASSES"]

SUPPORTED_CLASSES = {
    "transformers.models.vit.modeling_vit": "ViTAttention",
    "transformers.models.vit_mae.modeling_vit_mae": "ViTMAEAttention",
}
PREFIX = "fp4vis_"

# id(config) -> [config, original _attn_implementation, number of patched layers using it]
_CONFIGS: dict[int, list[Any]] = {}


def _supported(m: torch.nn.Module) -> bool:
    cls = type(m)
    return SUPPORTED_CLASSES.get(cls.__module__) == cls.__name__ and hasattr(m, "config")


def _group(name: str) -> str:
    return "decoder" if any(part.startswith("decoder") for part in name.split(".")) else "encoder"


def find_layers(root: torch.nn.Module, *, cross_attention: bool = False, decoder: bool = False) -> list[LayerSpec]:
    specs, counters = [], {}
    for name, m in root.named_modules():
        if not _supported(m):
            continue
        group = _group(name)
        idx = counters.get(group, 0)
        counters[group] = idx + 1
        specs.append(LayerSpec(name=name, module=m, index=idx, group=group,
                               default=group == "encoder" or decoder, patcher="hf_vit",
                               num_heads=m.num_attention_heads, head_dim=m.head_dim))
    return specs


def is_known_non_attention(module: torch.nn.Module) -> bool:
    # ViTAttention's children and the output/pooler helpers are not separate attention layers
    return type(module).__module__ in SUPPORTED_CLASSES


def _base_function(base: str, module: torch.nn.Module):
    if base == "eager" or base is None:
        mod = sys.modules.get(type(module).__module__)
        fn = getattr(mod, "eager_attention_forward", None)
        if fn is None:  # pragma: no cover - every supported modeling file defines it
            raise RuntimeError(f"fp4vis: {type(module).__module__} has no eager_attention_forward")
        return fn
    return ALL_ATTENTION_FUNCTIONS[base]


def _make_function(base: str):
    def fp4vis_attention_forward(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor,
                                 value: torch.Tensor, attention_mask: torch.Tensor | None,
                                 scaling: float | None = None, dropout: float = 0.0, **kwargs):
        st: LayerState | None = getattr(module, "_fp4vis_state", None)
        if st is not None and st.needs_qkv():
            extra = "output_attentions=True (fp4vis returns no attention weights)" if kwargs.get(
                "output_attentions") else None
            pol = st.select(query, key, value, layout="bhsd", scale=scaling, mask=attention_mask,
                            dropout_p=dropout, is_causal=bool(kwargs.get("is_causal") or False),
                            extra_reason=extra)
            if pol is not None:
                out = st.attention(query, key, value, pol, layout="bhsd", scale=scaling)
                return out.transpose(1, 2).contiguous(), None
        return _base_function(base, module)(module, query, key, value, attention_mask, scaling=scaling,
                                            dropout=dropout, **kwargs)

    fp4vis_attention_forward.__name__ = f"{PREFIX}{base}_attention_forward"
    return fp4vis_attention_forward


def _ensure_registered(base: str) -> str:
    name = f"{PREFIX}{base}"
    if name not in ALL_ATTENTION_FUNCTIONS:
        AttentionInterface.register(name, _make_function(base))
    return name


def install(spec: LayerSpec, state: LayerState) -> Any:
    cfg = spec.module.config
    entry = _CONFIGS.get(id(cfg))
    if entry is None or entry[0] is not cfg:
        orig = cfg._attn_implementation
        if isinstance(orig, str) and orig.startswith(PREFIX):
            raise RuntimeError(f"layer {spec.name!r}: its config already routes to {orig!r} without an fp4vis "
                               "handle (copied from a patched model?); set config._attn_implementation back first")
        base = orig or "eager"
        if base != "eager" and base not in ALL_ATTENTION_FUNCTIONS:
            raise NotImplementedError(f"layer {spec.name!r}: attention implementation {base!r} is not in "
                                      "AttentionInterface")
        cfg._attn_implementation = _ensure_registered(base)
        entry = _CONFIGS[id(cfg)] = [cfg, orig, 0]
    entry[2] += 1
    return cfg


def uninstall(spec: LayerSpec, state: LayerState, cfg: Any) -> None:
    if cfg is None:
        return
    entry = _CONFIGS.get(id(cfg))
    if entry is None or entry[0] is not cfg:
        return
    entry[2] -= 1
    if entry[2] <= 0:
        del _CONFIGS[id(cfg)]
        cfg._attn_implementation = entry[1]
