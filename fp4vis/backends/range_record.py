"""The range record: how a GPU kernel reports what went past a Direct-P policy's range (saturated P
blocks, rows whose probabilities all underflow, non-finite output) without a host synchronisation
per call (docs/numerics.md section 9).

One record per CUDA device:

* ``fields``: int32 on the device, which the kernel adds its counts to (``SATURATED``, ``EMPTY_ROWS``,
  ``NONFINITE``: the fields of ``RangeReport``, summed over the calls since the last check) and
  lowers ``FIRST_CALL`` to the number of the earliest call that reported anything;
* ``flag``: one int32 in pinned host memory, which the kernel writes directly (unified virtual
  addressing): a call that reports anything stores its number there. Reading it costs the host
  nothing: no copy, no synchronisation.

``RangeRecord.start_call`` numbers a call and keeps what its error message needs (``CallInfo``; the
last ``KEPT_CALLS`` calls). The record is read at three points:

* ``poll()``, at the start of every ``fp4vis.attention`` call: if a finished kernel raised the flag,
  wait for the device, read the fields and raise (or warn) for the earliest call;
* ``check()``, at the end of every forward of a patched model (and ``fp4vis.check_range``): if
  calls were recorded since the last check, wait for the device first, so that a forward never
  returns an output whose range was exceeded without an error;
* nothing else: a program that calls ``fp4vis.attention`` directly and stops sees the error at its
  next call or at ``fp4vis.check_range()``.

Errors name the call (its number, backend, policy, shapes and dtype) and, inside a patched model,
the layer (``call_label``, set by ``fp4vis.patching``). They are ``DeferredRangeError`` (a
``RangeExceededError``) and ``DeferredInputError`` (a ``ValueError``, for NaN or Inf in q, k or v,
which the kernels propagate to the output: named where the inputs are still alive at the check).
"""

from __future__ import annotations

import collections
import contextvars
import itertools
import threading
import warnings
import weakref
from dataclasses import dataclass

import torch

from fp4vis.policy import Policy
from fp4vis.reference import RangeExceededError, RangeReport

# fields of the device record (int32, byte offsets 0, 4, 8, 12: the kernels' contract)
SATURATED, EMPTY_ROWS, NONFINITE, FIRST_CALL = range(4)
NUM_FIELDS = 4
NO_CALL = 2**31 - 1          # FIRST_CALL before any call reported (the kernels take a minimum)
KEPT_CALLS = 4096            # CallInfo kept for error messages (the most recent calls)

#: the patched layer of the current call (``fp4vis.patching`` sets it around each call)
call_label: contextvars.ContextVar[str | None] = contextvars.ContextVar("fp4vis_call_label", default=None)


class DeferredRangeError(RangeExceededError):
    """A kernel call went past its policy's range; raised at a later check (see the module docstring)."""


class DeferredInputError(ValueError):
    """A kernel call had NaN or Inf in q, k or v; raised at a later check."""


@dataclass(eq=False)
class CallInfo:
    """What an error message says about a recorded call (made from the record's tuple on the error
    path only: ``start_call`` keeps a plain tuple, the per-call cost is a few microseconds)."""

    number: int
    backend: str
    policy: Policy
    mode: str                    # its range_check: "raise" or "warn"
    layout: str
    layer: str | None
    shapes: tuple                # q, k, v shapes as given to fp4vis.attention
    dtype: torch.dtype
    inputs: tuple                # weak references to q, k, v

    def describe(self) -> str:
        q, k, v = (tuple(s) for s in self.shapes)
        where = f", layer {self.layer!r}" if self.layer else ""
        return (f"fp4vis.attention call #{self.number} ({self.backend} backend, policy {self.policy.name!r}, "
                f"{self.layout} q {q} k {k} v {v} {str(self.dtype).removeprefix('torch.')}{where})")


