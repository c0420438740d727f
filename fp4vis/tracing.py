"""What code that torch.compile traces needs from fp4vis: functions Dynamo runs for real while it traces,
instead of tracing them (``constant_at_trace_time``), and warnings issued that way (``warn_once``: Dynamo
cannot trace ``warnings.warn``, so a first warning inside a ``fullgraph=True`` trace would fail it).

Nothing here imports torch._dynamo: ``import fp4vis`` stays light (seconds otherwise)."""

from __future__ import annotations

import threading
import warnings

_WARNED: set[tuple] = set()
_LOCK = threading.Lock()


def constant_at_trace_time(fn):
    """``torch.compiler.assume_constant_result``: under torch.compile Dynamo runs ``fn`` for real while it
    traces and puts the result in the graph as a constant (for values fixed for the process: a device's
    launch route, a traced call's site, a warning issued once). Without importing torch._dynamo: the mark is
    this attribute (torch/_dynamo/decorators.py); the compiled-call tests fail where Dynamo stops honouring
    it. Arguments must be plain values (str, int, float, bool, tuples of them)."""
    fn._dynamo_marked_constant = True
    return fn


@constant_at_trace_time
def warn_once(key: tuple, message: str, category: type[Warning] = UserWarning) -> bool:
    """Issue ``message`` the first time ``key`` is seen in the process (eagerly, or once while Dynamo traces);
    True when it warned. The warning points at this function: the callers are library layers whose own
    frames would be as unhelpful to the user."""
    with _LOCK:
        if key in _WARNED:
            return False
        _WARNED.add(key)
    warnings.warn(message, category, stacklevel=2)
    return True


def forget_warnings() -> None:
    """Forget which warnings were issued (the tests' clean slate)."""
    with _LOCK:
        _WARNED.clear()
