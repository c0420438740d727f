"""The models fp4vis ships: small models trained by the project (``scripts/train_digits.py``) on
real handwritten digits, so that FP4 attention can be tried on attention that has learned something,
on any machine, without downloads.

- ``digits-vit``: a timm ViT classifier, 28 px, patch 4 (49 tokens, average pooling, no class
  token), 3 blocks of width 64 with 2 heads; loaded by timm
  ``create_model("local-dir:<folder>", pretrained=True)``;
- ``digits-mae``: a transformers ViTMAE, 56 px, patch 4, mask ratio 0.75 (50 encoder tokens), 3
  encoder and 2 decoder blocks of width 64; loaded by ``ViTMAEForPreTraining.from_pretrained``;
- ``digits-wan``: a diffusers Wan2.1 text-to-video pipeline of moving digits
  (``scripts/train_digits_video.py``: 64 x 64, 13 frames, 256 tokens; 4 blocks of 4 heads of 64);
  loaded by ``WanPipeline.from_pretrained`` (``fp4vis.pipelines.wan_video.load_wan_pipeline``).

The CLI and the evals accept them as ``--model fp4vis:<name>``. Each model's folder holds what the
real loader reads (``config.json``, ``model.safetensors``; the MAE's ``preprocessor_config.json``; the
Wan pipeline's ``save_pretrained`` folder) and ``training.json``: the seed, the configuration, the
data's checksums, the per-epoch log, the final metrics and the weights' sha256 (``verify`` checks it).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from fp4vis.services.usage import UsageError

from .digits import file_checksum

ZOO_DIR = Path(__file__).resolve().parent
PREFIX = "fp4vis:"
WEIGHTS_FILE = "model.safetensors"
TRAINING_FILE = "training.json"
# a Wan pipeline folder (save_pretrained): one weight file per model component
DIFFUSERS_WAN_WEIGHTS = ("transformer/diffusion_pytorch_model.safetensors", "vae/diffusion_pytorch_model.safetensors",
                         "text_encoder/model.safetensors")


@dataclass(frozen=True)
class ZooModel:
    name: str
    kind: str        # "timm-classifier" | "transformers-mae" | "diffusers-wan"
    folder: str      # under fp4vis/zoo/
    description: str
    weights: tuple[str, ...] = (WEIGHTS_FILE,)   # the weight files, relative to the folder

    @property
    def path(self) -> Path:
        return ZOO_DIR / self.folder


MODELS: dict[str, ZooModel] = {m.name: m for m in (
    ZooModel("digits-vit", "timm-classifier", "digits_vit",
             "timm ViT digit classifier (28 px, patch 4: 49 tokens; 3 blocks, width 64)"),
    ZooModel("digits-mae", "transformers-mae", "digits_mae",
             "transformers ViTMAE on digits (56 px, patch 4, 75 % mask: 50 encoder tokens)"),
    ZooModel("digits-wan", "diffusers-wan", "digits_wan",
             "diffusers Wan2.1 text-to-video of moving digits (64 x 64, 13 frames: 256 tokens; 4 heads of 64)",
             weights=DIFFUSERS_WAN_WEIGHTS),
)}
# what the project plans to ship and does not yet: the demo and the docs say so instead of faking it
NOT_SHIPPED: dict[str, str] = {}


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
    missing = [w for w in m.weights if not (m.path / w).is_file()]
    if missing:
        script = "scripts/train_digits_video.py" if m.kind == "diffusers-wan" else "scripts/train_digits.py"
        raise FileNotFoundError(f"{option}: the weights of {PREFIX}{m.name} are missing ({m.path / missing[0]}); "
                                f"the package was installed without its data, or {script} has not run")
    return m.path


def is_available(name: str) -> bool:
    """Whether the shipped model's weights are there (the package may be installed without them)."""
    m = get(name)
    return all((m.path / w).is_file() for w in m.weights)


def weight_checksums(folder: str | Path, weights: tuple[str, ...] = DIFFUSERS_WAN_WEIGHTS) -> dict[str, str]:
    """sha256 of each weight file of a model folder, by its path in the folder."""
    return {w: file_checksum(Path(folder) / w) for w in weights}


def resolve_source(source: str, option: str = "model") -> str:
    """``fp4vis:<name>`` -> the local folder the real loaders read; any other source unchanged."""
    return str(model_path(source, option)) if is_zoo_source(source) else source


def metadata(name: str) -> dict[str, Any]:
    """The training record of a shipped model (``training.json``)."""
    return json.loads((get(name).path / TRAINING_FILE).read_text())


def verify(name: str) -> dict[str, Any]:
    """Check that the shipped weights are the ones the training record names (sha256); returns the record.
    A record names one file's sha256, or a sha256 per weight file (the Wan pipeline's components)."""
    m = get(name)
    meta = metadata(name)
    recorded = meta["weights_sha256"]
    expected = recorded if isinstance(recorded, dict) else {WEIGHTS_FILE: recorded}
    actual = weight_checksums(model_path(name), m.weights)
    for w in m.weights:
        if actual[w] != expected.get(w):
            raise RuntimeError(f"{PREFIX}{name}: {w} has sha256 {actual[w]}, its training record says "
                               f"{expected.get(w)}")
    return meta


def load(name: str, *, device: str = "cpu", dtype: Any = None):
    """Load a shipped model through the same code a user's checkpoint goes through (eval mode):
    timm ``create_model("local-dir:<folder>", pretrained=True)`` or transformers ``from_pretrained``. The
    Wan pipeline loads through the pipelines' loader, which takes the name as any source:
    ``fp4vis.pipelines.wan_video.load_wan_pipeline("fp4vis:digits-wan")``."""
    m = get(name)
    if m.kind == "diffusers-wan":   # the pipelines import the zoo, not the other way round
        raise UsageError(f"{PREFIX}{m.name} is a diffusers pipeline: load it with fp4vis.pipelines.wan_video."
                         f"load_wan_pipeline({PREFIX + m.name!r})")
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


__all__ = ["MODELS", "NOT_SHIPPED", "PREFIX", "ZooModel", "get", "is_available", "is_zoo_source", "load", "metadata",
           "model_path", "resolve_source", "verify", "weight_checksums"]
