"""Attention policies: plain, validated data (docs/numerics.md section 3).

A policy says *how* attention is computed; it carries no code. Backends read its fields. The named
policies are the ones the paper published; users may build their own within the same rules
(``Policy.__post_init__`` enforces them).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping
from dataclasses import dataclass
from types import MappingProxyType
from typing import Literal, NamedTuple

Method = Literal["direct_p", "fp8_pv", "nv_fp8", "exact"]
METHODS = ("direct_p", "fp8_pv", "nv_fp8", "exact")
QKFormat = Literal["block16", "folded64_mse", "fp8_e4m3"]
QK_FP8 = "fp8_e4m3"   # the one non-NVFP4 Q/K format (FP8 with power-of-two scales; docs/numerics.md section 7)
MarginUnits = Literal["code", "paper"]
CodeRounding = Literal["exact", "bf16"]

# docs/numerics.md section 2: representable block exponents relative to the row reference are [L-126, 127];
# an anchored policy needs its margin plus its stored shift to stay inside that window.
MAX_MARGIN_PLUS_SHIFT = 126
LN2 = math.log(2.0)
LOG2E = 1.0 / LN2   # a softmax scale times LOG2E: the scores' binary exponent per raw unit (s_log2)


class KernelParams(NamedTuple):
    """What a kernel takes of a policy for one call (``Policy.kernel_params``): ``s_log2`` (the softmax scale times
    log2 e), the anchors' margin in raw-score units, the affine code, the shift L, native positions, anchors, the
    Q/K layout actually used, the code rounding, and ``pv_fp8``: the FP8 P/V softmax in place of Direct-P."""

    s_log2: float
    margin_raw: float
    affine_a: float
    affine_b: float
    shift: int
    native_exp2: bool
    anchor: int
    qk_layout: str
    code_rounding: str
    pv_fp8: bool = False


@dataclass(frozen=True)
class Policy:
    """One attention policy.

    Attributes:
        name: label used in logs, guard plans and reports.
        method: ``"direct_p"`` (the FP4 method), ``"fp8_pv"`` (the method's FP8 P/V configuration: Q/K in
            ``qk_format``, softmax with an online row maximum per 128-key tile, P and V in E4M3; docs/numerics.md
            section 7, the Hopper speed mode), ``"nv_fp8"`` (control: NVFP4 Q/K, max-subtracted softmax, FP8 P
            and V) or ``"exact"`` (control: softmax attention, what SDPA computes).
        affine_a, affine_b: the affine stand-in ``A*x + B`` for ``2**x`` at affine key positions.
        native_exp2: compute ``2**x`` at the native key positions (25 % of keys, docs/numerics.md section 2).
        anchor: number of anchor samples (0: row reference ``m = 0``).
        margin: M, added to the anchor maximum (only with ``anchor > 0``).
        margin_units: ``"code"`` adds ``M*ln 2`` in raw-score units (the published code, default);
            ``"paper"`` adds ``M*ln 2 / scale`` (M in binary exponents of P, the paper's text).
        shift: L, the stored shift of the P block scales.
        qk_format: how Q and K are quantized: NVFP4 with its scale layout (``"block16"``,
            ``"folded64_mse"``, docs/numerics.md section 1), or ``"fp8_e4m3"``: E4M3 with a power-of-two
            scale per query row and per 32-key block (``fp4vis.formats.fp8_pow2_quantize``; not
            docs/numerics.md section 7: the Hopper FP8 policy ``fast_fp8qk``, whose QK^T runs on FP8 tensor cores).
        qk_global_scale: also apply the optional per-tensor FP32 encode ``G = 6*448/amax``.
        code_rounding: ``"exact"`` (docs/numerics.md): the P code is E2M1 of y, the affine or exp2 value;
            ``"bf16"``: y is first rounded to BF16 (8 significant bits), then to E2M1 — a double
            rounding that moves a code one step where y lies within half a BF16 ulp of an E2M1
            midpoint (about 0.5 % of the codes on Gaussian inputs). Not exact to docs/numerics.md: it lets the
            Hopper kernel round pairs of codes with BF16x2 instructions (``fast_bf16round``;
            docs/hopper_kernel.md).
    """

    name: str
    method: Method = "direct_p"
    affine_a: float = 1.5
    affine_b: float = 1.2
    native_exp2: bool = False
    anchor: int = 0
    margin: float = 0.0
    margin_units: MarginUnits = "code"
    shift: int = 16
    qk_format: QKFormat = "folded64_mse"
    qk_global_scale: bool = False
    code_rounding: CodeRounding = "exact"

    def __post_init__(self) -> None:
        if not isinstance(self.name, str) or not self.name:
            raise TypeError(f"Policy: name must be a non-empty string, got {self.name!r}")
        for field_name in ("native_exp2", "qk_global_scale"):
            value = getattr(self, field_name)
            if type(value) is not bool:   # the string "no" must not switch an option on
                raise TypeError(f"Policy {self.name!r}: {field_name} must be True or False, got {value!r}")
        if self.method not in METHODS:
            raise ValueError(f"Policy {self.name!r}: method must be one of {', '.join(map(repr, METHODS))}, "
                             f"got {self.method!r}")
        if self.qk_format not in ("block16", "folded64_mse", "fp8_e4m3"):
            raise ValueError(f"Policy {self.name!r}: qk_format must be 'block16', 'folded64_mse' or "
                             f"'fp8_e4m3', got {self.qk_format!r}")
        if self.qk_fp8 and self.qk_global_scale:
            raise ValueError(f"Policy {self.name!r}: qk_global_scale is an NVFP4 option; qk_format "
                             "'fp8_e4m3' has its own power-of-two scales")
        if self.code_rounding not in ("exact", "bf16"):
            raise ValueError(f"Policy {self.name!r}: code_rounding must be 'exact' or 'bf16', "
                             f"got {self.code_rounding!r}")
        if self.code_rounding != "exact" and self.method != "direct_p":
            raise ValueError(f"Policy {self.name!r}: code_rounding applies to Direct-P codes only "
                             f"(method {self.method!r})")
        if self.margin_units not in ("code", "paper"):
            raise ValueError(f"Policy {self.name!r}: margin_units must be 'code' or 'paper', "
                             f"got {self.margin_units!r}")
        for field_name in ("affine_a", "affine_b", "margin"):
            value = getattr(self, field_name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
                raise ValueError(f"Policy {self.name!r}: {field_name} must be a finite number, got {value!r}")
        if not self.affine_a > 0:
            raise ValueError(f"Policy {self.name!r}: affine_a (A) must be > 0, got {self.affine_a}")
        if type(self.shift) is not int or not 0 <= self.shift <= MAX_MARGIN_PLUS_SHIFT:
            raise ValueError(f"Policy {self.name!r}: shift (L) must be an integer in "
                             f"[0, {MAX_MARGIN_PLUS_SHIFT}], got {self.shift!r}")
        if type(self.anchor) is not int or self.anchor < 0:
            raise ValueError(f"Policy {self.name!r}: anchor must be a non-negative integer, got {self.anchor!r}")
        if self.method == "fp8_pv" and (self.anchor or self.native_exp2):
            raise ValueError(f"Policy {self.name!r}: method 'fp8_pv' takes its row maximum online (no anchors) "
                             "and computes every exponential (no native_exp2)")
        if self.anchor == 0 and self.margin != 0:
            raise ValueError(f"Policy {self.name!r}: margin (M) needs anchor > 0 (the row reference "
                             "is m = 0 without anchors)")
        if self.anchor > 0:
            if self.margin < 0:
                raise ValueError(f"Policy {self.name!r}: margin (M) must be >= 0, got {self.margin}")
            if self.margin + self.shift > MAX_MARGIN_PLUS_SHIFT:
                raise ValueError(
                    f"Policy {self.name!r}: margin + shift = {self.margin} + {self.shift} exceeds "
                    f"{MAX_MARGIN_PLUS_SHIFT} (docs/numerics.md section 3: M + L <= 126)")

    @property
    def is_direct_p(self) -> bool:
        return self.method == "direct_p"

    @property
    def is_fp8_pv(self) -> bool:
        """The FP8 P/V softmax (``method="fp8_pv"``): what the Hopper kernel runs at FP8 speed."""
        return self.method == "fp8_pv"

    @property
    def qk_fp8(self) -> bool:
        """Q and K are FP8 (``qk_format="fp8_e4m3"``), not NVFP4."""
        return self.qk_format == QK_FP8

    @property
    def is_spec_exact(self) -> bool:
        """False for the documented inexact trades (codes rounded through BF16, FP8 Q/K)."""
        return self.code_rounding == "exact" and not self.qk_fp8

    def spec_twin(self) -> Policy:
        """The exact policy this one approximates: itself if exact, else the same policy with
        exact code rounding and NVFP4 folded-K64 Q/K in place of FP8 (``fast`` for both inexact
        named policies)."""
        if self.is_spec_exact:
            return self
        return self.replace(name=f"{self.name}_spec", code_rounding="exact",
                            qk_format="folded64_mse" if self.qk_fp8 else self.qk_format)

    def margin_raw(self, s_log2: float, tensor_scale: float = 1.0) -> float:
        """The anchored row reference's margin above the anchor maximum, in raw-score units (docs/numerics.md
        section 4), for scores whose binary exponent is ``raw * s_log2`` (the softmax scale times log2 e, times
        ``tensor_scale``): ``M ln 2 / tensor_scale`` in code units, ``M / s_log2`` in the paper's (M binary
        exponents of P); 0 without anchors. ``tensor_scale``: the product of q's and k's per-tensor decode
        scales, which raw scores computed from the scaled operands leave out. The one margin formula: the
        reference and both kernels take it from here, the guard ``margin_log2``."""
        if self.anchor == 0:
            return 0.0
        if self.margin_units == "code":
            return self.margin * LN2 / tensor_scale
        return self.margin / s_log2

    def qk_layout(self, head_dim: int) -> str:
        """The Q/K format actually used at a head dim: folded64_mse needs D % 32 == 0 (docs/numerics.md), else
        block16; ``fp8_e4m3`` as given."""
        if self.qk_fp8:
            return QK_FP8
        return "folded64_mse" if self.qk_format == "folded64_mse" and head_dim % 32 == 0 else "block16"

    def kernel_params(self, head_dim: int, scale: float) -> KernelParams:
        """The one conversion of a policy to a kernel's parameters for a call (both kernel backends; the
        reference computes from the policy with the same ``margin_raw`` and ``qk_layout``)."""
        s_log2 = scale * LOG2E
        return KernelParams(s_log2, float(self.margin_raw(s_log2)), float(self.affine_a), float(self.affine_b),
                            int(self.shift), bool(self.native_exp2), int(self.anchor), self.qk_layout(head_dim),
                            self.code_rounding, self.is_fp8_pv)

    def margin_log2(self, scale: float) -> float:
        """The same margin in binary exponents of P, for a softmax scale (the guard's statistics): ``M * scale``
        in code units, ``M`` in the paper's."""
        if self.anchor == 0:
            return 0.0
        return self.margin * scale if self.margin_units == "code" else float(self.margin)

    def replace(self, **changes) -> Policy:
        """A copy with some fields changed (validated again)."""
        return dataclasses.replace(self, **changes)

    def values(self) -> tuple:
        """The fields in order, plain values: ``Policy(*p.values()) == p``. What torch.compile can pass as
        constants (Dynamo traces this; it cannot take the object itself as one in every torch release)."""
        return (self.name, self.method, self.affine_a, self.affine_b, self.native_exp2, self.anchor, self.margin,
                self.margin_units, self.shift, self.qk_format, self.qk_global_scale, self.code_rounding)


def guard_policy(margin: float = 110, shift: int = 16, name: str | None = None) -> Policy:
    """The guard policy with margin M and stored shift L (docs/numerics.md sections 3 and 4)."""
    return Policy(
        name=name or f"guard_m{margin:g}_l{shift}",
        affine_a=1.65, affine_b=0.80, native_exp2=True,
        anchor=128, margin=margin, shift=shift, qk_format="folded64_mse",
    )


def guard_policy_for_heads(num_heads: int) -> Policy:
    """The published guard for a model with ``num_heads`` heads: (M, L) = (110, 16) for the
    smaller models (H <= 16, e.g. Wan2.1-1.3B), (112, 14) for H >= 40 (Wan2.1-14B). Models in
    between get the smaller-model setting; pass (M, L) to ``guard_policy`` to choose otherwise."""
    return guard_policy(112, 14, name="guard") if num_heads >= 40 else POLICIES["guard"]


POLICIES: Mapping[str, Policy] = MappingProxyType({
    "fast": Policy("fast", affine_a=1.50, affine_b=1.20, shift=16, qk_format="folded64_mse"),
    "wan_fast": Policy("wan_fast", affine_a=1.60, affine_b=0.95, shift=16, qk_format="folded64_mse"),
    # not from the paper: `fast` with codes rounded through BF16, the inexact trade tried for Hopper.
    # Measured on the H200 (docs/hopper_kernel.md, "The inexact policies"): about 5 % less kernel time than
    # `fast`, 3-4 % relL2 off `fast`'s reference.
    "fast_bf16round": Policy("fast_bf16round", affine_a=1.50, affine_b=1.20, shift=16, qk_format="folded64_mse",
                             code_rounding="bf16"),
    # not from the paper: `fast` with Q and K in FP8 (E4M3, power-of-two scales per query row and per
    # 32-key block) instead of NVFP4, so that QK^T runs on Hopper's FP8 tensor cores; P and V as in
    # `fast`. Finer than NVFP4 (3 mantissa bits), so closer to BF16 attention, but not exact to docs/numerics.md and
    # not bit-reproducible on the GPU (FP8 WGMMA accumulation): docs/hopper_kernel.md.
    "fast_fp8qk": Policy("fast_fp8qk", affine_a=1.50, affine_b=1.20, shift=16, qk_format="fp8_e4m3"),
    "accurate": Policy("accurate", affine_a=1.65, affine_b=0.80, native_exp2=True, anchor=32,
                       margin=64, shift=8, qk_format="block16"),
    "guard": guard_policy(110, 16, name="guard"),
    # the method's FP8 P/V configuration (docs/numerics.md section 7): softmax with an online row maximum, P and V
    # in E4M3; Q/K in NVFP4 block16 (`fp8pv`, the paper's training route) or in FP8 as `fast_fp8qk` (`fp8`, the
    # Hopper speed mode: both products on FP8 tensor cores)
    "fp8pv": Policy("fp8pv", method="fp8_pv", qk_format="block16"),
    "fp8": Policy("fp8", method="fp8_pv", qk_format="fp8_e4m3"),
    "nv_fp8": Policy("nv_fp8", method="nv_fp8", qk_format="block16"),
    "bf16": Policy("bf16", method="exact"),
})   # read-only: a named policy means the same everywhere (build others with Policy(...) or .replace)


def get_policy(policy: str | Policy) -> Policy:
    """Resolve a policy name or pass a Policy through; unknown names raise with the known ones."""
    if isinstance(policy, Policy):
        return policy
    if isinstance(policy, str) and policy in POLICIES:
        return POLICIES[policy]
    raise ValueError(f"policy: unknown policy {policy!r}; known policies are "
                     f"{', '.join(sorted(POLICIES))}, or pass an fp4vis.Policy")
