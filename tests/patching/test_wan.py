"""fp4vis.patch on diffusers Wan2.1 (tiny random transformer through save/from_pretrained)."""

from __future__ import annotations

import pytest
import torch

diffusers = pytest.importorskip("diffusers")
from diffusers import (  # noqa: E402
    AutoencoderKLWan,
    UniPCMultistepScheduler,
    WanPipeline,
    WanTransformer3DModel,
)
from diffusers.models.transformers import transformer_wan  # noqa: E402

import fp4vis  # noqa: E402
from fp4vis.patching.wan import (  # noqa: E402
    FP4WanAttnProcessor,
    StepPolicyCallback,
    WanFunctionAttnProcessor,
    attention_function_applied,
    exact_steps,
)

TINY = dict(patch_size=(1, 2, 2), num_attention_heads=2, attention_head_dim=16, in_channels=16, out_channels=16,
            text_dim=32, freq_dim=32, ffn_dim=32, num_layers=3, cross_attn_norm=True,
            qk_norm="rms_norm_across_heads", rope_max_seq_len=32)


@pytest.fixture(scope="module")
def t2v_dir(tmp_path_factory):
    torch.manual_seed(0)
    d = tmp_path_factory.mktemp("wan_t2v")
    WanTransformer3DModel(**TINY).save_pretrained(d)
    return d


@pytest.fixture()
def transformer(t2v_dir):
    return WanTransformer3DModel.from_pretrained(t2v_dir).eval()


def _inputs(seed=0, text=8):
    g = torch.Generator().manual_seed(seed)
    return dict(hidden_states=torch.randn(1, 16, 2, 8, 8, generator=g), timestep=torch.tensor([500]),
                encoder_hidden_states=torch.randn(1, text, 32, generator=g), return_dict=False)


def _attn_names(model, which):
    return [f"blocks.{i}.{which}" for i in range(len(model.blocks))]


def _all_attn(model):
    return _attn_names(model, "attn1") + _attn_names(model, "attn2")


@torch.no_grad()
def test_attn1_output_equals_fp4vis_attention_then_bit_identical(transformer, monkeypatch):
    inp = _inputs()
    ref = transformer(**inp)[0]
    originals = {n: transformer.get_submodule(n).processor for n in _attn_names(transformer, "attn1")}
    seen, hooks = {}, []
    for name in originals:
        mod = transformer.get_submodule(name)
        hooks.append(mod.register_forward_pre_hook(lambda m, a, n=name: seen.setdefault(n, {}).update(args=a)))
        hooks.append(mod.register_forward_hook(lambda m, a, o, n=name: seen[n].update(out=o)))
    h = fp4vis.patch(transformer, "wan_fast")
    assert h.policies == {**dict.fromkeys(_attn_names(transformer, "attn1"), "wan_fast"),
                          **dict.fromkeys(_attn_names(transformer, "attn2"))}
    out = transformer(**inp)[0]
    for hk in hooks:
        hk.remove()
    assert not torch.equal(out, ref)
    for name in originals:
        assert isinstance(transformer.get_submodule(name).processor, FP4WanAttnProcessor)
        assert transformer.get_submodule(name.replace("attn1", "attn2")).processor.__class__.__name__ == \
            "WanAttnProcessor"

    # q, k, v of each layer as diffusers' own processor computes them
    captured = {}

    def capture(query, key, value, **kw):
        captured["qkv"] = (query, key, value)
        return torch.zeros_like(query)

    monkeypatch.setattr(transformer_wan, "dispatch_attention_fn", capture)
    for name, rec in seen.items():
        attn = transformer.get_submodule(name)
        originals[name](attn, *rec["args"])
        q, k, v = captured["qkv"]
        o = fp4vis.attention(q, k, v, policy="wan_fast", layout="bshd", backend="reference")
        expected = attn.to_out[0](o.flatten(2, 3).type_as(q))
        torch.testing.assert_close(rec["out"], expected, rtol=0, atol=0)
    monkeypatch.undo()

    h.remove()
    for name, proc in originals.items():
        assert transformer.get_submodule(name).processor is proc
    assert torch.equal(transformer(**inp)[0], ref)


