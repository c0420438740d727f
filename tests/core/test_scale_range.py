"""Quantized operands whose block scales leave their format's range are counted and reported, never
silently wrong (docs/numerics.md section 1, "Scale range"; section 8): NVFP4 scales under- or
overflowing E4M3 (q, k), MXFP4 scales under- or overflowing E8M0 (v), FP8 group exponents floored
(q, k of ``fast_fp8qk``)."""

from __future__ import annotations

import math
import re

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import fp4vis
import fp4vis.formats as fm
from fp4vis.range_report import RangeReport


def _block(amax: float, n: int = 16) -> torch.Tensor:
    x = torch.zeros(1, n)
    x[0, 3] = amax
    x[0, 5] = -amax / 2
    return x


@pytest.mark.parametrize("amax, under, over", [
    (0.0, 0, 0),                    # an all-zero block has nothing to lose
    (6 * 2.0**-10, 1, 0),           # amax/6 = 2**-10, the tie between 0 and 2**-9: RNE gives a zero scale
    (6 * 2.0**-9, 0, 0),            # the smallest subnormal scale: kept (fewer bits, not flushed)
    (6 * 464.0, 0, 0),              # 464 rounds to 448 (the tie goes to the even significand)
    (6 * 468.0, 0, 1),              # beyond: E4M3 saturates, values clip
])
def test_nvfp4_block16_scale_range(amax, under, over):
    x = _block(amax)
    r = fm.nvfp4_quantize(x, "block16").scale_range
    a = float(torch.tensor(amax).bfloat16())        # what the quantizer takes
    assert (r.underflow, r.overflow, r.flushed, r.amax) == (under, over, 16 * a if under else 0.0, a)


def test_nvfp4_folded_scale_range_counts_groups_of_32():
    x = torch.zeros(2, 64)
    x[0, 1], x[0, 40] = 1e-5, 1e-5        # one group (d 0..15 with 32..47), flushed
    x[1, 17] = 1e5                        # one group (d 16..31 with 48..63), saturated
    r = fm.nvfp4_quantize(x, "folded64_mse").scale_range
    bf16 = float(torch.tensor(1e-5).bfloat16())
    assert (r.underflow, r.overflow, r.flushed, r.amax) == (1, 1, 32 * bf16, float(torch.tensor(1e5).bfloat16()))
    # the per-tensor scale brings both into range
    r = fm.nvfp4_quantize(x[:1], "folded64_mse", global_scale=True).scale_range
    assert (r.underflow, r.overflow) == (0, 0)


def test_flushed_is_a_rows_flushed_values_times_their_largest():
    """Per row (token): the values in its flushed groups times their largest magnitude, the largest over rows."""
    x = torch.ones(3, 64)
    x[0, :16] = 2.0**-12          # one flushed group of 16 in row 0
    x[1, :48] = 2.0**-13          # three in row 1, smaller
    r = fm.nvfp4_quantize(x, "block16").scale_range
    assert (r.underflow, r.flushed, r.amax) == (4, max(16 * 2.0**-12, 48 * 2.0**-13), 1.0)


@pytest.mark.parametrize("amax, under, over", [
    (0.0, 0, 0), (1e-39, 1, 0), (1e-38, 1, 0), (2e-38, 0, 0), (1.0, 0, 0),
    (1.5 * 2.0**127 * (1 - 2**-23), 0, 0), (1.5 * 2.0**127, 0, 1), (3e38, 0, 1),
])
def test_mxfp4_scale_range(amax, under, over):
    v = torch.zeros(40, 2)     # two blocks of 32 tokens in each of 2 columns, one of them used
    v[33, 1] = amax
    r = fm.mxfp4_quantize(v).scale_range
    assert (r.underflow, r.overflow, r.flushed, r.amax) == (under, over, float(torch.tensor(amax)) if under else 0.0,
                                                            float(torch.tensor(amax)))


