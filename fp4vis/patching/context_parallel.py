"""FP4 attention under diffusers' context parallelism (``ContextParallelConfig``: Ulysses, ring, both).

diffusers' hooks (the model's ``_cp_plan``) split the sequence over the ranks before the first block
and gather it after the last; every attention layer in between sees its rank's shard of the
queries, keys and values. diffusers' own context-parallel attention lives inside its attention
backends, a closed enum (``attention_dispatch.AttentionBackendName``) that a custom attention cannot
join, so the fp4vis processors do the collectives here, with ``torch.distributed`` on the process
groups of diffusers' device mesh, in the layout of diffusers' templated Ulysses and unified
attention (the flattened mesh is (ring, ulysses): rank = ring index * ulysses_degree + ulysses index,
and rank r holds sequence shard r):

* Ulysses (``ulysses_degree`` U): an all-to-all gives every rank of a Ulysses group the group's
  whole sequence for H/U of the heads, ``fp4vis.attention`` runs on them as on one GPU, and the
  inverse all-to-all brings the heads back. Heads are independent: identical numerics to one GPU
  for every policy and backend.
* ring (``ring_degree`` R): each rank keeps its queries; the keys and values of every shard reach
  it, in one of two ways:

  - key streaming, where Direct-P's sums add: the reference backend with a fixed row reference
    (``fast``, ``wan_fast``, ``fast_fp8qk``). Ring rank j broadcasts its shard at step j (the next
    shard is in flight while a rank computes) and ``fp4vis.reference.DirectPAccumulator`` adds the
    partial numerators and denominators: no online maximum, no LSE rescaling, never more than
    two shards of keys. The accumulator cuts the key sequence at the same 32-key blocks and key
    chunks as one GPU, whatever the shard boundaries (diffusers' equal split is rarely a multiple
    of 32 keys: Wan 480x832x81 gives 32760 tokens), so the result is bit-identical to one GPU.
  - gathered keys, for everything else: anchored policies (``accurate``, ``guard``: the anchors
    sample the whole key sequence and are moved to the front of the physical key order, so no key
    shard has one GPU's blocks), ``nv_fp8`` (its softmax subtracts the row maximum over all keys), ``fp8`` and
    ``fp8pv`` (their online maximum and V's per-channel scale span all keys),
    and the GPU kernels (they return normalised outputs, not partial sums). The ring group
    all-gathers K and V and each rank attends its queries to the whole sequence: one GPU's
    numerics, at the memory of diffusers' own ring attention, which all-gathers too
    (``rotate_method="allgather"``). One warning per reason says so.
* both: the Ulysses all-to-all within each Ulysses group, then the ring over the ring group.

The same path serves the Wan layers (``fp4vis.patching.wan``) and every diffusers layer the generic patcher reaches
(``fp4vis.patching.diffusers_attention``). A key-padding mask (text padding: Qwen-Image, HunyuanVideo) travels
with its keys (gathered as they are; the ring gathers where it has one). A joint layer's sequence on a rank is its
shard of each token stream (text, image) joined, as diffusers splits them; ``streams`` gives their local lengths,
and the gathered tokens are put in one GPU's order (``one_gpu_order``) before the attention, the outputs back after
it, so that Ulysses is one GPU's call. The ring gathers such keys.

Refused before any collective, with ``ContextParallelError``: heads not divisible by
``ulysses_degree``; ``ulysses_anything`` / ``ring_anything`` (uneven shards); calibration and
``guard="auto"`` (their statistics would be one rank's: calibrate on one GPU, then pass the plan);
a policy with ``qk_global_scale`` (a per-tensor scale over every head and key, which no rank holds).
"""

from __future__ import annotations

import warnings
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from fp4vis.attention import enforce_range
from fp4vis.backends import REFERENCE, registry
from fp4vis.call import AttentionCall, default_scale
from fp4vis.policy import Policy
from fp4vis.reference import DirectPAccumulator, key_stream_reason

from .layer import LayerState

__all__ = ["ContextParallelError", "ContextParallelGroups", "check_layer", "check_policy", "groups_of",
           "one_gpu_order", "ring_strategy", "shard_attention"]


