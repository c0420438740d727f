"""The Hopper kernel against the reference emulation, on an sm_90 GPU (skipped elsewhere).

For every supported policy and shape class (full and partial tiles, cross-attention, D = 128 and
64, BF16 and FP16): relative L2 between the kernel and ``backend="reference"`` on the same inputs
<= 5e-3, on iid Gaussian inputs and on wide-dynamic-range inputs (logits scaled towards the
policy's limit, outlier channels); no non-finite outputs. Also: CUDA-graph capture then replay
with new inputs, torch.compile without graph breaks, and ``backend="auto"`` picking the kernel.
"""

import importlib
import math

import pytest
import torch

import fp4vis
from fp4vis.metrics import rel_l2

pytestmark = pytest.mark.gpu(capability=(9, 0))

TOL = 5e-3
POLICIES = ["fast", "wan_fast", "accurate", "guard"]
# (B, H, Sq, Skv, D)
SHAPES = [
    (1, 2, 256, 256, 128),     # whole tiles
    (2, 3, 200, 333, 128),     # partial query and key tiles, cross-attention
    (1, 2, 77, 1000, 64),      # D = 64, one partial query tile
    (1, 1, 130, 40, 64),       # fewer keys than one tile (and than the guard's 128 anchors)
]
# largest logit z*log2(e) we drive each policy to (below its representable range)
LOGIT_LIMIT = {"fast": 100.0, "wan_fast": 100.0, "accurate": 200.0, "guard": 300.0, "fast_bf16round": 100.0,
               "fast_fp8qk": 100.0}
# the inexact Hopper policies, each tested against its own reference (docs/numerics.md section 7)
INEXACT = ["fast_bf16round", "fast_fp8qk"]


def make_inputs(shape, dtype, kind, policy, seed=0):
    b, h, sq, skv, d = shape
    g = torch.Generator(device="cuda").manual_seed(seed)
    q = torch.randn(b, h, sq, d, device="cuda", generator=g)
    k = torch.randn(b, h, skv, d, device="cuda", generator=g)
    v = torch.randn(b, h, skv, d, device="cuda", generator=g)
    if kind == "wide":
        k[..., 1] *= 20.0                       # an outlier channel in K
        v[..., 2] *= 300.0                      # and in V
        v[..., 3] *= 1e-3
        raw_max = (q @ k.transpose(-1, -2)).abs().amax() / math.sqrt(d) * (1 / math.log(2))
        q = q * (LOGIT_LIMIT[policy] / float(raw_max))
    return q.to(dtype), k.to(dtype), v.to(dtype)


def run(q, k, v, policy, backend):
    return fp4vis.attention(q, k, v, policy=policy, backend=backend, range_check="off")


def reference(q, k, v, policy):
    """What the kernel must match. For FP8 Q/K (fast_fp8qk) the reference with the scores formed by
    the tensor cores (torch._scaled_mm): Hopper's FP8 MMA accumulates with reduced precision
    (~1e-4 relative, docs/numerics.md section 7), which Direct-P's rounding turns into 0.3-4 % relL2 against the
    float32 reference (test_fp8qk_kernel_error_is_fp8_accumulation measures both)."""
    pol = fp4vis.get_policy(policy)
    if not pol.qk_fp8:
        return run(q, k, v, policy, "reference")
    reference_mod = importlib.import_module("fp4vis.reference")
    scores = importlib.import_module("fp4vis.evals.kernel_bench").fp8_tensor_core_scores
    out, _ = reference_mod.direct_p_attention(*(t.flatten(0, 1) for t in (q, k, v)), pol, 1 / math.sqrt(q.shape[-1]),
                                              score_product=scores)
    return out.view(q.shape[:-1] + (v.shape[-1],)).to(q.dtype)


@pytest.mark.parametrize("kind", ["gauss", "wide"])
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
@pytest.mark.parametrize("policy", POLICIES + INEXACT)
def test_kernel_matches_reference_bf16(policy, shape, kind):
    q, k, v = make_inputs(shape, torch.bfloat16, kind, policy)
    out = run(q, k, v, policy, "hopper")
    ref = reference(q, k, v, policy)
    assert out.shape == ref.shape and out.dtype == q.dtype
    assert bool(torch.isfinite(out).all())
    err = rel_l2(out, ref)
    assert err <= TOL, f"{policy} {shape} {kind}: relL2 {err:.3e}"