@pytest.mark.parametrize("amax, under", [(0.0, 0), (2.0**-120, 1), (2.0**-119, 0), (1e30, 0)])
def test_fp8_pow2_scale_range(amax, under):
    x = torch.zeros(32, 8)
    x[7, 2] = amax
    r = fm.ScaleRange.of(fm.fp8_pow2_scale_counts(x, 32))
    assert (r.underflow, r.overflow, r.flushed) == (under, 0, 8 * amax if under else 0.0)


@pytest.mark.parametrize("amax, under", [(0.0, 0), (2.0**-120, 1), (2.0**-119, 0), (1e30, 0)])
def test_fp8_channel_scale_range(amax, under):
    """V's per-channel FP8 scale (the FP8 P/V policies): a channel whose maximum floors the exponent at -126 is an
    underflow, flushed by its maximum (v's criterion compares it with v's largest value); the others are not."""
    v = torch.zeros(2, 300, 8)
    v[1, 250, 3] = amax
    v[0, 5, 1] = 2.0**-121      # another head group's channel: counted on its own
    r = fm.ScaleRange.of(fm.fp8_channel_scale_counts(v))
    a32 = float(torch.tensor(amax))
    assert (r.underflow, r.overflow, r.flushed, r.amax) == (under + 1, 0, max(a32 if under else 0.0, 2.0**-121),
                                                            max(a32, 2.0**-121))
    _, scales = fm.fp8_channel_quantize(v)
    assert scales[0, 0, 1] == 2.0**-126                     # the channels counted are those whose scale floors
    if under:
        assert scales[1, 0, 3] == 2.0**-126


def _qkv(shape=(1, 2, 128, 64), seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(shape, generator=g) for _ in range(3)]


@pytest.mark.parametrize("policy", ["fast", "accurate", "guard", "wan_fast", "nv_fp8", "fast_fp8qk"])
def test_unbalanced_q_and_k_raise_naming_them(policy):
    """The probe's case: q 1e-3, k 1e3 have the logits of unit inputs, but their NVFP4 block scales leave
    E4M3 (q's flush to zero, k's clip); FP8 group exponents cover them, so fast_fp8qk computes."""
    q, k, v = _qkv()
    q, k, v = (q * 1e-3).bfloat16(), (k * 1e3).bfloat16(), v.bfloat16()
    if policy == "fast_fp8qk":
        out = fp4vis.attention(q, k, v, policy=policy)
        assert fp4vis.rel_l2(out.float(), fp4vis.attention(q, k, v, policy="bf16").float()) < 0.35
        return
    with pytest.raises(fp4vis.RangeExceededError, match=r"blocks of q whose scale underflows.*blocks of k whose "
                                                        r"scale saturates.*same power of two") as info:
        fp4vis.attention(q, k, v, policy=policy)
    assert ("qk_global_scale=True" in str(info.value)) == (policy != "fast_fp8qk")


def test_tiny_v_raises_naming_v():
    q, k, v = _qkv()
    with pytest.raises(fp4vis.RangeExceededError, match=r"blocks of v whose scale underflows.*scale v"):
        fp4vis.attention(q, k, v * 1e-40, policy="fast")


def test_scale_range_follows_range_check():
    q, k, v = _qkv()
    with pytest.warns(RuntimeWarning, match="blocks of q whose scale underflows"):
        fp4vis.attention(q * 1e-4, k * 1e4, v, policy="fast", range_check="warn")
    fp4vis.attention(q * 1e-4, k * 1e4, v, policy="fast", range_check="off")   # accepted silently, as asked


def test_report_counts_every_operand():
    q, k, v = _qkv()
    from fp4vis.policy import POLICIES
    from fp4vis.reference import reference_attention
    flat = [t.flatten(0, 1) for t in (q * 1e-4, k * 1e4, v * 1e-40)]
    _, report = reference_attention(*flat, POLICIES["fast"], 0.125)
    assert report.scale_underflow == (512, 0, 2 * 4 * 64) and report.scale_overflow == (0, 512, 0)
    assert not report.ok
    assert RangeReport(scale_overflow=(0, 0, 1)).ok is False and RangeReport().ok


