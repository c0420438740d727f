"""docs/numerics.md sections 2-4: the reference emulation, checked by hand, against a plain-Python
re-implementation, and by the orderings of section 5."""

import math

import pytest
import torch

import fp4vis
from fp4vis import formats as fm
from fp4vis import key_positions
from fp4vis import reference as ref
from fp4vis.policy import POLICIES, Policy, guard_policy

LN2 = math.log(2.0)


def gaussian(*shape, seed=0, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, generator=g).to(dtype)


def brute_e2m1(x: float) -> float:
    mags = [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0]
    m = min(abs(x), 6.0)
    best = min(range(8), key=lambda i: (abs(mags[i] - m), i % 2))
    return math.copysign(mags[best], x)


# ------------------------------------------------------------------------------ worked by hand

def hand_case():
    """1 query, 32 keys, D = 16. q = (6, 0, ...) and k_j = (a_j, 6, 0, ...) quantize exactly
    (block amax 6 -> scale 1), so raw_j = 6 a_j. scale = ln2/8 makes s = scale*log2(e) = 1/8."""
    a = [6, 4, 3, 2, 1.5, 1, 0] + [0] * 25
    q = torch.zeros(1, 1, 1, 16)
    q[..., 0] = 6.0
    k = torch.zeros(1, 1, 32, 16)
    k[0, 0, :, 0] = torch.tensor(a, dtype=torch.float32)
    k[0, 0, :, 1] = 6.0
    v = torch.zeros(1, 1, 32, 16)
    v[0, 0, :, 0] = torch.tensor([1, 0.5, 0.25, 1, 0.5, 1] + [1] * 26)  # MXFP4 exact: amax 1, alpha 1
    return q, k, v, LN2 / 8


def test_fast_policy_worked_by_hand():
    # raw = [36, 24, 18, 12, 9, 6, 0...]; log2 domain raw/8; block max g = 4.5
    # e = floor(4.5 + 1 - log2 1.5) = floor(4.915) = 4; u = 131 > L + 1 = 17, so e_bar = 4
    # x = raw/8 + log2 6 - 4; affine 1.5 x + 1.2:
    #   36: 3.0850 -> 5.827 -> 6     24: 1.5850 -> 3.577 -> 4     18: 0.8350 -> 2.452 -> 2
    #   12: 0.0850 -> 1.327 -> 1.5   9: -0.2900 -> 0.765 -> 1    6: -0.6650 -> 0.202 -> 0   0: < 0 -> 0
    # codes [6, 4, 2, 1.5, 1, 0...]: sum 14.5; numerator 6*1 + 4*.5 + 2*.25 + 1.5*1 + 1*.5 = 10.5
    q, k, v, scale = hand_case()
    out = fp4vis.attention(q, k, v, policy="fast", scale=scale, backend="reference")
    assert out[0, 0, 0, 0].item() == pytest.approx(10.5 / 14.5, rel=1e-7)
    assert out[0, 0, 0, 1:].abs().max() == 0

    raw = (q[0, 0] @ k[0, 0].T).float()
    blk = ref.direct_p_block(raw, torch.zeros(1, 1, dtype=torch.float64), 1 / 8, POLICIES["fast"],
                             torch.ones(32, dtype=torch.bool), None)
    assert blk.codes.flatten().tolist() == [6, 4, 2, 1.5, 1] + [0] * 27
    assert blk.u.flatten().tolist() == [131]
    # stored scale alpha' = 2**(131 - 16 - 127) = 2**-12; l = alpha' * 14.5 (the /6 comes at the end)
    assert blk.weighted_sum.item() == 14.5 * 2.0 ** -12
    assert blk.p_scaled.flatten()[0].item() == 6 * 2.0 ** -12


def test_accurate_policy_worked_by_hand():
    # 32 keys <= 32 anchors: every key is a sample, the order is unchanged; a = 36.
    # m = 36 + 64 ln2 (code units); g = (36 - m)/8 = -8 ln2 = -5.5452; e = floor(-5.1302) = -6
    # u = 121 > L + 1 = 9, e_bar = -6; x = (raw - 36)/8 - 5.5452 + log2 6 + 6 = (raw - 36)/8 + 3.0398
    #   36: 3.0398 -> native (j = 0: pair 0 = quarter 0) 2**x = 8.22 -> 6
    #   24: 1.5398 -> native (j = 1, pair 0) 2**x = 2.908 -> 3
    #   18: 0.7898 -> affine (j = 2, pair 1) 1.65 x + .8 = 2.103 -> 2
    #   12: 0.0398 -> affine 0.866 -> 1      9: -0.3352 -> affine 0.247 -> 0
    #    6: -0.7102 -> affine < 0 -> 0       0: -1.46 -> j = 8, 9 (pair 4) native 2**x = 0.363 -> 0.5
    q, k, v, scale = hand_case()
    expected = [6, 3, 2, 1, 0, 0, 0, 0, 0.5, 0.5] + [0] * 6 + [0.5, 0.5] + [0] * 6 + [0.5, 0.5] + [0] * 6
    # native pairs for block 0 are 0, 8, 4, 12 -> positions 0,1, 16,17, 8,9, 24,25
    raw = (q[0, 0] @ k[0, 0].T).float()
    m = torch.tensor([[36 + 64 * LN2]], dtype=torch.float64)
    blk = ref.direct_p_block(raw, m, 1 / 8, POLICIES["accurate"], torch.ones(32, dtype=torch.bool),
                             key_positions.native_positions(32))
    assert blk.codes.flatten().tolist() == expected
    assert blk.u.flatten().tolist() == [121]
    v_col = [1, 0.5, 0.25, 1, 0.5, 1] + [1] * 26
    num = sum(c * x for c, x in zip(expected, v_col, strict=True))
    out = fp4vis.attention(q, k, v, policy="accurate", scale=scale, backend="reference")
    assert out[0, 0, 0, 0].item() == pytest.approx(num / sum(expected), rel=1e-7)