class ContextParallelError(ValueError):
    """A context-parallel configuration that fp4vis' FP4 attention cannot run (the message says why)."""


@dataclass(frozen=True)
class ContextParallelGroups:
    """The process groups of a diffusers ``ContextParallelConfig`` that set up its device mesh."""

    ulysses_degree: int
    ring_degree: int
    ulysses_group: Any
    ring_group: Any
    ring_rank: int       # this rank's index in its ring group = the index of its ring shard of keys
    ulysses_anything: bool = False
    ring_anything: bool = False


def groups_of(parallel_config: Any) -> ContextParallelGroups | None:
    """The context-parallel groups of a processor's ``_parallel_config`` (a diffusers ``ParallelConfig``,
    set by ``ModelMixin.enable_parallelism``); None without context parallelism."""
    cp = getattr(parallel_config, "context_parallel_config", None)
    if cp is None:
        return None
    if cp._ulysses_mesh is None or cp._ring_mesh is None:
        raise ContextParallelError("ContextParallelConfig has no device mesh: it is set up by the model's "
                                   "enable_parallelism(config=...), not used on its own")
    return ContextParallelGroups(ulysses_degree=cp.ulysses_degree, ring_degree=cp.ring_degree,
                                 ulysses_group=cp._ulysses_mesh.get_group(), ring_group=cp._ring_mesh.get_group(),
                                 ring_rank=cp._ring_local_rank, ulysses_anything=bool(cp.ulysses_anything),
                                 ring_anything=bool(cp.ring_anything))


def check_layer(state: LayerState, groups: ContextParallelGroups, num_heads: int) -> None:
    """Before any collective: what this layer cannot run under these groups, whatever its policy."""
    where = f"fp4vis: layer {state.name!r} under context parallelism"
    if groups.ulysses_anything or groups.ring_anything:
        flag = "ulysses_anything" if groups.ulysses_anything else "ring_anything"
        raise ContextParallelError(f"{where}: ContextParallelConfig({flag}=True) splits the sequence unevenly; "
                                   f"fp4vis' FP4 attention takes diffusers' even split: leave {flag} off")
    if num_heads % groups.ulysses_degree:
        raise ContextParallelError(f"{where}: ulysses_degree {groups.ulysses_degree} does not divide its "
                                   f"{num_heads} heads (Ulysses gives each rank whole heads); use a ulysses degree "
                                   f"that divides {num_heads}, or ring_degree")
    if state.recorder is not None or state.auto is not None:
        what = "guard calibration" if state.recorder is not None else 'guard="auto"'
        raise ContextParallelError(f"{where}: {what} would see one rank's shard of the queries and keys; "
                                   "calibrate on one GPU (fp4vis.calibrate or `fp4vis calibrate`) and pass the "
                                   "plan (guard=plan)")


def check_policy(state: LayerState, policy: Policy) -> None:
    if policy.qk_global_scale:
        raise ContextParallelError(f"fp4vis: layer {state.name!r} under context parallelism: policy "
                                   f"{policy.name!r} scales q and k by their amax over the whole tensor "
                                   "(qk_global_scale), which no rank holds")


def shard_attention(state: LayerState, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, policy: Policy,
                    groups: ContextParallelGroups, *, scale: float | None = None, key_mask: torch.Tensor | None = None,
                    streams: tuple[int, ...] | None = None) -> torch.Tensor:
    """FP4 attention of this rank's sequence shard, (B, S_local, H, D) in and out (layout ``bshd``).

    ``scale``: the softmax scale (None: 1/sqrt(D)). ``key_mask``: the shard's bool (B, S_local) key-padding
    mask; it travels with its keys. ``streams``: the local lengths of the token streams the layer's sequence
    joins (joint attention: text and image shards, in the layer's order), None for one stream. diffusers splits
    each stream, so the gathered sequence holds every rank's streams in turn; they are put in one GPU's order
    (every stream whole, in turn) before the attention, and the outputs back after it."""
    check_policy(state, policy)
    streams = streams if streams is not None and len(streams) > 1 else None
    if streams is not None and not sum(streams) == q.shape[1] == k.shape[1]:
        raise ContextParallelError(f"fp4vis: layer {state.name!r} under context parallelism: token streams of "
                                   f"{list(streams)} tokens do not make its {q.shape[1]} queries and {k.shape[1]} keys")
    if groups.ulysses_degree > 1:
        q, k, v = (_heads_to_ranks(t, groups) for t in (q, k, v))
        if key_mask is not None:
            key_mask = _gather_mask(key_mask, groups.ulysses_group, groups.ulysses_degree)
    if groups.ring_degree > 1:
        out = _ring(state, (q, k, v), policy, groups, scale, key_mask, streams)
    elif streams is not None:
        order = one_gpu_order(streams, groups.ulysses_degree, q.device)
        q, k, v = (t[:, order] for t in (q, k, v))
        key_mask = key_mask[:, order] if key_mask is not None else None
        out = state.attention_of(q, k, v, policy, layout="bshd", scale=scale, key_mask=key_mask)
        out = out[:, torch.argsort(order)]
    else:
        out = state.attention_of(q, k, v, policy, layout="bshd", scale=scale, key_mask=key_mask)
    if groups.ulysses_degree > 1:
        out = _heads_from_ranks(out, groups)
    return out


