"""torch.compile(fullgraph=True) on the GPU kernels: the Hopper kernel, and the Blackwell kernel through its
sm_90 build on the H200 (precompiled cubins named by FP4VIS_BLACKWELL_CUBINS). A compiled
``fp4vis.attention`` gives the eager call's bits on new inputs after its first call, without recompiling,
with every range_check; a compiled call's range error surfaces at the next call and at
``fp4vis.check_range()``, and in a compiled patched model at the end of its forward; the Wan processor's
q/k transform stays folded into the pre-pass under compile. The CPU twins: tests/backends/test_range_record.py."""

from __future__ import annotations

import pytest
import torch

import fp4vis
from fp4vis.backends import range_record


def _blackwell_route() -> bool:
    if not torch.cuda.is_available():
        return False
    from fp4vis.kernels.blackwell import route
    return not isinstance(route.route(torch.cuda.current_device()), str)


pytestmark = pytest.mark.gpu
HOPPER = pytest.param("hopper", marks=pytest.mark.gpu(capability=(9, 0)))
BLACKWELL = pytest.param("blackwell", marks=pytest.mark.skipif(
    not _blackwell_route(), reason="needs a GPU the Blackwell kernel runs on (Blackwell, or sm_90 with its cubins)"))

# the calls that failed at 92478a8 (issue 25): kwargs of fp4vis.attention, and q's shape (k, v alike)
CASES = {
    "defaults": ({}, (1, 2, 1000, 128)),
    "off": ({"range_check": "off"}, (1, 2, 1000, 128)),
    "fp8qk-bshd": ({"policy": "fast_fp8qk", "layout": "bshd"}, (1, 1000, 2, 128)),
    "vit-d64": ({"policy": "fast"}, (8, 12, 197, 64)),
}


@pytest.fixture
def no_recompiles():
    torch._dynamo.reset()
    fp4vis.check_range()
    with torch._dynamo.config.patch(error_on_recompile=True):
        yield
    torch._dynamo.reset()


def gaussian(shape, seed, scale=1.0):
    g = torch.Generator().manual_seed(seed)
    return tuple((torch.randn(shape, generator=g) * scale).to("cuda", torch.bfloat16) for _ in range(3))


def case_kwargs(case: str, backend: str) -> dict:
    kwargs = dict(CASES[case][0])
    if backend == "blackwell":   # the Blackwell kernel is NVFP4 only, and "auto" never picks its sm_90 build
        kwargs["backend"] = "blackwell"
        if kwargs.get("policy") == "fast_fp8qk":
            kwargs["policy"] = "fast"
    return kwargs


@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("backend", [HOPPER, BLACKWELL])
def test_compiled_call_gives_the_eager_bits_without_recompiling(backend, case, no_recompiles):
    kwargs = case_kwargs(case, backend)

    def f(q, k, v):
        return fp4vis.attention(q, k, v, **kwargs)

    compiled = torch.compile(f, fullgraph=True)
    shape = CASES[case][1]
    compiled(*gaussian(shape, 0))            # compiles (and the Blackwell kernel checks itself, outside tracing)
    for seed in (1, 2):
        q, k, v = gaussian(shape, seed)
        assert torch.equal(compiled(q, k, v), f(q, k, v)), (backend, case, seed)
    fp4vis.check_range()


@pytest.mark.parametrize("backend", [HOPPER, BLACKWELL])
def test_compiled_range_error_surfaces(backend, no_recompiles):
    compiled = torch.compile(lambda q, k, v: fp4vis.attention(q, k, v, policy="fast", backend=backend),
                             fullgraph=True)
    shape = (1, 2, 512, 128)
    compiled(*gaussian(shape, 0))
    fp4vis.check_range()
    compiled(*gaussian(shape, 1, scale=12))   # logits far above fast's range: no error at the call
    torch.cuda.synchronize()
    with pytest.raises(range_record.DeferredRangeError,
                       match=rf"^compiled fp4vis.attention call #\d+ \({backend} backend, policy 'fast'.*"
                             "reported at the next fp4vis.attention call: .*saturated P blocks"):
        compiled(*gaussian(shape, 2))
    compiled(*gaussian(shape, 3, scale=12))
    with pytest.raises(range_record.DeferredRangeError, match="reported at fp4vis.check_range"):
        fp4vis.check_range()
    fp4vis.check_range()


def unbalanced(shape, seed):
    """q 1e-3, k 1e3 (the logits of unit inputs): q's NVFP4 blocks flush, k's clip (docs/numerics.md section 1,
    "Scale range")."""
    q, k, v = gaussian(shape, seed)
    return q * 1e-3, k * 1e3, v


