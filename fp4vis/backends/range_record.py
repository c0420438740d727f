"""The range record: how a GPU kernel reports what went past a Direct-P policy's range (saturated P
blocks, rows whose probabilities all underflow, non-finite output) without a host synchronisation
per call (docs/numerics.md section 8).

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

Under torch.compile none of this may run while Dynamo traces (it reads host memory and numbers calls,
which a graph would freeze): ``fp4vis.attention`` then names its call once, at trace time
(``call_site``: backend, policy, range_check, layout and layer, kept in a table under an int), and the
backend's custom op, which runs in the compiled graph on every call, polls and numbers the call there
(``start_site_call``); the patched forward's check is the op ``torch.ops.fp4vis.range_check``, ordered
after the forward's output (``check_after``). So a compiled call reports where an eager one does. In
CUDA-graph replays (``torch.cuda.graph``, torch.compile's ``mode="reduce-overhead"``) no Python runs:
the kernels still count into the record, which the next eager call or ``fp4vis.check_range()`` reads,
and a replay reports as the captured call.

Errors name the call (its number, backend, policy, shapes and dtype) and, inside a patched model,
the layer (``fp4vis.attention``'s ``label``, which ``fp4vis.patching`` sets). They are ``DeferredRangeError`` (a
``RangeExceededError``) and ``DeferredInputError`` (a ``ValueError``, for NaN or Inf in q, k or v,
which the kernels propagate to the output: named where the inputs are still alive at the check).
"""

from __future__ import annotations

import collections
import contextlib
import contextvars
import functools
import itertools
import json
import threading
import warnings
import weakref
from dataclasses import dataclass

import torch

from fp4vis.call import RecordSlot
from fp4vis.policy import Policy
from fp4vis.range_report import RangeExceededError, RangeReport
from fp4vis.tracing import constant_at_trace_time

# fields of the device record (int32, byte offsets 0, 4, 8, 12: the attention kernels' contract); then the
# blocks of q, k, v whose scale underflows (SCALE_UNDERFLOW + 0, 1, 2) or saturates (SCALE_OVERFLOW + 0, 1, 2)
# its format (the pre-passes' contract); then the pre-passes' words of the call in flight, which the call's
# attention kernel moves into SCALE_UNDERFLOW where they can change the result, and clears (kernels/scale_record.py):
# its underflows (CALL_UNDERFLOW + 0, 1, 2), its ScaleRange.flushed and .amax as float32 bits (CALL_FLUSHED,
# CALL_AMAX + 0, 1, 2) and its q/k flush limit as float32 bits (CALL_LIMIT)
SATURATED, EMPTY_ROWS, NONFINITE, FIRST_CALL = range(4)
SCALE_UNDERFLOW, SCALE_OVERFLOW = 4, 7
CALL_UNDERFLOW, CALL_FLUSHED, CALL_AMAX, CALL_LIMIT = 10, 13, 16, 19
NUM_FIELDS = 20
NO_CALL = 2**31 - 1          # FIRST_CALL before any call reported (the kernels take a minimum)
KEPT_CALLS = 4096            # CallInfo kept for error messages (the most recent calls)


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
    compiled: bool = False       # made in a torch.compile graph (range_record.start_site_call)

    def describe(self) -> str:
        q, k, v = (tuple(s) for s in self.shapes)
        where = f", layer {self.layer!r}" if self.layer else ""
        kind = "compiled " if self.compiled else ""
        return (f"{kind}fp4vis.attention call #{self.number} ({self.backend} backend, policy {self.policy.name!r}, "
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
        self.calls: collections.deque[tuple] = collections.deque(maxlen=KEPT_CALLS)   # CallInfo fields
        self._numbers = itertools.count(1)   # thread-safe under the GIL
        self.unchecked = False   # calls recorded since the last check
        self.captured = False    # a call was captured in a CUDA graph: its replays may report at any time
        self.lock = threading.Lock()
        _FLAGS.append(self._flag)

    def start_call(self, backend: str, policy: Policy, mode: str, layout: str,
                   inputs: tuple[torch.Tensor, torch.Tensor, torch.Tensor], layer: str | None = None,
                   compiled: bool = False, shapes: tuple | None = None) -> RecordSlot:
        """Number a call (q, k, v as given to ``fp4vis.attention``, in ``layout``, or, ``compiled``, as its op
        got them, with ``shapes`` as given; ``layer``: its label); returns its ``RecordSlot``. A call in CUDA-graph
        capture marks the record ``captured``: its replays run no Python, so every later check waits for the
        device."""
        q, k, v = inputs
        number = next(self._numbers) % (NO_CALL - 1) + 1    # 1 .. NO_CALL - 1
        self.unchecked = True
        if capturing():
            self.captured = True
        self.calls.append((number, backend, policy, mode, layout, layer, shapes or (q.shape, k.shape, v.shape),
                           q.dtype, (weakref.ref(q), weakref.ref(k), weakref.ref(v)), compiled))
        return RecordSlot(self.fields, self.flag, number)

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
                             nonfinite_outputs=vals[NONFINITE],
                             scale_underflow=tuple(vals[SCALE_UNDERFLOW:SCALE_UNDERFLOW + 3]),
                             scale_overflow=tuple(vals[SCALE_OVERFLOW:SCALE_OVERFLOW + 3]))
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


