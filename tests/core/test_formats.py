"""docs/numerics.md section 1: every element format and block format, tables, ties, saturation, and
cross-checks against independent implementations (torch's float8 casts, torchao's mx_formats)."""

import functools
import math
from fractions import Fraction

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from fp4vis import formats as fm

E2M1_MAGS = [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0]


def brute_e2m1(x: float) -> float:
    """Nearest E2M1 value by exhaustive search, ties to the even magnitude index, saturating."""
    mag = min(abs(x), 6.0)
    best = min(range(8), key=lambda i: (abs(E2M1_MAGS[i] - mag), i % 2))
    return math.copysign(E2M1_MAGS[best], x)


# ------------------------------------------------------------------------------ E2M1

def test_e2m1_decode_table_all_codes():
    codes = torch.arange(16, dtype=torch.uint8)
    vals = fm.e2m1_decode(codes)
    assert vals[:8].tolist() == E2M1_MAGS
    assert vals[8:].tolist() == [-m for m in E2M1_MAGS]
    assert torch.signbit(vals[8])  # code 8 is -0


def test_e2m1_encode_decode_roundtrip_all_codes():
    codes = torch.arange(16, dtype=torch.uint8)
    assert torch.equal(fm.e2m1_encode(fm.e2m1_decode(codes)), codes)


@pytest.mark.parametrize("x, expected", [
    (0.25, 0.0), (0.75, 1.0), (1.25, 1.0), (1.75, 2.0), (2.5, 2.0), (3.5, 4.0), (5.0, 4.0),  # ties
    (6.0, 6.0), (6.5, 6.0), (7.0, 6.0), (1e30, 6.0), (math.inf, 6.0),  # saturation
    (0.2499, 0.0), (0.2501, 0.5), (0.7499, 0.5), (4.99, 4.0), (5.01, 6.0),
])
def test_e2m1_ties_and_saturation(x, expected):
    for sign in (1.0, -1.0):
        got = fm.e2m1_round(torch.tensor([sign * x], dtype=torch.float64)).item()
        assert got == sign * expected
        assert math.copysign(1.0, got) == sign  # sign survives, -0 included


def test_e2m1_relu_maps_negatives_to_zero():
    x = torch.tensor([-6.0, -0.3, -1e-9, 0.0, 0.3, 2.6])
    assert fm.e2m1_round(x, relu=True).tolist() == [0.0, 0.0, 0.0, 0.0, 0.5, 3.0]
    assert not torch.signbit(fm.e2m1_round(x, relu=True)).any()


def test_e2m1_matches_brute_force_on_dense_grid():
    grid = torch.arange(-8000, 8001, dtype=torch.float64) / 1000.0  # every 0.001 including all ties
    got = fm.e2m1_round(grid)
    expected = torch.tensor([brute_e2m1(v) for v in grid.tolist()], dtype=torch.float64)
    assert torch.equal(got, expected)


@pytest.mark.parametrize("dtype, int_dtype", [(torch.float32, torch.int32), (torch.float64, torch.int64)])
def test_e2m1_round_is_the_boundary_table(dtype, int_dtype):
    """e2m1_round (scaled onto the integers, rounded half to even) against the definition: the magnitude
    whose index is the number of rounding boundaries strictly below |x| (NaN above all of them), on every
    kind of value: boundaries and their neighbours, powers of two down to the subnormals, any bit pattern."""
    mags, bounds = fm._e2m1_tables(dtype, torch.device("cpu"))

    def table(x, relu):
        if relu:
            return mags[torch.bucketize(x.contiguous(), bounds)]
        return torch.copysign(mags[torch.bucketize(x.abs().contiguous(), bounds)], x)

    edges = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.0, 2.5, 3.5, 4.0, 5.0, 6.0], dtype=dtype)
    near, lo, hi = [edges], edges, edges
    for _ in range(3):
        lo, hi = torch.nextafter(lo, torch.zeros_like(lo)), torch.nextafter(hi, torch.full_like(hi, 8.0))
        near += [lo, hi]
    info = torch.finfo(dtype)
    pow2 = torch.tensor([2.0 ** e for e in range(-1074 if dtype == torch.float64 else -149,
                                                 1024 if dtype == torch.float64 else 128)],
                        dtype=dtype)
    special = torch.tensor([0.0, math.inf, math.nan, info.tiny, info.max], dtype=dtype)
    bits = torch.randint(torch.iinfo(int_dtype).min, torch.iinfo(int_dtype).max, (200_000,), dtype=int_dtype,
                         generator=torch.Generator().manual_seed(0)).view(dtype)   # any value, any exponent
    for part in (torch.cat(near), pow2, special, bits):
        for x in (part, -part):
            for relu in (False, True):
                got, want = fm.e2m1_round(x, relu=relu), table(x, relu)
                assert got.dtype == dtype and not got.isnan().any()   # NaN saturates, as in the table
                assert torch.equal(got, want) and torch.equal(torch.signbit(got), torch.signbit(want))


def test_e2m1_nan_is_reported():
    with pytest.raises(ValueError, match="qq: contains NaN"):
        fm.e2m1_encode(torch.tensor([1.0, math.nan]), name="qq")


def test_pack_low_nibble_first_and_roundtrip():
    codes = torch.tensor([0x1, 0xF, 0x7, 0x8], dtype=torch.uint8)
    packed = fm.pack_fp4(codes)
    assert packed.tolist() == [0xF1, 0x87]
    assert torch.equal(fm.unpack_fp4(packed), codes)
    with pytest.raises(ValueError, match="even"):
        fm.pack_fp4(torch.zeros(3, dtype=torch.uint8))


def test_pack_matches_torch_float4_storage_order():
    """torch.float4_e2m1fn_x2 stores two codes per byte; torch cannot cast to it, so only the byte
    container is shared: our packed bytes view as that dtype and back unchanged."""
    if not hasattr(torch, "float4_e2m1fn_x2"):
        pytest.skip("torch has no float4_e2m1fn_x2")
    packed = fm.pack_fp4(torch.arange(16, dtype=torch.uint8))
    assert torch.equal(packed.view(torch.float4_e2m1fn_x2).view(torch.uint8), packed)


