"""Wan fidelity/speed eval on a tiny pipeline (fidelity mode) and on a tiny stand-in for the real
architectures (speed-only mode), CPU, reference backend."""

import json
import math

import pytest

from fp4vis.evals.wan_fidelity import run_wan_eval
from fp4vis.pipelines import wan_video as wv
from fp4vis.services import UsageError

KW = dict(height=32, width=32, frames=5, steps=2, progress=False)


@pytest.fixture(scope="module")
def tiny(tiny_wan):
    return tiny_wan


def test_fidelity_mode(tiny, tmp_path):
    r = run_wan_eval(str(tiny), policies="wan_fast,accurate", out_dir=tmp_path, backend="reference", **KW)
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
    assert json.loads((tmp_path / "wan_fidelity.json").read_text())["runs"]["accurate"]["video"]["psnr_mean"] > 25


def test_speed_only_mode_is_labelled(monkeypatch, tmp_path):
    tiny_cfg = dict(wv.WAN_TRANSFORMER_CONFIGS["1.3B"], num_layers=1, num_attention_heads=2, ffn_dim=32)
    monkeypatch.setitem(wv.WAN_TRANSFORMER_CONFIGS, "1.3B", tiny_cfg)
    r = run_wan_eval(speed_only="1.3B", policies="fast", out_dir=tmp_path, height=32, width=32, frames=5, steps=1,
                     progress=False, warmup=False)
    assert r["mode"] == "speed_only" and r["random_weights"] and r["decode"] is False
    assert r["transformer"]["attention_head_dim"] == 128
    assert math.isfinite(r["runs"]["fast"]["speedup_denoise"]) and "video" not in r["runs"]["fast"]
    md = (tmp_path / "wan_speed.md").read_text()
    assert "Random weights (speed only)" in md and "no checkpoint was loaded" in md


def test_failing_policy_is_reported_not_fatal(tiny, monkeypatch):
    real = wv.generate

    def flaky(pipe, *, policy, **kw):
        if getattr(policy, "name", policy) == "accurate":
            raise RuntimeError("kernel unavailable")
        return real(pipe, policy=policy, **kw)

    monkeypatch.setattr("fp4vis.evals.wan_fidelity.generate", flaky)
    r = run_wan_eval(str(tiny), policies="fast,accurate", warmup=False, decode=False, **KW)
    assert "error" in r["runs"]["accurate"] and "kernel unavailable" in r["runs"]["accurate"]["error"]
    assert "latent_cosine" in r["runs"]["fast"]


def test_argument_errors(tiny):
    with pytest.raises(UsageError, match="either a model"):
        run_wan_eval(None, **KW)
    with pytest.raises(UsageError, match="either a model"):
        run_wan_eval(str(tiny), speed_only="1.3B", **KW)
