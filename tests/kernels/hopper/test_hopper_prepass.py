"""CPU checks of the one-launch Triton pre-pass (kernels/hopper/prepass_launch.py and its kernels), run through
Triton's interpreter: bit-for-bit (BF16 bit patterns, signed zeros included) the values of
fp4vis.formats (nvfp4_qdq for Q and K in both layouts, mxfp4_qdq for V), on tie-heavy, Gaussian and
wide-range inputs (E4M3-saturating groups, whose tiles take the float64 MSE branch), BF16 and FP16,
D = 64 and 128, with and without the anchor permutation, partial 32-token V blocks, Sq != Skv; and
the kernel's GPU build (sm_90 cubin, compiled without a GPU). The FP8 Q/K pre-pass
(``prepass_launch.fp8_prepass`` and ``prepass_torch.kernel_operands``) likewise: bit-equal to
fp4vis.formats.fp8_pow2_quantize, decoding to fp8_pow2_qdq, NaN for non-finite inputs."""

import importlib
import os
import subprocess
import sys

import pytest

_CHECK = r"""
import torch
from fp4vis.formats import mxfp4_qdq, nvfp4_qdq
from fp4vis.kernels.hopper.prepass import cached_anchor_permutation
from fp4vis.kernels.hopper import prepass_launch as tp

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
    # the BF16 cases search the contenders (the default), the FP16 ones every candidate
    yq, yk, yv = tp.prepass(q, k, v, layout, perm, full_search=dtype == torch.float16)
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


def _run_interpreted(script: str) -> None:
    """Run ``script`` in a fresh interpreter with TRITON_INTERPRET=1 (set before Triton is imported,
    as it must be) and require it to print OK."""
    pytest.importorskip("triton")
    env = dict(os.environ, TRITON_INTERPRET="1")
    res = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=600)
    assert res.returncode == 0 and "OK" in res.stdout, res.stdout[-4000:] + res.stderr[-4000:]


def test_triton_prepass_bit_identical_to_formats_interpreted():
    """The module docstring's cases; the BF16 ones with the folded-K64 scale search over the contenders
    (the default), the FP16 ones over every candidate (``full_search=True``)."""
    _run_interpreted(_CHECK)


_CHECK_SATURATING = r"""
import torch
from fp4vis import formats as fm
from fp4vis.kernels.hopper import prepass_launch as tp

def wide_tie_rows(g, rows, dtype):
    # tests/core/test_formats.py::_wide_tie_groups with every folded group scaled by 2^e, e in 7..13:
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
    _run_interpreted(_CHECK_SATURATING)


_CHECK_CONTENDERS = r"""
import torch
from fp4vis import formats as fm
from fp4vis.kernels.hopper import prepass_launch as tp

g = torch.Generator().manual_seed(5)

def rows(kind, n, d):
    if kind == "tiny":      # E4M3-subnormal candidate scales: m = 0.625 is a contender, and wins somewhere
        return torch.randn(n, d, generator=g) * torch.exp2(torch.randint(-12, -2, (n, 1), generator=g).float())
    if kind == "ties":      # small integers times powers of two: exact ties between candidates
        return torch.randint(-48, 49, (n, d), generator=g).float() * torch.exp2(
            torch.randint(-14, 4, (n, 1), generator=g).float())
    if kind == "grid":      # group maxima on E2M1 grid points of E4M3 scales, the rest below
        sc = fm.e4m3_decode(torch.randint(8, 0x70, (n, 1), generator=g, dtype=torch.int32).to(torch.uint8))
        x = torch.rand(n, d, generator=g) * 3 * sc
        x[:, ::16] = sc * torch.tensor(fm.E2M1_VALUES)[torch.randint(5, 8, (n, d // 16), generator=g)]
        return x
    if kind == "zero":
        return torch.zeros(n, d)
    return torch.randn(n, d, generator=g) * torch.exp2(torch.randint(-8, 8, (n, 1), generator=g).float())

def bits(t):
    return t.view(torch.int16)

# groups where m = 0.625 wins (about 1 in 2000 tiny Gaussian groups), found with fp4vis.formats
cand = rows("tiny", 20000, 32).bfloat16().float()
index, _ = fm._folded_mse_choice(cand)
wins_0625 = cand[index[:, 0] == fm.FOLDED_MSE_SUBNORMAL_CONTENDER]
assert len(wins_0625) >= 2, len(wins_0625)

picked_0625 = 0
for d in (128, 64):
    # 16-row tiles: tiny rows beside ordinary ones (the m = 0.625 branch taken for the tile), tiles
    # without tiny rows (not taken), zero rows, ties and grid maxima in both
    order = ["tiny", "gauss", "ties", "grid"] * 12 + ["gauss", "ties", "grid", "zero"] * 12 + ["tiny"] * 16
    x = torch.cat([rows(kind, 1, d) for kind in order])
    for i, grp in enumerate(wins_0625[:6]):     # one group j = 0 of row 16 i + 1 (columns 0..15, d/2..d/2 + 15)
        x[16 * i + 1, :16], x[16 * i + 1, d // 2:d // 2 + 16] = grp[:16], grp[16:]
    x = x.bfloat16().view(1, 1, -1, d)
    ref = fm.nvfp4_qdq(x, "folded64_mse").bfloat16()
    got = tp.nvfp4_qdq(x, "folded64_mse")
    full = tp.nvfp4_qdq(x, "folded64_mse", full_search=True)
    assert torch.equal(bits(got), bits(ref)), (d, int((bits(got) != bits(ref)).sum()))
    assert torch.equal(bits(full), bits(ref)), (d, int((bits(full) != bits(ref)).sum()))
    xf = x.float().view(-1, d)
    pair = torch.cat((xf[:, :d // 2].unflatten(-1, (-1, 16)), xf[:, d // 2:].unflatten(-1, (-1, 16))), -1)
    index, _ = fm._folded_mse_choice(pair)
    picked_0625 += int((index == fm.FOLDED_MSE_SUBNORMAL_CONTENDER).sum())
assert picked_0625 > 0, picked_0625

# non-finite values: NaN exactly there; rows without one equal fp4vis.formats; an Inf row's tile takes
# the saturating branch
x = torch.randn(1, 1, 32, 128, generator=g).bfloat16()
x[0, 0, 3, 7], x[0, 0, 9, 70], x[0, 0, 20, 0] = float("nan"), float("inf"), -float("inf")
got = tp.nvfp4_qdq(x, "folded64_mse")
assert torch.equal(torch.isnan(got), ~torch.isfinite(x))
ok = torch.isfinite(x).all(-1)
ref = fm.nvfp4_qdq(torch.where(torch.isfinite(x), x, 0), "folded64_mse").bfloat16()
assert torch.equal(bits(got)[ok], bits(ref)[ok])
print("OK")
"""


