"""``fp4vis demo`` end to end on a few shipped digits (CPU, reference backend) and on a smoke-trained
video model (the shipped one's weights come from a GPU run): the files it writes, what they say, and
its option errors."""

from __future__ import annotations

import argparse
import json

import pytest

from fp4vis.cli import demo as demo_cmd
from fp4vis.evals.demo import demo_policies, run_demo
from fp4vis.services import UsageError


def _args(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="fp4vis")
    demo_cmd.add_parser(parser.add_subparsers(dest="command"))
    return parser.parse_args(["demo", *argv])


@pytest.fixture(scope="module")
def demo_run(tmp_path_factory, digits_wan_smoke):
    out = tmp_path_factory.mktemp("demo") / "out"
    args = _args("--out-dir", str(out), "--limit", "20", "--policies", "fast,accurate", "--no-progress",
                 "--video-model", str(digits_wan_smoke))
    return out, args


def test_demo_writes_its_files(demo_run, capsys):
    out, args = demo_run
    assert demo_cmd.run(args) == 0
    printed = capsys.readouterr().out
    for name in ("demo.json", "demo.md", "demo.png", "demo_vit_top1.json", "demo_vit_top1.md", "demo_mae_psnr.json",
                 "demo_mae_psnr.md", "demo_frames.png", "demo_wan.json", "demo_wan.md", "demo_wan_bf16.mp4",
                 "demo_wan_fast.mp4", "demo_wan_accurate.mp4"):
        assert (out / name).is_file() and (out / name).stat().st_size > 0, name
    assert (out / "demo.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    r = json.loads((out / "demo.json").read_text())
    assert r["images"] == 20 and r["backend"] == "reference" and r["policy_names"] == ["bf16", "fast", "accurate"]
    bf16, fast = r["policies"]["bf16"], r["policies"]["fast"]
    assert bf16["vit_attention_rel_l2"] == 0.0 and bf16["mae_masked_psnr_diff_vs_bf16"] is None
    for name in ("fast", "accurate"):
        p = r["policies"][name]
        # FP4 really ran on both models: every attention layer moved, by less than iid Gaussian inputs move it
        assert len(p["vit_attention_rel_l2_per_layer"]) == 3 and len(p["mae_attention_rel_l2_per_layer"]) == 3
        assert all(0 < e < 0.5 for e in p["vit_attention_rel_l2_per_layer"].values())
        assert all(0 < e < 0.5 for e in p["mae_attention_rel_l2_per_layer"].values())
        assert 0 <= p["vit_top1"] <= 1 and 0 <= p["vit_agreement_with_bf16"] <= 1
        d = p["mae_masked_psnr_diff_vs_bf16"]
        assert d["n"] == 20 and d["ci95_low"] <= d["mean"] <= d["ci95_high"]
    assert fast["mae_masked_psnr"]["n"] == 20
    md = (out / "demo.md").read_text()
    assert "fp4vis:digits-vit" in md and "demo.png" in md and "demo_frames.png" in md and "demo_wan_fast.mp4" in md
    for name in ("bf16", "fast", "accurate", "ViT top-1 %", "cos @1", "frames PSNR dB"):
        assert name in printed


def test_demo_video_figures(demo_run):
    out, _ = demo_run
    r = json.loads((out / "demo.json").read_text())
    v = r["video"]
    assert v["status"] == "measured" and v["latent_steps"] == [1, 4] and v["tokens"] == 32   # smoke model: 4 steps
    bf16 = r["policies"]["bf16"]
    assert bf16["video_latent_cosine_after"] == {"1": 1.0, "4": 1.0} and bf16["video_attention_rel_l2"] == 0.0
    for name in ("fast", "accurate"):
        p = r["policies"][name]
        cos, rel = p["video_latent_cosine_after"], p["video_latent_rel_l2_after"]
        assert set(cos) == {"1", "4"} and all(0.9 < c < 1.0 for c in cos.values())   # FP4 ran and stayed close
        assert all(0 < e < 0.2 for e in rel.values()) and rel["1"] <= rel["4"]           # the error grows with steps
        assert 0 < p["video_attention_rel_l2"] < 0.5 and len(p["video_attention_rel_l2_per_layer"]) == 2
        assert 20 < p["video_psnr_db"] < 200 and 0.5 < p["video_ssim"] <= 1.0 + 1e-5
        assert p["video_read_direction"] in (*("left", "right", "up", "down"), "still")
    wan = json.loads((out / "demo_wan.json").read_text())
    assert wan["runs"]["fast"]["attention_rel_l2"]["steps"] == 2 and wan["frames"] == 5   # after 1 and 4 steps
    assert (out / "demo_frames.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_demo_without_the_video_weights_says_so(tmp_path, monkeypatch):
    from fp4vis.evals import demo

    assert demo.check_video_model(None) is None
    monkeypatch.setattr("fp4vis.zoo.is_available", lambda name: False)
    assert demo.check_video_model(demo.VIDEO_MODEL) is None
    v = demo.run_video(demo.VIDEO_MODEL, None, ["bf16", "fast"], tmp_path, progress=False, say=print)
    assert v["status"] == "missing" and "train_digits_video.py" in v["note"]
    with pytest.raises(UsageError, match="--video-model"):
        demo.check_video_model(str(tmp_path))


def test_policies_bf16_first_and_unknown_names_rejected():
    assert demo_policies("accurate,bf16,fast") == ["bf16", "accurate", "fast"]
    with pytest.raises(UsageError, match="nope"):
        demo_policies("fast,nope")
    with pytest.raises(SystemExit):   # argparse names the option
        _args("--policies", "fast,nope")


def test_option_errors_name_the_option(tmp_path):
    with pytest.raises(UsageError, match="--policies"):
        run_demo(tmp_path, policies="bf16", limit=4, progress=False)
    with pytest.raises(UsageError, match="--limit"):
        run_demo(tmp_path, policies="fast", limit=1, progress=False)
    blocker = tmp_path / "a_file"
    blocker.write_text("x")
    with pytest.raises(UsageError, match="--out-dir"):
        demo_cmd.run(_args("--out-dir", str(blocker), "--no-progress"))
    assert list(tmp_path.iterdir()) == [blocker]   # nothing written before the checks


def test_demo_is_a_registered_command():
    from fp4vis.cli import COMMANDS, build_parser

    assert COMMANDS["demo"] is demo_cmd
    args = build_parser().parse_args(["demo", "--limit", "3"])
    assert args.out_dir == "out/demo" and args.limit == 3
