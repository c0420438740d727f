"""fp4vis.patch on timm vision transformers (tiny random models through a local checkpoint)."""

from __future__ import annotations

import warnings

import pytest
import torch

timm = pytest.importorskip("timm")

import fp4vis  # noqa: E402
from fp4vis.patching import FallbackError, FallbackWarning, unpatch  # noqa: E402

ARCH = "vit_tiny_patch16_224"
KW = dict(img_size=32, patch_size=8, embed_dim=64, depth=3, num_heads=2, num_classes=10)


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    torch.manual_seed(0)
    m = timm.create_model(ARCH, pretrained=False, **KW)
    path = tmp_path_factory.mktemp("timm") / "vit_tiny.pth"
    torch.save(m.state_dict(), path)
    return path, m.state_dict()


@pytest.fixture()
def model(ckpt):
    path, sd = ckpt
    overlay = dict(file=str(path), num_classes=10)
    m = timm.create_model(ARCH, pretrained=True, pretrained_cfg_overlay=overlay, **KW).eval()
    for k, v in m.state_dict().items():  # really loaded from the local checkpoint
        assert torch.equal(v, sd[k]), k
    return m


@pytest.fixture()
def x():
    return torch.randn(2, 3, 32, 32, generator=torch.Generator().manual_seed(1))


def _capture_inputs(model):
    seen, hooks = {}, []
    for name, m in model.named_modules():
        if type(m) is timm.layers.Attention:
            def pre(mod, args, kwargs, name=name):
                seen.setdefault(name, {})["x"] = args[0]

            def post(mod, args, kwargs, out, name=name):
                seen[name]["out"] = out
            hooks.append(m.register_forward_pre_hook(pre, with_kwargs=True))
            hooks.append(m.register_forward_hook(post, with_kwargs=True))
    return seen, hooks


def _expected(attn, xin, policy):
    """The layer's output computed from its own weights with fp4vis.attention."""
    B, N, _ = xin.shape
    qkv = attn.qkv(xin).reshape(B, N, 3, attn.num_heads, attn.head_dim).permute(2, 0, 3, 1, 4)
    q, k, v = qkv.unbind(0)
    q, k = attn.q_norm(q), attn.k_norm(k)
    o = fp4vis.attention(q, k, v, policy=policy, scale=attn.scale, backend="reference")
    return attn.proj(attn.norm(o.transpose(1, 2).reshape(B, N, -1)))


@torch.no_grad()
def test_patched_layer_equals_fp4vis_attention_and_remove_restores(model, x):
    ref = model(x)
    seen, hooks = _capture_inputs(model)
    handle = fp4vis.patch(model, "fast", backend="reference")
    out = model(x)
    for h in hooks:
        h.remove()
    assert set(seen) == {f"blocks.{i}.attn" for i in range(3)}
    for name, rec in seen.items():
        attn = model.get_submodule(name)
        torch.testing.assert_close(rec["out"], _expected(attn, rec["x"], "fast"), rtol=0, atol=0)
    assert not torch.equal(out, ref)  # FP4 did run
    assert all(st.calls == 1 for st in handle.states)
    handle.remove()
    for name in seen:
        m = model.get_submodule(name)
        assert "forward" not in m.__dict__ and not hasattr(m, "_fp4vis_state")
    assert torch.equal(model(x), ref)
    handle.remove()  # idempotent


@torch.no_grad()
def test_per_layer_map_reaches_exactly_the_intended_layers(model, x):
    ref = model(x)
    with fp4vis.patch(model, "fast", layers={1: "accurate", "blocks.2.*": None}) as h:
        assert h.policies == {"blocks.0.attn": "fast", "blocks.1.attn": "accurate", "blocks.2.attn": None}
        assert "forward" not in model.blocks[2].attn.__dict__
        used = {}
        for st in h.states:
            orig = st.attention

            def spy(q, k, v, policy, _orig=orig, _name=st.name, **kw):
                used[_name] = policy.name
                return _orig(q, k, v, policy, **kw)
            st.attention = spy
        model(x)
        assert used == {"blocks.0.attn": "fast", "blocks.1.attn": "accurate"}
    assert torch.equal(model(x), ref)


