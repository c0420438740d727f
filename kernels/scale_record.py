"""The range record's scale-range words (``fp4vis.backends.range_record``; docs/numerics.md section 8), shared by
both kernel backends: each program of a pre-pass counts the blocks of its operand whose scale leaves the format's
range (docs/numerics.md section 1, "Scale range", the conditions of ``fp4vis.formats.*_scale_counts``). Where the
call is recorded (CALL > 0):

* saturated scales (overflow) are added to the record's words at once, with the flag raised, as the attention
  kernels do with their own counts (``record_scale_range``);
* underflows count only where they can change the result (``fp4vis.scale_range.significant_underflow``), which needs
  the whole call's maxima: a program with underflows adds them, the maximum of its ``ScaleRange.flushed`` and the
  call's q/k flush limit to the call's words (``CALL_UNDERFLOW`` ...; floats as int32 bits: non-negative floats
  order as their bits do), and every program raises the call's ``.amax`` word (a relaxed ``atomic_max`` whose
  result is unused: a fire-and-forget ``RED`` in the GPU build, so no program waits on the word);
* the call's attention kernel, which runs after all of its pre-pass launches in stream order, decides once
  (``decide_scale_range``: one thread or program of it; ``kernels/hopper/ptx.py`` has the Hopper kernel's PTX
  twin), adds the underflows that count to the record, raises the flag where they do and clears the call's words.
  No fence, no counter, no host synchronisation: CUDA-graph replays and torch.compile keep it. Where no attention
  kernel follows a recorded pre-pass (the tests' statements, a launch that raised, a kernel variant that records
  nothing), ``decide`` launches the same decision alone.

``add_counts`` adds the counts of a pre-pass written in PyTorch: one small launch per operand, no host
synchronisation. The words of the call in flight are one set per device: calls recorded on two streams of one
device at once would mix them (fp4vis records a device's calls on one stream at a time).

A record is passed as ``(fields, flag, call, score_scale)``: the device's int32 fields, the pinned host flag
(which the GPU writes directly), the call's number and its score scale (the softmax scale times log2(e): scores
``raw * score_scale`` in log2 units; ``recorded``); ``None`` records nothing. The launches take it as ``words``:
the fields, the flag's address (an int64: a pinned host tensor as a pointer argument would cost every launch a
driver query of its address), the number and the q/k flush limit of the score scale
(``fp4vis.scale_range.qk_flush_limit``)."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from fp4vis.backends.range_record import (
    CALL_AMAX,
    CALL_FLUSHED,
    CALL_LIMIT,
    CALL_UNDERFLOW,
    FIRST_CALL,
    NUM_FIELDS,
    SCALE_OVERFLOW,
    SCALE_UNDERFLOW,
)
from fp4vis.formats import E4M3_SATURATION, FP8_GROUP_TOP_EXP, FP8_MIN_GROUP_EXP, MXFP4_ZERO_AMAX
from fp4vis.policy import LOG2E
from fp4vis.scale_range import V_FLUSH_FRACTION, qk_flush_limit

# literals in the counts below (Triton's interpreter mishandles module constexprs in tensor arithmetic)
assert E4M3_SATURATION == 464.0 and MXFP4_ZERO_AMAX == 1e-38 and V_FLUSH_FRACTION == 2.0**-24
assert 127 + FP8_GROUP_TOP_EXP + FP8_MIN_GROUP_EXP == 8     # the smallest exponent field whose E is not floored

Q_OPERAND, K_OPERAND, V_OPERAND = 0, 1, 2   # a count's offset from SCALE_UNDERFLOW / SCALE_OVERFLOW
_FIRST = tl.constexpr(FIRST_CALL)
_UNDER = tl.constexpr(SCALE_UNDERFLOW)
_OVER = tl.constexpr(SCALE_OVERFLOW)
_CALL_UNDER = tl.constexpr(CALL_UNDERFLOW)
_CALL_FLUSHED = tl.constexpr(CALL_FLUSHED)
_CALL_AMAX = tl.constexpr(CALL_AMAX)
_CALL_LIMIT = tl.constexpr(CALL_LIMIT)


@triton.jit
def _report(REC, FLAG, CALL, field, count, zero, where):
    """Add ``count`` to the record's word ``field``, lower its first call to CALL and store CALL at FLAG (the flag's
    int32, as a pointer or an address): scalars (``zero`` 0, ``where`` None), or elementwise on ``zero``, an int32
    zero tensor, where ``where``."""
    tl.atomic_add(REC + field + zero, count, mask=where)
    tl.atomic_min(REC + _FIRST + zero, zero + CALL, mask=where)
    tl.store(FLAG.to(tl.pointer_type(tl.int32), bitcast=True) + zero, zero + CALL, mask=where)


@triton.jit
def record_scale_range(REC, FLAG, CALL, LIMIT, operand, under, over, flushed, amax):
    """Add one program's ``*_scale_counts`` of ``operand`` (0 q, 1 k, 2 v) to the record REC (int32 words) where
    CALL > 0: ``over`` to the record (storing CALL into the int32 at address FLAG); where ``under`` > 0, ``under``,
    the float32 maximum ``flushed`` and the q/k flush limit LIMIT (the same for every program of the call) to the
    call's words; ``amax`` to the call's maximum.
    The call's attention kernel decides on them (``decide_scale_range``)."""
    if CALL > 0:
        if over > 0:
            _report(REC, FLAG, CALL, _OVER + operand, over, 0, None)
        if under > 0:
            tl.atomic_add(REC + _CALL_UNDER + operand, under, sem="relaxed")
            _raise_to(REC + _CALL_FLUSHED + operand, flushed.to(tl.int32, bitcast=True))
            limit = tl.cast(tl.cast(LIMIT, tl.float32), tl.int32, bitcast=True)
            if tl.load(REC + _CALL_LIMIT, volatile=True) != limit:   # stored once per call, not by every program
                tl.store(REC + _CALL_LIMIT, limit)
        _raise_to(REC + _CALL_AMAX + operand, amax.to(tl.int32, bitcast=True))