def test_native_positions_pattern():
    nat = key_positions.native_positions(128)
    assert nat.float().mean() == 0.25
    assert nat[:32].nonzero().flatten().tolist() == [0, 1, 8, 9, 16, 17, 24, 25]
    assert nat[32:64].nonzero().flatten().tolist() == [2, 3, 8, 9, 18, 19, 24, 25]
    assert nat[96:128].nonzero().flatten().tolist() == [6, 7, 8, 9, 22, 23, 24, 25]


def test_anchor_indices_and_permutation():
    assert key_positions.anchor_indices(10, 32).tolist() == list(range(10))
    idx = key_positions.anchor_indices(1000, 32)
    assert idx[0] == 0 and idx[-1] == 999 and len(set(idx.tolist())) == 32
    expected = [round(i * 999 / 31) for i in range(32)]  # no exact .5 ties at these sizes
    assert idx.tolist() == expected
    perm = key_positions.anchor_permutation(1000, 32)
    assert perm[:32].tolist() == expected
    assert sorted(perm.tolist()) == list(range(1000))
    rest = perm[32:].tolist()
    assert rest == sorted(rest)


# ------------------------------------------------------------------------------ plain-Python twin

def python_direct_p(q, k, v, policy: Policy, scale: float) -> torch.Tensor:
    """docs/numerics.md section 2-4 written as loops over rows and blocks with Python floats, for tiny inputs
    (G, S, D). Uses fp4vis.formats for the operand formats (tested on their own)."""
    G, Sq, D = q.shape
    S = k.shape[1]
    perm = list(range(S))
    if policy.anchor:
        idx = [round(x) for x in torch.linspace(0, S - 1, policy.anchor, dtype=torch.float64).tolist()]
        if S <= policy.anchor:
            idx = list(range(S))
        perm = idx + [j for j in range(S) if j not in set(idx)]
    k, v = k[:, perm], v[:, perm]
    Dp = -(-D // 16) * 16
    layout = "folded64_mse" if policy.qk_format == "folded64_mse" and Dp % 32 == 0 else "block16"
    if policy.qk_fp8:   # per query row, per 32 physical keys
        qd, kd = fm.fp8_pow2_qdq(q, 1), fm.fp8_pow2_qdq(k, 32)
    else:
        qd = fm.nvfp4_quantize(torch.nn.functional.pad(q, (0, Dp - D)), layout).dequantize()
        kd = fm.nvfp4_quantize(torch.nn.functional.pad(k, (0, Dp - D)), layout).dequantize()
    v6 = fm.mxfp4_quantize(v).dequantize(times_six=True)
    s = scale / LN2
    L = policy.shift
    out = torch.zeros(G, Sq, v.shape[-1], dtype=torch.float64)
    for g in range(G):
        raw = (qd[g] @ kd[g].T).tolist()  # float32 products, then Python floats
        for i in range(Sq):
            row = raw[i]
            m = 0.0
            if policy.anchor:
                a = max(row[: min(policy.anchor, S)])
                m = a + (policy.margin * LN2 if policy.margin_units == "code" else policy.margin / s)
            num = [0.0] * v.shape[-1]
            den = 0.0
            for b0 in range(0, S, 32):
                keys = range(b0, min(b0 + 32, S))
                gmax = (max(row[j] for j in keys) - m) * s
                e = math.floor(gmax + 1 - math.log2(1.5))
                u = min(max(e + 127, 0), 254)
                ub = max(u, L + 1)
                alpha = 2.0 ** (ub - L - 127)
                for j in keys:
                    x = (row[j] - m) * s + math.log2(6) - (ub - 127)
                    pair, quarter = (j % 32) // 2, (j // 32) % 4
                    native = policy.native_exp2 and pair in (quarter, quarter + 8, 4, 12)
                    c = brute_e2m1(2.0 ** x) if native else brute_e2m1(max(0.0, policy.affine_a * x + policy.affine_b))
                    if u == 0:
                        c = 0.0
                    den += alpha * c
                    for d in range(v.shape[-1]):
                        num[d] += alpha * c * float(v6[g, j, d])
            for d in range(v.shape[-1]):
                out[g, i, d] = num[d] / (6 * den)
    return out


@pytest.mark.parametrize("policy", ["fast", "wan_fast", "accurate", "guard", "fast_fp8qk", "fp8qk_anchored"])
@pytest.mark.parametrize("sq, skv, d", [(5, 70, 64), (3, 33, 16), (4, 40, 48)])
def test_reference_matches_plain_python(policy, sq, skv, d):
    pol = POLICIES.get(policy) or POLICIES["fast_fp8qk"].replace(name=policy, anchor=8, margin=4.0)
    q, k, v = gaussian(2, sq, d, seed=1) * 2, gaussian(2, skv, d, seed=2) * 2, gaussian(2, skv, d, seed=3)
    scale = 1 / math.sqrt(d)
    got, report = ref.direct_p_attention(q, k, v, pol, scale)
    assert report.ok
    want = python_direct_p(q, k, v, pol, scale)
    assert torch.allclose(got.double(), want, rtol=2e-6, atol=1e-7)


def test_margin_units_paper():
    pol = POLICIES["accurate"].replace(margin_units="paper", name="accurate_paper")
    q, k, v = gaussian(1, 4, 32, seed=4), gaussian(1, 50, 32, seed=5), gaussian(1, 50, 32, seed=6)
    got, _ = ref.direct_p_attention(q, k, v, pol, 0.2)
    assert torch.allclose(got.double(), python_direct_p(q, k, v, pol, 0.2), rtol=2e-6, atol=1e-7)
    # The two units shift g by M*scale and by M binades. Codes agree when the shifts differ by a
    # whole number of binades (here M(1 - scale) = 32) and no block reaches the floor; otherwise the
    # fractional part moves each block maximum within [4.5, 9) (see docs/numerics.md).
    paper, _ = ref.direct_p_attention(q, k, v, pol, 0.5)
    code, _ = ref.direct_p_attention(q, k, v, POLICIES["accurate"], 0.5)
    assert torch.equal(paper, code)
    paper, _ = ref.direct_p_attention(q, k, v, pol, 0.2)
    code, _ = ref.direct_p_attention(q, k, v, POLICIES["accurate"], 0.2)
    assert not torch.equal(paper, code)


# ------------------------------------------------------------------------------ structure

def test_chunking_does_not_change_results(monkeypatch):
    """Chunks of 96 keys (not a multiple of 128: the native pattern must follow the physical block
    index) and a few queries give the same codes as one chunk."""
    q, k, v = gaussian(1, 3, 100, 64, seed=7), gaussian(1, 3, 300, 64, seed=8), gaussian(1, 3, 300, 64, seed=9)
    for policy in ("fast", "accurate", "guard", "nv_fp8"):
        full = fp4vis.attention(q, k, v, policy=policy)
        monkeypatch.setattr(ref, "CHUNK_ELEMENTS", 96 * 10)
        monkeypatch.setattr(ref, "KEY_CHUNK", 96)
        assert ref._chunk_sizes(3, 100, 320, 32) == (1, 10, 96)
        chunked = fp4vis.attention(q, k, v, policy=policy)
        monkeypatch.undo()
        # same codes everywhere; only the float32 summation order of P V across key chunks moves
        assert torch.allclose(full, chunked, rtol=1e-5, atol=1e-6), policy


@pytest.mark.parametrize("policy", ["fast", "fast_fp8qk", Policy("fast_native", native_exp2=True)])
def test_key_shards_added_in_order_are_bit_identical_to_the_whole_sequence(policy, monkeypatch):
    """DirectPAccumulator (ring attention's key shards): with a fixed row reference the partial sums of
    key shards add, and cutting keys at the whole sequence's chunks keeps one call's float32 order,
    whatever the shard boundaries (here not multiples of 32, and inside the 96-key chunks)."""
    monkeypatch.setattr(ref, "KEY_CHUNK", 96)
    pol = fp4vis.get_policy(policy)
    q, k, v = gaussian(2, 40, 32, seed=1), gaussian(2, 301, 32, seed=2), gaussian(2, 301, 32, seed=3)
    whole, report = ref.reference_attention(q, k, v, pol, 0.125)
    for cuts in ([301], [150, 151], [1, 37, 40, 223], [96, 96, 96, 13]):
        acc = ref.DirectPAccumulator(q, pol, 0.125, num_keys=301)
        start = 0
        for n in cuts:
            acc.add(k[:, start:start + n], v[:, start:start + n])
            start += n
        out, rep = acc.result()
        assert torch.equal(out, whole), cuts
        assert rep == report and acc.keys_done == 301
    # the partial sums are Direct-P's: num / (6 l) of a prefix is attention over that prefix of keys
    acc = ref.DirectPAccumulator(q, pol, 0.125, num_keys=301)
    acc.add(k[:, :192], v[:, :192])
    prefix = ref.reference_attention(q, k[:, :192], v[:, :192], pol, 0.125)[0]
    assert torch.allclose((acc.numerator.double() / (6 * acc.denominator.unsqueeze(-1))).float(), prefix)


def test_key_shards_need_a_fixed_row_reference():
    q, k, v = gaussian(2, 8, 32, seed=1), gaussian(2, 40, 32, seed=2), gaussian(2, 40, 32, seed=3)
    for name, why in (("accurate", "anchors each row on 32 samples of the whole key sequence"),
                      ("nv_fp8", "is not a Direct-P policy"), ("bf16", "is not a Direct-P policy")):
        assert why in ref.key_stream_reason(POLICIES[name])
        with pytest.raises(ValueError, match=why):
            ref.DirectPAccumulator(q, POLICIES[name], 0.1, num_keys=40)
    assert "qk_global_scale" in ref.key_stream_reason(Policy("g", qk_global_scale=True))
    assert ref.key_stream_reason(POLICIES["fast_fp8qk"]) is None
    acc = ref.DirectPAccumulator(q, POLICIES["fast"], 0.1, num_keys=40)
    acc.add(k[:, :30], v[:, :30])
    with pytest.raises(RuntimeError, match="30 of 40 keys added"):
        acc.result()
    with pytest.raises(ValueError, match="more than num_keys = 40"):
        acc.add(k[:, :11], v[:, :11])
    with pytest.raises(ValueError, match="k: contains NaN"):
        acc.add(torch.full_like(k[:, :5], math.nan), v[:, :5])
    with pytest.raises(ValueError, match="G = 2"):
        acc.add(k[:1, :5], v[:1, :5])


def test_chunks_bound_memory_for_long_sequences():
    cg, cq, ck = ref._chunk_sizes(24, 32768, 32768, 32)
    assert cg * cq * ck <= ref.CHUNK_ELEMENTS and ck % 32 == 0


def test_layouts_cross_attention_dtypes():
    q, k, v = gaussian(2, 3, 17, 64, seed=10), gaussian(2, 3, 45, 64, seed=11), gaussian(2, 3, 45, 64, seed=12)
    bhsd = fp4vis.attention(q, k, v)
    bshd = fp4vis.attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), layout="bshd")
    assert bhsd.shape == (2, 3, 17, 64) and torch.equal(bshd.transpose(1, 2), bhsd)
    for dtype in (torch.bfloat16, torch.float16):
        low = [t.to(dtype) for t in (q, k, v)]
        out = fp4vis.attention(*low)
        assert out.dtype == dtype
        # the same values in float32 give the same result up to the output's rounding
        same_values = fp4vis.attention(*(t.float() for t in low))
        assert torch.equal(out, same_values.to(dtype))


