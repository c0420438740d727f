"""The FP8 P/V policies (``fp8``, ``fp8pv``; docs/numerics.md section 7) on the CPU: the policy rules, V's
per-channel E4M3 format, the reference against a literal statement of the contract (a key tile at a time, in
float64), their error against exact attention, and the backends' answers."""

import math

import pytest
import torch

import fp4vis
from fp4vis import reference
from fp4vis.formats import E4M3_MAX, e4m3_round, fp8_channel_quantize, fp8_group_exponent
from fp4vis.key_positions import P_E4M3_LOG2, softmax_tile
from fp4vis.metrics import rel_l2
from fp4vis.policy import LOG2E, POLICIES, Policy


def test_fp8_pv_policies_and_rules():
    for name, qk in (("fp8", "fp8_e4m3"), ("fp8pv", "block16")):
        pol = POLICIES[name]
        assert pol.is_fp8_pv and not pol.is_direct_p and pol.qk_format == qk
        assert pol.kernel_params(128, 0.1).pv_fp8
    assert not POLICIES["fast"].kernel_params(128, 0.1).pv_fp8
    with pytest.raises(ValueError, match="online"):
        Policy("x", method="fp8_pv", anchor=32, margin=1.0)
    with pytest.raises(ValueError, match="native_exp2"):
        Policy("x", method="fp8_pv", native_exp2=True)
    with pytest.raises(ValueError, match="code_rounding"):
        Policy("x", method="fp8_pv", code_rounding="bf16")
    with pytest.raises(ValueError, match="method"):
        Policy("x", method="fp4_pv")


def test_an_all_zero_group_scales_by_one():
    """An all-zero FP8 group (a zero V channel, the zero key blocks after a key-masked call's kept keys, a zero query
    row) gets E = 0 on every path, not the -126 floor: its values are 0 under any scale, and a scale of 2^-126
    multiplied into the Hopper kernel's scores could round a masked -inf to NaN."""
    amax = torch.tensor([0.0, 1e-45, 1.0, 300.0])
    assert fp8_group_exponent(amax).tolist() == [0, -126, -7, 1]


def test_v_channel_scale_is_a_power_of_two_and_never_saturates():
    g = torch.Generator().manual_seed(0)
    v = torch.randn(3, 100, 64, generator=g) * torch.logspace(-30, 30, 64)
    v[0, :, 5] = 0.0
    vals, scales = fp8_channel_quantize(v.to(torch.bfloat16))
    assert scales.shape == (3, 1, 64)
    mant, _ = torch.frexp(scales)
    assert bool((mant == 0.5).all())                                      # exact powers of two
    top = vals.abs().amax(-2)
    assert bool((top <= E4M3_MAX).all())
    nonzero = v.abs().amax(-2) > 0
    assert bool(((top >= 128) & (top <= 256))[nonzero].all())    # the channel maximum in [2^7, 2^8), rounded
    assert torch.equal(vals, e4m3_round(vals))                            # E4M3 values
    back = vals * scales
    assert bool(((back - v.bfloat16().float()).abs() <= v.abs().bfloat16().float() * 2.0 ** -4 + 1e-30).all())


def literal_contract(q, k, v, policy, scale):
    """docs/numerics.md section 7 word for word: key tiles of softmax_tile(D) in order, float64 arithmetic on the
    decoded operands; the E4M3 roundings the only approximations."""
    qd, kd, tensor_scale, _ = reference.quantize_qk(q, k, policy)
    v8, v_scale = fp8_channel_quantize(v)
    s = scale * tensor_scale * LOG2E
    qd, kd, v8 = qd.double(), kd.double(), v8.double()
    m = torch.full(qd.shape[:2], -math.inf, dtype=torch.float64)
    num = torch.zeros(qd.shape[:2] + (v.shape[-1],), dtype=torch.float64)
    den = torch.zeros(qd.shape[:2], dtype=torch.float64)
    tile = softmax_tile(qd.shape[-1])
    for k0 in range(0, kd.shape[1], tile):
        t = (qd @ kd[:, k0:k0 + tile].mT) * s
        m_new = torch.maximum(m, t.amax(-1))
        corr = torch.exp2(m - m_new)
        p = torch.exp2(t - m_new.unsqueeze(-1)) * 2.0 ** P_E4M3_LOG2
        p8 = e4m3_round(p.float()).double()
        num = num * corr.unsqueeze(-1) + p8 @ v8[:, k0:k0 + tile]
        den = den * corr + (p8 if qd.shape[-1] != 128 else p).sum(-1)   # D = 128 sums the unrounded P
        m = m_new
    return num / den.unsqueeze(-1) * v_scale.double()


