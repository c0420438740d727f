"""diffusers Wan2.1 / Wan2.2 (``WanAttention``): an attention processor, the diffusers way.

``fp4vis.patch`` installs one :class:`FP4WanAttnProcessor` per patched layer with
``attn.set_processor`` and restores the previous processor object on ``remove()``. The processor
computes q, k, v as diffusers' ``WanAttnProcessor`` does (projections, RMS norms, rotary embedding,
the I2V image branch) and hands them to ``fp4vis.attention`` (layout ``bshd``); when the layer runs
exact attention (its policy, a per-step override, or a fallback) it calls the original processor, or
diffusers' ``dispatch_attention_fn`` with the original's backend settings.

The norms and the rotary embedding are handed over as data where they can be: ``fp4vis.attention``
gets the raw projections and a ``fp4vis.qk_transform.QKTransform`` (the layer's ``norm_q`` /
``norm_k`` weights and eps, the rotary tables), and the Hopper backend folds both into its
pre-pass (the normed and rotated BF16 q and k are never written); every other path applies the
transform first, with diffusers' arithmetic. The layer computes q and k itself (the transform
unused) for the I2V image branch (q serves two attention calls), under context parallelism, and
while calibration or the automatic guard reads them.

Context parallelism (``transformer.enable_parallelism(config=ContextParallelConfig(...))``, before or
after patching): the settings land on the original processor, self-attention runs its FP4 path
through ``fp4vis.patching.context_parallel`` (Ulysses, ring, both) and its exact path through
diffusers' own CP attention; cross-attention is local (every rank holds the whole text context).

Another attention function in the model: ``attention_function_applied(pipe, fn)`` sets a
:class:`WanFunctionAttnProcessor` on every ``attn1`` (``select``: other layers) for the duration of a
``with`` block, whose attention is ``fn(q, k, v)`` on (B, S, H, D) tensors and everything else diffusers'
math (both processors share it: :class:`WanProcessorBase`); the Wan eval runs its BF16 baselines so
(flash-attn-4, SageAttention: ``fp4vis.evals.baselines``)::

    with attention_function_applied(pipe, flash_attn_bshd):
        video = pipe(...).frames

Layers: ``attn1`` (self-attention, group ``"self"``) of every block is a default layer; ``attn2``
(cross-attention, group ``"cross"``) only with ``cross_attention=True`` or a name pattern such as
``"*attn2"``. The layer index is the block index within its stack (``LayerSpec.stack``: ``blocks``, VACE's
``vace_blocks``; an int key of ``layers`` names ``blocks``).

Per-step policies: :class:`StepPolicyCallback` (``callback_on_step_end``), e.g. exact attention on
the first and last denoising steps::

    handle = fp4vis.patch(pipe, "wan_fast")
    cb = exact_steps(handle, steps=(0, -1))
    video = pipe(prompt_embeds=..., num_inference_steps=30, callback_on_step_end=cb).frames
"""

from __future__ import annotations

import contextlib
import fnmatch
import re
from collections.abc import Callable, Iterable, Iterator, Mapping
from typing import Any

import torch
from diffusers.callbacks import PipelineCallback
from diffusers.models.attention_dispatch import dispatch_attention_fn
from diffusers.models.transformers.transformer_wan import (
    WanAttention,
    WanAttnProcessor,
    _get_added_kv_projections,
    _get_qkv_projections,
)

from fp4vis.qk_transform import QKTransform, apply_rotary_emb

from . import context_parallel
from .layer import LayerSpec, LayerState, block_position, resolve_policy
from .roots import roots

__all__ = ["FP4WanAttnProcessor", "StepPolicyCallback", "WanFunctionAttnProcessor", "WanProcessorBase",
           "attention_function_applied", "exact_steps", "find_layers", "install", "uninstall"]

TEXT_CONTEXT = 512  # diffusers' WanAttnProcessor: "the context length of the text encoder, hardcoded"


