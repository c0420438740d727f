"""The Triton format functions both pre-passes are built from (``kernels/triton_formats.py``), run on the CPU
through Triton's interpreter, against ``fp4vis.formats`` bit for bit: E4M3 rounding and bytes, the MXFP4 block
scale, powers of two, the folded-K64 multipliers, BF16 rounding, E2M1 codes and values of x / sc (every BF16
magnitude against every E4M3 scale) and the nibble packing. The pre-pass tests check them again inside the
kernels; these cover the edges the pre-passes' inputs rarely reach (ties, subnormals, the top of the float32
range, Inf)."""

from __future__ import annotations

import pytest

_SCRIPT = r"""
import json
import torch
import triton
import triton.language as tl
from fp4vis import formats as fm
from fp4vis.kernels import triton_formats as tf

BLOCK = 4096

@triton.jit
def unary(X, Y, N, OP: tl.constexpr, BLOCK: tl.constexpr):
    i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    m = i < N
    x = tl.load(X + i, mask=m, other=0)
    if OP == 0:
        y = tf.e4m3_round(x)
    elif OP == 1:
        y = tf.e4m3_byte(tf.e4m3_round(x))
    elif OP == 2:
        y = tf.mxfp4_scale_exponent(x)
    elif OP == 3:
        y = tf.pow2(x)
    elif OP == 4:
        y = tf.folded_mse_multiplier(x)
    else:
        y = tf.bf16_round(x)
    tl.store(Y + i, y, mask=m)

@triton.jit
def packed(X, Y, BLOCK: tl.constexpr):
    i = tl.arange(0, BLOCK)
    tl.store(Y + tl.arange(0, BLOCK // 2), tf.packed_e2m1_pairs(tl.load(X + i)))

@triton.jit
def multipliers(Y):
    for k in tl.static_range(1, 12):
        tl.store(Y + k, tf.folded_mse_multiplier(k))

@triton.jit
def quotients(X, S, C, V, N, BLOCK: tl.constexpr):
    i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    m = i < N
    x = tl.load(X + i, mask=m, other=0.0)
    sc = tl.load(S + i, mask=m, other=0.0)
    tl.store(C + i, tf.e2m1_codes(x, sc), mask=m)
    tl.store(V + i, tf.e2m1_quotient(tl.abs(x), tf.scale_reciprocal(sc), False), mask=m)

def run(op, x, out_dtype):
    y = torch.empty(x.shape, dtype=out_dtype)
    unary[(triton.cdiv(x.numel(), BLOCK),)](x, y, x.numel(), op, BLOCK)
    return y

def bits(t):
    return t.view(torch.int32)

g = torch.Generator().manual_seed(0)
res = {}
# float32 magnitudes: every BF16 and FP16 value, random bit patterns, the top binades, E4M3 and E8M0 ties,
# subnormals, the MXFP4 zero threshold, 0 and Inf
bf16 = torch.arange(0, 0x7F81, dtype=torch.int32).to(torch.int16).view(torch.bfloat16).float()
fp16 = torch.arange(0, 0x7C01, dtype=torch.int32).to(torch.int16).view(torch.float16).float()
rand = (torch.randint(0, 0x7F800000, (1 << 16,), generator=g, dtype=torch.int32)).view(torch.float32)
e4m3 = fm.e4m3_decode(torch.arange(0, 0x7F, dtype=torch.int32).to(torch.uint8))
def around(t):   # t and its float32 neighbours
    return torch.cat((t, torch.nextafter(t, torch.zeros(())), torch.nextafter(t, torch.full((), float("inf")))))

ulp = torch.where(e4m3 < 2.0 ** -6, 2.0 ** -9, fm.pow2(torch.frexp(e4m3)[1] - 4))
e4m3_ties = torch.cat((around(e4m3 + ulp / 2), torch.tensor([464.0, 479.0, 480.0, 1e30])))
e8m0_ties = around(1.5 * torch.exp2(torch.arange(-126, 128).float()))
edges = torch.tensor([0.0, 1e-38, 1.0000001e-38, 0.99999994e-38, 2.0 ** -126, 2.0 ** -127, 2.0 ** -149, 3e-39,
                      2.0 ** 108, 1.5 * 2.0 ** 108, 2.0 ** 109 * 0.99, 3.3e38, float("inf")])
mags = torch.cat((bf16, fp16, rand, e4m3_ties, e8m0_ties, edges, torch.rand(4096, generator=g) * 2.0 ** 112))
res["e4m3_round"] = int((bits(run(0, mags, torch.float32)) != bits(fm.e4m3_round(mags))).sum())
res["e4m3_nan"] = run(0, torch.tensor([float("nan")]), torch.float32).tolist()   # minimum ignores NaN
ref_bytes = fm.e4m3_round(mags).to(torch.float8_e4m3fn).view(torch.uint8).int()
res["e4m3_byte"] = int((run(1, mags, torch.int32) != ref_bytes).sum())
fin = mags[torch.isfinite(mags)]
res["mxfp4_scale_exponent"] = int((run(2, fin, torch.int32) != fm.e8m0_nearest_pow2(fin).int()).sum())
res["mxfp4_scale_exponent_inf_nan"] = run(2, torch.tensor([float("inf"), float("nan")]), torch.int32).tolist()
e = torch.arange(-127, 128, dtype=torch.int32)
res["pow2"] = int((bits(run(3, e, torch.float32)) != bits(fm.pow2(e))).sum())
i = torch.arange(1, 12, dtype=torch.int32)
res["multipliers"] = run(4, i, torch.float32).tolist()
y = torch.zeros(12)
multipliers[(1,)](y)
res["multipliers_constexpr"] = y[1:].tolist()
finite = torch.cat((rand, -rand, bf16, torch.randn(4096, generator=g)))
res["bf16_round"] = int((bits(run(5, finite, torch.float32)) != bits(finite.bfloat16().float())).sum())
codes = torch.randint(0, 16, (256,), generator=g, dtype=torch.int32)
p = torch.empty(128, dtype=torch.int32)
packed[(1,)](codes, p, 256)
res["packed_e2m1_pairs"] = bool(torch.equal(p, fm.pack_fp4(codes.to(torch.uint8)).int()))
# E2M1 of x / sc: every BF16 value (both signs) against every E4M3 scale, 0 included
xs, scs = torch.meshgrid(torch.cat((bf16[:-1], -bf16[:-1])), e4m3, indexing="ij")
xs, scs = xs.flatten().contiguous(), scs.flatten().contiguous()
c = torch.empty(xs.shape, dtype=torch.int32)
v = torch.empty(xs.shape, dtype=torch.float32)
quotients[(triton.cdiv(xs.numel(), 1 << 16),)](xs, scs, c, v, xs.numel(), 1 << 16)
safe = torch.where(scs == 0, 1.0, scs).double()
ref_codes = torch.where(scs == 0, 0, fm.e2m1_encode(xs.double() / safe).int())
ref_mag = torch.where(scs == 0, 0.0, fm.e2m1_round(xs.abs().double() / safe).float())
res["e2m1_codes"] = int((c != ref_codes).sum())
res["e2m1_quotient"] = int((bits(v) != bits(ref_mag)).sum())
res["quotients_checked"] = xs.numel()
print("RESULT" + json.dumps(res))
"""


