"""The models fp4vis ships: small models trained by the project (``scripts/train_digits.py``) on
real handwritten digits, so that FP4 attention can be tried on attention that has learned something,
on any machine, without downloads.

- ``digits-vit``: a timm ViT classifier, 28 px, patch 4 (49 tokens, average pooling, no class
  token), 3 blocks of width 64 with 2 heads; loaded by timm
  ``create_model("local-dir:<folder>", pretrained=True)``;
- ``digits-mae``: a transformers ViTMAE, 56 px, patch 4, mask ratio 0.75 (50 encoder tokens), 3
  encoder and 2 decoder blocks of width 64; loaded by ``ViTMAEForPreTraining.from_pretrained``.

The CLI and the evals accept them as ``--model fp4vis:<name>``. Each model's folder holds what the
real loader reads (``config.json``, ``model.safetensors``; the MAE's ``preprocessor_config.json``) and
``training.json``: the seed, the configuration, the data's checksums, the per-epoch log, the final
metrics and the weights' sha256 (``verify`` checks it). The video (Wan) model is not shipped yet.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from fp4vis.services import UsageError

from .digits import file_checksum

ZOO_DIR = Path(__file__).resolve().parent
PREFIX = "fp4vis:"
WEIGHTS_FILE = "model.safetensors"
TRAINING_FILE = "training.json"


@dataclass(frozen=True)
class ZooModel:
    name: str
    kind: str        # "timm-classifier" | "transformers-mae"
    folder: str      # under fp4vis/zoo/
    description: str

    @property
    def path(self) -> Path:
        return ZOO_DIR / self.folder


MODELS: dict[str, ZooModel] = {m.name: m for m in (
    ZooModel("digits-vit", "timm-classifier", "digits_vit",
             "timm ViT digit classifier (28 px, patch 4: 49 tokens; 3 blocks, width 64)"),
    ZooModel("digits-mae", "transformers-mae", "digits_mae",
             "transformers ViTMAE on digits (56 px, patch 4, 75 % mask: 50 encoder tokens)"),
)}
# what the project plans to ship and does not yet: the demo and the docs say so instead of faking it
NOT_SHIPPED = {"digits-wan": "a Wan-architecture video model of moving digits, which needs an H200 to train"}


def is_zoo_source(source: str) -> bool:
    return isinstance(source, str) and source.startswith(PREFIX)


def get(name: str, option: str = "model") -> ZooModel:
    """The shipped model called ``name`` (with or without the ``fp4vis:`` prefix)."""
    key = name[len(PREFIX):] if is_zoo_source(name) else name
    if key in MODELS:
        return MODELS[key]
    known = ", ".join(PREFIX + n for n in MODELS)
    if key in NOT_SHIPPED:
        raise UsageError(f"{option}: {PREFIX}{key} is not shipped yet ({NOT_SHIPPED[key]}); shipped models: {known}")
    raise UsageError(f"{option}: {name!r} is not a model fp4vis ships; shipped models: {known}")


def model_path(name: str, option: str = "model") -> Path:
    """The folder of a shipped model, checked to hold its weights."""
    m = get(name, option)
    if not (m.path / WEIGHTS_FILE).is_file():
        raise FileNotFoundError(f"{option}: the weights of {PREFIX}{m.name} are missing ({m.path / WEIGHTS_FILE}); "
                                "the package was installed without its data, or scripts/train_digits.py has not run")
    return m.path


def resolve_source(source: str, option: str = "model") -> str:
    """``fp4vis:<name>`` -> the local folder the real loaders read; any other source unchanged."""
    return str(model_path(source, option)) if is_zoo_source(source) else source


def metadata(name: str) -> dict[str, Any]:
    """The training record of a shipped model (``training.json``)."""
    return json.loads((get(name).path / TRAINING_FILE).read_text())


def verify(name: str) -> dict[str, Any]:
    """Check that the shipped weights are the ones the training record names (sha256); returns the record."""
    meta = metadata(name)
    actual = file_checksum(model_path(name) / WEIGHTS_FILE)
    if actual != meta["weights_sha256"]:
        raise RuntimeError(f"{PREFIX}{name}: {WEIGHTS_FILE} has sha256 {actual}, its training record says "
                           f"{meta['weights_sha256']}")
    return meta


def load(name: str, *, device: str = "cpu", dtype: Any = None):
    """Load a shipped model through the same code a user's checkpoint goes through (eval mode):
    timm ``create_model("local-dir:<folder>", pretrained=True)`` or transformers ``from_pretrained``."""
    m = get(name)
    path = model_path(name)
    if m.kind == "timm-classifier":
        import timm

        model = timm.create_model(f"local-dir:{path}", pretrained=True)
    elif m.kind == "transformers-mae":
        from transformers import ViTMAEForPreTraining

        model = ViTMAEForPreTraining.from_pretrained(str(path))
    else:  # pragma: no cover - the registry above lists every kind
        raise AssertionError(m.kind)
    model.eval().to(device=device)
    if dtype is not None:
        model.to(dtype=dtype)
    return model


__all__ = ["MODELS", "NOT_SHIPPED", "PREFIX", "ZooModel", "get", "is_zoo_source", "load", "metadata", "model_path",
           "resolve_source", "verify"]
