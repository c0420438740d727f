"""``fp4vis eval pipeline`` on the CPU with the reference backend: tiny random instances of the published
architectures (speed-only mode, registered here), a tiny saved Wan pipeline (fidelity mode, the generic
pipeline path), and the CLI's one-line option errors."""

import dataclasses
import json
import math

import pytest
import torch

from fp4vis.cli import main
from fp4vis.evals import published_configs as pc
from fp4vis.evals.pipeline_eval import PipelineEvalConfig, run_pipeline_eval
from fp4vis.services.usage import UsageError

# tiny stand-ins of the published architectures: the published entry with a few small config values
TINY = {
    "wan2.2-t2v-a14b": dict(config=dict(num_attention_heads=2, attention_head_dim=16, text_dim=32, ffn_dim=32,
                                        num_layers=1, rope_max_seq_len=32),
                            text_dim=32, text_tokens=16, height=32, width=32, frames=5),
    "hunyuanvideo": dict(config=dict(num_attention_heads=2, attention_head_dim=16, num_layers=1, num_single_layers=1,
                                     num_refiner_layers=1, text_embed_dim=32, pooled_projection_dim=8,
                                     rope_axes_dim=(4, 6, 6)),
                         text_dim=32, text_tokens=16, prompt_tokens=8, pooled_dim=8, height=32, width=32, frames=5),
    "flux.1-dev": dict(config=dict(num_layers=1, num_single_layers=1, attention_head_dim=16, num_attention_heads=2,
                                   joint_attention_dim=32, pooled_projection_dim=8, axes_dims_rope=(4, 6, 6)),
                       text_dim=32, text_tokens=16, pooled_dim=8, height=64, width=32),
    "qwen-image": dict(config=dict(num_layers=1, attention_head_dim=16, num_attention_heads=2, joint_attention_dim=32,
                                   axes_dims_rope=(4, 6, 6)),
                       text_dim=32, text_tokens=16, height=32, width=32),
    # the published sample_height/width kept: the rotary embeddings' base grid (30x45) as published
    "cogvideox-5b": dict(config=dict(num_attention_heads=2, attention_head_dim=16, num_layers=1, text_embed_dim=32,
                                     time_embed_dim=16, max_text_seq_length=16),
                         text_dim=32, text_tokens=16, height=32, width=48, frames=5),
}


def tiny_arch(name: str) -> pc.PublishedDenoiser:
    arch = pc.PUBLISHED_DENOISERS[name]
    over = dict(TINY[name])
    return dataclasses.replace(arch, config={**arch.config, **over.pop("config")}, **over)


@pytest.fixture
def tiny_archs(monkeypatch):
    for name in TINY:
        monkeypatch.setitem(pc.PUBLISHED_DENOISERS, f"tiny-{name}", tiny_arch(name))


def test_published_configs_name_their_source_and_give_the_published_sizes():
    archs = pc.PUBLISHED_DENOISERS
    assert {"wan2.2-t2v-a14b", "hunyuanvideo", "flux.1-dev", "qwen-image", "cogvideox-5b"} <= set(archs)
    assert all(a.source and a.class_name and a.family in pc.FAMILIES for a in archs.values())
    size = {n: dict(height=a.height, width=a.width, frames=a.frames) for n, a in archs.items()}
    assert size["hunyuanvideo"] == dict(height=720, width=1280, frames=129)
    assert size["wan2.2-t2v-a14b"] == dict(height=720, width=1280, frames=81)
    assert pc.tokens(archs["flux.1-dev"], **size["flux.1-dev"]) == 4096
    assert pc.tokens(archs["qwen-image"], **size["qwen-image"]) == 83 * 83
    assert pc.tokens(archs["hunyuanvideo"], **size["hunyuanvideo"]) == 33 * 45 * 80
    assert pc.tokens(archs["wan2.2-t2v-a14b"], **size["wan2.2-t2v-a14b"]) == 21 * 45 * 80
    cog = archs["cogvideox-5b"]
    assert size["cogvideox-5b"] == dict(height=480, width=720, frames=49)
    assert cog.source == "THUDM/CogVideoX-5b transformer/config.json"
    assert pc.latent_shape(cog, **size["cogvideox-5b"]) == (1, 13, 16, 60, 90)   # frames before channels
    assert pc.tokens(cog, **size["cogvideox-5b"]) == 13 * 30 * 45
    assert cog.text_tokens == 226 and cog.prompt_tokens is None and cog.guidance_batched and cog.calls_per_step == 1
    cos, sin = pc.generation_inputs(cog, **size["cogvideox-5b"], device=torch.device("cpu"))["image_rotary_emb"]
    assert cos.shape == sin.shape == (13 * 30 * 45, 64)
    assert pc.generation_inputs(archs["flux.1-dev"], **size["flux.1-dev"], device=torch.device("cpu")) == {}
    text = pc.random_text(tiny_arch("hunyuanvideo"), seed=0, device=torch.device("cpu"), dtype=torch.float32)
    assert text["mask"].tolist() == [[True] * 8 + [False] * 8]   # the padding mask of the pipeline's form
    assert text["embeds"][0, 8:].abs().sum() == 0


