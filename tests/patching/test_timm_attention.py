"""fp4vis.patch on timm attention layers (tiny random models: a ViT through a local checkpoint; EVA-02, a ROPE
ViT, Swin and ConvNeXt built with timm.create_model(pretrained=False))."""

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

            def spy(layer_call, _orig=orig, _name=st.name):
                used[_name] = layer_call.policy.name
                return _orig(layer_call)
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
    mask = torch.ones(n, n, dtype=torch.bool).tril()   # per query: not a key-padding mask
    blk = model.blocks[0]
    tokens = torch.randn(2, n, 64)
    exact = blk.attn(tokens, attn_mask=mask)
    with fp4vis.patch(model, "fast"):
        with warnings.catch_warnings(record=True) as w:
            warnings.simplefilter("always")
            out1 = blk.attn(tokens, attn_mask=mask)
            blk.attn(tokens, attn_mask=mask)
        msgs = [str(i.message) for i in w if issubclass(i.category, FallbackWarning)]
        assert len(msgs) == 1 and "blocks.0.attn" in msgs[0] and "differs between queries" in msgs[0]
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
    from timm.layers.diff_attention import DiffAttention

    class Net(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.attn = DiffAttention(64, num_heads=2)

    with pytest.raises(NotImplementedError, match=r"DiffAttention.*Supported are: "):
        fp4vis.patch(Net())

    class Mixed(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.a = timm.layers.Attention(64, num_heads=2)
            self.b = DiffAttention(64, num_heads=2)

    with pytest.warns(FallbackWarning, match="b \\(DiffAttention\\)"):
        h = fp4vis.patch(Mixed())
    assert h.policies == {"a": "fast"}
    h.remove()
    with pytest.raises(NotImplementedError, match="DiffAttention"):
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


@torch.no_grad()
def test_a_patched_call_is_checked_once(model, x, monkeypatch):
    """Each FP4 call of a patched layer builds one AttentionCall and asks its backend once (issue 45): the layer's
    ``select`` checks, ``attention`` runs that call."""
    from fp4vis.backends import registry as dispatch

    asked, ran = [], []

    class Counting(dispatch.Backend):
        name = "counting_test"

        def supports(self, call):
            asked.append(call)
            return None

        def run(self, call):
            ran.append(call)
            return dispatch.get_backend("reference").run(call)

    monkeypatch.setitem(dispatch._REGISTRY, Counting.name, Counting())
    with fp4vis.patch(model, "fast", backend=Counting.name) as h:
        model(x)
        calls = sum(st.calls for st in h.states)
    assert calls == 3 and len(asked) == len(ran) == calls
    assert all(a.q is r.q and a.key_mask is r.key_mask for a, r in zip(asked, ran))   # the same call, run


def fallback_reason(q, k, v, policy, *, layout, scale, mask=None, dropout_p=0.0, is_causal=False, backend="auto"):
    """Why a patched layer keeps exact attention for this call (None: it runs FP4), as ``LayerState.select``
    decides it: the patcher's mask, ``call_reason``, then the backend's answer for the validated call."""
    from fp4vis.backends.registry import ask_backend
    from fp4vis.call import validated_call
    from fp4vis.patching.layer import call_reason

    if mask is not None:
        return "attention mask given (this layer's patcher hands fp4vis.attention no mask)"
    reason = call_reason(q, k, v, layout=layout, dropout_p=dropout_p, is_causal=is_causal)
    return reason or ask_backend(backend, validated_call(q, k, v, policy, scale=scale, layout=layout))[1]


def test_fallback_reasons():
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


# -- the attention classes beyond timm.layers.Attention ---------------------------------------------------------

TINY = dict(img_size=32, patch_size=8, embed_dim=64, depth=2, num_heads=2, num_classes=10)
FAMILIES = {
    "vit": ("vit_tiny_patch16_224", {}),
    # DeiT III: layer scale, and a class token as timm initialises it (~1e-6), whose q and k blocks flush to zero
    # without moving a score (issue 44: the range check counts them only where they can change the result)
    "deit3": ("deit3_small_patch16_224", dict(init_values=0.1)),
    "eva02": ("eva02_tiny_patch14_224", {}),   # EvaAttention, interleaved rotary embedding, class token
    "eva02_rotate_half": ("eva02_tiny_patch14_224", dict(rope_rotate_half=True)),
    "rope_vit": ("vit_medium_patch16_rope_reg1_gap_256", {}),   # EvaAttention, register tokens
    "attention_rope": ("eva02_tiny_patch14_224", dict(attn_type="rope")),
    "attention_rope_gqa": ("eva02_tiny_patch14_224", dict(attn_type="rope", qkv_fused=False, num_kv_heads=1)),
}


class SdpaAsFp4(torch.overrides.TorchFunctionMode):
    """The model's own forward with each ``F.scaled_dot_product_attention`` call replaced by fp4vis.attention
    (the reference, a bool key-padding mask as ``key_mask``): what a patched model must compute, bit for bit."""

    def __init__(self, policy: str):
        super().__init__()
        self.policy, self.calls = policy, 0

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is not torch.nn.functional.scaled_dot_product_attention:
            return func(*args, **kwargs)
        self.calls += 1
        q, k, v = args[:3]
        mask = kwargs.get("attn_mask")
        assert mask is None or (mask.dtype == torch.bool and mask.shape[1:3] == (1, 1))   # (B, 1, 1, Skv) here
        key_mask = None if mask is None else mask[:, 0, 0, :]
        return fp4vis.attention(q, k, v, policy=self.policy, scale=q.shape[-1] ** -0.5, backend="reference",
                                key_mask=key_mask)


def _attention_modules(model):
    return [m for m in model.modules() if hasattr(m, "fused_attn")]


@pytest.mark.parametrize("family", list(FAMILIES))
@torch.no_grad()
def test_family_patched_in_fp4_then_restored_bit_identically(family, x):
    arch, extra = FAMILIES[family]
    torch.manual_seed(0)
    model = timm.create_model(arch, pretrained=False, **TINY, **extra).eval()
    for m in _attention_modules(model):
        m.fused_attn = True   # the oracle replaces the class's SDPA call
    ref = model.forward_features(x)
    oracle_mode = SdpaAsFp4("fast")
    with oracle_mode:
        oracle = model.forward_features(x)
    for m in _attention_modules(model):
        m.fused_attn = False   # the patched forward computes q, k, v itself, whatever the class's path
    ref_unfused = model.forward_features(x)
    with warnings.catch_warnings():
        warnings.simplefilter("error", FallbackWarning)
        h = fp4vis.patch(model, "fast")
        out = model.forward_features(x)
    assert oracle_mode.calls == len(h.states) == 2 and h.policies == {"blocks.0.attn": "fast", "blocks.1.attn": "fast"}
    assert [s.calls for s in h.states] == [1, 1] and all(s.patcher == "timm" for s in h.specs)
    assert torch.equal(out, oracle)   # the class's own q, k, v (norms, rotary, repeated heads) and output steps
    assert not torch.equal(out, ref) and (out - ref).abs().max() < 1.0
    h.remove()
    assert not any("forward" in m.__dict__ for m in model.modules())
    assert torch.equal(model.forward_features(x), ref_unfused)


@torch.no_grad()
def test_key_padding_mask_runs_fp4_with_key_mask():
    torch.manual_seed(0)
    model = timm.create_model("eva02_tiny_patch14_224", pretrained=False, **TINY).eval()
    attn = model.blocks[0].attn
    tokens = torch.randn(2, 17, 64)
    rope = model.rope.get_embed()
    keep = torch.ones(2, 1, 1, 17, dtype=torch.bool)
    keep[1, ..., 12:] = False
    with SdpaAsFp4("fast"):
        oracle = attn(tokens, rope=rope, attn_mask=keep)
    with warnings.catch_warnings():
        warnings.simplefilter("error", FallbackWarning)
        with fp4vis.patch(model, "fast") as h:
            out = attn(tokens, rope=rope, attn_mask=keep)
            assert h.states[0].calls == 1
    assert torch.equal(out, oracle)
    with fp4vis.patch(model, "fast"):   # an additive bias is not a key-padding mask
        bias = torch.randn(1, 2, 17, 17)
        with pytest.warns(FallbackWarning, match="blocks.0.attn.*per-head attention bias"):
            out = attn(tokens, rope=rope, attn_mask=bias)
    assert torch.equal(out, attn(tokens, rope=rope, attn_mask=bias))


@torch.no_grad()
def test_swin_window_attention_is_found_and_kept_exact(x):
    torch.manual_seed(0)
    model = timm.create_model("swin_tiny_patch4_window7_224", pretrained=False, img_size=32, patch_size=4,
                              embed_dim=32, depths=(1, 1), num_heads=(2, 2), window_size=4, num_classes=10).eval()
    ref = model(x)
    with fp4vis.patch(model, "fast") as h:
        assert [(s.name, s.num_heads, s.head_dim) for s in h.specs] == [("layers.0.blocks.0.attn", 2, 16),
                                                                         ("layers.1.blocks.0.attn", 2, 32)]
        with warnings.catch_warnings(record=True) as w:
            warnings.simplefilter("always")
            out = model(x)
        msgs = [str(i.message) for i in w if issubclass(i.category, FallbackWarning)]
        assert len(msgs) == 2 and all("relative position bias" in m for m in msgs)
        assert [(s.calls, s.fallbacks) for s in h.states] == [(0, 1), (0, 1)]
    assert torch.equal(out, ref) and torch.equal(model(x), ref)
    with fp4vis.patch(model, "fast", strict=True), pytest.raises(FallbackError, match="relative position bias"):
        model(x)


def test_convnext_has_no_attention_layer():
    from fp4vis.patching import timm_attention

    model = timm.create_model("convnext_atto", pretrained=False, depths=(1, 1, 1, 1), dims=(8, 16, 32, 64),
                              num_classes=10)
    assert timm_attention.find_layers(model) == []
    assert not any(timm_attention.is_known_non_attention(m) for m in model.modules())


@pytest.mark.parametrize("policy", ["fp8", "fp8pv"])
@torch.no_grad()
def test_fp8_pv_policies_patch_compute_and_restore(policy, x):
    """The FP8 P/V softmax (docs/numerics.md section 7) through the timm patcher: the patched ViT computes what its
    own forward computes with each attention call replaced by ``fp4vis.attention(policy=...)``, bit for bit, close
    to the unpatched model, and removing the patch restores it."""
    arch, extra = FAMILIES["vit"]
    torch.manual_seed(0)
    model = timm.create_model(arch, pretrained=False, **TINY, **extra).eval()
    for m in _attention_modules(model):
        m.fused_attn = True
    oracle_mode = SdpaAsFp4(policy)
    with oracle_mode:
        oracle = model.forward_features(x)
    for m in _attention_modules(model):
        m.fused_attn = False
    ref = model.forward_features(x)
    with warnings.catch_warnings():
        warnings.simplefilter("error", FallbackWarning)
        h = fp4vis.patch(model, policy)
        out = model.forward_features(x)
    assert torch.equal(out, oracle) and not torch.equal(out, ref)
    assert torch.nn.functional.cosine_similarity(out.flatten(), ref.flatten(), dim=0) > 0.99
    h.remove()
    assert torch.equal(model.forward_features(x), ref)


@torch.no_grad()
def test_guard_on_a_model_without_direct_p_layers_says_it_changes_nothing(x):
    """guard="auto" (or a plan) with the FP8 P/V softmax: one warning that the guard changes nothing, no error."""
    arch, extra = FAMILIES["vit"]
    model = timm.create_model(arch, pretrained=False, **TINY, **extra).eval()
    with pytest.warns(RuntimeWarning, match="guards Direct-P layers"):
        h = fp4vis.patch(model, "fp8", guard="auto")
    model.forward_features(x)
    h.remove()