@torch.no_grad()
def test_cross_attention_and_per_layer_maps(transformer):
    self_names, cross_names = _attn_names(transformer, "attn1"), _attn_names(transformer, "attn2")
    with fp4vis.patch(transformer, "wan_fast", cross_attention=True) as h:
        assert set(h.policies.values()) == {"wan_fast"}
        transformer(**_inputs())
        assert all(st.calls == 1 for st in h.states)
    with fp4vis.patch(transformer, "wan_fast", layers={1: "accurate", "blocks.2.attn1": None,
                                                       "*.0.attn2": "fast"}) as h:
        assert h.policies == {self_names[0]: "wan_fast", self_names[1]: "accurate", self_names[2]: None,
                              cross_names[0]: "fast", cross_names[1]: None, cross_names[2]: None}
        transformer(**_inputs())
        assert {st.name: st.calls for st in h.states} == {self_names[0]: 1, self_names[1]: 1, cross_names[0]: 1}
        assert transformer.blocks[2].attn1.processor.__class__.__name__ == "WanAttnProcessor"


def _i2v(tmp_path):
    """A tiny I2V transformer (its attn2 has the image branch) and its inputs."""
    torch.manual_seed(0)
    WanTransformer3DModel(**dict(TINY, in_channels=36, image_dim=16, added_kv_proj_dim=32)).save_pretrained(tmp_path)
    model = WanTransformer3DModel.from_pretrained(tmp_path).eval()
    assert model.blocks[0].attn2.add_k_proj is not None
    g = torch.Generator().manual_seed(3)
    inp = dict(hidden_states=torch.randn(1, 36, 2, 8, 8, generator=g), timestep=torch.tensor([500]),
               encoder_hidden_states=torch.randn(1, 512, 32, generator=g),
               encoder_hidden_states_image=torch.randn(1, 4, 16, generator=g), return_dict=False)
    return model, inp


@torch.no_grad()
def test_i2v_transformer_with_image_branch(tmp_path):
    model, inp = _i2v(tmp_path)
    ref = model(**inp)[0]
    with fp4vis.patch(model, "wan_fast", cross_attention=True) as h:
        out = model(**inp)[0]
        # attn2 runs two attentions (image and text context) per call
        assert {st.name: st.calls for st in h.states} == {
            **{f"blocks.{i}.attn1": 1 for i in range(3)}, **{f"blocks.{i}.attn2": 2 for i in range(3)}}
    assert torch.isfinite(out).all() and fp4vis.cosine(out, ref) > 0.9
    assert torch.equal(model(**inp)[0], ref)


def _sdpa_bshd(q, k, v):
    """torch SDPA on (B, S, H, D) tensors, as diffusers' native attention backend calls it."""
    out = torch.nn.functional.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2))
    return out.transpose(1, 2)


@torch.no_grad()
def test_function_processor_is_diffusers_math_bit_for_bit_and_restores(transformer):
    """attn1 computed by an attention function through WanFunctionAttnProcessor: with torch SDPA the
    model's output is bit-identical to diffusers' own processor (float32, CPU); the processor objects
    are back on exit, also after an exception in the block."""
    inp = _inputs()
    ref = transformer(**inp)[0]
    originals = {n: transformer.get_submodule(n).processor for n in _all_attn(transformer)}
    shapes = []

    def fn(q, k, v):
        shapes.append(tuple(q.shape))
        return _sdpa_bshd(q, k, v)

    with attention_function_applied(transformer, fn) as layers:
        assert layers == [transformer.get_submodule(n) for n in _attn_names(transformer, "attn1")]
        assert all(isinstance(m.processor, WanFunctionAttnProcessor) for m in layers)
        assert all(transformer.get_submodule(n).processor is originals[n] for n in _attn_names(transformer, "attn2"))
        out = transformer(**inp)[0]
    assert shapes == [(1, 32, 2, 16)] * 3   # (B, S, H, D): 2 frames x 4 x 4 patches, one call per block
    torch.testing.assert_close(out, ref, rtol=0, atol=0)
    assert {n: transformer.get_submodule(n).processor for n in originals} == originals

    def boom(q, k, v):
        raise RuntimeError("boom")

    with pytest.raises(RuntimeError, match="boom"), attention_function_applied(transformer, boom):
        transformer(**inp)
    assert all(transformer.get_submodule(n).processor is p for n, p in originals.items())
    with pytest.raises(ValueError, match="no WanAttention layer"), attention_function_applied(transformer, fn,
                                                                                              select="attn9"):
        pass
    with fp4vis.patch(transformer, "wan_fast"), pytest.raises(RuntimeError, match="fp4vis processor"), \
            attention_function_applied(transformer, fn):
        pass