def one_gpu_order(streams: tuple[int, ...], shards: int, device: torch.device | None = None) -> torch.Tensor:
    """For ``shards`` gathered shards, each holding its part of every stream in turn (local lengths ``streams``),
    the gathered position of each token of one GPU's sequence (every stream whole, in turn): ``gathered[:, order]``
    is one GPU's sequence, and ``x[:, argsort(order)]`` takes one GPU's order back to the gathered one."""
    length = sum(streams)
    parts, start = [], 0
    for n in streams:
        parts += [torch.arange(r * length + start, r * length + start + n) for r in range(shards)]
        start += n
    return torch.cat(parts).to(device)


def _gather_mask(mask: torch.Tensor, group: Any, degree: int) -> torch.Tensor:
    """(B, S_local) bool key mask -> (B, degree * S_local), the group's shards in rank order."""
    local = mask.to(torch.uint8).contiguous()   # gloo gathers no bool tensors
    parts = [torch.empty_like(local) for _ in range(degree)]
    dist.all_gather(parts, local, group=group)
    return torch.cat(parts, dim=1).bool()


# ------------------------------------------------------------------------------------------------
# Ulysses: sequence shards of all heads <-> the whole sequence of some heads


def _heads_to_ranks(x: torch.Tensor, groups: ContextParallelGroups) -> torch.Tensor:
    """(B, S_local, H, D) -> (B, U * S_local, H / U, D): the Ulysses group's sequence, in rank order,
    for this rank's heads (rank u gets heads u*H/U ... (u+1)*H/U - 1)."""
    u = groups.ulysses_degree
    b, s, h, d = x.shape
    send = x.reshape(b, s, u, h // u, d).permute(2, 0, 1, 3, 4).contiguous()    # chunk i goes to rank i
    recv = torch.empty_like(send)
    dist.all_to_all_single(recv, send, group=groups.ulysses_group)             # chunk i came from rank i
    return recv.permute(1, 0, 2, 3, 4).reshape(b, u * s, h // u, d)


def _heads_from_ranks(x: torch.Tensor, groups: ContextParallelGroups) -> torch.Tensor:
    """The inverse of ``_heads_to_ranks``: (B, U * S_local, H / U, D) -> (B, S_local, H, D)."""
    u = groups.ulysses_degree
    b, s_all, hl, d = x.shape
    send = x.reshape(b, u, s_all // u, hl, d).permute(1, 0, 2, 3, 4).contiguous()
    recv = torch.empty_like(send)
    dist.all_to_all_single(recv, send, group=groups.ulysses_group)
    return recv.permute(1, 2, 0, 3, 4).reshape(b, s_all // u, u * hl, d)


# ------------------------------------------------------------------------------------------------
# ring: local queries, every shard's keys


def ring_strategy(state: LayerState, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                  policy: Policy) -> str | None:
    """None when the ring streams key shards through ``DirectPAccumulator``; otherwise why it gathers
    the keys instead. q, k, v: ``bshd``."""
    reason = key_stream_reason(policy)
    if reason is not None:
        return reason
    qb, kb, vb = (t.transpose(1, 2) for t in (q, k, v))
    backend = registry.select_backend(state.backend, AttentionCall(qb, kb, vb, policy, default_scale(q.shape[-1])))
    if backend.name != REFERENCE:
        return f"the {backend.name} backend returns normalised outputs, not Direct-P's partial sums"
    return None


def _ring(state: LayerState, qkv: tuple[torch.Tensor, torch.Tensor, torch.Tensor], policy: Policy,
          groups: ContextParallelGroups, scale: float | None, key_mask: torch.Tensor | None,
          streams: tuple[int, ...] | None) -> torch.Tensor:
    q, k, v = qkv
    reason = ring_strategy(state, q, k, v, policy)
    if reason is None and key_mask is not None:
        reason = "the keys have a padding mask (key streaming takes no mask)"
    if reason is None and streams is not None:
        reason = "the layer's keys are several token streams (joint attention: one GPU's key order is not the ring's)"
    if reason is not None:
        _warn_once(f"fp4vis: ring attention gathers each layer's keys and values on every rank where {reason} "
                   "(the one-GPU result, at the memory of diffusers' own ring attention)")
        k_all, v_all = _gather_keys(k, v, groups)
        if key_mask is not None:
            key_mask = _gather_mask(key_mask, groups.ring_group, groups.ring_degree)
        if streams is not None:
            order = one_gpu_order(streams, groups.ulysses_degree * groups.ring_degree, k.device)
            k_all, v_all = k_all[:, order], v_all[:, order]
            key_mask = key_mask[:, order] if key_mask is not None else None
        return state.attention_of(q, k_all, v_all, policy, layout="bshd", scale=scale, key_mask=key_mask)
    b, _, h, d = q.shape
    with state.fp4_call():
        acc = DirectPAccumulator(q.transpose(1, 2).flatten(0, 1), policy, default_scale(d) if scale is None else scale,
                                 num_keys=k.shape[1] * groups.ring_degree)
        for k_shard, v_shard in _key_shards_in_order(k, v, groups):
            acc.add(k_shard.transpose(1, 2).flatten(0, 1), v_shard.transpose(1, 2).flatten(0, 1))
        out, report = acc.result()
        enforce_range(report, policy, state.range_check, stacklevel=4)
    return out.unflatten(0, (b, h)).transpose(1, 2)


def _key_shards_in_order(k: torch.Tensor, v: torch.Tensor, groups: ContextParallelGroups
                         ) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    """Every ring shard's (k, v), in key order: ring rank j broadcasts its shard at step j, and the next
    broadcast is in flight while the caller computes on the current shard."""
    local = torch.cat((k.reshape(-1), v.reshape(-1)))   # one collective per shard for both

    def start(j: int):
        buf = local if j == groups.ring_rank else torch.empty_like(local)
        src = dist.get_global_rank(groups.ring_group, j)
        return buf, dist.broadcast(buf, src=src, group=groups.ring_group, async_op=True)

    pending = start(0)
    for j in range(groups.ring_degree):
        buf, work = pending
        work.wait()
        if j + 1 < groups.ring_degree:
            pending = start(j + 1)
        yield buf[: k.numel()].view_as(k), buf[k.numel():].view_as(v)


def _gather_keys(k: torch.Tensor, v: torch.Tensor, groups: ContextParallelGroups
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """(B, S_local, H, D) k and v -> the ring group's whole sequence (shards in ring-rank order)."""
    local = torch.cat((k.reshape(-1), v.reshape(-1)))
    parts = [torch.empty_like(local) for _ in range(groups.ring_degree)]
    dist.all_gather(parts, local, group=groups.ring_group)
    k_all = torch.cat([p[: k.numel()].view_as(k) for p in parts], dim=1)
    v_all = torch.cat([p[k.numel():].view_as(v) for p in parts], dim=1)
    return k_all, v_all


_WARNED: set[str] = set()


def _warn_once(message: str) -> None:
    """Once per process and message, on the first rank only (every rank takes the same path)."""
    if message not in _WARNED:
        _WARNED.add(message)
        if not dist.is_initialized() or dist.get_rank() == 0:
            warnings.warn(message, UserWarning, stacklevel=4)