@pytest.mark.parametrize("policy", ["fast", "guard", "fast_fp8qk"])
def test_kernel_matches_reference_fp16(policy):
    q, k, v = make_inputs((2, 2, 300, 300, 128), torch.float16, "gauss", policy, seed=3)
    out = run(q, k, v, policy, "hopper")
    ref = reference(q, k, v, policy)
    assert out.dtype == torch.float16 and bool(torch.isfinite(out).all())
    assert rel_l2(out, ref) <= TOL


def test_auto_uses_kernel():
    q, k, v = make_inputs((1, 2, 128, 128, 128), torch.bfloat16, "gauss", "fast", seed=5)
    assert fp4vis.available_backends()["hopper"] is None
    a = run(q, k, v, "fast", "auto")
    b = run(q, k, v, "fast", "hopper")
    assert torch.equal(a, b)


def test_cuda_graph_replay_new_inputs():
    shape = (1, 2, 256, 384, 128)
    q, k, v = (t.clone() for t in make_inputs(shape, torch.bfloat16, "gauss", "guard", seed=1))
    run(q, k, v, "guard", "hopper")  # compile + warm-up outside capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        run(q, k, v, "guard", "hopper")
        with torch.cuda.graph(graph, stream=stream):
            out = run(q, k, v, "guard", "hopper")
    torch.cuda.current_stream().wait_stream(stream)
    for seed in (11, 12):
        q2, k2, v2 = make_inputs(shape, torch.bfloat16, "gauss", "guard", seed=seed)
        q.copy_(q2)
        k.copy_(k2)
        v.copy_(v2)
        graph.replay()
        torch.cuda.synchronize()
        ref = run(q2, k2, v2, "guard", "reference")
        assert rel_l2(out, ref) <= TOL


def test_torch_compile_no_graph_break():
    from fp4vis.backends.range_record import policy_text
    importlib.import_module("fp4vis.kernels.hopper.op")   # registers torch.ops.fp4vis.hopper_attention
    pol = fp4vis.get_policy("fast")
    q, k, v = make_inputs((1, 2, 256, 256, 128), torch.bfloat16, "gauss", "fast", seed=2)
    scale = 1 / math.sqrt(128)
    text = policy_text(pol)

    def f(q, k, v):
        return torch.ops.fp4vis.hopper_attention(q * 1.0, k, v, scale, text) + 0.0

    torch._dynamo.reset()
    compiled = torch.compile(f, fullgraph=True)
    out = compiled(q, k, v)
    ref = run(q, k, v, "fast", "reference")
    assert rel_l2(out, ref) <= TOL


@pytest.mark.parametrize("policy", ["fast", "fast_fp8qk"])
def test_output_is_bshd_in_memory_as_the_op_declares(policy):
    """The output is (B, H, S, D) laid out as (B, S, H, D), so that a processor's transpose and reshape copy
    nothing; the custom op's fake declares the same strides (opcheck: a compiled graph relies on them)."""
    from fp4vis.backends.range_record import policy_text
    importlib.import_module("fp4vis.kernels.hopper.op")
    b, s, h, d = 2, 300, 3, 128
    q, k, v = (torch.randn(b, s, h * d, device="cuda", dtype=torch.bfloat16).view(b, s, h, d).transpose(1, 2)
               for _ in range(3))
    out = fp4vis.attention(q, k, v, policy=policy, backend="hopper", range_check="off")
    assert out.shape == (b, h, s, d) and out.transpose(1, 2).is_contiguous()
    assert rel_l2(out, reference(q, k, v, policy)) <= TOL
    bshd = fp4vis.attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), policy=policy,
                            backend="hopper", range_check="off", layout="bshd")
    assert bshd.is_contiguous() and torch.equal(bshd, out.transpose(1, 2))
    torch.library.opcheck(torch.ops.fp4vis.hopper_attention, (q, k, v, 1 / math.sqrt(d), policy_text(
        fp4vis.get_policy(policy))), test_utils=("test_schema", "test_faketensor"))


