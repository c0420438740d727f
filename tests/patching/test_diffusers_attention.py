"""fp4vis.patch on diffusers' attention layers (``fp4vis.patching.diffusers_attention``): tiny random FLUX,
Qwen-Image, HunyuanVideo 1.0 / 1.5, LTX-Video, CogVideoX, SkyReels-V2, Mochi, SD3.5, PixArt and Sana
transformers built from their configs (head dim 16, one or two blocks per stack, a batch of two prompts of which
three text tokens are padding)."""

from __future__ import annotations

import inspect
import re
import sys
import warnings

import pytest
import torch
import torch.nn.functional as F

diffusers = pytest.importorskip("diffusers")
from diffusers.models.attention_dispatch import (  # noqa: E402
    AttentionBackendName,
    _AttentionBackendRegistry,
    attention_backend,
    dispatch_attention_fn,
)
from torch.overrides import TorchFunctionMode  # noqa: E402

import fp4vis  # noqa: E402
from fp4vis.patching.diffusers_attention import (  # noqa: E402
    PAIRWISE_MASK_PROCESSORS,
    SDPA_BACKENDS,
    FP4AttnProcessor,
)

pytestmark = pytest.mark.filterwarnings("ignore:In CPU autocast:UserWarning")   # Mochi's float32 autocast on CPU

B, TEXT, VALID = 2, 8, 5     # batch, text tokens, valid (unpadded) text tokens


def _randn(*shape, seed=0):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


def _text_mask(n=TEXT, valid=VALID):
    mask = torch.zeros(B, n, dtype=torch.bool)
    mask[:, :valid] = True
    return mask


def _t():
    return torch.tensor([1.0] * B)


def _text():
    return _randn(B, TEXT, 32, seed=1)


# name -> (model, inputs); the text field a mask pads is "encoder_hidden_states" (positions VALID: are padding)
def _flux():
    m = diffusers.FluxTransformer2DModel(patch_size=1, in_channels=4, num_layers=1, num_single_layers=1,
                                         attention_head_dim=16, num_attention_heads=2, joint_attention_dim=32,
                                         pooled_projection_dim=32, axes_dims_rope=[4, 4, 8])
    return m, dict(hidden_states=_randn(B, 16, 4), encoder_hidden_states=_randn(B, TEXT, 32, seed=1),
                   pooled_projections=_randn(B, 32, seed=2), timestep=_t(), img_ids=torch.zeros(16, 3),
                   txt_ids=torch.zeros(TEXT, 3), return_dict=False)


def _qwen():
    m = diffusers.QwenImageTransformer2DModel(patch_size=2, in_channels=16, out_channels=4, num_layers=2,
                                              attention_head_dim=16, num_attention_heads=2, joint_attention_dim=32,
                                              axes_dims_rope=(4, 6, 6))
    return m, dict(hidden_states=_randn(B, 16, 16), encoder_hidden_states=_randn(B, TEXT, 32, seed=1),
                   encoder_hidden_states_mask=_text_mask(), timestep=_t(), img_shapes=[(1, 4, 4)] * B,
                   return_dict=False)


def _hunyuan():
    m = diffusers.HunyuanVideoTransformer3DModel(in_channels=4, out_channels=4, num_attention_heads=2,
                                                 attention_head_dim=16, num_layers=1, num_single_layers=1,
                                                 num_refiner_layers=1, patch_size=1, patch_size_t=1, text_embed_dim=32,
                                                 pooled_projection_dim=16, rope_axes_dim=(4, 6, 6))
    return m, dict(hidden_states=_randn(B, 4, 1, 4, 4), timestep=_t(), encoder_hidden_states=_text(),
                   encoder_attention_mask=_text_mask(), pooled_projections=_randn(B, 16, seed=2),
                   guidance=torch.tensor([3.0] * B), return_dict=False)


def _hunyuan15():
    m = diffusers.HunyuanVideo15Transformer3DModel(in_channels=4, out_channels=4, num_attention_heads=2,
                                                   attention_head_dim=16, num_layers=2, num_refiner_layers=1,
                                                   patch_size=1, patch_size_t=1, text_embed_dim=32, text_embed_2_dim=16,
                                                   image_embed_dim=16, rope_axes_dim=(4, 6, 6), target_size=32,
                                                   task_type="t2v")
    return m, dict(hidden_states=_randn(B, 4, 1, 4, 4), timestep=_t(), encoder_hidden_states=_text(),
                   encoder_attention_mask=_text_mask(), encoder_hidden_states_2=_randn(B, 4, 16, seed=2),
                   encoder_attention_mask_2=_text_mask(4, 3), image_embeds=torch.zeros(B, 5, 16), return_dict=False)