def _index(name: str, counters: dict[str, int], group: str) -> int:
    nums = re.findall(r"(?:^|\.)(\d+)(?=\.|$)", name)
    if nums:
        return int(nums[-1])
    i = counters.get(group, 0)
    counters[group] = i + 1
    return i


def find_layers(root: torch.nn.Module, *, cross_attention: bool = False, decoder: bool = False) -> list[LayerSpec]:
    specs, counters = [], {}
    for name, m in root.named_modules():
        if not isinstance(m, WanAttention):
            continue
        proc = m.processor
        if isinstance(proc, FP4WanAttnProcessor):
            proc = proc.original
        if type(proc) is not WanAttnProcessor:
            continue  # a processor fp4vis does not reproduce; reported as unsupported
        group = "cross" if m.is_cross_attention else "self"
        block = block_position(name)
        specs.append(LayerSpec(name=name, module=m, index=_index(name, counters, group), group=group,
                               default=group == "self" or cross_attention, patcher="wan",
                               num_heads=m.heads, head_dim=m.inner_dim // m.heads,
                               stack=block[0] if block is not None else None))
    return specs


def is_known_non_attention(module: torch.nn.Module) -> bool:
    # The Wan VAE's attention blocks and the text encoder are not denoiser attention layers.
    return type(module).__module__.startswith("diffusers.models.autoencoders")


def install(spec: LayerSpec, state: LayerState) -> Any:
    attn = spec.module
    original = attn.processor
    if isinstance(original, FP4WanAttnProcessor):
        raise RuntimeError(f"layer {spec.name!r} already has an fp4vis processor")
    attn.set_processor(FP4WanAttnProcessor(state, original))
    return original


def uninstall(spec: LayerSpec, state: LayerState, original: Any) -> None:
    attn = spec.module
    current = attn.processor
    if isinstance(current, FP4WanAttnProcessor) and current.state is state:
        attn.set_processor(original)


