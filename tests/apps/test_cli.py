"""The fp4vis CLI end to end on tiny local models and data made here (CPU, reference backend)."""

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from apps.tiny_models import make_image_folder, make_tiny_timm_vit

from fp4vis.cli import build_parser, main

NO_GPU = not torch.cuda.is_available()


@pytest.fixture(scope="module")
def assets(tmp_path_factory, tiny_wan, tiny_mae):
    root = tmp_path_factory.mktemp("cli")
    return {"wan": tiny_wan, "vit": make_tiny_timm_vit(root / "vit", num_classes=3), "mae": tiny_mae,
            "data": make_image_folder(root / "data", classes=("0", "2"), per_class=1, size=36)}


def test_console_script_help():
    r = subprocess.run([sys.executable, "-m", "fp4vis.cli", "--help"], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0
    for cmd in ("generate", "eval", "bench", "calibrate", "info", "selfcheck"):
        assert cmd in r.stdout


@pytest.mark.parametrize("argv", [["generate"], ["eval", "vit"], ["eval", "mae"], ["eval", "wan"], ["bench"],
                                  ["calibrate", "wan"], ["calibrate", "vit"], ["calibrate", "mae"], ["info"],
                                  ["selfcheck"]])
def test_every_subcommand_has_help(argv, capsys):
    with pytest.raises(SystemExit) as e:
        build_parser().parse_args([*argv, "--help"])
    assert e.value.code == 0
    out = capsys.readouterr().out
    assert "usage: fp4vis " + " ".join(argv) in out
    assert "(default:" in out or argv == ["info"]  # defaults are shown


def test_info_lists_backends_with_reasons(cli):
    code, out, _ = cli("info")
    assert code == 0 and "reference  available" in out and "hopper" in out
    import diffusers
    assert f"diffusers {diffusers.__version__}" in out and f"torch {torch.__version__}" in out   # the libraries
    if NO_GPU:
        assert "GPU: none visible" in out and "hopper     unavailable:" in out
    code, out, _ = cli("info", "--json")
    info = json.loads(out)
    assert info["backends"]["reference"] is None and "fast" in info["policies"]


def test_bench_quick_says_what_it_measured(tmp_path, cli):
    """Times of the reference on the CPU, and nothing it did not measure: no FLOP rate, no error, no plot."""
    code, out, _ = cli("bench", "--quick", "--out-dir", tmp_path, "--no-progress")
    assert code == 0
    rows = json.loads((tmp_path / "kernel_bench_quick.json").read_text())["rows"]
    assert rows and all(r["backend"] == "reference" and r["ms"] > 0 and "tflops" not in r for r in rows)
    table = (tmp_path / "kernel_bench_quick.md").read_text()
    assert table.startswith("| shape | reference/fast ms |") and "hopper" not in table and "tflops" not in out
    assert "median wall time" in out and "plot: none" in out and not (tmp_path / "kernel_bench_quick.png").exists()


def test_cli_parser_loads_no_model_library():
    """`fp4vis info` (every command's parser) without diffusers, transformers, timm: they took it to 14 s."""
    code = ("import sys, fp4vis.cli; fp4vis.cli.build_parser(); "
            "print(sorted(m for m in ('diffusers', 'transformers', 'timm', 'matplotlib') if m in sys.modules))")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0 and r.stdout.strip() == "[]", r.stderr


def test_zoo_export_digits_is_what_eval_reads(tmp_path, cli):
    from fp4vis.evals.datasets import data_layout

    dest = tmp_path / "digits"
    code, out, err = cli("zoo", "export", "digits", dest, "--limit", 20)
    assert code == 0, err
    assert sorted(p.name for p in dest.iterdir()) == [str(d) for d in range(10)]
    assert len(list(dest.glob("*/*.png"))) == 20 and "2 per digit" in out and "--labels index" in out
    assert data_layout(dest)[0] == "imagefolder"   # the evals' reader takes it as it is
    code, _, err = cli("zoo", "export", "digits", dest)
    assert code == 2 and "not empty" in err and len(list(dest.glob("*/*.png"))) == 20   # never overwritten
    code, out, _ = cli("zoo", "list")
    assert code == 0 and "fp4vis:digits-wan" in out


@pytest.mark.parametrize("command", ["generate", "calibrate"])
def test_commands_refuse_a_prompt_the_shipped_model_does_not_know(cli, tmp_path, command):
    """Before any loading: exit 2 with the grammar, and nothing written (generate; calibrate wan)."""
    argv = (["generate", "--output", tmp_path / "fox.mp4"] if command == "generate" else
            ["calibrate", "wan", "--out", tmp_path / "plan.json", "--prompt", "digit 3 moving left"])
    code, _, err = cli(*argv, "--model", "fp4vis:digits-wan", "--prompt", "a red fox in the snow")
    assert code == 2 and "digit <0-9> moving <left|right|up|down>" in err and "--force" in err
    assert err.count("\n") == 1 and list(tmp_path.iterdir()) == []


def test_generate_end_to_end(assets, tmp_path, cli):
    out_mp4 = tmp_path / "fox.mp4"
    code, out, err = cli("generate", "--model", assets["wan"], "--prompt", "a red fox in the snow",
                         "--policy", "wan_fast", "--frames", 5, "--steps", 2, "--height", 32, "--width", 32,
                         "--seed", 7, "--output", out_mp4, "--device", "cpu", "--exact-steps", "0")
    assert code == 0, err
    assert out_mp4.stat().st_size > 0 and f"video: {out_mp4}" in out
    side = json.loads(out_mp4.with_suffix(".json").read_text())
    assert side["policy"] == "wan_fast" and side["seed"] == 7 and side["prompt"] == "a red fox in the snow"
    assert side["exact_steps"] == [0]
    assert set(side["timings"]) >= {"load_s", "text_encode_s", "denoise_s", "decode_s", "total_s"}
    # what it does comes first (after the libraries' loading bars), then bars labelled by what runs
    said = [line for line in re.split(r"[\r\n]+", err) if line.strip() and not line.startswith("Loading")]
    assert said[0] == (f'generate: {assets["wan"]}, "a red fox in the snow", 32x32, 5 frames, 2 steps, guidance 5.0, '
                       f"seed 7; attention: wan_fast, reference, exact attention in steps 0 -> {out_mp4}"), said
    # then, once, that the CPU runs the reference (as the README says), and no other warning
    assert said[1] == ("warning: UserWarning: fp4vis generate: no FP4 attention kernel runs on the CPU; policy "
                       "'wan_fast' runs on the reference emulation (exact numerics, slow); --backend reference "
                       "chooses it and silences this"), said
    assert "denoise (wan_fast, reference):" in err and err.count("Warning") == 1, err


def test_eval_vit_mae_wan(assets, tmp_path, cli):
    code, out, err = cli("eval", "vit", "--model", assets["vit"], "--data", assets["data"],
                         "--resolution", 48, "--policies", "fast", "--out-dir", tmp_path)
    assert code == 0, err
    header = f"eval vit: {assets['vit']} at 48 px (37 tokens), 2 images from {assets['data']} (labels: "
    assert err.startswith(header), err
    assert "bf16 (the model's attention) and fast on the reference backend\n" in err
    assert "bf16 (baseline): top-1" in out and "fast: top-1" in out and "agreement" in out
    report = (tmp_path / "vit_top1.md").read_text()   # no absolute path of this machine in a report
    assert str(assets["vit"]) not in report and str(assets["data"]) not in report
    assert json.loads((tmp_path / "vit_top1.json").read_text())["tokens"] == 37
    code, out, err = cli("eval", "mae", "--model", assets["mae"], "--data", assets["data"],
                         "--policies", "accurate", "--out-dir", tmp_path, "--no-progress")
    assert code == 0, err
    assert "bf16 (baseline): masked-patch PSNR" in out and "accurate: masked-patch PSNR" in out
    assert (tmp_path / "mae_psnr.json").exists()
    code, out, err = cli("eval", "wan", "--model", assets["wan"], "--policies", "fast", "--frames", 5,
                         "--steps", 1, "--height", 32, "--width", 32, "--out-dir", tmp_path, "--no-warmup",
                         "--no-progress")
    assert code == 0, err
    assert "fast: denoise" in out and "latent cosine" in out
    assert json.loads((tmp_path / "wan_fidelity.json").read_text())["runs"]["fast"]["video"]["psnr_mean"] > 20


def test_calibrate_then_use_the_plan(assets, tmp_path, cli):
    plan = tmp_path / "vit_plan.json"
    code, out, err = cli("calibrate", "vit", "--model", assets["vit"], "--data", assets["data"],
                         "--limit", 2, "--out", plan)
    assert code == 0, err
    assert f"calibrate vit: {assets['vit']} on 2 images from {assets['data']}: the model's exact attention" in err
    data = json.loads(plan.read_text())
    assert data["format"] == "fp4vis.guard_plan" and len(data["layers"]) == 2 and "guarded layers:" in out
    code, out, err = cli("eval", "vit", "--model", assets["vit"], "--data", assets["data"], "--policies",
                         "fast,accurate", "--guard-plan", plan, "--out-dir", tmp_path, "--no-progress",
                         "--no-per-layer")
    assert code == 0, err
    report = json.loads((tmp_path / "vit_top1.json").read_text())
    assert report["guard_plan"]["format"] == "fp4vis.guard_plan" and data["policy"]["name"] == "fast"
    # calibrate's default policy is generate's and eval's; the plan guards only the policy it was made for
    assert [report["policies"][p]["guard_plan_applied"] for p in ("fast", "accurate")] == [True, False]
    wplan = tmp_path / "wan_plan.json"
    code, out, err = cli("calibrate", "wan", "--model", assets["wan"], "--prompt", "a cat", "--frames", 5,
                         "--steps", 1, "--height", 32, "--width", 32, "--out", wplan, "--no-progress")
    assert code == 0, err
    # --no-progress hides the libraries' loading bars too, and gives their switches back afterwards
    import diffusers.utils.logging as diffusers_logging
    import transformers.utils.logging as transformers_logging

    assert "Loading" not in err and "it/s" not in err, err
    assert transformers_logging.is_progress_bar_enabled() and diffusers_logging.is_progress_bar_enabled()
    assert len(json.loads(wplan.read_text())["layers"]) == 2
    code, _, err = cli("generate", "--model", assets["wan"], "--prompt", "x", "--frames", 5, "--steps", 1,
                       "--height", 32, "--width", 32, "--policy", "accurate", "--guard-plan", wplan, "--output",
                       tmp_path / "v.mp4", "--no-progress")
    assert code == 2 and "calibrated for policy 'fast', not 'accurate'" in err, err
    # an image-to-video pipeline, its image branch included
    from apps.tiny_models import make_tiny_wan_i2v
    i2v = make_tiny_wan_i2v(tmp_path / "i2v")
    img = assets["data"] / "0" / "img0.png"
    code, out, err = cli("calibrate", "wan", "--model", i2v, "--prompt", "a cat", "--image", img,
                         "--frames", 5, "--steps", 1, "--height", 32, "--width", 32, "--out", tmp_path / "i2v.json",
                         "--no-progress")
    assert code == 0, err
    assert len(json.loads((tmp_path / "i2v.json").read_text())["layers"]) == 2
    code, _, err = cli("calibrate", "wan", "--model", i2v, "--prompt", "a cat", "--frames", 5, "--height", 32,
                       "--width", 32, "--out", tmp_path / "x.json")
    assert code == 2 and "is an image-to-video model: pass --image" in err, err
    code, out, err = cli("calibrate", "mae", "--model", assets["mae"], "--data", assets["data"],
                         "--limit", 1, "--out", tmp_path / "mae_plan.json")
    assert code == 0, err


def test_clear_errors(assets, tmp_path, capsys, cli):
    code, _, err = cli("generate", "--model", tmp_path / "no_such_dir", "--prompt", "x", "--device", "cpu")
    assert code == 2 and "does not exist" in err and "Traceback" not in err
    code, _, err = cli("eval", "vit", "--model", assets["vit"], "--data", tmp_path / "nodata")
    assert code == 2 and "data:" in err and "does not exist" in err
    code, _, err = cli("eval", "vit", "--model", assets["vit"], "--data", assets["data"],
                       "--guard-plan", tmp_path / "nope.json")
    assert code == 2 and "guard plan" in err
    with pytest.raises(SystemExit) as e:
        main(["generate", "--model", str(assets["wan"]), "--prompt", "x", "--policy", "fastest"])
    assert e.value.code == 2
    assert "unknown policy 'fastest'" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["eval", "vit", "--model", "m", "--data", "d", "--policies", "fast,nope"])
    assert "unknown policy 'nope'" in capsys.readouterr().err
    code, _, err = cli("eval", "wan", "--out-dir", tmp_path)   # neither --model nor --speed-only
    assert code == 2 and "--model or --speed-only: one is required (or --protocol paper)" in err


