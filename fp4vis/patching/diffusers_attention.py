"""diffusers attention layers whose processor computes softmax attention through torch's SDPA (patcher
``"diffusers"``): FLUX, Qwen-Image, HunyuanVideo 1.0 / 1.5, LTX-Video, CogVideoX, SkyReels-V2, Mochi, SD3,
PixArt, Sana's cross-attention, the UNets, ... (Wan's ``WanAttention`` goes to ``fp4vis.patching.wan`` first).

A layer is a diffusers attention module (``AttentionModuleMixin``, ``Attention``, ``MochiAttention``) whose
processor's ``__call__`` calls ``dispatch_attention_fn`` or ``F.scaled_dot_product_attention``; a processor that
computes attention otherwise (Sana's linear attention, xformers, the sliced and baddbmm processors) or holds
weights of its own (an ``nn.Module``: IP-Adapter, custom diffusion) is not reached and is reported as unsupported.

Per patched layer, ``attn.set_processor`` installs an :class:`FP4AttnProcessor` around the layer's processor
object (``remove()`` sets that object back). It runs the original processor inside a ``TorchFunctionMode``
(``_SDPARouter``) scoped to that call, which takes the processor's ``F.scaled_dot_product_attention`` calls
(diffusers' native backend ends in one): ``LayerState.select`` decides, and the call becomes
``fp4vis.attention`` (``LayerState.attention``) or goes on to SDPA unchanged, with the layer's one
``FallbackWarning`` (``FallbackError`` with ``strict=True``) naming the reason: causal, dropout, grouped-query,
a mask form fp4vis does not take, a head dim or dtype the backend lacks. Everything else the processor does
(projections, q/k norms, rotary embeddings, the output projection) is diffusers' own code, bit for bit.

Masks: a bool mask with one value per batch element and key, broadcast over heads and queries (Qwen-Image's and
HunyuanVideo's text padding, (B, 1, 1, S)) becomes ``key_mask``; ``layer.broadcast_key_mask`` reads shapes and
strides only, so compiled and eager calls decide alike. HunyuanVideo 1.5's processor builds its joint padding mask
as ``valid_q & valid_k`` (B, 1, S, S): for it (``PAIRWISE_MASK_PROCESSORS``) the diagonal is the key mask and the
rows of padded queries are zero, as SDPA returns them. Additive masks (LTX's, PixArt's and Sana's -10000 text
bias, cross-attention only), per-query masks (HunyuanVideo's token refiner, SkyReels-V2's diffusion-forcing causal
mask) keep exact attention naming the form. Mochi attends each batch element over its valid tokens without a mask.

Attention backends: the layers whose processor dispatches to a backend that ends in SDPA (``SDPA_BACKENDS``:
``native``, the default, and ``_native_flash`` / ``_native_efficient`` / ``_native_math``) run FP4; any other
backend (flash-attn, sage, flex, xformers, cuDNN, hub kernels), chosen per layer (``set_attention_backend``) or
for the process (``attention_backend(...)``, ``DIFFUSERS_ATTN_BACKEND``), is the user's choice of exact attention
library: the layer keeps it, with the fallback warning naming the backend. So does a layer under diffusers'
context parallelism (fp4vis's own covers the Wan layers: ``fp4vis.patching.context_parallel``), and a call of a
processor that made no SDPA call at all.

Groups: ``"self"`` (one token stream, which may hold text and image tokens: FLUX's single blocks, CogVideoX),
``"joint"`` (two streams with their own projections: FLUX/SD3/Qwen-Image/HunyuanVideo double blocks, Mochi),
both default; ``"cross"`` (k and v from the text encoder: ``is_cross_attention``, else a layer named ``attn2``)
with ``cross_attention=True`` or a name pattern; ``"text"`` (attention over the prompt alone, under a
``context_embedder``: HunyuanVideo's token refiner) by name pattern only. The index is the block index within
its stack (``LayerSpec.stack``: ``transformer_blocks``, ``single_transformer_blocks``, ...).

torch.compile: the processor, the mode and the FP4 call trace with ``fullgraph=True`` (the mode is entered and
left inside the graph; the processor class keeps the original's ``__call__`` signature, by which diffusers'
attention modules filter the keyword arguments they pass).

Private diffusers names relied on (``tests/patching/test_diffusers_attention.py`` pins each against the installed
diffusers): ``attention_dispatch._AttentionBackendRegistry._active_backend`` (the process-wide backend); the
processors' ``_attention_backend`` and ``_parallel_config`` attributes (what ``set_attention_backend`` and
``enable_parallelism`` set); the native backend calling ``F.scaled_dot_product_attention``; the mask that
``HunyuanVideo15AttnProcessor2_0`` builds.
"""