@pytest.mark.parametrize("policy", ["fast", "accurate"])
def test_key_stream_counts_like_the_whole_call(policy):
    from fp4vis.policy import POLICIES
    from fp4vis.reference import DirectPAccumulator, reference_attention
    q, k, v = (t.flatten(0, 1) for t in _qkv((1, 2, 64, 32)))
    k = k.clone()
    k[:, 40:50] *= 1e6
    v = v.clone()
    v[:, :32] *= 1e-39   # the first 32-token block of every column
    pol = POLICIES[policy]
    _, whole = reference_attention(q, k, v, pol, 0.2)
    if policy == "accurate":        # anchored: no key stream; the whole call still counts
        assert whole.scale_overflow[1] > 0
        return
    acc = DirectPAccumulator(q, pol, 0.2, num_keys=64)
    for a in range(0, 64, 24):
        acc.add(k[:, a:a + 24], v[:, a:a + 24])
    _, streamed = acc.result()
    assert (streamed.scale_underflow, streamed.scale_overflow) == (whole.scale_underflow, whole.scale_overflow)
    assert streamed.scale_ranges == whole.scale_ranges
    # v's tiny block, among unit values, cannot move an output: flushed, not counted
    assert whole.scale_overflow[1] == 2 * 10 and whole.scale_ranges[2].underflow == 2 * 32
    assert whole.scale_underflow[2] == 0


# how far the error of a scaled call may be from its twin's: the operands round differently (BF16, then the
# block scales), a spread of a few hundredths on these 128-token rows (docs/numerics.md section 1, "Scale range")
POLICY_ERROR_SPREAD = 0.06


@settings(max_examples=60, deadline=None)
@given(a=st.floats(-6, 6), b=st.floats(-6, 6), c=st.floats(-6, 6),
       policy=st.sampled_from(["fast", "accurate", "guard", "wan_fast"]))
def test_scaled_operands_match_their_unit_twin_or_raise(a, b, c, policy):
    """q, k, v scaled by 10**a, 10**b, 10**c: the call raises the range error, or its error against exact
    attention matches that of its twin within the policy's documented bound. The twin has the same raw
    scores from balanced operands, q and k both scaled by 10**((a + b) / 2), and unit v (anchored policies
    place their margin in raw units, so the softmax scale cannot stand in for the operands' magnitude).
    No third outcome: where the twin's scores are out of range, the scaled call raises too; except where both sit
    at the edge of the row reference's window (the twin's only error a few saturated P blocks or empty rows, which
    BF16 and block-scale rounding of differently scaled operands put on either side: a=0, b=1.5566, accurate)."""
    q, k, v = _qkv((1, 4, 128, 64), seed=1)
    scale = 0.125
    qs, ks, vs = (q * 10**a).bfloat16(), (k * 10**b).bfloat16(), (v * 10**c).bfloat16()
    if not all(bool(torch.isfinite(t).all()) and bool((t != 0).any()) for t in (qs, ks, vs)):
        return   # BF16 cannot hold the scaled input itself: not this test's subject
    balanced = 10 ** ((a + b) / 2)
    qt, kt, vt = (q * balanced).bfloat16(), (k * balanced).bfloat16(), v.bfloat16()

    def error(qq, kk, vv):
        try:
            out = fp4vis.attention(qq, kk, vv, policy=policy, scale=scale)
        except fp4vis.RangeExceededError as exc:
            return exc
        return fp4vis.rel_l2(out.float(), fp4vis.attention(qq, kk, vv, policy="bf16", scale=scale).float())

    err = error(qs, ks, vs)
    if isinstance(err, Exception):
        return
    twin_err = error(qt, kt, vt)
    if isinstance(twin_err, Exception):
        assert "blocks of" not in str(twin_err) and not any(
            n > 4 for n in map(int, re.findall(r"(\d+) (?:saturated P blocks|rows whose)", str(twin_err)))), (
            f"the scaled call computed (relL2 {err:.3f}) where its twin raises: {twin_err}")
        return
    assert math.isfinite(err) and abs(err - twin_err) <= POLICY_ERROR_SPREAD, (err, twin_err)
