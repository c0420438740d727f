"""Writing what a pipeline makes: a video as an H.264 MP4 (``save_mp4``, through imageio-ffmpeg;
``mp4_unavailable`` says why it cannot here) and an image as a PNG (``save_png``), each atomically."""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np

from fp4vis.files import atomic_path


def mp4_unavailable() -> str | None:
    """Why ``save_mp4`` cannot write here (imageio-ffmpeg finds no ffmpeg), or None when it can."""
    try:
        import imageio_ffmpeg

        imageio_ffmpeg.get_ffmpeg_exe()
    except Exception as e:   # ImportError, or RuntimeError: no bundled or system ffmpeg
        return f"no ffmpeg for imageio-ffmpeg ({type(e).__name__}: {e}); pip install imageio-ffmpeg"
    return None


def save_mp4(frames: np.ndarray, path: str | os.PathLike, fps: int = 16, progress: bool = False) -> Path:
    """Write (F, H, W, 3) frames in [0, 1] (or diffusers' batched (1, F, H, W, 3)) as an H.264 MP4 through
    imageio-ffmpeg, atomically: a failed write leaves no partial file under ``path``. ``progress``: a bar
    over the frames written."""
    import imageio.v2 as imageio
    from tqdm.auto import tqdm

    frames = np.asarray(frames)
    if frames.ndim == 5 and frames.shape[0] == 1:   # diffusers' batched output (1, F, H, W, 3)
        frames = frames[0]
    if frames.ndim != 4 or frames.shape[-1] != 3:
        raise ValueError(f"frames: expected (F, H, W, 3) or (1, F, H, W, 3), got shape {frames.shape}")
    u8 = (np.clip(frames, 0, 1) * 255).round().astype(np.uint8)
    h, w = u8.shape[1:3]
    # macro_block_size=1 keeps odd-sized test videos as they are (H.264 wants even sizes: pad by one)
    if h % 2 or w % 2:
        u8 = np.pad(u8, ((0, 0), (0, h % 2), (0, w % 2), (0, 0)), mode="edge")
    path = Path(path)
    with atomic_path(path) as tmp, imageio.get_writer(str(tmp), format="FFMPEG", mode="I", fps=fps,
                                                      codec="libx264", macro_block_size=1, quality=8,
                                                      pixelformat="yuv420p") as writer:
        for f in tqdm(u8, desc=f"write {path.name}", unit="frame", disable=not progress):
            writer.append_data(f)
    return path


def save_png(image: np.ndarray, path: str | os.PathLike) -> Path:
    """An (H, W, 3) image in [0, 1] written as a PNG, atomically."""
    from PIL import Image

    u8 = (np.clip(np.asarray(image, dtype=np.float32), 0, 1) * 255).round().astype(np.uint8)
    with atomic_path(path) as tmp:
        Image.fromarray(u8).save(tmp, format="PNG")
    return Path(path)
