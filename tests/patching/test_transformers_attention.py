"""fp4vis.patch on transformers models whose attention goes through AttentionInterface (tiny random models:
ViT and ViTMAE through save/from_pretrained, DeiT, Dinov2, CLIP, SigLIP and BEiT built from their configs)."""

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
    tested on timm's, tests/patching/test_timm_attention.py)."""
    model = ViTModel.from_pretrained(vit_dir, attn_implementation="sdpa").eval()
    with fp4vis.patch(model, "fast"):
        eager = model(x).last_hidden_state
        torch._dynamo.reset()
        out = torch.compile(model, fullgraph=True, backend="aot_eager")(x).last_hidden_state
    torch._dynamo.reset()
    assert torch.equal(out, eager)


# -- every model family through AttentionInterface ------------------------------------------------------------

SMALL = dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=2, intermediate_size=64, image_size=32,
             patch_size=8)


def _family(name: str):
    """A tiny random model of a family and the names of its default (vision) layers."""
    T = transformers
    torch.manual_seed(0)
    build = {
        "vit": lambda: T.ViTModel(T.ViTConfig(**SMALL)),
        "deit": lambda: T.DeiTModel(T.DeiTConfig(**SMALL)),
        "dinov2": lambda: T.Dinov2Model(T.Dinov2Config(**SMALL)),
        "dinov2_registers": lambda: T.Dinov2WithRegistersModel(
            T.Dinov2WithRegistersConfig(**SMALL, num_register_tokens=2)),
        "clip_vision": lambda: T.CLIPVisionModel(T.CLIPVisionConfig(**SMALL)),
        "siglip_vision": lambda: T.SiglipVisionModel(T.SiglipVisionConfig(**SMALL, vision_use_head=False)),
        "beit": lambda: T.BeitModel(T.BeitConfig(**SMALL)),
    }[name]
    return build().eval()


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
        key_mask = None if mask is None else mask[:, 0, 0, :].expand(q.shape[0], k.shape[2])
        assert mask is None or torch.equal(mask, key_mask[:, None, None, :].expand_as(mask))
        return fp4vis.attention(q, k, v, policy=self.policy, scale=kwargs.get("scale"), backend="reference",
                                key_mask=None if key_mask is None or key_mask.all() else key_mask)


@pytest.mark.parametrize("family", ["vit", "deit", "dinov2", "dinov2_registers", "clip_vision", "siglip_vision",
                                    "beit"])
@torch.no_grad()
def test_family_patched_in_fp4_then_restored_bit_identically(family, x):
    model = _family(family)
    assert model.config._attn_implementation == "sdpa"
    ref = model(x).last_hidden_state
    oracle_mode = SdpaAsFp4("fast")
    with oracle_mode:
        oracle = model(x).last_hidden_state
    with warnings.catch_warnings():
        warnings.simplefilter("error", FallbackWarning)   # nothing unsupported, no fallback
        h = fp4vis.patch(model, "fast")
        out = model(x).last_hidden_state
    assert len(h.states) == oracle_mode.calls == 2
    assert all(s.group == "encoder" and s.patcher == "transformers" for s in h.specs)
    assert [(s.num_heads, s.head_dim) for s in h.specs] == [(2, 32)] * 2
    assert [s.calls for s in h.states] == [1, 1]
    assert torch.equal(out, oracle)   # the model's own q, k, v and output steps around fp4vis.attention
    assert not torch.equal(out, ref) and (out - ref).abs().max() < 1.0
    h.remove()
    assert model.config._attn_implementation == "sdpa"
    assert torch.equal(model(x).last_hidden_state, ref)


@torch.no_grad()
def test_beit_relative_position_bias_keeps_exact_attention(x):
    model = transformers.BeitModel(transformers.BeitConfig(**SMALL, use_relative_position_bias=True)).eval()
    ref = model(x).last_hidden_state
    with fp4vis.patch(model, "fast") as h:
        with warnings.catch_warnings(record=True) as w:
            warnings.simplefilter("always")
            out = model(x).last_hidden_state
        msgs = [str(i.message) for i in w if issubclass(i.category, FallbackWarning)]
        assert len(msgs) == 2 and all("per-head attention bias of shape 1x2x17x17" in m for m in msgs)
        assert "'layers.0.attention'" in msgs[0] and "'layers.1.attention'" in msgs[1]
        assert [(s.calls, s.fallbacks) for s in h.states] == [(0, 1), (0, 1)]
        assert torch.equal(out, ref)
    with fp4vis.patch(model, "fast", strict=True), pytest.raises(FallbackError, match="relative position bias"):
        model(x)


