"""Wan2.1 pipeline (pipelines/wan_video.py, wan_sizes.py, wan_generate.py) on a tiny pipeline saved with
save_pretrained and loaded back through load_wan_pipeline: seeded generation, FP4 vs BF16, MP4 + sidecar, errors."""

import json

import numpy as np
import pytest
import torch
from apps.tiny_models import make_image_folder, make_tiny_wan, make_tiny_wan_i2v

from fp4vis.metrics import cosine
from fp4vis.pipelines import wan_generate as wg
from fp4vis.pipelines import wan_sizes as ws
from fp4vis.pipelines import wan_video as wv
from fp4vis.services.usage import UsageError

KW = dict(height=32, width=32, frames=5, steps=2, progress=False)


@pytest.fixture(scope="module")
def tiny(tiny_wan):
    path = tiny_wan
    return path, wv.load_wan_pipeline(str(path), device="cpu")


def test_load_local_pipeline(tiny):
    path, pipe = tiny
    assert type(pipe).__name__ == "WanPipeline" and pipe.text_encoder is not None
    assert pipe.transformer.dtype == torch.bfloat16 and pipe.vae.dtype == torch.float32
    assert ws.latent_shape(pipe, height=32, width=32, frames=5) == (1, 16, 2, 4, 4)


def test_seeded_generation_and_fp4_close_to_bf16(tiny):
    _, pipe = tiny
    a = wv.generate(pipe, prompt="a red fox in the snow", policy="bf16", seed=3, **KW)
    assert pipe._progress_bar_config["desc"] == "denoise (bf16, the model's attention)"   # labelled by what runs
    b = wv.generate(pipe, prompt="a red fox in the snow", policy="bf16", seed=3, **KW)
    assert torch.equal(a.latents, b.latents)
    assert a.frames.shape == (5, 32, 32, 3) and 0 <= a.frames.min() and a.frames.max() <= 1
    assert set(a.timings) == {"text_encode_s", "denoise_s", "decode_s", "total_s"}
    assert a.timings["total_s"] == pytest.approx(sum(a.timings[k] for k in ("text_encode_s", "denoise_s",
                                                                            "decode_s")))
    c = wv.generate(pipe, prompt="a red fox in the snow", policy="wan_fast", seed=3, backend="reference", **KW)
    assert not torch.equal(c.latents, a.latents) and cosine(c.latents, a.latents) > 0.99
    assert pipe._progress_bar_config["desc"] == "denoise (wan_fast, reference)"
    d = wv.generate(pipe, prompt="a red fox in the snow", policy="bf16", seed=4, **KW)
    assert not torch.equal(d.latents, a.latents)
    # exact attention on every step (per-step callback) reproduces the BF16 run
    f = wv.generate(pipe, prompt="a red fox in the snow", policy="wan_fast", seed=3, exact_steps=(0, 1), **KW)
    assert torch.equal(f.latents, a.latents) and f.info["exact_steps"] == [0, 1]
    # the patch is removed after the call: bf16 again gives the bf16 result
    e = wv.generate(pipe, prompt="a red fox in the snow", policy="bf16", seed=3, **KW)
    assert torch.equal(e.latents, a.latents)


def test_prompt_embeds_without_text_encoder(tiny, tmp_path):
    path = make_tiny_wan(tmp_path / "no_te", text_encoder=False)
    pipe = wv.load_wan_pipeline(str(path), device="cpu")
    assert pipe.text_encoder is None
    pe, npe = wv.random_prompt_embeds(0, length=16, dim=32)
    r = wv.generate(pipe, prompt_embeds=pe, negative_prompt_embeds=npe, policy="fast", decode=False, **KW)
    assert r.frames is None and r.latents.shape == (1, 16, 2, 4, 4)
    with pytest.raises(UsageError, match="no text encoder"):
        wv.generate(pipe, prompt="a cat", policy="bf16", **KW)


def test_run_generate_writes_mp4_and_sidecar(tiny, tmp_path):
    path, _ = tiny
    out = wg.run_generate(wg.GenerateOptions(str(path), "a dog on the beach", output=tmp_path / "v.mp4", policy="fast",
                                            seed=1, height=32, width=32, frames=5, steps=1, fps=8, device="cpu",
                                            progress=False))
    frames = _read_mp4(out["video"])
    assert frames.shape == (5, 32, 32, 3)
    side = json.loads(out["sidecar"].read_text())
    for key in ("model", "prompt", "seed", "frames", "steps", "policy", "guard_plan", "timings", "environment"):
        assert key in side
    assert side["policy"] == "fast" and side["frames"] == 5 and side["steps"] == 1
    assert side["environment"]["versions"]["diffusers"] and "gpu" in side["environment"]
    assert side["timings"]["denoise_s"] > 0 and side["tokens"] == 8