# (schedule, p_path, num_wg[, block_scales[, ctas_per_sm]]); the default block_scales is "quad" (128-key
# tiles); ctas_per_sm 2: the short-sequence variant (two CTAs per SM)
KERNEL_VARIANTS = [("pingpong", "packed", 2), ("pingpong", "scalar", 2), ("serial", "packed", 2),
                   ("serial", "scalar", 2), ("overlap", "packed", 2), ("pingpong", "packed", 3),
                   ("serial", "packed", 3), ("pingpong", "packed_alu", 2), ("serial", "packed", 1),
                   ("pingpong", "packed", 2, "lane"), ("serial", "scalar", 2, "lane"),
                   ("serial", "packed", 1, "", 2), ("serial", "scalar", 1, "lane", 2)]


def variant_kwargs(variant) -> dict:
    schedule, p_path, num_wg, *rest = variant
    return dict(schedule=schedule or None, p_path=p_path or None, num_wg=num_wg or None,
                block_scales=(rest[0] if rest else "") or None, ctas_per_sm=(rest[1] if len(rest) > 1 else 0) or None)


def kernel_variant(q, k, v, pol, scale, **variant):
    """The Hopper launcher with a kernel variant (``KernelConfig.make``'s keywords; none: the default variant,
    one CTA per SM): what the tests and the benchmarks hand it."""
    from fp4vis.call import AttentionCall
    from fp4vis.kernels.hopper.config import KernelConfig
    from fp4vis.kernels.hopper.launch import attention
    cfg = KernelConfig.from_policy(pol, q.shape[-1], "bf16" if q.dtype == torch.bfloat16 else "fp16", **variant)
    return attention(AttentionCall(q, k, v, pol, scale), cfg)


@pytest.mark.parametrize("variant", KERNEL_VARIANTS, ids=lambda v: "-".join(map(str, v)))
@pytest.mark.parametrize("shape", SHAPES + [(1, 1, 64, 64 * 7 + 5, 128)], ids=lambda s: "x".join(map(str, s)))
@pytest.mark.parametrize("policy", ["fast", "accurate", "guard", "fast_fp8qk"])
def test_kernel_variants_match_reference(policy, shape, variant):
    """Every schedule (ping-pong and serial with 128-key tiles, overlapped with 64-key tiles; the
    128-anchor guard runs the default schedule in place of the overlapped one), the P paths (packed
    with the FFMA or the integer rounding constant, scalar), one (serial), two and three consumer
    warpgroups (three: 64-key tiles; the guard keeps two), odd and even tile counts, block constants
    per quad (the default) and per thread, one and two CTAs per SM."""
    pol = fp4vis.get_policy(policy)
    q, k, v = make_inputs(shape, torch.bfloat16, "wide", policy, seed=7)
    scale = 1 / math.sqrt(shape[-1])
    out = kernel_variant(q, k, v, pol, scale, **variant_kwargs(variant))
    ref = reference(q, k, v, policy)
    assert bool(torch.isfinite(out).all())
    assert rel_l2(out, ref) <= TOL