def test_head_dim_padding_is_zero_padding():
    q, k, v = gaussian(1, 2, 9, 40, seed=13), gaussian(1, 2, 64, 40, seed=14), gaussian(1, 2, 64, 40, seed=15)
    pad = (0, 8)
    out = fp4vis.attention(q, k, v, policy="accurate")
    padded = fp4vis.attention(*(torch.nn.functional.pad(t, pad) for t in (q, k)), v, policy="accurate",
                              scale=1 / math.sqrt(40))
    assert torch.equal(out, padded)


def test_anchor_permutation_is_what_the_anchored_policy_sees():
    """An anchored policy equals the same policy without anchors on keys and values permuted by
    hand, with the row reference supplied the same way (anchor max over the first n physical keys)."""
    q, k, v = gaussian(1, 1, 6, 32, seed=16), gaussian(1, 1, 200, 32, seed=17), gaussian(1, 1, 200, 32, seed=18)
    pol = POLICIES["guard"]
    perm = key_positions.anchor_permutation(200, 128)
    got, _ = ref.direct_p_attention(q[0], k[0], v[0], pol, 0.1)
    ops = ref.quantize_operands(q[0], k[0][:, perm], v[0][:, perm], pol.replace(anchor=0, margin=0), 0.1)
    m = (ops.q @ ops.k[:, :128].mT).amax(-1, keepdim=True).double() + pol.margin * LN2
    blk = ref.direct_p_block(ops.q @ ops.k.mT, m, ops.s, pol, torch.arange(ops.k.shape[1]) < 200,
                             key_positions.native_positions(ops.k.shape[1]))
    want = (blk.p_scaled @ ops.v6) / (6 * blk.weighted_sum.unsqueeze(-1))
    assert torch.allclose(got, want.float(), rtol=1e-6, atol=1e-7)