from __future__ import annotations

import functools
import inspect
from typing import Any

import torch
import torch.nn.functional as F
from diffusers.models.attention import AttentionModuleMixin
from diffusers.models.attention_dispatch import _AttentionBackendRegistry
from diffusers.models.attention_processor import Attention, MochiAttention
from torch.overrides import TorchFunctionMode

from .layer import LayerSpec, LayerState, block_position, broadcast_key_mask

__all__ = ["FP4AttnProcessor", "PAIRWISE_MASK_PROCESSORS", "SDPA_BACKENDS", "attention_route", "find_layers",
           "install", "is_known_non_attention", "layer_group", "uninstall"]

#: diffusers attention backends whose function ends in ``F.scaled_dot_product_attention`` (without context
#: parallelism): the ones whose call a patched layer takes
SDPA_BACKENDS = ("native", "_native_flash", "_native_efficient", "_native_math")
#: processors whose SDPA mask is, by construction, ``valid[:, None, :, None] & valid[:, None, None, :]``
PAIRWISE_MASK_PROCESSORS = ("diffusers.models.transformers.transformer_hunyuan_video15.HunyuanVideo15AttnProcessor2_0",)
#: a layer under a module of this name attends over the prompt tokens alone (group "text")
TEXT_PATH_PARTS = ("context_embedder",)

_ATTENTION_CLASSES = (AttentionModuleMixin, Attention, MochiAttention)
_SDPA = F.scaled_dot_product_attention
_SDPA_PARAMS = ("query", "key", "value", "attn_mask", "dropout_p", "is_causal", "scale", "enable_gqa")
_SDPA_DEFAULTS = {"attn_mask": None, "dropout_p": 0.0, "is_causal": False, "scale": None, "enable_gqa": False}


def _qualname(cls: type) -> str:
    return f"{cls.__module__}.{cls.__qualname__}"


@functools.cache
def attention_route(processor_cls: type) -> str | None:
    """How a processor class computes attention: ``"dispatch"`` (``dispatch_attention_fn``, its backend
    chosen by diffusers), ``"sdpa"`` (``F.scaled_dot_product_attention`` itself) or None (neither: not reached).
    Read from the names its ``__call__`` refers to."""
    code = getattr(processor_cls.__call__, "__code__", None)
    names = set(code.co_names) if code is not None else set()
    if "dispatch_attention_fn" in names:
        return "dispatch"
    if "scaled_dot_product_attention" in names:
        return "sdpa"
    return None


def _original(processor: Any) -> Any:
    return processor.original if isinstance(processor, FP4AttnProcessor) else processor


def layer_group(name: str, module: torch.nn.Module) -> str:
    """The layer's group (module docstring): "text", "cross", "joint" or "self"."""
    if any(part in TEXT_PATH_PARTS for part in name.split(".")):
        return "text"
    cross = getattr(module, "is_cross_attention", None)
    if cross:
        return "cross"
    if getattr(module, "added_kv_proj_dim", None) is not None or getattr(module, "add_k_proj", None) is not None:
        return "joint"
    if cross is None and name.rsplit(".", 1)[-1] == "attn2":   # diffusers' name of cross-attention
        return "cross"
    return "self"