def test_triton_prepass_contender_search_bit_identical_interpreted():
    """The folded-K64 contender search (the default) gives fp4vis.formats' bits, as the full search does
    (FP4VIS_PREPASS_FULL_SEARCH=1), in tiles that take the m = 0.625 contender (E4M3-subnormal scales
    beside ordinary rows; it wins in some groups) and tiles that do not, with exact ties, group maxima on
    E2M1 grid points, zero rows, D = 128 and 64; non-finite values give NaN there and leave other rows
    as they are."""
    _run_interpreted(_CHECK_CONTENDERS)


def _compile_sm90(fn, signature: dict, constexprs: dict, num_warps: int | None = None,
                  max_registers: int | None = None) -> dict:
    """``compile_check.compile_triton_sm90`` (the GPU build, without a GPU); its asm."""
    pytest.importorskip("triton")
    from fp4vis.kernels.hopper import compile_check
    from fp4vis.kernels.hopper import prepass_launch as tpt

    return compile_check.compile_triton_sm90(fn, signature, constexprs, num_warps or tpt.NUM_WARPS, max_registers)


@pytest.mark.parametrize("folded,has_perm,f16,d", [(True, True, True, 128), (True, False, False, 128),
                                                   (False, False, True, 128), (True, False, True, 64)],
                         ids=["folded-perm-f16", "folded-f32", "block16-f16", "folded-d64-f16"])
def test_triton_prepass_compiles_for_sm90(folded, has_perm, f16, d):
    """The pre-pass kernel compiles for sm_90 down to a cubin on a machine without a GPU (Triton's
    bundled ptxas): the interpreted tests check its arithmetic, this its GPU build. With F16 the codes
    are made on FP16 pairs (HMNMX2/HADD2 in the SASS), without it in float32 (none)."""
    pytest.importorskip("triton")
    from fp4vis.kernels.hopper import prepass_kernels as tk
    from fp4vis.kernels.hopper import prepass_launch as tpt

    rows, warps, cap = tpt.nvfp4_launch(d)
    consts = dict(D=d, FOLDED=folded, HAS_PERM=has_perm, BLOCK_R=rows, BLOCK_D=64, CODES_F16=f16,
                  NORM=False, ROPE=False, FULL_SEARCH=not f16, ROW_ALIGN=8)
    cubin = _compile_sm90(tk.prepass_kernel, tk.compile_signature(False), consts, warps, cap).get("cubin")
    assert cubin
    sass = importlib.import_module("fp4vis.kernels.hopper.compile_check").sass_text(cubin)
    assert ("HMNMX2" in sass) == f16 and ("F2FP.F16.F32.PACK_AB" in sass) == f16


def test_contender_search_and_fp16_pair_codes_shorten_the_search():
    """The sm_90 build's scale search per value (``python -m fp4vis.kernels.compile_check --triton-prepass``):
    the contenders take less than half the full search's instructions, and the FP16-pair codes fewer
    than the float32 form (with Triton 3.8 at D = 128: 51.2 against 125.8, and 69.1 in float32)."""
    pytest.importorskip("triton")
    from fp4vis.kernels.hopper.compile_check import prepass_search_per_value

    contenders = prepass_search_per_value(128, True)["per_value"]
    assert 2 * contenders < prepass_search_per_value(128, True, full_search=True)["per_value"]
    assert contenders < prepass_search_per_value(128, False)["per_value"]


def _e2m1_codes_f16_emulated(t):
    """``triton_formats.e2m1_magnitude_f16`` step by step in PyTorch (float32 t >= 0): the FP16 conversion
    (round to nearest even), p = min(p, 6) (NaN-ignoring, as PTX min), k = max(p, 1), then the two FP16
    FMAs s = k * 512 + p and s - k * 512, each rounded once (the exact values have at most 22
    significant bits: exact in float32, then one rounding to FP16)."""
    import torch

    p = torch.fmin(t.to(torch.float16), torch.tensor(6.0, dtype=torch.float16))
    k = torch.fmax(p, torch.tensor(1.0, dtype=torch.float16))
    s = (k.float() * 512 + p.float()).to(torch.float16)
    return (s.float() - k.float() * 512).to(torch.float16).float()


