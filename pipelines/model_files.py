"""What a model source's files say, read before (or without) its weights: ``resolve_model`` (where a source's
folder is: a model fp4vis ships is its folder), ``model_index`` (a local diffusers folder's
``model_index.json``; ``has_transformer``: whether it names a transformer), ``training_record`` (a folder's
``training.json``), the prompts a model trained on a closed set knows (``known_prompts``, ``check_prompt``), and a
loaded pipeline's transformers (``pipeline_transformers``). Generic: every pipeline reads them, Wan's and any
other diffusers pipeline's."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from fp4vis.services.usage import UsageError


def resolve_model(model: str) -> str:
    """The source ``from_pretrained`` reads: a model fp4vis ships (``fp4vis:...``) is its folder, any other as given."""
    from fp4vis import zoo

    return zoo.resolve_source(model, "model") if zoo.is_zoo_source(model) else model


def model_index(path: str) -> dict[str, Any]:
    """A local diffusers folder's ``model_index.json`` (a UsageError when it has none)."""
    f = Path(path) / "model_index.json"
    if not f.is_file():
        raise UsageError(f"model: {path!r} is not a diffusers pipeline folder (no model_index.json); save one "
                         "with pipe.save_pretrained(dir) or pass a Hub id such as Wan-AI/Wan2.1-T2V-1.3B-Diffusers")
    return json.loads(f.read_text())


#: the pipeline components that hold a denoising transformer (Wan2.2's second expert: ``transformer_2``)
TRANSFORMER_COMPONENTS = ("transformer", "transformer_2")


def has_transformer(index: dict[str, Any]) -> bool:
    """Whether a pipeline's ``model_index.json`` (``index``) names a transformer component."""
    return any((index.get(name) or [None])[0] for name in TRANSFORMER_COMPONENTS)


def pipeline_transformers(pipe: Any) -> list[Any]:
    """A loaded pipeline's transformers (``TRANSFORMER_COMPONENTS`` that are modules), in that order."""
    import torch

    return [m for name in TRANSFORMER_COMPONENTS if isinstance(m := getattr(pipe, name, None), torch.nn.Module)]


def training_record(model: str) -> dict[str, Any]:
    """The training record (``training.json``) of a model folder: the shipped ``fp4vis:digits-wan`` and any
    run of scripts/train_digits_video.py; {} for any other model (a Hub id, a folder without one)."""
    record = Path(os.path.expanduser(resolve_model(model))) / "training.json"
    return json.loads(record.read_text()) if record.is_file() else {}


def known_prompts(model: str) -> tuple[tuple[str, ...], str] | None:
    """(the prompts, their grammar) of a model trained on a closed set of prompts: a training record whose
    clips state their prompt grammar (scripts/train_digits_video.py: ``digit <0-9> moving
    <left|right|up|down>``, the 40 of ``fp4vis.zoo.moving_digits.PROMPTS``); None for a model that takes any
    text."""
    grammar = (training_record(model).get("clips") or {}).get("prompt")
    if not grammar:
        return None
    from fp4vis.zoo import moving_digits as md

    return md.PROMPTS, grammar


def check_prompt(model: str, prompt: str, *, force: bool = False, option: str = "--prompt") -> None:
    """A model that knows a closed set of prompts (``known_prompts``) refuses any other (its text encoder
    has no word for it, and the clip would show some digit anyway): a UsageError giving the grammar, or
    with ``force`` a warning."""
    known = known_prompts(model)
    if known is None or " ".join(str(prompt).split()) in known[0]:
        return
    prompts, grammar = known
    message = (f"{option}: {model} was trained on {len(prompts)} prompts, \"{grammar}\" (e.g. \"{prompts[13]}\"), "
               f"and knows no other; got {prompt!r}")
    if not force:
        raise UsageError(message + " (--force generates anyway)")
    import warnings

    warnings.warn(message + "; generating anyway (--force)", UserWarning, stacklevel=2)