def _ltx():
    m = diffusers.LTXVideoTransformer3DModel(in_channels=4, out_channels=4, num_attention_heads=2,
                                             attention_head_dim=16, cross_attention_dim=32, num_layers=2,
                                             caption_channels=32)
    return m, dict(hidden_states=_randn(B, 32, 4), encoder_hidden_states=_randn(B, TEXT, 32, seed=1), timestep=_t(),
                   encoder_attention_mask=_text_mask().long(), num_frames=2, height=4, width=4, return_dict=False)


def _cogvideox():
    m = diffusers.CogVideoXTransformer3DModel(num_attention_heads=2, attention_head_dim=16, in_channels=4,
                                              out_channels=4, time_embed_dim=16, text_embed_dim=32, num_layers=2,
                                              sample_width=8, sample_height=8, sample_frames=5, patch_size=2,
                                              max_text_seq_length=TEXT)
    return m, dict(hidden_states=_randn(B, 2, 4, 8, 8), encoder_hidden_states=_randn(B, TEXT, 32, seed=1),
                   timestep=_t(), return_dict=False)


def _skyreels():
    m = diffusers.SkyReelsV2Transformer3DModel(patch_size=(1, 2, 2), num_attention_heads=2, attention_head_dim=16,
                                               in_channels=4, out_channels=4, text_dim=32, freq_dim=32, ffn_dim=32,
                                               num_layers=2, rope_max_seq_len=32)
    return m, dict(hidden_states=_randn(B, 4, 2, 4, 4), timestep=_t(), encoder_hidden_states=_text(),
                   return_dict=False)


def _mochi():
    m = diffusers.MochiTransformer3DModel(patch_size=2, num_attention_heads=2, attention_head_dim=16, num_layers=2,
                                          pooled_projection_dim=16, in_channels=4, text_embed_dim=32, time_embed_dim=4,
                                          max_sequence_length=TEXT)
    return m, dict(hidden_states=_randn(B, 4, 2, 4, 4), encoder_hidden_states=_randn(B, TEXT, 32, seed=1),
                   timestep=_t(), encoder_attention_mask=_text_mask(), return_dict=False)


def _sd35():
    m = diffusers.SD3Transformer2DModel(sample_size=8, patch_size=2, in_channels=4, num_layers=2, attention_head_dim=16,
                                        num_attention_heads=2, joint_attention_dim=32, caption_projection_dim=32,
                                        pooled_projection_dim=16, out_channels=4, pos_embed_max_size=8,
                                        dual_attention_layers=(0,), qk_norm="rms_norm")
    return m, dict(hidden_states=_randn(B, 4, 8, 8), encoder_hidden_states=_randn(B, TEXT, 32, seed=1),
                   pooled_projections=_randn(B, 16, seed=2), timestep=_t(), return_dict=False)


def _pixart():
    m = diffusers.PixArtTransformer2DModel(num_attention_heads=2, attention_head_dim=16, in_channels=4, out_channels=8,
                                           num_layers=2, cross_attention_dim=32, sample_size=8, patch_size=2,
                                           caption_channels=32, norm_num_groups=1)
    return m, dict(hidden_states=_randn(B, 4, 8, 8), encoder_hidden_states=_randn(B, TEXT, 32, seed=1), timestep=_t(),
                   added_cond_kwargs={"resolution": None, "aspect_ratio": None},
                   encoder_attention_mask=_text_mask().long(), return_dict=False)


def _sana():
    m = diffusers.SanaTransformer2DModel(in_channels=4, out_channels=4, num_attention_heads=2, attention_head_dim=16,
                                         num_layers=2, num_cross_attention_heads=2, cross_attention_head_dim=16,
                                         cross_attention_dim=32, caption_channels=32, sample_size=8, patch_size=1)
    return m, dict(hidden_states=_randn(B, 4, 8, 8), encoder_hidden_states=_randn(B, TEXT, 32, seed=1), timestep=_t(),
                   encoder_attention_mask=_text_mask().long(), return_dict=False)


BUILDERS = {"flux": _flux, "qwen_image": _qwen, "hunyuan_video": _hunyuan, "hunyuan_video_15": _hunyuan15,
            "ltx_video": _ltx, "cogvideox": _cogvideox, "skyreels_v2": _skyreels, "mochi": _mochi, "sd35": _sd35,
            "pixart": _pixart, "sana": _sana}