def test_e2m1_code_on_fp16_pairs_exhaustive():
    """The FP16-pair E2M1 code of the NVFP4 pre-pass (``triton_formats.e2m1_magnitude_f16``, GPU only: Triton's
    interpreter cannot run inline PTX) is the exact E2M1 rounding of x / sc for every positive BF16 magnitude x
    against every E4M3 scale sc (and sc = 0 gives 0): t = x * rcp(sc) in float32 as the kernel forms
    it, its FP16 steps emulated, the reference rounding the float64 quotient (exact: BF16 / E4M3 is
    either an E2M1 midpoint or far from one). So is the float32 form (snap to 2^-12, then the grid).
    The GPU bit check (benchmarks/prepass_bench.py) checks the PTX itself against fp4vis.formats."""
    import torch

    from fp4vis.formats import e2m1_round

    x = torch.arange(0, 0x7F80, dtype=torch.int32).to(torch.int16).view(torch.bfloat16).float()   # +0 .. max
    sc = torch.arange(0, 0x7F, dtype=torch.int32).to(torch.uint8).view(torch.float8_e4m3fn).float()  # 0 .. 448
    xs, scs = torch.meshgrid(x, sc, indexing="ij")
    r = torch.where(scs == 0, 0.0, 1.0 / torch.where(scs == 0, 1.0, scs))       # correctly rounded in float32
    t = xs * r
    exact = torch.where(scs == 0, 0.0, e2m1_round(xs.double() / torch.where(scs == 0, 1.0, scs).double()).float())
    f16 = _e2m1_codes_f16_emulated(t)
    snapped = (t + 2048.0) - 2048.0
    f32 = e2m1_round(snapped)
    assert torch.equal(f16, exact), int((f16 != exact).sum())
    assert torch.equal(f32, exact), int((f32 != exact).sum())
    # on the GPU rcp(sc) is rcp.approx (within 1 ulp: ``test_rcp_approx_on_every_e4m3_scale_on_gpu``), so t
    # lies within 2^-22 of x / sc, not 2^-23: both ends of that interval give the exact code, and every
    # float32 t between them converts to one of the two FP16 values the ends convert to (the conversion is
    # monotonic and the interval far narrower than an FP16 ulp), so every t in it does
    q = xs.double() / torch.where(scs == 0, 1.0, scs).double()
    for side in (1 - 2.0 ** -22, 1 + 2.0 ** -22):
        t_end = torch.where(scs == 0, 0.0, (q * side).float())
        assert torch.equal(_e2m1_codes_f16_emulated(t_end), exact)
    # the FMAs' grid is not exact for every FP16 value: just below 2 and 4 the sum leaves its binade
    near = torch.tensor([2.0 - 2.0 ** -10, 4.0 - 2.0 ** -9])
    assert _e2m1_codes_f16_emulated(near).tolist() == [1.5, 3.0]
    # the ties are there: x / sc exactly on an E2M1 midpoint (about one per scale and midpoint)
    mids = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0], dtype=torch.float64)
    assert int(torch.isin(xs.double() / torch.where(scs == 0, 1.0, scs).double(), mids).sum()) > 800


_FP8_COMMON = r"""
import torch
from fp4vis.formats import fp8_pow2_qdq, fp8_pow2_quantize, mxfp4_qdq
from fp4vis.kernels.hopper import prepass_torch
from fp4vis.kernels.hopper.prepass import cached_anchor_permutation
from fp4vis.kernels.hopper.prepass_launch import fp8_prepass

def physical(x, anchor):
    # keys in the physical order the K groups and V blocks follow
    return x[:, :, cached_anchor_permutation(x.shape[-2], anchor, x.device)] if anchor else x

def from_physical(x, anchor):
    # the logical tensor whose physical order is x
    if not anchor:
        return x
    out = torch.empty_like(x)
    out[:, :, cached_anchor_permutation(x.shape[-2], anchor, x.device)] = x
    return out

def bits(t):
    # bit patterns (scales as they are): signed zeros and NaN codes count
    if t.dtype == torch.float8_e4m3fn:
        return t.view(torch.uint8)
    return t.view(torch.int16) if t.dtype == torch.bfloat16 else t

def e4m3_bytes(vals):
    return vals.to(torch.float8_e4m3fn).view(torch.uint8)

def both_paths(q, k, v, anchor):
    # (fused Triton pre-pass, interpreted; PyTorch statement), shapes, dtypes and layout checked
    perm = cached_anchor_permutation(k.shape[-2], anchor, k.device, torch.int32) if anchor else None
    fused = fp8_prepass(q, k, v, perm)
    plain = tuple(prepass_torch.kernel_operands(q, k, v, "fp8_e4m3", anchor))[:5]   # no key counts: unmasked
    b, h, sq, d = q.shape
    skv = k.shape[-2]
    shapes = ((b, h, sq, d), (b, h, skv, d), (b, h, skv, d), (b, h, sq), (b, h, 4 * -(-skv // 128)))
    dtypes = (torch.float8_e4m3fn,) * 2 + (torch.bfloat16,) + (torch.float32,) * 2
    for out in (fused, plain):
        for t, shape, dtype in zip(out, shapes, dtypes):
            assert t.shape == shape and t.dtype == dtype and t.is_contiguous(), (t.shape, t.dtype)
    return fused, plain
"""