@triton.jit
def _raise_to(word, bits):
    """The call's maximum at ``word`` raised to ``bits`` (non-negative float32 bits): a relaxed atomic whose result
    is unused, so that the program does not wait on the word."""
    tl.atomic_max(word, bits, sem="relaxed")


@triton.jit
def _take_float(ptr, zero, first):
    """The float32 whose bits the word at ptr holds, as float64; the word cleared (elementwise on ``zero`` where
    ``first``, as ``decide_scale_range``)."""
    return tl.atomic_xchg(ptr + zero, zero, mask=first).to(tl.float32, bitcast=True).to(tl.float64)


@triton.jit
def decide_scale_range(REC, FLAG, CALL, zero, first):
    """The call's decision on its underflows, where CALL > 0, run once after all of its pre-pass programs (in stream
    order): ``fp4vis.scale_range.significant_underflow``'s exact arithmetic (the float32 maxima multiplied in float64
    against the float32 q/k flush limit the pre-pass left in the call's words; v: flushed > amax * 2^-24); the
    underflows that count go to the record (FLAG: the flag's int32, as a pointer or an address) and every call word
    is cleared. Elementwise on ``zero``, an int32 zero tensor, where ``first``, which holds one element: a Triton
    program passes a tensor of one element, a warp-specialised Gluon kernel one per thread with thread 0's set (a
    scalar atomic's thread predicate would be computed at the kernel's entry and kept live across its partitions).
    ``kernels/hopper/ptx.py``'s ``decide_scale_range`` is its PTX twin."""
    if CALL > 0:
        q_flushed = _take_float(REC + _CALL_FLUSHED, zero, first)
        k_flushed = _take_float(REC + _CALL_FLUSHED + 1, zero, first)
        v_flushed = _take_float(REC + _CALL_FLUSHED + 2, zero, first)
        q_amax = _take_float(REC + _CALL_AMAX, zero, first)
        k_amax = _take_float(REC + _CALL_AMAX + 1, zero, first)
        v_amax = _take_float(REC + _CALL_AMAX + 2, zero, first)
        limit = _take_float(REC + _CALL_LIMIT, zero, first)
        for operand in tl.static_range(3):
            under = tl.atomic_xchg(REC + _CALL_UNDER + operand + zero, zero, mask=first)
            if operand == 0:
                counts = q_flushed * k_amax > limit
            elif operand == 1:
                counts = k_flushed * q_amax > limit
            else:
                counts = v_flushed > v_amax * 5.9604644775390625e-08   # V_FLUSH_FRACTION
            _report(REC, FLAG, CALL, _UNDER + operand, under, zero, first & counts & (under > 0))


@triton.jit
def _total(flags):
    """The number of true elements of a tile, int32."""
    return tl.sum(tl.ravel(flags.to(tl.int32), can_reorder=True), axis=0)


@triton.jit
def _top(x):
    """The largest element of a tile of non-negative float32."""
    return tl.max(tl.ravel(x, can_reorder=True), axis=0)


