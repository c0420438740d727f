"""The pre-passes' side of the range record (``fp4vis.backends.range_record``; docs/numerics.md section 8),
shared by both kernel backends: each program of a pre-pass counts the blocks of its operand whose scale
leaves the format's range (docs/numerics.md section 1, "Scale range", the conditions of
``fp4vis.formats.*_scale_counts``) and, where the call is recorded (CALL > 0) and a count is not zero,
adds them to the record's words and raises its flag, as the attention kernels do with their own counts.
``add_counts`` does the same from the host for a pre-pass written in PyTorch: one small launch, no host
synchronisation.

A record is passed as ``(fields, flag, call)``: the device's int32 fields, the pinned host flag (which
the GPU writes directly) and the call's number; ``None`` records nothing. The launches take it as
``words``: the fields, the flag's address (an int64: a pinned host tensor as a pointer argument would
cost every launch a driver query of its address) and the number."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from fp4vis.backends.range_record import FIRST_CALL, NUM_FIELDS, SCALE_OVERFLOW, SCALE_UNDERFLOW
from fp4vis.formats import E4M3_SATURATION, FP8_GROUP_TOP_EXP, FP8_MIN_GROUP_EXP, MXFP4_ZERO_AMAX

# literals in the counts below (Triton's interpreter mishandles module constexprs in tensor arithmetic)
assert E4M3_SATURATION == 464.0 and MXFP4_ZERO_AMAX == 1e-38
assert 127 + FP8_GROUP_TOP_EXP + FP8_MIN_GROUP_EXP == 8     # the smallest exponent field whose E is not floored

Q_OPERAND, K_OPERAND, V_OPERAND = 0, 1, 2   # a count's offset from SCALE_UNDERFLOW / SCALE_OVERFLOW
_FIRST = tl.constexpr(FIRST_CALL)
_UNDER = tl.constexpr(SCALE_UNDERFLOW)
_OVER = tl.constexpr(SCALE_OVERFLOW)


@triton.jit
def record_scale_range(REC, FLAG, CALL, operand, under, over):
    """Add one program's counts of ``operand`` (0 q, 1 k, 2 v) to the record REC (int32 words) and store
    CALL into the int32 at address FLAG, where CALL > 0 and a count is not zero."""
    if CALL > 0:
        if under + over > 0:
            tl.atomic_add(REC + _UNDER + operand, under)
            tl.atomic_add(REC + _OVER + operand, over)
            tl.atomic_min(REC + _FIRST, CALL)
            tl.store(FLAG.to(tl.pointer_type(tl.int32), bitcast=True), CALL)


@triton.jit
def _total(flags):
    """The number of true elements of a tile, int32."""
    return tl.sum(tl.ravel(flags.to(tl.int32), can_reorder=True), axis=0)


@triton.jit
def nvfp4_scale_counts(sc, amax, base):
    """(underflow, overflow) of a tile of NVFP4 scale groups (``fp4vis.formats.nvfp4_scale_counts``): the
    chosen scales ``sc``, the group maxima ``amax`` and ``base = amax / 6`` (correctly rounded)."""
    return _total((sc == 0.0) & (amax > 0.0)), _total((base > 464.0) & (amax < float("inf")))


@triton.jit
def mxfp4_scale_counts(amax):
    """(underflow, overflow) of MXFP4 block maxima (``fp4vis.formats.mxfp4_scale_counts``)."""
    return (_total((amax > 0.0) & (amax <= 1e-38)),
            _total((amax >= 2.5521177519070385e38) & (amax < float("inf"))))   # 1.5 * 2^127


@triton.jit
def fp8_scale_underflow(amax):
    """Underflow of FP8 pow2 group maxima (``fp4vis.formats.fp8_pow2_scale_counts``): E floored at -126."""
    return _total((amax > 0.0) & (((amax.to(tl.int32, bitcast=True) >> 23) & 0xFF) < 8))


@triton.jit(do_not_specialize=["FLAG", "CALL", "operand"])
def _add_counts(COUNTS, REC, FLAG, CALL, operand):
    record_scale_range(REC, FLAG, CALL, operand, tl.load(COUNTS), tl.load(COUNTS + 1))


_NO_RECORD: dict[torch.device, torch.Tensor] = {}


def words(record: tuple | None, device: torch.device) -> tuple:
    """(fields, flag address, call) launch arguments of ``record``; where nothing is recorded (None, or call
    0), int32 words of the device stand in for both (the kernels then write nothing), so that a launch with
    and one without a record share one compiled kernel."""
    if record is not None and record[2]:
        fields, flag, call = record
        return fields, flag.data_ptr(), call
    t = placeholder(device)
    return t, t.data_ptr(), 0


def placeholder(device: torch.device) -> torch.Tensor:
    """Int32 words of the device that a launch's record arguments take where it records nothing."""
    t = _NO_RECORD.get(device)
    if t is None:
        t = _NO_RECORD[device] = torch.zeros(NUM_FIELDS, dtype=torch.int32, device=device)
    return t


def add_counts(counts: torch.Tensor, record: tuple | None, operand: int) -> None:
    """Add the int32 (underflow, overflow) ``counts`` of a ``fp4vis.formats`` ``*_scale_counts`` function to
    ``record`` under ``operand`` (``Q_OPERAND``, ``K_OPERAND`` or ``V_OPERAND``); nothing where ``record`` is None
    or its call 0."""
    if record is not None and record[2]:
        _add_counts[(1,)](counts, *words(record, counts.device), operand)
