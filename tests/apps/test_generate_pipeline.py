"""``fp4vis generate`` and ``fp4vis calibrate pipeline`` on a diffusers pipeline other than Wan's: a tiny random
FluxPipeline saved here (CPU, FP4 on the reference backend), its plan loaded by generate and eval pipeline, and
the one-line errors of the options it does not take."""

import dataclasses
import json
import os
import re
import subprocess
import sys

import numpy as np
import pytest
from apps.tiny_models import make_tiny_flux
from PIL import Image

from fp4vis.pipelines.diffusers_generate import PipelineCall, is_wan, run_pipeline_generate
from fp4vis.pipelines.wan_generate import GenerateOptions
from fp4vis.services.usage import UsageError

SIZE = ["--height", 32, "--width", 32]


@pytest.fixture(scope="module")
def tiny_flux(tmp_path_factory):
    return make_tiny_flux(tmp_path_factory.mktemp("generic") / "flux")


def test_the_call_is_read_from_the_pipeline_class(tiny_flux, tiny_wan):
    assert is_wan(str(tiny_wan)) and not is_wan(str(tiny_flux))
    call = PipelineCall.of("FluxPipeline")
    assert call.kind == "image" and call.default("num_inference_steps") == 28
    assert call.arguments(height=32, width=None, steps=2) == {"height": 32, "num_inference_steps": 2}
    assert PipelineCall.of("WanPipeline").kind == "video"


@pytest.fixture
def patches(monkeypatch):
    """The patches applied meanwhile: (keyword arguments, the handle's layers) of each ``fp4vis.patch``."""
    from fp4vis.services import policies

    applied, patch = [], policies.patch

    def spy(model, **kwargs):
        handle = patch(model, **kwargs)
        applied.append((kwargs, dict(handle.layers)))
        return handle
    monkeypatch.setattr(policies, "patch", spy)
    return applied


def test_generate_an_image_then_calibrate_and_use_the_plan(tiny_flux, tmp_path, cli, patches):
    png = tmp_path / "fox.png"
    code, out, err = cli("generate", "--model", tiny_flux, "--prompt", "a red fox in the snow", *SIZE,
                         "--steps", 2, "--seed", 3, "--exact-steps", "0", "--dtype", "float32", "--device", "cpu",
                         "--backend", "reference", "--output", png)
    assert code == 0, err
    assert f"image: {png}" in out and re.search(r"timings: load .* text .* denoise .* decode", out), out
    said = [line for line in err.splitlines() if line.startswith("generate:")]
    assert said == [f'generate: {tiny_flux} (FluxPipeline), "a red fox in the snow", height 32, width 32, steps 2 '
                    "(the rest: the pipeline's defaults), seed 3; attention: fast, reference, exact attention in "
                    f"steps 0 -> {png}"], err
    image = np.asarray(Image.open(png))
    assert image.shape == (32, 32, 3) and image.std() > 0
    side = json.loads(png.with_suffix(".json").read_text())
    assert side["pipeline"] == "FluxPipeline" and side["kind"] == "image" and side["image"] == str(png)
    assert (side["seed"], side["steps"], side["height"], side["width"], side["frames"]) == (3, 2, 32, 32, None)
    assert side["guidance_scale"] == 3.5 and side["policy"] == "fast" and side["exact_steps"] == [0]   # Flux's own
    assert side["call_arguments"] == {"height": 32, "width": 32, "num_inference_steps": 2}
    assert all(side["timings"][k] >= 0 for k in ("load_s", "text_encode_s", "denoise_s", "decode_s", "total_s"))
    assert side["environment"]["versions"]["diffusers"] and side["guard_plan"] is None
    (kwargs, layers), = patches   # the policy reached both of the transformer's attention layers
    assert kwargs["policy"].name == "fast" and kwargs["guard"] is None and len(layers) == 2
    assert all(state is not None for state in layers.values())

    plan = tmp_path / "plan.json"
    code, out, err = cli("calibrate", "pipeline", "--model", tiny_flux, "--prompt", "a red fox",
                         "--prompt", "a blue dog", *SIZE, "--steps", 1, "--dtype", "float32", "--device", "cpu",
                         "--out", plan, "--no-progress")
    assert code == 0, err
    assert f"guard plan: {plan}" in out
    layers = json.loads(plan.read_text())["layers"]
    assert len(layers) == 2 and all(name.startswith("transformer.") for name in layers)

    again = tmp_path / "guarded.png"
    code, out, err = cli("generate", "--model", tiny_flux, "--prompt", "a red fox", *SIZE, "--steps", 1,
                         "--dtype", "float32", "--device", "cpu", "--backend", "reference", "--guard-plan", plan,
                         "--output", again, "--no-progress")
    assert code == 0, err
    side = json.loads(again.with_suffix(".json").read_text())
    assert side["guard_plan"] == str(plan) and set(side["guard_plan_content"]["layers"]) == set(layers)
    assert patches[-1][0]["guard"] is not None and set(patches[-1][1]) == set(layers)
    code, out, err = cli("eval", "pipeline", "--model", tiny_flux, *SIZE, "--steps", 2, "--no-warmup",
                         "--dtype", "float32", "--device", "cpu", "--backend", "reference", "--guard-plan", plan,
                         "--out-dir", tmp_path / "eval", "--no-progress")
    assert code == 0, err
    result = json.loads((tmp_path / "eval" / "pipeline_fidelity.json").read_text())
    assert result["guard_plan"]["layers"].keys() == layers.keys() and result["runs"]["fast"]["latent_cosine"] < 1