def spread_inputs(shape, policy, seed):
    """Gaussian q, k, v (BF16) with every query row and every 32-key block scaled by its own power of
    two (2^-4 .. 2^2): Gaussian inputs alone give nearly one exponent per block and row everywhere, so
    a scale or block constant applied to the wrong row, block, tile or thread shows up."""
    b, h, sq, skv, d = shape
    q, k, v = make_inputs(shape, torch.float32, "gauss", policy, seed=seed)
    g = torch.Generator(device="cuda").manual_seed(seed + 1)
    q = q * 2.0 ** torch.randint(-4, 3, (b, h, sq, 1), device="cuda", generator=g)
    block_scale = 2.0 ** torch.randint(-4, 3, (b, h, -(-skv // 32), 1), device="cuda", generator=g)
    k = k * block_scale.repeat_interleave(32, 2)[:, :, :skv]
    return q.bfloat16(), k.bfloat16(), v.bfloat16()


QUAD_POLICIES = ["fast", "wan_fast", "accurate", "guard", "fast_bf16round", "fast_fp8qk"]
QUAD_CASES = ([(p, "pingpong", "packed") for p in QUAD_POLICIES]
              + [(p, "serial", "scalar") for p in ("fast", "accurate")])


@pytest.mark.parametrize("kind", ["wide", "gauss", "spread"])
@pytest.mark.parametrize("shape", SHAPES + [(1, 1, 64, 64 * 7 + 5, 128)], ids=lambda s: "x".join(map(str, s)))
@pytest.mark.parametrize("case", QUAD_CASES, ids=lambda c: "-".join(c))
def test_quad_block_constants_bit_identical(case, shape, kind):
    """Block constants made once per quad and shuffled (block_scales "quad", the default) give the same
    bits as every thread making all of them ("lane"): the same operations, only where they run. Both
    P paths (packed: alpha' read back off the BF16 pair; scalar: alpha' shuffled itself), both
    128-key schedules, native exp2 positions and anchors, per-row and per-block spread scales."""
    policy, schedule, p_path = case
    pol = fp4vis.get_policy(policy)
    q, k, v = (spread_inputs(shape, policy, 17) if kind == "spread"
               else make_inputs(shape, torch.bfloat16, kind, policy, seed=17))
    scale = 1 / math.sqrt(shape[-1])
    quad = kernel_variant(q, k, v, pol, scale, schedule=schedule, p_path=p_path, block_scales="quad")
    lane = kernel_variant(q, k, v, pol, scale, schedule=schedule, p_path=p_path, block_scales="lane")
    assert torch.equal(quad, lane), f"max |diff| {(quad.float() - lane.float()).abs().max().item()}"


@pytest.mark.parametrize("kind", ["wide", "spread"])
@pytest.mark.parametrize("shape", SHAPES + [(1, 1, 64, 64 * 7 + 5, 128), (2, 3, 1100, 1100, 64)],
                         ids=lambda s: "x".join(map(str, s)))
@pytest.mark.parametrize("policy", QUAD_POLICIES)
def test_short_variant_bit_identical_to_default(policy, shape, kind):
    """The short-sequence variant (one serial warpgroup, two CTAs per SM) gives the default kernel's bits
    (ping-pong, one CTA per SM): the same matrix products and Direct-P per 64-row slab, in the same tile
    order. Every policy, D = 64 and 128, partial query and key tiles, odd tile counts, key lengths
    on both sides of backend.SHORT_SEQ."""
    pol = fp4vis.get_policy(policy)
    q, k, v = (spread_inputs(shape, policy, 19) if kind == "spread"
               else make_inputs(shape, torch.bfloat16, kind, policy, seed=19))
    scale = 1 / math.sqrt(shape[-1])
    default = kernel_variant(q, k, v, pol, scale, ctas_per_sm=1)
    short = kernel_variant(q, k, v, pol, scale, ctas_per_sm=2)
    # bit patterns, non-finite values included: on the 1100-key wide inputs `accurate`'s reference itself
    # has a non-finite output (both kernels reproduce it)
    assert torch.equal(short.view(torch.int16), default.view(torch.int16)), \
        f"max |diff| {(short.float() - default.float()).nan_to_num().abs().max().item()}"
    # the public call (short where both sequences are at most SHORT_SEQ)
    assert torch.equal(run(q, k, v, pol, "hopper").view(torch.int16), default.view(torch.int16))


E2M1_BOUNDARIES = (0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0)


@pytest.mark.parametrize("d", [128, 64])
@pytest.mark.parametrize("policy", POLICIES)
def test_codes_match_reference_up_to_rounding_boundaries(policy, d):
    """With V = identity (Skv = D keys) the output row is P-tilde / l, so the kernel's E2M1 codes can be
    read back. Codes may differ from the reference's only where the reference's value lies within
    float32 rounding distance of an E2M1 rounding boundary (or its block exponent within rounding
    distance of an integer), and only rarely."""
    from fp4vis import key_positions
    from fp4vis import reference as ref

    pol = fp4vis.get_policy(policy)
    g = torch.Generator(device="cuda").manual_seed(17)
    b, h, sq, skv = 1, 2, 96, d
    q = (torch.randn(b, h, sq, d, device="cuda", generator=g) * 2).to(torch.bfloat16)
    k = (torch.randn(b, h, skv, d, device="cuda", generator=g) * 2).to(torch.bfloat16)
    v = torch.eye(skv, d, device="cuda").expand(b, h, skv, d).to(torch.bfloat16).contiguous()
    scale = 1 / math.sqrt(d)
    out = run(q, k, v, policy, "hopper").float().flatten(0, 1)

    ops = ref.quantize_operands(q.flatten(0, 1), k.flatten(0, 1), v.flatten(0, 1), pol, scale)
    nkp = ops.k.shape[1]
    raw = ops.q @ ops.k.mT
    m = ref.row_reference(ops.q, ops.k, ops.num_keys, ops.s, pol)
    valid = torch.arange(nkp, device="cuda") < ops.num_keys
    native = key_positions.native_positions(nkp, device="cuda") if pol.native_exp2 else None
    blk = ref.direct_p_block(raw, m, ops.s, pol, valid, native)
    codes_ref = blk.codes.flatten(-2)[..., :skv]                               # (G, Sq, Skv), physical
    u_work = blk.u.double().clamp(min=pol.shift + 1)
    alpha = torch.exp2(u_work - pol.shift - 127).repeat_interleave(32, dim=-1)[..., :skv]
    perm = ops.perm if ops.perm is not None else torch.arange(skv, device="cuda")
    out_phys = out[..., perm].double()                                        # column p = physical key p
    # out = sum (alpha' q)(alpha c) / (6 l) with alpha c = 6 for V = I: out = alpha' q / l
    codes_k = torch.round(out_phys * blk.weighted_sum.unsqueeze(-1) / alpha * 2) / 2
    diff = codes_k != codes_ref
    frac = float(diff.double().mean())
    assert frac < 2e-3, f"{frac:.2e} of codes differ"
    if diff.any():
        # the reference's pre-rounding value at the differing codes must sit near a boundary
        r = raw.double().unflatten(-1, (-1, 32))
        e_bar = (u_work - 127).unsqueeze(-1)
        x = ((r - m.unsqueeze(-1)) * ops.s + (math.log2(6) - e_bar)).flatten(-2)[..., :skv]
        y = (pol.affine_a * x + pol.affine_b).clamp(min=0)
        if native is not None:
            y = torch.where(native[:skv], torch.exp2(x), y)
        bnd = torch.tensor(E2M1_BOUNDARIES, dtype=torch.float64, device="cuda")
        dist = (y[diff].unsqueeze(-1) - bnd).abs().amin(-1) / y[diff].abs().clamp(min=1.0)
        assert float(dist.max()) < 1e-4, f"codes differ away from a rounding boundary: {float(dist.max()):.2e}"


@pytest.mark.parametrize("policy", ["fast", "guard", "fast_fp8qk"])
def test_non_finite_inputs(policy):
    """docs/numerics.md section 6 on the kernel path: the pre-pass turns NaN/Inf into NaN operands and the kernel
    propagates them (a bad q row gives a NaN output row; a bad k or v entry NaN in that head), so
    the range record's check (here fp4vis.check_range) raises ValueError naming the tensor; with
    range_check="off" the NaNs come back, as from SDPA — never a finite number from a quantized Inf."""
    g = torch.Generator(device="cuda").manual_seed(3)
    q, k, v = (torch.randn(1, 3, 300, 128, device="cuda", generator=g, dtype=torch.bfloat16) for _ in range(3))
    for name, bad in (("q", q), ("k", k), ("v", v)):
        x = bad.clone()
        x[0, 1, 17, 9] = math.inf
        args = {"q": q, "k": k, "v": v, name: x}
        fp4vis.attention(args["q"], args["k"], args["v"], policy=policy, backend="hopper")
        with pytest.raises(ValueError, match=f"{name}: contains Inf"):
            fp4vis.check_range()
    q[0, 0, 5, 3] = math.nan
    k[0, 1, 200, 0] = math.inf
    v[0, 2, 17, 9] = -math.inf
    out = fp4vis.attention(q, k, v, policy=policy, backend="hopper", range_check="off")
    row_nan = torch.isnan(out).any(-1)[0]          # (H, S)
    assert row_nan[0, 5] and not row_nan[0, torch.arange(300, device="cuda") != 5].any()
    assert row_nan[1].all()
    assert torch.isnan(out[0, 2]).any(-1).all()


@pytest.mark.parametrize("policy", INEXACT)
def test_inexact_kernel_follows_its_own_reference(policy):
    """An inexact policy's kernel implements that policy (code_rounding="bf16", FP8 Q/K), not merely
    fast within tolerance: its output is far closer to its own reference than to fast's."""
    q, k, v = make_inputs((1, 4, 512, 512, 128), torch.bfloat16, "gauss", "fast", seed=11)
    out = run(q, k, v, policy, "hopper")
    own = rel_l2(out, reference(q, k, v, policy))
    other = rel_l2(out, run(q, k, v, "fast", "reference"))
    assert own <= TOL and other > 10 * max(own, 1e-4), (own, other)


@pytest.mark.parametrize("kind", ["gauss", "wide"])
@pytest.mark.parametrize("shape", SHAPES + [(1, 1, 64, 64 * 7 + 5, 128)], ids=lambda s: "x".join(map(str, s)))
def test_fp8qk_kernel_error_is_fp8_accumulation(shape, kind):
    """Where the fast_fp8qk kernel leaves its float32 reference (up to 4e-2 relL2 here), it is FP8
    accumulation alone: against the reference fed with the tensor cores' own FP8 scores it is equal
    up to FP32 summation order (measured on the H200: 0 in 7 of 10 cases, at most 1.7e-4)."""
    pol = fp4vis.get_policy("fast_fp8qk")
    q, k, v = make_inputs(shape, torch.bfloat16, kind, "fast_fp8qk", seed=7)
    out = run(q, k, v, pol, "hopper")
    err_float32 = rel_l2(out, run(q, k, v, pol, "reference"))
    err_tc = rel_l2(out, reference(q, k, v, pol))
    print(f"fp8qk {shape} {kind}: relL2 vs float32 reference {err_float32:.3e}, vs FP8-scores reference {err_tc:.3e}")
    assert err_tc <= 1e-3 and err_float32 < 0.1


@pytest.mark.parametrize("variant", [("pingpong", "packed", 2), ("pingpong", "packed", 3), ("serial", "scalar", 2),
                                     ("pingpong", "packed", 2, "lane"), ("serial", "packed", 1, "", 2)],
                         ids=lambda v: "-".join(map(str, v)))
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
def test_fp8qk_spread_scales(shape, variant):
    """Per-row and per-32-key-block scales that differ: each query row and each key block is scaled
    by its own power of two (2^-4 .. 2^2; Gaussian inputs give nearly one exponent everywhere), so a
    scale applied to the wrong row, block, tile or warpgroup shows up. 64- and 128-key tiles."""
    pol = fp4vis.get_policy("fast_fp8qk")
    d = shape[-1]
    q, k, v = spread_inputs(shape, "fast_fp8qk", 13)
    scale = 1 / math.sqrt(d)
    out = kernel_variant(q, k, v, pol, scale, **variant_kwargs(variant))
    assert bool(torch.isfinite(out).all())
    assert rel_l2(out, reference(q, k, v, pol)) <= TOL


def test_fp8qk_falls_back_with_anchors():
    """FP8 Q/K with anchors is not in the kernel: auto falls back to the reference, hopper raises."""
    pol = fp4vis.get_policy("fast_fp8qk").replace(name="fp8_anchored", anchor=32, margin=8.0)
    q, k, v = make_inputs((1, 1, 64, 64, 128), torch.bfloat16, "gauss", "fast", seed=2)
    with pytest.raises(RuntimeError, match="fp8_e4m3"):
        fp4vis.attention(q, k, v, policy=pol, backend="hopper", range_check="off")
    with pytest.warns(UserWarning):
        out = fp4vis.attention(q, k, v, policy=pol, backend="auto", range_check="off")
    assert rel_l2(out, run(q, k, v, pol, "reference")) == 0