@triton.jit
def nvfp4_scale_counts(sc, amax, base, GROUP: tl.constexpr):
    """(underflow, overflow, flushed, amax) of a (rows, groups) tile of NVFP4 scale groups of GROUP values
    (``fp4vis.formats.nvfp4_scale_counts``): the chosen scales ``sc``, the group maxima ``amax`` and
    ``base = amax / 6`` (correctly rounded)."""
    under = (sc == 0.0) & (amax > 0.0)
    flushed_values = tl.sum(under.to(tl.int32), axis=1).to(tl.float32) * GROUP
    flushed = flushed_values * tl.max(tl.where(under, amax, 0.0), axis=1)
    return _total(under), _total((base > 464.0) & (amax < float("inf"))), _top(flushed), _top(amax)


@triton.jit
def mxfp4_scale_counts(amax):
    """(underflow, overflow, flushed, amax) of MXFP4 block maxima (``fp4vis.formats.mxfp4_scale_counts``)."""
    under = (amax > 0.0) & (amax <= 1e-38)
    return (_total(under), _total((amax >= 2.5521177519070385e38) & (amax < float("inf"))),   # 1.5 * 2^127
            _top(tl.where(under, amax, 0.0)), _top(amax))


@triton.jit
def fp8_scale_counts(amax, D: tl.constexpr):
    """(underflow, overflow = 0, flushed, amax) of FP8 pow2 group maxima of rows of D values
    (``fp4vis.formats.fp8_pow2_scale_counts``): E floored at -126."""
    under = (amax > 0.0) & (((amax.to(tl.int32, bitcast=True) >> 23) & 0xFF) < 8)
    return _total(under), 0, _top(tl.where(under, amax * D, 0.0)), _top(amax)


@triton.jit(do_not_specialize=["FLAG", "CALL", "LIMIT", "operand"])
def _add_counts(COUNTS, REC, FLAG, CALL, LIMIT, operand):
    flushed = tl.load(COUNTS + 2).to(tl.float32, bitcast=True)
    amax = tl.load(COUNTS + 3).to(tl.float32, bitcast=True)
    record_scale_range(REC, FLAG, CALL, LIMIT, operand, tl.load(COUNTS), tl.load(COUNTS + 1), flushed, amax)


@triton.jit(do_not_specialize=["FLAG", "CALL"])
def _decide(REC, FLAG, CALL):
    zero = tl.zeros((1,), tl.int32)
    decide_scale_range(REC, FLAG, CALL, zero, zero == 0)


_NO_RECORD: dict[torch.device, torch.Tensor] = {}


def recorded(slot: tuple | None, softmax_scale: float) -> tuple | None:
    """The pre-passes' record of a call: its range record's slot (``fp4vis.call.RecordSlot``: fields, flag, number;
    None: nothing recorded) with the call's score scale."""
    return None if slot is None else (*slot, softmax_scale * LOG2E)


def words(record: tuple | None, device: torch.device) -> tuple:
    """(fields, flag address, call, q/k flush limit) launch arguments of ``record``; where nothing is recorded
    (None, or call 0), int32 words of the device stand in for both (the kernels then write nothing), so that a
    launch with and one without a record share one compiled kernel."""
    if record is not None and record[2]:
        fields, flag, call, score_scale = record
        return fields, flag.data_ptr(), call, qk_flush_limit(score_scale)
    t = placeholder(device)
    return t, t.data_ptr(), 0, 0.0


def placeholder(device: torch.device) -> torch.Tensor:
    """Int32 words of the device that a launch's record arguments take where it records nothing."""
    t = _NO_RECORD.get(device)
    if t is None:
        t = _NO_RECORD[device] = torch.zeros(NUM_FIELDS, dtype=torch.int32, device=device)
    return t


def add_counts(counts: torch.Tensor, record: tuple | None, operand: int) -> None:
    """Add the int32 words of a ``fp4vis.formats`` ``*_scale_counts`` function to ``record`` under ``operand``
    (``Q_OPERAND``, ``K_OPERAND`` or ``V_OPERAND``), one launch; nothing where ``record`` is None or its call 0."""
    if record is not None and record[2]:
        fields, flag, call, limit = words(record, counts.device)
        _add_counts[(1,)](counts, fields, flag, call, limit, operand)


def decide(record: tuple | None) -> None:
    """``decide_scale_range`` in a launch of its own, for a recorded pre-pass that no attention kernel follows:
    ``record`` a ``fp4vis.call.RecordSlot`` (fields, flag, number) or the pre-passes' tuple (``recorded``); nothing
    where it is None or its call 0."""
    if record is not None and record[2]:
        _decide[(1,)](record[0], record[1].data_ptr(), record[2])
