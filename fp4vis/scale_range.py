"""What an underflowing block scale can change (docs/numerics.md section 1, "Scale range"): the criterion that
decides whether the blocks of q, k or v that ``fp4vis.formats``' ``*_scale_counts`` found flushed count in the
range report, the same on every backend (the reference: ``fp4vis.range_report.RangeReport``; the kernels:
``kernels/scale_record.py``, whose attention kernels evaluate it on the device, after the pre-pass, with the same exact
arithmetic)."""

from __future__ import annotations

import functools
import math

import torch

from fp4vis.formats import ScaleRange

# docs/numerics.md section 1, "Scale range": a q or k block whose scale underflows counts only where it can move a
# score (raw * s, log2 units: binary exponents of P) by more than this. E2M1 rounds each P code to within
# log2(7/6) = 0.22 of these units at best (between codes 1.5 and 2, or 3 and 4; more elsewhere), so a flush that
# stays below moves every normalised weight by at most 2**(2 * 2**-5) - 1 = 4.4 %, a fifth of that rounding
SCORE_CHANGE_LIMIT = 2.0**-5
# a v block whose scale underflows counts only where its amax is above this fraction of v's largest value: each
# output is a weighted average of v, so a flush below changes no output element by more than float32's own
# resolution of v's largest value; a v whose every block flushes (largest amax <= 1e-38) always counts
V_FLUSH_FRACTION = 2.0**-24


def significant_underflow(ranges: tuple[ScaleRange, ScaleRange, ScaleRange], s: float) -> tuple[int, int, int]:
    """The underflow counts of q, k, v that the range report gives (docs/numerics.md section 1, "Scale range"): an
    operand's flushed blocks count where they can change the result beyond the policy's own rounding, else 0. q's
    flushed values change a score ``raw * s`` (log2 units) by at most ``s * q.flushed * k.amax`` (the row's lost L1
    norm times k's largest value), k's by ``s * k.flushed * q.amax``: they count where that exceeds
    ``SCORE_CHANGE_LIMIT``; v's count where ``v.flushed > V_FLUSH_FRACTION * v.amax``. Evaluated exactly, as every
    kernel evaluates it (``kernels/scale_record.py``): the float32 limit ``qk_flush_limit(s)`` against the product
    of two float32 values, exact in float64."""
    q, k, v = ranges
    limit = qk_flush_limit(s)
    return (q.underflow if q.flushed * k.amax > limit else 0,
            k.underflow if k.flushed * q.amax > limit else 0,
            v.underflow if v.flushed > v.amax * V_FLUSH_FRACTION else 0)


@functools.lru_cache(maxsize=64)   # asked on every recorded call: a model has a few score scales
def qk_flush_limit(s: float) -> float:
    """``SCORE_CHANGE_LIMIT / s`` rounded to float32 (inf where s is 0): what a q or k row's flushed L1 bound times
    the other operand's largest value may reach before its flushed blocks count (``significant_underflow``)."""
    limit = SCORE_CHANGE_LIMIT / s if s else math.inf
    return float(torch.tensor(limit, dtype=torch.float32))