def _heads(module: torch.nn.Module) -> tuple[int, int]:
    heads = getattr(module, "heads", None) or 0
    head_dim = getattr(module, "head_dim", None) or getattr(module, "dim_head", None)
    inner = getattr(module, "inner_dim", None)
    if not head_dim and heads and inner:
        head_dim = inner // heads
    return int(heads), int(head_dim or 0)


def _reached(module: torch.nn.Module) -> bool:
    if not isinstance(module, _ATTENTION_CLASSES):
        return False
    proc = _original(getattr(module, "processor", None))
    return proc is not None and not isinstance(proc, torch.nn.Module) and attention_route(type(proc)) is not None


def find_layers(root: torch.nn.Module, *, cross_attention: bool = False, decoder: bool = False) -> list[LayerSpec]:
    specs, position = [], 0
    for name, m in root.named_modules():
        if not _reached(m):
            continue
        group = layer_group(name, m)
        block = block_position(name)
        stack, index = block if block is not None else (None, position)
        position += 1
        heads, head_dim = _heads(m)
        specs.append(LayerSpec(name=name, module=m, index=index, group=group,
                               default=group in ("self", "joint") or (group == "cross" and cross_attention),
                               patcher="diffusers", num_heads=heads, head_dim=head_dim, stack=stack))
    return specs


def is_known_non_attention(module: torch.nn.Module) -> bool:
    """diffusers modules named like attention that are no attention layer: blocks that hold attention layers,
    and attention pooling (one query over the prompt: Mochi's ``MochiAttentionPool``)."""
    cls = type(module)
    if not cls.__module__.startswith("diffusers.") or isinstance(module, _ATTENTION_CLASSES):
        return False
    return cls.__name__.endswith("AttentionPool") or any(isinstance(c, _ATTENTION_CLASSES) for c in module.modules())


def install(spec: LayerSpec, state: LayerState) -> Any:
    attn = spec.module
    original = attn.processor
    if isinstance(original, FP4AttnProcessor):
        raise RuntimeError(f"layer {spec.name!r} already has an fp4vis processor")
    _set_processor(attn, _processor_class(type(original))(state, original))
    return original


def uninstall(spec: LayerSpec, state: LayerState, original: Any) -> None:
    attn = spec.module
    current = attn.processor
    if isinstance(current, FP4AttnProcessor) and current.state is state:
        _set_processor(attn, original)


def _set_processor(attn: torch.nn.Module, processor: Any) -> None:
    """``attn.set_processor``, or the attribute for a module without it (``MochiAttention``)."""
    if hasattr(attn, "set_processor"):
        attn.set_processor(processor)
    else:
        attn.processor = processor


class FP4AttnProcessor:
    """The processor of one patched layer: the original processor object, run with the layer's SDPA calls
    routed to fp4vis (module docstring). ``original`` is restored by ``remove()``; the attention-backend and
    context-parallel settings diffusers sets on a layer's processor land on it. Instances are made through
    ``_processor_class``, whose ``__call__`` carries the original class's signature."""

    def __init__(self, state: LayerState, original: Any):
        self.state = state
        self.original = original
        self.route = attention_route(type(original))
        self.pairwise_mask = _qualname(type(original)) in PAIRWISE_MASK_PROCESSORS

    # Absent where the original has none (AttributeError: hasattr is how diffusers asks)
    @property
    def _attention_backend(self):
        return self.original._attention_backend

    @_attention_backend.setter
    def _attention_backend(self, value):
        self.original._attention_backend = value

    @property
    def _parallel_config(self):
        return self.original._parallel_config

    @_parallel_config.setter
    def _parallel_config(self, value):
        self.original._parallel_config = value

    def _exact_reason(self) -> str | None:
        """Why no call of this processor can be taken, whatever its inputs (None: the calls decide)."""
        if getattr(self.original, "_parallel_config", None) is not None:
            return ("diffusers context parallelism (a parallel config on the processor; fp4vis's context-parallel "
                    "attention covers the Wan layers)")
        if self.route == "dispatch":
            backend = getattr(self.original, "_attention_backend", None) or _AttentionBackendRegistry._active_backend
            name = getattr(backend, "value", backend)
            if name not in SDPA_BACKENDS:
                return (f"diffusers attention backend {name!r} (fp4vis takes the calls of the backends that end in "
                        f"torch's scaled_dot_product_attention: {', '.join(SDPA_BACKENDS)})")
        return None

    def _run(self, attn: torch.nn.Module, args: tuple, kwargs: dict) -> Any:
        st = self.state
        if not st.needs_qkv():
            return self.original(attn, *args, **kwargs)
        reason = self._exact_reason()
        if reason is not None:
            if st.active_policy() is not None:
                st.fallback(reason)
            return self.original(attn, *args, **kwargs)
        router = _SDPARouter(st, self.pairwise_mask)
        with router:
            out = self.original(attn, *args, **kwargs)
        if router.sdpa_calls == 0 and st.active_policy() is not None:
            st.fallback(f"its processor {type(self.original).__name__} made no scaled_dot_product_attention call")
        return out

    def __repr__(self) -> str:
        return f"FP4AttnProcessor({type(self.original).__name__}, {self.state!r})"


