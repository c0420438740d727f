"""Where and how the apps run torch, as the user names it: devices, dtypes, seeds (``derived_seed``: one per
prompt or image, wrapped as torch's generators count) and the modes of torch.compile."""

from __future__ import annotations

import torch

from fp4vis.services.usage import UsageError

# how the apps torch.compile a pipeline's transformers (fp4vis.pipelines.compile.compile_transformers):
# diffusers' regional compilation (compile_repeated_blocks) or the whole model (ModelMixin.compile)
COMPILE_MODES = ("regional", "full")
DTYPES = {"bfloat16": torch.bfloat16, "bf16": torch.bfloat16, "float16": torch.float16,
          "fp16": torch.float16, "float32": torch.float32, "fp32": torch.float32}


# the seeds torch's generators accept (torch.Generator.manual_seed, torch.manual_seed); a negative one counts
# modulo 2**64
SEED_MIN, SEED_MAX = -(2 ** 63), 2 ** 64 - 1


def derived_seed(seed: int, offset: int) -> int:
    """``seed + offset`` as torch's generators take it: modulo 2**64, as they count a negative seed, so a
    seed derived from the user's (a prompt's, an image's) never overflows (the last seed plus one is 0)."""
    return (int(seed) + int(offset)) % 2 ** 64


def resolve_device(device: str | torch.device | None = "auto") -> torch.device:
    """'auto' -> the first CUDA GPU when one is visible, else the CPU; 'cuda' without a GPU raises."""
    if device is None or str(device) == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        dev = torch.device(device)
    except (RuntimeError, TypeError):
        raise UsageError(f"device: {str(device)!r} is not a device; use auto, cpu, cuda or cuda:N") from None
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise UsageError(f"device {str(device)!r} needs a CUDA GPU, but none is visible here "
                         "(torch.cuda.is_available() is False); use --device cpu or --device auto")
    return dev


def resolve_dtype(dtype: str | torch.dtype) -> torch.dtype:
    if isinstance(dtype, torch.dtype):
        return dtype
    try:
        return DTYPES[str(dtype).lower()]
    except KeyError:
        raise UsageError(f"dtype: unknown dtype {dtype!r}; use one of bfloat16, float16, float32") from None
