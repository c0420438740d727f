"""One attention call as the backends get it. ``fp4vis.attention`` validates its arguments once and builds an
``AttentionCall``; the registry asks each backend ``supports(call)`` and runs ``run(call)``. Nothing below
unpacks it again except a backend's custom op, whose arguments must be plain values (docs/design.md,
"Follow a tensor")."""

from __future__ import annotations

from typing import NamedTuple

import torch

from fp4vis.policy import Policy
from fp4vis.qk_transform import QKTransform


class RecordSlot(NamedTuple):
    """One recorded call's place in its device's record (``fp4vis.backends.range_record.RangeRecord.start_call``):
    the record's int32 ``fields`` and host ``flag`` (pinned, mapped into the device's address space) and the call's
    ``number``. A pre-pass takes it as is; a kernel takes its ``addresses``."""

    fields: torch.Tensor
    flag: torch.Tensor
    number: int

    @property
    def addresses(self) -> tuple[int, int, int]:
        """(fields address, flag address, number): what a kernel's launch takes."""
        return self.fields.data_ptr(), self.flag.data_ptr(), self.number


class AttentionCall(NamedTuple):
    """q (B, H, Sq, D), k (B, H, Skv, D), v (B, H, Skv, Dv): validated views in SDPA's layout, one dtype and
    device; ``policy`` and ``scale`` (the softmax scale) resolved. ``qk_transform``: q and k are a layer's raw
    projections, which a backend with ``fuses_qk_transform`` normalises and rotates itself (None: q and k are
    the attention's). ``key_mask``: bool (B, Skv), True for the keys each batch element attends to (None: all;
    docs/numerics.md section 6, "Key masks"). ``record``: the range record's slot of an eager kernel call
    (``RecordSlot``), None where nothing is recorded;
    ``record_site``: under torch.compile, the call's site (``range_record.call_site``), which the backend's op
    takes instead. A NamedTuple: immutable, cheap to build on every call, and traced by torch.compile."""

    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    policy: Policy
    scale: float
    qk_transform: QKTransform | None = None
    key_mask: torch.Tensor | None = None
    record: RecordSlot | None = None
    record_site: int = 0