class WanProcessorBase:
    """diffusers' ``WanAttnProcessor`` with its attention calls left to the subclass (``_attend``):
    projections, RMS norms, rotary embedding, the I2V image branch and the output projection, as
    diffusers computes them. ``original`` is the processor it replaced; the attention-backend and
    context-parallel settings that diffusers sets on a layer's processor land on it."""

    def __init__(self, original: Any):
        self.original = original

    @property
    def _attention_backend(self):
        return getattr(self.original, "_attention_backend", None)

    @_attention_backend.setter
    def _attention_backend(self, value):
        self.original._attention_backend = value

    @property
    def _parallel_config(self):
        return getattr(self.original, "_parallel_config", None)

    @_parallel_config.setter
    def _parallel_config(self, value):
        self.original._parallel_config = value

    def __call__(self, attn: WanAttention, hidden_states: torch.Tensor,
                 encoder_hidden_states: torch.Tensor | None = None, attention_mask: torch.Tensor | None = None,
                 rotary_emb: tuple[torch.Tensor, torch.Tensor] | None = None, **kwargs) -> torch.Tensor:
        if self._passes_to_original(attention_mask, kwargs):
            return self.original(attn, hidden_states, encoder_hidden_states, attention_mask, rotary_emb, **kwargs)
        return self._wan_attention(attn, hidden_states, encoder_hidden_states, rotary_emb)

    def _passes_to_original(self, attention_mask: torch.Tensor | None, kwargs: dict[str, Any]) -> bool:
        """Whether the original processor computes this call: one with an attention mask or arguments
        that diffusers' Wan math here does not take (diffusers passes neither to Wan layers)."""
        return attention_mask is not None or bool(kwargs)

    def _attend(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, *, parallel_config: Any
                ) -> torch.Tensor:
        """Attention of (B, S, H, D) q, k, v (normed and rotated) -> (B, S, H, D); ``parallel_config``:
        the context-parallel settings of self-attention, None for cross-attention and the image branch."""
        raise NotImplementedError

    def _attend_projections(self, attn: WanAttention, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                            rotary_emb: Any, parallel_config: Any) -> torch.Tensor | None:
        """The attention (B, S, H*D) from the raw (B, S, H*D) projections of a layer without an image
        branch, or None: the norms and the rotary embedding are applied here first (the default)."""
        return None

    def _wan_attention(self, attn: WanAttention, hidden_states: torch.Tensor,
                       encoder_hidden_states: torch.Tensor | None, rotary_emb: Any) -> torch.Tensor:
        """The layer's output, as diffusers' ``WanAttnProcessor`` (without an attention mask)."""
        encoder_hidden_states_img = None
        if attn.add_k_proj is not None:
            image_context_length = encoder_hidden_states.shape[1] - TEXT_CONTEXT
            encoder_hidden_states_img = encoder_hidden_states[:, :image_context_length]
            encoder_hidden_states = encoder_hidden_states[:, image_context_length:]

        query, key, value = _get_qkv_projections(attn, hidden_states, encoder_hidden_states)
        parallel_config = self._parallel_config if encoder_hidden_states is None else None
        if encoder_hidden_states_img is None:
            hidden_states = self._attend_projections(attn, query, key, value, rotary_emb, parallel_config)
            if hidden_states is not None:
                return self._output(attn, hidden_states.type_as(query))
        query = attn.norm_q(query)
        key = attn.norm_k(key)
        query = query.unflatten(2, (attn.heads, -1))
        key = key.unflatten(2, (attn.heads, -1))
        value = value.unflatten(2, (attn.heads, -1))
        if rotary_emb is not None:
            query = apply_rotary_emb(query, *rotary_emb)
            key = apply_rotary_emb(key, *rotary_emb)

        hidden_states_img = None
        if encoder_hidden_states_img is not None:
            key_img, value_img = _get_added_kv_projections(attn, encoder_hidden_states_img)
            key_img = attn.norm_added_k(key_img)
            key_img = key_img.unflatten(2, (attn.heads, -1))
            value_img = value_img.unflatten(2, (attn.heads, -1))
            hidden_states_img = self._attend(query, key_img, value_img, parallel_config=None)
            hidden_states_img = hidden_states_img.flatten(2, 3).type_as(query)

        hidden_states = self._attend(query, key, value, parallel_config=parallel_config)
        hidden_states = hidden_states.flatten(2, 3).type_as(query)
        if hidden_states_img is not None:
            hidden_states = hidden_states + hidden_states_img
        return self._output(attn, hidden_states)

    @staticmethod
    def _output(attn: WanAttention, hidden_states: torch.Tensor) -> torch.Tensor:
        """The layer's output projection (and its dropout), as diffusers."""
        hidden_states = attn.to_out[0](hidden_states)
        return attn.to_out[1](hidden_states)


