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

from .datasets import data_layout

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


# photographs that scikit-image ships inside its package (no download); used by the real-config runs
SKIMAGE_PHOTOS = ("astronaut", "coffee", "chelsea", "rocket", "immunohistochemistry", "hubble_deep_field",
                  "camera", "coins", "moon", "colorwheel")


def check_image_folder(root: str | os.PathLike) -> Path:
    """The root of image data in a layout the evals read (``fp4vis.evals.datasets``: an ImageFolder, a
    folder of images, the CIFAR-10 test set). Raises a clear UsageError otherwise."""
    data_layout(root)
    return Path(os.path.expanduser(str(root)))


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


def image_list(dataset: Any, indices: Sequence[int], max_items: int = 100) -> list[str] | None:
    """The images an eval uses (``ImageDataset.names``: files relative to the root; None above
    ``max_items``)."""
    if len(indices) > max_items:
        return None
    return [dataset.names[i] for i in indices]


def images_markdown(files: list[str] | None) -> str:
    if not files or len(files) > 20:
        return ""
    return " Images: " + ", ".join(f"`{f}`" for f in files) + "."


def add_speedups_vs(runs: dict[str, Any], references: list[str]) -> None:
    """``speedup_vs`` of every timed run: {reference run: its denoise_s / this run's denoise_s} for each
    reference run (BF16, the baselines) that has finished."""
    done = {ref: runs[ref]["timings"]["denoise_s"] for ref in references if "timings" in runs.get(ref, {})}
    for run in runs.values():
        if "timings" in run:
            run["speedup_vs"] = {ref: s / run["timings"]["denoise_s"] for ref, s in done.items()}


def frame_metrics(frames, ref) -> dict[str, Any]:
    from torchmetrics.functional.image import peak_signal_noise_ratio, structural_similarity_index_measure

    a = torch.from_numpy(frames).permute(0, 3, 1, 2).float()
    b = torch.from_numpy(ref).permute(0, 3, 1, 2).float()
    psnr = peak_signal_noise_ratio(a, b, data_range=1.0, reduction="none", dim=(1, 2, 3))
    ssim = structural_similarity_index_measure(a, b, data_range=1.0, reduction="none")
    return {"psnr_per_frame": psnr.tolist(), "ssim_per_frame": ssim.tolist(),
            "psnr_mean": float(psnr[torch.isfinite(psnr)].mean()) if torch.isfinite(psnr).any() else float("inf"),
            "psnr_min": float(psnr.min()), "ssim_mean": float(ssim.mean()), "ssim_min": float(ssim.min())}


def reference_timed(r: dict[str, Any]) -> bool:
    """Whether the FP4 runs were timed on the reference emulation (asked for, or ``auto`` off a GPU): their
    times are no speed result."""
    return r["backend"] == "reference" or (r["backend"] == "auto" and r.get("device", "cuda") != "cuda")
