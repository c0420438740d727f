"""Triton device functions that both kernel backends' pre-passes use."""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def exact_f32(x):
    """BF16 or FP16 x in float32, exactly. BF16 by moving its bits up 16 places, which is what the
    GPU's conversion does; Triton's interpreter flushes BF16 subnormals to 0 instead."""
    if x.dtype == tl.bfloat16:
        return (x.to(tl.uint16, bitcast=True).to(tl.uint32) << 16).to(tl.float32, bitcast=True)
    else:
        return x.to(tl.float32)