# ------------------------------------------------------------------------------ docs/numerics.md section 5

@pytest.mark.parametrize("shape", [(1, 4, 256, 64), (1, 2, 1024, 128)])
def test_orderings_on_gaussian_inputs(shape):
    q, k, v = (gaussian(*shape, seed=s) for s in (20, 21, 22))
    exact = torch.softmax((q.double() @ k.double().mT) / math.sqrt(shape[-1]), -1) @ v.double()
    err = {p: fp4vis.rel_l2(fp4vis.attention(q, k, v, policy=p), exact) for p in POLICIES}
    assert err["bf16"] < 1e-5
    for p in ("fast", "wan_fast", "accurate", "guard"):
        assert 0.15 < err[p] < 0.5, (p, err[p])  # "roughly one third"
    assert err["nv_fp8"] < err["fast"] / 2
    assert err["accurate"] < err["fast"]


@pytest.mark.parametrize("policy", list(POLICIES))
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_every_policy_finite_in_range(policy, dtype):
    q, k, v = (gaussian(1, 2, 100, 64, seed=s, dtype=dtype) * 4 for s in (30, 31, 32))
    out = fp4vis.attention(q, k, v, policy=policy)
    assert torch.isfinite(out).all()


# ------------------------------------------------------------------------------ range

def big_logits(mult):
    q, k, v = gaussian(1, 1, 64, 64, seed=40), gaussian(1, 1, 128, 64, seed=41), gaussian(1, 1, 128, 64, seed=42)
    return q * mult, k * mult, v