@pytest.mark.parametrize("argv, expected", [
    ([], "fp4vis: error: the following arguments are required: COMMAND (options: fp4vis --help)"),
    (["info", "--bogus"], "fp4vis info: error: unrecognized arguments: --bogus (options: fp4vis info --help)"),
    (["eval", "vit", "--data", "d", "--limit", "0"], "fp4vis eval vit: error: argument --limit: expected a positive"),
    (["eval", "wan", "--speed-only", "13B"], "fp4vis eval wan: error: argument --speed-only: invalid choice: '13B'"),
    (["calibrate", "wan", "--prompt", "x"], "fp4vis calibrate wan: error: the following arguments are required: "
                                            "--model"),
    (["bench", "--quick", "--shapes", "x"], "fp4vis bench: error: unrecognized arguments: --shapes x"),
])
def test_bad_options_are_one_line_and_exit_2(argv, expected, capsys):
    """argparse's errors too: one line naming the (sub)command and where its options are, not the usage."""
    with pytest.raises(SystemExit) as e:
        main(argv)
    err = capsys.readouterr().err
    assert e.value.code == 2 and err.startswith(expected) and len(err.strip().splitlines()) == 1, err


@pytest.mark.skipif(not NO_GPU, reason="checks the messages given without a GPU")
def test_gpu_only_options_without_gpu(assets, cli):
    code, _, err = cli("generate", "--model", assets["wan"], "--prompt", "x", "--device", "cuda")
    assert code == 2 and "needs a CUDA GPU" in err
    code, _, err = cli("eval", "vit", "--model", assets["vit"], "--data", assets["data"], "--backend",
                       "hopper")
    assert code == 2 and "runs only on a CUDA GPU" in err
    code, _, err = cli("bench")
    assert code == 2 and "bench --quick" in err
    code, _, err = cli("selfcheck")
    assert code == 2 and "needs a CUDA GPU" in err and len(err.strip().splitlines()) == 1