@torch.no_grad()
def test_function_processor_runs_the_i2v_image_branch_as_diffusers(tmp_path):
    model, inp = _i2v(tmp_path)
    ref = model(**inp)[0]
    calls = []
    with attention_function_applied(model, lambda q, k, v: calls.append(k.shape[1]) or _sdpa_bshd(q, k, v),
                                    select="attn2"):
        out = model(**inp)[0]
    assert calls == [4, 512] * 3   # per block: the image context, then the text context
    torch.testing.assert_close(out, ref, rtol=0, atol=0)


def _pipe(t2v_dir):
    torch.manual_seed(0)
    vae = AutoencoderKLWan(base_dim=3, z_dim=16, dim_mult=[1, 1, 1, 1], num_res_blocks=1,
                           temperal_downsample=[False, True, True]).eval()
    sched = UniPCMultistepScheduler(prediction_type="flow_prediction", use_flow_sigmas=True, flow_shift=3.0)
    transformer = WanTransformer3DModel.from_pretrained(t2v_dir).eval()
    return WanPipeline(tokenizer=None, text_encoder=None, vae=vae, transformer=transformer, scheduler=sched)


def _call(pipe, **kw):
    g = torch.Generator().manual_seed(0)
    pe = torch.randn(1, 8, 32, generator=g)
    ne = torch.randn(1, 8, 32, generator=g)
    return pipe(prompt_embeds=pe, negative_prompt_embeds=ne, height=16, width=16, num_frames=5,
                num_inference_steps=3, guidance_scale=2.0, output_type="pt", generator=g, **kw).frames


def test_wan_pipeline_end_to_end_fast_accurate_and_step_override(t2v_dir):
    pipe = _pipe(t2v_dir)
    pipe.set_progress_bar_config(disable=True)
    ref = _call(pipe)
    for policy in ("wan_fast", "accurate"):
        with fp4vis.patch(pipe, policy) as h:
            assert all(p == policy for n, p in h.policies.items() if n.endswith("attn1"))
            assert all(n.startswith("transformer.") for n in h.policies)
            out = _call(pipe)
            assert all(st.calls == 6 for st in h.states)  # 3 steps x (cond + uncond)
        assert out.shape == ref.shape and torch.isfinite(out).all()
        assert not torch.equal(out, ref)
    assert torch.equal(_call(pipe), ref)

    # exact attention on the first and last denoising steps: only step 1 runs FP4
    with fp4vis.patch(pipe, "wan_fast") as h:
        cb = exact_steps(h, steps=(0, -1))
        assert isinstance(cb, StepPolicyCallback)
        _call(pipe, callback_on_step_end=cb)
        assert all(st.calls == 2 for st in h.states)
        assert cb.history == [(0, "exact"), (1, "layers"), (2, "exact"), (0, "exact")]
        # a schedule of policies, composed with another callback through MultiPipelineCallbacks
        from diffusers.callbacks import MultiPipelineCallbacks
        sched = StepPolicyCallback(h, {1: "accurate"})
        used = []
        for st in h.states:
            orig = st.attention
            st.attention = lambda layer_call, _o=orig: (used.append(layer_call.policy.name), _o(layer_call))[1]
        _call(pipe, callback_on_step_end=MultiPipelineCallbacks([sched]))
        assert used == ["wan_fast"] * 6 + ["accurate"] * 6 + ["wan_fast"] * 6
    assert torch.equal(_call(pipe), ref)


