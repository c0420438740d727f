"""GPU tests of the Blackwell backend. On a Blackwell GPU they test the product; on the H200 they
run the same kernel source through its sm_90 build (precompiled cubins named by
FP4VIS_BLACKWELL_CUBINS, or a local Triton >= 3.8): everything but the FP4 MMA lowering.

Checks (the Hopper kernel's classes): relL2 <= 5e-3 against fp4vis.reference for every policy and
shape class on Gaussian and wide-range inputs (bit-identical share recorded in
$FP4VIS_BLACKWELL_REPORT when set), no non-finite output where the reference has none, CUDA-graph
replay with new inputs, torch.compile fullgraph, the self-check, bad input."""

from __future__ import annotations

import json
import math

import pytest
import torch

import fp4vis
from fp4vis.call import AttentionCall
from fp4vis.kernels.blackwell.selfcheck import make_inputs
from fp4vis.metrics import rel_l2
from fp4vis.settings import setting


def _route_ok() -> bool:
    if not torch.cuda.is_available():
        return False
    from fp4vis.kernels.blackwell import route
    return not isinstance(route.route(torch.cuda.current_device()), str)


pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not _route_ok(), reason="needs a GPU the Blackwell kernel "
                                                  "runs on (Blackwell, or sm_90 with the verification cubins)")]

TOL = 5e-3
POLICIES = ["fast", "wan_fast", "accurate", "guard"]
# (B, H, Sq, Skv, D)
SHAPES = [
    (1, 2, 256, 256, 128),     # whole tiles
    (2, 3, 200, 333, 128),     # partial query and key tiles, cross-attention
    (1, 2, 77, 1000, 64),      # D = 64, one partial query tile, many key tiles
    (1, 1, 130, 40, 64),       # fewer keys than one tile (and than the guard's 128 anchors)
]
REPORT: list[dict] = []


def run(q, k, v, policy, backend):
    return fp4vis.attention(q, k, v, policy=policy, backend=backend, range_check="off")


def _record(**row):
    REPORT.append(row)
    path = (setting("FP4VIS_BLACKWELL_REPORT") or None)
    if path:
        with open(path, "w") as f:
            json.dump(REPORT, f, indent=1)


@pytest.mark.parametrize("kind", ["gauss", "wide"])
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
@pytest.mark.parametrize("policy", POLICIES)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
def test_matches_reference(policy, shape, kind, dtype):
    q, k, v = make_inputs(shape, dtype, kind, policy, seed=sum(shape), device="cuda")
    out = run(q, k, v, policy, "blackwell")
    ref = run(q, k, v, policy, "reference")
    fin = torch.isfinite(ref)
    assert out.dtype == dtype and out.shape == ref.shape
    # a non-finite output only where the reference itself overflows (accurate at its logit limit)
    assert torch.equal(torch.isfinite(out), fin)
    err = rel_l2(out[fin].float(), ref[fin].float())
    same = float((out == ref).double().mean())
    _record(policy=policy, shape=list(shape), kind=kind, dtype=str(dtype), rel_l2=err, bit_identical=same,
            ref_nonfinite=int((~fin).sum()))
    assert err <= TOL


def test_user_policy():
    pol = fp4vis.Policy("user", affine_a=1.55, affine_b=1.0, native_exp2=True, anchor=64, margin=40,
                        margin_units="paper", shift=12, qk_format="folded64_mse")
    q, k, v = make_inputs((1, 2, 150, 300, 128), torch.bfloat16, "gauss", "guard", seed=3, device="cuda")
    assert rel_l2(run(q, k, v, pol, "blackwell"), run(q, k, v, pol, "reference")) <= TOL


@pytest.mark.parametrize("layout,anchor", [("folded64_mse", 128), ("block16", 32), ("block16", 0)])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
def test_prepass_on_gpu_equals_cpu(layout, anchor, dtype):
    """The default GPU pre-pass (fused where enabled) = the PyTorch statement on the CPU."""
    from fp4vis.kernels.blackwell import prepass
    q, k, v = make_inputs((1, 2, 100, 300, 128), dtype, "wide", "guard", seed=5)
    a = prepass.kernel_operands(q, k, v, layout, anchor, 128, 128)
    b = prepass.kernel_operands(q.cuda(), k.cuda(), v.cuda(), layout, anchor, 128, 128)
    bad = [n for n in ("qc", "qs", "kc", "ks", "vc", "vs")
           if not torch.equal(getattr(a, n).view(torch.uint8), getattr(b, n).cpu().view(torch.uint8))]
    assert not bad, bad


@pytest.mark.parametrize("shape,dtype,anchor", [((1, 2, 100, 300, 128), torch.bfloat16, 0),
                                                ((2, 3, 257, 129, 64), torch.float16, 0),
                                                ((1, 2, 130, 333, 128), torch.bfloat16, 128)])
def test_fused_prepass_is_the_pytorch_prepass_on_gpu(shape, dtype, anchor):
    """The fused Triton pre-pass (the default on GPUs) writes the PyTorch statement's operands bit for bit here, the
    folded-K64 Q/K with its MSE scale choice included (it once disagreed on the H200, 2026-12-01)."""
    from fp4vis.kernels.blackwell import prepass
    q, k, v = make_inputs(shape, dtype, "gauss", "fast", seed=5)
    for layout in ("folded64_mse", "block16"):
        a = prepass.kernel_operands(q, k, v, layout, anchor, 128, 128, fused=False)
        b = prepass.kernel_operands(q.cuda(), k.cuda(), v.cuda(), layout, anchor, 128, 128, fused=True)
        diff = {n: int((getattr(a, n).view(torch.uint8) != getattr(b, n).cpu().view(torch.uint8)).sum())
                for n in ("qc", "qs", "kc", "ks", "vc", "vs")}
        assert not any(diff.values()), (layout, diff)