class RangeRecord:
    """The range record of one device (module docstring): a CUDA device, or the CPU, where the tests
    stand in for a kernel."""

    def __init__(self, device: torch.device):
        self.device = device
        self.fields = torch.zeros(NUM_FIELDS, dtype=torch.int32, device=device)
        self.fields[FIRST_CALL] = NO_CALL
        # pinned host memory is mapped into the device's address space (UVA): the kernel stores here
        self.flag = torch.zeros(1, dtype=torch.int32, pin_memory=device.type == "cuda")
        self._flag = self.flag.numpy()
        self._addresses = (self.fields.data_ptr(), self.flag.data_ptr())
        self.calls: collections.deque[tuple] = collections.deque(maxlen=KEPT_CALLS)   # CallInfo fields
        self._numbers = itertools.count(1)   # thread-safe under the GIL
        self.unchecked = False   # calls recorded since the last check
        self.lock = threading.Lock()
        _FLAGS.append(self._flag)

    def start_call(self, backend: str, policy: Policy, mode: str, layout: str,
                   inputs: tuple[torch.Tensor, torch.Tensor, torch.Tensor]) -> tuple[int, int, int]:
        """Number a call (q, k, v as given to ``fp4vis.attention``, in ``layout``); returns the kernel's
        launch arguments (fields address, flag address, number)."""
        q, k, v = inputs
        number = next(self._numbers) % (NO_CALL - 1) + 1    # 1 .. NO_CALL - 1
        self.unchecked = True
        self.calls.append((number, backend, policy, mode, layout, call_label.get(), (q.shape, k.shape, v.shape),
                           q.dtype, (weakref.ref(q), weakref.ref(k), weakref.ref(v))))
        return (*self._addresses, number)

    @property
    def last_number(self) -> int | None:
        """The number of the most recent recorded call (None before any)."""
        return self.calls[-1][0] if self.calls else None

    def collect(self) -> tuple[CallInfo | None, int, RangeReport] | None:
        """Wait for the device, read and reset the record: (the earliest reporting call's CallInfo,
        or None where it is no longer kept; its number; the counts) or None when nothing was reported."""
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        with self.lock:
            self.unchecked = False
            if not self._flag[0]:
                return None
            vals = self.fields.tolist()
            self.fields.zero_()
            self.fields[FIRST_CALL] = NO_CALL
            self._flag[0] = 0
            number = vals[FIRST_CALL]
            info = next((CallInfo(*c) for c in reversed(self.calls) if c[0] == number), None)
        report = RangeReport(saturated_blocks=vals[SATURATED], empty_rows=vals[EMPTY_ROWS],
                             nonfinite_outputs=vals[NONFINITE])
        return info, number, report


_RECORDS: dict[torch.device, RangeRecord] = {}
_FLAGS: list = []      # every record's flag (poll reads these alone)
_LOCK = threading.Lock()


def record_for(device: torch.device) -> RangeRecord:
    """The range record of a device (made at its first use)."""
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    rec = _RECORDS.get(device)
    if rec is None:
        with _LOCK:
            rec = _RECORDS.get(device)
            if rec is None:
                rec = _RECORDS[device] = RangeRecord(device)
    return rec


def discard(device: torch.device) -> None:
    """Forget a device's record, unread (the tests' clean slate)."""
    with _LOCK:
        rec = _RECORDS.pop(device, None)
        if rec is not None:
            _FLAGS[:] = [f for f in _FLAGS if f is not rec._flag]


def _capturing() -> bool:
    """In CUDA-graph capture, where waiting for the device is not allowed: the check waits for the
    next call or check outside it."""
    return torch.cuda.is_available() and torch.cuda.is_current_stream_capturing()


def poll() -> None:
    """At the start of a call: raise (or warn) for a finished kernel that raised a flag."""
    for flag in _FLAGS:
        if flag[0]:
            for rec in tuple(_RECORDS.values()):
                if rec._flag[0] and not _capturing():
                    _report(rec, "the next fp4vis.attention call")
            return


def check(where: str = "fp4vis.check_range()") -> None:
    """Wait for the devices that ran recorded calls since the last check and raise (or warn) for
    any call that went past its range. Costs nothing when no call was recorded."""
    for rec in tuple(_RECORDS.values()):
        if (rec.unchecked or rec._flag[0]) and not _capturing():
            _report(rec, where)


def _report(rec: RangeRecord, where: str) -> None:
    found = rec.collect()
    if found is None:
        return
    info, number, report = found
    exc = _error(info, number, report, where)
    if info is not None and info.mode == "warn":
        warnings.warn(str(exc), RuntimeWarning, stacklevel=3)
        return
    raise exc


def _error(info: CallInfo | None, number: int, report: RangeReport, where: str) -> Exception:
    who = info.describe() if info is not None else f"fp4vis.attention call #{number} (no longer described)"
    when = f"reported at {where}"
    if report.nonfinite_outputs:
        bad = _nonfinite_input(info)
        if bad is not None:
            return DeferredInputError(f"{who}, {when}: {bad}; attention inputs must be finite")
    if info is None:
        return DeferredRangeError(f"{who}, {when}: {report.saturated_blocks} saturated P blocks, "
                                  f"{report.empty_rows} empty rows, {report.nonfinite_outputs} non-finite outputs")
    message = report.describe(info.policy)
    if report.nonfinite_outputs and not all(r() is not None for r in info.inputs):
        message += (" (NaN or Inf in q, k or v also gives non-finite outputs: the kernel propagates them; "
                    "the inputs were freed before this check, so they could not be inspected)")
    return DeferredRangeError(f"{who}, {when}: {message}")


def _nonfinite_input(info: CallInfo | None) -> str | None:
    """'q: contains NaN' (the first of q, k, v that is not finite) where the call's inputs are still alive."""
    if info is None:
        return None
    for name, ref in zip("qkv", info.inputs):
        t = ref()
        if t is not None and not bool(torch.isfinite(t).all()):
            return f"{name}: contains {'NaN' if bool(torch.isnan(t).any()) else 'Inf'}"
    return None