# every reachable layer -> its group; the default ones are "self" and "joint"
GROUPS = {
    "flux": {"transformer_blocks.0.attn": "joint", "single_transformer_blocks.0.attn": "self"},
    "qwen_image": {"transformer_blocks.0.attn": "joint", "transformer_blocks.1.attn": "joint"},
    "hunyuan_video": {"context_embedder.token_refiner.refiner_blocks.0.attn": "text",
                      "transformer_blocks.0.attn": "joint", "single_transformer_blocks.0.attn": "self"},
    "hunyuan_video_15": {"context_embedder.token_refiner.refiner_blocks.0.attn": "text",
                         "transformer_blocks.0.attn": "joint", "transformer_blocks.1.attn": "joint"},
    "ltx_video": {"transformer_blocks.0.attn1": "self", "transformer_blocks.0.attn2": "cross",
                  "transformer_blocks.1.attn1": "self", "transformer_blocks.1.attn2": "cross"},
    "cogvideox": {"transformer_blocks.0.attn1": "self", "transformer_blocks.1.attn1": "self"},
    "skyreels_v2": {"blocks.0.attn1": "self", "blocks.0.attn2": "cross", "blocks.1.attn1": "self",
                    "blocks.1.attn2": "cross"},
    "mochi": {"transformer_blocks.0.attn1": "joint", "transformer_blocks.1.attn1": "joint"},
    "sd35": {"transformer_blocks.0.attn": "joint", "transformer_blocks.0.attn2": "self",
             "transformer_blocks.1.attn": "joint"},
    "pixart": {"transformer_blocks.0.attn1": "self", "transformer_blocks.0.attn2": "cross",
               "transformer_blocks.1.attn1": "self", "transformer_blocks.1.attn2": "cross"},
    "sana": {"transformer_blocks.0.attn2": "cross", "transformer_blocks.1.attn2": "cross"},
}


def _build(name):
    torch.manual_seed(0)
    model, inputs = BUILDERS[name]()
    return model.eval(), inputs


def _processors(model):
    return {n: m.processor for n, m in model.named_modules() if hasattr(m, "processor")}


@pytest.mark.parametrize("name", [n for n in BUILDERS if n != "sana"])
@torch.no_grad()
def test_default_layers_run_fp4_and_remove_restores_bit_identical(name):
    """Every default layer runs fp4vis (its calls rise, no fallback), the output moves by a small nonzero
    relative error, and remove() sets the original processor objects back: the output is bit-identical."""
    model, inputs = _build(name)
    ref = model(**inputs)[0]
    before = _processors(model)
    with warnings.catch_warnings():
        warnings.simplefilter("error", fp4vis.FallbackWarning)
        h = fp4vis.patch(model, "fast")
        out = model(**inputs)[0]
    assert {s.local_name: s.group for s in h.specs} == GROUPS[name]
    patched = {n: st for n, st in h.layers.items() if st is not None}
    assert set(patched) == {n for n, g in GROUPS[name].items() if g in ("self", "joint")}
    assert all(st.calls >= 1 and st.fallbacks == 0 for st in patched.values())
    assert all(isinstance(model.get_submodule(n).processor, FP4AttnProcessor) for n in patched)
    rel = ((out - ref).norm() / ref.norm()).item()
    assert torch.isfinite(out).all() and 1e-4 < rel < 0.15, rel
    h.remove()
    assert all(m.processor is before[n] for n, m in model.named_modules() if hasattr(m, "processor"))
    assert torch.equal(model(**inputs)[0], ref)


@pytest.mark.parametrize("name", ["flux", "hunyuan_video", "cogvideox"])
@torch.no_grad()
def test_fp8_pv_policy_runs_in_the_default_layers_and_restores(name):
    """The FP8 P/V softmax (``fp8``: docs/numerics.md section 7) in every default layer, text padding as a key
    mask included: no fallback, closer to the model's attention than ``fast``, and remove() restores it."""
    model, inputs = _build(name)
    ref = model(**inputs)[0]
    errors = {}
    for policy in ("fp8", "fast"):
        with warnings.catch_warnings():
            warnings.simplefilter("error", fp4vis.FallbackWarning)
            h = fp4vis.patch(model, policy)
            out = model(**inputs)[0]
        assert all(st.calls >= 1 and st.fallbacks == 0 for st in h.layers.values() if st is not None)
        errors[policy] = ((out - ref).norm() / ref.norm()).item()
        h.remove()
    assert torch.isfinite(out).all() and 0 < errors["fp8"] < errors["fast"], errors
    assert torch.equal(model(**inputs)[0], ref)


