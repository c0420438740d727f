"""Blocks whose scale underflows count only where they can change the result beyond the policy's own rounding
(docs/numerics.md section 1, "Scale range"; ``fp4vis.scale_range.significant_underflow``): the cases real models
produce (a near-zero class or register token, zero padding rows, a head whose q is tiny in some channels, a text
token whose embedding is all zeros) compute within the policy's error; operands that really are out of range still
raise; and a call whose worst-case score change is within the limit computes within its twin's error."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import fp4vis
import fp4vis.formats as fm
import fp4vis.scale_range as sr
from fp4vis.policy import LOG2E

POLICIES = ["fast", "accurate", "guard", "wan_fast"]
SCALE = 0.125
# as tests/core/test_scale_range.py: how far the error of a call may be from its twin's (relL2 of 128-197 tokens)
POLICY_ERROR_SPREAD = 0.06


def _qkv(shape=(1, 2, 197, 64), seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(shape, generator=g) for _ in range(3)]


def _error(q, k, v, policy):
    """relL2 of the policy's call against exact attention; None where it raises the range error."""
    q, k, v = (t.bfloat16() for t in (q, k, v))
    try:
        out = fp4vis.attention(q, k, v, policy=policy, scale=SCALE)
    except fp4vis.RangeExceededError:
        return None
    return fp4vis.rel_l2(out.float(), fp4vis.attention(q, k, v, policy="bf16", scale=SCALE).float())


def test_the_criterion_is_exact_at_its_limit():
    """The limit is a float32; the products of two float32 maxima are compared exactly (float64)."""
    s = SCALE * LOG2E
    limit = sr.qk_flush_limit(s)
    assert limit == float(torch.tensor(sr.SCORE_CHANGE_LIMIT / s, dtype=torch.float32))
    at = fm.ScaleRange(3, 0, limit, 0.0), fm.ScaleRange(0, 0, 0.0, 1.0), fm.ScaleRange()
    assert sr.significant_underflow(at, s) == (0, 0, 0)
    above = fm.ScaleRange(3, 0, math.nextafter(limit, math.inf), 0.0), at[1], at[2]
    assert sr.significant_underflow(above, s) == (3, 0, 0)
    v_at = fm.ScaleRange(), fm.ScaleRange(), fm.ScaleRange(2, 0, 2.0**-130, 2.0**-106)
    assert sr.significant_underflow(v_at, s) == (0, 0, 0)
    v_above = fm.ScaleRange(), fm.ScaleRange(), fm.ScaleRange(2, 0, 2.0**-130, 2.0**-107)
    assert sr.significant_underflow(v_above, s) == (0, 0, 2)
    # a v that flushes everywhere: its largest block is a flushed one
    assert sr.significant_underflow((fm.ScaleRange(), fm.ScaleRange(), fm.ScaleRange(5, 0, 1e-39, 1e-39)), s)[2] == 5
    # scores scaled by 0 cannot move
    assert sr.significant_underflow((above[0], at[1], at[2]), 0.0) == (0, 0, 0)


def _class_token(q, k, v):
    for t in (q, k, v):
        t[:, :, 0] *= 3e-6          # a timm class token as initialised (std 1e-6 .. 2e-2), through its projections
    return q, k, v


def _register_tokens(q, k, v):
    for t in (q, k, v):
        t[:, :, 1:5] *= 1e-5
    return q, k, v


def _zero_padding(q, k, v):
    for t in (q, k, v):
        t[:, :, -20:] = 0.0
    return q, k, v


def _tiny_channels(q, k, v):
    q[:, 1, :, :16] *= 1e-4          # one head's q, channels 0..15 and their folded partners 32..47
    q[:, 1, :, 32:48] *= 1e-4
    return q, k, v


def _dead_v_channel(q, k, v):
    v[:, 0, :, 5] *= 1e-40          # a value channel that is all but zero in one head (MXFP4 blocks, FP8 channel scale)
    return q, k, v


def _zero_text_token(q, k, v):
    # a text token whose embedding is all zeros: its projections are the biases alone, here tiny ones
    for t in (q, k, v):
        t[:, :, 7] = 1e-7
    return q, k, v


@pytest.mark.parametrize("case", [_class_token, _register_tokens, _zero_padding, _tiny_channels, _dead_v_channel,
                                  _zero_text_token], ids=lambda f: f.__name__.strip("_"))
