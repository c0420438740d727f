"""fp4vis.patch on transformers ViT and ViTMAE (tiny random models through save/from_pretrained)."""

from __future__ import annotations

import warnings

import pytest
import torch

transformers = pytest.importorskip("transformers")
from transformers import ViTConfig, ViTMAEConfig, ViTMAEForPreTraining, ViTModel  # noqa: E402

import fp4vis  # noqa: E402
from fp4vis.patching import FallbackError, FallbackWarning  # noqa: E402

VIT = dict(hidden_size=64, num_hidden_layers=3, num_attention_heads=2, intermediate_size=128, image_size=32,
           patch_size=8)
MAE = dict(VIT, num_hidden_layers=2, decoder_hidden_size=32, decoder_num_hidden_layers=2,
           decoder_num_attention_heads=2, decoder_intermediate_size=64, mask_ratio=0.5)


@pytest.fixture(scope="module")
def vit_dir(tmp_path_factory):
    torch.manual_seed(0)
    d = tmp_path_factory.mktemp("vit")
    ViTModel(ViTConfig(**VIT)).save_pretrained(d)
    return d


@pytest.fixture(scope="module")
def mae_dir(tmp_path_factory):
    torch.manual_seed(0)
    d = tmp_path_factory.mktemp("mae")
    ViTMAEForPreTraining(ViTMAEConfig(**MAE)).save_pretrained(d)
    return d


@pytest.fixture()
def x():
    return torch.randn(2, 3, 32, 32, generator=torch.Generator().manual_seed(1))


@pytest.fixture()
def noise():
    return torch.rand(2, 16, generator=torch.Generator().manual_seed(2))


def _attn_modules(model):
    return {n: m for n, m in model.named_modules() if type(m).__name__ in ("ViTAttention", "ViTMAEAttention")}


def _capture(model):
    seen, hooks = {}, []
    for name, m in _attn_modules(model).items():
        def pre(mod, args, kwargs, name=name):
            seen.setdefault(name, {})["x"] = args[0] if args else kwargs["hidden_states"]

        def post(mod, args, kwargs, out, name=name):
            seen[name]["out"] = out[0]
        hooks += [m.register_forward_pre_hook(pre, with_kwargs=True), m.register_forward_hook(post, with_kwargs=True)]
    return seen, hooks


def _expected(attn, h, policy):
    B, S, _ = h.shape
    q, k, v = (p(h).view(B, S, -1, attn.head_dim).transpose(1, 2) for p in (attn.q_proj, attn.k_proj, attn.v_proj))
    o = fp4vis.attention(q, k, v, policy=policy, scale=attn.scaling, backend="reference")
    return attn.o_proj(o.transpose(1, 2).reshape(B, S, -1))


@pytest.mark.parametrize("impl", ["sdpa", "eager"])
@torch.no_grad()
def test_vit_layer_equals_fp4vis_attention_then_bit_identical(vit_dir, x, impl):
    model = ViTModel.from_pretrained(vit_dir, attn_implementation=impl).eval()
    ref = model(x).last_hidden_state
    seen, hooks = _capture(model)
    h = fp4vis.patch(model, "fast", layers={2: None})
    assert model.config._attn_implementation == f"fp4vis_{impl}"
    assert h.policies == {"layers.0.attention": "fast", "layers.1.attention": "fast", "layers.2.attention": None}
    model(x)
    for hk in hooks:
        hk.remove()
    for name in ("layers.0.attention", "layers.1.attention"):
        rec = seen[name]
        torch.testing.assert_close(rec["out"], _expected(model.get_submodule(name), rec["x"], "fast"), rtol=0, atol=0)
    # the unpatched layer shares the config and still runs the original implementation, bit for bit
    l2 = model.get_submodule("layers.2.attention")
    with torch.no_grad():
        base = transformers.modeling_utils.ALL_ATTENTION_FUNCTIONS.get_interface(impl, None)
        assert base is not None or impl == "eager"
    out_patched = l2(seen["layers.2.attention"]["x"])[0]
    model.config._attn_implementation = impl  # temporarily the plain implementation
    out_plain = l2(seen["layers.2.attention"]["x"])[0]
    model.config._attn_implementation = f"fp4vis_{impl}"
    assert torch.equal(out_patched, out_plain)
    assert [s.calls for s in h.states] == [1, 1]
    h.remove()
    assert model.config._attn_implementation == impl
    assert not any(hasattr(m, "_fp4vis_state") for m in model.modules())
    assert torch.equal(model(x).last_hidden_state, ref)


