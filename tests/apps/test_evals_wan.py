"""Wan fidelity/speed eval on a tiny pipeline (fidelity mode) and on a tiny stand-in for the real
architectures (speed-only mode), CPU, reference backend."""

import json
import math

import pytest

from fp4vis.evals.wan_fidelity import WanEvalConfig, run_wan_eval
from fp4vis.pipelines import wan_sizes as ws
from fp4vis.pipelines import wan_video as wv
from fp4vis.pipelines.compile import compile_transformers
from fp4vis.services.usage import UsageError

KW = dict(height=32, width=32, frames=5, steps=2, progress=False)


@pytest.fixture(scope="module")
def tiny(tiny_wan):
    return tiny_wan


def test_fidelity_mode(tiny, tmp_path):
    r = run_wan_eval(WanEvalConfig(str(tiny), policies="wan_fast,accurate", out_dir=tmp_path, backend="reference",
                                   **KW))
    assert r["mode"] == "fidelity" and not r["random_weights"] and r["decode"] and r["complete"]
    assert list(r["runs"]) == ["bf16", "wan_fast", "accurate"]
    assert r["tokens"] == 8 and r["latent_frames"] == 2
    base = r["runs"]["bf16"]["timings"]
    for name in ("wan_fast", "accurate"):
        run = r["runs"][name]
        t = run["timings"]
        # the prompt is encoded once and shared: every run reports the same text-encoding time
        assert t["text_encode_s"] == base["text_encode_s"] > 0
        assert t["total_s"] == pytest.approx(t["text_encode_s"] + t["denoise_s"] + t["decode_s"])
        assert run["speedup_denoise"] == pytest.approx(base["denoise_s"] / t["denoise_s"])
        assert 0.99 < run["latent_cosine"] < 1.0 and 0 < run["latent_rel_l2"] < 0.2
        v = run["video"]
        assert len(v["psnr_per_frame"]) == 5 and len(v["ssim_per_frame"]) == 5
        assert v["psnr_mean"] > 25 and 0.9 < v["ssim_mean"] <= 1.0 + 1e-5
    md = (tmp_path / "wan_fidelity.md").read_text()
    assert "| wan_fast |" in md and "Random weights" not in md
    # the reference emulation's times are no speed result: no speedup column, and the report says why
    assert "speedup (denoise)" not in md and "not a kernel" in md and str(tiny) not in md
    assert json.loads((tmp_path / "wan_fidelity.json").read_text())["runs"]["accurate"]["video"]["psnr_mean"] > 25


def test_speed_only_mode_is_labelled(monkeypatch, tmp_path):
    tiny_cfg = dict(ws.WAN_TRANSFORMER_CONFIGS["1.3B"], num_layers=1, num_attention_heads=2, ffn_dim=32)
    monkeypatch.setitem(ws.WAN_TRANSFORMER_CONFIGS, "1.3B", tiny_cfg)
    r = run_wan_eval(WanEvalConfig(speed_only="1.3B", policies="fast", out_dir=tmp_path, height=32, width=32, frames=5,
                                   steps=1, progress=False, warmup=False))
    assert r["mode"] == "speed_only" and r["random_weights"] and r["decode"] is False
    assert r["transformer"]["attention_head_dim"] == 128
    assert math.isfinite(r["runs"]["fast"]["speedup_denoise"]) and "video" not in r["runs"]["fast"]
    md = (tmp_path / "wan_speed.md").read_text()
    assert "Random weights (speed only)" in md and "no checkpoint was loaded" in md


def test_failing_policy_is_reported_not_fatal(tiny, monkeypatch):
    real = wv.generate

    def flaky(pipe, config):
        if getattr(config.policy, "name", config.policy) == "accurate":
            raise RuntimeError("kernel unavailable")
        return real(pipe, config)

    monkeypatch.setattr("fp4vis.evals.wan_fidelity.generate", flaky)
    r = run_wan_eval(WanEvalConfig(str(tiny), policies="fast,accurate", warmup=False, decode=False, **KW))
    assert "error" in r["runs"]["accurate"] and "kernel unavailable" in r["runs"]["accurate"]["error"]
    assert "latent_cosine" in r["runs"]["fast"]