def test_generate_under_torchrun_with_cp_writes_what_one_process_writes(tiny_flux, tmp_path, cli):
    """``torchrun --nproc-per-node 2 -m fp4vis.cli generate ... --cp ulysses=2`` on the CPU (gloo): the FLUX
    transformer under diffusers' context parallelism, FP4 in both layers, and rank 0 writes the image one process
    writes, bit for bit (rank 1 gets the same arguments and writes nothing)."""
    args = ["generate", "--model", tiny_flux, "--prompt", "a red fox", *SIZE, "--steps", 2, "--dtype", "float32",
            "--device", "cpu", "--backend", "reference"]
    one = tmp_path / "one.png"
    code, _, err = cli(*args, "--output", one, "--no-progress")
    assert code == 0, err
    two = tmp_path / "cp" / "fox.png"
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                           "-m", "fp4vis.cli", *map(str, args), "--output", str(two), "--cp", "ulysses=2"],
                          capture_output=True, text=True, timeout=600, env=env)
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert f"image: {two}" in proc.stdout and proc.stdout.count("image: ") == 1, proc.stdout
    # rank 0 alone says it (counted in the whole stream: two processes share the pipe, so a line of one may start
    # after a part of the other's)
    said = "attention: fast, reference; context parallelism ulysses=2 over 2 processes"
    assert proc.stderr.count(said) == 1, proc.stderr[-4000:]
    assert "keeps exact attention" not in proc.stderr, proc.stderr
    assert np.array_equal(np.asarray(Image.open(two)), np.asarray(Image.open(one)))
    assert sorted(p.name for p in two.parent.iterdir()) == ["fox.json", "fox.png"]
    side = json.loads(two.with_suffix(".json").read_text())
    assert side["context_parallel"] == {"ulysses": 2, "ring": 1, "world_size": 2} and side["policy"] == "fast"
    assert json.loads(one.with_suffix(".json").read_text())["context_parallel"] is None


def test_settings_not_given_are_the_pipelines_defaults(tiny_flux, tmp_path, cli):
    """No size and no guidance given: FluxPipeline's own (128 x 128 from its default_sample_size, guidance 3.5);
    the default output is image.png in the working folder."""
    code, out, err = cli("generate", "--model", tiny_flux, "--prompt", "a cat", "--steps", 1, "--policy",
                         "bf16", "--dtype", "float32", "--device", "cpu", "--output", tmp_path / "cat.png",
                         "--no-progress")
    assert code == 0, err
    side = json.loads((tmp_path / "cat.json").read_text())
    assert (side["height"], side["width"], side["guidance_scale"]) == (128, 128, 3.5)
    assert side["call_arguments"] == {"num_inference_steps": 1}


def test_a_video_pipeline_writes_an_mp4(tiny_wan, tmp_path):
    """The same path on a video pipeline (a Wan one, which the CLI gives to wan_generate instead): its frames as
    an MP4, at 16 fps (WanPipeline's call has no frame_rate)."""
    config = GenerateOptions(str(tiny_wan), "a red fox", output=tmp_path / "fox.mp4", height=32, width=32, frames=5,
                            steps=2, device="cpu", dtype="float32", backend="reference", progress=False)
    out = run_pipeline_generate(config)
    assert out["kind"] == "video" and out["output"].stat().st_size > 0
    side = json.loads(out["sidecar"].read_text())
    assert (side["frames"], side["height"], side["fps"], side["guidance_scale"]) == (5, 32, 16, 5.0)
    assert side["video"] == str(tmp_path / "fox.mp4") and side["call_arguments"]["num_frames"] == 5
    with pytest.raises(UsageError, match="--output: WanPipeline makes a video, written as MP4"):
        run_pipeline_generate(dataclasses.replace(config, output=tmp_path / "fox.png"))


@pytest.mark.parametrize("argv, expected", [
    (["--output", "fox.mp4"], r"--output: FluxPipeline makes an image, written as PNG: give a path ending in \.png"),
    (["--frames", 5], "--frames: FluxPipeline is an image pipeline whose call takes no num_frames"),
    (["--fps", 8], "--fps: FluxPipeline is an image pipeline"),
    (["--cp", "ulysses=2"], r"--cp ulysses=2: needs 2 processes, one per GPU; launch with torchrun"),
    (["--image", "cat.png"], r"--image: image-to-video conditioning is for Wan2.1 pipelines"),
    (["--exact-steps", "0,5", "--steps", 2], "--exact-steps: step 5 does not exist in 2 denoising steps"),
])
def test_options_the_pipeline_does_not_take_are_one_line(tiny_flux, tmp_path, cli, argv, expected):
    code, _, err = cli("generate", "--model", tiny_flux, "--prompt", "x", "--device", "cpu",
                       *[tmp_path / a if a in ("fox.mp4", "cat.png") else a for a in argv])
    lines = [line for line in err.splitlines() if line.strip()]
    assert code == 2 and len(lines) == 1 and lines[0].startswith("fp4vis generate: error: "), err
    assert re.search(expected, lines[0]), lines[0]
    assert not list(tmp_path.iterdir())   # refused before anything was written


def test_calibrate_pipeline_refuses_what_the_call_does_not_take(tiny_flux, tmp_path, cli):
    code, _, err = cli("calibrate", "pipeline", "--model", tiny_flux, "--prompt", "x", "--frames", 5,
                       "--out", tmp_path / "plan.json")
    assert code == 2 and err.strip() == ("fp4vis calibrate pipeline: error: --frames: FluxPipeline is an image "
                                         "pipeline whose call takes no num_frames"), err
