"""Definitions every backend shares (docs/numerics.md sections 2, 4 and 7): the 32-key block of Direct-P, the key
tile and P scale of the FP8 P/V softmax, the anchor samples and the physical key order of anchored policies, and
the native exp2 positions. The reference and every kernel import them from here, so that a key means the same
position everywhere."""

from __future__ import annotations

import torch

from fp4vis.formats import MXFP4_BLOCK

KEY_BLOCK = MXFP4_BLOCK  # keys per P block (section 2) = tokens per MXFP4 V block (section 1)
# FP8 P/V policies (section 7): the row maximum is updated once per tile of physical keys, the Hopper kernel's key
# tile at the head dim (``softmax_tile``): 192 at D = 128 (two consumer warpgroups, a 64 x 192 score tile beside the
# output in registers; longer tiles spread each tile's fixed work over more keys), 128 at any other D (D = 64 runs
# three warpgroups of 160 registers); and P in [0, 1] is scaled by 2**P_E4M3_LOG2 before its E4M3 rounding (P = 1 ->
# 256: no saturation at 448, and 8 more binades before E4M3's subnormals)
SOFTMAX_TILE = 128
SOFTMAX_TILE_D128 = 192
P_E4M3_LOG2 = 8
# the denominator sums the E4M3-rounded P (the numerator's) at every head dim but 128, where it sums the unrounded P:
# the Hopper kernel sums it on the tensor cores beside P V at D = 64, 6 % less kernel time at CogVideoX-5B's and
# LTX-Video's shapes, and on the ALUs at D = 128, where the tensor-core sum measured 1 % slower
# (docs/hopper_kernel.md, "Measured")
SOFTMAX_SUMS_UNROUNDED_P_HEAD_DIMS = (128,)


def softmax_tile(head_dim: int) -> int:
    """Physical keys per tile of the FP8 P/V softmax's running maximum at this head dim (docs/numerics.md section 7)."""
    return SOFTMAX_TILE_D128 if head_dim == 128 else SOFTMAX_TILE


def softmax_sums_rounded_p(head_dim: int) -> bool:
    """Whether the FP8 P/V softmax's denominator sums the E4M3-rounded P at this head dim, else the unrounded P
    (docs/numerics.md section 7)."""
    return head_dim not in SOFTMAX_SUMS_UNROUNDED_P_HEAD_DIMS


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
