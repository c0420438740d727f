"""timm vision transformers (``timm.layers.Attention``, the vision_transformer attention).

``fp4vis.patch`` gives each patched ``Attention`` instance its own ``forward`` (an instance
attribute bound to that module; the class is untouched, the state dict and module tree unchanged)
and deletes it again on ``remove()``. The instance forward computes q, k, v as timm 1.0's
``Attention.forward`` does (fused qkv, q/k norms, optional gate and scale norm) and hands them to
``fp4vis.attention``; exact attention (the layer's policy, a fallback) runs the class's own forward.

Supported: modules whose type is exactly ``timm.layers.Attention`` (vision_transformer ``Block``,
``ResPostBlock``, ``ParallelThingsBlock``; ViT, DeiT, ... built on them). Other timm attention
classes (``AttentionRope``, ``DiffAttention``, EVA, Swin, ``ParallelScalingBlock``'s inline attention,
...) are reported as unsupported. The layer index is the position among the model's supported
attention modules in module order (the block index for a plain ViT).
"""

from __future__ import annotations

import types
from typing import Any

import torch
from timm.layers import Attention

from .layer import LayerSpec, LayerState

__all__ = ["find_layers", "install", "uninstall"]

_REQUIRED = ("qkv", "num_heads", "head_dim", "scale", "q_norm", "k_norm", "attn_drop", "norm", "proj", "proj_drop")


def _supported(m: torch.nn.Module) -> bool:
    return type(m) is Attention and all(hasattr(m, a) for a in _REQUIRED)


def find_layers(root: torch.nn.Module, *, cross_attention: bool = False, decoder: bool = False) -> list[LayerSpec]:
    specs = []
    for name, m in root.named_modules():
        if _supported(m):
            specs.append(LayerSpec(name=name, module=m, index=len(specs), group="attn", default=True,
                                   patcher="timm_vit", num_heads=m.num_heads, head_dim=m.head_dim))
    return specs


def is_known_non_attention(module: torch.nn.Module) -> bool:
    return False


def _fp4_forward(self: Attention, x: torch.Tensor, attn_mask: torch.Tensor | None = None,
                 is_causal: bool = False) -> torch.Tensor:
    st: LayerState | None = self.__dict__.get("_fp4vis_state")
    if st is None or not st.needs_qkv():
        return type(self).forward(self, x, attn_mask=attn_mask, is_causal=is_causal)
    B, N, C = x.shape
    gate_mod = getattr(self, "gate", None)
    qkv = self.qkv(x).reshape(B, N, 3, self.num_heads, self.head_dim).permute(2, 0, 3, 1, 4)
    q, k, v = qkv.unbind(0)
    q, k = self.q_norm(q), self.k_norm(k)
    dropout_p = self.attn_drop.p if self.training else 0.0
    pol = st.select(q, k, v, layout="bhsd", scale=self.scale, mask=attn_mask, dropout_p=dropout_p,
                    is_causal=is_causal)
    if pol is None:
        return type(self).forward(self, x, attn_mask=attn_mask, is_causal=is_causal)
    out = st.attention(q, k, v, pol, layout="bhsd", scale=self.scale)
    out = out.transpose(1, 2).reshape(B, N, getattr(self, "attn_dim", C))
    out = self.norm(out)
    if gate_mod is not None:
        out = out * gate_mod(x).sigmoid()
    out = self.proj(out)
    return self.proj_drop(out)


def install(spec: LayerSpec, state: LayerState) -> Any:
    m = spec.module
    if "forward" in m.__dict__:
        raise RuntimeError(f"layer {spec.name!r} already has an instance-level forward (patched by something "
                           "else?); fp4vis will not wrap it")
    m.forward = types.MethodType(_fp4_forward, m)
    return None


def uninstall(spec: LayerSpec, state: LayerState, token: Any) -> None:
    m = spec.module
    fwd = m.__dict__.get("forward")
    if isinstance(fwd, types.MethodType) and fwd.__func__ is _fp4_forward:
        del m.__dict__["forward"]
