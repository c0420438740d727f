"""timm attention layers (patcher ``"timm"``).

``fp4vis.patch`` gives each patched attention module its own ``forward`` (an instance attribute bound to
that module; the class is untouched, the state dict and module tree unchanged) and deletes it again on
``remove()``. The instance forward computes q, k, v exactly as the class's forward does (timm 1.0: the same
projections, q/k norms and rotary embedding, timm's own ``apply_rot_embed_cat``) and hands them to
``fp4vis.attention``, then applies the class's output steps (scale norm, gate, projection); exact attention
(the layer's policy, a fallback) runs the class's own forward.

Supported, by exact type (a subclass may change the forward):

* ``timm.layers.Attention``: vision_transformer's ``Block``, ``ResPostBlock``, ``ParallelThingsBlock`` (ViT,
  DeiT, ...);
* ``timm.layers.AttentionRope`` and ``timm.models.eva.EvaAttention`` (EVA, EVA-02, the ROPE ViTs): the rotary
  embedding is applied here, by timm's function, to the tokens after the prefix tokens, and fp4vis gets the
  rotated q and k. (``fp4vis.QKTransform`` is not used: it rotates every token, where these layers leave the
  class token alone, and the Hopper pre-pass folds a rotary embedding only together with RMS norms across
  heads, which these layers do not have.) Grouped key/value heads are repeated as the class repeats them;
* ``timm.models.swin_transformer.WindowAttention``: found and kept exact, with the reason: every call adds a
  relative position bias to the logits, which fp4vis.attention cannot.

An ``attn_mask`` that is a key-padding mask (``masks.key_padding_mask``) is passed as ``key_mask``; any other
mask, causal attention, dropout in training keep exact attention with the reason. Other timm attention
classes (``DiffAttention``, Swin V2's, ``AttentionPoolLatent``, ...) are reported as unsupported. The layer
index is the position among the model's supported attention modules in module order (the block index).
"""

from __future__ import annotations

import types
from collections.abc import Callable
from typing import Any, NamedTuple

import torch
import torch.nn.functional as F
from timm.layers import Attention
from timm.layers.attention import AttentionRope
from timm.layers.pos_embed_sincos import apply_rot_embed_cat
from timm.models.eva import EvaAttention
from timm.models.swin_transformer import WindowAttention

from .layer import STATE_ATTR, LayerSpec, LayerState
from .masks import key_padding_mask

__all__ = ["find_layers", "install", "uninstall", "is_known_non_attention"]

PATCHER = "timm"
WINDOW_REASON = ("Swin window attention adds a relative position bias to the logits (an additive bias; "
                 "fp4vis.attention takes key-padding masks only)")
_OUTPUT = ("scale", "attn_drop", "norm", "proj", "proj_drop", "q_norm", "k_norm", "num_heads", "head_dim")


