"""Helpers shared by the evals: per-layer attention errors (``AttentionRecorder``), per-sample
metrics, ImageFolder datasets (and the scikit-image photos used by the real runs). The app services
(errors, devices, model sources, guard plans, reports' metadata) are in ``fp4vis.services``.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch
from torch import nn

from fp4vis.services import UsageError

# --------------------------------------------------------------------------------------------------
# attention layers and per-layer errors


def find_attention_modules(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """The outermost modules whose class name ends in 'Attention' (timm ``Attention``, transformers
    ``ViTAttention``/``ViTMAEAttention``, diffusers ``Attention``/``WanAttention``), in model order."""
    found: list[tuple[str, nn.Module]] = []
    for name, mod in model.named_modules():
        if not type(mod).__name__.endswith("Attention"):
            continue
        if any(name.startswith(prev + ".") for prev, _ in found):
            continue
        found.append((name, mod))
    return found


def _first_tensor(out: Any) -> torch.Tensor:
    if isinstance(out, torch.Tensor):
        return out
    if isinstance(out, (tuple, list)) and out:
        return _first_tensor(out[0])
    if hasattr(out, "to_tuple"):
        return _first_tensor(out.to_tuple())
    raise TypeError(f"attention module returned {type(out).__name__}, expected a tensor")


class AttentionRecorder:
    """Records the inputs and outputs of every attention module during one forward pass, so that
    each layer can be re-run in isolation under another policy (same inputs: per-layer error
    without the drift accumulated by the layers before it)."""

    def __init__(self, model: nn.Module, select: Callable[[str], bool] | None = None):
        """``select(name)``: which attention modules to record (default: all)."""
        self.modules = [(n, m) for n, m in find_attention_modules(model) if select is None or select(n)]
        self.calls: dict[str, tuple[tuple, dict, torch.Tensor]] = {}
        self._handles: list[Any] = []

    def __enter__(self) -> AttentionRecorder:
        self._install()
        return self

    def _install(self) -> None:
        for name, mod in self.modules:
            def hook(m, args, kwargs, out, _name=name):
                self.calls[_name] = (args, dict(kwargs), _first_tensor(out).detach())
            self._handles.append(mod.register_forward_hook(hook, with_kwargs=True))

    def __exit__(self, *exc) -> None:
        for h in self._handles:
            h.remove()
        self._handles.clear()

    @torch.no_grad()
    def rerun(self) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
        """Re-run each recorded layer on its recorded inputs (under whatever patch is active now):
        {layer name: (new output, recorded output)}. Recording pauses meanwhile (a re-run inside the
        recorded block, e.g. from a per-step callback, must not overwrite what it compares with)."""
        recording = bool(self._handles)
        self.__exit__()
        try:
            out = {}
            for name, mod in self.modules:
                if name not in self.calls:
                    continue
                args, kwargs, ref = self.calls[name]
                out[name] = (_first_tensor(mod(*args, **kwargs)).detach(), ref)
            return out
        finally:
            if recording:
                self._install()


def per_sample(metric: Callable[[torch.Tensor, torch.Tensor], Any], a: torch.Tensor,
               ref: torch.Tensor) -> list[float]:
    """Apply an ``fp4vis.metrics`` function to each sample (first dimension) separately."""
    return [float(metric(a[i].float(), ref[i].float())) for i in range(a.shape[0])]


def error_metrics() -> tuple[Callable, Callable]:
    """(cosine, rel_l2) from fp4vis.metrics (the one implementation of these in the project)."""
    from fp4vis.metrics import cosine, rel_l2

    return cosine, rel_l2


# --------------------------------------------------------------------------------------------------
# images


IMAGE_EXTENSIONS = (".jpg", ".jpeg", ".png", ".ppm", ".bmp", ".pgm", ".tif", ".tiff", ".webp")

# photographs that scikit-image ships inside its package (no download); used by the real-config runs
SKIMAGE_PHOTOS = ("astronaut", "coffee", "chelsea", "rocket", "immunohistochemistry", "hubble_deep_field",
                  "camera", "coins", "moon", "colorwheel")


def check_image_folder(root: str | os.PathLike) -> Path:
    """An ImageFolder root: class sub-folders holding images. Raises a clear UsageError otherwise."""
    p = Path(os.path.expanduser(str(root)))
    if not p.is_dir():
        raise UsageError(f"data: directory {str(root)!r} does not exist")
    classes = [d for d in p.iterdir() if d.is_dir()]
    if not classes:
        raise UsageError(f"data: {str(root)!r} has no class sub-folders; the layout is ImageFolder's: "
                         "ROOT/<class>/<image>.jpg (put unlabeled images in one folder, e.g. ROOT/images/)")
    if not any(f.suffix.lower() in IMAGE_EXTENSIONS for d in classes for f in d.iterdir()):
        raise UsageError(f"data: no images ({', '.join(IMAGE_EXTENSIONS)}) under {str(root)!r}")
    return p


def image_loader(path: str) -> Any:
    """``torchvision``'s image loader with a clear error: a file with an image extension that is not
    an image stops the run with one line naming it (not a traceback from inside a DataLoader)."""
    from PIL import Image, UnidentifiedImageError

    try:
        with open(path, "rb") as f:
            return Image.open(f).convert("RGB")
    except (UnidentifiedImageError, OSError, SyntaxError) as exc:
        raise UsageError(f"data: {path!r} is not a readable image ({type(exc).__name__}: {exc})") from None


def export_skimage_photos(dest: str | os.PathLike, names: Sequence[str] = SKIMAGE_PHOTOS,
                          class_name: str = "photos") -> Path:
    """Write the RGB photos that scikit-image ships into an ImageFolder at ``dest/<class_name>/``
    (grayscale ones are converted to RGB). Needs scikit-image (not a dependency of fp4vis)."""
    import numpy as np
    import skimage.data
    from PIL import Image

    folder = Path(dest) / class_name
    folder.mkdir(parents=True, exist_ok=True)
    written = 0
    for name in names:
        try:
            img = np.asarray(getattr(skimage.data, name)())
        except Exception:  # a photo that needs a download is skipped
            continue
        if img.dtype == bool:
            continue
        if img.ndim == 2:
            img = np.stack([img] * 3, axis=-1)
        img = img[..., :3].astype("uint8")
        Image.fromarray(img).save(folder / f"{name}.png")
        written += 1
    if written == 0:
        raise RuntimeError("no scikit-image photo could be loaded")
    return Path(dest)


def image_list(dataset: Any, root: Path, limit: int | None, max_items: int = 100) -> list[str] | None:
    """The image files an eval uses, relative to the ImageFolder root (None above ``max_items``)."""
    samples = dataset.samples[: limit if limit is not None else len(dataset.samples)]
    if len(samples) > max_items:
        return None
    return [str(Path(path).relative_to(root)) for path, _ in samples]


def images_markdown(files: list[str] | None) -> str:
    if not files or len(files) > 20:
        return ""
    return " Images: " + ", ".join(f"`{f}`" for f in files) + "."