def test_pipeline_calibration_plan_applies_to_pipeline_or_transformer(t2v_dir, tmp_path):
    pipe = _pipe(t2v_dir)
    pipe.set_progress_bar_config(disable=True)
    g = torch.Generator().manual_seed(0)
    call = dict(prompt_embeds=torch.randn(1, 8, 32, generator=g), height=16, width=16, num_frames=5,
                num_inference_steps=2, guidance_scale=1.0, output_type="latent")
    plan = fp4vis.calibrate(pipe, [call], policy="wan_fast")
    names = [f"transformer.blocks.{i}.attn1" for i in range(3)]
    assert list(plan.stats) == names and plan.guarded == []  # a random tiny Wan needs no guard
    assert all(st.calls == 2 for st in plan.stats.values())  # 2 steps, no CFG
    everything = plan.redecide(threshold=-1e9)  # a rule that guards every layer
    everything.save(tmp_path / "plan.json")
    with fp4vis.patch(pipe.transformer, "wan_fast", guard=tmp_path / "plan.json") as h:  # names without prefix
        assert {n: p for n, p in h.policies.items() if n.endswith("attn1")} == {
            f"blocks.{i}.attn1": "guard" for i in range(3)}
    with fp4vis.patch(pipe, "wan_fast", guard=everything, layers={2: None}) as h:
        assert h.policies["transformer.blocks.0.attn1"] == "guard"
        assert h.policies["transformer.blocks.2.attn1"] is None


def test_wan_i2v_pipeline_end_to_end(tmp_path):
    from diffusers import WanImageToVideoPipeline
    from transformers import CLIPImageProcessor, CLIPVisionConfig, CLIPVisionModelWithProjection

    torch.manual_seed(0)
    WanTransformer3DModel(**dict(TINY, in_channels=36, image_dim=16, added_kv_proj_dim=32)).save_pretrained(tmp_path)
    transformer = WanTransformer3DModel.from_pretrained(tmp_path).eval()
    clip = CLIPVisionModelWithProjection(CLIPVisionConfig(hidden_size=16, projection_dim=16, num_hidden_layers=2,
                                                          num_attention_heads=2, image_size=32, intermediate_size=32,
                                                          patch_size=8)).eval()
    vae = AutoencoderKLWan(base_dim=3, z_dim=16, dim_mult=[1, 1, 1, 1], num_res_blocks=1,
                           temperal_downsample=[False, True, True]).eval()
    sched = UniPCMultistepScheduler(prediction_type="flow_prediction", use_flow_sigmas=True, flow_shift=3.0)
    pipe = WanImageToVideoPipeline(tokenizer=None, text_encoder=None, vae=vae, transformer=transformer,
                                   scheduler=sched, image_encoder=clip,
                                   image_processor=CLIPImageProcessor(crop_size=32, size=32))
    pipe.set_progress_bar_config(disable=True)
    g = torch.Generator().manual_seed(0)
    image = torch.rand(1, 3, 16, 16, generator=g)
    pe = torch.randn(1, 512, 32, generator=g)

    def run():
        return pipe(image=image, prompt_embeds=pe, height=16, width=16, num_frames=5, num_inference_steps=2,
                    guidance_scale=1.0, output_type="pt", generator=torch.Generator().manual_seed(0)).frames

    ref = run()
    with fp4vis.patch(pipe, "wan_fast", cross_attention=True) as h:
        out = run()
        assert all(st.calls == (2 if st.group == "self" else 4) for st in h.states)
        assert len(h.states) == 6  # the CLIP image encoder is not a denoiser: not patched
    assert torch.isfinite(out).all() and not torch.equal(out, ref)
    assert torch.equal(run(), ref)