def _qkv_fused(m: torch.nn.Module, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    B, N, _ = x.shape
    q, k, v = m.qkv(x).reshape(B, N, 3, m.num_heads, m.head_dim).permute(2, 0, 3, 1, 4).unbind(0)
    return q, k, v


def _rotated(m: torch.nn.Module, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
             rope: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    """q, k with the rotary embedding on the tokens after the prefix tokens, as AttentionRope and EvaAttention."""
    if rope is None:
        return q, k
    npt, half = m.num_prefix_tokens, getattr(m, "rotate_half", False)
    q = torch.cat([q[:, :, :npt, :], apply_rot_embed_cat(q[:, :, npt:, :], rope, half=half)], dim=2).type_as(v)
    k = torch.cat([k[:, :, :npt, :], apply_rot_embed_cat(k[:, :, npt:, :], rope, half=half)], dim=2).type_as(v)
    return q, k


def _qkv_attention(m: Attention, x: torch.Tensor, rope: None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    q, k, v = _qkv_fused(m, x)
    return m.q_norm(q), m.k_norm(k), v


def _qkv_attention_rope(m: AttentionRope, x: torch.Tensor,
                        rope: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    B, N, _ = x.shape
    if m.qkv is not None:
        q, k, v = _qkv_fused(m, x)
    else:
        q = m.q_proj(x).reshape(B, N, m.num_heads, m.head_dim).transpose(1, 2)
        k = m.k_proj(x).reshape(B, N, m.num_kv_heads, m.head_dim).transpose(1, 2)
        v = m.v_proj(x).reshape(B, N, m.num_kv_heads, m.head_dim).transpose(1, 2)
    q, k = _rotated(m, m.q_norm(q), m.k_norm(k), v, rope)
    if m.num_kv_groups > 1:
        k = k.repeat_interleave(m.num_kv_groups, dim=1)
        v = v.repeat_interleave(m.num_kv_groups, dim=1)
    return q, k, v


def _qkv_eva(m: EvaAttention, x: torch.Tensor,
             rope: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    B, N, _ = x.shape
    if m.qkv is not None:
        if m.q_bias is None:
            qkv = m.qkv(x)
        else:
            qkv_bias = torch.cat((m.q_bias, m.k_bias, m.v_bias))
            if m.qkv_bias_separate:
                qkv = m.qkv(x)
                qkv += qkv_bias
            else:
                qkv = F.linear(x, weight=m.qkv.weight, bias=qkv_bias)
        q, k, v = qkv.reshape(B, N, 3, m.num_heads, -1).permute(2, 0, 3, 1, 4).unbind(0)
    else:
        q = m.q_proj(x).reshape(B, N, m.num_heads, -1).transpose(1, 2)
        k = m.k_proj(x).reshape(B, N, m.num_heads, -1).transpose(1, 2)
        v = m.v_proj(x).reshape(B, N, m.num_heads, -1).transpose(1, 2)
    q, k = _rotated(m, m.q_norm(q), m.k_norm(k), v, rope)
    return q, k, v


def _output(m: torch.nn.Module, x: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """The class's steps after attention: heads merged, scale norm, gate, projection."""
    B, N, _ = x.shape
    y = m.norm(out.transpose(1, 2).reshape(B, N, -1))
    gate = getattr(m, "gate", None)
    if gate is not None:
        y = y * gate(x).sigmoid()
    return m.proj_drop(m.proj(y))


def _fp4(m: torch.nn.Module, x: torch.Tensor, rope: torch.Tensor | None, attn_mask: torch.Tensor | None,
         is_causal: bool) -> torch.Tensor | None:
    """The layer's output with fp4vis attention, or None where it keeps the class's exact forward."""
    st: LayerState | None = m.__dict__.get(STATE_ATTR)
    if st is None or not st.needs_qkv():
        return None
    q, k, v = _KINDS[type(m)].qkv(m, x, rope)
    key_mask, reason = key_padding_mask(attn_mask, q, k)
    layer_call = st.select(q, k, v, layout="bhsd", scale=m.scale, dropout_p=m.attn_drop.p if m.training else 0.0,
                           is_causal=is_causal, extra_reason=reason, key_mask=key_mask)
    if layer_call is None:
        return None
    return _output(m, x, st.attention(layer_call))


def _forward(self: Attention, x: torch.Tensor, attn_mask: torch.Tensor | None = None,
             is_causal: bool = False) -> torch.Tensor:
    out = _fp4(self, x, None, attn_mask, is_causal)
    return type(self).forward(self, x, attn_mask=attn_mask, is_causal=is_causal) if out is None else out


def _forward_rope(self: torch.nn.Module, x: torch.Tensor, rope: torch.Tensor | None = None,
                  attn_mask: torch.Tensor | None = None, is_causal: bool = False) -> torch.Tensor:
    out = _fp4(self, x, rope, attn_mask, is_causal)
    if out is None:
        return type(self).forward(self, x, rope=rope, attn_mask=attn_mask, is_causal=is_causal)
    return out


def _forward_window(self: WindowAttention, x: torch.Tensor, mask: torch.Tensor | None = None) -> torch.Tensor:
    st: LayerState | None = self.__dict__.get(STATE_ATTR)
    if st is not None and st.active_policy() is not None:
        st.fallback(WINDOW_REASON)
    return type(self).forward(self, x, mask=mask)


class _Kind(NamedTuple):
    qkv: Callable | None        # (module, x, rope) -> q, k, v as (B, H, S, D); None: always exact
    forward: Callable           # the instance forward, with the class's signature
    required: tuple[str, ...]   # attributes the computation reads (another timm version may lack them)


_KINDS: dict[type, _Kind] = {
    Attention: _Kind(_qkv_attention, _forward, ("qkv", *_OUTPUT)),
    AttentionRope: _Kind(_qkv_attention_rope, _forward_rope,
                         ("qkv", "q_proj", "k_proj", "v_proj", "num_kv_heads", "num_kv_groups", "num_prefix_tokens",
                          *_OUTPUT)),
    EvaAttention: _Kind(_qkv_eva, _forward_rope,
                        ("qkv", "q_bias", "k_bias", "v_bias", "qkv_bias_separate", "q_proj", "k_proj", "v_proj",
                         "num_prefix_tokens", *_OUTPUT)),
    WindowAttention: _Kind(None, _forward_window, ("qkv", "num_heads")),
}


def _kind(m: torch.nn.Module) -> _Kind | None:
    kind = _KINDS.get(type(m))
    return kind if kind is not None and all(hasattr(m, a) for a in kind.required) else None


def _heads(m: torch.nn.Module) -> tuple[int, int]:
    head_dim = getattr(m, "head_dim", None)
    return m.num_heads, head_dim if isinstance(head_dim, int) else m.qkv.out_features // (3 * m.num_heads)


def find_layers(root: torch.nn.Module, *, cross_attention: bool = False, decoder: bool = False) -> list[LayerSpec]:
    specs = []
    for name, m in root.named_modules():
        if _kind(m) is not None:
            heads, head_dim = _heads(m)
            specs.append(LayerSpec(name=name, module=m, index=len(specs), group="attn", default=True,
                                   patcher=PATCHER, num_heads=heads, head_dim=head_dim))
    return specs


def is_known_non_attention(module: torch.nn.Module) -> bool:
    return False


def install(spec: LayerSpec, state: LayerState) -> Any:
    m = spec.module
    if "forward" in m.__dict__:
        raise RuntimeError(f"layer {spec.name!r} already has an instance-level forward (patched by something "
                           "else?); fp4vis will not wrap it")
    m.forward = types.MethodType(_KINDS[type(m)].forward, m)
    return None


def uninstall(spec: LayerSpec, state: LayerState, token: Any) -> None:
    m = spec.module
    fwd = m.__dict__.get("forward")
    if isinstance(fwd, types.MethodType) and fwd.__func__ is _KINDS[type(m)].forward:
        del m.__dict__["forward"]
