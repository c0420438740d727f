"""CPU checks of the one-launch Triton pre-pass (kernels/hopper_prepass_triton.py), run through
Triton's interpreter: bit-for-bit (BF16 bit patterns, signed zeros included) the values of
fp4vis.formats (nvfp4_qdq for Q and K in both layouts, mxfp4_qdq for V), on tie-heavy, Gaussian and
wide-range inputs (E4M3-saturating groups, which take the literal float64 MSE path), BF16 and FP16,
D = 64 and 128, with and without the anchor permutation, partial 32-token V blocks, Sq != Skv."""

import os
import subprocess
import sys

import pytest

_CHECK = r"""
import torch
from fp4vis.formats import mxfp4_qdq, nvfp4_qdq
from fp4vis.kernels.hopper_prepass import cached_anchor_permutation
from fp4vis.kernels import hopper_prepass_triton as tp

def mk(kind, shape, g, dtype):
    if kind == "ties":      # small integers times powers of two: many x == b * sc exactly
        x = torch.randint(-48, 49, shape, generator=g).float() * torch.exp2(
            torch.randint(-8, 4, shape[:-1] + (1,), generator=g).float())
    elif kind == "gauss":
        e = torch.randint(-12, 12, shape[:-1] + (1,), generator=g).float()
        x = torch.randn(*shape, generator=g) * torch.exp2(e)
    else:                   # per-element exponents over 44 binades: E4M3 underflow and saturation
        x = torch.randn(*shape, generator=g) * torch.exp2(torch.randint(-30, 14, shape, generator=g).float())
    return x.clamp(-60000, 60000).to(dtype)

g = torch.Generator().manual_seed(0)
bad = []
cases = [(dt, d, lay, kind, anchor) for dt in (torch.bfloat16, torch.float16) for d in (64, 128)
         for lay in ("folded64_mse", "block16") for kind, anchor in (("ties", 0), ("gauss", 32), ("wide", 32))]
cases += [(torch.bfloat16, d, "folded64_mse", "ties", a) for d in (64, 128) for a in (0, 128)]
for dtype, d, layout, kind, anchor in cases:
    b, h, sq, sk = 1, 2, 19, 45
    q, k, v = mk(kind, (b, h, sq, d), g, dtype), mk(kind, (b, h, sk, d), g, dtype), mk(kind, (b, h, sk, d), g, dtype)
    if kind == "wide" and dtype == torch.bfloat16:
        k[0, 0, 3, :5] = 3000.0   # a saturating group
        q[0, 1, 2] = -0.0
    perm = cached_anchor_permutation(sk, anchor, q.device, torch.int32) if anchor else None
    yq, yk, yv = tp.prepass(q, k, v, layout, perm)
    kk, vv = (k[:, :, perm.long()], v[:, :, perm.long()]) if anchor else (k, v)
    ref = (nvfp4_qdq(q, layout), nvfp4_qdq(kk, layout), mxfp4_qdq(vv, times_six=True))
    for name, a, r in zip("qkv", (yq, yk, yv), ref):
        n = int((a.view(torch.int16) != r.to(torch.bfloat16).view(torch.int16)).sum())
        if n:
            bad.append((str(dtype), d, layout, kind, anchor, name, n))
    if (dtype, d, layout, kind) == (torch.float16, 64, "folded64_mse", "gauss"):
        # the single-tensor entry points give the same values as the one-launch pre-pass
        assert torch.equal(tp.nvfp4_qdq(q, layout), yq)
        assert torch.equal(tp.nvfp4_qdq(k, layout, perm), yk)
        assert torch.equal(tp.mxfp4_v6(v, perm), yv)
print("BAD", bad)
print("OK" if not bad else "FAIL")
"""


def test_triton_prepass_bit_identical_to_formats_interpreted():
    pytest.importorskip("triton")
    env = dict(os.environ, TRITON_INTERPRET="1")
    res = subprocess.run([sys.executable, "-c", _CHECK], env=env, capture_output=True, text=True, timeout=600)
    assert res.returncode == 0 and "OK" in res.stdout, res.stdout[-4000:] + res.stderr[-4000:]