@settings(max_examples=300, deadline=None)
@given(st.floats(min_value=-100, max_value=100, allow_nan=False))
def test_e2m1_property_nearest_and_idempotent(x):
    r = fm.e2m1_round(torch.tensor([x], dtype=torch.float64)).item()
    assert r == brute_e2m1(x)
    assert fm.e2m1_round(torch.tensor([r], dtype=torch.float64)).item() == r


@settings(max_examples=100, deadline=None)
@given(st.lists(st.floats(min_value=-10, max_value=10, allow_nan=False, width=32), min_size=2, max_size=40))
def test_e2m1_property_monotone(xs):
    x = torch.tensor(sorted(xs), dtype=torch.float32)
    r = fm.e2m1_round(x)
    assert bool((r[1:] >= r[:-1]).all())


# ------------------------------------------------------------------------------ E4M3 / E8M0

def _e4m3_formula(b: int) -> float:
    s, e, m = b >> 7, (b >> 3) & 0xF, b & 0x7
    if e == 0xF and m == 0x7:
        return math.nan
    v = (m / 8) * 2.0 ** -6 if e == 0 else (1 + m / 8) * 2.0 ** (e - 7)
    return -v if s else v


def test_e4m3_decode_all_256_bytes():
    got = fm.e4m3_decode(torch.arange(256, dtype=torch.uint8)).tolist()
    for b, v in enumerate(got):
        ref = _e4m3_formula(b)
        assert (math.isnan(v) and math.isnan(ref)) or v == ref, b


def test_e4m3_encode_every_value_and_midpoint_matches_torch_cast():
    finite = torch.tensor(sorted({abs(_e4m3_formula(b)) for b in range(256) if not math.isnan(_e4m3_formula(b))}),
                          dtype=torch.float64)
    mids = (finite[1:] + finite[:-1]) / 2
    eps = torch.tensor([-1e-6, 0.0, 1e-6], dtype=torch.float64)
    probes = torch.cat([finite, (mids[:, None] * (1 + eps)).flatten()]).float()
    probes = torch.cat([probes, -probes])
    ours = fm.e4m3_encode(probes)
    theirs = probes.to(torch.float8_e4m3fn).view(torch.uint8)  # in range: torch rounds RNE
    assert torch.equal(ours, theirs)


@pytest.mark.parametrize("x, expected", [
    (448.0, 448.0), (460.0, 448.0), (464.0, 448.0), (1e9, 448.0), (math.inf, 448.0),  # saturating
    (2.0 ** -9, 2.0 ** -9), (2.0 ** -10, 0.0), (3 * 2.0 ** -10, 2.0 ** -8),  # subnormal ties to even
    (2.0 ** -11, 0.0), (1.0625, 1.0), (1.1875, 1.25),
])
def test_e4m3_saturation_and_subnormals(x, expected):
    assert fm.e4m3_round(torch.tensor([x])).item() == expected
    assert fm.e4m3_round(torch.tensor([-x])).item() == -expected


def test_e4m3_random_matches_torch_cast():
    g = torch.Generator().manual_seed(1)
    x = torch.randn(100_000, generator=g) * torch.exp2(torch.randint(-14, 10, (100_000,), generator=g).float())
    x = x.clamp(-448, 448)
    assert torch.equal(fm.e4m3_encode(x), x.to(torch.float8_e4m3fn).view(torch.uint8))


def test_e8m0_decode_all_bytes():
    u = torch.arange(256, dtype=torch.uint8)
    vals = fm.e8m0_decode(u)
    for b in range(255):
        assert vals[b].item() == 2.0 ** (b - 127)
    assert math.isnan(vals[255].item())
    assert vals[0].item() == 2.0 ** -127  # subnormal in float32, still exact


def test_pow2_exact_over_whole_float32_range():
    e = torch.arange(-149, 128)
    got = fm.pow2(e).double()
    assert torch.equal(got, torch.tensor([2.0 ** int(i) for i in e], dtype=torch.float64))


@pytest.mark.parametrize("amax, u", [
    (1.0, 127), (1.5, 127), (1.5000001, 128), (1.4999, 127),  # e = 0 is even: the tie stays down
    (3.0, 129), (2.9999, 128), (6.0, 129), (12.0, 131),  # ties go up only from odd e (1, 3)
    (0.75, 127), (0.375, 125),  # e = -1 odd: tie goes up to 2**0; e = -2 even: stays at 2**-2
    (1e-38, 0), (1e-39, 0), (0.0, 0), (1.1e-38, 1), (3e38, 254),
])
def test_e8m0_nearest_power_of_two(amax, u):
    assert fm.e8m0_nearest_pow2(torch.tensor([amax])).item() == u


# ------------------------------------------------------------------------------ NVFP4

def test_nvfp4_block16_hand_example():
    x = torch.zeros(32)
    x[:16] = torch.tensor([6, -3, 0.5, 1.25, 2.6, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0.2])  # amax 6 -> scale 1
    x[16:] = torch.tensor([24.0] + [5.0] * 15)  # amax 24 -> scale 4; 5/4 = 1.25 ties to 1 -> 4
    t = fm.nvfp4_quantize(x, "block16")
    assert fm.e4m3_decode(t.scales).tolist() == [1.0, 4.0]
    d = t.dequantize()
    assert d[:16].tolist() == [6, -3, 0.5, 1, 3, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0]
    assert d[16:].tolist() == [24.0] + [4.0] * 15
    assert t.codes.shape == (16,) and t.codes.dtype == torch.uint8


def test_nvfp4_casts_to_bf16_first():
    x = torch.tensor([6.0 + 2 ** -10] + [0.0] * 15)  # not a bf16 value; bf16 rounds it to 6
    t = fm.nvfp4_quantize(x, "block16")
    assert fm.e4m3_decode(t.scales).item() == 1.0