def test_fast_saturation_raises_and_points_to_guard():
    q, k, v = big_logits(12)  # logits z ~ up to a few hundred: far past 127 binades above m = 0
    with pytest.raises(fp4vis.RangeExceededError, match="guard"):
        fp4vis.attention(q, k, v, policy="fast")
    with pytest.warns(RuntimeWarning, match="saturated"):
        fp4vis.attention(q, k, v, policy="fast", range_check="warn")
    out = fp4vis.attention(q, k, v, policy="guard")  # anchored: stays in range, finite
    assert torch.isfinite(out).all()
    # logits span hundreds of units, so Q/K quantization alone can move the argmax: compare with
    # exact softmax attention over the same decoded operands (only P's quantization differs)
    ops = ref.quantize_operands(q[0], k[0], v[0], POLICIES["guard"], 1 / 8)
    exact = torch.softmax(ops.q @ ops.k.mT / 8, -1) @ (ops.v6 / 6)
    assert fp4vis.cosine(out[0], exact) > 0.99


def test_fast_underflow_rows_raise():
    q, k, v = big_logits(12)
    q, k = -q.abs(), k.abs()  # every logit very negative: with m = 0 every P block hits the floor
    with pytest.raises(fp4vis.RangeExceededError, match="underflowed"):
        fp4vis.attention(q, k, v, policy="fast")
    assert torch.isfinite(fp4vis.attention(q, k, v, policy="guard")).all()


def test_policy_values_are_its_fields_in_order():
    """``Policy.values()`` (what a compiled call passes as constants) rebuilds the policy, every field in order."""
    import dataclasses

    for pol in [*POLICIES.values(), guard_policy(90, 12, name="g"), Policy("mine", affine_a=1.25, shift=3)]:
        assert pol.values() == tuple(getattr(pol, f.name) for f in dataclasses.fields(pol))
        assert Policy(*pol.values()) == pol


def test_guard_policy_parameters():
    g = guard_policy(112, 14)
    assert (g.margin, g.shift, g.anchor, g.native_exp2) == (112, 14, 128, True)
    assert fp4vis.guard_policy_for_heads(40).shift == 14
    assert fp4vis.guard_policy_for_heads(12) == POLICIES["guard"]


# ------------------------------------------------------------------------------ bad input

@pytest.mark.parametrize("kwargs, exc, match", [
    (dict(policy="fastest"), ValueError, "policy: unknown policy 'fastest'"),
    (dict(layout="sbhd"), ValueError, "layout"),
    (dict(backend="tpu"), ValueError, "backend: unknown backend 'tpu'"),
    (dict(range_check="maybe"), ValueError, "range_check"),
    (dict(scale=-1.0), ValueError, "scale"),
])
def test_bad_options(kwargs, exc, match):
    q = gaussian(1, 1, 8, 16)
    with pytest.raises(exc, match=match):
        fp4vis.attention(q, q, q, **kwargs)


def test_bad_tensors():
    q = gaussian(1, 2, 8, 16)
    bad = q.clone()
    bad[0, 0, 0, 0] = math.nan
    with pytest.raises(ValueError, match="k: contains NaN"):
        fp4vis.attention(q, bad, q)
    bad[0, 0, 0, 0] = math.inf
    with pytest.raises(ValueError, match="v: contains Inf"):
        fp4vis.attention(q, q, bad)
    with pytest.raises(ValueError, match="q: expected a 4-D tensor"):
        fp4vis.attention(q[0], q, q)
    with pytest.raises(ValueError, match="head counts differ"):
        fp4vis.attention(q, q[:, :1], q[:, :1])
    with pytest.raises(ValueError, match="batch sizes differ"):
        fp4vis.attention(q, torch.cat([q, q]), torch.cat([q, q]))
    with pytest.raises(ValueError, match="head dims differ"):
        fp4vis.attention(q, q[..., :8], q)
    with pytest.raises(TypeError, match="q: dtype torch.int32"):
        fp4vis.attention(q.int(), q, q)
    with pytest.raises(TypeError, match="k: dtype torch.float16 differs"):
        fp4vis.attention(q, q.half(), q)


@pytest.mark.parametrize("kwargs, match", [
    (dict(anchor=32, margin=120, shift=8), "M \\+ L <= 126"),
    (dict(affine_a=0.0), "affine_a"),
    (dict(qk_format="block8"), "qk_format"),
    (dict(margin=3.0), "needs anchor"),
    (dict(shift=-1), "shift"),
    (dict(method="int8"), "method"),
])
def test_policy_validation(kwargs, match):
    with pytest.raises(ValueError, match=match):
        Policy("custom", **kwargs)


@pytest.mark.parametrize("kwargs", [dict(affine_a=math.inf), dict(affine_b=math.nan), dict(anchor=32, margin=math.nan),
                                    dict(shift=True), dict(anchor=True)])
def test_policy_rejects_non_finite_and_bool(kwargs):
    with pytest.raises(ValueError, match="Policy 'custom'"):
        Policy("custom", **kwargs)


def test_empty_inputs_give_empty_output():
    q, k = gaussian(2, 3, 0, 16), gaussian(2, 3, 5, 16)
    assert fp4vis.attention(q, k, k).shape == (2, 3, 0, 16)
    assert fp4vis.attention(q[:0], k[:0], k[:0], policy="bf16").shape == (0, 3, 0, 16)


def test_custom_policy_accepted():
    pol = Policy("mine", affine_a=1.55, affine_b=1.0, anchor=64, margin=40, shift=12, native_exp2=True)
    q = gaussian(1, 1, 40, 32)
    assert torch.isfinite(fp4vis.attention(q, q, q, policy=pol)).all()


