"""Definitions every backend shares (docs/numerics.md sections 2 and 4): the 32-key block of Direct-P,
the anchor samples and the physical key order of anchored policies, the native exp2 positions, and
which Q/K operand layout a policy uses at a head dim. The reference and every kernel import them
from here, so that a key means the same position everywhere."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from fp4vis.formats import MXFP4_BLOCK
from fp4vis.policy import QK_FP8, Policy

LOG2E = 1.0 / math.log(2.0)
LN2 = math.log(2.0)
KEY_BLOCK = MXFP4_BLOCK  # keys per P block (section 2) = tokens per MXFP4 V block (section 1)


def anchor_indices(seq_len: int, n: int, device=None) -> torch.Tensor:
    """docs/numerics.md section 4 sample positions ``round(linspace(0, S-1, n))`` (round half to even).
    With S <= n every key is a sample: ``arange(S)``."""
    if seq_len <= n:
        return torch.arange(seq_len, device=device)
    return torch.round(torch.linspace(0, seq_len - 1, n, dtype=torch.float64, device=device)).long()


def anchor_permutation(seq_len: int, n: int, device=None) -> torch.Tensor:
    """Physical order of keys for an anchored policy: the n samples first, the rest in order.
    ``perm[p]`` is the logical key at physical position p."""
    idx = anchor_indices(seq_len, n, device)
    rest = torch.ones(seq_len, dtype=torch.bool, device=device)
    rest[idx] = False
    return torch.cat((idx, torch.arange(seq_len, device=device)[rest]))


def native_positions(num_keys: int, device=None) -> torch.Tensor:
    """Bool mask of the native exp2 positions (docs/numerics.md section 2): with b = j//32, quarter = b%4,
    pair = (j%32)//2, key j is native when pair is quarter, quarter+8, 4 or 12."""
    j = torch.arange(num_keys, device=device)
    quarter = (j // KEY_BLOCK) % 4
    pair = (j % KEY_BLOCK) // 2
    return (pair == quarter) | (pair == quarter + 8) | (pair == 4) | (pair == 12)


@dataclass(frozen=True)
class KernelParams:
    """What a Direct-P kernel takes of a policy for one call (``kernel_params``): the affine code, the shift L,
    native positions, anchors and their margin in raw-score units, the Q/K layout, the code rounding, and
    ``s_log2`` (the softmax scale times log2 e)."""

    s_log2: float
    margin_raw: float
    affine_a: float
    affine_b: float
    shift: int
    native_exp2: bool
    anchor: int
    qk_layout: str
    code_rounding: str


def kernel_params(policy: Policy, head_dim: int, scale: float) -> KernelParams:
    """The one conversion of a policy to a kernel's parameters (both kernel backends; the reference computes
    from the policy, with the same ``Policy.margin_raw``)."""
    s_log2 = scale * LOG2E
    return KernelParams(s_log2, float(policy.margin_raw(s_log2)), float(policy.affine_a), float(policy.affine_b),
                        int(policy.shift), bool(policy.native_exp2), int(policy.anchor), qk_layout(policy, head_dim),
                        policy.code_rounding)


def qk_layout(policy: Policy, head_dim: int) -> str:
    """The Q/K format actually used: folded64_mse needs D % 32 == 0 (docs/numerics.md), else block16."""
    if policy.qk_fp8:
        return QK_FP8
    return "folded64_mse" if policy.qk_format == "folded64_mse" and head_dim % 32 == 0 else "block16"