class FP4WanAttnProcessor(WanProcessorBase):
    """Attention processor of one patched ``WanAttention``: fp4vis attention with the layer's
    policy, everything else as diffusers' ``WanAttnProcessor``. ``original`` is the processor it
    replaced (restored by ``remove()``, used for exact attention)."""

    def __init__(self, state: LayerState, original: Any):
        super().__init__(original)
        self.state = state

    def _attend(self, query, key, value, *, parallel_config, transform: QKTransform | None = None) -> torch.Tensor:
        """Attention of (B, S, H, D) tensors: fp4vis with the layer's policy, or exact through diffusers.
        ``transform``: query and key are raw projections and it makes the attention's q and k (never
        under context parallelism: the caller checks). Under context parallelism (``parallel_config`` of
        self-attention) the FP4 path does its own collectives (``context_parallel``) and the exact
        path is diffusers' own CP attention."""
        st = self.state
        groups = context_parallel.groups_of(parallel_config)
        if groups is not None:  # before any work: every rank raises the same error
            context_parallel.check_layer(st, groups, query.shape[2])
        layer_call = st.select(query, key, value, layout="bshd", scale=None, qk_transform=transform)
        if layer_call is None:
            if transform is not None:
                query, key = transform.apply(query, key)
            return dispatch_attention_fn(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False,
                                         backend=self._attention_backend, parallel_config=parallel_config)
        if groups is not None:
            return context_parallel.shard_attention(st, query, key, value, layer_call.policy, groups)
        return st.attention(layer_call)

    def _attend_projections(self, attn, query, key, value, rotary_emb, parallel_config):
        """The raw projections and the norms/rotary as a QKTransform: the backend makes q and k (module
        doc); not while calibration or the automatic guard reads q and k, nor under context parallelism."""
        st = self.state
        if st.recorder is not None or st.auto is not None or context_parallel.groups_of(parallel_config) is not None:
            return None
        transform = QKTransform.from_norms(attn.norm_q, attn.norm_k, rotary_emb)
        if transform is None:
            return None
        hidden_states = self._attend(query.unflatten(2, (attn.heads, -1)), key.unflatten(2, (attn.heads, -1)),
                                     value.unflatten(2, (attn.heads, -1)), parallel_config=parallel_config,
                                     transform=transform)
        return hidden_states.flatten(2, 3)

    def _passes_to_original(self, attention_mask, kwargs) -> bool:
        """Also when the layer runs exact attention and nothing reads its q, k, v; a call the layer's
        policy cannot serve says so (``LayerState.fallback``)."""
        st = self.state
        if st.needs_qkv() and attention_mask is None and not kwargs:
            return False
        if st.active_policy() is not None:
            st.fallback("attention mask given" if attention_mask is not None
                        else f"unexpected processor arguments {sorted(kwargs)}")
        return True

    def __repr__(self) -> str:
        return f"FP4WanAttnProcessor({self.state!r})"


class WanFunctionAttnProcessor(WanProcessorBase):
    """Attention processor of a ``WanAttention`` whose attention is ``fn(q, k, v)`` on (B, S, H, D)
    tensors (normed and rotated as diffusers does), everything else as diffusers' ``WanAttnProcessor``:
    a BF16 attention library in the model (``attention_function_applied``). ``original`` is the
    processor it replaced; calls it cannot serve (an attention mask, other arguments) go to it."""

    def __init__(self, fn: Callable[..., torch.Tensor], original: Any):
        super().__init__(original)
        self.fn = fn

    def _attend(self, query, key, value, *, parallel_config):
        if context_parallel.groups_of(parallel_config) is not None:
            raise NotImplementedError("an attention function in a Wan layer under context parallelism: "
                                      "the function would see this rank's shard of the sequence only")
        return self.fn(query, key, value)

    def __repr__(self) -> str:
        return f"WanFunctionAttnProcessor({getattr(self.fn, '__name__', self.fn)!r})"


def _function_layers(model: Any, select: str) -> list[WanAttention]:
    """The ``WanAttention`` layers of ``model`` whose name matches ``select`` (an fnmatch pattern over
    the layer names; one without a dot is matched against their last part, e.g. "attn1")."""
    layers = []
    for _, root in roots(model, "attention_function_applied"):
        for name, m in root.named_modules():
            part = name.rpartition(".")[2] if "." not in select else name
            if isinstance(m, WanAttention) and fnmatch.fnmatchcase(part, select):
                layers.append(m)
    if not layers:
        raise ValueError(f"attention_function_applied: no WanAttention layer of {type(model).__name__} "
                         f"matches {select!r}")
    return layers


