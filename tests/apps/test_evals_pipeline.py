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
    assert {"wan2.2-t2v-a14b", "hunyuanvideo", "flux.1-dev", "qwen-image"} <= set(archs)
    assert all(a.source and a.class_name and a.family in pc.FAMILIES for a in archs.values())
    size = {n: dict(height=a.height, width=a.width, frames=a.frames) for n, a in archs.items()}
    assert size["hunyuanvideo"] == dict(height=720, width=1280, frames=129)
    assert size["wan2.2-t2v-a14b"] == dict(height=720, width=1280, frames=81)
    assert pc.tokens(archs["flux.1-dev"], **size["flux.1-dev"]) == 4096
    assert pc.tokens(archs["qwen-image"], **size["qwen-image"]) == 83 * 83
    assert pc.tokens(archs["hunyuanvideo"], **size["hunyuanvideo"]) == 33 * 45 * 80
    assert pc.tokens(archs["wan2.2-t2v-a14b"], **size["wan2.2-t2v-a14b"]) == 21 * 45 * 80
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
    assert (tmp_path / "pipeline_speed.json").exists()


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
])
def test_cli_option_errors_are_one_line(argv, expected, tmp_path, capsys):
    try:
        code = main(["eval", "pipeline", *argv, "--out-dir", str(tmp_path), "--no-progress"])
    except SystemExit as e:
        code = e.code
    err = capsys.readouterr().err
    lines = [ln for ln in err.splitlines() if ln.strip()]
    assert code == 2 and len(lines) == 1 and lines[0].startswith(expected), err