def _key_mask_spy(monkeypatch):
    """The key_mask of every FP4 call a patched layer runs (``fp4vis.attention.run_call``; None where a call had
    none)."""
    module = sys.modules["fp4vis.patching.layer"]
    seen, original = [], module.run_call

    def spy(call, *args, **kwargs):
        seen.append(call.key_mask)
        return original(call, *args, **kwargs)

    monkeypatch.setattr(module, "run_call", spy)
    return seen


@pytest.mark.parametrize("name", ["qwen_image", "hunyuan_video", "hunyuan_video_15", "mochi"])
@torch.no_grad()
def test_padded_text_tokens_change_nothing_where_the_model_masks_them(name, monkeypatch):
    """The text padding reaches fp4vis.attention as key_mask (Qwen-Image, HunyuanVideo: the (B, 1, 1, S) bool mask;
    HunyuanVideo 1.5: the diagonal of its pairwise mask, video and valid text tokens True) or as the valid tokens
    alone (Mochi attends per batch element without a mask): changing a padded token changes nothing."""
    model, inputs = _build(name)
    other = dict(inputs, encoder_hidden_states=inputs["encoder_hidden_states"].clone())
    other["encoder_hidden_states"][:, VALID:] = _randn(B, TEXT - VALID, 32, seed=9) * 3
    with fp4vis.patch(model, "fast") as h:
        seen = _key_mask_spy(monkeypatch)
        out = model(**inputs)[0]
        assert torch.equal(model(**other)[0], out)
        calls = {n: st.calls for n, st in h.layers.items() if st is not None}
    if name == "mochi":
        assert all(m is None for m in seen) and set(calls.values()) == {2 * B}    # one call per batch element
        return
    assert len(seen) == 2 * len(calls) and all(m is not None and m.dtype == torch.bool for m in seen)
    if name == "hunyuan_video_15":   # video tokens, the valid byT5 and text tokens, then the padding and the 5
        video, valid = 16, 3 + VALID   # image slots (t2v: all invalid)
        expected = torch.zeros(B, video + 5 + 4 + TEXT, dtype=torch.bool)
        expected[:, :video + valid] = True
        assert all(torch.equal(m, expected) for m in seen)
    else:
        assert all(int((~m).sum()) == B * (TEXT - VALID) for m in seen)


@pytest.mark.parametrize(("name", "kwargs", "form"), [
    ("hunyuan_video", dict(policy=None, layers={"*refiner*": "fast"}), r"varies per head and per query"),
    ("ltx_video", dict(cross_attention=True), r"additive attention mask \(a float bias on the logits\) of shape "
                                              r"2x2x1x8"),
    ("pixart", dict(cross_attention=True), r"additive attention mask"),
])
@torch.no_grad()
def test_other_mask_forms_keep_exact_attention_naming_the_form(name, kwargs, form):
    """HunyuanVideo's token refiner (a per-query mask, group "text": by name only) and the -10000 text bias of
    LTX's and PixArt's cross-attention keep exact attention with one warning per layer naming the form; strict
    raises."""
    model, inputs = _build(name)
    policy = kwargs.pop("policy", "fast")
    with fp4vis.patch(model, policy, **kwargs) as h:
        with pytest.warns(fp4vis.FallbackWarning, match=form):
            model(**inputs)
        masked = [st for st in h.states if st.fallbacks]
        assert masked and all(st.calls == 0 for st in masked)
    with fp4vis.patch(model, policy, strict=True, **kwargs), pytest.raises(fp4vis.FallbackError, match=form):
        model(**inputs)


@torch.no_grad()
def test_sana_linear_attention_is_reported_and_nothing_is_patched_by_default():
    model, inputs = _build("sana")
    with pytest.warns(fp4vis.FallbackWarning) as record:
        h = fp4vis.patch(model, "fast")
    messages = "\n".join(str(w.message) for w in record)
    assert "transformer_blocks.0.attn1 (Attention with processor SanaLinearAttnProcessor2_0)" in messages
    assert "none of the 2 attention layers of SanaTransformer2DModel is a default layer (groups: cross)" in messages
    assert h.policies == {"transformer_blocks.0.attn2": None, "transformer_blocks.1.attn2": None}
    h.remove()
    with pytest.raises(NotImplementedError, match="SanaLinearAttnProcessor2_0"):
        fp4vis.patch(model, "fast", strict=True)