@pytest.fixture(scope="module")
def interpreted(interpreted_result):
    return interpreted_result(_SCRIPT, "triton_formats")


@pytest.mark.parametrize("name", ["e4m3_round", "e4m3_byte", "mxfp4_scale_exponent", "pow2", "bf16_round",
                                  "e2m1_codes", "e2m1_quotient"])
def test_bit_equal_to_formats(interpreted, name):
    assert interpreted[name] == 0


def test_non_finite_saturates_e4m3_and_the_mxfp4_scale(interpreted):
    """NaN gives E4M3's largest value (Triton's minimum returns the other operand, on the GPU too), Inf and NaN
    block maxima the largest E8M0 scale; the pre-passes mark non-finite inputs separately (NaN operands, NaN
    V scales)."""
    assert interpreted["e4m3_nan"] == [448.0] and interpreted["mxfp4_scale_exponent_inf_nan"] == [254, 254]


def test_folded_mse_multipliers(interpreted):
    from fp4vis.formats import FOLDED_MSE_MULTIPLIERS

    assert interpreted["multipliers"] == list(FOLDED_MSE_MULTIPLIERS[1:])
    assert interpreted["multipliers_constexpr"] == list(FOLDED_MSE_MULTIPLIERS[1:])


def test_packed_pairs_and_quotient_coverage(interpreted):
    assert interpreted["packed_e2m1_pairs"]
    assert interpreted["quotients_checked"] == 2 * 0x7F80 * 0x7F