_CHECK_FP8 = _FP8_COMMON + r"""
def mk(shape, group_rows, dtype, g):
    # rows grouped as the pre-pass groups them: every group scaled by its own power of two (BF16:
    # 2^-20..2^20, FP16 within its range) around 8-significant-bit integers (RNE ties, carries into
    # the next binade: 255 -> 256) with per-element exponents over 14 binades (E4M3 subnormals and
    # underflow to +-0 within a group); the first group all zero, the second tiny (float32
    # subnormals for BF16, FP16 subnormals)
    x = torch.randint(-255, 256, shape, generator=g).float()
    x = x * torch.exp2(-torch.randint(0, 14, shape, generator=g).float())
    lo, hi, tiny = (-20, 20, -136) if dtype == torch.bfloat16 else (-16, 8, -24)
    rows = shape[-2]
    group_exp = torch.randint(lo, hi + 1, shape[:-2] + (-(-rows // group_rows),), generator=g).float()
    group_exp[..., 1] = tiny
    x = x * torch.exp2(group_exp.repeat_interleave(group_rows, -1)[..., :rows, None])
    x[..., :group_rows, :] = 0.0
    return x.to(dtype)

g = torch.Generator().manual_seed(0)
n = 0
for dtype in (torch.bfloat16, torch.float16):
    for d in (64, 128):
        for anchor in (0, 32):
            for sq, skv in ((19, 77), (40, 160)):
                q = mk((2, 2, sq, d), 1, dtype, g)
                kk, vv = mk((2, 2, skv, d), 32, dtype, g), mk((2, 2, skv, d), 32, dtype, g)   # physical
                fused, plain = both_paths(q, from_physical(kk, anchor), from_physical(vv, anchor), anchor)
                for a, b in zip(fused, plain):
                    assert torch.equal(bits(a), bits(b))
                q8, k8, v6, q_scale, k_scale = fused
                # the format's statement, bit for bit
                qv, qs = fp8_pow2_quantize(q, 1)
                kv, ks = fp8_pow2_quantize(kk, 32)
                nb = ks.shape[-2]
                assert torch.equal(q8.view(torch.uint8), e4m3_bytes(qv))
                assert torch.equal(k8.view(torch.uint8), e4m3_bytes(kv))
                assert torch.equal(q_scale, qs.squeeze(-1)) and torch.equal(k_scale[..., :nb], ks.squeeze(-1))
                assert bool((k_scale[..., nb:] == 1.0).all()) and k_scale.shape[-1] - nb in (1, 3)
                assert torch.equal(bits(v6), bits(mxfp4_qdq(vv, times_six=True).to(torch.bfloat16)))
                # decoding gives the format's quantize-dequantize
                assert torch.equal(q8.float() * q_scale[..., None], fp8_pow2_qdq(q, 1))
                k_dec = k8.float() * k_scale[..., :nb].repeat_interleave(32, -1)[..., :skv, None]
                assert torch.equal(k_dec, fp8_pow2_qdq(kk, 32))
                # the inputs reached what they are meant to exercise
                assert bool((q8[..., 0, :].float() == 0).all()) and bool((k8[..., :32, :].float() == 0).all())
                assert dtype == torch.float16 or bool((q_scale[..., 1] == 2.0 ** -126).all())
                assert bool((q8.view(torch.uint8) & 0x78 == 0).any())   # E4M3 subnormals
                assert bool((k8.view(torch.uint8) == 0x78).any())       # 256: a carry into the top binade
                assert bool((v6[..., 32:64, :] != 0).any())            # a tiny V block (u = 0) keeps codes
                n += 1
print("cases", n)
print("OK")
"""


def test_fp8_prepass_fused_torch_and_formats_bit_identical_interpreted():
    """The FP8 pre-pass: the fused Triton path (interpreted) == the PyTorch statement ==
    fp8_pow2_quantize bit for bit (E4M3 bytes, scales, V's BF16 bits), decoding to fp8_pow2_qdq:
    BF16 and FP16, D = 64 and 128, with and without the anchor permutation, Sq != Skv, Skv = 77
    (partial last 32-key block, scales padded with 1.0) and 160, groups scaled over 2^+-20, an
    all-zero row and block, tiny (subnormal) groups, RNE ties and carries into the top binade."""
    _run_interpreted(_CHECK_FP8)


