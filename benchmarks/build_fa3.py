"""Build FlashAttention-3 (flash-attention's ``hopper/``) trimmed to what the kernel benchmark compares: the sm90
forward, head dims 64 and 128, BF16 and FP8 (E4M3) inputs, no variable length, paging, splits, softcap or local
windows. For the ``fa3``, ``fa3_fp8`` and ``fa3_fp8_kernel`` backends of ``benchmarks/kernel_grid.py``.

    git clone https://github.com/Dao-AILab/flash-attention
    git -C flash-attention submodule update --init csrc/cutlass
    python benchmarks/build_fa3.py flash-attention/hopper            # nvcc >= 12.3 (FA3 needs it)
    PYTHONPATH=flash-attention/hopper python benchmarks/kernel_grid.py --backends fa4,fa3,fa3_fp8_kernel,...
    python benchmarks/build_fa3.py flash-attention/hopper --cubin fa3.cubin   # one instantiation's cubin, for
    python -m fp4vis.kernels.hopper.compile_check --loop-opcodes fa3.cubin    # its key loop's static counts

It compiles the sources with torch's extension builder (ninja) and the nvcc flags of flash-attention's own
``hopper/setup.py`` (which also downloads a toolchain and needs git; this does neither), writes
``flash_attn_config.py`` beside them and puts the module at ``flash_attn_3/_C.so``, where ``flash_attn_interface``
imports it; then checks one BF16 and one FP8 call against SDPA (exit status 1 past ``CHECK_TOLERANCE``). With
flash-attention 0251105a and its CUTLASS submodule 71275920 it builds on the 2-core workstation (nvcc 13.0, torch
2.14.1) in about 200 s and the module imports there; the check needs a GPU (there the command exits 1 at its first
CUDA tensor). The module is built against torch's stable ABI for torch >= 2.9 (FA3's ``TORCH_TARGET_VERSION``): one
built there loads on the GPU machine's torch 2.11 and passes the check (BF16 relL2 0.0028, FP8 0.0539 against SDPA
on the H100), the build behind the FlashAttention-3 figures in docs/hopper_kernel.md.
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import time

# FA3's feature switches (hopper/setup.py's FLASH_ATTENTION_DISABLE_*), True = left out of the build
DISABLED = dict(FLASHATTENTION_DISABLE_BACKWARD=True, FLASHATTENTION_DISABLE_SPLIT=True,
                FLASHATTENTION_DISABLE_PAGEDKV=True, FLASHATTENTION_DISABLE_APPENDKV=True,
                FLASHATTENTION_DISABLE_LOCAL=True, FLASHATTENTION_DISABLE_SOFTCAP=True,
                FLASHATTENTION_DISABLE_PACKGQA=True, FLASHATTENTION_DISABLE_FP16=True,
                FLASHATTENTION_DISABLE_FP8=False, FLASHATTENTION_DISABLE_VARLEN=True,
                FLASHATTENTION_DISABLE_CLUSTER=False, FLASHATTENTION_DISABLE_HDIM64=False,
                FLASHATTENTION_DISABLE_HDIM96=True, FLASHATTENTION_DISABLE_HDIM128=False,
                FLASHATTENTION_DISABLE_HDIM192=True, FLASHATTENTION_DISABLE_HDIM256=True,
                FLASHATTENTION_DISABLE_SM8x=True, FLASHATTENTION_ENABLE_VCOLMAJOR=False,
                FLASH_ATTENTION_DISABLE_HDIMDIFF64=True, FLASH_ATTENTION_DISABLE_HDIMDIFF192=True)
HEAD_DIMS = (64, 128)
NVCC_FLAGS = ["--threads", "2", "-O3", "-std=c++17", "--ftemplate-backtrace-limit=0", "--use_fast_math", "-lineinfo",
              "-DCUTE_SM90_EXTENDED_MMA_SHAPES_ENABLED", "-DCUTLASS_ENABLE_GDC_FOR_SM90",
              "-DCUTLASS_DEBUG_TRACE_LEVEL=0", "-DNDEBUG", "-gencode", "arch=compute_90a,code=sm_90a"]
CXX_FLAGS = ["-O3", "-std=c++17", "-DPy_LIMITED_API=0x03090000", "-DTORCH_TARGET_VERSION=0x0209000000000000"]


def _defines() -> list[str]:
    """-D of every switch left out (the macros are all spelled FLASHATTENTION_*, two config keys FLASH_ATTENTION_*,
    as in setup.py)."""
    return [f"-D{k.replace('FLASH_ATTENTION_', 'FLASHATTENTION_')}" for k, off in DISABLED.items()
            if off and k != "FLASHATTENTION_ENABLE_VCOLMAJOR"]


def _check_cuda_home(cuda_home: str | None) -> None:
    if cuda_home is None or not os.path.isfile(os.path.join(cuda_home, "include", "cuda_runtime.h")):
        raise SystemExit(f"CUDA_HOME={cuda_home!r} holds no CUDA toolkit (include/cuda_runtime.h): set CUDA_HOME")


def build(hopper: str) -> str:
    """Compile FA3 in ``hopper`` (a flash-attention checkout's hopper/ directory); returns the module's path."""
    from torch.utils.cpp_extension import CUDA_HOME, load

    with open(os.path.join(hopper, "flash_attn_config.py"), "w") as f:
        f.write(f"CONFIG = {{'build_flags': {DISABLED!r}}}\n")
    defines = _defines()
    sources = (["flash_api_stable.cpp"]
               + [f"instantiations/flash_fwd_hdim{d}_{t}_sm90.cu" for d in HEAD_DIMS for t in ("bf16", "e4m3")]
               + ["flash_prepare_scheduler.cu"])
    _check_cuda_home(CUDA_HOME)
    cccl = os.path.join(CUDA_HOME, "include", "cccl")   # CUDA 13's CCCL headers (as FA3's setup.py adds them)
    if os.path.isdir(cccl):
        for var in ("CPLUS_INCLUDE_PATH", "C_INCLUDE_PATH"):
            os.environ[var] = cccl + (":" + os.environ[var] if os.environ.get(var) else "")
    os.environ.setdefault("MAX_JOBS", str(os.cpu_count() or 4))
    build_dir = os.path.join(hopper, "build_fa3")
    os.makedirs(build_dir, exist_ok=True)
    load(name="_C", sources=[os.path.join(hopper, s) for s in sources], extra_cflags=CXX_FLAGS + defines,
         extra_cuda_cflags=NVCC_FLAGS + defines, build_directory=build_dir, verbose=True, is_python_module=False,
         extra_include_paths=[hopper, os.path.join(hopper, "..", "csrc", "cutlass", "include")])
    target = os.path.join(hopper, "flash_attn_3", "_C.so")
    shutil.copy(os.path.join(build_dir, "_C.so"), target)
    return target


CHECK_TOLERANCE = {"bf16": 1e-2, "e4m3": 6e-2}   # relative L2 against SDPA: BF16's rounding, E4M3's


def cubin(hopper: str, instantiation: str, out: str) -> None:
    """One of FA3's instantiations (``instantiations/<name>.cu``) compiled alone to ``out``, a cubin, with the build's
    flags (and the half-precision switches torch's builder adds): for ``compile_check --loop-opcodes``."""
    from torch.utils.cpp_extension import COMMON_NVCC_FLAGS, CUDA_HOME

    _check_cuda_home(CUDA_HOME)
    nvcc = os.path.join(CUDA_HOME, "bin", "nvcc")
    cmd = [nvcc, "-cubin", *COMMON_NVCC_FLAGS, *NVCC_FLAGS, *_defines(), f"-I{hopper}",
           f"-I{os.path.join(hopper, '..', 'csrc', 'cutlass', 'include')}",
           os.path.join(hopper, "instantiations", f"{instantiation}.cu"), "-o", out]
    subprocess.run(cmd, check=True)


def check(hopper: str) -> bool:
    """One BF16 and one FP8 call of the built module against SDPA: each within ``CHECK_TOLERANCE`` (printed)."""
    import torch

    sys.path.insert(0, hopper)
    from flash_attn_interface import flash_attn_func

    q, k, v = (torch.randn(1, 1024, 4, 128, device="cuda", dtype=torch.bfloat16) for _ in range(3))
    ref = torch.nn.functional.scaled_dot_product_attention(*(x.transpose(1, 2) for x in (q, k, v))).transpose(1, 2)
    one = torch.ones(1, 4, device="cuda")
    ok = True
    for name, args, kw in (("bf16", (q, k, v), {}),
                           ("e4m3", tuple(x.to(torch.float8_e4m3fn) for x in (q, k, v)),
                            dict(q_descale=one, k_descale=one, v_descale=one))):
        out = flash_attn_func(*args, **kw)
        out = (out[0] if isinstance(out, tuple) else out).float()
        err = ((out - ref.float()).norm() / ref.float().norm()).item()
        ok &= err <= CHECK_TOLERANCE[name]
        print(f"{name}: rel L2 vs SDPA {err:.4f} (at most {CHECK_TOLERANCE[name]})")
    return ok


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("hopper", help="flash-attention's hopper/ directory (csrc/cutlass beside it)")
    ap.add_argument("--check-only", action="store_true", help="only the calls against SDPA")
    ap.add_argument("--cubin", metavar="OUT", default=None,
                    help="only compile --instantiation to the cubin OUT (no GPU needed)")
    ap.add_argument("--instantiation", default="flash_fwd_hdim128_e4m3_sm90",
                    help="with --cubin: the instantiations/ file, without .cu")
    a = ap.parse_args(argv)
    hopper = os.path.abspath(a.hopper)
    if a.cubin:
        cubin(hopper, a.instantiation, a.cubin)
        return 0
    if a.check_only:
        return 0 if check(hopper) else 1
    t0 = time.time()
    print(f"built {build(hopper)} in {time.time() - t0:.0f} s", flush=True)
    # in a fresh process: this one has loaded the build directory's copy, whose operators a second copy
    # (flash_attn_3/_C.so, what flash_attn_interface imports) would register again
    return subprocess.run([sys.executable, __file__, hopper, "--check-only"]).returncode


if __name__ == "__main__":
    raise SystemExit(main())