@pytest.mark.parametrize("policy", ["fp8", "fp8pv"])
@pytest.mark.parametrize("skv", [40, 128, 300, 777])
@pytest.mark.parametrize("d", [64, 128])   # 128- and 192-key tiles (softmax_tile)
def test_reference_is_the_contract(policy, skv, d, monkeypatch):
    # small chunks: the running maximum and the sums carried from one key chunk to the next
    monkeypatch.setattr(reference, "CHUNK_ELEMENTS", 50 * 256)
    monkeypatch.setattr(reference, "KEY_CHUNK", 256)
    g = torch.Generator().manual_seed(skv)
    q = torch.randn(2, 50, d, generator=g) * 2 * (8 / d) ** 0.5
    k = torch.randn(2, skv, d, generator=g) + torch.linspace(0, 4, skv)[:, None]   # the maximum moves
    v = torch.randn(2, skv, d, generator=g) * torch.logspace(-2, 3, d)
    pol = POLICIES[policy]
    out, report = reference.fp8_pv_attention(q, k, v, pol, 0.125)
    assert report.ok
    assert rel_l2(out, literal_contract(q, k, v, pol, 0.125)) < 1e-4


def test_errors_against_exact_attention_on_gaussian_inputs():
    """The floor the formats set (docs/numerics.md section 7, ``benchmarks/fp8_error.py``): E4M3 P, E4M3 V and FP8
    Q/K together give about 0.05 on iid Gaussian inputs at D = 128, so ``fp8`` lands there, a sixth of ``fast``'s;
    ``fp8pv`` is ``nv_fp8``'s NVFP4 Q/K with V and P scaled, no worse than it."""
    err = {}
    for seed in range(3):
        g = torch.Generator().manual_seed(seed)
        q, k, v = (torch.randn(1, 4, 512, 128, generator=g).bfloat16() for _ in range(3))
        exact = fp4vis.attention(q, k, v, policy="bf16")
        for p in ("fp8", "fp8pv", "nv_fp8", "fast"):
            err.setdefault(p, []).append(rel_l2(fp4vis.attention(q, k, v, policy=p, backend="reference"), exact))
    mean = {p: sum(e) / len(e) for p, e in err.items()}
    assert 0.04 < mean["fp8"] < 0.06 and mean["fp8"] < mean["fast"] / 5
    assert mean["fp8pv"] <= mean["nv_fp8"] * 1.01


def test_v_beyond_e4m3_range_keeps_its_values():
    """A V channel far past 448 (nv_fp8 saturates it) and one far below 1: V's channel scale keeps both."""
    g = torch.Generator().manual_seed(3)
    q, k, v = (torch.randn(1, 2, 64, 64, generator=g) for _ in range(3))
    v[..., 0] = 5.0e4
    v[..., 1] *= 1e-20
    exact = fp4vis.attention(q, k, v, policy="bf16")
    out = fp4vis.attention(q, k, v, policy="fp8", backend="reference")
    assert rel_l2(out[..., 0], exact[..., 0]) < 2.0 ** -5    # one E4M3 rounding of 5e4 / 2^8: 1.8 %
    assert rel_l2(out[..., 1], exact[..., 1]) < 0.1
    assert rel_l2(fp4vis.attention(q, k, v, policy="nv_fp8", backend="reference")[..., 0], exact[..., 0]) > 0.9


def test_blackwell_declines_the_fp8_pv_policies_with_the_reason():
    from fp4vis.call import AttentionCall
    from fp4vis.kernels.blackwell.backend import BACKEND
    q = torch.randn(1, 1, 8, 64)
    reason = BACKEND.supports(AttentionCall(q, q, q, POLICIES["fp8"], 0.125))
    assert reason is not None and "FP8 P/V" in reason
