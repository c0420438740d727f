"""One attention call as the backends get it. ``fp4vis.attention`` validates its arguments once and builds an
``AttentionCall``; the registry asks each backend ``supports(call)`` and runs ``run(call)``. Nothing below
unpacks it again except a backend's custom op, whose arguments must be plain values (docs/design.md,
"Follow a tensor")."""

from __future__ import annotations

from typing import NamedTuple

import torch

from fp4vis.policy import Policy
from fp4vis.qk_transform import QKTransform


class AttentionCall(NamedTuple):
    """q (B, H, Sq, D), k (B, H, Skv, D), v (B, H, Skv, Dv): validated views in SDPA's layout, one dtype and
    device; ``policy`` and ``scale`` (the softmax scale) resolved. ``qk_transform``: q and k are a layer's raw
    projections, which a backend with ``fuses_qk_transform`` normalises and rotates itself (None: q and k are
    the attention's). ``key_mask``: bool (B, Skv), True for the keys each batch element attends to (None: all;
    docs/numerics.md section 6, "Key masks"). ``record``: the range record's launch arguments of an eager kernel
    call (fields address,
    flag address, call number; ``fp4vis.backends.range_record``), None where nothing is recorded;
    ``record_site``: under torch.compile, the call's site (``range_record.call_site``), which the backend's op
    takes instead. A NamedTuple: immutable, cheap to build on every call, and traced by torch.compile."""

    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    policy: Policy
    scale: float
    qk_transform: QKTransform | None = None
    key_mask: torch.Tensor | None = None
    record: tuple[int, int, int] | None = None
    record_site: int = 0
