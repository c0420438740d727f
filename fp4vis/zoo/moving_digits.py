"""Clips of a handwritten digit moving across a dark canvas: what ``fp4vis:digits-wan`` was trained on
(``scripts/train_digits_video.py``), and the reader that checks what it generates.

A clip is one 28 px digit (``fp4vis.zoo.digits``) moving in a straight line at a constant speed (1 to
2 px per frame) left, right, up or down across a 64 x 64 canvas for 13 frames, never leaving it; its
prompt says which digit and which way: ``"digit 3 moving left"``. Positions are sub-pixel (bilinear
resampling of the digit), so the motion is smooth.

``read_clips`` says what a clip shows, the way a person would check it: in every frame it crops 28 px
around the bright pixels' centre of mass (MNIST digits are centred that way) and asks the shipped
classifier ``fp4vis:digits-vit`` which digit it is (the majority over frames is the clip's digit); the
centre's path from the first to the last frame gives the direction. On real clips of held-out
digits it reads almost every digit and direction right (the training record states how often), so it
is a fair check of generated clips.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

from .digits import IMAGE_SIZE, NUM_CLASSES

CANVAS = 64          # clip height and width (px)
FRAMES = 13          # 4k + 1: Wan's VAE keeps the first frame and compresses the next ones 4x in time
MIN_SPEED, MAX_SPEED = 1.0, 2.0   # px per frame
DIRECTIONS = ("left", "right", "up", "down")
_UNIT = {"left": (0.0, -1.0), "right": (0.0, 1.0), "up": (-1.0, 0.0), "down": (1.0, 0.0)}   # (dy, dx)
STILL = -1           # read_clips' direction for a digit that did not move
INK = 0.1            # pixels darker than this are background for the reader's centre of mass


def prompt(digit: int, direction: str | int) -> str:
    """The prompt of a clip: ``"digit 3 moving left"``."""
    name = DIRECTIONS[direction] if isinstance(direction, int) else direction
    if name not in _UNIT or not 0 <= int(digit) < NUM_CLASSES:
        raise ValueError(f"prompt: no clip of digit {digit!r} moving {direction!r}")
    return f"digit {int(digit)} moving {name}"


PROMPTS = tuple(prompt(d, k) for d in range(NUM_CLASSES) for k in range(len(DIRECTIONS)))   # index d * 4 + k
VOCABULARY = ("digit", "moving", *(str(d) for d in range(NUM_CLASSES)), *DIRECTIONS)


def prompt_index(digit: int, direction: int) -> int:
    return int(digit) * len(DIRECTIONS) + int(direction)


def balanced_prompts(n: int) -> list[int]:
    """``n`` prompt indices (into PROMPTS) spread over the digits and directions: digit d moving
    DIRECTIONS[(d + k) % 4] for k = 0, 1, 2, 3 in turn, so that the first 10 cover every digit once
    and every direction 2 or 3 times, and all 40 are every prompt once."""
    if not 1 <= n <= len(PROMPTS):
        raise ValueError(f"n: between 1 and {len(PROMPTS)} prompts, got {n}")
    return [prompt_index(d, (d + k) % len(DIRECTIONS)) for k in range(len(DIRECTIONS))
            for d in range(NUM_CLASSES)][:n]


@dataclass(frozen=True)
class Motions:
    """Per clip: the direction (index into DIRECTIONS), the speed (px per frame) and the digit's
    top-left corner in the first frame (y, x), as tensors."""

    direction: torch.Tensor   # (n,) int64
    speed: torch.Tensor       # (n,) float32
    start: torch.Tensor       # (n, 2) float32

    def positions(self, frames: int) -> torch.Tensor:
        """(n, frames, 2): the digit's top-left corner (y, x) in every frame."""
        unit = torch.tensor([_UNIT[d] for d in DIRECTIONS])[self.direction]          # (n, 2)
        t = torch.arange(frames, dtype=torch.float32).view(1, frames, 1)
        return self.start.unsqueeze(1) + t * (self.speed.view(-1, 1, 1) * unit.unsqueeze(1))


def max_speed(canvas: int, frames: int) -> float:
    """The fastest motion that keeps the whole digit on the canvas for all frames."""
    return min(MAX_SPEED, (canvas - IMAGE_SIZE) / max(1, frames - 1))