@functools.cache
def _processor_class(original_cls: type) -> type:
    """The ``FP4AttnProcessor`` subclass for processors of ``original_cls``: its ``__call__`` has the original's
    signature, from which diffusers' ``Attention.forward`` (and FLUX's, LTX's, ...) picks the keyword arguments it
    passes (an image rotary embedding, a text mask)."""
    def __call__(self, attn, *args, **kwargs):
        return self._run(attn, args, kwargs)

    __call__.__signature__ = inspect.signature(original_cls.__call__)
    return type(f"FP4{original_cls.__name__}", (FP4AttnProcessor,), {"__call__": __call__, "__module__": __name__})


class _SDPARouter(TorchFunctionMode):
    """The ``F.scaled_dot_product_attention`` calls of one processor call, for one layer (module docstring);
    every other torch function passes through. Inside ``__torch_function__`` the mode is off, so SDPA and
    ``fp4vis.attention`` run as they are."""

    def __init__(self, state: LayerState, pairwise_mask: bool):
        super().__init__()
        self.state = state
        self.pairwise_mask = pairwise_mask
        self.sdpa_calls = 0

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is not _SDPA:
            return func(*args, **kwargs)
        self.sdpa_calls += 1
        call = dict(_SDPA_DEFAULTS)
        call.update(zip(_SDPA_PARAMS, args))
        call.update(kwargs)
        q, k, v, mask = call["query"], call["key"], call["value"], call["attn_mask"]
        key_mask = query_rows = reason = None
        if mask is not None:
            if self.pairwise_mask and _is_square_bool(mask, q, k):
                key_mask = query_rows = mask[:, 0].diagonal(dim1=-2, dim2=-1)   # valid (B, S)
            else:
                key_mask, reason = broadcast_key_mask(mask, q, k)
        st = self.state
        pol = st.select(q, k, v, layout="bhsd", scale=call["scale"], dropout_p=call["dropout_p"],
                        is_causal=call["is_causal"], extra_reason=reason, key_mask=key_mask)
        if pol is None:
            return func(*args, **kwargs)
        out = st.attention(q, k, v, pol, layout="bhsd", scale=call["scale"], key_mask=key_mask)
        if query_rows is not None:   # a query that attends to no key: SDPA's zero row
            out = out.masked_fill(~query_rows[:, None, :, None], 0)
        return out


def _is_square_bool(mask: Any, q: torch.Tensor, k: torch.Tensor) -> bool:
    return (isinstance(mask, torch.Tensor) and mask.dtype == torch.bool and mask.dim() == 4
            and tuple(mask.shape) == (q.shape[0], 1, q.shape[2], k.shape[2]) and q.shape[2] == k.shape[2])
