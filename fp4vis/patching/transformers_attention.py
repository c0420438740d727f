"""transformers models whose attention goes through ``AttentionInterface`` (patcher ``"transformers"``).

transformers 5 attention modules pick their attention function per call from
``self.config._attn_implementation`` through ``ALL_ATTENTION_FUNCTIONS`` and call it as
``fn(module, q, k, v, attention_mask, scaling=..., dropout=..., **kwargs)`` with (B, H, S, D) tensors.
fp4vis registers one function per base implementation, ``"fp4vis_<base>"`` (``fp4vis_sdpa``,
``fp4vis_eager``, ...), with ``AttentionInterface.register``, registers the base's mask function under the
same name (``AttentionMaskInterface``: the model builds the masks the base expects) and points the
``_attn_implementation`` of the configs of the patched layers at it. The function reads the calling module's
``_fp4vis_state`` attribute: a patched layer gets fp4vis attention with its own policy, any other module that
shares the config gets the base implementation itself (bit-identical). ``remove()`` restores the configs'
original value once no patched layer uses them.

Layers: every module whose class's ``forward`` reads ``ALL_ATTENTION_FUNCTIONS`` and which holds a config
with ``_attn_implementation`` (ViT, ViTMAE, DeiT, Dinov2 and Dinov2 with registers, DINOv3, CLIP and SigLIP
vision towers, BEiT, IJEPA, ViViT, VideoMAE, ...). Heads and head dim are read from the module
(``num_attention_heads`` / ``num_heads``, ``head_dim`` / ``attention_head_size``), else from its config.
Groups: ``"encoder"`` and ``"decoder"`` (a name part starting with "decoder") for layers of vision configs
(with ``image_size`` or ``patch_size``), the default layers (the decoder's with ``decoder=True``);
``"text"`` for the rest (text towers such as CLIP's, language models, causal layers), reachable by name
only, where their causal masks keep exact attention anyway. The index is the position within the group.

Per call: no mask -> FP4; a key-padding mask (``masks.key_padding_mask``; a flash base's 2-D (B, Skv) mask
too) -> FP4 with ``key_mask``; any other mask (BEiT's relative position bias, a causal mask), causal
attention, ``output_attentions=True`` or an argument fp4vis.attention has no equivalent for (``softcap``,
``sliding_window``, packed sequences, ...) -> the base implementation, with the reason.

ViTMAE: the decoder builds its layers from a *deep copy* of the model config, so changing the attention
implementation after construction (``model.set_attn_implementation``, or the model config) reaches only the
encoder. fp4vis sets it on the config each patched layer actually holds, so the decoder is reached when
asked: ``decoder=True`` or a name pattern like ``"decoder.*"`` in ``layers``.
"""

from __future__ import annotations

import inspect
import sys
from typing import Any

import torch
from transformers import AttentionInterface
from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, AttentionMaskInterface
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

from .layer import STATE_ATTR, LayerSpec, LayerState
from .masks import key_padding_mask

__all__ = ["find_layers", "install", "uninstall", "is_known_non_attention", "uses_attention_interface"]

PATCHER = "transformers"
PREFIX = "fp4vis_"
# keyword arguments of the attention function that do not change what it computes (or are handled on their own)
_NO_EFFECT = frozenset({"is_causal", "output_attentions", "output_hidden_states", "return_dict", "use_cache"})

# id(config) -> [config, original _attn_implementation, number of patched layers using it]
_CONFIGS: dict[int, list[Any]] = {}
_READS_INTERFACE: dict[type, bool] = {}


def uses_attention_interface(m: torch.nn.Module) -> bool:
    """True for a module whose attention goes through ``ALL_ATTENTION_FUNCTIONS`` by its config."""
    cfg = getattr(m, "config", None)
    if cfg is None or not hasattr(cfg, "_attn_implementation"):
        return False
    cls = type(m)
    if cls not in _READS_INTERFACE:
        code = getattr(inspect.unwrap(cls.forward), "__code__", None)
        _READS_INTERFACE[cls] = code is not None and "ALL_ATTENTION_FUNCTIONS" in code.co_names
    return _READS_INTERFACE[cls]


def _positive_int(obj: Any, names: tuple[str, ...]) -> int | None:
    for n in names:
        v = getattr(obj, n, None)
        if isinstance(v, int) and not isinstance(v, bool) and v > 0:
            return v
    return None


def heads_of(m: torch.nn.Module) -> tuple[int, int] | None:
    """(heads, head dim) of an attention module, as the module spells them, else as its config does."""
    heads = _positive_int(m, ("num_attention_heads", "num_heads", "n_heads")) or _positive_int(
        m.config, ("num_attention_heads", "num_heads"))
    if heads is None:
        return None
    head_dim = _positive_int(m, ("head_dim", "attention_head_size", "head_size")) or _positive_int(
        m.config, ("head_dim",))
    if head_dim is None:
        width = _positive_int(m, ("all_head_size", "embed_dim", "hidden_size")) or _positive_int(
            m.config, ("hidden_size",))
        head_dim = width // heads if width and width % heads == 0 else None
    return None if head_dim is None else (heads, head_dim)


