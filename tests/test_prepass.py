"""CPU checks of the one-launch Triton pre-pass (kernels/hopper_prepass_triton.py), run through
Triton's interpreter: bit-for-bit (BF16 bit patterns, signed zeros included) the values of
fp4vis.formats (nvfp4_qdq for Q and K in both layouts, mxfp4_qdq for V), on tie-heavy, Gaussian and
wide-range inputs (E4M3-saturating groups, whose tiles take the float64 MSE branch), BF16 and FP16,
D = 64 and 128, with and without the anchor permutation, partial 32-token V blocks, Sq != Skv; and
the kernel's GPU build (sm_90 cubin, compiled without a GPU)."""

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


_CHECK_SATURATING = r"""
import torch
from fp4vis import formats as fm
from fp4vis.kernels import hopper_prepass_triton as tp

def wide_tie_rows(g, rows, dtype):
    # tests/test_formats.py::_wide_tie_groups with every folded group scaled by 2^e, e in 7..13:
    # two tie-prone values k/8 * 2^e among tiny ones, amax up to 6 * 2^13 (FP16-finite), so that
    # every 16-row tile holds saturating groups (base * 1.25 > 448) and huge ones (amax >= 48 * 448)
    x = torch.randn(rows, 4, 32, generator=g) * torch.exp2(torch.randint(-32, -24, (rows, 4, 32), generator=g).float())
    pos = torch.rand(rows, 4, 32, generator=g).argsort(-1)[..., :2]
    x.scatter_(-1, pos, torch.randint(-48, 49, (rows, 4, 2), generator=g).float() / 8)
    x = x * torch.exp2(torch.randint(7, 14, (rows, 4, 1), generator=g).float())
    # saturating groups with exact ties between distinct scales (448 vs 384, 384 vs 416)
    for r, (a, b) in enumerate(((2304.0, 2688.0), (1792.0, 2272.0))):
        x[r, 0] = 2.0 ** -19
        x[r, 0, 3], x[r, 0, 30] = a, -b
    x[2, 1, 7] = 60000.0   # a huge group far above the threshold
    return torch.cat((x[..., :16].flatten(-2), x[..., 16:].flatten(-2)), -1).to(dtype)

def exact_errs(xf):
    # (groups, 12) sum P (P - 2|x|) per candidate as fp4vis.formats computes it (exact unless huge)
    pair = torch.cat((xf[:, :64].unflatten(-1, (4, 16)), xf[:, 64:].unflatten(-1, (4, 16))), -1).flatten(0, 1)
    _, cands = fm._folded_mse_choice(pair)
    errs = torch.stack([(lambda p: (p * (p - 2 * pair.abs().double())).sum(-1))(
        (fm._codes_for_scale(pair, cands[:, i:i + 1]).abs() * cands[:, i:i + 1]).double())
        for i in range(12)], -1)
    return pair.abs().amax(-1), cands, errs

g = torch.Generator().manual_seed(0)
rows = 256
for dtype in (torch.bfloat16, torch.float16):
    x = wide_tie_rows(g, rows, dtype)
    xf = x.bfloat16().float()
    amax, cands, errs = exact_errs(xf)
    sat = amax / 6 * 1.25 > 448
    huge = amax >= 48 * cands.amax(-1)
    assert bool(sat.view(-1, 16 * 4).any(-1).all())   # every tile takes the saturating (float64) branch
    best = errs.min(-1, keepdim=True).values
    tied = ((errs == best) & (cands != cands.gather(-1, errs.argmin(-1, keepdim=True)))).any(-1) & ~huge
    n_sat_ties, n_ties, n_huge = int((tied & sat).sum()), int(tied.sum()), int(huge.sum())
    assert n_sat_ties >= 2 and n_ties >= 10 and n_huge >= 50, (n_sat_ties, n_ties, n_huge)
    xx = x.view(1, 1, rows, 128)
    ref = fm.nvfp4_qdq(xx, "folded64_mse").to(torch.bfloat16)
    y = tp.nvfp4_qdq(xx, "folded64_mse")
    n = int((y.view(torch.int16) != ref.view(torch.int16)).sum())
    print(dtype, "ties", n_ties, "saturating ties", n_sat_ties, "huge", n_huge, "differing values", n)
    assert n == 0, (str(dtype), n)
print("OK")
"""


def test_triton_prepass_saturating_tiles_bit_identical_interpreted():
    """Tiles with an E4M3-saturating folded group take the float64 MSE branch: exact ties between
    distinct scales (in saturating groups and in ordinary groups of those tiles) and huge groups are
    split as fp4vis.formats splits them, BF16 and FP16 inputs."""
    pytest.importorskip("triton")
    env = dict(os.environ, TRITON_INTERPRET="1")
    res = subprocess.run([sys.executable, "-c", _CHECK_SATURATING], env=env, capture_output=True, text=True,
                         timeout=600)
    assert res.returncode == 0 and "OK" in res.stdout, res.stdout[-4000:] + res.stderr[-4000:]


@pytest.mark.parametrize("folded,has_perm", [(True, True), (False, False)], ids=["folded-perm", "block16"])
def test_triton_prepass_compiles_for_sm90(folded, has_perm):
    """The pre-pass kernel compiles for sm_90 down to a cubin on a machine without a GPU (Triton's
    bundled ptxas): the interpreted tests check its arithmetic, this its GPU build."""
    triton = pytest.importorskip("triton")
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from fp4vis.kernels import hopper_prepass_triton as tpt

    sig = {name: "*bf16" for name in ("Q", "K", "V", "YQ", "YK", "YV")}
    sig.update(PERM="*i32", **{name: "i32" for name in ("NQ", "SQ", "NK", "SK", "TQ", "TK", "NVB")})
    consts = dict(D=128, FOLDED=folded, HAS_PERM=has_perm, BLOCK_R=tpt.BLOCK_R, BLOCK_D=64)
    sig.update({name: "constexpr" for name in consts})
    src = ASTSource(fn=tpt._prepass_kernel, signature=sig, constexprs=consts)
    compiled = triton.compile(src, target=GPUTarget("cuda", 90, 32),
                              options={"num_warps": tpt.NUM_WARPS, "enable_fp_fusion": False})
    assert compiled.asm.get("cubin")
