"""``fp4vis demo`` end to end on a few shipped digits (CPU, reference backend) and on a smoke-trained
video model (the shipped one's weights come from a GPU run): the files it writes, what they say, and
its option errors."""

from __future__ import annotations

import argparse
import json

import pytest

from fp4vis.cli import demo as demo_cmd
from fp4vis.evals.demo import demo_policies, run_demo
from fp4vis.services.usage import UsageError


def _args(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="fp4vis")
    demo_cmd.add_parser(parser.add_subparsers(dest="command"))
    return parser.parse_args(["demo", *argv])


@pytest.fixture(scope="module")
def demo_run(tmp_path_factory, digits_wan_smoke):
    out = tmp_path_factory.mktemp("demo") / "out"
    args = _args("--out-dir", str(out), "--limit", "20", "--policies", "fast,accurate", "--no-progress",
                 "--video-model", str(digits_wan_smoke), "--video-clips", "3")
    return out, args


def test_demo_writes_its_files(demo_run, capsys):
    out, args = demo_run
    assert demo_cmd.run(args) == 0
    printed = capsys.readouterr().out
    for name in ("demo.json", "demo.md", "demo.png", "demo_vit_top1.json", "demo_vit_top1.md", "demo_mae_psnr.json",
                 "demo_mae_psnr.md", "demo_frames.png", "demo_clips.png", "demo_wan.json", "demo_wan.md",
                 "demo_wan_bf16.mp4", "demo_wan_fast.mp4", "demo_wan_accurate.mp4"):
        assert (out / name).is_file() and (out / name).stat().st_size > 0, name
    assert (out / "demo.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    r = json.loads((out / "demo.json").read_text())
    assert r["images"] == 20 and r["backend"] == "reference" and r["policy_names"] == ["bf16", "fast", "accurate"]
    bf16 = r["policies"]["bf16"]
    assert bf16["vit_attention_rel_l2"] == 0.0 and bf16["mae_masked_psnr_diff_vs_bf16"] is None
    for name in ("fast", "accurate"):
        p = r["policies"][name]
        # FP4 really ran on both models: every attention layer moved, by less than iid Gaussian inputs move it
        assert len(p["vit_attention_rel_l2_per_layer"]) == 3 and len(p["mae_attention_rel_l2_per_layer"]) == 3
        assert all(0 < e < 0.5 for e in p["vit_attention_rel_l2_per_layer"].values())
        assert all(0 < e < 0.5 for e in p["mae_attention_rel_l2_per_layer"].values())
        assert 0 <= p["vit_top1"] <= 1 and 0 <= p["vit_agreement_with_bf16"] <= 1
        d, t = p["mae_masked_psnr_diff_vs_bf16"], p["vit_top1_diff_vs_bf16"]
        assert d["n"] == 20 and d["ci95_low"] <= d["mean"] <= d["ci95_high"]
        assert t["n"] == 20 and t["ci95_low"] < t["ci95_high"] and t["mean"] == (t["gained"] - t["lost"]) / 20
    text = (out / "demo.md").read_text() + (out / "demo_wan.md").read_text()
    assert "fp4vis:digits-vit" in text and "demo.png" in text and "demo_clips.png" in text
    assert "demo_wan_fast.mp4" in text
    for path in (str(out), args.video_model):   # no absolute path of this machine in a report
        assert path not in text and path not in (out / "demo_vit_top1.md").read_text()
    for name in ("bf16", "fast", "accurate", "ViT top-1 %", "cos @1", "frames PSNR dB", "digit read",
                 "accurate - fast", "guards: none"):
        assert name in printed


def test_demo_video_figures(demo_run):
    out, _ = demo_run
    v = json.loads((out / "demo.json").read_text())["video"]
    assert v["status"] == "measured" and v["dtype"] == "float32" and v["latent_steps"] == [1, 4]   # smoke: 4 steps
    assert v["clips"] == 3 and v["prompts"] == ["digit 0 moving left", "digit 1 moving right", "digit 2 moving up"]
    assert v["seeds"] == [0, 1, 2] and v["tokens"] == 32 and len(v["per_clip"]) == 3
    bf16 = v["policies"]["bf16"]
    assert bf16["digit_read"]["n"] == 3 and "latent_cosine_after" not in bf16
    for name in ("fast", "accurate"):
        p = v["policies"][name]
        cos, rel = p["latent_cosine_after"], p["latent_rel_l2_after"]
        assert set(cos) == {"1", "4"} and all(0.9 < c["mean"] < 1.0 and c["n"] == 3 for c in cos.values())
        assert all(0 < e["mean"] < 0.2 for e in rel.values()) and rel["1"]["mean"] <= rel["4"]["mean"]
        assert 0 < p["attention_rel_l2"] < 0.5 and len(p["attention_rel_l2_per_layer"]) == 2
        assert 20 < p["psnr_db"]["mean"] < 200 and 0.5 < p["ssim"]["mean"] <= 1.0 + 1e-5
        assert p["digit_read"]["ci95_low"] <= p["digit_read"]["rate"] <= p["digit_read"]["ci95_high"]
        for clip in v["per_clip"]:
            assert clip["policies"][name]["read_direction"] in ("left", "right", "up", "down", "still")
    # the paired difference is the per-clip difference, averaged
    diffs = [c["policies"]["accurate"]["psnr_db"] - c["policies"]["fast"]["psnr_db"] for c in v["per_clip"]]
    assert v["paired"]["accurate"]["psnr_db"]["mean"] == pytest.approx(sum(diffs) / 3)
    # the calibration saw the smoke model's 2 self-attention layers, within range
    lg = v["logits"]
    assert len(lg["layers"]) == 2 and lg["guarded"] == [] and 0 < lg["max_full_log2"] < 127
    assert all(st["sampled_max_log2"] <= st["full_max_log2"] + 1e-6 for st in lg["layers"].values())
    assert (out / "demo_frames.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_demo_without_the_video_weights_says_so(tmp_path, monkeypatch):
    from fp4vis.evals import demo

    assert demo.check_video_model(None) is None
    monkeypatch.setattr("fp4vis.zoo.is_available", lambda name: False)
    assert demo.check_video_model(demo.VIDEO_MODEL) is None
    v = demo.run_video_section(demo.VIDEO_MODEL, None, ["bf16", "fast"], tmp_path, progress=False, say=print)
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
    with pytest.raises(UsageError, match="--video-clips"):
        run_demo(tmp_path, policies="fast", video_clips=41, progress=False)
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