@torch.no_grad()
def test_int_keys_select_the_main_stack():
    """FLUX has two block stacks with the same indices: an int key names transformer_blocks.N only (the first
    stack), single_transformer_blocks.N by pattern; a key past the main stack matches nothing."""
    model, _ = _build("flux")
    with fp4vis.patch(model, "fast", layers={0: "accurate", "single_transformer_blocks.0.*": None}) as h:
        assert h.policies == {"transformer_blocks.0.attn": "accurate", "single_transformer_blocks.0.attn": None}
        assert [(s.stack, s.index) for s in h.specs] == [("transformer_blocks", 0), ("single_transformer_blocks", 0)]
    with pytest.raises(ValueError, match="key 1 matches no attention layer"):
        fp4vis.patch(model, "fast", layers={1: None})


def test_int_keys_select_wan_vace_main_blocks():
    from diffusers import WanVACETransformer3DModel

    from fp4vis.patching.discovery import find_layers, select_layers

    model = WanVACETransformer3DModel(patch_size=(1, 2, 2), num_attention_heads=2, attention_head_dim=16, in_channels=4,
                                      out_channels=4, text_dim=32, freq_dim=32, ffn_dim=32, num_layers=2,
                                      vace_layers=[0, 1], vace_in_channels=4)
    specs, _ = find_layers(model)
    assert {s.name for s in specs if s.default} == {"blocks.0.attn1", "blocks.1.attn1", "vace_blocks.0.attn1",
                                                    "vace_blocks.1.attn1"}
    assert [s.name for s in select_layers(specs, 1)] == ["blocks.1.attn1"]


@torch.no_grad()
def test_strict_names_what_keeps_a_processor_exact():
    """A non-SDPA attention backend (per layer or for the process) and a processor that makes no SDPA call keep
    exact attention, naming it; the SDPA backends run fp4vis. A context-parallel config without its device mesh
    (not set up by enable_parallelism) is an error naming it (context parallelism itself:
    tests/patching/test_diffusers_context_parallel.py)."""
    model, inputs = _build("flux")
    layer = model.transformer_blocks[0].attn
    # set_attention_backend sets the process-wide backend too: attention_backend sets the previous one back
    with fp4vis.patch(model, "fast", strict=True) as h, attention_backend("native"):
        model.set_attention_backend("_native_math")     # lands on the original processor, which dispatches to it
        assert layer.processor.original._attention_backend == AttentionBackendName._NATIVE_MATH
        model(**inputs)
        assert all(st.calls == 1 for st in h.states)
        model.reset_attention_backend()
        with attention_backend("flex"), pytest.raises(fp4vis.FallbackError, match="backend 'flex'"):
            model(**inputs)
        from diffusers import ContextParallelConfig
        from diffusers.models._modeling_parallel import ParallelConfig

        layer.processor.original._parallel_config = ParallelConfig(ContextParallelConfig(ulysses_degree=2))
        with pytest.raises(ValueError, match="ContextParallelConfig has no device mesh: it is set up by the model's"):
            model(**inputs)
        layer.processor.original._parallel_config = None

    class NoSDPAProcessor:   # names F.scaled_dot_product_attention, calls it only when asked
        def __call__(self, attn, hidden_states, encoder_hidden_states=None, attention_mask=None, sdpa=False):
            x = hidden_states
            return F.scaled_dot_product_attention(x, x, x) if sdpa else x

    attn = diffusers.models.attention_processor.Attention(32, heads=2, dim_head=16, processor=NoSDPAProcessor())
    with fp4vis.patch(attn, "fast", strict=True):
        assert "sdpa" in inspect.signature(attn.processor.__call__).parameters
        with pytest.raises(fp4vis.FallbackError, match="made no scaled_dot_product_attention call"):
            attn(torch.randn(1, 4, 32))


@torch.no_grad()
def test_patched_transformer_compiles_with_fullgraph():
    """A patched Qwen-Image (joint attention with a key mask) traced with fullgraph=True, and under diffusers'
    regional compilation (its two blocks share one graph), run through AOTAutograd: the eager bits."""
    model, inputs = _build("qwen_image")
    with fp4vis.patch(model, "fast"):
        eager = model(**inputs)[0]
        torch._dynamo.reset()
        try:
            out = torch.compile(model, fullgraph=True, backend="aot_eager")(**inputs)[0]
            torch._dynamo.reset()
            model.compile_repeated_blocks(fullgraph=True, backend="aot_eager")
            with torch._dynamo.config.patch(error_on_recompile=True):
                regional = model(**inputs)[0]
        finally:
            torch._dynamo.reset()
    assert torch.equal(out, eager) and torch.equal(regional, eager)


