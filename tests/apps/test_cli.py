"""The fp4vis CLI end to end on tiny local models and data made here (CPU, reference backend)."""

import json
import os
import subprocess
import sys

import pytest
import torch

from fp4vis.cli import build_parser, main
from fp4vis.evals.tiny import make_image_folder, make_tiny_timm_vit

NO_GPU = not torch.cuda.is_available()


@pytest.fixture(scope="module")
def assets(tmp_path_factory, tiny_wan, tiny_mae):
    root = tmp_path_factory.mktemp("cli")
    return {"wan": tiny_wan, "vit": make_tiny_timm_vit(root / "vit", num_classes=3), "mae": tiny_mae,
            "data": make_image_folder(root / "data", classes=("0", "2"), per_class=1, size=36)}


def run(capsys, *argv):
    code = main([str(a) for a in argv])
    out, err = capsys.readouterr()
    return code, out, err


def test_console_script_help():
    r = subprocess.run([sys.executable, "-m", "fp4vis.cli", "--help"], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0
    for cmd in ("generate", "eval", "bench", "calibrate", "info"):
        assert cmd in r.stdout


@pytest.mark.parametrize("argv", [["generate"], ["eval", "vit"], ["eval", "mae"], ["eval", "wan"], ["bench"],
                                  ["calibrate", "wan"], ["calibrate", "vit"], ["calibrate", "mae"], ["info"]])
def test_every_subcommand_has_help(argv, capsys):
    with pytest.raises(SystemExit) as e:
        build_parser().parse_args([*argv, "--help"])
    assert e.value.code == 0
    out = capsys.readouterr().out
    assert "usage: fp4vis " + " ".join(argv) in out
    assert "(default:" in out or argv == ["info"]  # defaults are shown


def test_info_lists_backends_with_reasons(capsys):
    code, out, _ = run(capsys, "info")
    assert code == 0 and "reference  available" in out and "hopper" in out
    if NO_GPU:
        assert "GPU: none visible" in out and "hopper     unavailable:" in out
    code, out, _ = run(capsys, "info", "--json")
    info = json.loads(out)
    assert info["backends"]["reference"] is None and "fast" in info["policies"]


def test_bench_quick_writes_json_table_and_plot(tmp_path, capsys):
    code, out, _ = run(capsys, "bench", "--quick", "--out-dir", tmp_path, "--no-progress")
    assert code == 0
    rows = json.loads((tmp_path / "kernel_bench_quick.json").read_text())["rows"]
    assert rows and all(r["backend"] == "reference" and r["ms"] > 0 for r in rows)
    assert (tmp_path / "kernel_bench_quick.md").read_text().startswith("| shape |")
    assert (tmp_path / "kernel_bench_quick.png").read_bytes()[:4] == b"\x89PNG"


def test_generate_end_to_end(assets, tmp_path, capsys):
    out_mp4 = tmp_path / "fox.mp4"
    code, out, err = run(capsys, "generate", "--model", assets["wan"], "--prompt", "a red fox in the snow",
                         "--policy", "wan_fast", "--frames", 5, "--steps", 2, "--height", 32, "--width", 32,
                         "--seed", 7, "--output", out_mp4, "--device", "cpu", "--exact-steps", "0")
    assert code == 0, err
    assert out_mp4.stat().st_size > 0 and f"video: {out_mp4}" in out
    side = json.loads(out_mp4.with_suffix(".json").read_text())
    assert side["policy"] == "wan_fast" and side["seed"] == 7 and side["prompt"] == "a red fox in the snow"
    assert side["exact_steps"] == [0]
    assert set(side["timings"]) >= {"load_s", "text_encode_s", "denoise_s", "decode_s", "total_s"}


def test_eval_vit_mae_wan(assets, tmp_path, capsys):
    code, out, err = run(capsys, "eval", "vit", "--model", assets["vit"], "--data", assets["data"],
                         "--resolution", 48, "--policies", "fast", "--out-dir", tmp_path, "--no-progress")
    assert code == 0, err
    assert "fast: top-1" in out and "agreement" in out and (tmp_path / "vit_top1.md").exists()
    assert json.loads((tmp_path / "vit_top1.json").read_text())["tokens"] == 37
    code, out, err = run(capsys, "eval", "mae", "--model", assets["mae"], "--data", assets["data"],
                         "--policies", "accurate", "--out-dir", tmp_path, "--no-progress")
    assert code == 0, err
    assert "accurate: masked-patch PSNR" in out and (tmp_path / "mae_psnr.json").exists()
    code, out, err = run(capsys, "eval", "wan", "--model", assets["wan"], "--policies", "fast", "--frames", 5,
                         "--steps", 1, "--height", 32, "--width", 32, "--out-dir", tmp_path, "--no-warmup",
                         "--no-progress")
    assert code == 0, err
    assert "fast: denoise" in out and "latent cosine" in out
    assert json.loads((tmp_path / "wan_fidelity.json").read_text())["runs"]["fast"]["video"]["psnr_mean"] > 20


def test_calibrate_then_use_the_plan(assets, tmp_path, capsys):
    plan = tmp_path / "vit_plan.json"
    code, out, err = run(capsys, "calibrate", "vit", "--model", assets["vit"], "--data", assets["data"],
                         "--limit", 2, "--out", plan)
    assert code == 0, err
    data = json.loads(plan.read_text())
    assert data["format"] == "fp4vis.guard_plan" and len(data["layers"]) == 2 and "guarded layers:" in out
    code, out, err = run(capsys, "eval", "vit", "--model", assets["vit"], "--data", assets["data"], "--policies",
                         "fast", "--guard-plan", plan, "--out-dir", tmp_path, "--no-progress", "--no-per-layer")
    assert code == 0, err
    assert json.loads((tmp_path / "vit_top1.json").read_text())["guard_plan"]["format"] == "fp4vis.guard_plan"
    wplan = tmp_path / "wan_plan.json"
    code, out, err = run(capsys, "calibrate", "wan", "--model", assets["wan"], "--prompt", "a cat", "--frames", 5,
                         "--steps", 1, "--height", 32, "--width", 32, "--out", wplan, "--no-progress")
    assert code == 0, err
    assert len(json.loads(wplan.read_text())["layers"]) == 2
    code, out, err = run(capsys, "calibrate", "mae", "--model", assets["mae"], "--data", assets["data"],
                         "--limit", 1, "--out", tmp_path / "mae_plan.json")
    assert code == 0, err


def test_clear_errors(assets, tmp_path, capsys):
    code, _, err = run(capsys, "generate", "--model", tmp_path / "no_such_dir", "--prompt", "x", "--device", "cpu")
    assert code == 2 and "does not exist" in err and "Traceback" not in err
    code, _, err = run(capsys, "eval", "vit", "--model", assets["vit"], "--data", tmp_path / "nodata")
    assert code == 2 and "data:" in err and "does not exist" in err
    code, _, err = run(capsys, "eval", "vit", "--model", assets["vit"], "--data", assets["data"],
                       "--guard-plan", tmp_path / "nope.json")
    assert code == 2 and "guard plan" in err
    with pytest.raises(SystemExit) as e:
        main(["generate", "--model", str(assets["wan"]), "--prompt", "x", "--policy", "fastest"])
    assert e.value.code == 2
    assert "unknown policy 'fastest'" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["eval", "vit", "--model", "m", "--data", "d", "--policies", "fast,nope"])
    assert "unknown policy 'nope'" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["eval", "wan"])  # neither --model nor --speed-only
    assert "one of the arguments --model --speed-only is required" in capsys.readouterr().err


@pytest.mark.skipif(not NO_GPU, reason="checks the messages given without a GPU")
def test_gpu_only_options_without_gpu(assets, capsys):
    code, _, err = run(capsys, "generate", "--model", assets["wan"], "--prompt", "x", "--device", "cuda")
    assert code == 2 and "needs a CUDA GPU" in err
    code, _, err = run(capsys, "eval", "vit", "--model", assets["vit"], "--data", assets["data"], "--backend",
                       "hopper")
    assert code == 2 and "runs only on a CUDA GPU" in err
    code, _, err = run(capsys, "bench")
    assert code == 2 and "bench --quick" in err


def test_hub_id_without_network_says_what_to_do(assets, tmp_path):
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    r = subprocess.run([sys.executable, "-m", "fp4vis.cli", "eval", "vit", "--model", "google/vit-base-patch16-224",
                        "--data", str(assets["data"]), "--out-dir", str(tmp_path)], capture_output=True, text=True,
                       timeout=180, env=env)
    assert r.returncode == 2
    assert "could not load 'google/vit-base-patch16-224' from the Hugging Face Hub" in r.stderr
    assert "pass the local directory" in r.stderr and "Traceback" not in r.stderr
