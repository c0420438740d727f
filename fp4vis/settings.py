"""Settings from the environment: every ``FP4VIS_*`` variable is declared here, and read when it is
used (``setting(name)``), never at import. docs/configuration.md lists them (a test keeps the two in
step). The defaults are the product.

The kernel switches are read once, together (``kernel_settings()``: the values at their first use in the
process; ``overridden`` and ``refresh`` read them again), and each backend hands them to its kernels as
configuration. Kernel variants for measurement are not settings: a benchmark builds the variant's
configuration and hands it to the backend's launcher.
"""

from __future__ import annotations

import contextlib
import functools
import os
from collections.abc import Iterator
from dataclasses import dataclass

_TRUE, _FALSE = ("1", "true", "yes", "on"), ("0", "false", "no", "off")


@dataclass(frozen=True)
class Setting:
    """One environment variable: its default; a boolean flag unless ``text``."""

    name: str
    default: str
    doc: str
    text: bool = False              # free text (a path), returned as given

    def parse(self, raw: str) -> str | bool:
        if self.text:
            return raw
        value = raw.strip().lower()
        if value in _TRUE:
            return True
        if value in _FALSE:
            return False
        raise ValueError(f"{self.name}: expected 1 or 0, got {raw!r}")


SETTINGS: dict[str, Setting] = {s.name: s for s in (
    Setting("FP4VIS_HOPPER_TVM_FFI", "1", "Hopper kernel: launch through TVM-FFI where apache-tvm-ffi "
            "imports (a few microseconds per call); 0 uses the DLPack path"),
    Setting("FP4VIS_HOPPER_SHORT", "1", "Hopper backend: the short-sequence variant (two 64-row CTAs per "
            "SM) where both sequences are at most 768 keys; 0 never uses it"),
    Setting("FP4VIS_PREPASS_F16_CODES", "1", "Hopper pre-pass: E2M1 codes on FP16 pairs on the GPU "
            "(same bits); 0 selects the float32 form"),
    Setting("FP4VIS_PREPASS_FULL_SEARCH", "0", "Hopper pre-pass: the folded-K64 scale search over every "
            "candidate instead of the contenders (same bits, slower: for measurement); 1 turns it on"),
    Setting("FP4VIS_PREPASS_DIRECT_LAUNCH", "1", "Hopper pre-pass: launch the compiled Triton kernel "
            "directly (skips Triton's per-call argument binding); 0 uses the ordinary launch"),
    Setting("FP4VIS_BLACKWELL_CUBINS", "", "Blackwell backend: a folder of precompiled sm_90 cubins of its kernel "
            "(the H200 verification route, kernels/blackwell/cubin.py); empty: Triton compiles it", text=True),
    Setting("FP4VIS_BLACKWELL_PREPASS_FUSED", "1", "Blackwell pre-pass: the fused Triton launch on CUDA tensors "
            "(same bits); 0 runs the PyTorch statement"),
    Setting("FP4VIS_BLACKWELL_WARP_SPECIALIZED", "0", "Blackwell backend on sm_100/sm_103: the warp-specialised "
            "Gluon kernel (kernels/blackwell/gluon_ws.py) for the policies with m = 0 and no native positions (fast, "
            "wan_fast); never run by the project, so the self-check verifies it on first use; 1 turns it on"),
    Setting("FP4VIS_BLACKWELL_REPORT", "", "Tests: a JSON file where the Blackwell GPU tests write their "
            "per-case relL2 and bit-identical shares", text=True),
    Setting("FP4VIS_EXHAUSTIVE", "0", "Tests: run the exhaustive E2M1 rounding check over every float32 "
            "in [0, 1] (about a minute) instead of a sample"),
)}


@dataclass(frozen=True)
class KernelSettings:
    """The kernel switches, read from the environment once (``kernel_settings()``); each backend reads them at
    one place and hands them to its kernels as configuration (a compiled variant, a launcher's option)."""

    hopper_tvm_ffi: bool
    hopper_short: bool
    prepass_f16_codes: bool
    prepass_full_search: bool
    prepass_direct_launch: bool
    blackwell_cubins: str
    blackwell_prepass_fused: bool
    blackwell_warp_specialized: bool


@functools.cache
def kernel_settings() -> KernelSettings:
    """The ``KernelSettings`` as the environment had them at the first call of the process (``overridden`` and
    ``refresh`` read them again)."""
    return KernelSettings(*(setting(name) for name in (
        "FP4VIS_HOPPER_TVM_FFI", "FP4VIS_HOPPER_SHORT", "FP4VIS_PREPASS_F16_CODES", "FP4VIS_PREPASS_FULL_SEARCH",
        "FP4VIS_PREPASS_DIRECT_LAUNCH", "FP4VIS_BLACKWELL_CUBINS", "FP4VIS_BLACKWELL_PREPASS_FUSED",
        "FP4VIS_BLACKWELL_WARP_SPECIALIZED")))


def refresh() -> None:
    """Forget the values ``kernel_settings`` read (after changing the environment by hand)."""
    kernel_settings.cache_clear()


def setting(name: str) -> str | bool:
    """The value of ``name`` now: a bool for a flag, the text as given for a text setting. An unknown
    name is a programming error (KeyError); a bad value raises ValueError naming the variable."""
    s = SETTINGS[name]
    return s.parse(os.environ.get(name, s.default))


@contextlib.contextmanager
def overridden(**values: str) -> Iterator[None]:
    """Run a block with some settings set (``overridden(FP4VIS_HOPPER_SHORT="0")``), restoring the
    environment afterwards. For benchmarks and tests that compare variants in one process."""
    for name, raw in values.items():
        SETTINGS[name].parse(raw)   # an unknown name or a bad value fails before anything changes
    saved = {name: os.environ.get(name) for name in values}
    os.environ.update(values)
    refresh()
    try:
        yield
    finally:
        for name, old in saved.items():
            if old is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = old
        refresh()


def markdown_table() -> str:
    """The settings as docs/configuration.md lists them (``python -m fp4vis.settings`` prints it)."""
    rows = ["| variable | default | values | what |", "|---|---|---|---|"]
    for s in SETTINGS.values():
        values = "a path" if s.text else "`1`, `0`"
        rows.append(f"| `{s.name}` | `{s.default}` | {values} | {s.doc} |")
    return "\n".join(rows)


if __name__ == "__main__":
    print(markdown_table())
