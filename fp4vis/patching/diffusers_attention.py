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
HunyuanVideo's text padding, (B, 1, 1, S)) becomes ``key_mask``; ``fp4vis.call.broadcast_key_mask`` reads
shapes and strides only, so compiled and eager calls decide alike. HunyuanVideo 1.5's processor builds its joint
padding mask as ``valid_q & valid_k`` (B, 1, S, S): for it (``PAIRWISE_MASK_PROCESSORS``) the diagonal is the key
mask and the rows of padded queries are zero, as SDPA returns them. Additive masks (LTX's, PixArt's and Sana's
-10000 text bias, cross-attention only), per-query masks (HunyuanVideo's token refiner, SkyReels-V2's
diffusion-forcing causal mask) keep exact attention naming the form. Mochi attends each batch element over its valid
tokens without a mask.

Attention backends: the layers whose processor dispatches to a backend that ends in SDPA (``SDPA_BACKENDS``:
``native``, the default, and ``_native_flash`` / ``_native_efficient`` / ``_native_math``) run FP4; any other
backend (flash-attn, sage, flex, xformers, cuDNN, hub kernels), chosen per layer (``set_attention_backend``) or
for the process (``attention_backend(...)``, ``DIFFUSERS_ATTN_BACKEND``), is the user's choice of exact attention
library: the layer keeps it, with the fallback warning naming the backend. So does a call of a processor that
made no SDPA call at all.

Context parallelism (``enable_parallelism(config=ContextParallelConfig(...))``, before or after patching; the
settings land on the original processor): diffusers' hooks split the sequence and gather it, and its processors
would hand their shard to diffusers' context-parallel attention. A patched layer runs the original processor with
its parallel config set aside for the call (``_local_attention``), so its SDPA call is on this rank's shard, and
its router (``_ParallelSDPARouter``, the one-GPU router's subclass) hands that to
``fp4vis.patching.context_parallel.shard_attention`` (Ulysses, ring, both: the collectives the Wan layers use too),
the key mask with its keys; the calls it keeps exact go to diffusers' own context-parallel attention
(``dispatch_attention_fn`` with the parallel config). diffusers splits the text and image streams of a joint layer
separately, so a rank's sequence is its text shard and its image shard joined; the FP4 path puts the gathered
tokens in one GPU's order (``JOINT_STREAM_ORDER``: which stream the processor puts first; the local lengths come
from its ``hidden_states`` and ``encoder_hidden_states``), which makes Ulysses one GPU's call, bit for bit. A
single-stream block that joins the streams before its attention (FLUX's: a joint processor called without text)
has the length of the joint layers' calls of the same forward and takes their streams
(``PatchHandle.joint_streams``); where no joint layer ran FP4 at that length, it keeps diffusers' attention, saying
so. A joint processor not in the table
keeps diffusers' attention, with the warning naming it; so do per-query masks (HunyuanVideo 1.5's) and patched
cross-attention and text-only layers (a model's plan may split the text, LTX-Video's, or keep it whole on every
rank, Wan-style processors, which then make that call without the parallel config).

