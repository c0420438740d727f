"""Static configuration of the Blackwell Direct-P kernel, in one place.

Everything the compiler specialises on lives in ``KernelConfig`` (a frozen dataclass with a
``key()``); policy numbers that do not change the instruction stream (A, B, L, the margin, the
anchor count, the softmax scale) are runtime arguments, so one compiled kernel serves every policy
of its shape class (docs/numerics.md section 3: user policies within the rules included).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal, get_args

# docs/numerics.md section 2 constants (the reference's names: fp4vis.reference.LOG2_6 / LOG2_1P5 / KEY_BLOCK)
LOG2_6 = math.log2(6.0)
LOG2_1P5 = math.log2(1.5)
KEY_BLOCK = 32        # keys per P block = tokens per MXFP4 V block (docs/numerics.md sections 1, 2)
NVFP4_BLOCK = 16      # elements of D per E4M3 Q/K scale (docs/numerics.md section 1; folded-K64 is expanded)
E8M0_BIAS = 127
MAX_EXP_BYTE = 254
E8M0_NAN = 0xFF       # a V scale of 0xFF marks a head with non-finite input (docs/numerics.md section 6)

SUPPORTED_HEAD_DIMS = (64, 128)
OutDtype = Literal["bf16", "fp16"]
OUT_DTYPES: tuple[OutDtype, ...] = get_args(OutDtype)
# Architectures the kernel is compiled for: (Triton capability, marketing name). 90 is the H200
# verification build (dot_scaled lowers to an exact BF16 upcast + wgmma there).
ARCHS = {100: "sm_100a", 103: "sm_103a", 120: "sm_120a", 90: "sm_90a"}
# the hardware E2M1 conversion (cvt.rn.satfinite.relu.e2m1x2.f32) exists from sm_100a on
HW_CVT_ARCHS = (100, 103, 120)
# the packed float32 FMA (fma.rn.f32x2) exists on these
FMA_X2_ARCHS = (100, 103)
# the warp-specialised Gluon kernel (gluon_ws.py: tcgen05 and TMEM) exists for these
WARP_SPECIALIZED_ARCHS = (100, 103)
# its launch shape: 4 warps in the default partition (the even tiles' Direct-P and the epilogue; the three worker
# partitions bring their own), and the depth of its K/V ring: the load warp refills a stage after that tile's P·V
# and Q·Kᵀ runs two tiles ahead of P·V, so with 4 stages a K tile's TMA starts about two tiles before its MMA
WS_WARPS = 4
WS_STAGES = 4
Schedule = Literal["serial", "warp_specialized"]
SCHEDULES: tuple[Schedule, ...] = get_args(Schedule)
# the Triton release that lowers NVFP4 tl.dot_scaled everywhere we need it (docs/blackwell_kernel.md, "Pins")
MIN_TRITON = (3, 8)
# the Blackwell GPUs this kernel is built for (sm_100a, sm_103a, sm_120a): where "auto" picks it (its sm_90 build is
# a verification route: "auto" never picks it on a Hopper GPU)
CAPABILITIES = ((10, 0), (10, 3), (12, 0))

# tile shape: BLOCK_M query rows x BLOCK_N keys per step (BLOCK_N a multiple of 64, the FP4 MMA's K)
BLOCK_M = 128
BLOCK_N = 128


@dataclass(frozen=True)
class KernelConfig:
    """One compiled variant.

    head_dim: D (64 or 128); out_dtype: "bf16" / "fp16"; native: the 25 % native exp2 positions
    (accurate, guard); anchored: a row reference from anchor samples (else m = 0); arch: Triton
    capability (100, 103, 120 or 90); hw_cvt: P codes through the hardware E2M1 conversion (only
    where the arch has it), else the exact emulation; key_lengths: a key count per batch element (a key-masked
    call: ``kernels/kept_keys.py``), else every element has all keys; schedule: "serial" (``kernel.py``: one
    Triton source for every arch, each tile's MMAs waited on in its iteration) or "warp_specialized"
    (``gluon_ws.py``: sm_100a/sm_103a, m = 0 without native positions; its tile shape and warps are its own)."""

    head_dim: int
    out_dtype: OutDtype
    native: bool
    anchored: bool
    arch: int
    block_m: int = BLOCK_M
    block_n: int = BLOCK_N
    num_warps: int = 8
    num_stages: int = 2
    key_lengths: bool = False
    schedule: Schedule = "serial"

    def __post_init__(self) -> None:
        if self.head_dim not in SUPPORTED_HEAD_DIMS:
            raise ValueError(f"head_dim: {self.head_dim} not in {SUPPORTED_HEAD_DIMS}")
        if self.out_dtype not in OUT_DTYPES:
            raise ValueError(f"out_dtype: {self.out_dtype!r} not in {OUT_DTYPES}")
        if self.arch not in ARCHS:
            raise ValueError(f"arch: {self.arch} not in {sorted(ARCHS)}")
        if self.schedule not in SCHEDULES:
            raise ValueError(f"schedule: {self.schedule!r} not in {SCHEDULES}")
        if self.warp_specialized and (self.arch not in WARP_SPECIALIZED_ARCHS or self.native or self.anchored):
            raise ValueError(f"schedule: the warp-specialised kernel is built for sm_100a/sm_103a with m = 0 and no "
                             f"native positions, not {self.arch_name} native={self.native} anchored={self.anchored}")
        if self.block_n % 64 or self.block_m % 64:
            raise ValueError(f"block_m/block_n: multiples of 64 needed, got {self.block_m}/{self.block_n}")

    @property
    def hw_cvt(self) -> bool:
        return self.arch in HW_CVT_ARCHS

    @property
    def fma_x2(self) -> bool:
        return self.arch in FMA_X2_ARCHS

    @property
    def warp_specialized(self) -> bool:
        return self.schedule == "warp_specialized"

    @property
    def register_lean(self) -> bool:
        """sm_120a's native D128 build sits at 255 registers a thread: 16-byte V loads, per-thread saturation
        counters or a peeled last key tile spill it (``compile_check``: 7-67 LDL/STL), so it keeps byte-wide V
        loads, a per-tile saturation sum and one loop that tests each tile for the key mask."""
        return self.arch == 120 and self.native and self.head_dim == 128

    @property
    def arch_name(self) -> str:
        return ARCHS[self.arch]

    def key(self) -> tuple:
        """The fields in order, plain values (``KernelConfig(*key)``; spelled out: torch.compile traces it,
        and ``dataclasses.asdict`` does not trace in every torch release)."""
        return (self.head_dim, self.out_dtype, self.native, self.anchored, self.arch, self.block_m, self.block_n,
                self.num_warps, self.num_stages, self.key_lengths, self.schedule)

    def tag(self) -> str:
        """A file-name-safe name of the variant (cubin cache, logs)."""
        return (f"{self.arch_name}_d{self.head_dim}_{self.out_dtype}_n{int(self.native)}a{int(self.anchored)}"
                f"_m{self.block_m}n{self.block_n}w{self.num_warps}s{self.num_stages}"
                + ("_klen" if self.key_lengths else "") + ("_ws" if self.warp_specialized else ""))


def arch_of_capability(cap: tuple[int, int]) -> int | None:
    """Triton capability for a torch compute capability, None where the kernel has no build."""
    c = cap[0] * 10 + cap[1]
    return c if c in ARCHS else None
