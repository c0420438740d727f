"""The Hopper kernel's range record (docs/numerics.md section 8), on an sm_90 GPU (skipped elsewhere).

For every policy the kernel runs, on inputs that stay in range and on inputs that leave it (Student-t(3)
q and k, twice scaled, whose logits reach |z| of a few hundred: saturated P blocks; with a huge V also non-finite
outputs; anchored policies at a large softmax scale: rows whose probabilities all underflow; operands whose
block scales leave their format: some q rows 1e-4, some k rows 3e3, a V block of subnormals among unit values,
which cannot move an output; a V of subnormals, which counts; class-token-like q and k rows of 3e-6, which flush
without moving a score: no count), the
record's counts are the reference's: the same saturated blocks and empty rows (bit-exact policies;
for the FP8 Q/K policy, whose scores differ slightly, the same verdict), the same blocks whose scale
leaves its format (counted by the pre-pass, every policy), and as many non-finite outputs as the
kernel's output holds. On every kernel variant (schedules, P paths, block-constant
modes, the short-sequence variant). Through ``fp4vis.attention``: no error at the call, the error at
the next call or ``fp4vis.check_range()``, naming the call; in a patched model at the end of its
forward, naming the layer."""

import importlib
import math

import pytest
import torch
from test_hopper_kernel import KERNEL_VARIANTS, variant_kwargs

import fp4vis
from fp4vis.backends import range_record
from fp4vis.backends.reference import ReferenceBackend
from fp4vis.call import AttentionCall
from fp4vis.range_report import RangeReport

pytestmark = pytest.mark.gpu(capability=(9, 0))

POLICIES = ["fast", "wan_fast", "accurate", "guard", "fast_bf16round", "fast_fp8qk", "fp8", "fp8pv"]
# (B, H, Sq, Skv, D): the short-sequence variant (both <= 768), the default kernel, D = 64
SHAPES = [(1, 2, 300, 520, 128), (1, 2, 1000, 1100, 128), (2, 1, 77, 900, 64)]
KINDS = ["gauss", "student", "student_big_v", "underflow", "scale_range", "tiny_v", "harmless_flush"]