@torch.no_grad()
def test_mae_encoder_by_default_decoder_on_request(mae_dir, x, noise):
    mae = ViTMAEForPreTraining.from_pretrained(mae_dir).eval()
    enc = ["vit.layers.0.attention", "vit.layers.1.attention"]
    dec = ["decoder.decoder_layers.0.attention", "decoder.decoder_layers.1.attention"]
    # the decoder holds a deep copy of the config: changing the model config reaches only the encoder
    assert mae.decoder.config is not mae.config
    ref = mae(x, noise=noise).logits

    def calls(h):
        return {n: s.calls for n, s in h.layers.items() if s is not None}

    with fp4vis.patch(mae, "fast") as h:
        assert h.policies == {**dict.fromkeys(enc, "fast"), **dict.fromkeys(dec)}
        mae(x, noise=noise)
        assert calls(h) == dict.fromkeys(enc, 1)
        assert mae.decoder.config._attn_implementation == "sdpa"
    with fp4vis.patch(mae, "fast", decoder=True) as h:
        mae(x, noise=noise)
        assert calls(h) == dict.fromkeys(enc + dec, 1)
        assert mae.decoder.config._attn_implementation == "fp4vis_sdpa"
    with fp4vis.patch(mae, None, layers={"decoder.*": "accurate"}) as h:
        assert h.policies == {**dict.fromkeys(enc), **dict.fromkeys(dec, "accurate")}
        mae(x, noise=noise)
        assert calls(h) == dict.fromkeys(dec, 1)
        assert mae.config._attn_implementation == "sdpa"
    with fp4vis.patch(mae, "fast", layers={1: "accurate"}) as h:  # int keys: default (encoder) layers
        assert h.policies[enc[1]] == "accurate" and h.policies[dec[1]] is None
    assert mae.config._attn_implementation == "sdpa" and mae.decoder.config._attn_implementation == "sdpa"
    assert torch.equal(mae(x, noise=noise).logits, ref)


@torch.no_grad()
def test_mae_decoder_output_equals_fp4vis_attention(mae_dir, x, noise):
    mae = ViTMAEForPreTraining.from_pretrained(mae_dir).eval()
    seen, hooks = _capture(mae)
    with fp4vis.patch(mae, "accurate", decoder=True):
        mae(x, noise=noise)
    for hk in hooks:
        hk.remove()
    assert len(seen) == 4
    for name, rec in seen.items():
        torch.testing.assert_close(rec["out"], _expected(mae.get_submodule(name), rec["x"], "accurate"),
                                   rtol=0, atol=0)


@torch.no_grad()
def test_hf_fallbacks(vit_dir, x):
    model = ViTModel.from_pretrained(vit_dir, attn_implementation="eager").eval()
    with fp4vis.patch(model, "fast"):
        with warnings.catch_warnings(record=True) as w:
            warnings.simplefilter("always")
            out = model(x, output_attentions=True)
        msgs = [str(i.message) for i in w if issubclass(i.category, FallbackWarning)]
        assert len(msgs) == 3 and all("output_attentions" in m for m in msgs)
        assert out.attentions[0] is not None
    with fp4vis.patch(model, "fast", strict=True):
        with pytest.raises(FallbackError, match="layers.0.attention"):
            model(x, output_attentions=True)
    train = ViTModel.from_pretrained(vit_dir, attention_probs_dropout_prob=0.1).train()
    with fp4vis.patch(train, "fast"):
        with pytest.warns(FallbackWarning, match="dropout"):
            train(x)


def test_double_patch_is_an_error(vit_dir):
    model = ViTModel.from_pretrained(vit_dir).eval()
    with fp4vis.patch(model):
        with pytest.raises(RuntimeError, match="already patched"):
            fp4vis.patch(model)
        # another subset through a second handle is fine and shares the config routing
        assert model.config._attn_implementation == "fp4vis_sdpa"
    assert model.config._attn_implementation == "sdpa"
    h1 = fp4vis.patch(model, None, layers={0: "fast"})
    h2 = fp4vis.patch(model, None, layers={1: "fast"})
    h1.remove()
    assert model.config._attn_implementation == "fp4vis_sdpa"  # h2 still uses it
    h2.remove()
    assert model.config._attn_implementation == "sdpa"


@torch.no_grad()
def test_patched_vit_compiles_with_fullgraph(vit_dir, x):
    """transformers' attention function, patched, traced with fullgraph=True (the reference is one op) and
    run through AOTAutograd (aot_eager: the same ops, so the same bits; inductor's code generation is
    tested on timm's, tests/patching/test_timm_vit.py)."""
    model = ViTModel.from_pretrained(vit_dir, attn_implementation="sdpa").eval()
    with fp4vis.patch(model, "fast"):
        eager = model(x).last_hidden_state
        torch._dynamo.reset()
        out = torch.compile(model, fullgraph=True, backend="aot_eager")(x).last_hidden_state
    torch._dynamo.reset()
    assert torch.equal(out, eager)