@pytest.mark.gpu
def test_reference_cuda_matches_cpu():
    q, k, v = (gaussian(1, 2, 130, 64, seed=s) for s in (50, 51, 52))
    for policy in ("fast", "accurate", "nv_fp8"):
        cpu = fp4vis.attention(q, k, v, policy=policy, backend="reference")
        gpu = fp4vis.attention(q.cuda(), k.cuda(), v.cuda(), policy=policy, backend="reference").cpu()
        assert fp4vis.rel_l2(gpu, cpu) < 1e-5


@pytest.mark.gpu
@pytest.mark.parametrize("layout", ["block16", "folded64_mse"])
def test_formats_identical_on_cpu_and_cuda(layout):
    """Exact E4M3 ties of amax/6 (e.g. amax = 6.375 -> 1.0625) must round the same on both devices."""
    g = torch.Generator().manual_seed(60)
    x = torch.randn(4096, 128, generator=g).bfloat16().float()
    ties = fm.e4m3_round(torch.rand(4096, 8, generator=g) * 4 + 0.01)
    x.view(4096, 8, 16)[..., 0] = (ties + torch.exp2(torch.floor(torch.log2(ties)) - 4)) * 6  # midpoints * 6
    cpu, gpu = fm.nvfp4_quantize(x, layout), fm.nvfp4_quantize(x.cuda(), layout)
    assert torch.equal(cpu.codes, gpu.codes.cpu()) and torch.equal(cpu.scales, gpu.scales.cpu())
    assert torch.equal(fm.nvfp4_qdq(x, layout), fm.nvfp4_qdq(x.cuda(), layout).cpu())
    v = torch.randn(2, 300, 64, generator=g)
    assert torch.equal(fm.mxfp4_qdq(v), fm.mxfp4_qdq(v.cuda()).cpu())


def test_code_rounding_bf16_is_a_double_rounding():
    """code_rounding="bf16" (policy fast_bf16round, the Hopper speed trade) rounds y to BF16 first:
    2.5 + 2^-10 is above the 2.5 midpoint (E2M1 3) but its BF16 value is 2.5 (ties to even: 2)."""
    y = torch.tensor([2.5 + 2**-10, 2.5 - 2**-10, 3.5 + 2**-9, 0.7, 5.2, 9.0, -1.0], dtype=torch.float64)
    exact = ref._code(y, POLICIES["fast"])
    via_bf16 = ref._code(y, POLICIES["fast_bf16round"])
    assert exact.tolist() == [3.0, 2.0, 4.0, 0.5, 6.0, 6.0, 0.0]
    assert via_bf16.tolist() == [2.0, 2.0, 4.0, 0.5, 6.0, 6.0, 0.0]


def test_fast_bf16round_trades_little_against_bf16():
    """The inexact policy moves a few codes one step: measurably off the exact fast reference, but
    its error against exact attention is within 1 % of fast's."""
    g = torch.Generator().manual_seed(5)
    q, k, v = (torch.randn(1, 2, 256, 64, generator=g) for _ in range(3))
    exact = fp4vis.attention(q, k, v, policy="bf16")
    fast = fp4vis.attention(q, k, v, policy="fast")
    rounded = fp4vis.attention(q, k, v, policy="fast_bf16round")
    assert 1e-3 < fp4vis.rel_l2(rounded, fast) < 5e-2
    assert abs(fp4vis.rel_l2(rounded, exact) - fp4vis.rel_l2(fast, exact)) < 0.01 * fp4vis.rel_l2(fast, exact)


def test_fast_fp8qk_is_closer_to_exact_attention_than_fast():
    """FP8 Q/K (3 mantissa bits, power-of-two row/block scales) is finer than NVFP4 (1 mantissa bit):
    the policy that trades exactness (docs/numerics.md) for Hopper's FP8 tensor cores is closer to BF16
    attention than fast on Gaussian inputs, and clearly different from fast."""
    g = torch.Generator().manual_seed(6)
    q, k, v = (torch.randn(1, 2, 256, 64, generator=g) for _ in range(3))
    q = q * 2
    exact = fp4vis.attention(q, k, v, policy="bf16")
    fast = fp4vis.attention(q, k, v, policy="fast")
    fp8 = fp4vis.attention(q, k, v, policy="fast_fp8qk")
    assert fp4vis.rel_l2(fp8, exact) < fp4vis.rel_l2(fast, exact)
    assert fp4vis.rel_l2(fp8, fast) > 0.05


def test_direct_p_sensitivity_to_score_noise():
    """What bounds an inexact score product (FP8 MMA accumulation on Hopper, ~1e-4 relative): Direct-P
    rounds every score to a code and every block maximum to an exponent, so noise of 1e-4 times the
    mean |score| moves the output by a few 1e-3 relL2: why the fast_fp8qk kernel, whose scores come
    from FP8 MMA, is tested against the reference fed with the tensor cores' own scores."""
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, 256, 128, generator=g) for _ in range(3))
    ops = ref.quantize_operands(q, k, v, POLICIES["fast"], 128 ** -0.5)
    raw = ops.q @ ops.k.mT
    noisy = raw + 1e-4 * raw.abs().mean() * torch.randn(raw.shape, generator=g)
    m = torch.zeros(2, 256, 1, dtype=torch.float64)
    valid = torch.ones(256, dtype=torch.bool)
    outs = [ref.direct_p_block(r, m, ops.s, POLICIES["fast"], valid, None) for r in (raw, noisy)]
    o = [(b.p_scaled @ ops.v6) / b.weighted_sum.unsqueeze(-1).float() for b in outs]
    assert 1e-3 < fp4vis.rel_l2(o[1], o[0]) < 1e-2


