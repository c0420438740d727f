"""Where the patchers look: a model itself, or the denoisers of a diffusers pipeline. Its own module
because ``discovery`` imports the patcher modules (lazily), and the Wan patcher needs this too."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

__all__ = ["roots"]

_DENOISER_COMPONENTS = ("transformer", "transformer_2", "unet")


def roots(obj: Any, caller: str = "fp4vis.patch") -> list[tuple[str, torch.nn.Module]]:
    """(component name, module) pairs to search: a module itself, or a pipeline's denoisers; ``caller``
    names the function in the error."""
    if isinstance(obj, torch.nn.Module):
        return [("", obj)]
    comps = getattr(obj, "components", None)
    if isinstance(comps, Mapping):
        roots = [(n, m) for n, m in comps.items() if n in _DENOISER_COMPONENTS and isinstance(m, torch.nn.Module)]
        if roots:
            return roots
        raise TypeError(f"{caller}: pipeline {type(obj).__name__} has no denoiser component "
                        f"({', '.join(_DENOISER_COMPONENTS)}) holding a torch module")
    raise TypeError(f"{caller}: expected a torch.nn.Module or a diffusers pipeline, got {type(obj).__name__}")