def test_run_generate_resolves_once(tiny, tmp_path, monkeypatch):
    """A run resolves the policy name once and reads model_index.json once (the CLI's reading handed down, or
    run_generate's own); the layers below take the Policy and the index rather than resolve or read again."""
    import fp4vis.policy
    from fp4vis.pipelines import model_files, wan_sizes, wan_video

    resolved, reads = [], []

    class CountingPolicies(dict):
        def __getitem__(self, name):
            resolved.append(name)
            return super().__getitem__(name)

    monkeypatch.setattr(fp4vis.policy, "POLICIES", CountingPolicies(fp4vis.policy.POLICIES))
    real_index = model_files.model_index

    def counted_index(src):
        reads.append(src)
        return real_index(src)

    for module in (wg, wan_sizes, wan_video):
        monkeypatch.setattr(module, "model_index", counted_index)
    path, _ = tiny
    wg.run_generate(wg.GenerateOptions(str(path), "a dog", output=tmp_path / "v.mp4", policy="fast", height=32,
                                       width=32, frames=5, steps=1, exact_steps=(0,), device="cpu", backend="reference",
                                       progress=False))
    assert resolved == ["fast"] and len(reads) == 1


def _read_mp4(path):
    import imageio.v2 as imageio

    with imageio.get_reader(str(path), format="FFMPEG") as r:
        return np.stack(list(r.iter_data()))


def test_errors(tiny, tmp_path):
    path, pipe = tiny
    with pytest.raises(UsageError, match="does not exist"):
        wv.load_wan_pipeline(str(tmp_path / "missing_model"), device="cpu")
    (tmp_path / "empty").mkdir()
    with pytest.raises(UsageError, match="model_index.json"):
        wv.load_wan_pipeline(str(tmp_path / "empty"), device="cpu")
    with pytest.raises(UsageError, match="4k \\+ 1"):
        wv.generate(pipe, prompt="a cat", policy="bf16", height=32, width=32, frames=4, steps=1, progress=False)
    with pytest.raises(ValueError, match="unknown policy"):
        wv.generate(pipe, prompt="a cat", policy="fastest", **KW)
    with pytest.raises(UsageError, match="CUDA GPU"):
        wv.generate(pipe, prompt="a cat", policy="fast", backend="hopper", **KW)
    with pytest.raises(UsageError, match="image: file"):
        wg.run_generate(wg.GenerateOptions(str(path), "x", image=str(tmp_path / "nope.png"), device="cpu"))


def test_random_architecture_builder():
    cfg = dict(ws.WAN_TRANSFORMER_CONFIGS["1.3B"], num_layers=1, num_attention_heads=2, ffn_dim=32, text_dim=64)
    pipe = wv.build_random_wan_pipeline("1.3B", device="cpu", transformer_config=cfg, vae=False)
    assert pipe.transformer.config.attention_head_dim == 128 and pipe.text_encoder is None
    assert pipe.transformer.scale_shift_table.dtype == torch.float32  # kept in FP32 as from_pretrained does
    assert pipe.transformer.blocks[0].attn1.to_q.weight.dtype == torch.bfloat16
    with pytest.raises(UsageError, match="unknown Wan2.1 size"):
        wv.build_random_wan_pipeline("7B", device="cpu")
    assert ws.WAN_TRANSFORMER_CONFIGS["14B"]["num_attention_heads"] == 40


def test_image_to_video(tmp_path):
    path = make_tiny_wan_i2v(tmp_path / "i2v")
    img = make_image_folder(tmp_path / "img", classes=("a",), per_class=1, size=32) / "a" / "img0.png"
    out = wg.run_generate(wg.GenerateOptions(str(path), "a cat", image=str(img), output=tmp_path / "i2v.mp4",
                                            policy="fast", height=32, width=32, frames=5, steps=1, device="cpu",
                                            progress=False))
    side = json.loads(out["sidecar"].read_text())
    assert side["pipeline"] == "WanImageToVideoPipeline" and side["image"] == str(img)
    assert out["result"].frames.shape == (5, 32, 32, 3)
    with pytest.raises(UsageError, match="image-to-video model: pass --image"):
        wg.run_generate(wg.GenerateOptions(str(path), "a cat", output=tmp_path / "x.mp4", height=32, width=32, frames=5,
                                          steps=1, device="cpu", progress=False))


def test_gpu_sized_generation_on_the_cpu_warns_with_an_estimate(tiny_wan):
    """81 frames at 480x832 on a CPU: a warning with a measured estimate and the options that help;
    a CPU-sized request says nothing."""
    import warnings

    pipe = wv.load_wan_pipeline(str(tiny_wan), device="cpu", dtype="float32")
    with pytest.warns(UserWarning, match=r"32760 tokens per sequence; 50 steps would take at least .* --frames 9"):
        estimate = wg.warn_if_impractical_on_cpu(pipe, "fast", height=480, width=832, frames=81, steps=50,
                                                 guidance_scale=5.0)
    assert estimate > 0
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert wg.warn_if_impractical_on_cpu(pipe, "fast", height=32, width=32, frames=5, steps=2,
                                             guidance_scale=5.0) is None