@pytest.mark.parametrize("name", list(TINY))
def test_speed_only_runs_each_architecture(tiny_archs, name, tmp_path):
    r = run_pipeline_eval(PipelineEvalConfig(speed_only=f"tiny-{name}", policies="fast", steps=2, backend="reference",
                                             device="cpu", warmup=False, progress=False, out_dir=tmp_path))
    assert r["mode"] == "speed_only" and r["random_weights"] and r["complete"] and not r["decode"]
    assert list(r["runs"]) == ["bf16", "fast"] and r["architecture"]["class"] == pc.PUBLISHED_DENOISERS[name].class_name
    fast = r["runs"]["fast"]
    assert fast["timings"]["steps_timed"] == 2 and fast["step_s"]["n"] == 2 and fast["step_s"]["ci95_low"] is not None
    assert fast["speedup_vs"]["bf16"] == pytest.approx(r["runs"]["bf16"]["timings"]["denoise_s"]
                                                       / fast["timings"]["denoise_s"])
    assert 0.9 < fast["latent_cosine"] < 1.0 and math.isfinite(fast["latent_rel_l2"])
    md = (tmp_path / "pipeline_speed.md").read_text()
    assert "Random weights (speed only)" in md and "no speedup is given" in md and "| fast |" in md
    assert pc.PUBLISHED_DENOISERS[name].source in md
    batched = "1 transformer call of batch 2 (classifier-free guidance: the negative's and the prompt's halves)"
    assert (f"{batched} per step" in md) == (name == "cogvideox-5b")


def test_cogvideox_guidance_is_one_call_of_batch_2(tiny_archs):
    """CogVideoX's classifier-free guidance as its pipeline makes it: one transformer call a step, of batch 2, the
    latents in its (B, F, C, H, W) layout; the step is the guided Euler step that the prompt's and the negative's
    calls of batch 1 give (the halves in the right order)."""
    from fp4vis.evals.pipeline_eval import SpeedOnlySubject

    cpu, size = torch.device("cpu"), dict(height=32, width=48)
    arch = pc.PUBLISHED_DENOISERS["tiny-cogvideox-5b"]
    subject = SpeedOnlySubject(arch, PipelineEvalConfig(speed_only="tiny-cogvideox-5b", steps=2, device="cpu",
                                                        dtype="float32", progress=False), cpu)
    subject.load()
    calls = []
    hook = subject.module.register_forward_pre_hook(lambda m, args, kw: calls.append(kw["hidden_states"].shape),
                                                    with_kwargs=True)
    out = subject.run(1, "test", decode=False)
    hook.remove()
    assert calls == [(2, 2, 16, 4, 6)]
    assert subject.fields()["architecture"]["calls_per_step"] == 1
    assert subject.fields()["architecture"]["batch_per_call"] == 2
    rotary = pc.generation_inputs(arch, **size, frames=5, device=cpu)
    prompt, negative = (subject.module(**pc.denoiser_inputs(arch, subject.latents, 1.0, text, **size), **rotary)[0]
                        for text in (pc.random_text(arch, seed=i, device=cpu, dtype=torch.float32) for i in (0, 1)))
    expected = subject.latents - (negative + arch.guidance * (prompt - negative))
    torch.testing.assert_close(out.latents, expected, rtol=1e-4, atol=1e-4)