@dataclass(frozen=True)
class CallSite:
    """A compiled ``fp4vis.attention`` call as traced: what its errors and its backend's op need."""

    backend: str
    policy: Policy
    mode: str                    # its range_check: "raise", "warn" or "off"
    layout: str

    def describe(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> str:
        """What an error of this site's call names, from the (B, H, S, D) tensors its op got (no layer: a layer's
        name in the graph would give every layer a graph of its own)."""
        shapes = [tuple(t.transpose(1, 2).shape if self.layout == "bshd" else t.shape) for t in (q, k, v)]
        return (f"compiled fp4vis.attention call ({self.backend} backend, policy {self.policy.name!r}, {self.layout} "
                f"q {shapes[0]} k {shapes[1]} v {shapes[2]} {str(q.dtype).removeprefix('torch.')})")


_SITES: dict[CallSite, int] = {}
_SITE_LIST: list[CallSite | None] = [None]   # number 0: no site


def call_site(backend: str, policy: Policy, mode: str, layout: str) -> int:
    """The number (>= 1) of a traced call's ``CallSite``; Dynamo runs ``_site_number`` once, at trace time,
    so that the compiled graph passes the number to its backend's op as a constant."""
    return _site_number(backend, policy.values(), mode, layout)


@constant_at_trace_time
def _site_number(backend: str, policy_values: tuple, mode: str, layout: str) -> int:
    site = CallSite(backend, Policy(*policy_values), mode, layout)
    with _LOCK:
        number = _SITES.get(site)
        if number is None:
            number = _SITES[site] = len(_SITE_LIST)
            _SITE_LIST.append(site)
    return number


def policy_text(policy: Policy) -> str:
    """A policy as an op argument (a string of its values, made at trace time): an op that computes from it
    needs nothing of this process's tables (``policy_of_text``)."""
    return _policy_text(policy.values())


@constant_at_trace_time
def _policy_text(values: tuple) -> str:
    return json.dumps(list(values))


@functools.lru_cache(maxsize=256)
def policy_of_text(text: str) -> Policy:
    """The policy of a ``policy_text``."""
    return Policy(*json.loads(text))


def site_of(number: int) -> CallSite:
    """The ``CallSite`` of a ``call_site`` number (in a backend's op, at run time)."""
    if not 0 < number < len(_SITE_LIST):
        raise ValueError(f"record_site: {number} names no traced fp4vis.attention call")
    return _SITE_LIST[number]


def start_site_call(number: int, inputs: tuple[torch.Tensor, torch.Tensor, torch.Tensor]) -> RecordSlot | None:
    """In a kernel backend's op, at run time, for a compiled call: report what finished kernels raised
    (``poll``), then number the call as ``fp4vis.attention`` does an eager one. ``inputs``: the op's
    (B, H, S, D) q, k, v. Returns its ``RecordSlot``, None where the site's range_check is "off"."""
    site = site_of(number)
    poll()
    if site.mode == "off":
        return None
    shapes = tuple(t.transpose(1, 2).shape if site.layout == "bshd" else t.shape for t in inputs)
    return record_for(inputs[0].device).start_call(site.backend, site.policy, site.mode, site.layout, inputs,
                                                   compiled=True, shapes=shapes)


#: what the check op of a compiled forward declares it writes (a private one-element tensor): a compiler
#: drops an op without outputs that writes nothing, and the forward's own output must stay untouched
CHECK_TOKEN = torch.zeros(1)


def _check_after(token: torch.Tensor, after: list[torch.Tensor], where: str) -> None:
    check(where)


check_after = torch.library.custom_op("fp4vis::range_check", mutates_args=("token",))(_check_after)
check_after.__doc__ = """``check(where)`` as an op of a compiled graph (a patched model's forward hook under
torch.compile): ``after`` are the forward's output tensors, so the op runs after the calls that made them;
``token`` is ``CHECK_TOKEN``, which the op is declared to write (it does not) so that every torch release
keeps it in the graph."""


@check_after.register_fake
def _check_after_fake(token, after, where):
    return None


_LAYER: contextvars.ContextVar[str | None] = contextvars.ContextVar("fp4vis_layer", default=None)


@contextlib.contextmanager
def layer_scope(name: str):
    """Eager ``fp4vis.attention`` calls made inside are the layer ``name``'s: the record keeps the name for their
    errors (a patched layer's calls run in one: ``LayerState.fp4_call``)."""
    token = _LAYER.set(name)
    try:
        yield
    finally:
        _LAYER.reset(token)


def current_layer() -> str | None:
    """The layer of ``layer_scope`` around this call, None outside one."""
    return _LAYER.get()


def labelled(message: str, layer: str | None) -> str:
    """An error message of a patched layer's call, starting with the layer's name (a model has dozens)."""
    return message if layer is None else f"layer {layer!r}: {message}"


def capturing() -> bool:
    """In CUDA-graph capture, where waiting for the device (or any data-dependent host check) is not
    allowed: the check waits for the next call or check outside it."""
    return torch.cuda.is_available() and torch.cuda.is_current_stream_capturing()


def poll() -> None:
    """At the start of a call: raise (or warn) for a finished kernel that raised a flag."""
    for flag in _FLAGS:
        if flag[0]:
            for rec in tuple(_RECORDS.values()):
                if rec._flag[0] and not capturing():
                    _report(rec, "the next fp4vis.attention call")
            return


def check(where: str = "fp4vis.check_range()") -> None:
    """Wait for the devices that ran recorded calls since the last check and raise (or warn) for
    any call that went past its range. Costs nothing when no call was recorded."""
    for rec in tuple(_RECORDS.values()):
        if (rec.unchecked or rec.captured or rec._flag[0]) and not capturing():
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
                                  f"{report.empty_rows} empty rows, {report.nonfinite_outputs} non-finite outputs, "
                                  f"q, k, v blocks whose scale underflows {report.scale_underflow} or saturates "
                                  f"{report.scale_overflow} its format")
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