class _SDPACalls(TorchFunctionMode):
    """Records the arguments of each F.scaled_dot_product_attention call and returns zeros instead."""

    def __init__(self):
        super().__init__()
        self.calls = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is F.scaled_dot_product_attention:
            self.calls.append(dict(zip(("query", "key", "value", "attn_mask"), args), **kwargs))
            return torch.zeros_like(self.calls[-1]["query"])
        return func(*args, **kwargs)


def test_the_private_diffusers_names_it_relies_on():
    """Pins what the module docstring lists against the installed diffusers: the process-wide backend lives in
    ``_AttentionBackendRegistry._active_backend``; each of SDPA_BACKENDS ends in one F.scaled_dot_product_attention
    call; processors keep their backend and parallel config in ``_attention_backend`` / ``_parallel_config``;
    HunyuanVideo 1.5's processor builds its SDPA mask as valid_q & valid_k."""
    assert isinstance(_AttentionBackendRegistry._active_backend, AttentionBackendName)
    with attention_backend("_native_math"):
        assert _AttentionBackendRegistry._active_backend == AttentionBackendName._NATIVE_MATH
    q = torch.randn(1, 4, 2, 16)   # (B, S, H, D), diffusers' layout
    for name in SDPA_BACKENDS:
        with _SDPACalls() as rec:
            dispatch_attention_fn(q, q, q, backend=AttentionBackendName(name))
        assert len(rec.calls) == 1, name
    from diffusers.models.transformers.transformer_flux import FluxAttnProcessor
    assert FluxAttnProcessor._attention_backend is None and FluxAttnProcessor._parallel_config is None

    from diffusers.models.transformers.transformer_hunyuan_video15 import HunyuanVideo15AttnProcessor2_0
    assert f"{HunyuanVideo15AttnProcessor2_0.__module__}.{HunyuanVideo15AttnProcessor2_0.__qualname__}" in \
        PAIRWISE_MASK_PROCESSORS
    model, _ = _build("hunyuan_video_15")
    attn = model.transformer_blocks[0].attn
    text_valid = torch.tensor([[True, False, True, True], [False, False, False, False]])
    with torch.no_grad(), _SDPACalls() as rec:
        attn.processor(attn, torch.randn(B, 6, 32), torch.randn(B, 4, 32), attention_mask=text_valid)
    (call,) = rec.calls
    mask = call["attn_mask"]
    valid = torch.cat([torch.ones(B, 6, dtype=torch.bool), text_valid], dim=1)
    assert torch.equal(mask, valid[:, None, :, None] & valid[:, None, None, :])


def test_broadcast_key_mask_reads_the_form_from_shape_and_strides():
    from fp4vis.call import broadcast_key_mask

    q, k = torch.randn(2, 3, 5, 16), torch.randn(2, 3, 7, 16)
    keys = torch.rand(2, 7) > 0.3
    for mask in (keys[:, None, None, :], keys[:, None, None, :].expand(2, 3, 5, 7), keys[:1, None, None, :]):
        key_mask, reason = broadcast_key_mask(mask, q, k)
        assert reason is None and torch.equal(key_mask, keys[:mask.shape[0]].expand(2, 7))
    key_mask, reason = broadcast_key_mask(keys[:, None, None, :], q.transpose(1, 2), k.transpose(1, 2), "bshd")
    assert reason is None and torch.equal(key_mask, keys)
    for mask, form in ((keys[:, None, None, :].repeat(1, 1, 5, 1), "varies per query, of shape 2x1x5x7"),
                       (keys[:, None, None, :].repeat(1, 3, 1, 1), "varies per head, of shape 2x3x1x7"),
                       (keys[:, None, None, :].float(), "additive attention mask .* of shape 2x1x1x7"),
                       (keys, "of shape 2x7 for 2x3x5x7 attention"),     # SDPA reads a 2-D mask as (Sq, Skv)
                       (keys[:, None, None, :].int(), "dtype torch.int32")):
        key_mask, reason = broadcast_key_mask(mask, q, k)
        assert key_mask is None and reason is not None
        assert re.search(form, reason), reason