def sample_motions(n: int, generator: torch.Generator, *, canvas: int = CANVAS, frames: int = FRAMES,
                   direction: torch.Tensor | None = None) -> Motions:
    """``n`` random straight motions that stay on the canvas (directions drawn uniformly unless given)."""
    room = float(canvas - IMAGE_SIZE)
    top = max_speed(canvas, frames)
    low = min(MIN_SPEED, top)
    if direction is None:
        direction = torch.randint(len(DIRECTIONS), (n,), generator=generator)
    speed = low + (top - low) * torch.rand(n, generator=generator)
    travel = speed * (frames - 1)
    along = torch.rand(n, generator=generator) * (room - travel)   # start on the axis of motion, then...
    across = torch.rand(n, generator=generator) * room
    forward = torch.tensor([_UNIT[d][0] + _UNIT[d][1] for d in DIRECTIONS])[direction] > 0
    along = torch.where(forward, along, along + travel)             # ...leave room ahead of the digit
    vertical = torch.tensor([_UNIT[d][0] != 0 for d in DIRECTIONS])[direction]
    start = torch.stack([torch.where(vertical, along, across), torch.where(vertical, across, along)], dim=1)
    return Motions(direction.long(), speed.float(), start.float())


def render(digits01: torch.Tensor, positions: torch.Tensor, canvas: int = CANVAS) -> torch.Tensor:
    """Digits (n, 28, 28) in [0, 1] placed at ``positions`` (n, frames, 2) -> clips (n, frames, canvas,
    canvas) in [0, 1], on the digits' device (bilinear: sub-pixel positions; zeros around the digit)."""
    n, frames = positions.shape[:2]
    pos = positions.to(digits01.device, torch.float32)
    coord = torch.arange(canvas, device=digits01.device, dtype=torch.float32)
    scale = 2.0 / (IMAGE_SIZE - 1)   # align_corners=True: digit pixel k sits at -1 + k * scale
    gy = (coord.view(1, 1, canvas) - pos[..., 0:1]) * scale - 1.0          # (n, frames, canvas)
    gx = (coord.view(1, 1, canvas) - pos[..., 1:2]) * scale - 1.0
    grid = torch.stack(torch.broadcast_tensors(gx.unsqueeze(-2), gy.unsqueeze(-1)), dim=-1)  # (n, F, H, W, 2): (x, y)
    src = digits01.unsqueeze(1).expand(n, frames, IMAGE_SIZE, IMAGE_SIZE).reshape(n * frames, 1, IMAGE_SIZE,
                                                                                   IMAGE_SIZE)
    out = F.grid_sample(src, grid.reshape(n * frames, canvas, canvas, 2), mode="bilinear", padding_mode="zeros",
                        align_corners=True)
    return out.view(n, frames, canvas, canvas)


def make_clips(images: torch.Tensor, labels: torch.Tensor, generator: torch.Generator, *, canvas: int = CANVAS,
               frames: int = FRAMES, direction: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor,
                                                                                     Motions]:
    """Clips of the digits ``images`` (n, 28, 28) uint8 or [0, 1] float, each with a random motion:
    (clips (n, frames, canvas, canvas) in [0, 1], prompt indices (n,) into PROMPTS, the motions)."""
    digits01 = images.float() / 255.0 if images.dtype == torch.uint8 else images.float()
    motions = sample_motions(len(images), generator, canvas=canvas, frames=frames, direction=direction)
    clips = render(digits01, motions.positions(frames), canvas)
    return clips, labels.long().cpu() * len(DIRECTIONS) + motions.direction, motions


def to_video(clips01: torch.Tensor) -> torch.Tensor:
    """Clips (n, F, H, W) in [0, 1] -> the Wan VAE's input (n, 3, F, H, W) in [-1, 1] (grey as RGB)."""
    # repeated, not expanded: convolutions of a broadcast view (stride 0) are many times slower
    return (clips01 * 2.0 - 1.0).unsqueeze(1).repeat(1, 3, 1, 1, 1)


def from_frames(frames: Any) -> torch.Tensor:
    """A pipeline's decoded frames, (n, F, H, W, 3) or (F, H, W, 3) in [0, 1] (numpy or torch) -> grey
    clips (n, F, H, W)."""
    x = torch.as_tensor(frames, dtype=torch.float32)
    if x.ndim == 4:
        x = x.unsqueeze(0)
    return x.mean(-1)


# --------------------------------------------------------------------------------------------------
# reading a clip


def centres(clips01: torch.Tensor) -> torch.Tensor:
    """(n, F, H, W) -> the centre of mass (y, x) of the ink in every frame (n, F, 2); the canvas centre
    where a frame has no ink."""
    ink = (clips01.float() - INK).clamp(min=0)
    h, w = ink.shape[-2:]
    mass = ink.sum((-2, -1))
    ys = torch.arange(h, dtype=torch.float32).view(1, 1, h, 1)
    xs = torch.arange(w, dtype=torch.float32).view(1, 1, 1, w)
    safe = mass.clamp(min=1e-6)
    cy = torch.where(mass > 1e-6, (ink * ys).sum((-2, -1)) / safe, torch.full_like(mass, (h - 1) / 2))
    cx = torch.where(mass > 1e-6, (ink * xs).sum((-2, -1)) / safe, torch.full_like(mass, (w - 1) / 2))
    return torch.stack([cy, cx], dim=-1)


