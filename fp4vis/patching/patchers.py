"""The patcher registry: one entry per library patcher, in the order ``fp4vis.patch`` asks them.

A patcher is a module with four functions (``Patcher``):

* ``find_layers(root, *, cross_attention, decoder) -> list[LayerSpec]``: the layers it reaches in ``root``;
* ``is_known_non_attention(module) -> bool``: an attention-looking module it knows needs no patch;
* ``install(spec, state) -> token`` and ``uninstall(spec, state, token)``: the reversible per-layer hook.

Adding a model family is one module with these four functions, its line here and its test. A patcher is
imported only when its library already is (a model of a library never imported cannot exist), so
``fp4vis.patch`` never imports diffusers, timm or transformers itself. A layer found by an earlier patcher is
not offered to a later one (``discovery.find_layers``): model-specific fast paths come before generic ones."""

from __future__ import annotations

import importlib
import sys
from typing import Any, NamedTuple, Protocol

import torch


class Patcher(Protocol):
    def find_layers(self, root: torch.nn.Module, *, cross_attention: bool = False,
                    decoder: bool = False) -> list: ...

    def is_known_non_attention(self, module: torch.nn.Module) -> bool: ...

    def install(self, spec: Any, state: Any) -> Any: ...

    def uninstall(self, spec: Any, state: Any, token: Any) -> None: ...


class PatcherEntry(NamedTuple):
    name: str        # LayerSpec.patcher of the layers it finds
    library: str     # the top-level package whose models it patches
    module: str      # where it is defined


#: model-specific patchers first (a layer is offered to the first that finds it)
PATCHERS: tuple[PatcherEntry, ...] = (
    PatcherEntry("wan", "diffusers", "fp4vis.patching.wan"),
    PatcherEntry("diffusers", "diffusers", "fp4vis.patching.diffusers_attention"),
    PatcherEntry("timm", "timm", "fp4vis.patching.timm_attention"),
    PatcherEntry("transformers", "transformers", "fp4vis.patching.transformers_attention"),
)


def loaded_patchers() -> dict[str, Patcher]:
    """name -> patcher module, for the patchers whose library is already imported, in registry order."""
    return {e.name: importlib.import_module(e.module) for e in PATCHERS if e.library in sys.modules}