# ---- another attention function in the layers (fp4vis.patching.attention_function) ----

KEY_PADDING = "a key-padding attention mask (text padding; the function takes no mask)"


class _RecordingSDPA:
    """An attention function over (B, H, S, D) tensors that records each call's q shape and computes SDPA."""

    def __init__(self):
        self.shapes = []

    def __call__(self, q, k, v, scale=None):
        self.shapes.append(tuple(q.shape))
        return F.scaled_dot_product_attention(q, k, v, scale=scale)


@pytest.mark.parametrize(("name", "on_function", "kept"), [
    ("flux", ["transformer_blocks.0.attn", "single_transformer_blocks.0.attn"], {}),
    # every default layer of HunyuanVideo attends with the text-padding mask: all keep SDPA, with their mask
    ("hunyuan_video", [], {"transformer_blocks.0.attn": [KEY_PADDING],
                           "single_transformer_blocks.0.attn": [KEY_PADDING]}),
])
@torch.no_grad()
def test_attention_function_reaches_the_default_layers_bit_for_bit_and_restores(name, on_function, kept):
    """The function computes the unmasked calls of the default layers (self + joint), masked calls keep SDPA with
    their mask and say why; with SDPA as the function the output is the model's, bit for bit; the processor
    objects are back on exit, also after an exception in the block."""
    from fp4vis.patching.attention_function import attention_function_applied

    model, inputs = _build(name)
    ref = model(**inputs)[0]
    before = _processors(model)
    fn = _RecordingSDPA()
    with attention_function_applied(model, fn) as applied:
        assert applied.layers == [n for n, g in GROUPS[name].items() if g in ("self", "joint")]
        out = model(**inputs)[0]
    assert torch.equal(out, ref)
    summary = applied.summary()
    assert summary["layers_on_function"] == on_function and summary["layers_kept"] == kept
    assert summary["calls_on_function"] == len(on_function) == len(fn.shapes)
    assert summary["calls_kept"] == ({KEY_PADDING: len(kept)} if kept else {})
    assert all(len(s) == 4 and s[:2] == (B, 2) for s in fn.shapes)   # (B, H, S, D)
    assert _processors(model) == before

    def boom(q, k, v, scale=None):
        raise RuntimeError("boom")

    with pytest.raises(RuntimeError, match="boom"), attention_function_applied(model, boom, select="*single*"):
        if name == "hunyuan_video":   # its masked calls never reach the function
            raise RuntimeError("boom")
        model(**inputs)
    assert all(m.processor is before[n] for n, m in model.named_modules() if hasattr(m, "processor"))


class _MaskedSDPA(_RecordingSDPA):
    """A function that takes key-padding masks (``takes_key_mask``): SDPA with the mask broadcast back."""

    takes_key_mask = True

    def __call__(self, q, k, v, scale=None, key_mask=None):
        self.shapes.append(tuple(q.shape))
        mask = None if key_mask is None else key_mask[:, None, None, :]
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale)


@torch.no_grad()
def test_attention_function_that_takes_key_masks_gets_the_masked_calls():
    """HunyuanVideo's text-padding calls go to a function that says it takes key masks, as the (B, Skv) mask; with
    masked SDPA as the function the output is the model's, bit for bit; the baselines' flash-attn-4 says so."""
    from fp4vis.evals.baselines import _one_graph_node
    from fp4vis.patching.attention_function import attention_function_applied

    model, inputs = _build("hunyuan_video")
    ref = model(**inputs)[0]
    fn = _MaskedSDPA()
    with attention_function_applied(model, fn) as applied:
        out = model(**inputs)[0]
    assert torch.equal(out, ref)
    summary = applied.summary()
    assert summary["layers_on_function"] == ["transformer_blocks.0.attn", "single_transformer_blocks.0.attn"]
    assert summary["layers_kept"] == {} and summary["calls_on_function"] == 2 == len(fn.shapes)
    # a baseline function built to take masks says so, in either layout, and one that takes none refuses a mask
    seen = []
    masked = _one_graph_node("test_masked", "bhsd", lambda q, k, v, s, m: seen.append(m) or q, takes_key_mask=True)
    q = torch.randn(1, 2, 3, 16)
    assert masked.takes_key_mask and masked(q, q, q, None, torch.ones(1, 3, dtype=torch.bool)) is q and len(seen) == 1
    plain = _one_graph_node("test_plain", "bhsd", lambda q, k, v, s: q)
    assert not plain.takes_key_mask
    with pytest.raises(ValueError, match="key_mask: the test_plain baseline takes no mask"):
        plain(q, q, q, None, torch.ones(1, 3, dtype=torch.bool))