def inputs(shape, kind, dtype=torch.bfloat16, seed=0):
    """(q, k, v, scale) of one kind (module docstring)."""
    b, h, sq, skv, d = shape
    torch.manual_seed(seed)
    scale = 1 / math.sqrt(d)
    if kind.startswith("student"):
        t = torch.distributions.StudentT(3.0)
        q, k = t.sample((b, h, sq, d)) * 2, t.sample((b, h, skv, d)) * 2
        v = torch.randn(b, h, skv, d) * (3e4 if kind == "student_big_v" else 1)
    else:
        q, k, v = torch.randn(b, h, sq, d), torch.randn(b, h, skv, d), torch.randn(b, h, skv, d)
        if kind == "underflow":
            q[:, :, : sq // 4] *= 0.01
            scale = 6.0
        if kind == "scale_range":   # docs/numerics.md section 1, "Scale range"
            q[:, :, ::3] *= 1e-4
            k[:, :, 5:40] *= 3e3
            v[:, :, 64:96] *= 1e-40
        if kind == "tiny_v":
            v *= 1e-40
        if kind == "harmless_flush":   # docs/numerics.md section 1: flushed, counted only where they matter
            q[:, :, :2] *= 3e-6
            k[:, :, :2] *= 3e-6
            v[:, :, 64:96] *= 1e-40
    return *(x.to(dtype).cuda() for x in (q, k, v)), scale


def kernel_run(q, k, v, policy, scale, variant=None):
    """The kernel's output and its record's counts for one call."""
    hl = importlib.import_module("fp4vis.kernels.hopper.launch")
    from fp4vis.kernels.hopper.config import KernelConfig
    pol = fp4vis.get_policy(policy)
    fp4vis.check_range()
    rec = range_record.record_for(q.device)
    slot = rec.start_call("hopper", pol, "raise", "bhsd", (q, k, v))
    number = slot.number
    cfg = None if variant is None else KernelConfig.from_policy(
        pol, q.shape[-1], "bf16" if q.dtype == torch.bfloat16 else "fp16", range_record=True,
        **variant_kwargs(variant))
    out = hl.attention(AttentionCall(q, k, v, pol, scale, record=slot), cfg)
    found = rec.collect()
    if found is None:
        return out, RangeReport()
    info, first, report = found
    assert first == number and info.number == number
    return out, report


def reference_report(q, k, v, policy, scale):
    return ReferenceBackend().run(AttentionCall(q, k, v, fp4vis.get_policy(policy), scale))[1]


def assert_counts(out, report, expected, policy):
    nonfinite = int((~torch.isfinite(out)).sum())
    assert report.nonfinite_outputs == nonfinite, (report, nonfinite)
    assert (report.scale_underflow, report.scale_overflow) == (expected.scale_underflow, expected.scale_overflow), (
        report, expected)
    if fp4vis.get_policy(policy).qk_fp8:   # FP8 accumulation moves scores: the verdict, not the count
        assert bool(report.saturated_blocks) == bool(expected.saturated_blocks), (report, expected)
        assert bool(report.empty_rows) == bool(expected.empty_rows), (report, expected)
    else:
        assert (report.saturated_blocks, report.empty_rows) == (expected.saturated_blocks, expected.empty_rows), (
            report, expected)
    # non-finite outputs where the reference has them outside its empty rows (the kernel writes 0 there)
    if expected.nonfinite_outputs > expected.empty_rows * out.shape[-1]:
        assert report.nonfinite_outputs > 0


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
@pytest.mark.parametrize("policy", POLICIES)
def test_record_counts_what_the_reference_reports(policy, shape, kind):
    if kind == "underflow" and fp4vis.get_policy(policy).anchor == 0:
        pytest.skip("rows underflow only below an anchored row reference")
    q, k, v, scale = inputs(shape, kind)
    expected = reference_report(q, k, v, policy, scale)
    if kind in ("gauss", "harmless_flush"):
        assert expected.ok
    elif kind == "tiny_v":
        assert expected.scale_underflow[2] > 0
    elif kind == "scale_range" and policy == "fp8":   # FP8 groups hold q and k, V's channel scale the tiny block
        assert expected.ok
    elif kind == "scale_range":   # FP8 group exponents hold these q and k (v's block counts, unpermuted)
        assert not expected.ok
        assert fp4vis.get_policy(policy).qk_fp8 or (expected.scale_underflow[0] > 0 and expected.scale_overflow[1] > 0)
    elif kind == "student" and policy in ("fast", "wan_fast", "fast_fp8qk"):
        assert expected.saturated_blocks > 0
    out, report = kernel_run(q, k, v, policy, scale)
    assert_counts(out, report, expected, policy)


@pytest.mark.parametrize("variant", KERNEL_VARIANTS, ids=lambda v: "-".join(map(str, v)))
@pytest.mark.parametrize("policy", ["fast", "guard"])
def test_record_on_every_variant(policy, variant):
    if fp4vis.get_policy(policy).anchor > 64 and variant[0] == "overlap":
        pytest.skip("the overlapped schedule holds at most 64 anchors")
    for kind in ("student_big_v", "underflow", "gauss"):
        if kind == "underflow" and policy != "guard":
            continue
        q, k, v, scale = inputs((1, 2, 200, 333, 128), kind, seed=3)
        out, report = kernel_run(q, k, v, policy, scale, variant)
        assert_counts(out, report, reference_report(q, k, v, policy, scale), policy)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_output_overflow_in_its_dtype(dtype):
    """Finite float32 results beyond the output dtype's range are counted (they are Inf in q's dtype)."""
    q, k = (torch.randn(1, 1, 64, 128, device="cuda", dtype=dtype) for _ in range(2))
    v = torch.full((1, 1, 64, 128), 6e4 if dtype == torch.float16 else 3e38, device="cuda").to(dtype)
    out, report = kernel_run(q, k, v, "fast", 1 / math.sqrt(128))
    assert report.nonfinite_outputs == int((~torch.isfinite(out)).sum()) > 0


def test_attention_reports_at_the_next_call_and_check_range():
    fp4vis.check_range()
    q, k, v, scale = inputs((1, 2, 300, 520, 128), "student")
    with pytest.raises(fp4vis.RangeExceededError) as expected:
        fp4vis.attention(q, k, v, policy="fast", scale=scale, backend="reference")
    out = fp4vis.attention(q, k, v, policy="fast", scale=scale, backend="hopper")   # returns: no synchronisation
    number = range_record.record_for(q.device).last_number
    torch.cuda.synchronize()
    g, _, _, _ = inputs((1, 2, 300, 520, 128), "gauss")
    with pytest.raises(range_record.DeferredRangeError) as exc:
        fp4vis.attention(g, g, g, policy="fast", backend="hopper")
    assert f"call #{number} (hopper backend, policy 'fast'" in str(exc.value)
    assert str(exc.value).endswith(str(expected.value))
    assert out.shape == q.shape
    fp4vis.attention(q, k, v, policy="fast", scale=scale, backend="hopper", range_check="warn")
    with pytest.warns(RuntimeWarning, match="saturated P blocks"):
        fp4vis.check_range()
    fp4vis.attention(q, k, v, policy="fast", scale=scale, backend="hopper", range_check="off")
    fp4vis.check_range()
    fp4vis.attention(g, g, g, policy="fast", backend="hopper")
    fp4vis.check_range()


def test_patched_model_raises_at_the_end_of_its_forward():
    timm = pytest.importorskip("timm")
    torch.manual_seed(0)
    model = timm.create_model("vit_tiny_patch16_224", pretrained=False, img_size=64, patch_size=4, embed_dim=128,
                              depth=2, num_heads=2, num_classes=3).eval().cuda().bfloat16()
    with torch.no_grad():
        model.blocks[1].attn.qkv.weight[:256] *= 60   # layer 1's logits saturate fast
    x = torch.randn(2, 3, 64, 64, device="cuda", dtype=torch.bfloat16)
    fp4vis.check_range()
    with fp4vis.patch(model, "fast", backend="hopper"), torch.no_grad():
        with pytest.raises(range_record.DeferredRangeError, match=r"layer 'blocks\.1\.attn'.*end of VisionTransformer"):
            model(x)
        model.blocks[1].attn.qkv.weight[:256] /= 60
        model(x)
