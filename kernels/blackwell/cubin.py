"""Ahead-of-time cubins: compile ``direct_p_fwd`` here (Triton >= 3.8, no GPU) and launch the
result elsewhere through CuPy (or cuda.bindings): the H200 verification route.

Why: the GPU machine's Triton (3.6) cannot lower NVFP4 ``tl.dot_scaled`` on sm_90, and a 3.8
wheel does not fit a device run's carry. A cubin compiled here by 3.8 carries dot_scaled's own
semantics (scale layouts, packing, the exact BF16 upcast) onto the H200, from the same source as
the Blackwell builds. ``auto`` never takes this route: the Hopper CuTe DSL backend is the sm_90
product path; ``backend="blackwell"`` on an sm_90 GPU uses it only where cubins exist
(``FP4VIS_BLACKWELL_CUBINS`` names their directory) or the local Triton can JIT the kernel.

Launch ABI (read from the PTX entry, saved beside the cubin): the kernel's runtime arguments in
signature order (pointers u64, ints u32, floats f32), then Triton's two scratch pointers (global
and profile scratch; both sizes are 0 for this kernel, checked at build time, so NULL is passed).
"""

from __future__ import annotations

import json
import os
import re

import torch

from fp4vis.settings import kernel_settings

from .config import KernelConfig

CUBIN_ENV = "FP4VIS_BLACKWELL_CUBINS"


def default_configs(arch: int = 90) -> list[KernelConfig]:
    """The variants the named policies and user policies need: D x out dtype x (native, anchored)
    for (affine, m = 0) and (native, anchored) policies, plus the two mixed classes; each without and with
    key counts (key-masked calls)."""
    return [KernelConfig(d, dt, native, anchored, arch, key_lengths=key_lengths)
            for key_lengths in (False, True) for d in (64, 128) for dt in ("bf16", "fp16")
            for native, anchored in ((False, False), (True, True), (True, False), (False, True))]


def _ptx_params(ptx: str, entry: str) -> list[str]:
    """Parameter kinds of the PTX entry, in order: "u64" / "u32" / "f32"."""
    m = re.search(r"\.entry\s+" + re.escape(entry) + r"\s*\((.*?)\)", ptx, re.S)
    if m is None:
        raise RuntimeError(f"entry {entry} not found in PTX")
    return re.findall(r"\.param\s+\.(\w+)", m.group(1))


def build(cfg: KernelConfig, outdir: str) -> dict:
    """Compile ``cfg`` and write ``<tag>.cubin`` + ``<tag>.json`` (launch metadata) to outdir."""
    from .kernel import compile_for_target, signature
    k = compile_for_target(cfg)
    md = k.metadata._asdict()
    if md.get("global_scratch_size", 0) or md.get("profile_scratch_size", 0):
        raise RuntimeError(f"{cfg.tag()}: needs Triton scratch memory; the cubin launcher passes none")
    params = _ptx_params(k.asm["ptx"], md["name"])
    n_user = len(signature(cfg.out_dtype))
    meta = {"name": md["name"], "num_warps": md["num_warps"], "shared": md["shared"], "params": params,
            "n_user": n_user, "triton_version": md["triton_version"], "config": cfg.key(), "tag": cfg.tag()}
    os.makedirs(outdir, exist_ok=True)
    with open(os.path.join(outdir, cfg.tag() + ".cubin"), "wb") as f:
        f.write(k.asm["cubin"])
    with open(os.path.join(outdir, cfg.tag() + ".json"), "w") as f:
        json.dump(meta, f)
    return meta


def cubin_dir() -> str | None:
    d = kernel_settings().blackwell_cubins
    return d if d and os.path.isdir(d) else None


def has_cubin(cfg: KernelConfig, directory: str | None = None) -> bool:
    directory = directory or cubin_dir()
    return bool(directory) and os.path.exists(os.path.join(directory, cfg.tag() + ".cubin"))


class CubinKernel:
    """One loaded cubin, launched on the current torch stream."""

    def __init__(self, cfg: KernelConfig, directory: str):
        import cupy
        self.cfg = cfg
        with open(os.path.join(directory, cfg.tag() + ".json")) as f:
            self.meta = json.load(f)
        # a cubin directory built before KernelConfig had its schedule field holds serial builds
        if KernelConfig(*self.meta["config"]).key() != cfg.key():
            raise RuntimeError(f"{cfg.tag()}: cubin metadata is for another config {self.meta['config']}")
        self._cupy = cupy
        self._streams: dict[int, object] = {}
        self.fn = cupy.RawModule(path=os.path.join(directory, cfg.tag() + ".cubin")).get_function(self.meta["name"])
        if self.meta["shared"] > 48 * 1024:
            self.fn.max_dynamic_shared_size_bytes = self.meta["shared"]

    def __call__(self, grid: tuple[int, int], args: tuple) -> None:
        import numpy as np
        kinds = self.meta["params"]
        if len(args) != self.meta["n_user"]:
            raise ValueError(f"{len(args)} arguments for a kernel of {self.meta['n_user']}")
        conv = []
        for kind, a in zip(kinds, list(args) + [0] * (len(kinds) - len(args))):
            if isinstance(a, torch.Tensor):
                conv.append(np.uint64(a.data_ptr()))
            elif kind == "u64":
                conv.append(np.uint64(a))
            elif kind == "f32":
                conv.append(np.float32(a))
            else:
                conv.append(np.int32(a))
        # RawKernel launches on CuPy's current stream: make it torch's current stream (graph capture
        # records the launch there)
        ptr = torch.cuda.current_stream().cuda_stream
        stream = self._streams.get(ptr)
        if stream is None:
            stream = self._streams[ptr] = self._cupy.cuda.ExternalStream(ptr)
        with stream:
            self.fn((grid[0], grid[1], 1), (32 * self.meta["num_warps"], 1, 1), tuple(conv),
                    shared_mem=self.meta["shared"])


_LOADED: dict[tuple, CubinKernel] = {}


def get(cfg: KernelConfig, directory: str | None = None) -> CubinKernel:
    directory = directory or cubin_dir()
    if directory is None:
        raise RuntimeError(f"no cubin directory: set {CUBIN_ENV}")
    key = (cfg.key(), directory)
    k = _LOADED.get(key)
    if k is None:
        k = _LOADED[key] = CubinKernel(cfg, directory)
    return k


def main(argv=None) -> int:
    """``python -m fp4vis.kernels.blackwell.cubin OUTDIR [--arch 90]``: build the default set."""
    import argparse
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("outdir")
    ap.add_argument("--arch", type=int, default=90)
    a = ap.parse_args(argv)
    for cfg in default_configs(a.arch):
        meta = build(cfg, a.outdir)
        print(cfg.tag(), "shared", meta["shared"], "params", len(meta["params"]), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