Groups: ``"self"`` (one token stream, which may hold text and image tokens: FLUX's single blocks, CogVideoX),
``"joint"`` (two streams with their own projections: FLUX/SD3/Qwen-Image/HunyuanVideo double blocks, Mochi),
both default; ``"cross"`` (k and v from the text encoder: ``is_cross_attention``, else a layer named ``attn2``)
with ``cross_attention=True`` or a name pattern; ``"text"`` (attention over the prompt alone, under a
``context_embedder``: HunyuanVideo's token refiner) by name pattern only. The index is the block index within
its stack (``LayerSpec.stack``: ``transformer_blocks``, ``single_transformer_blocks``, ...).

torch.compile: the processor, the mode and the FP4 call trace with ``fullgraph=True`` (the mode is entered and
left inside the graph; the processor class keeps the original's ``__call__`` signature, by which diffusers'
attention modules filter the keyword arguments they pass).

Another attention function instead of fp4vis (a BF16 attention library as a baseline:
``fp4vis.patching.attention_function``): ``install_function`` sets a :class:`FunctionAttnProcessor`, the same
wrapping of the original processor with another mode (``_FunctionRouter``), which hands the SDPA calls that
``function_call_reason`` lets through (no mask or a key-padding one, non-causal, no dropout, (B, H, S, D) q, k,
v of one head count) to ``fn(q, k, v, scale)`` (a key-padding mask too where ``fn.takes_key_mask``: ``fn(q, k, v, scale,
key_mask)``) and the others on to SDPA unchanged, each call told to a ``tally`` (None, or the
reason it kept SDPA); ``restore_processor`` sets the original back.

Private diffusers names relied on (``tests/patching/test_diffusers_attention.py`` pins each against the installed
diffusers): ``attention_dispatch._AttentionBackendRegistry._active_backend`` (the process-wide backend); the
processors' ``_attention_backend`` and ``_parallel_config`` attributes (what ``set_attention_backend`` and
``enable_parallelism`` set); the native backend calling ``F.scaled_dot_product_attention``; the mask that
``HunyuanVideo15AttnProcessor2_0`` builds.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
from collections.abc import Callable, Iterator
from typing import Any, NamedTuple

import torch
import torch.nn.functional as F
from diffusers.models.attention import AttentionModuleMixin
from diffusers.models.attention_dispatch import _AttentionBackendRegistry, dispatch_attention_fn
from diffusers.models.attention_processor import Attention, MochiAttention
from torch.overrides import TorchFunctionMode

from fp4vis.call import broadcast_key_mask

from . import context_parallel
from .layer import LayerCall, LayerSpec, LayerState, block_position

__all__ = ["CONTEXT_PARALLEL_SDPA_BACKENDS", "FP4AttnProcessor", "FunctionAttnProcessor", "PAIRWISE_MASK_PROCESSORS",
           "SDPA_BACKENDS",
           "attention_route", "find_layers", "function_call_reason", "install", "install_function",
           "is_known_non_attention", "layer_group", "restore_processor", "uninstall"]

#: diffusers attention backends whose function ends in ``F.scaled_dot_product_attention`` (without context
#: parallelism): the ones whose call a patched layer takes
SDPA_BACKENDS = ("native", "_native_flash", "_native_efficient", "_native_math")
#: under diffusers' context parallelism also ``_native_cudnn``, which ends in SDPA too without a parallel config (the
#: FP4 path sets the config aside) and which the apps give exact self-attention under ring (its ring attention
#: returns the log-sum-exp: ``fp4vis.pipelines.context_parallel.RING_EXACT_BACKEND``)
CONTEXT_PARALLEL_SDPA_BACKENDS = (*SDPA_BACKENDS, "_native_cudnn")
#: processors whose SDPA mask is, by construction, ``valid[:, None, :, None] & valid[:, None, None, :]``
PAIRWISE_MASK_PROCESSORS = ("diffusers.models.transformers.transformer_hunyuan_video15.HunyuanVideo15AttnProcessor2_0",)
#: joint processors (text and image tokens with projections of their own): which stream comes first in the sequence
#: of their attention (the processor concatenates them), read under context parallelism (module docstring)
JOINT_STREAM_ORDER = {
    "diffusers.models.transformers.transformer_flux.FluxAttnProcessor": "text",
    "diffusers.models.transformers.transformer_qwenimage.QwenDoubleStreamAttnProcessor2_0": "text",
    "diffusers.models.transformers.transformer_hunyuan_video.HunyuanVideoAttnProcessor2_0": "image",
}
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
    if isinstance(original, _WrappingProcessor):
        raise RuntimeError(f"layer {spec.name!r} already has an fp4vis processor")
    _set_processor(attn, _processor_class(type(original), FP4AttnProcessor)(state, original))
    return original


def uninstall(spec: LayerSpec, state: LayerState, original: Any) -> None:
    attn = spec.module
    current = attn.processor
    if isinstance(current, FP4AttnProcessor) and current.state is state:
        _set_processor(attn, original)


def install_function(name: str, attn: torch.nn.Module, fn: Callable[..., torch.Tensor],
                     tally: Callable[[str | None], None]) -> Any:
    """Set a :class:`FunctionAttnProcessor` on layer ``attn`` (named ``name``): its calls computed by
    ``fn(q, k, v, scale)`` (bhsd), each call told to ``tally`` (module docstring). Returns the processor
    object it replaced, for ``restore_processor``."""
    original = attn.processor
    if isinstance(original, _WrappingProcessor):
        raise RuntimeError(f"layer {name!r} already has an fp4vis processor ({type(original).__name__}); remove "
                           "its patch handle (or leave the attention_function_applied block) first")
    _set_processor(attn, _processor_class(type(original), FunctionAttnProcessor)(fn, tally, original))
    return original


def restore_processor(attn: torch.nn.Module, original: Any) -> None:
    """Set ``original`` back as the processor of ``attn``."""
    _set_processor(attn, original)


def _set_processor(attn: torch.nn.Module, processor: Any) -> None:
    """``attn.set_processor``, or the attribute for a module without it (``MochiAttention``)."""
    if hasattr(attn, "set_processor"):
        attn.set_processor(processor)
    else:
        attn.processor = processor


class _WrappingProcessor:
    """A processor that runs a layer's original processor object with its SDPA calls routed elsewhere (the
    subclasses: where to). The attention-backend and context-parallel settings diffusers sets on a layer's
    processor land on ``original``. Instances are made through ``_processor_class``, whose ``__call__``
    carries the original class's signature."""

    prefix = ""   # of the generated class names: FP4FluxAttnProcessor, FunctionFluxAttnProcessor

    def __init__(self, original: Any):
        self.original = original
        self.route = attention_route(type(original))

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
        if self.route == "dispatch":
            backend = getattr(self.original, "_attention_backend", None) or _AttentionBackendRegistry._active_backend
            name = getattr(backend, "value", backend)
            parallel = getattr(self.original, "_parallel_config", None) is not None
            if name not in (CONTEXT_PARALLEL_SDPA_BACKENDS if parallel else SDPA_BACKENDS):
                return (f"diffusers attention backend {name!r} (fp4vis takes the calls of the backends that end in "
                        f"torch's scaled_dot_product_attention: {', '.join(SDPA_BACKENDS)})")
        return None

    def _no_sdpa_reason(self) -> str:
        return f"its processor {type(self.original).__name__} made no scaled_dot_product_attention call"


class FP4AttnProcessor(_WrappingProcessor):
    """The processor of one patched layer: the original processor object, run with the layer's SDPA calls
    routed to fp4vis (module docstring). ``original`` is restored by ``remove()``."""

    prefix = "FP4"

    def __init__(self, state: LayerState, original: Any):
        super().__init__(original)
        self.state = state
        self.pairwise_mask = _qualname(type(original)) in PAIRWISE_MASK_PROCESSORS

    def _run(self, attn: torch.nn.Module, args: tuple, kwargs: dict) -> Any:
        st = self.state
        if not st.needs_qkv():
            return self.original(attn, *args, **kwargs)
        reason = self._exact_reason()
        parallel = None
        if reason is None:
            parallel = self._parallel_call(attn, args, kwargs)
            reason = parallel if isinstance(parallel, str) else None
        if reason is not None:
            if st.active_policy() is not None:
                st.fallback(reason)
            return self.original(attn, *args, **kwargs)
        router = (_SDPARouter(st, self.pairwise_mask) if parallel is None
                  else _ParallelSDPARouter(st, parallel))
        with router, _local_attention(self.original, parallel):
            out = self.original(attn, *args, **kwargs)
        if router.sdpa_calls == 0 and st.active_policy() is not None:
            st.fallback(self._no_sdpa_reason())
        return out

    def _parallel_call(self, attn: torch.nn.Module, args: tuple, kwargs: dict) -> _ParallelCall | str | None:
        """Under diffusers' context parallelism: how this call's SDPA calls run FP4 (``fp4vis.patching.
        context_parallel``, every rank alike), or why they keep diffusers' own context-parallel attention; None
        without it. Raises ``ContextParallelError`` for what no policy can run (before any collective)."""
        config = getattr(self.original, "_parallel_config", None)
        groups = context_parallel.groups_of(config)
        if groups is None:
            return None
        context_parallel.check_layer(self.state, groups, _heads(attn)[0])
        if self.pairwise_mask:
            return "a per-query padding mask under context parallelism (its rows are one rank's queries)"
        if self.state.group in ("cross", "text"):
            what = "cross-attention" if self.state.group == "cross" else "attention over the prompt alone"
            return (f"{what} under context parallelism (whether its text is split is the model's plan's and its "
                    "processor's choice: diffusers' own attention follows it)")
        backend = getattr(self.original, "_attention_backend", None)
        hidden = _argument(type(self.original), "hidden_states", args, kwargs)
        text = _argument(type(self.original), "encoder_hidden_states", args, kwargs)
        seen = self.state.handle.joint_streams if self.state.handle is not None else {}
        first = JOINT_STREAM_ORDER.get(_qualname(type(self.original)))
        if text is None and first is not None:   # a single-stream block of a joint model (FLUX's): the joint order
            streams = seen.get(hidden.shape[1])
            if streams is None:
                return (f"context parallelism: this {type(self.original).__name__} call attends over the text and "
                        "image tokens its block joined, in the order of the model's joint layers, none of which ran "
                        "FP4 with this length")
            return _ParallelCall(groups, config, backend, streams)
        if text is None:
            return _ParallelCall(groups, config, backend, None)
        if first is None:
            return (f"context parallelism: fp4vis does not know in which order {type(self.original).__name__} "
                    "joins its text and image tokens, which diffusers splits separately")
        streams = (text.shape[1], hidden.shape[1]) if first == "text" else (hidden.shape[1], text.shape[1])
        seen[sum(streams)] = streams
        return _ParallelCall(groups, config, backend, streams)

    def __repr__(self) -> str:
        return f"FP4AttnProcessor({type(self.original).__name__}, {self.state!r})"


class FunctionAttnProcessor(_WrappingProcessor):
    """The processor of a layer whose attention is another function (``install_function``, for
    ``fp4vis.patching.attention_function.attention_function_applied``): the original processor object, run
    with its SDPA calls that ``function_call_reason`` lets through computed by ``fn(q, k, v, scale)`` on
    (B, H, S, D) tensors, every other call by SDPA unchanged. Each call is told to ``tally``: None for a call
    ``fn`` computed, else the reason it kept SDPA."""

    prefix = "Function"

    def __init__(self, fn: Callable[..., torch.Tensor], tally: Callable[[str | None], None], original: Any):
        super().__init__(original)
        self.fn = fn
        self.tally = tally

    def _run(self, attn: torch.nn.Module, args: tuple, kwargs: dict) -> Any:
        reason = self._exact_reason()
        if getattr(self.original, "_parallel_config", None) is not None:
            reason = "diffusers context parallelism (the function would see this rank's shard of the sequence only)"
        if reason is not None:
            self.tally(reason)
            return self.original(attn, *args, **kwargs)
        router = _FunctionRouter(self.fn, self.tally)
        with router:
            out = self.original(attn, *args, **kwargs)
        if router.sdpa_calls == 0:
            self.tally(self._no_sdpa_reason())
        return out

    def __repr__(self) -> str:
        return f"FunctionAttnProcessor({type(self.original).__name__}, {getattr(self.fn, '__name__', self.fn)!r})"


class _ParallelCall(NamedTuple):
    """A processor call under diffusers' context parallelism: the groups of its device mesh, diffusers' parallel
    config (the exact path: diffusers' own context-parallel attention) and the local lengths of the token streams
    its attention joins (None: one stream)."""

    groups: context_parallel.ContextParallelGroups
    config: Any
    backend: Any
    streams: tuple[int, ...] | None


@contextlib.contextmanager
def _local_attention(processor: Any, parallel: _ParallelCall | None) -> Iterator[None]:
    """Under context parallelism, the processor's attention call made on this rank's shard (its parallel config
    set aside for the call): the router hands it to ``fp4vis.patching.context_parallel``, which does the
    collectives."""
    if parallel is None:
        yield
        return
    processor._parallel_config = None
    try:
        yield
    finally:
        processor._parallel_config = parallel.config


@functools.cache
def _argument_position(processor_cls: type, name: str) -> int | None:
    params = list(inspect.signature(processor_cls.__call__).parameters)
    return params.index(name) - 2 if name in params else None   # after self and attn


def _argument(processor_cls: type, name: str, args: tuple, kwargs: dict) -> Any:
    """A processor call's argument ``name``, given by keyword or position."""
    if name in kwargs:
        return kwargs[name]
    position = _argument_position(processor_cls, name)
    return args[position] if position is not None and 0 <= position < len(args) else None


@functools.cache
def _processor_class(original_cls: type, base: type) -> type:
    """The subclass of ``base`` (``FP4AttnProcessor``, ``FunctionAttnProcessor``) for processors of
    ``original_cls``: its ``__call__`` has the original's signature, from which diffusers' ``Attention.forward``
    (and FLUX's, LTX's, ...) picks the keyword arguments it passes (an image rotary embedding, a text mask)."""
    def __call__(self, attn, *args, **kwargs):
        return self._run(attn, args, kwargs)

    __call__.__signature__ = inspect.signature(original_cls.__call__)
    return type(f"{base.prefix}{original_cls.__name__}", (base,), {"__call__": __call__, "__module__": __name__})


def _sdpa_call(args: tuple, kwargs: dict) -> dict[str, Any]:
    """An ``F.scaled_dot_product_attention`` call's arguments by name, defaults filled in."""
    call = dict(_SDPA_DEFAULTS)
    call.update(zip(_SDPA_PARAMS, args))
    call.update(kwargs)
    return call


# Tensor.unflatten is Python (torch/_tensor.py) ending in ``super().unflatten``, which Dynamo cannot trace where a
# TorchFunctionMode hands it over (torch 2.11, fullgraph=True: FLUX's and Qwen-Image's processors call it); the
# mode runs it as torch.unflatten, the same op in C
_TENSOR_UNFLATTEN = torch.Tensor.unflatten


class _SDPAMode(TorchFunctionMode):
    """The ``F.scaled_dot_product_attention`` calls of one processor call go to ``sdpa`` (the subclasses'),
    counted in ``sdpa_calls``; every other torch function passes through. Inside ``__torch_function__`` the mode
    is off, so what ``sdpa`` calls runs as it is."""

    def __init__(self):
        super().__init__()
        self.sdpa_calls = 0

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is not _SDPA:
            return (torch.unflatten if func is _TENSOR_UNFLATTEN else func)(*args, **kwargs)
        self.sdpa_calls += 1
        return self.sdpa(func, args, kwargs, _sdpa_call(args, kwargs))

    def sdpa(self, func, args: tuple, kwargs: dict, call: dict[str, Any]) -> torch.Tensor:
        """One SDPA call: ``func(*args, **kwargs)`` is SDPA itself; ``call`` its arguments by name."""
        raise NotImplementedError


class _SDPARouter(_SDPAMode):
    """The SDPA calls of one processor call, for one layer, to fp4vis where it can compute them (module
    docstring)."""

    def __init__(self, state: LayerState, pairwise_mask: bool):
        super().__init__()
        self.state = state
        self.pairwise_mask = pairwise_mask

    def sdpa(self, func, args: tuple, kwargs: dict, call: dict[str, Any]) -> torch.Tensor:
        layer_call, _, query_rows = self.select(call)
        if layer_call is None:
            return func(*args, **kwargs)
        out = self.state.attention(layer_call)
        if query_rows is not None:   # a query that attends to no key: SDPA's zero row
            out = out.masked_fill(~query_rows[:, None, :, None], 0)
        return out

    def select(self, call: dict[str, Any]) -> tuple[LayerCall | None, torch.Tensor | None, torch.Tensor | None]:
        """The layer's answer for an SDPA call (its ``LayerCall``, or None: exact), with the call's bool (B, S)
        key mask and, for a pairwise padding mask, its valid query rows (else None)."""
        q, k, v, mask = call["query"], call["key"], call["value"], call["attn_mask"]
        key_mask = query_rows = reason = None
        if mask is not None:
            if self.pairwise_mask and _is_square_bool(mask, q, k):
                key_mask = query_rows = mask[:, 0].diagonal(dim1=-2, dim2=-1)   # valid (B, S)
            else:
                key_mask, reason = broadcast_key_mask(mask, q, k)
        layer_call = self.state.select(q, k, v, layout="bhsd", scale=call["scale"], dropout_p=call["dropout_p"],
                                       is_causal=call["is_causal"], extra_reason=reason, key_mask=key_mask)
        return layer_call, key_mask, query_rows


class _ParallelSDPARouter(_SDPARouter):
    """The router under diffusers' context parallelism: each SDPA call is this rank's shard, computed FP4 through
    ``context_parallel`` (its collectives), or by diffusers' own context-parallel attention where the layer keeps
    it exact. A pairwise mask never comes here (``FP4AttnProcessor._parallel_call`` keeps such layers exact)."""

    def __init__(self, state: LayerState, parallel: _ParallelCall):
        super().__init__(state, pairwise_mask=False)
        self.parallel = parallel

    def sdpa(self, func, args: tuple, kwargs: dict, call: dict[str, Any]) -> torch.Tensor:
        layer_call, key_mask, _ = self.select(call)
        q, k, v = (call[n].transpose(1, 2) for n in ("query", "key", "value"))   # bshd, as diffusers' backends
        if layer_call is None:
            out = dispatch_attention_fn(q, k, v, attn_mask=call["attn_mask"], dropout_p=call["dropout_p"],
                                        is_causal=call["is_causal"], scale=call["scale"],
                                        backend=self.parallel.backend, parallel_config=self.parallel.config)
            return out.transpose(1, 2)
        out = context_parallel.shard_attention(self.state, q, k, v, layer_call.policy, self.parallel.groups,
                                         scale=call["scale"], key_mask=key_mask, streams=self.parallel.streams)
        return out.transpose(1, 2)


def _is_square_bool(mask: Any, q: torch.Tensor, k: torch.Tensor) -> bool:
    return (isinstance(mask, torch.Tensor) and mask.dtype == torch.bool and mask.dim() == 4
            and tuple(mask.shape) == (q.shape[0], 1, q.shape[2], k.shape[2]) and q.shape[2] == k.shape[2])


class _FunctionRouter(_SDPAMode):
    """The SDPA calls of one processor call of a ``FunctionAttnProcessor``: those ``function_call_reason`` lets
    through go to ``fn``, the others on to SDPA unchanged; each is told to ``tally``."""

    def __init__(self, fn: Callable[..., torch.Tensor], tally: Callable[[str | None], None]):
        super().__init__()
        self.fn = fn
        self.tally = tally

    def sdpa(self, func, args: tuple, kwargs: dict, call: dict[str, Any]) -> torch.Tensor:
        reason = function_call_reason(call, bool(getattr(self.fn, "takes_key_mask", False)))
        self.tally(reason)
        if reason is not None:
            return func(*args, **kwargs)
        q, k, v, mask = call["query"], call["key"], call["value"], call["attn_mask"]
        if mask is None:
            return self.fn(q, k, v, call["scale"])
        return self.fn(q, k, v, call["scale"], broadcast_key_mask(mask, q, k)[0])


def function_call_reason(call: dict[str, Any], takes_key_mask: bool = False) -> str | None:
    """Why an SDPA call (its arguments by name) keeps SDPA rather than going to an attention function
    ``fn(q, k, v, scale)`` (None: it goes): a mask other than a key-padding mask, a key-padding mask where the
    function takes none (``takes_key_mask``: it does, as ``fn(q, k, v, scale, key_mask)``), causal attention,
    dropout, grouped-query attention, or q, k, v that are not (B, H, S, D) tensors of one batch, head count and
    head dim with one key/value length. Reads shapes, dtypes and strides only: eager and compiled calls decide
    alike."""
    q, k, v, mask = call["query"], call["key"], call["value"], call["attn_mask"]
    if any(not isinstance(t, torch.Tensor) or t.dim() != 4 for t in (q, k, v)):
        return "q, k, v that are not 4-D (B, H, S, D) tensors"
    if mask is not None:
        key_mask, form = broadcast_key_mask(mask, q, k)
        if key_mask is None:
            return form
        if not takes_key_mask:
            return "a key-padding attention mask (text padding; the function takes no mask)"
    if call["is_causal"]:
        return "causal attention"
    if call["dropout_p"]:
        return f"attention dropout p={call['dropout_p']:g}"
    if not q.shape[1] == k.shape[1] == v.shape[1]:
        return f"grouped-query attention ({q.shape[1]} query heads, {k.shape[1]} key heads, {v.shape[1]} value heads)"
    if not (q.shape[0] == k.shape[0] == v.shape[0] and k.shape[2] == v.shape[2]
            and q.shape[3] == k.shape[3] == v.shape[3]):
        shapes = ", ".join(f"{n} {'x'.join(map(str, t.shape))}" for n, t in (("q", q), ("k", k), ("v", v)))
        return f"shapes the function does not take ({shapes})"
    return None
