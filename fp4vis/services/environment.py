"""The one environment record that every result JSON carries (``environment()``: date, versions, GPU,
platform, commit, the library warnings counted while the command ran) and its parts."""

from __future__ import annotations

import contextlib
import datetime as _dt
import importlib.metadata
import os
import platform
import subprocess
import sys
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import torch

from fp4vis.services.console import library_warnings

_PACKAGES = ("fp4vis", "torch", "triton", "diffusers", "transformers", "timm", "torchmetrics", "accelerate",
             "torchvision", "imageio", "imageio-ffmpeg", "nvidia-cutlass-dsl", "numpy", "flash-attn-4",
             "sageattention")


def fp4vis_version() -> str:
    try:
        return importlib.metadata.version("fp4vis")
    except importlib.metadata.PackageNotFoundError:
        return "unknown"


def package_versions(packages: Iterable[str] = _PACKAGES) -> dict[str, str | None]:
    """Installed version of each package (None when it is not installed)."""
    out: dict[str, str | None] = {}
    for name in packages:
        try:
            out[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            out[name] = None
    return out


def git_commit() -> str | None:
    """The commit of the fp4vis checkout (None outside a git work tree), with '+dirty' if modified."""
    root = Path(__file__).resolve().parent
    try:
        sha = subprocess.run(["git", "-C", str(root), "rev-parse", "HEAD"], capture_output=True,
                             text=True, timeout=10)
        if sha.returncode != 0:
            return None
        dirty = subprocess.run(["git", "-C", str(root), "status", "--porcelain", "--untracked-files=no"],
                               capture_output=True, text=True, timeout=10)
        return sha.stdout.strip() + ("+dirty" if dirty.stdout.strip() else "")
    except (OSError, subprocess.SubprocessError):
        return None


def gpu_info() -> dict[str, Any]:
    """CUDA devices seen by torch (empty list without CUDA)."""
    info: dict[str, Any] = {"cuda_available": bool(torch.cuda.is_available()),
                            "cuda_version": torch.version.cuda, "devices": []}
    if info["cuda_available"]:
        for i in range(torch.cuda.device_count()):
            p = torch.cuda.get_device_properties(i)
            info["devices"].append({"index": i, "name": p.name, "capability": f"{p.major}.{p.minor}",
                                    "sm_count": p.multi_processor_count,
                                    "memory_gib": round(p.total_memory / 2**30, 1)})
        with contextlib.suppress(Exception):
            info["cudnn"] = torch.backends.cudnn.version()
    return info


def environment() -> dict[str, Any]:
    """Everything a result needs to be reproduced: versions, GPU, platform, commit, time (UTC), and the
    library warnings the run's open ``WarningLog`` counted (not printed). The one metadata record of every
    JSON the project writes (evals, pipelines, benchmarks)."""
    return {
        "timestamp_utc": _dt.datetime.now(_dt.UTC).strftime("%Y-%m-%dT%H:%M:%SZ"),
        "python": sys.version.split()[0],
        "platform": platform.platform(),
        "cpu_count": os.cpu_count(),
        "git_commit": git_commit(),
        "versions": package_versions(),
        "gpu": gpu_info(),
        "command": " ".join([os.path.basename(sys.argv[0]), *sys.argv[1:]]),   # no path of this machine
        "library_warnings": library_warnings(),
    }