def test_selfcheck_passes_here():
    from fp4vis.kernels.blackwell import backend
    ok, table = backend.run_table()
    print(table)
    assert ok, table
    assert backend.ensure()["passed"]


def test_cuda_graph_replay_new_inputs():
    shape = (1, 2, 200, 333, 128)
    q, k, v = make_inputs(shape, torch.bfloat16, "gauss", "guard", seed=1, device="cuda")
    run(q, k, v, "guard", "blackwell")   # compile, self-check and warm up outside capture
    g = torch.cuda.CUDAGraph()
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        run(q, k, v, "guard", "blackwell")
    torch.cuda.current_stream().wait_stream(s)
    with torch.cuda.graph(g):
        out = run(q, k, v, "guard", "blackwell")
    for seed in (2, 3):
        q2, k2, v2 = make_inputs(shape, torch.bfloat16, "gauss", "guard", seed=seed, device="cuda")
        q.copy_(q2), k.copy_(k2), v.copy_(v2)
        g.replay()
        torch.cuda.synchronize()
        assert rel_l2(out, run(q2, k2, v2, "guard", "reference")) <= TOL


def test_torch_compile_fullgraph():
    q, k, v = make_inputs((1, 2, 130, 200, 64), torch.bfloat16, "gauss", "fast", seed=4, device="cuda")
    run(q, k, v, "fast", "blackwell")   # self-check outside tracing

    @torch.compile(fullgraph=True)
    def f(q, k, v):
        return fp4vis.attention(q, k, v, policy="fast", backend="blackwell", range_check="off") * 2

    out = f(q, k, v)
    assert rel_l2(out, 2 * run(q, k, v, "fast", "reference")) <= TOL


def test_bad_input_names_tensor():
    q, k, v = make_inputs((1, 2, 64, 64, 64), torch.bfloat16, "gauss", "fast", seed=6, device="cuda")
    k[0, 1, 3, 3] = float("nan")
    fp4vis.attention(q, k, v, policy="fast", backend="blackwell")   # reported by the range record's check
    with pytest.raises(ValueError, match="k: contains NaN"):
        fp4vis.check_range()


def test_auto_never_picks_verification_route_on_sm90():
    if torch.cuda.get_device_capability() != (9, 0):
        pytest.skip("sm_90 only")
    from fp4vis.backends.registry import select_backend
    from fp4vis.policy import POLICIES as P
    q, k, v = make_inputs((1, 1, 64, 64, 128), torch.bfloat16, "gauss", "fast", device="cuda")
    assert select_backend("auto", AttentionCall(q, k, v, P["fast"], 0.1)).name != "blackwell"
    assert fp4vis.available_backends()["blackwell"] is None


@pytest.mark.parametrize("policy", POLICIES)
def test_range_record_counts_what_the_reference_reports(policy):
    """The kernel's range record on this GPU (docs/numerics.md section 8): saturating logits (q and k
    scaled up), rows that underflow (anchored policies at a large scale), block scales out of their format
    (q rows 1e-4, k rows 3e3: counted by the pre-pass; a V of subnormals: counted; class-token-like rows and a V
    block of subnormals among unit values, which cannot change the result: not counted) and inputs in range; the
    counts are the reference's, reported by fp4vis.check_range."""
    from fp4vis.backends import range_record
    from fp4vis.backends.reference import ReferenceBackend
    pol = fp4vis.get_policy(policy)
    fp4vis.check_range()
    for kind in ("saturated", "underflow", "scale_range", "tiny_v", "harmless_flush", "in_range"):
        if kind == "underflow" and pol.anchor == 0:
            continue
        q, k, v = make_inputs((1, 2, 150, 300, 128), torch.bfloat16, "gauss", policy, seed=5, device="cuda")
        scale = 6.0 if kind == "underflow" else 1 / math.sqrt(128)
        if kind == "saturated":
            q, k = q * 12, k * 12
        if kind == "underflow":
            q[:, :, :40] *= 0.01
        if kind == "scale_range":
            q[:, :, ::3] *= 1e-4
            k[:, :, 5:40] *= 3e3
            v[:, :, 64:96] *= 1e-40
        if kind == "tiny_v":
            v = v * 1e-40
        if kind == "harmless_flush":
            q[:, :, :2] *= 3e-6
            k[:, :, :2] *= 3e-6
            v[:, :, 64:96] *= 1e-40
        expected = ReferenceBackend().run(AttentionCall(q, k, v, pol, scale))[1]
        assert (kind != "harmless_flush" or expected.ok) and (kind != "tiny_v" or expected.scale_underflow[2] > 0)
        out = fp4vis.attention(q, k, v, policy=policy, scale=scale, backend="blackwell")
        if expected.ok:
            assert kind != "saturated" or policy not in ("fast", "wan_fast"), expected
            fp4vis.check_range()
            continue
        with pytest.raises(range_record.DeferredRangeError) as exc:
            fp4vis.check_range()
        msg = str(exc.value)
        assert "blackwell backend" in msg
        if expected.saturated_blocks:
            assert f"{expected.saturated_blocks} saturated P blocks" in msg, (msg, expected)
        if expected.empty_rows:
            assert f"{expected.empty_rows} rows whose probabilities all underflowed" in msg, (msg, expected)
        for name, under, over in zip("qkv", expected.scale_underflow, expected.scale_overflow):
            assert not under or f"{under} blocks of {name} whose scale underflows" in msg, (msg, expected)
            assert not over or f"{over} blocks of {name} whose scale saturates" in msg, (msg, expected)
        assert kind != "scale_range" or expected.scale_underflow[0] > 0
        assert out.shape == q.shape