def crops(clips01: torch.Tensor, at: torch.Tensor) -> torch.Tensor:
    """28 px crops (n, F, 28, 28) of every frame, centred on ``at`` (n, F, 2) as MNIST centres a digit
    (its centre of mass at pixel 14), zeros beyond the canvas."""
    n, frames, h, w = clips01.shape
    half = IMAGE_SIZE // 2
    padded = F.pad(clips01.float(), (half, half, half, half))
    # the crop's top-left corner is the centre less 14 px, which is the centre itself in the padded frame
    corner = at.round().long()
    corner[..., 0] = corner[..., 0].clamp(0, h + 2 * half - IMAGE_SIZE)
    corner[..., 1] = corner[..., 1].clamp(0, w + 2 * half - IMAGE_SIZE)
    k = torch.arange(IMAGE_SIZE)
    rows = (corner[..., 0:1] + k).unsqueeze(-1)                        # (n, F, 28, 1)
    cols = (corner[..., 1:2] + k).unsqueeze(-2)                        # (n, F, 1, 28)
    clip = torch.arange(n).view(n, 1, 1, 1)
    frame = torch.arange(frames).view(1, frames, 1, 1)
    return padded[clip, frame, rows, cols]


@dataclass(frozen=True)
class Reading:
    """What ``read_clips`` saw in each clip."""

    digit: torch.Tensor          # (n,) the majority digit over frames
    digit_frames: torch.Tensor   # (n, F) the digit read in every frame
    direction: torch.Tensor      # (n,) index into DIRECTIONS, or STILL
    travel: torch.Tensor         # (n, 2) the centre's displacement (dy, dx), first to last frame (px)


def load_reader(device: str | torch.device = "cpu"):
    """The classifier the reader asks: the shipped ``fp4vis:digits-vit`` (float32, eval mode)."""
    from fp4vis import zoo

    return zoo.load("digits-vit", device=device)


@torch.no_grad()
def read_clips(clips01: torch.Tensor, classifier: Any = None, *, min_travel: float = 4.0,
               batch_size: int = 512) -> Reading:
    """Which digit each clip (n, F, H, W) in [0, 1] shows and which way it moves (``min_travel``: a
    displacement below this many px reads as STILL). ``classifier``: ``load_reader()`` by default."""
    clf = classifier if classifier is not None else load_reader()
    device = next(clf.parameters()).device
    mean = torch.tensor(clf.pretrained_cfg["mean"]).view(1, 3, 1, 1)
    std = torch.tensor(clf.pretrained_cfg["std"]).view(1, 3, 1, 1)
    at = centres(clips01)
    patches = crops(clips01, at).clamp(0, 1)
    n, frames = patches.shape[:2]
    flat = ((patches.view(-1, 1, IMAGE_SIZE, IMAGE_SIZE).expand(-1, 3, -1, -1) - mean) / std)
    pred = torch.cat([clf(flat[i:i + batch_size].to(device)).argmax(-1).cpu()
                      for i in range(0, len(flat), batch_size)]).view(n, frames)
    digit = torch.mode(pred, dim=1).values
    travel = at[:, -1] - at[:, 0]
    dy, dx = travel[:, 0], travel[:, 1]
    horizontal = dx.abs() >= dy.abs()
    direction = torch.where(horizontal, torch.where(dx < 0, 0, 1), torch.where(dy < 0, 2, 3))
    direction = torch.where(travel.abs().amax(1) < min_travel, torch.full_like(direction, STILL), direction)
    return Reading(digit, pred, direction.long(), travel)


def reading_scores(reading: Reading, prompt_indices: Sequence[int] | torch.Tensor) -> dict[str, float]:
    """How often the reading matches the prompts: the clip's digit, its frames' digits, the direction."""
    idx = torch.as_tensor(list(prompt_indices) if not isinstance(prompt_indices, torch.Tensor) else prompt_indices)
    digit, direction = idx // len(DIRECTIONS), idx % len(DIRECTIONS)
    return {"clips": int(len(idx)),
            "digit_accuracy": float((reading.digit == digit).float().mean()),
            "digit_frame_accuracy": float((reading.digit_frames == digit.view(-1, 1)).float().mean()),
            "direction_accuracy": float((reading.direction == direction).float().mean())}
