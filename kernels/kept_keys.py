"""Key-padding masks on the kernels: each batch element's kept keys gathered to the front, so that a kernel that
reads one key count per batch element computes, bit for bit, the unmasked call on those keys (docs/numerics.md
section 6, "Key masks").

``kept_keys(k, v, key_mask, anchor)`` returns K and V with, per batch element b, its ``lengths[b]`` kept keys
at positions 0..lengths[b]-1 in the physical order of an unmasked call on them (anchored policies: the anchor
samples of ``lengths[b]`` keys first, ``fp4vis.key_positions.anchor_permutation``), and zeros after them. Zeros make
every block statistic of the pre-passes (the MXFP4 V blocks of 32 tokens, the FP8 K scales of 32 keys) the one
the unmasked call gets from its zero padding; the kernels mask keys >= lengths[b] as they mask keys >= Skv. The
pre-pass then runs without a permutation of its own.

Device-side only (argsort, gather, where): no host synchronisation, so CUDA-graph capture and torch.compile (the
backends' ops) take it. Both kernel backends call it; the reference gathers the kept keys itself.
"""

from __future__ import annotations

from typing import NamedTuple

import torch


class KeptKeys(NamedTuple):
    k: torch.Tensor        # (B, H, Skv, D): kept keys first, physical order, zeros after
    v: torch.Tensor        # (B, H, Skv, Dv) likewise
    lengths: torch.Tensor  # int32 (B,): kept keys per batch element


def anchor_positions(lengths: torch.Tensor, n: int) -> torch.Tensor:
    """``fp4vis.key_positions.anchor_indices(lengths[b], n)`` for every b at once, (B, n) int64 (rows with
    ``lengths[b] <= n`` are not meaningful: there every key is a sample). The same float64 arithmetic as
    ``torch.linspace`` (the first half counted from the start, the second from the end) and the same rounding
    (half to even), so the positions are those of the unmasked call (tests/core/test_key_mask.py checks)."""
    last = (lengths.to(torch.float64) - 1.0)[:, None]
    i = torch.arange(n, dtype=torch.float64, device=lengths.device)[None, :]
    step = last / (n - 1) if n > 1 else torch.zeros_like(last)
    pos = torch.where(i < n // 2, step * i, last - step * (n - 1 - i))
    return torch.round(pos).long()


def _physical_order(lengths: torch.Tensor, skv: int, anchor: int) -> torch.Tensor:
    """(B, Skv) int64: for each batch element, the compact positions (0..lengths-1: the kept keys in order) in
    the physical order of the unmasked call on them, then lengths..Skv-1."""
    b = lengths.shape[0]
    pos = torch.arange(skv, device=lengths.device).expand(b, skv)
    kept = pos < lengths[:, None]
    if anchor > 0 and skv > anchor:
        # an element with at most `anchor` kept keys samples every one of them
        marks = torch.zeros(b, skv, dtype=torch.bool, device=lengths.device)
        marks.scatter_(1, anchor_positions(lengths, anchor).clamp(0, skv - 1), True)
        is_anchor = torch.where((lengths > anchor)[:, None], marks, kept)
        rank = torch.where(kept, torch.where(is_anchor, 0, 1), 2)
    else:
        rank = torch.where(kept, 0, 2)
    return torch.argsort(rank, dim=1, stable=True)


def kept_keys(k: torch.Tensor, v: torch.Tensor, key_mask: torch.Tensor, anchor: int = 0) -> KeptKeys:
    """K and V of (B, H, Skv, D) layout gathered by the bool (B, Skv) ``key_mask`` (module docstring);
    ``anchor``: the policy's anchor samples (0: none)."""
    b, h, skv = k.shape[0], k.shape[1], k.shape[2]
    lengths = key_mask.sum(-1)
    # kept keys first, in order; then the masked ones
    order = torch.argsort((~key_mask).to(torch.int8), dim=1, stable=True)
    index = order.gather(1, _physical_order(lengths, skv, anchor))
    valid = (torch.arange(skv, device=k.device)[None, :] < lengths[:, None])[:, None, :, None]

    def gather(t: torch.Tensor) -> torch.Tensor:
        g = t.gather(2, index[:, None, :, None].expand(b, h, skv, t.shape[-1]))
        return torch.where(valid, g, torch.zeros((), dtype=t.dtype, device=t.device))

    # an element that masks every key (not checked in CUDA-graph capture and compiled calls: a host
    # synchronisation) attends to one zero key and gets zero rows; a kernel never sees a count of 0
    return KeptKeys(gather(k), gather(v), lengths.clamp(min=1).to(torch.int32))