_CHECK_FP8_NON_FINITE = _FP8_COMMON + r"""
g = torch.Generator().manual_seed(1)
b, h, sq, skv, d = 1, 2, 21, 77, 64
for anchor in (0, 32):
    q, k, v = (torch.randn(b, h, s, d, generator=g).bfloat16() for s in (sq, skv, skv))
    q[0, 1, 4, 7], q[0, 0, 2, 3] = float("nan"), -float("inf")
    k[0, 1, 10, 5], k[0, 0, 50, 0], k[0, 0, 51, 1] = float("inf"), -float("nan"), float("nan")
    v[0, 0, 7, 2] = float("nan")
    kk, vv = physical(k, anchor), physical(v, anchor)
    qv, qs = fp8_pow2_quantize(q, 1)
    kv, ks = fp8_pow2_quantize(kk, 32)
    nb = ks.shape[-2]
    row_ok = torch.isfinite(q).all(-1)
    key_pad = torch.nn.functional.pad(torch.isfinite(kk), (0, 0, 0, 32 * nb - skv), value=True)
    blk_ok = key_pad.unflatten(-2, (nb, 32)).all(-1).all(-1)
    key_ok = blk_ok.repeat_interleave(32, -1)[..., :skv]
    assert not bool(row_ok.all()) and not bool(blk_ok.all())
    for q8, k8, v6, q_scale, k_scale in both_paths(q, k, v, anchor):
        # NaN exactly where the input is NaN or Inf (after the permutation), never a finite code
        assert torch.equal(torch.isnan(q8.float()), ~torch.isfinite(q))
        assert torch.equal(torch.isnan(k8.float()), ~torch.isfinite(kk))
        assert torch.equal(torch.isnan(v6), ~torch.isfinite(vv))
        # rows and key blocks without a non-finite value are untouched
        assert torch.equal(q8.view(torch.uint8)[row_ok], e4m3_bytes(qv)[row_ok])
        assert torch.equal(q_scale[row_ok], qs.squeeze(-1)[row_ok])
        assert torch.equal(k8.view(torch.uint8)[key_ok], e4m3_bytes(kv)[key_ok])
        assert torch.equal(k_scale[..., :nb][blk_ok], ks.squeeze(-1)[blk_ok])
print("OK")
"""


def test_fp8_prepass_non_finite_inputs_give_nan_interpreted():
    """NaN or Inf in q or k gives NaN in q8 / k8 exactly there (after the anchor permutation) on both
    paths (E4M3 has NaN; saturating to a finite code would hide the input's fault), V's NaN as in
    the NVFP4 pre-pass, and every row / key block without a non-finite value is unchanged (the rest of
    a non-finite group is unspecified, and the paths differ there)."""
    _run_interpreted(_CHECK_FP8_NON_FINITE)