def test_fidelity_mode_on_a_saved_pipeline(tiny_wan, tmp_path):
    r = run_pipeline_eval(PipelineEvalConfig(str(tiny_wan), policies="fast,accurate", steps=3, height=32, width=32,
                                             frames=5, backend="reference", device="cpu", dtype="float32",
                                             progress=False, out_dir=tmp_path))
    assert r["mode"] == "fidelity" and r["pipeline"] == "WanPipeline" and r["decode"] and r["complete"]
    assert list(r["runs"]) == ["bf16", "fast", "accurate"]
    for name in ("fast", "accurate"):
        run = r["runs"][name]
        assert run["timings"]["steps_timed"] == 2 and run["timings"]["warmup_s"] > 0
        assert 0.99 < run["latent_cosine"] < 1.0
        assert len(run["frames"]["psnr_per_frame"]) == 5 and run["frames"]["psnr_mean"] > 25
    saved = json.loads((tmp_path / "pipeline_fidelity.json").read_text())
    assert saved["runs"]["fast"]["frames"]["ssim_mean"] > 0.9


def test_argument_errors(tiny_archs):
    with pytest.raises(UsageError, match="either a model"):
        run_pipeline_eval(PipelineEvalConfig())
    with pytest.raises(UsageError, match="speed_only: unknown architecture 'nope'"):
        run_pipeline_eval(PipelineEvalConfig(speed_only="nope"))
    with pytest.raises(UsageError, match="height: .* multiples of 16"):
        run_pipeline_eval(PipelineEvalConfig(speed_only="tiny-flux.1-dev", height=40, device="cpu"))
    with pytest.raises(UsageError, match="frames: .* 4k\\+1 frames"):
        run_pipeline_eval(PipelineEvalConfig(speed_only="tiny-hunyuanvideo", frames=6, device="cpu"))
    with pytest.raises(UsageError, match="decode: speed-only"):
        run_pipeline_eval(PipelineEvalConfig(speed_only="tiny-qwen-image", decode=True))
    with pytest.raises(UsageError, match="compile: needs the warm-up"):
        run_pipeline_eval(PipelineEvalConfig(speed_only="tiny-qwen-image", compile="regional", warmup=False))


def test_cli_speed_only_end_to_end(tiny_archs, tmp_path, capsys):
    code = main(["eval", "pipeline", "--speed-only", "tiny-qwen-image", "--steps", "2", "--policies", "fast",
                 "--backend", "reference", "--device", "cpu", "--no-progress", "--out-dir", str(tmp_path)])
    out = capsys.readouterr().out
    assert code == 0 and "bf16: " in out and "fast: " in out and "latent cosine" in out
    assert "baseline skipped, fa4: " in out   # --baselines auto, the default: none runs on the CPU
    assert (tmp_path / "pipeline_speed.json").exists()


def test_speed_only_help_names_every_published_architecture(capsys):
    with pytest.raises(SystemExit) as e:
        main(["eval", "pipeline", "--help"])
    help_text = "".join(capsys.readouterr().out.split())   # the wrapping may break a name at a hyphen
    assert e.value.code == 0 and all(name in help_text for name in pc.PUBLISHED_DENOISERS)