@pytest.mark.parametrize("policy", POLICIES + ["fp8", "fp8pv"])
def test_what_real_models_produce_computes_within_the_policys_error(case, policy):
    q, k, v = _qkv()
    unit = _error(q, k, v, policy)
    err = _error(*case(q.clone(), k.clone(), v.clone()), policy)
    assert err is not None, f"{case.__name__} raised"
    assert abs(err - unit) <= POLICY_ERROR_SPREAD, (err, unit)


@pytest.mark.parametrize("policy", POLICIES + ["nv_fp8", "fp8", "fp8pv"])
def test_what_is_wrong_still_raises(policy):
    """docs/numerics.md section 1's cases: q 1e-3 with k 1e3 (relL2 0.81 computed), v 1e-40, saturated k (FP8 Q/K's
    group exponents hold the first two: `fp8` computes them)."""
    q, k, v = (t.bfloat16() for t in _qkv((1, 2, 128, 64)))
    for qs, ks, vs, what in ((q * 1e-3, k * 1e3, v, "blocks of q whose scale underflows"),
                             (q, k * 1e4, v, "blocks of k whose scale saturates"),
                             (q, k, v * 1e-40, "blocks of v whose scale underflows")):
        if policy == "nv_fp8" and what.endswith("v whose scale underflows"):
            continue     # its V is not block-scaled (section 8)
        if policy == "fp8" and not what.startswith("blocks of v"):
            continue
        with pytest.raises(fp4vis.RangeExceededError, match=what):
            fp4vis.attention(qs, ks, vs, policy=policy, scale=SCALE)


def _flushed_groups(x: torch.Tensor, layout: str) -> tuple[float, torch.Tensor]:
    """(the largest over rows of the values of its groups whose chosen E4M3 scale is 0 times their largest
    magnitude; x with those groups zeroed) for BF16-valued x, in float64, stated here on its own from the scales
    the format chose."""
    groups = x.double().unflatten(-1, (-1, 16))
    h = groups.shape[-2] // 2
    if layout == "folded64_mse":
        groups = torch.cat((groups[..., :h, :], groups[..., h:, :]), -1)
    amax = groups.abs().amax(-1)
    gone = (amax > 0) & (fm.e4m3_decode(fm.nvfp4_quantize(x, layout).scales) == 0)
    bound = (gone.sum(-1) * groups.shape[-1] * torch.where(gone, amax, 0.0).amax(-1)).max().item()
    kept = torch.where(gone[..., None], 0.0, groups)
    if layout == "folded64_mse":
        kept = torch.cat((kept[..., :16], kept[..., 16:]), -2)
    return bound, kept.flatten(-2).to(x.dtype)


@settings(max_examples=40, deadline=None)
@given(rows=st.integers(1, 8), channels=st.booleans(), exponent=st.floats(-12, -2),
       policy=st.sampled_from(POLICIES), seed=st.integers(0, 3))
def test_calls_within_the_limit_compute_within_their_twins_error(rows, channels, exponent, policy, seed):
    """Tokens (or one channel group of q) scaled by 10**exponent. The call's worst-case score change (docs/numerics.md
    section 1, computed here from its inputs) decides: beyond the limit it raises; within, it computes, and its
    error against exact attention is its twin's within the policy's spread. The twin has the flushed values set to
    0 beforehand: the same FP4 operands, nothing flushed, exact scores that differ by at most the bound."""
    q, k, v = (t.bfloat16().float() for t in _qkv((1, 2, 128, 64), seed))
    if channels:
        q[..., :16] *= 10**exponent
        q[..., 32:48] *= 10**exponent
    else:
        q[:, :, :rows] *= 10**exponent
        k[:, :, :rows] *= 10**exponent
    q, k = q.bfloat16().float(), k.bfloat16().float()
    layout = fp4vis.get_policy(policy).qk_layout(64)
    (q_bound, q_twin), (k_bound, k_twin) = _flushed_groups(q, layout), _flushed_groups(k, layout)
    worst = SCALE * LOG2E * max(q_bound * k.abs().max().item(), k_bound * q.abs().max().item())
    err = _error(q, k, v, policy)
    if worst > sr.SCORE_CHANGE_LIMIT:
        assert err is None, f"worst-case score change {worst:.3g} computed"
        return
    assert err is not None, f"worst-case score change {worst:.3g} within the limit raised"
    twin = _error(q_twin, k_twin, v, policy)
    assert abs(err - twin) <= POLICY_ERROR_SPREAD, (err, twin)