def test_code_rounding_bf16_moves_about_half_a_percent_of_codes():
    """The figure docs/hopper_kernel.md quotes: on Gaussian scores (D = 128 logits, fast's constants)
    the BF16 double rounding moves 0.47 % of all codes (0.7 % of the non-zero ones), one step each."""
    g = torch.Generator().manual_seed(0)
    raw = torch.randn(4, 256, 1024, generator=g) * math.sqrt(128) * 0.9
    m = torch.zeros(4, 256, 1, dtype=torch.float64)
    s = 1 / math.sqrt(128) / math.log(2)
    valid = torch.ones(1024, dtype=torch.bool)
    a = ref.direct_p_block(raw, m, s, POLICIES["fast"], valid, None).codes
    b = ref.direct_p_block(raw, m, s, POLICIES["fast_bf16round"], valid, None).codes
    moved = a != b
    nonzero = (a > 0) | (b > 0)
    assert 0.004 < float(moved.float().mean()) < 0.0055
    assert 0.006 < int(moved.sum()) / int(nonzero.sum()) < 0.008
    steps = {0.0: 0.5, 0.5: 0.5, 1.0: 0.5, 1.5: 0.5, 2.0: 1.0, 3.0: 1.0, 4.0: 2.0}
    lo = torch.minimum(a, b)[moved]
    assert torch.equal((a - b).abs()[moved], torch.tensor([steps[x] for x in lo.tolist()], dtype=a.dtype))


def test_fp8_tensor_core_scores_recovers_the_fp8_operands_exactly():
    """The GPU tests' FP8-scores reference re-encodes the decoded operands: with an exact matrix product
    in place of the tensor cores' it must give exactly the float64 product of the decoded values, also
    for groups whose maximum rounded to a power of two (E4M3 256 * 2^E, where the exponent read off the
    decoded maximum is one too high) and for groups with E4M3 subnormals."""
    from fp4vis.evals.kernel_bench import fp8_tensor_core_scores
    g = torch.Generator().manual_seed(9)
    q = torch.randn(2, 48, 64, generator=g) * torch.logspace(-8, 8, 48, base=2.0)[:, None]
    k = torch.randn(2, 96, 64, generator=g)
    top = 2.0 ** q[:, :8, 1:].abs().amax(-1).log2().ceil()      # 2^E * 128 above every other element
    q[:, :8, 0] = 1.97 * top                                     # -> E4M3 252.2, rounded to 256 ...
    q[:, :8, 2] = top * 2.0 ** -16                               # ... beside the smallest subnormal, 2^-9
    k[:, :32, 5] = 1e-4                                       # E4M3 subnormals beside a large maximum
    k[:, 40, :] = 2.0 ** -3                                    # a power-of-two maximum that is exact
    assert bool((fm.fp8_pow2_quantize(q, 1)[0].abs().amax(-1) == 256).any())   # the ambiguous case occurs
    qd, kd = fm.fp8_pow2_qdq(q, 1), fm.fp8_pow2_qdq(k, 32)
    got = fp8_tensor_core_scores(qd, kd, matmul=lambda q8, k8: q8.double() @ k8.double().mT)
    assert torch.equal(got, qd.double() @ kd.double().mT)    # float64: every sum here is exact


def test_policy_fp8_qk_format_rules():
    pol = POLICIES["fast_fp8qk"]
    assert pol.qk_fp8 and not pol.is_spec_exact and POLICIES["fast"].is_spec_exact
    assert pol.spec_twin().qk_format == "folded64_mse" and pol.spec_twin().is_spec_exact
    with pytest.raises(ValueError, match="qk_global_scale"):
        pol.replace(qk_global_scale=True)


def test_exact_policy_is_finite_for_huge_finite_inputs():
    """docs/numerics.md section 6: finite inputs never give NaN. q = k = 1e20 overflow float32 scores
    (SDPA returns NaN); the exact policy recomputes such a call in float64, where all scores are
    equal and the attention is the mean of V. Inputs in range get SDPA's own bits."""
    q, k, v = (gaussian(1, 2, 33, 64, seed=s).bfloat16() for s in (7, 8, 9))
    sdpa = torch.nn.functional.scaled_dot_product_attention(q, k, v)
    assert torch.equal(fp4vis.attention(q, k, v, policy="bf16"), sdpa)
    for dtype in (torch.bfloat16, torch.float32):
        q = torch.full((1, 2, 5, 64), 1e20, dtype=dtype)
        v = gaussian(1, 2, 5, 64).to(dtype)
        assert not torch.isfinite(torch.nn.functional.scaled_dot_product_attention(q, q, v)).all()
        out = fp4vis.attention(q, q, v, policy="bf16")
        torch.testing.assert_close(out.float(), v.float().mean(-2, keepdim=True).expand_as(v), atol=1e-2, rtol=1e-2)