def test_nvfp4_zero_and_tiny_blocks():
    t = fm.nvfp4_quantize(torch.zeros(16), "block16")
    assert t.dequantize().abs().sum() == 0 and t.scales.item() == 0
    tiny = torch.full((16,), 2.0 ** -20)  # amax/6 underflows E4M3 -> zero scale -> zero codes
    assert fm.nvfp4_quantize(tiny, "block16").dequantize().abs().sum() == 0
    sub = torch.full((16,), 6 * 2.0 ** -8)  # amax/6 = 2**-8: a subnormal E4M3 scale, still exact
    t = fm.nvfp4_quantize(sub, "block16")
    assert fm.e4m3_decode(t.scales).item() == 2.0 ** -8
    assert torch.equal(t.dequantize(), sub)


def test_nvfp4_scale_saturates():
    x = torch.full((16,), 6000.0)  # amax/6 = 1000 > 448 -> scale 448, values clip to 6*448
    t = fm.nvfp4_quantize(x, "block16")
    assert fm.e4m3_decode(t.scales).item() == 448.0
    assert torch.equal(t.dequantize(), torch.full((16,), 2688.0))


def test_nvfp4_dequantized_values_exact_in_bf16_and_fp16():
    x = torch.randn(64, 128) * 3
    for layout in ("block16", "folded64_mse"):
        d = fm.nvfp4_quantize(x, layout).dequantize()
        assert torch.equal(d.bfloat16().float(), d)
        assert torch.equal(d.half().float(), d)


