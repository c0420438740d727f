"""The image datasets the evals read from the user's disk (nothing downloads), in three layouts:

* an ImageFolder, ``ROOT/<class>/<image>`` (the class is the folder);
* a flat folder of images, ``ROOT/<image>`` (unlabeled: COCO val2017 as it unpacks);
* the CIFAR-10 test set in its own format (``ROOT/cifar-10-batches-py/test_batch``, or ROOT that
  folder), as torchvision's CIFAR10 reads it; classes are its label names.

``open_images`` gives a dataset of (image, label) (label -1 where unlabeled) with ``classes`` and
``names`` (the files, or ``test_batch[i]``); ``sample`` draws a seeded subset, as the method's
protocols do (``fp4vis.evals.paper_protocols``).
"""

from __future__ import annotations

import os
import pickle
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch

from fp4vis.services.usage import UsageError

IMAGE_EXTENSIONS = (".jpg", ".jpeg", ".png", ".ppm", ".bmp", ".pgm", ".tif", ".tiff", ".webp")
CIFAR_FOLDER = "cifar-10-batches-py"


def _images(folder: Path) -> list[Path]:
    return sorted(f for f in folder.iterdir() if f.is_file() and f.suffix.lower() in IMAGE_EXTENSIONS)


def data_layout(root: str | os.PathLike) -> tuple[str, Path]:
    """("imagefolder" | "flat" | "cifar10", the folder), or a UsageError that says what is expected."""
    p = Path(os.path.expanduser(str(root)))
    if p.exists() and not p.is_dir():
        raise UsageError(f"data: {str(root)!r} is a file, not a directory: give the folder of the images (an "
                         f"ImageFolder root, a folder of images, or the CIFAR-10 test set's folder)")
    if not p.is_dir():
        raise UsageError(f"data: directory {str(root)!r} does not exist")
    for cand in (p / CIFAR_FOLDER, p):
        if (cand / "test_batch").is_file() and (cand / "batches.meta").is_file():
            return "cifar10", cand
    classes = [d for d in p.iterdir() if d.is_dir()]
    if classes and any(_images(d) for d in classes):
        return "imagefolder", p
    if _images(p):
        return "flat", p
    raise UsageError(f"data: no images ({', '.join(IMAGE_EXTENSIONS)}) in {str(root)!r}: give an ImageFolder "
                     "(ROOT/<class>/<image>), a folder of images, or the CIFAR-10 test set "
                     f"(ROOT/{CIFAR_FOLDER}/test_batch)")


def image_loader(path: str) -> Any:
    """Open an image as RGB with a clear error: a file with an image extension that is not an image
    stops the run with one line naming it (not a traceback from inside a DataLoader)."""
    from PIL import Image, UnidentifiedImageError

    try:
        with open(path, "rb") as f:
            return Image.open(f).convert("RGB")
    except (UnidentifiedImageError, OSError, SyntaxError) as exc:
        raise UsageError(f"data: {path!r} is not a readable image ({type(exc).__name__}: {exc})") from None


class ImageDataset(torch.utils.data.Dataset):
    """(image, label) pairs of one of the layouts; ``classes`` (empty where unlabeled), ``names``."""

    def __init__(self, root: str | os.PathLike, transform: Callable | None = None):
        self.layout, self.root = data_layout(root)
        self.transform = transform
        self._arrays: np.ndarray | None = None
        if self.layout == "cifar10":
            with open(self.root / "batches.meta", "rb") as f:
                self.classes = [str(c) for c in pickle.load(f, encoding="latin1")["label_names"]]
            with open(self.root / "test_batch", "rb") as f:
                batch = pickle.load(f, encoding="latin1")
            self._arrays = np.asarray(batch["data"], dtype=np.uint8).reshape(-1, 3, 32, 32).transpose(0, 2, 3, 1)
            self.labels = [int(x) for x in batch["labels"]]
            self.names = [f"test_batch[{i}]" for i in range(len(self.labels))]
        elif self.layout == "imagefolder":
            self.classes = sorted(d.name for d in self.root.iterdir() if d.is_dir())
            files = [(f, i) for i, c in enumerate(self.classes) for f in _images(self.root / c)]
            self.paths, self.labels = [f for f, _ in files], [i for _, i in files]
            self.names = [str(f.relative_to(self.root)) for f in self.paths]
        else:
            self.classes = []
            self.paths = _images(self.root)
            self.labels = [-1] * len(self.paths)
            self.names = [f.name for f in self.paths]

    def __len__(self) -> int:
        return len(self.labels)

    def __getitem__(self, i: int):
        if self._arrays is not None:
            from PIL import Image
            img = Image.fromarray(self._arrays[i])
        else:
            img = image_loader(str(self.paths[i]))
        return (self.transform(img) if self.transform is not None else img), self.labels[i]


def open_images(root: str | os.PathLike, transform: Callable | None = None) -> ImageDataset:
    return ImageDataset(root, transform)


def sample_indices(total: int, count: int | None, seed: int | None) -> list[int]:
    """The indices an eval uses: the first ``count`` (seed None), or ``count`` drawn at random with
    ``seed`` (torch.randperm on a CPU generator; kept in dataset order); all of them without a count."""
    n = total if count is None else min(count, total)
    if seed is None:
        return list(range(n))
    perm = torch.randperm(total, generator=torch.Generator().manual_seed(int(seed)))[:n]
    return sorted(int(i) for i in perm)