@pytest.mark.parametrize("argv, expected", [
    (["--speed-only", "sdxl"], "fp4vis eval pipeline: error: argument --speed-only: unknown architecture 'sdxl'"),
    (["--speed-only", "flux.1-dev", "--steps", "0"], "fp4vis eval pipeline: error: argument --steps: expected a "
                                                      "positive"),
    (["--speed-only", "flux.1-dev", "--policies", "fast,nope"], "fp4vis eval pipeline: error: argument --policies: "
                                                                 "unknown policy 'nope'"),
    ([], "fp4vis eval pipeline: error: --model or --speed-only: one is required"),
    (["--speed-only", "hunyuanvideo", "--device", "cpu"], "fp4vis eval pipeline: error: speed-only hunyuanvideo on "
                                                          "the CPU: 129 frames at 720x1280 are 118800 tokens"),
    (["--speed-only", "flux.1-dev", "--frames", "5"], "fp4vis eval pipeline: error: frames: FLUX.1-dev is an image "
                                                      "model"),
    (["--speed-only", "flux.1-dev", "--baselines", "sdpa_flash,nope"], "fp4vis eval pipeline: error: baselines: "
                                                                       "unknown baseline 'nope'"),
    (["--speed-only", "flux.1-dev", "--cp", "ulysses=2"], "fp4vis eval pipeline: error: --cp ulysses=2: needs 2 "
                                                          "processes, one per GPU; launch with torchrun"),
    (["--speed-only", "flux.1-dev", "--cp", "ulysses"], "fp4vis eval pipeline: error: --cp: expected ulysses=N"),
])
def test_cli_option_errors_are_one_line(argv, expected, tmp_path, capsys):
    try:
        code = main(["eval", "pipeline", *argv, "--out-dir", str(tmp_path), "--no-progress"])
    except SystemExit as e:
        code = e.code
    err = capsys.readouterr().err
    lines = [ln for ln in err.splitlines() if ln.strip()]
    assert code == 2 and len(lines) == 1 and lines[0].startswith(expected), err


def test_baselines_on_the_cpu_are_skipped_with_reasons(tiny_archs, tmp_path):
    """auto: fa4 and sage are skipped on the CPU, each with its reason, and the runs are BF16 and the policies;
    a named baseline that cannot run here stops the eval before any work (as eval wan)."""
    r = run_pipeline_eval(PipelineEvalConfig(speed_only="tiny-flux.1-dev", policies="fast", baselines="auto", steps=2,
                                             backend="reference", device="cpu", warmup=False, progress=False,
                                             out_dir=tmp_path))
    assert r["baselines"] == [] and list(r["runs"]) == ["bf16", "fast"]
    assert set(r["baselines_skipped"]) == {"fa4", "sage"} and all(r["baselines_skipped"].values())
    assert r["runs"]["fast"]["speedup_vs"].keys() == {"bf16"}
    assert "Baselines skipped: `fa4` (" in (tmp_path / "pipeline_speed.md").read_text()
    assert PipelineEvalConfig().baselines == "auto"
    with pytest.raises(UsageError, match="baselines: 'fa4' cannot run here: "):
        run_pipeline_eval(PipelineEvalConfig(speed_only="tiny-flux.1-dev", baselines=["fa4"], device="cpu"))
    with pytest.raises(UsageError, match="baselines: unknown baseline 'nope'"):
        run_pipeline_eval(PipelineEvalConfig(speed_only="tiny-flux.1-dev", baselines="sdpa_flash,nope", device="cpu"))


@pytest.fixture
def cpu_baseline(monkeypatch):
    """A baseline that runs on the CPU (torch SDPA's flash kernel), registered for the test, a custom op under
    torch.compile as the GPU libraries' are; records the layouts it was built for and the q shape of each eager
    call."""
    from fp4vis.evals import baselines

    seen = {"layouts": [], "shapes": []}

    def build(layout):
        seen["layouts"].append(layout)
        sdpa = baselines._one_graph_node("cpu_sdpa", layout, baselines.attention_function("sdpa_flash", layout))

        def call(q, k, v, scale=None):
            if not torch.compiler.is_compiling():
                seen["shapes"].append(tuple(q.shape))
            return sdpa(q, k, v, scale)
        return call

    monkeypatch.setitem(baselines.BASELINES, "cpu_sdpa",
                        baselines.Baseline("cpu_sdpa", "CPU SDPA", "torch SDPA (a test's)", build, needs_cuda=False))
    return seen


KEY_PADDING = "a key-padding attention mask (text padding; the function takes no mask)"