def test_hub_id_without_network_says_what_to_do(assets, tmp_path):
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    r = subprocess.run([sys.executable, "-m", "fp4vis.cli", "eval", "vit", "--model", "google/vit-base-patch16-224",
                        "--data", str(assets["data"]), "--out-dir", str(tmp_path)], capture_output=True, text=True,
                       timeout=180, env=env)
    assert r.returncode == 2
    assert "could not load 'google/vit-base-patch16-224' from the Hugging Face Hub" in r.stderr
    assert "pass the local directory" in r.stderr and "Traceback" not in r.stderr


@pytest.fixture(scope="module")
def bad(assets, tmp_path_factory):
    """Files a user gets wrong: guard plans that are not readable or belong to another model, an output
    path that is a directory or a file, an image that is not one, a ViT classifier where an MAE is needed."""
    from apps.tiny_models import make_tiny_hf_vit

    root = tmp_path_factory.mktemp("bad")
    assert main(["calibrate", "vit", "--model", str(assets["vit"]), "--data", str(assets["data"]), "--limit", "1",
                 "--dtype", "float32", "--out", str(root / "vit_plan.json"), "--no-progress"]) == 0
    text = (root / "vit_plan.json").read_text()
    (root / "corrupt.json").write_text("{not json")
    (root / "truncated.json").write_text(text[: len(text) // 2])
    (root / "v99.json").write_text(json.dumps({**json.loads(text), "version": 99}))
    plan = json.loads(text)
    for name, edit in (("layers_list", {"layers": list(plan["layers"].values())}),
                       ("guarded_str", {"guarded": "blocks.1.attn"}), ("policy_str", {"policy": "fast"}),
                       ("stat_inf", {"layers": {n: {**st, "sampled_max_log2": float("inf")}
                                                for n, st in plan["layers"].items()}})):
        (root / f"{name}.json").write_text(json.dumps({**plan, **edit}).replace("Infinity", "1e999"))
    (root / "a_dir").mkdir()
    (root / "a_file").write_text("x")
    data = make_image_folder(root / "data_broken", classes=("0",), per_class=1, size=36)
    (data / "0" / "broken.jpg").write_text("this is not a JPEG")
    names = make_image_folder(root / "data_names", classes=("cat", "dog"), per_class=1, size=36)
    return {"root": root, "data_broken": data, "hf_vit": make_tiny_hf_vit(root / "hf_vit", num_classes=3),
            "data_names": names}


def _bad_cases(a, b):
    vit = ["eval", "vit", "--model", a["vit"], "--data", a["data"], "--dtype", "float32", "--no-progress"]
    mae = ["eval", "mae", "--model", a["mae"], "--data", a["data"], "--dtype", "float32", "--no-progress"]
    cal = ["calibrate", "vit", "--model", a["vit"], "--data", a["data"], "--out", b["root"] / "p.json"]
    gen = ["generate", "--model", a["wan"], "--prompt", "x", "--frames", 5, "--steps", 1, "--height", 32,
           "--width", 32, "--no-progress"]
    return {
        "corrupt plan": ([*vit, "--guard-plan", b["root"] / "corrupt.json"], "corrupt.json"),
        "truncated plan": ([*vit, "--guard-plan", b["root"] / "truncated.json"], "truncated.json"),
        "plan of another version": ([*vit, "--guard-plan", b["root"] / "v99.json"], "version 99"),
        "plan of another model": ([*mae, "--guard-plan", b["root"] / "vit_plan.json"], "does not fit this model"),
        "bogus device": ([*vit, "--device", "bogus"], "device: 'bogus' is not a device"),
        "output is a directory": ([*gen, "--output", b["root"] / "a_dir"], "--output:.*is a directory"),
        "--cp that is not a degree": ([*gen, "--cp", "ulysses=two"], "--cp: ulysses must be a whole number"),
        "--cp of another form": ([*gen, "--cp", "tensor=2"], "--cp: expected ulysses=N, ring=N or both"),
        "--cp of one rank": ([*gen, "--cp", "ring=1"], "--cp: 'ring=1' is one rank"),
        "--cp without torchrun": ([*gen, "--cp", "ulysses=2,ring=2"],
                                  "--cp ulysses=2,ring=2: needs 4 processes.*torchrun --nproc-per-node 4"),
        "out-dir is a file": ([*vit, "--out-dir", b["root"] / "a_file"], "--out-dir:.*is a file"),
        "calibrate --fraction 0": ([*cal, "--fraction", 0], "--fraction: expected a number in"),
        "calibrate --threshold nan": ([*cal, "--threshold", "nan"], "argument --threshold: must be a finite number, "
                                                                    "got 'nan'"),
        "calibrate --policy bf16": ([*cal, "--policy", "bf16"], "--policy: 'bf16' is not a Direct-P policy"),
        "a file that is not an image": (["eval", "vit", "--model", a["vit"], "--data", b["data_broken"],
                                         "--dtype", "float32", "--no-progress"], "broken.jpg.*not a readable image"),
        "unknown timm architecture": (["eval", "vit", "--model", "timm:no_such_vit", "--random-weights", "--data",
                                       a["data"]], "'no_such_vit' is not a timm architecture"),
        "--image with a text-to-video model": ([*gen, "--image", a["data"] / "0" / "img0.png", "--output",
                                                b["root"] / "v.mp4"], "image:.*text-to-video model"),
        "eval mae on a ViT classifier": (["eval", "mae", "--model", b["hf_vit"], "--data", a["data"]],
                                         "is a 'vit' model, not a ViTMAE"),
        "eval wan with an unknown baseline": (["eval", "wan", "--speed-only", "1.3B", "--baselines", "fa4,nope",
                                               "--device", "cpu", "--out-dir", b["root"], "--no-progress"],
                                              "baselines: unknown baseline 'nope'"),
        "calibrate mae on a ViT classifier": (["calibrate", "mae", "--model", b["hf_vit"], "--data", a["data"],
                                               "--out", b["root"] / "m.json"], "is a 'vit' model, not a ViTMAE"),
        "eval wan at a GPU's size on the CPU": (["eval", "wan", "--speed-only", "1.3B", "--steps", 2, "--device", "cpu",
                                                "--out-dir", b["root"], "--no-progress"],
                                               "^fp4vis eval wan: error: speed-only 1.3B on the CPU: 81 frames at "
                                               "480x832 are 32760 tokens per sequence.*--device cuda"),
        # issue 33: every option a user can give wrongly, refused before loading with one line naming it
        "plan whose layers are a list": ([*vit, "--guard-plan", b["root"] / "layers_list.json"],
                                         "layers_list.json': layers: expected an object"),
        "plan whose guarded layers are a string": ([*vit, "--guard-plan", b["root"] / "guarded_str.json"],
                                                   "guarded: expected a list of layer names, got the string"),
        "plan whose policy is a name": ([*vit, "--guard-plan", b["root"] / "policy_str.json"],
                                        "policy: expected the policy's fields as an object"),
        "plan with a statistic of 1e999": ([*vit, "--guard-plan", b["root"] / "stat_inf.json"],
                                           "sampled_max_log2: expected a finite number, got inf"),
        "generate --guidance nan": ([*gen, "--guidance", "nan"],
                                    "argument --guidance: must be a finite number, got 'nan'"),
        "generate --guidance -1": ([*gen, "--guidance", "-1"], "argument --guidance: must be a finite number >= 0"),
        "generate --exact-steps beyond --steps": ([*gen, "--exact-steps", "0,5"],
                                                  r"--exact-steps: step 5 does not exist in 1 denoising step"),
        "generate --frames beyond the rotary embedding": ([*gen, "--frames", 100001],
                                                          "--frames: at most 125 for .*rope_max_seq_len"),
        "generate --frames not 4k+1": ([*gen, "--frames", 6], r"--frames: .* needs frames = 4k \+ 1"),
        "generate --height not a multiple of 16": ([*gen, "--height", 72], "--height: must be a multiple of 16 for "),
        "generate --width beyond the rotary embedding": ([*gen, "--width", 528], "--width: at most 512 for "),
        "generate --seed 2**64": ([*gen, "--seed", 2 ** 64], r"argument --seed: must be an integer in \[-2\*\*63"),
        "generate --seed below -2**63": ([*gen, "--seed", -2 ** 63 - 1], "argument --seed: must be an integer in"),
        "calibrate wan --height 40": (["calibrate", "wan", "--model", a["wan"], "--prompt", "x", "--height", 40,
                                       "--out", b["root"] / "w.json"], "--height: must be a multiple of 16"),
        "calibrate --fraction inf": ([*cal, "--fraction", "inf"], "argument --fraction: must be a finite number"),
        "eval wan --latent-steps beyond --steps": (["eval", "wan", "--model", a["wan"], "--steps", 2, "--latent-steps",
                                                    "1,3", "--out-dir", b["root"]], "--latent-steps: 3 steps is not"),
        "eval wan --guidance inf": (["eval", "wan", "--model", a["wan"], "--guidance", "inf", "--out-dir", b["root"]],
                                    "argument --guidance: must be a finite number"),
        "eval wan --speed-only --height 72": (["eval", "wan", "--speed-only", "1.3B", "--height", 72, "--out-dir",
                                               b["root"]], "--height: must be a multiple of 16 for Wan2.1 1.3B"),
        "eval mae --mask-ratio nan": ([*mae, "--mask-ratio", "nan"], "argument --mask-ratio: must be a finite number"),
        "eval mae --mask-ratio 1": ([*mae, "--mask-ratio", 1], r"argument --mask-ratio: must be a number in \(0, 1\)"),
        "eval vit --workers -1": ([*vit, "--workers", -1], "argument --workers: expected an integer >= 0"),
        "--data that is a file": (["eval", "vit", "--model", a["vit"], "--data", b["root"] / "a_file"],
                                  "data: .*a_file' is a file, not a directory"),
        "--labels index on folders of names": (["eval", "vit", "--model", a["vit"], "--data", b["data_names"],
                                                "--labels", "index", "--dtype", "float32", "--no-progress",
                                                "--out-dir", b["root"]],
                                               r"labels=index needs folders named by class index \(0 \.\. 2 for this "
                                               r"3-class model\)"),
    }


CASES = list(_bad_cases({"vit": "", "mae": "", "wan": "", "data": Path(".")},
                        {"root": Path("."), "data_broken": "", "hf_vit": "", "data_names": ""}))


@pytest.mark.parametrize("case", CASES)
def test_user_errors_exit_2_with_one_line(case, assets, bad, cli):
    argv, expected = _bad_cases(assets, bad)[case]
    code, _, err = cli(*argv)
    progress = re.compile(r"\d+%\||it/s\]|s/it\]")   # loading bars of the libraries, not messages
    # the error is one line; before it may stand the one warning a CPU run gives (it runs the reference)
    lines = [line for line in err.splitlines() if line.strip() and not progress.search(line)
             and "no FP4 attention kernel runs on the CPU" not in line]
    assert code == 2, (case, err)
    assert len(lines) == 1 and lines[0].startswith("fp4vis ") and "Traceback" not in err, err
    assert re.search(expected, lines[0]), lines[0]


def test_a_user_error_from_a_dataloader_worker_is_one_line():
    """torch re-raises a worker's UsageError with the worker's traceback in its message; the CLI prints
    the last line only."""
    from fp4vis.cli import one_line
    from fp4vis.services.usage import UsageError

    worker = UsageError("Caught UsageError in DataLoader worker process 0.\nOriginal Traceback (most recent call "
                        "last):\n  File \"x.py\", line 1\nfp4vis.services.usage.UsageError: data: 'b.jpg' is not a "
                        "readable image")
    assert one_line(worker) == "data: 'b.jpg' is not a readable image"
    assert one_line(UsageError("plain message")) == "plain message"
    assert one_line(UsageError("a message\n  over two lines\n")) == "a message over two lines"