def test_layers_key_matching_nothing_is_an_error(model):
    with pytest.raises(ValueError, match="matches no attention layer"):
        fp4vis.patch(model, layers={7: "fast"})
    with pytest.raises(ValueError, match="matches no attention layer"):
        fp4vis.patch(model, layers={"decoder.*": "fast"})
    with pytest.raises(ValueError, match="unknown policy"):
        fp4vis.patch(model, "fastest")


@torch.no_grad()
def test_no_double_wrap_and_unpatch(model, x):
    ref = model(x)
    h = fp4vis.patch(model)
    with pytest.raises(RuntimeError, match="already patched"):
        fp4vis.patch(model)
    del h  # unpatch finds the patch without the handle
    assert unpatch(model) == 1
    assert unpatch(model) == 0
    assert torch.equal(model(x), ref)
    with fp4vis.patch(model, "accurate"):  # a clean re-patch after removal
        model(x)
    assert torch.equal(model(x), ref)


@torch.no_grad()
def test_fallbacks_warn_once_or_raise_when_strict(model, x):
    n = model.patch_embed.num_patches + 1
    mask = torch.zeros(n, n, dtype=torch.bool).fill_(True)
    blk = model.blocks[0]
    tokens = torch.randn(2, n, 64)
    exact = blk.attn(tokens, attn_mask=mask)
    with fp4vis.patch(model, "fast"):
        with warnings.catch_warnings(record=True) as w:
            warnings.simplefilter("always")
            out1 = blk.attn(tokens, attn_mask=mask)
            blk.attn(tokens, attn_mask=mask)
        msgs = [str(i.message) for i in w if issubclass(i.category, FallbackWarning)]
        assert len(msgs) == 1 and "blocks.0.attn" in msgs[0] and "mask" in msgs[0]
        assert torch.equal(out1, exact)
    with fp4vis.patch(model, "fast", strict=True):
        with pytest.raises(FallbackError, match="blocks.0.attn.*mask"):
            blk.attn(tokens, attn_mask=mask)


def test_dropout_in_training_falls_back(ckpt):
    path, _ = ckpt
    overlay = dict(file=str(path), num_classes=10)
    m = timm.create_model(ARCH, pretrained=True, pretrained_cfg_overlay=overlay, attn_drop_rate=0.1, **KW).train()
    with fp4vis.patch(m, "fast") as h, torch.no_grad():
        with pytest.warns(FallbackWarning, match="dropout"):
            m(torch.randn(1, 3, 32, 32))
        m.eval()
        calls = [st.calls for st in h.states]
        with warnings.catch_warnings():
            warnings.simplefilter("error", FallbackWarning)   # eval: no dropout, no fallback
            m(torch.randn(1, 3, 32, 32))
        assert [st.calls for st in h.states] == [c + 1 for c in calls]   # every layer ran FP4


def test_training_with_gradients_falls_back_visibly(model, x):
    """A patched model in training mode keeps its own attention where gradients are requested, with one
    warning per layer (an error under strict=True), and its gradients are the unpatched model's."""
    model.train()
    xg = x.clone().requires_grad_(True)
    model(xg).sum().backward()
    ref_grad = xg.grad.clone()
    xg.grad = None
    with fp4vis.patch(model, "fast") as h:
        with warnings.catch_warnings(record=True) as w:
            warnings.simplefilter("always")
            model(xg).sum().backward()
            model(xg).sum().backward()
        msgs = [str(i.message) for i in w if issubclass(i.category, FallbackWarning)]
        assert len(msgs) == len(h.states) and all("gradients requested" in m for m in msgs)
        assert all(st.calls == 0 for st in h.states)
    torch.testing.assert_close(xg.grad, 2 * ref_grad)
    with fp4vis.patch(model, "fast", strict=True), pytest.raises(FallbackError, match="blocks.0.attn.*gradients"):
        model(xg)
    model.eval()


def test_errors_inside_a_patched_model_name_the_layer(model, x):
    with torch.no_grad():
        model.blocks[1].attn.qkv.bias[0] = float("inf")
    with fp4vis.patch(model, "fast"), torch.no_grad(), pytest.raises(ValueError, match="layer 'blocks.1.attn': q"):
        model(x)