_CHECK_QK_TRANSFORM = r"""
import numpy as np
import torch
from fp4vis.qk_transform import QKTransform, apply_rotary_emb
from fp4vis.kernels.hopper import prepass_launch as tp
from fp4vis.kernels.hopper.prepass import cached_anchor_permutation

def rstd_torch_order(x, eps, threads=tp.RMS_THREADS):
    # torch's vectorized CUDA rms_norm sum order (prepass_kernels._rms_rstd_rows), written in PyTorch
    t, n = x.shape
    chunk = 4 * threads
    nchunk = -(-n // chunk)
    xf = torch.nn.functional.pad(x.float(), (0, nchunk * chunk - n)).view(t, nchunk, threads, 4)
    acc = torch.zeros(t, threads)
    for j in range(nchunk):
        for ii in range(4):
            acc = acc + xf[:, j, :, ii] * xf[:, j, :, ii]
    lanes = acc.view(t, threads // 32, 32)
    for half in (16, 8, 4, 2, 1):
        lanes = lanes[..., :half] + lanes[..., half:2 * half]
    warps = lanes[..., 0]
    while warps.shape[1] > 1:
        half = warps.shape[1] // 2
        warps = warps[:, :half] + warps[:, half:]
    # float32 division, + eps, sqrt and 1 / sqrt, each correctly rounded (as numpy, and Triton's
    # interpreter, compute rsqrt; the GPU's rsqrt.approx is the GPU test's business)
    mean = (warps[:, 0] / float(n)).numpy()
    return torch.from_numpy(np.float32(1) / np.sqrt(mean + np.float32(eps)))

def normed(x, r, w):
    return ((x.float() * r[:, None]) * w.float()).bfloat16()

def bits(t):
    return t.view({1: torch.uint8, 2: torch.int16, 4: torch.int32}[t.element_size()])

g = torch.Generator().manual_seed(3)
n_cases = 0
for h, d, sq, sk, rope_dtype, anchor in ((3, 64, 37, 37, torch.float32, 0), (5, 128, 19, 19, torch.bfloat16, 16),
                                        (2, 64, 21, 45, None, 0)):
    b = 2 if rope_dtype is None else 1
    qp = (torch.randn(b, sq, h * d, generator=g) * 3).bfloat16()
    kscale = torch.exp2(torch.randint(-6, 6, (b, sk, 1), generator=g).float())
    kp = (torch.randn(b, sk, h * d, generator=g) * kscale).bfloat16()
    vp = torch.randn(b, sk, h * d, generator=g).bfloat16()
    qp[-1, 3] = 0.0                                          # a zero token: rstd = 1 / sqrt(eps)
    wq, wk = ((1 + 0.3 * torch.randn(h * d, generator=g)).bfloat16() for _ in range(2))
    rope = None
    if rope_dtype is not None:
        ang = torch.randn(1, sq, 1, d, generator=g) * 4
        rope = (ang.cos().to(rope_dtype), ang.sin().to(rope_dtype))
    tr = QKTransform(wq, wk, 1e-6, 1e-5, rope)
    q, k, v = (t.view(b, t.shape[1], h, d).transpose(1, 2) for t in (qp, kp, vp))   # (B, H, S, D) views
    assert tp.fusable_transform(q, k, tr) is None
    rq, rk = tp.rms_rstd(q, k, 1e-6, 1e-5)
    assert torch.equal(bits(rq), bits(rstd_torch_order(qp.view(-1, h * d), 1e-6)))
    assert torch.equal(bits(rk), bits(rstd_torch_order(kp.view(-1, h * d), 1e-5)))
    # the normed and rotated q, k the fused path must see (PyTorch, the same rstd)
    qn = normed(qp.view(-1, h * d), rq, wq).view(b, sq, h, d)
    kn = normed(kp.view(-1, h * d), rk, wk).view(b, sk, h, d)
    if rope is not None:
        qn, kn = apply_rotary_emb(qn, *rope), apply_rotary_emb(kn, *rope)
    qn, kn = qn.transpose(1, 2).contiguous(), kn.transpose(1, 2).contiguous()
    vc = v.contiguous()
    perm = cached_anchor_permutation(sk, anchor, q.device, torch.int32) if anchor else None
    for layout in ("folded64_mse", "block16"):
        fused = tp.prepass(q, k, v, layout, perm, qk=tr)
        plain = tp.prepass(qn, kn, vc, layout, perm)
        for a, c in zip(fused, plain):
            assert torch.equal(bits(a), bits(c)), (h, d, layout)
        n_cases += 1
    fused = tp.fp8_prepass(q, k, v, perm, qk=tr)
    plain = tp.fp8_prepass(qn, kn, vc, perm)
    for a, c in zip(fused, plain):
        assert torch.equal(bits(a), bits(c)), (h, d, "fp8")
    n_cases += 1
# the dispatch (prepass.kernel_operands): a transform the pre-pass cannot fold (float32 weights) is applied in
# PyTorch first, a foldable one is folded; both give the operands of the made q and k
from fp4vis.call import AttentionCall
from fp4vis.settings import kernel_settings
from fp4vis.kernels.hopper.prepass import kernel_operands
from fp4vis.policy import POLICIES
tr32 = QKTransform(wq.float(), wk.float(), 1e-6, 1e-5, None)
assert tp.fusable_transform(q, k, tr32) is not None
pol = POLICIES["accurate"]
params = pol.kernel_params(d, 0.1)
assert params.qk_layout == "block16"
qa, ka = tr32.apply(q, k, "bhsd")
for t, (qm, km) in ((tr32, (qa, ka)), (tr, (qn, kn))):
    got = kernel_operands(AttentionCall(q, k, v, pol, 0.1, t), params, kernel_settings())
    ref = kernel_operands(AttentionCall(qm, km, v, pol, 0.1), params, kernel_settings())
    assert all(a is None and c is None or torch.equal(bits(a), bits(c)) for a, c in zip(got, ref))
    n_cases += 1
# timm's fused qkv projection, (B, N, 3, H, D) permuted to three (B, H, N, D) views: read in place
qkv = torch.randn(2, 19, 3, 2, 64, generator=g).bfloat16().permute(2, 0, 3, 1, 4)
for fused, plain in ((tp.prepass(*qkv, "block16"), tp.prepass(*(t.contiguous() for t in qkv), "block16")),
                     (tp.fp8_prepass(*qkv), tp.fp8_prepass(*(t.contiguous() for t in qkv)))):
    assert all(torch.equal(bits(a), bits(c)) for a, c in zip(fused, plain))
    n_cases += 1
# the values of QKTransform.apply (the unfused path) are diffusers' arithmetic on the CPU too
layer = torch.nn.RMSNorm(h * d, eps=1e-6)
assert torch.equal(QKTransform(wq, wk, 1e-6, 1e-6).apply_one(q.transpose(1, 2), wq, 1e-6),
                   torch.nn.functional.rms_norm(qp, (h * d,), wq, 1e-6).view(b, sq, h, d))
print("cases", n_cases)
print("OK")
"""


def test_qk_transform_folded_into_prepass_bit_identical_interpreted():
    """The q/k transform folded into the pre-pass (raw (B, S, H*D) projections read through
    (B, H, S, D) views, RMS norm, rotary embedding, quantization in one pass, plus the rstd launch):
    the rstd is torch's CUDA rms_norm sum order written out in PyTorch, bit for bit; the NVFP4 (both
    layouts) and FP8 operands and MXFP4 V equal today's pre-pass fed with the normed and rotated values
    (float32 and BF16 rotary tables, the anchor permutation, a zero token, Sq != Skv without rotary
    embedding, strided V); a transform the pre-pass cannot fold is applied first; timm's permuted qkv
    views are read in place. The GPU test checks the same against torch's own rms_norm."""
    _run_interpreted(_CHECK_QK_TRANSFORM)