def test_argument_errors(tiny):
    with pytest.raises(UsageError, match="either a model"):
        run_wan_eval(WanEvalConfig(None, **KW))
    with pytest.raises(UsageError, match="either a model"):
        run_wan_eval(WanEvalConfig(str(tiny), speed_only="1.3B", **KW))


def test_auto_baselines_are_skipped_with_reasons_on_the_cpu(tiny, tmp_path):
    r = run_wan_eval(WanEvalConfig(str(tiny), policies="fast", baselines="auto", device="cpu", warmup=False,
                                   decode=False, out_dir=tmp_path, **KW))
    assert r["complete"] and r["baselines"] == [] and list(r["runs"]) == ["bf16", "fast"]
    assert set(r["baselines_skipped"]) == {"fa4", "sage"} and all(r["baselines_skipped"].values())
    fast = r["runs"]["fast"]
    assert fast["speedup_vs"] == {"bf16": pytest.approx(fast["speedup_denoise"])}
    md = (tmp_path / "wan_fidelity.md").read_text()
    assert "Baselines skipped: `fa4` (" in md and "vs bf16 |" not in md   # no speedup table without a baseline


def test_a_baseline_runs_in_attn1_through_the_processor(tiny, tmp_path, monkeypatch):
    """A baseline registered for the test (torch SDPA, CPU) runs as attn1's attention: its own run after
    BF16 and before the policies, speedups of every run against BF16 and it, its table in the report; each
    run's progress bar says what runs (the baseline in attn1, not "bf16"), its warm-up that it is one."""
    from fp4vis.evals import baselines, wan_fidelity

    labels = []

    def generate(pipe, config):
        labels.append(config.label)
        return wv.generate(pipe, config)

    monkeypatch.setattr(wan_fidelity, "generate", generate)

    layouts, seen = [], []

    def build(layout):
        layouts.append(layout)

        def call(q, k, v, scale=None):
            seen.append(tuple(q.shape))
            return baselines.attention_function("sdpa_flash", layout)(q, k, v, scale)
        return call

    monkeypatch.setitem(baselines.BASELINES, "cpu_sdpa",
                        baselines.Baseline("cpu_sdpa", "CPU SDPA", "torch SDPA (a test's)", build, needs_cuda=False))
    r = run_wan_eval(WanEvalConfig(str(tiny), policies="fast", baselines="cpu_sdpa", decode=False, out_dir=tmp_path,
                                   backend="reference", **KW))
    assert labels == [f"{run}{warm}" for run in ("bf16, the model's attention", "CPU SDPA in attn1", "fast, reference")
                      for warm in ("; warm-up, untimed", "")]
    assert r["baselines"] == ["cpu_sdpa"] and r["baselines_skipped"] == {}
    assert list(r["runs"]) == ["bf16", "attn1=cpu_sdpa", "fast"]
    assert layouts[-1] == "bshd"   # the Wan processor's layout (an availability check builds one first)
    assert seen and all(len(s) == 4 and s[1] == r["tokens"] for s in seen)   # (B, S, H, D), attn1 only
    base = r["runs"]["attn1=cpu_sdpa"]
    assert base["baseline"]["layers"] == "attn1" and base["latent_cosine"] > 0.9999
    denoise = {n: run["timings"]["denoise_s"] for n, run in r["runs"].items()}
    for name, run in r["runs"].items():
        assert run["speedup_vs"] == {ref: pytest.approx(denoise[ref] / denoise[name])
                                     for ref in ("bf16", "attn1=cpu_sdpa")}
    md = (tmp_path / "wan_fidelity.md").read_text()
    assert "| attn1=cpu_sdpa |" in md and "`attn1=cpu_sdpa`: torch SDPA (a test's)" in md
    # off the reference emulation the report tabulates the speedups against every reference; on it, none (its
    # times are no speed result), as the generic configuration's report
    assert "| run | vs bf16 | vs attn1=cpu_sdpa |" in wan_fidelity.wan_markdown(dict(r, backend="hopper",
                                                                                       device="cuda"))
    assert "| run | vs bf16 |" not in md
    assert json.loads((tmp_path / "wan_fidelity.json").read_text())["baselines"] == ["cpu_sdpa"]