def test_qk_global_scale_is_applied_once():
    """The per-tensor NVFP4 scale: the operands are decoded without it and it is folded into s once,
    so the log2-domain logits are the paper's (Q̂ K̂ᵀ of the decoded values with 1/G, times the softmax
    scale); against exact attention the option lands where `fast` does (it was applied twice: 0.8)."""
    q, k, v = (gaussian(1, 2, 128, 64, seed=s) * 3 for s in (1, 2, 3))
    pol = POLICIES["fast"].replace(name="fast_global", qk_global_scale=True)
    scale = 0.125
    ops = ref.quantize_operands(q.flatten(0, 1), k.flatten(0, 1), v.flatten(0, 1), pol, scale)
    qq = fm.nvfp4_quantize(q.flatten(0, 1), "folded64_mse", True)
    kq = fm.nvfp4_quantize(k.flatten(0, 1), "folded64_mse", True)
    assert qq.tensor_scale != 1.0 and kq.tensor_scale != 1.0
    assert torch.equal(ops.q, qq.dequantize(tensor_scale=False))
    paper = (qq.dequantize() @ kq.dequantize().mT) * scale * fp4vis.policy.LOG2E
    torch.testing.assert_close((ops.q @ ops.k.mT) * ops.s, paper, rtol=1e-5, atol=1e-5)
    exact = fp4vis.attention(q, k, v, policy="bf16")
    err_global = fp4vis.rel_l2(fp4vis.attention(q, k, v, policy=pol), exact)
    err_fast = fp4vis.rel_l2(fp4vis.attention(q, k, v, policy="fast"), exact)
    assert abs(err_global - err_fast) < 0.1 * err_fast, (err_global, err_fast)
    # an anchored policy: the code-units margin M ln 2 is stated for the true scores, so the row
    # reference sits M ln 2 above the anchor maximum of the paper's logits whatever the tensor scale
    acc = POLICIES["accurate"].replace(name="accurate_global", qk_global_scale=True, qk_format="folded64_mse")
    ops = ref.quantize_operands(q.flatten(0, 1), k.flatten(0, 1), v.flatten(0, 1), acc, scale)
    m = ref.row_reference(ops.q, ops.k, ops.num_keys, ops.s, acc, ops.tensor_scale)
    anchor_max = (ops.q @ ops.k[:, :acc.anchor].mT).amax(-1, keepdim=True).double()
    gap = (m - anchor_max) * ops.tensor_scale          # in the true scores' units
    torch.testing.assert_close(gap, torch.full_like(gap, acc.margin * fp4vis.policy.LN2), rtol=1e-9, atol=1e-9)


def test_output_overflow_is_reported_and_the_advice_fits_the_cause():
    """An FP16 output beyond FP16's range is counted after the cast; its message says the guard does
    not help (the logits are in range). A saturating guard policy is not told to use the guard."""
    q = torch.full((1, 1, 8, 64), 0.1, dtype=torch.float16)
    v = torch.full((1, 1, 64, 64), 60000.0, dtype=torch.float16)
    with pytest.raises(fp4vis.RangeExceededError, match="non-finite output.*guard does not help"):
        fp4vis.attention(q, q[:, :, :1].expand(1, 1, 64, 64), v, policy="fast")
    report = ref.RangeReport(saturated_blocks=3)
    assert "use policy='guard'" in report.describe(POLICIES["fast"]).lower()
    msg = report.describe(POLICIES["guard"]).lower()
    assert "use policy='guard'" not in msg and "larger margin" in msg


def test_gradients_are_straight_through_never_silently_dropped():
    """An FP4 policy has no gradient of its own: with inputs that require grad the output is the FP4
    value and its gradient exact attention's (one warning per policy), never a detached tensor."""
    q, k, v = (gaussian(1, 2, 40, 64, seed=s).requires_grad_(True) for s in (4, 5, 6))
    with pytest.warns(UserWarning, match="straight-through"):
        out = fp4vis.attention(q, k, v, policy="wan_fast")
    with torch.no_grad():
        assert torch.equal(out, fp4vis.attention(q, k, v, policy="wan_fast"))
    out.square().sum().backward()
    grads = [t.grad.clone() for t in (q, k, v)]
    for t in (q, k, v):
        t.grad = None
    exact = torch.nn.functional.scaled_dot_product_attention(q, k, v)
    torch.autograd.backward(exact, 2 * out.detach())
    for got, t in zip(grads, (q, k, v), strict=True):
        torch.testing.assert_close(got, t.grad)


def test_inputs_and_policies_are_checked():
    q = gaussian(1, 1, 8, 64)
    np = pytest.importorskip("numpy")
    torch.testing.assert_close(fp4vis.attention(q, q, q, scale=np.float32(0.125)),
                               fp4vis.attention(q, q, q, scale=0.125))
    for bad in (True, "0.1", float("nan"), -1.0):
        with pytest.raises(ValueError, match="scale"):
            fp4vis.attention(q, q, q, scale=bad)
    with pytest.raises(ValueError, match="k: is a meta tensor"):
        fp4vis.attention(q, q.to("meta"), q)
    with pytest.raises(TypeError, match="native_exp2 must be True or False, got 'no'"):
        Policy("mine", native_exp2="no")
    with pytest.raises(TypeError, match="qk_global_scale must be True or False"):
        Policy("mine", qk_global_scale=1)
    with pytest.raises(TypeError):
        POLICIES["fast"] = Policy("fast", affine_a=9.0)   # the named policies are read-only
    assert POLICIES["fast"].affine_a == 1.5
