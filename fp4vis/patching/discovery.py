"""Finding the attention layers of a model or pipeline that fp4vis can reach, and naming them: the
patcher modules of the libraries already imported each report their layers (``LayerSpec``)."""

from __future__ import annotations

import fnmatch
from collections.abc import Mapping
from typing import Any

import torch

from .layer import LayerSpec
from .patchers import loaded_patchers
from .roots import roots


def _looks_like_attention(module: torch.nn.Module) -> bool:
    n = type(module).__name__
    return (n.endswith(("Attention", "Attn", "SelfAttention")) or "Attention" in n) and not n.endswith(
        ("Processor", "Output", "Pooling"))


def find_layers(obj: Any, *, cross_attention: bool = False, decoder: bool = False) -> tuple[
        list[LayerSpec], list[tuple[str, str]]]:
    """All reachable attention layers of a model or pipeline, and the unsupported attention-like
    modules found next to them as (name, class) pairs."""
    specs: list[LayerSpec] = []
    unsupported: list[tuple[str, str]] = []
    mods = list(loaded_patchers().values())
    for comp, root in roots(obj):
        found: list[LayerSpec] = []
        reached: set[int] = set()
        for pm in mods:   # a layer goes to the first patcher that finds it (patchers.PATCHERS' order)
            new = [s for s in pm.find_layers(root, cross_attention=cross_attention, decoder=decoder)
                   if id(s.module) not in reached]
            found.extend(new)
            reached.update(id(s.module) for s in new)
        for s in found:
            s.component = comp
            s.local_name = s.name or ROOT_NAME
            s.name = _module_name(comp, s.name)
        specs.extend(found)
        for name, m in root.named_modules():
            if id(m) in reached or not _looks_like_attention(m):
                continue
            if any(id(c) in reached for c in m.modules()):
                continue  # a container of supported layers (e.g. a transformers ViTAttention parent)
            if any(pm.is_known_non_attention(m) for pm in mods):
                continue
            unsupported.append((_module_name(comp, name), _class_text(m)))
    return specs, unsupported


def _class_text(module: torch.nn.Module) -> str:
    """A module's class in messages, with its attention processor where it has one (diffusers)."""
    proc = getattr(module, "processor", None)
    text = type(module).__qualname__
    return f"{text} with processor {type(proc).__name__}" if proc is not None else text


ROOT_NAME = "<root>"


def _module_name(component: str, name: str) -> str:
    """A module's name in messages: its path under the pipeline component; the model itself (named "" by
    ``named_modules``) is ``<root>``."""
    return ".".join(n for n in (component, name) if n) or ROOT_NAME


def main_stacks(specs: list[LayerSpec]) -> dict[str, str]:
    """component -> its main block stack: the stack of its first default layer that names one (module order)."""
    out: dict[str, str] = {}
    for s in specs:
        if s.default and s.stack is not None:
            out.setdefault(s.component, s.stack)
    return out


def select_layers(specs: list[LayerSpec], key: Any) -> list[LayerSpec]:
    """The layers a ``layers=`` key names: an int, the default layers with that block index in their component's
    main stack (``main_stacks``; layers whose patcher names no stack by index alone); a str, an fnmatch pattern
    over the names (qualified or within the component)."""
    if isinstance(key, bool):
        raise TypeError(f"layers: key {key!r} must be a layer index (int) or a name pattern (str)")
    if isinstance(key, int):
        main = main_stacks(specs)
        return [s for s in specs if s.default and s.index == key and (s.stack is None or s.stack == main.get(
            s.component))]
    if isinstance(key, str):
        return [s for s in specs if fnmatch.fnmatchcase(s.name, key) or (
            s.local_name != s.name and fnmatch.fnmatchcase(s.local_name, key))]
    raise TypeError(f"layers: key {key!r} must be a layer index (int) or a name pattern (str)")


def model_id(obj: Any) -> str:
    cfg = getattr(obj, "config", None)
    v = cfg.get("_name_or_path") if isinstance(cfg, Mapping) else getattr(cfg, "_name_or_path", None)
    if isinstance(v, str) and v:
        return v
    cfg = getattr(obj, "pretrained_cfg", None)
    if isinstance(cfg, Mapping):
        for key in ("hf_hub_id", "architecture", "file"):
            if cfg.get(key):
                return str(cfg[key])
    return type(obj).__name__