@pytest.mark.parametrize(("name", "on_function", "kept"), [
    ("flux.1-dev", ["transformer_blocks.0.attn", "single_transformer_blocks.0.attn"], {}),
    ("hunyuanvideo", [], {"transformer_blocks.0.attn": [KEY_PADDING],
                          "single_transformer_blocks.0.attn": [KEY_PADDING]}),
    ("wan2.2-t2v-a14b", ["blocks.0.attn1"], {}),
    ("cogvideox-5b", ["transformer_blocks.0.attn1"], {}),
])
def test_a_baseline_runs_as_the_attention_of_the_default_layers(tiny_archs, cpu_baseline, tmp_path, name, on_function,
                                                                kept):
    """A baseline runs as a policy does, after BF16 and before the policies, in the layers the policies patch by
    default (FLUX: both stacks; Wan: attn1), a masked layer keeping the model's attention (HunyuanVideo's text
    padding: all of them), as the result and the report say; speedups against BF16 and it."""
    r = run_pipeline_eval(PipelineEvalConfig(speed_only=f"tiny-{name}", policies="fast", baselines="cpu_sdpa", steps=2,
                                             backend="reference", device="cpu", progress=False, out_dir=tmp_path))
    assert r["baselines"] == ["cpu_sdpa"] and list(r["runs"]) == ["bf16", "attn=cpu_sdpa", "fast"]
    base = r["runs"]["attn=cpu_sdpa"]
    routing = base["baseline"]["routing"]
    assert routing["layers_on_function"] == on_function and routing["layers_kept"] == kept
    assert routing["layers"] == len(on_function) + len(kept)
    arch = pc.PUBLISHED_DENOISERS[f"tiny-{name}"]
    calls = arch.calls_per_step * 3   # warm-up and 2 steps
    assert {shape[0] for shape in cpu_baseline["shapes"]} <= {2 if arch.guidance_batched else 1}   # the batch
    assert routing["calls_on_function"] == len(on_function) * calls == len(cpu_baseline["shapes"])
    assert sum(routing["calls_kept"].values()) == len(kept) * calls
    assert base["timings"]["warmup_s"] > 0 and base["latent_cosine"] > 0.9999
    denoise = {n: run["timings"]["denoise_s"] for n, run in r["runs"].items()}
    for run_key, run in r["runs"].items():
        assert run["speedup_vs"] == {ref: pytest.approx(denoise[ref] / denoise[run_key])
                                     for ref in ("bf16", "attn=cpu_sdpa")}
    md = (tmp_path / "pipeline_speed.md").read_text()
    assert f"in {len(on_function)} of {len(on_function) + len(kept)} layers" in md and "| attn=cpu_sdpa |" in md
    assert ("kept in 2 layers" in md) == bool(kept)
    # off the reference emulation the report tabulates the speedups against every reference
    from fp4vis.evals.pipeline_eval import pipeline_markdown

    assert "| run | vs bf16 | vs attn=cpu_sdpa |" in pipeline_markdown(dict(r, backend="hopper", device="cuda"))
    assert "| run | vs bf16 |" not in md


@pytest.mark.parametrize("name", ["qwen-image", "cogvideox-5b"])
def test_a_compiled_baseline_run_gives_the_eager_latents(tiny_archs, cpu_baseline, monkeypatch, name):
    """compile: the baseline's run compiles too (fullgraph, in its warm-up) and gives the eager latents; its calls
    are counted as traced. CogVideoX, whose diffusers class names no repeated blocks, compiles regionally too."""
    import functools

    from fp4vis.evals import pipeline_eval
    from fp4vis.pipelines.compile import compile_transformers

    kw = dict(speed_only=f"tiny-{name}", policies="fast", baselines="cpu_sdpa", steps=2, backend="reference",
              device="cpu", progress=False)
    eager = run_pipeline_eval(PipelineEvalConfig(**kw))
    monkeypatch.setattr(pipeline_eval, "compile_transformers", functools.partial(compile_transformers,
                                                                                  backend="aot_eager"))
    compiled = run_pipeline_eval(PipelineEvalConfig(compile="regional", **kw))
    base = compiled["runs"]["attn=cpu_sdpa"]
    assert base["latent_cosine"] == eager["runs"]["attn=cpu_sdpa"]["latent_cosine"]
    routing = base["baseline"]["routing"]
    assert routing["calls_on_function"] == 0 and routing["traced"]["calls_on_function"] >= 1