@contextlib.contextmanager
def attention_function_applied(model: Any, fn: Callable[..., torch.Tensor], select: str = "attn1"
                               ) -> Iterator[list[WanAttention]]:
    """Run a block with the attention of ``model``'s Wan layers named ``select`` (default: every block's
    self-attention) computed by ``fn(q, k, v)`` on (B, S, H, D) tensors, e.g. a BF16 attention library
    (``fp4vis.evals.baselines``). ``model``: a ``WanTransformer3DModel`` (or any module holding
    ``WanAttention`` layers) or a diffusers pipeline. The processors are set with ``attn.set_processor``
    and the previous processor objects are set back on exit, also after an exception; yields the
    layers. A layer patched by fp4vis is refused (remove its handle first). Any diffusers model, Wan's
    layers and the others alike, with counts of where the calls went:
    ``fp4vis.patching.attention_function.attention_function_applied``."""
    layers = _function_layers(model, select)
    patched = [m for m in layers if isinstance(m.processor, FP4WanAttnProcessor)]
    if patched:
        raise RuntimeError("attention_function_applied: a selected layer has an fp4vis processor; remove the "
                           "patch handle first")
    originals = [m.processor for m in layers]
    try:
        for m, original in zip(layers, originals):
            m.set_processor(WanFunctionAttnProcessor(fn, original))
        yield layers
    finally:
        for m, original in zip(layers, originals):
            m.set_processor(original)


class StepPolicyCallback(PipelineCallback):
    """A ``callback_on_step_end`` that switches every layer of a patch handle per denoising step.

    ``schedule`` maps step indices (negative: from the end, e.g. -1 the last step) to a policy
    (None / "exact" / "bf16": the model's exact attention; a name or Policy: that policy on every
    patched layer). Steps not in the schedule run the handle's per-layer policies. The pipeline
    calls the callback at the end of step i, so it arms step i+1; step 0 is armed when the callback
    is built and again after the last step (ready for the next run; ``reset()`` re-arms it by
    hand, e.g. after an interrupted run). Negative indices for step 0 need ``num_inference_steps``.
    ``layer_steps`` (layer name -> step indices) runs those layers exact in those steps where the schedule
    leaves the step to the layers' own policies.
    Combine with other callbacks through ``diffusers.callbacks.MultiPipelineCallbacks``.
    """

    tensor_inputs: list[str] = []

    def __init__(self, handle: Any, schedule: Mapping[int, Any], num_inference_steps: int | None = None,
                 layer_steps: Mapping[str, Iterable[int]] | None = None):
        super().__init__(cutoff_step_ratio=1.0)
        self.handle = handle
        self.schedule = {int(k): resolve_policy(v) for k, v in schedule.items()}
        self.layer_steps = {name: [int(s) for s in steps] for name, steps in (layer_steps or {}).items()}
        self.num_inference_steps = num_inference_steps
        self.history: list[tuple[int, str]] = []   # (step armed, policy name or "exact"/"layers")
        self.reset()

    def _arm(self, step: int, n: int | None) -> None:
        def at(k: int) -> bool:
            return (k if k >= 0 else (n + k if n else None)) == step

        hits = [pol for k, pol in self.schedule.items() if at(k)]
        if not hits:
            self.handle.clear_override()
            exact = [name for name, steps in self.layer_steps.items() if any(at(k) for k in steps)]
            if exact:
                self.handle.set_layer_override(exact, None)
            self.history.append((step, "layers" + "".join(f", {name} exact" for name in exact)))
        else:
            chosen = hits[-1]
            self.handle.set_override(chosen)
            self.history.append((step, chosen.name if chosen is not None else "exact"))

    def reset(self) -> None:
        self._arm(0, self.num_inference_steps)

    def callback_fn(self, pipeline, step_index, timestep, callback_kwargs):
        n = getattr(pipeline, "num_timesteps", None) or self.num_inference_steps
        nxt = step_index + 1
        if n is not None and nxt >= n:
            self.num_inference_steps = n
            self._arm(0, n)
        else:
            self._arm(nxt, n)
        return callback_kwargs


def exact_steps(handle: Any, steps: Iterable[int] = (0, -1), num_inference_steps: int | None = None
                ) -> StepPolicyCallback:
    """A :class:`StepPolicyCallback` running exact attention on ``steps`` (default: first and last)."""
    return StepPolicyCallback(handle, {int(s): None for s in steps}, num_inference_steps=num_inference_steps)