@pytest.mark.parametrize("rope_dtype", ["fp32", "bf16"])
def test_qk_transform_kernels_compile_for_sm90(rope_dtype):
    """The pre-pass kernels with the q/k transform folded in (NORM, ROPE; float32 or BF16 rotary tables)
    and the rstd launch compile for sm_90 to a cubin without a GPU."""
    pytest.importorskip("triton")
    from fp4vis.kernels.hopper import prepass_kernels as tk
    from fp4vis.kernels.hopper import prepass_launch as tpt

    rows, warps, cap = tpt.nvfp4_launch(128)
    consts = dict(D=128, FOLDED=True, HAS_PERM=False, BLOCK_R=rows, BLOCK_D=64, CODES_F16=True, NORM=True,
                  ROPE=True, FULL_SEARCH=False, ROW_ALIGN=8)
    assert _compile_sm90(tk.prepass_kernel, tk.compile_signature(False, rope_dtype=rope_dtype), consts,
                         warps, cap).get("cubin")
    consts = dict(D=128, HAS_PERM=False, BLOCK_Q=tpt.FP8_BLOCK_Q, BLOCK_D=64, NORM=True, ROPE=True, ROW_ALIGN=8)
    assert _compile_sm90(tk.fp8_prepass_kernel, tk.compile_signature(True, rope_dtype=rope_dtype), consts).get(
        "cubin")
    sig = dict(XQ="*bf16", XK="*bf16", RQ="*fp32", RK="*fp32", eps_q="fp32", eps_k="fp32",
               **dict.fromkeys(("NQT", "NKT", "TQ", "SQ", "SK", "QSB", "QSS", "KSB", "KSS", "N"), "i32"))
    consts = dict(BLOCK_T=tpt.RMS_BLOCK_T, THREADS=tpt.RMS_THREADS, NCHUNK=3, ROW_ALIGN=8)
    assert _compile_sm90(tk.rms_rstd_kernel, sig, consts).get("cubin")


@pytest.mark.parametrize("fp8", [False, True], ids=["nvfp4", "fp8"])
def test_prepass_loads_rows_as_vectors(fp8):
    """With ROW_ALIGN (every stride a multiple of 8 values, as a Wan projection's, timm's qkv and
    contiguous tensors are) the sm_90 build loads q, k, v, the norm weights and the rotary tables in
    16-byte vectors, the transform folded in or not: the rotary pairs are split in registers, not
    gathered. Without the hint (strides are runtime integers) every BF16 value is a scalar load."""
    pytest.importorskip("triton")
    from fp4vis.kernels.hopper import prepass_kernels as tk
    from fp4vis.kernels.hopper import prepass_launch as tpt
    from fp4vis.kernels.hopper.compile_check import global_loads

    fn = tk.fp8_prepass_kernel if fp8 else tk.prepass_kernel
    base = (dict(D=128, HAS_PERM=False, BLOCK_Q=tpt.FP8_BLOCK_Q, BLOCK_D=64) if fp8 else
            dict(D=128, FOLDED=True, HAS_PERM=False, BLOCK_R=tpt.nvfp4_launch(128)[0], BLOCK_D=64, CODES_F16=True,
                 FULL_SEARCH=False))
    warps = tpt.default_warps(128) if fp8 else tpt.nvfp4_launch(128)[1]
    for fold in (False, True):
        loads = {align: global_loads(_compile_sm90(fn, tk.compile_signature(fp8), dict(
            base, NORM=fold, ROPE=fold, ROW_ALIGN=align), warps).get("ptx")) for align in (1, 8)}
        assert loads[1].get("ld.global.b16", 0) >= 32, loads[1]         # value by value
        assert loads[8].get("ld.global.b16", 0) <= 1, loads[8]          # (one 128-value weight row)
        assert loads[8].get("ld.global.v4.b32", 0) > 0, loads[8]


@pytest.mark.parametrize("dtype,has_perm,d", [("bf16", True, 128), ("fp16", False, 128), ("bf16", False, 64)],
                         ids=["bf16-perm", "fp16", "bf16-d64"])
def test_fp8_prepass_compiles_for_sm90(dtype, has_perm, d):
    """The FP8 pre-pass kernel (E4M3 bytes through float8e4nv, scales, MXFP4 V) compiles for sm_90
    to a cubin without a GPU, from BF16 and FP16 inputs, with the launch's warps for D."""
    pytest.importorskip("triton")
    from fp4vis.kernels.hopper import prepass_kernels as tk
    from fp4vis.kernels.hopper import prepass_launch as tpt

    consts = dict(D=d, HAS_PERM=has_perm, BLOCK_Q=tpt.FP8_BLOCK_Q, BLOCK_D=64, NORM=False, ROPE=False, ROW_ALIGN=8)
    assert _compile_sm90(tk.fp8_prepass_kernel, tk.compile_signature(True, dtype), consts,
                         tpt.default_warps(d), tpt.FP8_MAX_REGISTERS[d]).get("cubin")


@pytest.mark.gpu
def test_rcp_approx_on_every_e4m3_scale_on_gpu():
    """The pre-pass's reciprocal on the GPU (``triton_formats.scale_reciprocal(sc, APPROX=True)``:
    ``rcp.approx.ftz.f32``) is within 1 ulp (2^-23 relative) of 1 / sc for every E4M3 scale (sc takes no other
    value), and 0 for sc = 0: the bound the exhaustive code test assumes."""
    import torch
    import triton
    import triton.language as tl

    from fp4vis.kernels import triton_formats as tf

    @triton.jit
    def rcp_kernel(X, Y, N: tl.constexpr):
        i = tl.arange(0, N)
        tl.store(Y + i, tf.scale_reciprocal(tl.load(X + i), True))

    sc = torch.arange(0, 128, dtype=torch.int32).to(torch.uint8).view(torch.float8_e4m3fn).float().cuda()
    sc = torch.where(torch.isnan(sc), 0.0, sc)          # 0x7F is NaN: not a scale
    r = torch.empty_like(sc)
    rcp_kernel[(1,)](sc, r, 128)
    exact = 1.0 / sc[sc > 0].double()
    assert bool((r[sc == 0] == 0).all())
    rel = ((r[sc > 0].double() - exact) / exact).abs()
    assert float(rel.max()) <= 2.0 ** -23, float(rel.max())


