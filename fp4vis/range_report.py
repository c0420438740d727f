"""The range report of one attention call (docs/numerics.md section 8): what went past a policy's representable
range, how it is described, and ``range_check``'s decision (raise, warn or accept). The reference builds it
(``fp4vis.reference``), the kernels' device record reads back into it (``fp4vis.backends.range_record``), and
``fp4vis.attention`` enforces it."""

from __future__ import annotations

import warnings
from dataclasses import dataclass, field

from fp4vis.formats import ScaleRange
from fp4vis.policy import Policy
from fp4vis.scale_range import significant_underflow


class RangeExceededError(FloatingPointError):
    """A Direct-P policy was driven past its representable range (docs/numerics.md section 2)."""


OPERANDS = ("q", "k", "v")


@dataclass
class RangeReport:
    """What went past a Direct-P policy's representable range in one call.

    saturated_blocks: (row, key block) pairs whose exponent clamped at the top (u = 254): logits
        more than ~127 binades above the row reference, where P codes saturate.
    empty_rows: rows with valid keys whose probabilities all fell below the floor (l = 0).
    nonfinite_outputs: output elements that are NaN or Inf.
    scale_underflow, scale_overflow: per operand (q, k, v), the blocks whose scale left its format's range
        (``fp4vis.formats.ScaleRange``): values clipped, or flushed to zero where that can change the result beyond
        the policy's own rounding (``fp4vis.scale_range.significant_underflow``).
    scale_ranges, score_scale: the reference's, what those counts were decided from, so that the reports of a
        call's parts (the elements of a key-masked call) decide once, over the whole call, as a kernel does.
    """

    saturated_blocks: int = 0
    empty_rows: int = 0
    nonfinite_outputs: int = 0
    scale_underflow: tuple[int, int, int] = (0, 0, 0)
    scale_overflow: tuple[int, int, int] = (0, 0, 0)
    scale_ranges: tuple[ScaleRange, ScaleRange, ScaleRange] | None = field(default=None, repr=False)
    score_scale: float = field(default=0.0, repr=False)

    @property
    def ok(self) -> bool:
        return not (self.saturated_blocks or self.empty_rows or self.nonfinite_outputs or any(self.scale_underflow)
                    or any(self.scale_overflow))

    def add(self, other: RangeReport) -> None:
        """Add another call's counts (the elements of a masked call)."""
        self.saturated_blocks += other.saturated_blocks
        self.empty_rows += other.empty_rows
        self.nonfinite_outputs += other.nonfinite_outputs
        if other.scale_ranges is not None:
            self.add_scale_ranges(other.scale_ranges, other.score_scale)
            return
        self.scale_underflow = tuple(a + b for a, b in zip(self.scale_underflow, other.scale_underflow))
        self.scale_overflow = tuple(a + b for a, b in zip(self.scale_overflow, other.scale_overflow))

    def add_scale_ranges(self, ranges: tuple[ScaleRange, ScaleRange, ScaleRange], s: float) -> None:
        """Add the ``ScaleRange`` of q, k and v of a call whose scores ``raw * s`` are in log2 units; the underflow
        counts are decided over every range added (``fp4vis.scale_range.significant_underflow``)."""
        if self.scale_ranges is not None:
            ranges = tuple(a + b for a, b in zip(self.scale_ranges, ranges))
        self.scale_ranges, self.score_scale = ranges, s
        self.scale_underflow = significant_underflow(ranges, s)
        self.scale_overflow = tuple(r.overflow for r in ranges)

    def describe(self, policy: Policy) -> str:
        """The error message: what went past the range, and advice that fits the cause. The guard
        helps where logits leave the window above a fixed row reference (saturated blocks, empty
        rows) and the policy is not already anchored; it cannot help an output that overflows on
        its own (a huge V, or an output beyond the dtype's range), nor operands whose block scales
        leave their format's range (docs/numerics.md section 1, "Scale range")."""
        parts = []
        for name, under, over in zip(OPERANDS, self.scale_underflow, self.scale_overflow):
            if under:
                parts.append(f"{under} blocks of {name} whose scale underflows its format (their values flush to 0)")
            if over:
                parts.append(f"{over} blocks of {name} whose scale saturates its format (their values clip)")
        if self.saturated_blocks:
            parts.append(f"{self.saturated_blocks} saturated P blocks (logits z*log2(e) more than ~127 above "
                         "the row reference)")
        if self.empty_rows:
            parts.append(f"{self.empty_rows} rows whose probabilities all underflowed (l = 0)")
        if self.nonfinite_outputs:
            parts.append(f"{self.nonfinite_outputs} non-finite output elements")
        qk_scales = any(self.scale_underflow[:2]) or any(self.scale_overflow[:2])
        if qk_scales:
            fix = "" if policy.qk_fp8 or policy.qk_global_scale else (
                "; or the per-tensor NVFP4 scale, a Policy with qk_global_scale=True (the reference backend runs it)")
            advice = ("attention is unchanged when q is multiplied and k divided by the same power of two: bring "
                      "their magnitudes together (q * 2**a and k / 2**a with amax(q) * 4**a close to amax(k))"
                      f"{fix}; or policy='bf16' for this layer")
        elif any(self.scale_underflow) or any(self.scale_overflow):
            advice = ("MXFP4's block scales hold 2**-127 .. 2**127: scale v into that range (the output scales with "
                      "it) or use policy='bf16' for this layer")
        elif (self.saturated_blocks or self.empty_rows) and policy.anchor == 0:
            advice = "use policy='guard' for this layer (or a guard plan from fp4vis.calibrate)"
        elif self.saturated_blocks:
            advice = (f"the anchored policy's margin (M = {policy.margin:g}) does not cover these logits: use a "
                      "guard policy with a larger margin (fp4vis.guard_policy(margin, shift); M + L <= 126, so "
                      f"lower L = {policy.shift} to make room) or policy='bf16' for this layer")
        elif self.empty_rows:
            advice = (f"the anchored policy's row reference sits too far above these rows' scores: use a smaller "
                      f"margin (M = {policy.margin:g}) or a lower shift (L = {policy.shift}) with "
                      "fp4vis.guard_policy(margin, shift), or policy='bf16' for this layer")
        else:
            advice = ("the logits are in range, so the guard does not help: the values overflow (V too large "
                      "for FP4/FP8 blocks, or an output beyond its dtype's range); scale V down, compute in "
                      "float32, or use policy='bf16' for this layer")
        return (f"policy {policy.name!r} went past its representable range: {'; '.join(parts)}. "
                f"{advice[0].upper() + advice[1:]}; or range_check='warn'/'off' to accept the result.")


def enforce_range(report: RangeReport | None, policy: Policy, range_check: str, *, stacklevel: int = 2) -> None:
    """What ``range_check`` does with a backend's RangeReport (None: the backend reports none): "raise"
    RangeExceededError or "warn" when it is not ok, nothing with "off". ``stacklevel`` as for
    ``warnings.warn``, counted from the caller. For ``fp4vis.attention``, the reference's op under
    torch.compile, and callers that assemble attention from the reference's parts (ring attention over
    key shards: fp4vis.patching.context_parallel)."""
    if report is not None and not report.ok and range_check != "off":
        message = report.describe(policy)
        if range_check == "raise":
            raise RangeExceededError(message)
        warnings.warn(message, RuntimeWarning, stacklevel=stacklevel + 1)