def test_unsupported_timm_attention_is_named():
    from timm.layers.attention import AttentionRope

    class Net(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.attn = AttentionRope(64, num_heads=2)

    with pytest.raises(NotImplementedError, match=r"AttentionRope.*Supported are: .*timm.layers.Attention"):
        fp4vis.patch(Net())

    class Mixed(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.a = timm.layers.Attention(64, num_heads=2)
            self.b = AttentionRope(64, num_heads=2)

    with pytest.warns(FallbackWarning, match="b \\(AttentionRope\\)"):
        h = fp4vis.patch(Mixed())
    assert h.policies == {"a": "fast"}
    h.remove()
    with pytest.raises(NotImplementedError, match="AttentionRope"):
        fp4vis.patch(Mixed(), strict=True)


@torch.no_grad()
def test_torch_compile_of_patched_model_runs(model, x):
    with fp4vis.patch(model, "fast"):
        eager = model(x)
        torch._dynamo.reset()
        compiled = torch.compile(model, fullgraph=True)  # inductor; the reference is one op of the graph
        out = compiled(x)
    torch._dynamo.reset()
    # inductor fuses the layers around attention differently: float32 rounding, not a new result
    torch.testing.assert_close(out, eager, rtol=1e-4, atol=1e-5)


@torch.no_grad()
def test_backend_lacking_the_head_dim_keeps_exact_attention(model, x, monkeypatch):
    from fp4vis.backends import registry as dispatch

    class NoD32(dispatch.Backend):
        name = "no_d32_test"

        def supports(self, call):
            return "head dim 32 is not supported" if call.q.shape[-1] == 32 else None

        def run(self, call):  # pragma: no cover - never reached here
            return dispatch.get_backend("reference").run(call)

    monkeypatch.setitem(dispatch._REGISTRY, NoD32.name, NoD32())
    ref = model(x)
    with fp4vis.patch(model, "fast", backend=NoD32.name) as h:
        with warnings.catch_warnings(record=True) as w:
            warnings.simplefilter("always")
            out = model(x)
            model(x)
        msgs = sorted(str(i.message) for i in w if issubclass(i.category, FallbackWarning))
        assert len(msgs) == 3 and all("head dim 32" in m for m in msgs)
        assert [f"'blocks.{i}.attn'" in msgs[i] for i in range(3)] == [True] * 3
        assert all(st.calls == 0 and st.fallbacks == 2 for st in h.states)
    assert torch.equal(out, ref)
    with fp4vis.patch(model, "fast", backend=NoD32.name, strict=True):
        with pytest.raises(FallbackError, match="blocks.0.attn.*head dim 32"):
            model(x)
    with pytest.raises(ValueError, match="unknown backend"):
        fp4vis.patch(model, backend="tpu")


def test_fallback_reasons():
    from fp4vis.patching.layer import fallback_reason

    pol = fp4vis.get_policy("fast")
    q = torch.randn(1, 4, 8, 32)
    kv = torch.randn(1, 2, 8, 32)
    assert "grouped-query" in fallback_reason(q, kv, kv, pol, layout="bhsd", scale=None)
    assert fallback_reason(q, q, q, pol, layout="bhsd", scale=None) is None
    assert "mask" in fallback_reason(q, q, q, pol, layout="bhsd", scale=None, mask=torch.ones(8, 8))
    assert "causal" in fallback_reason(q, q, q, pol, layout="bhsd", scale=None, is_causal=True)
    assert "dropout" in fallback_reason(q, q, q, pol, layout="bhsd", scale=None, dropout_p=0.1)
    assert "head dims" in fallback_reason(q, q[..., :16], q, pol, layout="bhsd", scale=None)
    assert "dtype" in fallback_reason(q.double(), q.double(), q.double(), pol, layout="bhsd", scale=None)
    assert "grouped-query" in fallback_reason(q.transpose(1, 2), kv.transpose(1, 2), kv.transpose(1, 2), pol,
                                              layout="bshd", scale=None)


def test_copying_or_saving_a_patched_model_says_to_unpatch(model):
    import copy
    import io

    h = fp4vis.patch(model, "fast")
    for copy_it in (lambda: copy.deepcopy(model), lambda: torch.save(model, io.BytesIO())):
        with pytest.raises(TypeError, match="is patched.*remove the patch first"):
            copy_it()
    h.remove()
    clone = copy.deepcopy(model)
    torch.save(model, io.BytesIO())
    assert not any(hasattr(m, "_fp4vis_state") for m in clone.modules())
