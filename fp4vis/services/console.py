"""What reaches the user's terminal besides a command's own lines: the one filter of warnings (``WarningLog``:
fp4vis' own printed once each, those the libraries issue on their own counted for the reports,
``library_warnings``) and the libraries' loading bars (``loading_bars``)."""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

# The warnings of every command pass through one filter, WarningLog: fp4vis' own (a fallback to the reference
# or to exact attention, a range warning, the CPU-size warning) are printed, once per message: they are the
# visible fallback the project promises. Those the libraries underneath issue on their own (flash-attn-4's CuTe
# DSL argument warning, CuTe DSL's loop-size hint, deprecation notes) are not the user's doing: they are counted
# and recorded in the run's JSON and Markdown (``environment()["library_warnings"]``), not printed.
OWN_MODULES = ("fp4vis", "__main__")   # issuers whose warnings are shown: fp4vis, and the user's own script
_ACTIVE: list[WarningLog] = []          # the logs open now, outermost first (the CLI's, then an eval run's)


def _issuer(frame: Any) -> str:
    """The module whose code called ``warnings.warn``: the first frame above the warnings machinery. Not the
    module a warning is attributed to, which ``stacklevel`` moves (fp4vis' fallback warnings point at the
    caller's code, a library's may point into fp4vis')."""
    while frame is not None and frame.f_globals.get("__name__") == "warnings":
        frame = frame.f_back
    return "?" if frame is None else str(frame.f_globals.get("__name__", "?"))


def _is_own(module: str) -> bool:
    return any(module == m or module.startswith(m + ".") for m in OWN_MODULES)


def _short_path(filename: str) -> str:
    """A source path without the machine's prefix: from the package folder on where it is installed."""
    parts = Path(filename).parts
    for anchor in ("site-packages", "dist-packages"):
        if anchor in parts:
            return "/".join(parts[parts.index(anchor) + 1:])
    return Path(filename).name


class WarningLog:
    """The warnings raised inside a block, sorted by who issued them (the module that called
    ``warnings.warn``, whatever its ``stacklevel``). fp4vis' own are kept in ``messages`` (each distinct
    message once, at most ``limit``) for the reports and printed to stderr the first time any open log sees
    them; a library's are counted in ``library`` and not printed. Logs nest (the CLI's around a command, an
    eval's around each run): an inner log passes what it kept to the one around it when it closes. With
    Python's -W option or PYTHONWARNINGS set, library warnings are shown as Python shows them, and counted."""

    def __init__(self, echo: bool = True, limit: int = 20):
        self.echo, self.limit = echo, limit
        self.messages: list[str] = []
        self.library: dict[tuple[str, str, str], dict[str, Any]] = {}   # (module, category, message) -> record

    def __enter__(self) -> WarningLog:
        import warnings

        self._ctx = warnings.catch_warnings()
        self._ctx.__enter__()
        self._shown_by_python = warnings.showwarning if sys.warnoptions else None
        # after the filters already set (Python's defaults ignore DeprecationWarning outside __main__, libraries
        # silence their own notes): everything else reaches ``_show`` at every occurrence, so counts are counts
        warnings.filterwarnings("always", append=True)
        warnings.showwarning = self._show
        _ACTIVE.append(self)
        return self

    def __exit__(self, *exc) -> None:
        _ACTIVE.remove(self)
        self._ctx.__exit__(*exc)
        if _ACTIVE:
            outer = _ACTIVE[-1]
            outer.messages += [m for m in self.messages if m not in outer.messages][: outer.limit - len(outer.messages)]
            for key, rec in self.library.items():
                outer._count(key, rec["where"], rec["count"])

    def _show(self, message, category, filename, lineno, file=None, line=None) -> None:
        module = _issuer(sys._getframe(1))
        if not _is_own(module):
            self._count((module, category.__name__, str(message)), f"{_short_path(filename)}:{lineno}", 1)
            if self._shown_by_python is not None:
                self._shown_by_python(message, category, filename, lineno, file, line)
            return
        msg = f"{category.__name__}: {message}"
        if self.echo and not any(msg in log.messages for log in _ACTIVE):
            from tqdm import tqdm

            tqdm.write(f"warning: {msg}", file=sys.stderr)   # between progress bars, not through one
        if msg not in self.messages and len(self.messages) < self.limit:
            self.messages.append(msg)

    def _count(self, key: tuple[str, str, str], where: str, times: int) -> None:
        rec = self.library.setdefault(key, {"module": key[0], "category": key[1], "message": key[2],
                                            "where": where, "count": 0})
        rec["count"] += times


def library_warnings() -> list[dict[str, Any]]:
    """The library warnings the open logs have counted so far (module, category, message, where, count),
    in the order they first came: what ``environment()`` records for a run's report."""
    merged: dict[tuple[str, str, str], dict[str, Any]] = {}
    for log in _ACTIVE:
        for key, rec in log.library.items():
            merged.setdefault(key, {**rec, "count": 0})["count"] += rec["count"]
    return list(merged.values())


@contextlib.contextmanager
def loading_bars(enabled: bool) -> Iterator[None]:
    """The loading and download bars of transformers, diffusers and huggingface_hub on or off, through their
    own switches, and restored after (``--no-progress`` hides them with fp4vis' own bars)."""
    if enabled:
        yield
        return
    import diffusers.utils.logging as diffusers_logging
    import huggingface_hub.utils as hub_utils
    import transformers.utils.logging as transformers_logging

    was = (transformers_logging.is_progress_bar_enabled(), diffusers_logging.is_progress_bar_enabled(),
           not hub_utils.are_progress_bars_disabled())
    transformers_logging.disable_progress_bar()
    diffusers_logging.disable_progress_bar()
    hub_utils.disable_progress_bars()
    try:
        yield
    finally:
        for on, lib in zip(was, (transformers_logging, diffusers_logging)):
            if on:
                lib.enable_progress_bar()
        if was[2]:
            hub_utils.enable_progress_bars()