@torch.no_grad()
def test_siglip_pooling_head_is_reported_as_unsupported(x):
    model = transformers.SiglipVisionModel(transformers.SiglipVisionConfig(**SMALL)).eval()
    with pytest.warns(FallbackWarning, match=r"head\.attention \(MultiheadAttention\)"):
        h = fp4vis.patch(model, "fast")
    model(x)
    assert [s.calls for s in h.states] == [1, 1]
    h.remove()


@pytest.mark.parametrize("impl", ["sdpa", "eager"])
@torch.no_grad()
def test_key_padding_mask_runs_fp4_with_key_mask(impl, x):
    """A padding mask given to the model reaches fp4vis.attention as its key mask (not dropped: the patched
    config names a mask function), in the base implementation's form (bool for sdpa, additive for eager)."""
    model = transformers.ViTModel(transformers.ViTConfig(**SMALL), add_pooling_layer=False).eval()
    pad = torch.ones(2, 17, dtype=torch.long)
    pad[1, 11:] = 0
    model.set_attn_implementation("sdpa")
    oracle_mode = SdpaAsFp4("fast")
    with oracle_mode:
        oracle = model(x, attention_mask=pad).last_hidden_state
    model.set_attn_implementation(impl)
    ref = model(x, attention_mask=pad).last_hidden_state
    with warnings.catch_warnings():
        warnings.simplefilter("error", FallbackWarning)
        with fp4vis.patch(model, "fast") as h:
            out = model(x, attention_mask=pad).last_hidden_state
            unpadded = model(x).last_hidden_state
            with torch.inference_mode():
                assert torch.equal(model(x, attention_mask=pad).last_hidden_state, out)
            assert [s.calls for s in h.states] == [3, 3]
    assert torch.equal(out, oracle)
    assert torch.equal(out[0], unpadded[0]) and not torch.equal(out[1], unpadded[1])
    assert torch.equal(model(x, attention_mask=pad).last_hidden_state, ref)


@torch.no_grad()
def test_other_masks_and_arguments_keep_exact_attention():
    model = transformers.ViTModel(transformers.ViTConfig(**SMALL)).eval()
    model.set_attn_implementation("eager")
    attn = model.layers[0].attention
    h_in = torch.randn(2, 17, 64)
    causal = torch.full((17, 17), torch.finfo(torch.float32).min).triu(1)[None, None]
    with fp4vis.patch(model, "fast") as h:
        with pytest.warns(FallbackWarning, match="differs between queries"):
            out = attn(h_in, causal)[0]
        model.config._attn_implementation = "eager"
        assert torch.equal(out, attn(h_in, causal)[0])
        model.config._attn_implementation = "fp4vis_eager"
        with pytest.warns(FallbackWarning, match="argument sliding_window of the attention function"):
            attn(h_in, None, sliding_window=4)
        assert h.states[0].calls == 0 and h.states[0].fallbacks == 2


@torch.no_grad()
def test_clip_text_tower_is_reachable_by_name_only(x):
    T = transformers
    torch.manual_seed(0)
    text = dict(hidden_size=32, num_hidden_layers=1, num_attention_heads=2, intermediate_size=32, vocab_size=50,
                bos_token_id=0, eos_token_id=1, pad_token_id=2)
    model = T.CLIPModel(T.CLIPConfig(text_config=text, vision_config=SMALL)).eval()
    ids = torch.randint(3, 50, (2, 5))
    ref = model(input_ids=ids, pixel_values=x).logits_per_image
    with fp4vis.patch(model, "fast") as h:
        assert h.policies == {"text_model.encoder.layers.0.self_attn": None,
                              "vision_model.encoder.layers.0.self_attn": "fast",
                              "vision_model.encoder.layers.1.self_attn": "fast"}
        assert h.specs[0].group == "text"
        assert model.text_model.config._attn_implementation == "sdpa"   # the text tower is untouched
        model(input_ids=ids, pixel_values=x)
        assert [s.calls for s in h.states] == [1, 1]
    with fp4vis.patch(model, None, layers={"text_model.*": "fast"}) as h:
        with pytest.warns(FallbackWarning, match="causal attention"):   # causal: exact attention, as named
            out = model(input_ids=ids, pixel_values=x).logits_per_image
        assert torch.equal(out, ref)
    assert torch.equal(model(input_ids=ids, pixel_values=x).logits_per_image, ref)


def test_discovery_reads_heads_from_the_module():
    from fp4vis.patching import transformers_attention as ta

    model = _family("clip_vision")
    attn = model.encoder.layers[0].self_attn
    assert not hasattr(attn, "num_attention_heads") and ta.heads_of(attn) == (2, 32)
    assert ta.uses_attention_interface(attn) and not ta.uses_attention_interface(model.encoder)
    assert ta.find_layers(torch.nn.Sequential(torch.nn.Linear(4, 4))) == []