def test_baseline_errors_come_before_any_work(tmp_path):
    missing = str(tmp_path / "no_such_model")   # never loaded: the option is checked first
    with pytest.raises(UsageError, match="baselines: unknown baseline 'nope'"):
        run_wan_eval(WanEvalConfig(missing, baselines="fa4,nope", device="cpu", **KW))
    with pytest.raises(UsageError, match="baselines: 'fa4' cannot run here: "):
        run_wan_eval(WanEvalConfig(missing, baselines=["fa4"], device="cpu", **KW))
    assert WanEvalConfig().baselines == "auto"


def test_compiled_runs_give_the_eager_latents_and_report_their_warmup(tiny, tmp_path, monkeypatch):
    """``compile``: every run (BF16, the policies) with the transformer compiled (fullgraph) in its warm-up;
    traced through AOTAutograd (aot_eager: the same ops), the latents are the eager run's, bit for bit
    (``full``: tests/patching/test_wan.py compiles the whole transformer)."""
    import functools

    from fp4vis.evals import wan_fidelity as wf

    kw = dict(KW, steps=1, policies="fast", backend="reference", decode=False, baselines="none")
    eager = run_wan_eval(WanEvalConfig(str(tiny), **kw))
    monkeypatch.setattr(wf, "compile_transformers", functools.partial(compile_transformers, backend="aot_eager"))
    compiled = run_wan_eval(WanEvalConfig(str(tiny), compile="regional", out_dir=tmp_path, **kw))
    assert compiled["compile"] == "regional" and eager["compile"] is None
    for name in ("bf16", "fast"):
        assert compiled["runs"][name]["timings"]["warmup_s"] > 0
    assert compiled["runs"]["fast"]["latent_cosine"] == eager["runs"]["fast"]["latent_cosine"]
    md = (tmp_path / "wan_fidelity.md").read_text()
    assert "**compiled** (`transformer.compile_repeated_blocks(fullgraph=True)`" in md
    with pytest.raises(UsageError, match="compile: needs the warm-up"):
        run_wan_eval(WanEvalConfig(str(tiny), compile="full", warmup=False, **kw))
    with pytest.raises(UsageError, match="compile: must be one of regional, full"):
        run_wan_eval(WanEvalConfig(str(tiny), compile="max", **kw))


def test_the_wan_eval_is_a_configuration_of_the_pipeline_eval(tiny, monkeypatch):
    """One run loop: the Wan eval, the pipeline eval's entry point given the Wan configuration, and the generic
    configuration on the same saved Wan pipeline all run their schedules through ``timed_runs.run_schedule``; the
    pipeline eval's entry point runs a ``WanEvalConfig`` as ``run_wan_eval`` does, to the latent."""
    from fp4vis.evals import timed_runs
    from fp4vis.evals.pipeline_eval import PipelineEvalConfig, run_pipeline_eval

    loops = []
    real = timed_runs.run_schedule

    def spy(schedule, settings, result, **kw):
        loops.append((result["eval"], [run.name for run in schedule]))
        return real(schedule, settings, result, **kw)

    monkeypatch.setattr(timed_runs, "run_schedule", spy)
    kw = dict(KW, policies="fast", backend="reference", device="cpu", decode=False, warmup=False, baselines="none")
    wan = run_wan_eval(WanEvalConfig(str(tiny), **kw))
    wan_via_pipeline = run_pipeline_eval(WanEvalConfig(str(tiny), **kw))
    generic = run_pipeline_eval(PipelineEvalConfig(str(tiny), dtype="float32", **kw))
    assert loops == [(name, ["bf16", "fast"]) for name in ("wan_fidelity", "wan_fidelity", "pipeline_eval")]
    assert wan_via_pipeline["eval"] == "wan_fidelity"
    assert wan_via_pipeline["runs"]["fast"]["latent_cosine"] == wan["runs"]["fast"]["latent_cosine"]
    # what the loop writes is the same for both configurations
    for r in (wan, generic):
        assert r["complete"] and r["context_parallel"] is None and r["baselines_skipped"] == {}
        assert r["runs"]["fast"]["speedup_vs"] == {"bf16": pytest.approx(r["runs"]["bf16"]["timings"]["denoise_s"]
                                                                          / r["runs"]["fast"]["timings"]["denoise_s"])}