def _is_vision_layer(m: torch.nn.Module) -> bool:
    cfg = m.config
    if getattr(m, "is_causal", False) is True or "text" in str(getattr(cfg, "model_type", "")):
        return False
    return any(getattr(cfg, a, None) is not None for a in ("image_size", "patch_size"))


def _group(name: str, m: torch.nn.Module) -> str:
    if not _is_vision_layer(m):
        return "text"
    return "decoder" if any(part.startswith("decoder") for part in name.split(".")) else "encoder"


def find_layers(root: torch.nn.Module, *, cross_attention: bool = False, decoder: bool = False) -> list[LayerSpec]:
    specs, counters = [], {}
    for name, m in root.named_modules():
        if not uses_attention_interface(m):
            continue
        shape = heads_of(m)
        if shape is None:   # left to discovery, which reports it as unsupported
            continue
        group = _group(name, m)
        idx = counters.get(group, 0)
        counters[group] = idx + 1
        specs.append(LayerSpec(name=name, module=m, index=idx, group=group,
                               default=group == "encoder" or (group == "decoder" and decoder), patcher=PATCHER,
                               num_heads=shape[0], head_dim=shape[1]))
    return specs


def is_known_non_attention(module: torch.nn.Module) -> bool:
    return False


def _base_function(base: str, module: torch.nn.Module):
    if base == "eager" or base is None:
        mod = sys.modules.get(type(module).__module__)
        fn = getattr(mod, "eager_attention_forward", None)
        if fn is None:
            raise RuntimeError(f"fp4vis: {type(module).__module__} has no eager_attention_forward")
        return fn
    return ALL_ATTENTION_FUNCTIONS[base]


def _call_form(base: str, module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
               mask: Any, kwargs: dict) -> tuple[torch.Tensor | None, bool, str | None]:
    """(key mask, causal, reason to keep exact attention) of one call of the attention function."""
    if kwargs.get("output_attentions"):
        return None, False, "output_attentions=True (fp4vis returns no attention weights)"
    if not query.shape[0] == key.shape[0] == value.shape[0]:
        return None, False, (f"batch sizes differ (q {query.shape[0]}, k {key.shape[0]}, v {value.shape[0]}: "
                             "broadcast by SDPA, not by fp4vis.attention)")
    extra = sorted(k for k, v in kwargs.items() if k not in _NO_EFFECT and v is not None and v is not False)
    if extra:
        return None, False, (f"argument{'s' if len(extra) > 1 else ''} {', '.join(extra)} of the attention "
                             "function (fp4vis.attention has no equivalent)")
    if mask is None:
        # as transformers' sdpa function decides it
        causal = kwargs.get("is_causal")
        causal = getattr(module, "is_causal", True) if causal is None else causal
        return None, bool(causal) and query.shape[2] > 1, None
    if isinstance(mask, torch.Tensor) and mask.dim() == 2 and "flash" in base:   # flash's (B, Skv) padding mask
        mask = mask.bool()[:, None, None, :]
    key_mask, reason = key_padding_mask(mask, query, key)
    return key_mask, False, reason


def _make_function(base: str):
    def fp4vis_attention_forward(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor,
                                 value: torch.Tensor, attention_mask: torch.Tensor | None,
                                 scaling: float | None = None, dropout: float = 0.0, **kwargs):
        st: LayerState | None = getattr(module, STATE_ATTR, None)
        if st is not None and st.needs_qkv():
            key_mask, causal, reason = _call_form(base, module, query, key, value, attention_mask, kwargs)
            layer_call = st.select(query, key, value, layout="bhsd", scale=scaling, dropout_p=dropout,
                                   is_causal=causal, extra_reason=reason, key_mask=key_mask)
            if layer_call is not None:
                return st.attention(layer_call).transpose(1, 2).contiguous(), None
        return _base_function(base, module)(module, query, key, value, attention_mask, scaling=scaling,
                                            dropout=dropout, **kwargs)

    fp4vis_attention_forward.__name__ = f"{PREFIX}{base}_attention_forward"
    return fp4vis_attention_forward


def _ensure_registered(base: str) -> str:
    name = f"{PREFIX}{base}"
    if name not in ALL_ATTENTION_FUNCTIONS:
        AttentionInterface.register(name, _make_function(base))
    # the model builds its masks for the implementation its config names: the base's form, or none at all
    # for a name without a mask function (a padding mask would then be dropped)
    masks = ALL_MASK_ATTENTION_FUNCTIONS._global_mapping
    if base in masks and name not in masks:
        AttentionMaskInterface.register(name, masks[base])
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