def _folded_brute(x: torch.Tensor) -> tuple[list[float], torch.Tensor]:
    """Independent per-pair search written with Python loops (docs/numerics.md section 1)."""
    d = x.numel()
    nb = d // 16
    xs = x.bfloat16().double().tolist()
    out = [0.0] * d
    scales = []
    for i in range(nb // 2):
        idx = list(range(16 * i, 16 * i + 16)) + list(range(16 * (i + nb // 2), 16 * (i + nb // 2) + 16))
        vals = [xs[j] for j in idx]
        base = max(abs(v) for v in vals) / 6
        best, best_err, best_q = None, None, None
        b32 = torch.tensor(base, dtype=torch.float32)  # float32 b = amax/6, then float32 b*m (docs/numerics.md)
        for m in (1.0, 0.25, 0.3125, 0.375, 0.4375, 0.5, 0.625, 0.75, 0.875, 1.0, 1.125, 1.25):  # numerics.md section 1
            cand = (b32 * torch.tensor(m, dtype=torch.float32)).clamp(max=448.0)
            sc = cand.to(torch.float8_e4m3fn).float().item()  # torch's RNE cast, independent of fm
            q = [brute_e2m1(v / sc) * sc if sc else 0.0 for v in vals]
            err = sum((a - b) ** 2 for a, b in zip(q, vals, strict=True))
            if best_err is None or err < best_err:
                best, best_err, best_q = sc, err, q
        scales.append(best)
        for j, v in zip(idx, best_q, strict=True):
            out[j] = v
    return scales, torch.tensor(out)


@pytest.mark.parametrize("seed", range(6))
def test_nvfp4_folded64_mse_matches_brute_force(seed):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(128, generator=g) * torch.exp2(torch.randn(128, generator=g) * 2)
    t = fm.nvfp4_quantize(x, "folded64_mse")
    scales, deq = _folded_brute(x)
    assert fm.e4m3_decode(t.scales).tolist() == scales
    assert torch.allclose(t.dequantize().double(), deq.double(), rtol=0, atol=0)
    assert t.scales.shape == (4,)  # D/32 scales for D = 128


def test_nvfp4_folded_pairs_block_i_with_i_plus_half():
    x = torch.zeros(128)
    x[0:16] = 6.0  # block 0 pairs with block 4 (d 64..79): one shared scale
    x[64:80] = 0.5
    x[16:32] = 60.0  # block 1 pairs with block 5, which stays 0
    t = fm.nvfp4_quantize(x, "folded64_mse")
    sc = fm.e4m3_decode(t.scales)
    assert sc[0] == 1.0 and sc[1] == 10.0
    d = t.dequantize()
    assert torch.equal(d[64:80], torch.full((16,), 0.5))


def test_nvfp4_folded_mse_can_beat_amax_scale():
    """A pair whose outlier dominates: a smaller scale (m < 1) represents the bulk better."""
    x = torch.full((32,), 1.75)
    x[0] = 6.0  # amax scale 1: the bulk 1.75 ties to 2 (error 31 * 0.0625); scale 0.875 fits it exactly
    t = fm.nvfp4_quantize(x, "folded64_mse")
    amax_scale = 1.0
    assert fm.e4m3_decode(t.scales).item() == 0.875
    assert fm.e4m3_decode(t.scales).item() != amax_scale
    err = ((t.dequantize() - x.bfloat16().float()) ** 2).sum()
    err_amax = ((fm.nvfp4_quantize(x, "block16").dequantize() - x.bfloat16().float()) ** 2).sum()
    assert err < err_amax


# Exact references for the folded-K64 MSE choice: Python Fractions, no float arithmetic at all.
_E2M1_FRACS = [Fraction(v) for v in E2M1_MAGS]


def _e2m1_exact(q: Fraction) -> Fraction:
    """Nearest E2M1 magnitude of q >= 0 by exhaustive search, ties to the even index, saturating."""
    q = min(q, Fraction(6))
    return _E2M1_FRACS[min(range(8), key=lambda i: (abs(_E2M1_FRACS[i] - q), i % 2))]


def _exact_choice(xs: list[float], cands: list[float]) -> tuple[int, list[Fraction], list[Fraction]]:
    """(first candidate index with the least exact squared error, decoded values, all errors)."""
    fx = [Fraction(x) for x in xs]
    best, errs = None, []
    for i, sc in enumerate(cands):
        s = Fraction(sc)
        dec = [_e2m1_exact(abs(x) / s) * s * (1 if x >= 0 else -1) if s else Fraction(0) for x in fx]
        errs.append(sum((d - x) ** 2 for d, x in zip(dec, fx, strict=True)))
        if best is None or errs[-1] < errs[best[0]]:
            best = (i, dec)
    return best[0], best[1], errs


def test_nvfp4_folded_mse_exact_tie_in_wide_range_group():
    """docs/numerics.md: a later candidate wins only when STRICTLY better. Here sc = 1 (m = 1.0, index 0) and
    sc = 0.875 (m = 0.875, index 8) have exactly equal errors: 6 -> 6 and 5.25 -> 6 (error 9/16)
    against 6 -> 5.25 (9/16) and 5.25 -> 5.25, plus the same 30 * (2^-28)^2 from the tiny values
    (codes 0 under every candidate). Each 2^-56 is 1/8 ulp of 9/16: a float64 sum in element order
    loses them one by one after 9/16 (index 8: exactly 9/16) but adds them up exactly before it
    (index 0: 9/16 + 3.75 ulp, rounded up), so the old float64 formula picked 0.875 (torch's CPU sum
    too, on this x86 build; the assertion below fixes the order so that it holds on any build)."""
    x = torch.full((32,), 2.0 ** -28)
    x[0], x[31] = 6.0, 5.25  # one folded group for D = 32: blocks 0 and 1
    index, cands = fm._folded_mse_choice(x[None])
    cands = cands.flatten().tolist()
    assert (cands[0], cands[8]) == (1.0, 0.875)
    exact_index, exact_dec, errs = _exact_choice(x.tolist(), cands)
    assert errs[0] == errs[8] == min(errs) and exact_index == 0

    def float64_in_order(sc: float) -> float:  # the old formula, summed left to right
        s = torch.tensor(sc)
        acc = 0.0
        for term in ((fm._codes_for_scale(x, s) * s - x).double() ** 2).tolist():
            acc += term
        return acc

    assert float64_in_order(0.875) < float64_in_order(1.0)  # the rounding splits the tie
    assert index.item() == 0
    t = fm.nvfp4_quantize(x, "folded64_mse")
    assert fm.e4m3_decode(t.scales).item() == 1.0
    assert t.dequantize().tolist() == [float(d) for d in exact_dec] == [6.0] + [0.0] * 30 + [6.0]


def _wide_tie_groups(g: torch.Generator, rows: int) -> torch.Tensor:
    """rows x 128 BF16 values: each folded group holds two tie-prone values k/8 among tiny ones
    (about 2^-28) whose squares are near the ulps of the groups' errors."""
    x = torch.randn(rows, 4, 32, generator=g) * torch.exp2(torch.randint(-32, -24, (rows, 4, 32), generator=g).float())
    pos = torch.rand(rows, 4, 32, generator=g).argsort(-1)[..., :2]
    x.scatter_(-1, pos, torch.randint(-48, 49, (rows, 4, 2), generator=g).float() / 8)
    return torch.cat((x[..., :16].flatten(-2), x[..., 16:].flatten(-2)), -1).bfloat16().float()


def _mse_groups(kind: str, g: torch.Generator, rows: int = 24) -> torch.Tensor:
    """rows x 128 float32 inputs (4 folded groups per row) of one kind."""
    shape = (rows, 128)
    if kind == "gauss":
        x = torch.randn(shape, generator=g) * torch.exp2(torch.randint(-12, 12, (rows, 1), generator=g).float())
    elif kind == "ties":  # small integers times powers of two: many exact ties between candidates
        x = torch.randint(-48, 49, shape, generator=g).float() * torch.exp2(
            torch.randint(-8, 4, (rows, 1), generator=g).float())
    elif kind == "wide":  # 44 binades per group: E4M3 underflow, saturation and huge groups
        x = torch.randn(shape, generator=g) * torch.exp2(torch.randint(-30, 14, shape, generator=g).float())
    elif kind == "wide_ties":
        x = _wide_tie_groups(g, rows)
    elif kind == "saturating":  # amax around 48 * 448 (the huge threshold) and far above it
        x = torch.randn(shape, generator=g) * torch.exp2(torch.randint(-20, 10, shape, generator=g).float())
        x[:, 0] = torch.exp2(torch.rand(rows, generator=g) * 6 + 11)  # 2^11 .. 2^17
        x[:, 33] = -torch.exp2(torch.rand(rows, generator=g) * 100 + 11)  # up to 2^111
    elif kind == "tiny":  # subnormal and zero E4M3 scales
        x = torch.randn(shape, generator=g) * torch.exp2(torch.randint(-16, -4, (rows, 1), generator=g).float())
    else:  # float32 values, not BF16 (what the global encode scale produces)
        return torch.randn(shape, generator=g) * torch.exp2(torch.randint(-6, 6, (rows, 1), generator=g).float())
    return x.bfloat16().float()


@pytest.mark.parametrize("kind", ["gauss", "ties", "wide", "wide_ties", "saturating", "tiny", "float32"])
def test_nvfp4_folded_mse_matches_exact_fractions(kind):
    """The chosen candidate index and the decoded values equal the exact (Fraction) search, group by
    group: first candidate with the least exact squared error."""
    g = torch.Generator().manual_seed(sum(map(ord, kind)))
    x = _mse_groups(kind, g)
    vals, scales = fm.nvfp4_chunked(x, "folded64_mse")
    dec = (vals.unflatten(-1, (-1, 16)) * torch.cat((scales, scales), -1).unsqueeze(-1)).flatten(-2)
    pair = torch.cat((x[:, :64].unflatten(-1, (4, 16)), x[:, 64:].unflatten(-1, (4, 16))), -1)  # (rows, 4, 32)
    dec_pair = torch.cat((dec[:, :64].unflatten(-1, (4, 16)), dec[:, 64:].unflatten(-1, (4, 16))), -1)
    index, cands = fm._folded_mse_choice(pair)
    # the candidates themselves: torch's float8 cast of float32 (amax / 6) * m, saturated
    base = (pair.abs().amax(-1, keepdim=True).double() / 6).float()
    mult = torch.tensor(fm.FOLDED_MSE_MULTIPLIERS)
    assert torch.equal(cands, (base * mult).clamp(max=448).to(torch.float8_e4m3fn).float())
    ties = 0
    for r in range(pair.shape[0]):
        for j in range(pair.shape[1]):
            cs = cands[r, j].tolist()
            want, want_dec, errs = _exact_choice(pair[r, j].tolist(), cs)
            assert index[r, j].item() == want, (kind, r, j)
            assert dec_pair[r, j].tolist() == [float(d) for d in want_dec], (kind, r, j)
            ties += len({cs[i] for i, e in enumerate(errs) if e == errs[want]}) > 1
    if kind in ("ties", "wide_ties"):
        assert ties > 0  # exact ties between distinct scales were exercised


def test_nvfp4_folded_mse_exact_where_float64_rounds_ties_apart():
    """Random wide-range groups where the old formula (squared errors summed in float64, here in
    element order so that the selection does not depend on the torch build) chooses differently:
    every one is an exact tie that float64 rounded apart, and the new choice is the exact one."""
    g = torch.Generator().manual_seed(1)
    x = _wide_tie_groups(g, 2000)
    pair = torch.cat((x[:, :64].unflatten(-1, (4, 16)), x[:, 64:].unflatten(-1, (4, 16))), -1)
    index, cands = fm._folded_mse_choice(pair)
    old_err = []
    for i in range(cands.shape[-1]):
        sc = cands[..., i:i + 1]
        terms = (fm._codes_for_scale(pair, sc) * sc - pair).double() ** 2
        acc = torch.zeros_like(terms[..., 0])
        for k in range(32):
            acc = acc + terms[..., k]
        old_err.append(acc)
    old_err = torch.stack(old_err, -1)
    old_index = torch.zeros_like(index[..., 0])
    for i in range(1, cands.shape[-1]):  # a later candidate wins when strictly smaller
        better = old_err[..., i] < old_err.gather(-1, old_index[..., None])[..., 0]
        old_index = torch.where(better, i, old_index)
    differ = (cands.gather(-1, old_index[..., None]) != cands.gather(-1, index)).squeeze(-1).nonzero().tolist()
    assert len(differ) >= 10, len(differ)
    for r, j in differ[:40]:
        cs = cands[r, j].tolist()
        want, want_dec, errs = _exact_choice(pair[r, j].tolist(), cs)
        assert index[r, j].item() == want
        assert errs[old_index[r, j].item()] == errs[want]  # the old choice was an exact tie, later
        got = fm.nvfp4_qdq(x[r], "folded64_mse")
        got_pair = torch.cat((got[16 * j:16 * j + 16], got[64 + 16 * j:64 + 16 * j + 16]))
        assert got_pair.tolist() == [float(d) for d in want_dec]


# ------------------------------------------------------------------------------ folded-K64 contenders
# fm.FOLDED_MSE_CONTENDERS: the candidates a kernel's scale search evaluates. The proof is exhaustive over
# the group maximum A (every positive BF16 value whose group saturates no candidate) and, for each A, over
# every BF16 value a <= A: a candidate k is never chosen when some contender j satisfies, for EVERY group
# with maximum A, err_k >= err_j with j first, or err_k > err_j. The group holds A and 31 values a <= A,
# so err_k - err_j = d(A) + sum of 31 d(a) >= d(A) + 31 min_a d(a), d(a) = e_k(a) - e_j(a), and that bound
# is reached (31 copies of the minimising a): the condition is D = d(A) + 31 min_a d(a) > 0, or >= 0
# with j first. Values below the window (A/256) code to 0 under every candidate: d = 0 there.

_WINDOW = 1024   # BF16 values up to A: eight binades, below A/256


@functools.cache
def _contender_domain():
    """(A (n,) float64, candidate scales (n, 12) float64, a (n, 1 + _WINDOW) float64: 0 and the
    _WINDOW largest BF16 values up to A): every positive BF16 A with a non-zero candidate and none
    saturating E4M3 (fl32(fl32(A/6) * 1.25) <= 448, the kernels' exact branch); also fl32(A/6 * 0.625)."""
    a_bits = torch.arange(1, 0x7F80, dtype=torch.int32)
    amax = (a_bits << 16).view(torch.float32)
    base = fm._over_six(amax)
    cands = fm.e4m3_round(base[:, None] * torch.tensor(fm.FOLDED_MSE_MULTIPLIERS))
    keep = (base * 1.25 <= fm.E4M3_MAX) & (cands.amax(1) > 0)
    a_bits, amax, base, cands = a_bits[keep], amax[keep], base[keep], cands[keep]
    win = (a_bits[:, None] - torch.arange(_WINDOW - 1, -1, -1, dtype=torch.int32)).clamp(min=0)
    a = torch.cat((torch.zeros(len(amax), 1), (win << 16).view(torch.float32)), 1).double()
    return amax.double(), cands.double(), a, base * 0.625


def _sq_errors(a: torch.Tensor, sc: torch.Tensor) -> torch.Tensor:
    """(E2M1(a / sc) * sc - a)^2 per value (sc = 0: a^2), float64 (exact here: asserted by the caller)."""
    sc = sc[:, None]
    t = torch.where(sc > 0, a / torch.where(sc > 0, sc, 1.0), 0.0)
    return (fm.e2m1_round(t) * sc - a) ** 2


def test_folded_mse_contenders_dominate_every_other_candidate():
    """Every candidate outside FOLDED_MSE_CONTENDERS is, for every group maximum A and every group, never
    strictly better than some contender, or only as good and later (the bound above, exact in float64);
    m = 0.625 is needed only where its scale is an E4M3 subnormal, fl32(A/6 * 0.625) < 2^-6. The
    contenders are all needed: each one is undominated (by the others) for some A."""
    amax, cands, a, base_0625 = _contender_domain()
    assert len(amax) > 2000 and float(amax.max()) == 2144.0
    distinct = [i for i in range(12) if fm.FOLDED_MSE_MULTIPLIERS[i] not in fm.FOLDED_MSE_MULTIPLIERS[:i]]
    errs = {i: _sq_errors(a, cands[:, i]) for i in distinct}
    # exact: every error an integer multiple of 2^(2 floor(log2 A) - 32) below 2^45 of them
    unit = torch.exp2(2 * torch.floor(torch.log2(amax)) - 32)[:, None]
    for e in errs.values():
        assert bool((e / unit == torch.round(e / unit)).all()) and float((e / unit).max()) < 2.0 ** 45
    # below the window every candidate codes 0
    nonzero = torch.where(cands > 0, cands, math.inf).amin(1)
    assert bool((a[:, 1] <= nonzero / 4).all())

    def dominated(k, by):
        out = torch.zeros(len(amax), dtype=torch.bool)
        for j in by:
            d = errs[k] - errs[j]
            bound = d[:, -1] + 31 * d.amin(1)
            out |= (bound > 0) | ((bound >= 0) & (j < k))
        return out

    contenders = fm.FOLDED_MSE_CONTENDERS
    sub = fm.FOLDED_MSE_SUBNORMAL_CONTENDER
    assert set(contenders) <= set(distinct) and sub in contenders
    for k in set(distinct) - set(contenders):
        assert bool(dominated(k, contenders).all()), fm.FOLDED_MSE_MULTIPLIERS[k]
    without_sub = [j for j in contenders if j != sub]
    needs_sub = ~dominated(sub, without_sub)
    assert bool(needs_sub.any())
    assert bool((base_0625[needs_sub] < 2.0 ** -6).all())       # only where its scale is subnormal
    for k in set(distinct) - set(contenders):                    # and then the others need it too
        assert bool(dominated(k, contenders)[needs_sub].all())
    for j in contenders:
        assert bool((~dominated(j, [i for i in contenders if i != j])).any()), fm.FOLDED_MSE_MULTIPLIERS[j]
    # the extreme groups, A and 31 copies of the value that brings a pruned candidate closest to a
    # contender (every eighth A): the contender search picks the full search's scale there too
    extreme = []
    for k in set(distinct) - set(contenders):
        for j in contenders:
            worst = a.gather(1, (errs[k] - errs[j]).argmin(1, keepdim=True))
            extreme.append(torch.cat((amax[:, None], worst.expand(-1, 31)), 1)[::8])
    extreme = torch.cat(extreme).float()
    index, cands = fm._folded_mse_choice(extreme)
    assert torch.equal(_contender_choice(extreme), cands.gather(-1, index))


def test_folded_mse_contender_error_sums_exact_in_float32():
    """The kernels' error of a contender scale sc: sc times the float32 sum over the group of
    T = c (c sc - 2|x|), c = E2M1(|x| / sc). For every group maximum A, contender and BF16 value a <= A,
    T and (where c > 0) c sc - 2a are integer multiples of u = 2^(floor(log2 sc) - 9) and 32 |T| < 2^24 u, so the
    FMA, the product and every partial sum of 32 terms, in any order, are exact in float32 (and the
    product with sc, 4 significant bits, in float64)."""
    amax, cands, a, _ = _contender_domain()
    worst = 0.0
    for j in fm.FOLDED_MSE_CONTENDERS:
        sc = cands[:, j:j + 1]
        live = sc[:, 0] > 0
        sc, aa = sc[live], a[live]
        c = fm.e2m1_round(aa / sc)
        u = torch.exp2(torch.floor(torch.log2(sc)) - 9).expand_as(c)
        diff, terms = (c * sc - 2 * aa) / u, c * (c * sc - 2 * aa) / u   # c = 0: -2a and 0, exact anyway
        assert bool((diff[c > 0] == torch.round(diff[c > 0])).all())
        assert bool((terms == torch.round(terms)).all())
        worst = max(worst, float(terms.abs().amax()) * 32)
    assert worst < 2.0 ** 24, math.log2(worst)


def _contender_choice(pair: torch.Tensor) -> torch.Tensor:
    """The scale (groups (..., 32) of BF16 values, float32) the kernels' contender search picks, in
    PyTorch: errors sc * sum_float32 c (c sc - 2|x|) of the contenders in order (m = 0.625 for every
    group: it is a candidate, so evaluating it where the others cover it changes nothing), the first
    least wins."""
    ax = pair.abs()
    cands = fm.e4m3_round(fm._over_six(ax.amax(-1, keepdim=True)) * torch.tensor(fm.FOLDED_MSE_MULTIPLIERS))
    best_sc = best_err = None
    for i in fm.FOLDED_MSE_CONTENDERS:
        sc = cands[..., i:i + 1]
        c = fm._codes_for_scale(ax, sc)
        terms = c * (c * sc - 2 * ax)                                   # float32, exact
        err = terms.sum(-1, keepdim=True).double() * sc.double()
        better = err < best_err if best_err is not None else torch.ones_like(err, dtype=torch.bool)
        best_err = err if best_err is None else torch.where(better, err, best_err)
        best_sc = sc if best_sc is None else torch.where(better, sc, best_sc)
    return best_sc


def _adversarial_groups(g: torch.Generator, n: int = 1000) -> torch.Tensor:
    """(about 4n, 32) BF16-valued groups that saturate no candidate: Gaussian over 2^-14..2^8 (subnormal
    E4M3 scales included), small integers times powers of two (exact ties between candidates), one
    outlier over a tiny bulk, maxima on E2M1 grid points of E4M3 scales, BF16 subnormals, all-zero
    groups (the proof's extreme groups are in the test above)."""
    gauss = torch.randn(n, 32, generator=g) * torch.exp2(torch.randint(-14, 9, (n, 1), generator=g).float())
    ties = torch.randint(-48, 49, (n, 32), generator=g).float() * torch.exp2(torch.randint(-12, 4, (n, 1),
                                                                                           generator=g).float())
    outlier = torch.randn(n, 32, generator=g) * 0.05
    outlier[:, 0] = torch.randint(1, 12, (n,), generator=g).float()
    sc = fm.e4m3_decode(torch.randint(1, 0x7F, (n,), generator=g, dtype=torch.int32).to(torch.uint8))
    grid = torch.randn(n, 32, generator=g) * sc[:, None]
    grid[:, 5] = sc * torch.tensor(E2M1_MAGS)[torch.randint(4, 8, (n,), generator=g)]
    subnormal = torch.randn(16, 32, generator=g) * 2.0 ** -128
    groups = torch.cat((gauss, ties, outlier, grid, subnormal, torch.zeros(4, 32))).bfloat16().float()
    base = fm._over_six(groups.abs().amax(-1))
    return groups[base * 1.25 <= fm.E4M3_MAX]


@pytest.mark.parametrize("seed", range(2))
def test_folded_mse_contender_search_matches_full_search(seed):
    """The contender search (``_contender_choice``, the kernels' arithmetic) picks the full search's
    scale (fm._folded_mse_choice, the definition) in every group of the adversarial set, and every
    contender but m = 0.625 is picked somewhere."""
    g = torch.Generator().manual_seed(100 + seed)
    groups = _adversarial_groups(g)
    index, cands = fm._folded_mse_choice(groups)
    want = cands.gather(-1, index)
    got = _contender_choice(groups)
    assert torch.equal(got, want), int((got != want).sum())
    picked = {fm.FOLDED_MSE_MULTIPLIERS[i] for i in index.flatten().tolist()}
    assert picked >= {fm.FOLDED_MSE_MULTIPLIERS[i] for i in fm.FOLDED_MSE_CONTENDERS} - {0.625}, picked


def test_nvfp4_global_scale_roundtrip():
    x = torch.randn(4, 64) * 1e-3
    t = fm.nvfp4_quantize(x, "block16", global_scale=True)
    assert t.tensor_scale == pytest.approx(float(x.bfloat16().float().abs().max()) / 2688)
    assert fm.e4m3_decode(t.scales).max() == 448.0  # the largest block uses the full E4M3 range


def test_nvfp4_errors_name_tensor():
    with pytest.raises(ValueError, match="kk: last dim must be a multiple of 16"):
        fm.nvfp4_quantize(torch.zeros(2, 24), name="kk")
    with pytest.raises(ValueError, match="multiple of 32"):
        fm.nvfp4_quantize(torch.zeros(2, 48), "folded64_mse")
    with pytest.raises(ValueError, match="contains NaN"):
        fm.nvfp4_quantize(torch.tensor([math.nan] * 16))


def test_nvfp4_block16_cross_check_torchao():
    """torchao's NVFP4 (mx_formats) uses the same per-16 E4M3 amax/6 scale; it multiplies by the
    reciprocal scale instead of dividing and clamps zero scales to E4M3's epsilon, so codes may
    differ exactly at E2M1 ties and in all-zero blocks (both avoided or counted here)."""
    nvfp4 = pytest.importorskip("torchao.prototype.mx_formats.nvfp4_tensor")
    kernels = pytest.importorskip("torchao.prototype.mx_formats.kernels")
    g = torch.Generator().manual_seed(3)
    x = (torch.randn(256, 128, generator=g) * 2).bfloat16()
    scales_ao, packed_ao = nvfp4.nvfp4_quantize(x, 16)
    ours = fm.nvfp4_quantize(x, "block16")
    assert torch.equal(scales_ao.view(torch.uint8).flatten(), ours.scales.flatten())
    vals_ao = kernels.f4_unpacked_to_f32(fm.unpack_fp4(packed_ao.view(torch.uint8))).reshape(256, 128)
    vals_ours = fm.e2m1_decode(fm.unpack_fp4(ours.codes))
    ratio = x.float().unflatten(-1, (8, 16)) / fm.e4m3_decode(ours.scales).unsqueeze(-1)
    at_tie = (ratio.abs() * 4 == torch.round(ratio.abs() * 4)).flatten(-2)  # k/4: possible ties
    differ = vals_ao != vals_ours
    assert not bool((differ & ~at_tie).any())
    assert differ.float().mean() < 0.01


def test_e2m1_cross_check_torchao():
    kernels = pytest.importorskip("torchao.prototype.mx_formats.kernels")
    x = torch.arange(-8000, 8001, dtype=torch.float32) / 1000.0
    theirs = kernels.f4_unpacked_to_f32(kernels.f32_to_f4_unpacked(x))
    assert torch.equal(theirs.abs(), fm.e2m1_round(x).abs())


# ------------------------------------------------------------------------------ MXFP4

def test_mxfp4_alpha_convention_and_clip():
    v = torch.zeros(32, 2)
    v[:, 0] = torch.tensor([1.4, 0.7, 0.35, -0.2] + [0.0] * 28)  # amax 1.4 -> alpha 1 (<= 1.5)
    v[:, 1] = torch.tensor([1.6, 0.8] + [0.0] * 30)  # amax 1.6 -> alpha 2
    t = fm.mxfp4_quantize(v)
    assert t.scales.tolist() == [[127, 128]]
    d6 = t.dequantize(times_six=True)  # alpha * c, exact
    # 6*1.4 = 8.4 clips to 6; 6*0.7 = 4.2 -> 4; 6*.35 = 2.1 -> 2; -1.2 -> -1
    assert d6[:4, 0].tolist() == [6.0, 4.0, 2.0, -1.0]
    # alpha 2: 6*1.6/2 = 4.8 -> 4; 6*0.8/2 = 2.4 -> 2
    assert d6[:2, 1].tolist() == [8.0, 4.0]
    assert torch.equal(t.dequantize(), d6 / 6)


def test_mxfp4_partial_block_and_layout():
    v = torch.randn(2, 3, 70, 8)
    t = fm.mxfp4_quantize(v)
    assert t.codes.shape == (2, 3, 70, 4) and t.scales.shape == (2, 3, 3, 8) and t.seq_len == 70
    d = t.dequantize()
    assert d.shape == v.shape
    # the last block (tokens 64..69) is quantized on its own
    alone = fm.mxfp4_quantize(v[..., 64:, :]).dequantize()
    assert torch.equal(d[..., 64:, :], alone)


def test_mxfp4_exactly_representable_roundtrip():
    c = torch.tensor(E2M1_MAGS)[torch.randint(0, 8, (64, 16))] * torch.where(torch.rand(64, 16) < 0.5, -1, 1)
    c[0] = 6.0  # every block reaches amax = 6 * alpha / 6 = alpha
    c[32] = 6.0
    v = c / 6 * 2.0 ** -3
    assert torch.equal(fm.mxfp4_quantize(v).dequantize(), v)


def test_mxfp4_fp32_value_is_rounded_once():
    """6 v must reach the E2M1 rounding exactly: v = 13981014 / 2**24 gives 6 v = 5 + 2**-22 (rounds
    to 6), while a float32 product would round 6 v to 5.0, a tie that goes to 4."""
    v = torch.zeros(32, 2)
    v[0] = 13981014 / 2**24
    v[1] = 1.0  # amax 1: alpha = 1
    assert fm.mxfp4_quantize(v).dequantize(times_six=True)[0].tolist() == [6.0, 6.0]
    assert torch.equal(fm.mxfp4_qdq(v, times_six=True), fm.mxfp4_quantize(v).dequantize(times_six=True))


def test_mxfp4_tiny_block_gets_u0():
    t = fm.mxfp4_quantize(torch.full((32, 2), 1e-39))
    assert t.scales.tolist() == [[0, 0]]


@settings(max_examples=60, deadline=None)
@given(st.integers(1, 80), st.floats(1e-6, 1e6))
def test_mxfp4_property_error_bound(s, mag):
    g = torch.Generator().manual_seed(s)
    v = torch.randn(s, 4, generator=g) * mag
    t = fm.mxfp4_quantize(v)
    alpha = fm.e8m0_decode(t.scales).repeat_interleave(32, 0)[:s]
    err = (t.dequantize() - v).abs()
    # |v| <= alpha: half the widest E2M1 step (4 -> 6) times alpha/6; above alpha (<= 1.5 alpha): the clip
    inside = v.abs() <= alpha
    assert bool((err[inside] <= alpha[inside] / 6 * (1 + 1e-6)).all())
    assert bool((err[~inside] <= (v.abs() - alpha)[~inside] * (1 + 1e-6)).all())


@settings(max_examples=60, deadline=None)
@given(st.integers(1, 6), st.floats(1e-3, 1e3), st.sampled_from(["block16", "folded64_mse"]))
def test_nvfp4_property_error_bound(rows, mag, layout):
    g = torch.Generator().manual_seed(rows)
    x = (torch.randn(rows, 64, generator=g) * mag).bfloat16().float()
    t = fm.nvfp4_quantize(x, layout)
    err = (t.dequantize() - x).abs().unflatten(-1, (4, 16))
    sc = t.block_scales().unsqueeze(-1)
    amax = x.abs().unflatten(-1, (4, 16)).amax(-1, keepdim=True)
    # RNE in [0, 6*sc] gives at most sc (the 4..6 step / 2); clipping above 6*sc at most amax - 6*sc
    assert bool((err <= torch.maximum(sc, amax - 6 * sc) * 1.0001 + 1e-12).all())


# ------------------------------------------------------------------------------ FP8 with power-of-two group scales

def _fp8_groups_brute(x: torch.Tensor, g: int):
    """Independent statement: per group of g rows, E = floor(log2 amax) - 7 (>= -126) from math.frexp, 0 for an
    all-zero group, values = torch's own float8_e4m3fn cast of x * 2^-E (RNE; nothing here reaches 448)."""
    s = x.shape[-2]
    vals = torch.empty_like(x, dtype=torch.float32)
    scales = []
    for i in range(0, s, g):
        grp = x[..., i:i + g, :].float()
        amax = float(grp.abs().max())
        e = math.frexp(amax)[1] - 1 - 7 if amax >= 2.0 ** -126 else -126 - 7
        e = max(e, -126) if amax > 0 else 0
        vals[..., i:i + g, :] = (grp * 2.0 ** -e).to(torch.float8_e4m3fn).float()
        scales.append(2.0 ** e)
    return vals, scales


@pytest.mark.parametrize("group", [1, 32])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_fp8_pow2_matches_independent_statement(group, dtype):
    g = torch.Generator().manual_seed(4)
    x = torch.randn(77, 64, generator=g)
    x[3] *= 2.0 ** 14          # wide range between groups
    x[40:50] *= 2.0 ** -20
    x[60] = 0.0                # an all-zero row
    x[:, 5] *= 1e-4            # small elements inside a group (E4M3 subnormals)
    x = x.to(dtype)
    vals, scales = fm.fp8_pow2_quantize(x, group)
    want_vals, want_scales = _fp8_groups_brute(x, group)
    assert torch.equal(vals, want_vals)
    assert scales.squeeze(-1).tolist() == want_scales
    assert torch.equal(fm.fp8_pow2_qdq(x, group), vals * torch.tensor(want_scales).repeat_interleave(group)[:77, None])


def test_fp8_pow2_group_max_lands_in_top_binade_and_error_bound():
    g = torch.Generator().manual_seed(5)
    x = torch.randn(4, 96, 128, generator=g) * torch.logspace(-30, 30, 96, base=2.0)[:, None]
    vals, scales = fm.fp8_pow2_quantize(x, 32)
    top = vals.abs().unflatten(-2, (-1, 32)).amax(dim=(-2, -1))
    assert bool(((top >= 128) & (top <= 256)).all())
    # one E4M3 rounding: relative error <= 2^-4 for elements within 13 binades of their group max
    qdq = fm.fp8_pow2_qdq(x, 32)
    amax = x.abs().unflatten(-2, (-1, 32)).amax(dim=(-2, -1), keepdim=True).expand(-1, -1, 32, 128).flatten(1, 2)
    inwin = x.abs() >= amax * 2.0 ** -13
    rel = ((qdq - x).abs() / x.abs().clamp(min=1e-38))[inwin]
    assert float(rel.max()) <= 2.0 ** -4
    assert torch.equal(fm.fp8_pow2_qdq(qdq, 32), qdq)   # idempotent



@pytest.mark.parametrize("dtype, limit", [(torch.bfloat16, fm.OVERFLOW_BF16), (torch.float16, fm.OVERFLOW_FP16)])
def test_overflow_limits_are_the_first_magnitudes_that_round_to_inf(dtype, limit):
    """The kernels' range record counts an output as non-finite from these float32 magnitudes on."""
    x = torch.tensor([limit, -limit], dtype=torch.float32)
    below = torch.nextafter(x, torch.zeros_like(x))
    assert torch.isinf(x.to(dtype)).all() and torch.isfinite(below.to(dtype)).all()