@pytest.mark.gpu
@pytest.mark.parametrize("d", [128, 64])
def test_fp16_pair_codes_bit_identical_on_gpu(d):
    """On the GPU the NVFP4 pre-pass's E2M1 codes on FP16 pairs (the inline PTX, the default) give the
    bits of the float32 form and of fp4vis.formats: both layouts, tie-heavy, Gaussian and wide-range
    inputs (E4M3-saturating tiles too), BF16 and FP16, the anchor permutation, partial V blocks."""
    import torch

    from fp4vis.formats import mxfp4_qdq, nvfp4_qdq
    from fp4vis.kernels.hopper import prepass_launch as tp
    from fp4vis.kernels.hopper.prepass import cached_anchor_permutation

    g = torch.Generator(device="cuda").manual_seed(0)

    def mk(kind, shape, dtype):
        x = torch.randn(*shape, generator=g, device="cuda")
        if kind == "ties":
            x = torch.randint(-48, 49, shape, generator=g, device="cuda").float() * torch.exp2(
                torch.randint(-8, 4, shape[:-1] + (1,), generator=g, device="cuda").float())
        elif kind == "wide":
            x = x * torch.exp2(torch.randint(-30, 14, shape, generator=g, device="cuda").float())
        return x.clamp(-60000, 60000).to(dtype)

    for dtype in (torch.bfloat16, torch.float16):
        for layout in ("folded64_mse", "block16"):
            for kind, anchor in (("ties", 0), ("gauss", 32), ("wide", 32)):
                b, h, sq, sk = 2, 3, 77, 301
                q, k, v = (mk(kind, (b, h, s, d), dtype) for s in (sq, sk, sk))
                perm = cached_anchor_permutation(sk, anchor, q.device, torch.int32) if anchor else None
                f16 = tp.prepass(q, k, v, layout, perm, f16_codes=True)
                f32 = tp.prepass(q, k, v, layout, perm, f16_codes=False)
                kk = k[:, :, perm.long()] if anchor else k
                ref = (nvfp4_qdq(q, layout).to(torch.bfloat16), nvfp4_qdq(kk, layout).to(torch.bfloat16))
                for a, c, r in zip(f16[:2], f32[:2], ref):
                    assert torch.equal(a.view(torch.int16), c.view(torch.int16)), (str(dtype), layout, kind)
                    assert torch.equal(a.view(torch.int16), r.view(torch.int16)), (str(dtype), layout, kind)
                vv = v[:, :, perm.long()] if anchor else v
                v6 = mxfp4_qdq(vv, times_six=True).to(torch.bfloat16)
                assert torch.equal(f16[2].view(torch.int16), v6.view(torch.int16))


_CHECK_FP8_VALUES = r"""
import torch
from fp4vis.formats import fp8_channel_quantize
from fp4vis.kernels.hopper.config import PV_FP8_KEY_ORDER
from fp4vis.kernels.hopper.prepass_launch import fp8_values

bad = []
for seed, (s, d, dtype) in enumerate([(70, 64, torch.bfloat16), (64, 128, torch.float16), (33, 64, torch.bfloat16),
                                      (5, 64, torch.float16), (300, 128, torch.bfloat16)]):
    g = torch.Generator().manual_seed(seed)
    v = (torch.randn(2, 3, s, d, generator=g) * torch.logspace(-3, 2, d)).to(dtype)
    v[0, 0, :, 3] = 0
    v[1, 2, :, 5] *= 1e4 if dtype == torch.bfloat16 else 1.0
    view = v.transpose(1, 2).contiguous().transpose(1, 2)      # strided (a patched layer's bshd layout)
    vt, scales = fp8_values(view)
    vals, ref_scales = fp8_channel_quantize(v)
    sp = vt.shape[-1]
    order = torch.tensor([32 * (p // 32) + PV_FP8_KEY_ORDER[p % 32] for p in range(sp)])
    ref = torch.zeros(2, 3, d, sp)
    kept = order < s
    ref[..., kept] = vals.transpose(-1, -2)[..., order[kept]]
    if sp % 32 or not torch.equal(vt.float(), ref) or not torch.equal(scales, ref_scales.squeeze(-2)):
        bad.append((s, d, dtype))
print("OK" if not bad else f"FAIL {bad}")
"""


def test_fp8_values_is_the_channel_quantization_in_key_order_interpreted():
    """The FP8 P/V policies' V pass (``prepass_launch.fp8_values``): V^T bytes equal ``fp4vis.formats``'
    ``fp8_channel_quantize`` of V, each 32-key block stored in ``PV_FP8_KEY_ORDER`` (the order the kernel's A
    fragment holds P in), keys past S zero, and the scales equal; strided views, BF16 and FP16, one program and
    several along the keys."""
    _run_interpreted(_CHECK_FP8_VALUES)
