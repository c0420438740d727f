"""``fp4vis info``: versions, GPUs, and every attention backend: usable here, or why not."""

from __future__ import annotations

import argparse
import json

import torch

from fp4vis.backends import available_backends, get_backend
from fp4vis.policy import POLICIES
from fp4vis.services.environment import fp4vis_version, gpu_info, package_versions

from .options import Formatter


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("info", formatter_class=Formatter, help="which backends work here and why the others do not",
                       description="Versions, GPU, and every attention backend: usable here, or why not.")
    p.add_argument("--json", action="store_true", help="print JSON instead of text")


def _backend_status(backends: dict) -> dict:
    """More than available-or-not, from backends that say it (``status()``: the Blackwell backend's
    launch route, compiled kernels, self-check verdicts and first-use timing against BF16)."""
    out = {}
    for name in backends:
        try:
            backend = get_backend(name)
            if backend is not None and hasattr(backend, "status"):
                out[name] = backend.status()
        except Exception as e:  # noqa: BLE001 - report, do not crash
            out[name] = {"error": f"{type(e).__name__}: {e}"}
    return out


def run(args: argparse.Namespace) -> int:
    try:
        backends = available_backends()
    except Exception as e:  # report, do not crash: `info` is what people run when things break
        backends = {"(registry)": f"{type(e).__name__}: {e}"}
    gpu = gpu_info()
    status = _backend_status(backends)
    info = {"fp4vis": fp4vis_version(), "torch": torch.__version__, "cuda": gpu, "backends": backends,
            "backend_status": status, "policies": sorted(POLICIES), "versions": package_versions()}
    if args.json:
        print(json.dumps(info, indent=2, default=str))
        return 0
    print(f"fp4vis {info['fp4vis']}  (torch {torch.__version__}, CUDA build {torch.version.cuda})")
    if gpu["devices"]:
        for d in gpu["devices"]:
            print(f"GPU {d['index']}: {d['name']} (sm_{d['capability'].replace('.', '')}, {d['memory_gib']} GiB)")
    else:
        print("GPU: none visible (torch.cuda.is_available() is False): CPU only, reference backend")
    print("Backends:")
    for name, reason in backends.items():
        print(f"  {name:<10} {'available' if reason is None else 'unavailable: ' + str(reason)}")
        for key, value in status.get(name, {}).items():
            if key == "available" or value in ({}, [], None):
                continue
            if key == "first_use_timing":   # long lines: one per GPU (the Blackwell kernel against BF16 there)
                for line in value.values():
                    print(f"  {'':<10}   {line}")
            else:
                print(f"  {'':<10}   {key}: {value}")
    print("Policies: " + ", ".join(info["policies"]))
    installed = [f"{k} {v}" for k, v in info["versions"].items() if v is not None and k != "fp4vis"]
    print("Libraries: " + ", ".join(installed))
    missing = [k for k, v in info["versions"].items() if v is None]
    if missing:
        print("Not installed: " + ", ".join(missing))
    return 0