@pytest.mark.gpu(capability=(9, 0))
@torch.no_grad()
def test_fused_qk_transform_gives_the_unpatched_values_on_gpu():
    """On the H200 the patched layer hands the Hopper backend the raw projections and its q/k
    transform: the rstd equals torch's own CUDA rms_norm's (its sum order), the fused pre-pass's
    operands (NVFP4 both layouts, FP8) equal today's pre-pass fed with diffusers' norm_q/norm_k and
    rotary output, and the patched self- and cross-attention layers' outputs equal today's path
    (diffusers' q, k, v, then fp4vis.attention, then to_out) bit for bit."""
    from diffusers.models.transformers.transformer_wan import WanAttention, WanAttnProcessor

    from fp4vis.kernels.hopper import prepass_launch as tp
    from fp4vis.patching.layer import LayerSpec, LayerState
    from fp4vis.policy import get_policy
    from fp4vis.qk_transform import QKTransform, apply_rotary_emb

    torch.manual_seed(0)
    h, d, s, dev = 12, 128, 1500, "cuda"
    ang = torch.rand(1, s, 1, d // 2, device=dev).repeat_interleave(2, -1) * 50
    rope = (ang.cos(), ang.sin())
    x = torch.randn(1, s, h * d, device=dev).bfloat16()
    ctx = torch.randn(1, 77, h * d, device=dev).bfloat16()
    bits = lambda t: t.view({1: torch.uint8, 2: torch.int16, 4: torch.int32}[t.element_size()])  # noqa: E731
    for kind in ("self", "cross"):
        attn = WanAttention(dim=h * d, heads=h, dim_head=d, eps=1e-6,
                            cross_attention_dim_head=d if kind == "cross" else None).to(dev, torch.bfloat16)
        for p in attn.parameters():
            if p.dim() == 1:
                p.normal_(1.0, 0.1)
            else:
                p.normal_(0.0, 0.02)
        r, c = (rope, None) if kind == "self" else (None, ctx)
        qp, kp, vp = attn.to_q(x), attn.to_k(x if c is None else c), attn.to_v(x if c is None else c)
        q, k, v = (t.unflatten(2, (h, -1)) for t in (attn.norm_q(qp), attn.norm_k(kp), vp))
        if r is not None:
            q, k = apply_rotary_emb(q, *r), apply_rotary_emb(k, *r)
        if kind == "self":
            rq, rk = tp.rms_rstd(qp.unflatten(2, (h, -1)).transpose(1, 2), kp.unflatten(2, (h, -1)).transpose(1, 2),
                                 1e-6, 1e-6)
            assert torch.equal(bits(rq), bits(torch.ops.aten._fused_rms_norm(qp, [h * d], attn.norm_q.weight,
                                                                             1e-6)[1].view(-1)))
            tr = QKTransform.from_norms(attn.norm_q, attn.norm_k, r)
            raw = tuple(t.unflatten(2, (h, -1)).transpose(1, 2) for t in (qp, kp, vp))
            plain = tuple(t.transpose(1, 2).contiguous() for t in (q, k, v))
            for layout in ("folded64_mse", "block16", "fp8"):
                fused = tp.fp8_prepass(*raw, qk=tr) if layout == "fp8" else tp.prepass(*raw, layout, qk=tr)
                ref = tp.fp8_prepass(*plain) if layout == "fp8" else tp.prepass(*plain, layout)
                assert all(torch.equal(bits(a), bits(b)) for a, b in zip(fused, ref)), layout
        for policy in ("fast", "fast_fp8qk", "fp8", "fp8pv"):
            spec = LayerSpec(name=kind, module=attn, index=0, group=kind, default=True, patcher="wan", num_heads=h,
                             head_dim=d)
            st = LayerState(spec, get_policy(policy), backend="hopper", range_check="raise", strict=True, handle=None)
            got = FP4WanAttnProcessor(st, WanAttnProcessor())(attn, x, c, None, r)
            o = fp4vis.attention(q, k, v, policy=policy, layout="bshd", backend="hopper")
            assert torch.equal(bits(got), bits(attn.to_out[0](o.flatten(2, 3)))), (kind, policy)
    fp4vis.check_range()


@torch.no_grad()
def test_patched_transformer_compiles_with_fullgraph(transformer):
    """The Wan processor with its q/k transform, patched, traced with fullgraph=True as diffusers users
    compile (``transformer.compile``; the reference is one op) and run through AOTAutograd (aot_eager: the
    same ops, so the same bits)."""
    with fp4vis.patch(transformer, "wan_fast", cross_attention=True):
        eager = transformer(**_inputs())[0]
        torch._dynamo.reset()
        transformer.compile(fullgraph=True, backend="aot_eager")
        out = transformer(**_inputs())[0]
    torch._dynamo.reset()
    assert torch.equal(out, eager)


@torch.no_grad()
def test_patched_blocks_share_one_graph_under_regional_compilation(transformer):
    """diffusers' regional compilation (``compile_repeated_blocks``) compiles the block once for every block:
    a patched layer keeps nothing of its own in the graph (no name, no count), so no block recompiles."""
    with fp4vis.patch(transformer, "wan_fast", cross_attention=True):
        eager = transformer(**_inputs())[0]
        torch._dynamo.reset()
        transformer.compile_repeated_blocks(fullgraph=True, backend="aot_eager")
        with torch._dynamo.config.patch(error_on_recompile=True):
            out = transformer(**_inputs())[0]
            again = transformer(**_inputs(seed=1))[0]
    torch._dynamo.reset()
    assert torch.equal(out, eager) and again.shape == out.shape