@pytest.mark.parametrize("backend", [HOPPER, BLACKWELL])
def test_compiled_and_graphed_calls_report_the_scale_range(backend, no_recompiles):
    """The pre-pass's scale-range counts surface from a compiled call and from CUDA-graph replays, naming q and
    k, with no error at the call."""
    shape = (1, 2, 512, 128)
    compiled = torch.compile(lambda q, k, v: fp4vis.attention(q, k, v, policy="fast", backend=backend),
                             fullgraph=True)
    compiled(*gaussian(shape, 0))
    fp4vis.check_range()
    compiled(*unbalanced(shape, 1))
    with pytest.raises(range_record.DeferredRangeError,
                       match=r"blocks of q whose scale underflows.*blocks of k whose scale saturates"):
        fp4vis.check_range()
    # a graph captured on unit inputs, replayed on unbalanced ones copied into them
    q, k, v = gaussian(shape, 2)
    fp4vis.attention(q, k, v, policy="fast", backend=backend)
    fp4vis.check_range()
    graph, stream = torch.cuda.CUDAGraph(), torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream), torch.cuda.graph(graph, stream=stream):
        fp4vis.attention(q, k, v, policy="fast", backend=backend)
    torch.cuda.current_stream().wait_stream(stream)
    graph.replay()
    fp4vis.check_range()
    for dst, src in zip((q, k, v), unbalanced(shape, 3)):
        dst.copy_(src)
    graph.replay()
    with pytest.raises(range_record.DeferredRangeError, match=r"blocks of q whose scale underflows"):
        fp4vis.check_range()
    fp4vis.check_range()


@torch.no_grad()
def test_compiled_patched_vit_matches_eager_and_raises_at_the_end_of_its_forward(no_recompiles):
    """A timm ViT (head dim 64) patched with the Hopper kernel and compiled whole (inductor, fullgraph): its
    output is the eager patched model's up to inductor's rounding of the layers around attention; a
    saturating layer raises at the end of the compiled forward."""
    if torch.cuda.get_device_capability() != (9, 0):
        pytest.skip("sm_90 only")
    timm = pytest.importorskip("timm")
    torch.manual_seed(0)
    model = timm.create_model("vit_tiny_patch16_224", pretrained=False, img_size=64, patch_size=4, embed_dim=192,
                              depth=2, num_heads=3, num_classes=3).eval().cuda().bfloat16()
    x = torch.randn(2, 3, 64, 64, device="cuda", dtype=torch.bfloat16)
    with fp4vis.patch(model, "fast", backend="hopper"):
        eager = model(x)
        compiled = torch.compile(model, fullgraph=True)
        out = compiled(x)
        assert fp4vis.rel_l2(out.float(), eager.float()) < 0.05
        model.blocks[1].attn.qkv.weight[:384] *= 60   # layer 1's logits saturate fast
        with pytest.raises(range_record.DeferredRangeError, match=r"end of VisionTransformer's forward"):
            compiled(x)
        model.blocks[1].attn.qkv.weight[:384] /= 60
        compiled(x)
    fp4vis.check_range()


@torch.no_grad()
def test_compiled_wan_layer_folds_its_qk_transform_into_the_pre_pass(monkeypatch, no_recompiles):
    """A Wan self-attention layer patched with the Hopper kernel, its processor compiled (fullgraph): the op
    receives the raw projections with the norms and the rotary tables, and the pre-pass folds them (the
    transform reaches it), with the eager layer's result up to inductor's rounding of the projections."""
    if torch.cuda.get_device_capability() != (9, 0):
        pytest.skip("sm_90 only")
    from diffusers.models.transformers.transformer_wan import WanAttention, WanAttnProcessor

    from fp4vis.kernels.hopper import prepass
    from fp4vis.patching.layer import LayerSpec, LayerState
    from fp4vis.patching.wan import FP4WanAttnProcessor
    from fp4vis.policy import get_policy

    torch.manual_seed(0)
    h, d, s, dev = 12, 128, 1500, "cuda"
    ang = torch.rand(1, s, 1, d // 2, device=dev).repeat_interleave(2, -1) * 50
    rope = (ang.cos(), ang.sin())
    x = torch.randn(1, s, h * d, device=dev).bfloat16()
    attn = WanAttention(dim=h * d, heads=h, dim_head=d, eps=1e-6).to(dev, torch.bfloat16)
    for p in attn.parameters():
        (p.normal_(1.0, 0.1) if p.dim() == 1 else p.normal_(0.0, 0.02))
    seen = []
    real = prepass.kernel_operands
    monkeypatch.setattr("fp4vis.kernels.hopper.launch.kernel_operands",
                        lambda call, *a: seen.append(call.qk_transform is not None) or real(call, *a))
    for policy in ("fast", "fast_fp8qk"):
        spec = LayerSpec(name="self", module=attn, index=0, group="self", default=True, patcher="wan", num_heads=h,
                         head_dim=d)
        st = LayerState(spec, get_policy(policy), backend="hopper", range_check="raise", strict=True, handle=None)
        proc = FP4WanAttnProcessor(st, WanAttnProcessor())
        eager = proc(attn, x, None, None, rope)
        torch._dynamo.reset()
        compiled = torch.compile(lambda x, cos, sin, proc=proc: proc(attn, x, None, None, (cos, sin)), fullgraph=True)
        seen.clear()
        out = compiled(x, *rope)
        assert seen == [True], (policy, seen)
        assert fp4vis.rel_l2(out.float(), eager.float()) < 0.02, policy
    fp4vis.check_range()
