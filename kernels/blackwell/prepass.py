"""Pre-pass of the Blackwell kernel: (B, H, S, D) q/k/v -> packed E2M1 codes + scales (the
operands ``kernel.direct_p_fwd`` reads; layouts in its docstring).

The numbers are fp4vis.formats' (the project's one statement of the quantizers, docs/numerics.md section 1):
NVFP4 Q/K through ``formats.nvfp4_chunked`` (block16, or folded-K64 with its MSE scale choice),
MXFP4 V through ``formats.mxfp4_blocks``; this module only re-lays their values and scales out:
codes packed two per byte along the MMA's reduction dim (D for Q/K, tokens for V), the folded
scale written twice (docs/numerics.md section 1: block i shares with i + nb/2, so the kernel sees one E4M3
scale per 16), V transposed to (D, tokens). For anchored policies K and V are first permuted so the
anchor samples sit at physical keys 0..n-1 (docs/numerics.md section 4, ``fp4vis.key_positions.anchor_permutation``).
The CPU tests check the decoded operands bit for bit against ``fp4vis.reference.quantize_operands``.

No host synchronisation (CUDA-graph capture, torch.compile): the public quantizers' NaN checks
sync, so they are not used; instead a head with any non-finite q, k or v element gets NaN V scales
(E8M0 0xFF), which makes the kernel's output for that head non-finite, and ``fp4vis.attention``
names the bad input (docs/numerics.md section 6).
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from fp4vis.formats import (
    E2M1_INDEX_OF_TWICE_MAG,
    mxfp4_blocks,
    mxfp4_scale_counts,
    nvfp4_chunked,
    nvfp4_scale_counts,
)
from fp4vis.settings import kernel_settings

from ..launch_shared import cached_anchor_permutation
from .config import E8M0_NAN, KEY_BLOCK

_CODE_TABLE: dict[torch.device, torch.Tensor] = {}


def _codes_of_values(vals: torch.Tensor) -> torch.Tensor:
    """uint8 E2M1 codes (sign bit 3, magnitude index bits 0-2) of values that ARE E2M1 values
    (the quantizers' output): a table look-up, no rounding. Non-finite entries (only from
    non-finite input, flagged separately) become 0."""
    table = _CODE_TABLE.get(vals.device)
    if table is None:
        table = _CODE_TABLE[vals.device] = E2M1_INDEX_OF_TWICE_MAG.to(vals.device)
    v = torch.where(torch.isfinite(vals), vals, torch.zeros_like(vals))
    index = table[(v.abs() * 2).to(torch.long)]
    return index | (torch.signbit(v).to(torch.uint8) << 3)


def _pack_last(codes: torch.Tensor) -> torch.Tensor:
    """Two codes per byte along the last dim, the even element in the low nibble (what
    tl.dot_scaled's "e2m1" operands and fp4vis.formats.pack_fp4 both use)."""
    return codes[..., 0::2] | (codes[..., 1::2] << 4)


def _count(counts: torch.Tensor, record: tuple | None, operand: int) -> None:
    """Add a ``*_scale_counts`` tensor to the range record (``kernels/scale_record.py``; Triton, imported only
    where a call records); the call's attention kernel decides on its underflows."""
    if record is not None and record[2]:
        from ..scale_record import add_counts
        add_counts(counts, record, operand)


def nvfp4_operand(x: torch.Tensor, layout: str, rows: int, record: tuple | None = None,
                  operand: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """(codes (G, rows, D/2) u8, scales (G, rows, D/16) float8_e4m3fn) of x (G, S, D), rows >= S
    (zero rows below). One E4M3 scale per 16 along D: a folded-K64 scale is written for both of
    its blocks. The scale range is counted into ``record`` as ``operand`` (0 q, 1 k) (``kernel_operands``)."""
    xf = x.to(torch.bfloat16).float()
    vals, scales = nvfp4_chunked(xf, layout)
    if record is not None:
        _count(nvfp4_scale_counts(xf, scales, layout), record, operand)
    if layout == "folded64_mse":
        scales = torch.cat((scales, scales), dim=-1)
    pad = rows - x.shape[-2]
    codes = _pack_last(_codes_of_values(vals))
    sc = scales.to(torch.float8_e4m3fn)  # E4M3 values already: exact
    if pad:
        codes = F.pad(codes, (0, 0, 0, pad))
        sc = F.pad(sc.view(torch.uint8), (0, 0, 0, pad)).view(torch.float8_e4m3fn)
    return codes.contiguous(), sc.contiguous()


def mxfp4_v_operand(v: torch.Tensor, keys: int, record: tuple | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(codes (G, D, keys/2) u8 packed along tokens, scales (G, D, keys/32) E8M0 u8) of V
    (G, S, D), keys a multiple of 32 >= S (zero tokens below: u = 0, code 0); its scale range counted
    into ``record`` as ``nvfp4_operand``'s."""
    if record is not None:
        _count(mxfp4_scale_counts(v), record, 2)
    vf = v.float()
    if keys > v.shape[-2]:
        vf = F.pad(vf, (0, 0, 0, keys - v.shape[-2]))
    vals, u = mxfp4_blocks(vf)                       # (G, nblk, 32, D), (G, nblk, D)
    codes = _codes_of_values(vals).flatten(-3, -2).transpose(-1, -2)   # (G, D, keys)
    return _pack_last(codes).contiguous(), u.transpose(-1, -2).contiguous()


@dataclass
class KernelOperands:
    """What ``kernel.direct_p_fwd`` reads (G = B*H heads), plus the sizes it needs."""

    qc: torch.Tensor
    qs: torch.Tensor
    kc: torch.Tensor
    ks: torch.Tensor
    vc: torch.Tensor
    vs: torch.Tensor
    seq_q: int
    rows_q: int     # Sq padded to whole BLOCK_M tiles
    keys: int       # Skv padded to whole BLOCK_N tiles
    num_keys: int


# the fused Triton pre-pass (prepass_kernels.py: the same bits) on CUDA tensors; 0 sends every call
# through the PyTorch statement below


def _fused_module(x: torch.Tensor, fused: bool | None):
    """prepass_kernels where the fused path runs: asked for (``fused``), or by default on CUDA tensors;
    CPU tensors only under Triton's interpreter (the CPU tests)."""
    if fused is False or (fused is None and not (kernel_settings().blackwell_prepass_fused and x.is_cuda)):
        return None
    if not x.is_cuda and os.environ.get("TRITON_INTERPRET") != "1":
        raise RuntimeError("fused pre-pass: CUDA tensors (or TRITON_INTERPRET=1) needed")
    from . import prepass_kernels
    return prepass_kernels


def kernel_operands(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, qk_layout: str, anchor: int,
                    block_m: int, block_n: int, fused: bool | None = None,
                    record: tuple | None = None) -> KernelOperands:
    """The operands of (B, H, S, D) q, k, v for a policy with Q/K layout ``qk_layout`` ("block16" or
    "folded64_mse") and ``anchor`` samples (0: none), tiles of block_m rows and block_n keys.
    ``fused``: the Triton pre-pass (default on CUDA tensors), else the PyTorch statement. ``record``: the
    range record's (fields, flag, call, score scale) that the blocks whose scale leaves its format are counted into
    (docs/numerics.md section 1, "Scale range"; ``kernels/scale_record.py``: ``recorded``), on either path; the
    call's attention kernel decides on the underflows (``scale_record.decide`` where none follows)."""
    q, k, v = q.flatten(0, 1), k.flatten(0, 1), v.flatten(0, 1)
    sq, skv = q.shape[-2], k.shape[-2]
    rows_q = -(-sq // block_m) * block_m
    keys = -(-skv // block_n) * block_n
    perm = cached_anchor_permutation(skv, anchor, k.device) if anchor > 0 else None
    tp = _fused_module(q, fused)
    if tp is not None:
        vc, vs = tp.mxfp4_v_operand(v, keys, perm, record)
        qc, qs = tp.nvfp4_operand(q, qk_layout, rows_q, None, record, 0)
        kc, ks = tp.nvfp4_operand(k, qk_layout, keys, perm, record, 1)
    else:
        kp, vp = (k.index_select(-2, perm), v.index_select(-2, perm)) if perm is not None else (k, v)
        qc, qs = nvfp4_operand(q, qk_layout, rows_q, record, 0)
        kc, ks = nvfp4_operand(kp, qk_layout, keys, record, 1)
        vc, vs = mxfp4_v_operand(vp, keys, record)
    # docs/numerics.md section 6 without a host sync: a head with a non-finite input gets NaN V scales
    bad = ~(torch.isfinite(q).flatten(1).all(1) & torch.isfinite(k).flatten(1).all(1)
            & torch.isfinite(v).flatten(1).all(1))
    vs = torch.where(bad[:, None, None], torch.full_like(vs, E8M0_NAN), vs)
    assert keys % KEY_BLOCK == 0
    return KernelOperands(qc, qs, kc, ks, vc, vs, sq, rows_q, keys, skv)


def decode_operands(ops: KernelOperands) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Float32 decoded (Q̂ (G, rows_q, D), K̂ (G, keys, D), 6·V̂ = α·c (G, keys, D)) of the packed
    operands: what the kernel's two products consume (for the tests and the self-check)."""
    from fp4vis.formats import e2m1_decode, e4m3_decode, e8m0_decode, unpack_fp4

    def nv(codes, scales):
        vals = e2m1_decode(unpack_fp4(codes))
        sc = e4m3_decode(scales.view(torch.uint8)).repeat_interleave(16, dim=-1)
        return vals * sc

    v = e2m1_decode(unpack_fp4(ops.vc)) * e8m0_decode(ops.vs).repeat_interleave(KEY_BLOCK, dim=-1)
    return nv(ops.qc, ops.qs), nv(ops.kc, ops.ks), v.transpose(-1, -2)