@torch.no_grad()
def test_attention_function_selection_refusals_and_other_mask_forms():
    """A name pattern selects other layers (the token refiner, whose per-query mask keeps SDPA naming its form); a
    pattern matching nothing, a patched layer and a function that is no callable are refused."""
    from fp4vis.patching.attention_function import attention_function_applied

    model, inputs = _build("hunyuan_video")
    with attention_function_applied(model, _RecordingSDPA(), select="*refiner*") as applied:
        model(**inputs)
    (reasons,) = applied.summary()["layers_kept"].values()
    assert applied.layers == ["context_embedder.token_refiner.refiner_blocks.0.attn"]
    assert len(reasons) == 1 and "varies per head and per query" in reasons[0]
    with pytest.raises(ValueError, match="no attention layer .* matches '\\*attn9'"), \
            attention_function_applied(model, _RecordingSDPA(), select="*attn9"):
        pass
    with pytest.raises(ValueError, match="mapping of layouts"), attention_function_applied(model, {"bsd": F.relu}):
        pass
    with fp4vis.patch(model, "fast"), pytest.raises(RuntimeError, match="already has an fp4vis processor"), \
            attention_function_applied(model, _RecordingSDPA()):
        pass
    assert not any(type(m.processor).__name__.startswith(("FP4", "Function"))
                   for m in model.modules() if hasattr(m, "processor"))


@torch.no_grad()
def test_attention_function_in_wan_layers_takes_the_bshd_function_or_transposes():
    """Wan's attn1 through the Wan processor: a bshd function as it is, a bhsd one transposed; SDPA as either is
    the model's output bit for bit, one counted call per block."""
    from diffusers import WanTransformer3DModel

    from fp4vis.patching.attention_function import attention_function_applied

    torch.manual_seed(0)
    model = WanTransformer3DModel(patch_size=(1, 2, 2), num_attention_heads=2, attention_head_dim=16, in_channels=4,
                                  out_channels=4, text_dim=32, freq_dim=32, ffn_dim=32, num_layers=2).eval()
    inputs = dict(hidden_states=_randn(1, 4, 2, 4, 4), timestep=torch.tensor([1.0]),
                  encoder_hidden_states=_randn(1, TEXT, 32, seed=1), return_dict=False)
    ref = model(**inputs)[0]
    bhsd = _RecordingSDPA()

    def bshd(q, k, v, scale=None):
        return bhsd(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), scale).transpose(1, 2)

    for fn, shape in ((bhsd, (1, 2, 8, 16)), ({"bshd": bshd}, (1, 2, 8, 16))):
        bhsd.shapes.clear()
        with attention_function_applied(model, fn) as applied:
            assert torch.equal(model(**inputs)[0], ref)
        assert applied.layers == ["blocks.0.attn1", "blocks.1.attn1"] and bhsd.shapes == [shape] * 2
        assert applied.summary()["calls_on_function"] == 2


@torch.no_grad()
def test_attention_function_compiles_with_fullgraph_without_a_graph_per_layer():
    """Under diffusers' regional compilation (fullgraph) the blocks of a stack share one graph (no recompile for
    the second block: nothing per layer is read in the graph) and the output is the eager one; the calls are
    counted while Dynamo traces, not per layer."""
    from fp4vis.patching.attention_function import attention_function_applied

    model, inputs = _build("qwen_image")
    inputs = dict(inputs, encoder_hidden_states_mask=None)   # unmasked: its two joint layers call the function

    def sdpa(q, k, v, scale=None):
        return F.scaled_dot_product_attention(q, k, v, scale=scale)

    ref = model(**inputs)[0]
    torch._dynamo.reset()
    try:
        with attention_function_applied(model, sdpa) as applied:
            model.compile_repeated_blocks(fullgraph=True, backend="aot_eager")
            with torch._dynamo.config.patch(error_on_recompile=True):
                out = model(**inputs)[0]
                again = model(**inputs)[0]
    finally:
        torch._dynamo.reset()
    assert torch.equal(out, ref) and torch.equal(again, ref)
    summary = applied.summary()
    assert summary["calls_on_function"] == 0   # no eager call: both layers ran in the one compiled block graph
    assert summary["traced"] == {"calls_on_function": 1, "calls_kept": {}}
