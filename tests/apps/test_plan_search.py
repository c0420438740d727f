"""A plan for a fidelity target (``fp4vis.plan``, ``fp4vis calibrate pipeline --target``) on a tiny Wan pipeline
saved and loaded through the real loading code: the search (deterministic, within its budget), the plan file
(round trip, version 2, refused on another model), what a plan does to a run, the time model, and the CLI."""

import json
import math
import statistics
from pathlib import Path

import pytest
import torch
from apps.tiny_models import make_tiny_wan

import fp4vis
from fp4vis.evals.attention_time import FP4_RELATIVE_TIME, AttentionTimes, LayerShape, stated_times
from fp4vis.evals.plan_search import Candidate, FidelityTarget, WanRuns, check_plan, search, search_plan
from fp4vis.patching import GuardPlan, GuardPlanError
from fp4vis.pipelines import wan_video as wv

ROOT = Path(__file__).resolve().parents[2]
SETTINGS = wv.GenerationConfig(height=32, width=32, frames=5, steps=3, guidance_scale=3.0, backend="reference",
                               progress=False)
PROMPTS = ["a red fox", "a blue car"]
TARGET = FidelityTarget("latent_cosine", 0.999999, "mean")   # the search's mechanics, on the plain mean


@pytest.fixture(scope="module")
def pipe(tiny_wan):
    p = wv.load_wan_pipeline(str(tiny_wan), device="cpu", dtype="float32")
    p.set_progress_bar_config(disable=True)
    return p


@pytest.fixture(scope="module")
def searched(pipe):
    return search_plan(pipe, PROMPTS, "fast", TARGET, settings=SETTINGS, budget=5)


def test_targets_parse_and_refuse():
    assert FidelityTarget.parse("psnr=30") == FidelityTarget("psnr_db", 30.0, "lower")
    assert FidelityTarget("psnr_db", 30.0).statistic == "lower"   # the default: a margin for other prompts
    assert FidelityTarget.parse("cosine>=0.99", "worst") == FidelityTarget("latent_cosine", 0.99, "worst")
    t = FidelityTarget("psnr_db", 30.0, "worst")
    assert t.score([31.0, 29.0]) == 29.0 and not t.met([31.0, 29.0])
    assert FidelityTarget("psnr_db", 30.0, "mean").met([31, 29]) and not FidelityTarget("psnr_db", 30.0).met([31, 29])
    for bad, why in (("psnr", "expected METRIC=VALUE"), ("lpips=0.1", "expected METRIC=VALUE"),
                     ("psnr=inf", "finite")):
        with pytest.raises(ValueError, match=why):
            FidelityTarget.parse(bad)
    lower = FidelityTarget("psnr_db", 30.0, "lower")
    assert lower.score([31.0, 29.0, 30.0]) == pytest.approx(30.0 - 4.302653 / math.sqrt(3), rel=1e-4)
    assert lower.score([31.0]) == 31.0
    with pytest.raises(ValueError, match="statistic: expected one of mean, worst, lower"):
        FidelityTarget("psnr_db", 30.0, "median")


def test_search_is_deterministic_and_bounded(pipe, searched):
    r = searched
    assert r.runs <= r.budget == 5
    assert r.chosen.met and r.plan.fidelity["fp4_share"] == r.chosen.fp4_share
    assert r.chosen.fp4_share == max(m.fp4_share for m in r.measured if m.met)
    again = search_plan(pipe, PROMPTS, "fast", TARGET, settings=SETTINGS, budget=5)
    assert [m.to_dict() for m in again.measured] == [m.to_dict() for m in r.measured]
    assert again.plan.exact_steps == r.plan.exact_steps and again.plan.exact_layers == r.plan.exact_layers
    # the first run is the policy everywhere; a candidate is the plan it names
    first = r.measured[0]
    assert first.candidate == Candidate() and first.fp4_share == 1.0
    assert r.plan.exact_steps == r.chosen.candidate.exact_steps()
    assert r.plan.fidelity["num_prompts"] == 2 and r.plan.fidelity["target"]["value"] == 0.999999


def test_a_target_the_policy_meets_keeps_everything_fp4(pipe):
    r = search_plan(pipe, PROMPTS[:1], "fast", "cosine=0.5", settings=SETTINGS, budget=1)
    assert r.runs == 1 and r.chosen.candidate == Candidate() and r.plan.exact_steps == [] and not r.exhausted
    with pytest.raises(ValueError, match="budget: expected at least 1"):
        search(WanRuns(pipe, PROMPTS[:1], fp4vis.get_policy("fast"), SETTINGS), FidelityTarget("ssim", 0.5),
               r.times, r.plan, budget=0)


def test_plan_file_round_trip_and_checks(searched, tmp_path):
    plan = searched.plan
    plan.exact_layers = ["transformer.blocks.1.attn1"]
    path = tmp_path / "plan.json"
    plan.save(path)
    d = json.loads(path.read_text())
    assert d["version"] == 2 and d["exact_steps"] == plan.exact_steps and d["fidelity"]["num_prompts"] == 2
    back = GuardPlan.load(path)
    assert back.to_dict() == plan.to_dict() and back.exact_layers == ["transformer.blocks.1.attn1"]
    for change, why in (
            (lambda d: d.update(version=1), "unknown field 'exact_layers'"),
            (lambda d: d.update(exact_steps=[0.5]), "exact_steps: expected a list of step indices"),
            (lambda d: d["fidelity"]["target"].update(metric="lpips"), "fidelity.target.metric: expected one of"),
            (lambda d: d["fidelity"].update(fp4_share=1.5), "fidelity.fp4_share: expected a fraction"),
            (lambda d: d["fidelity"].pop("num_prompts"), "fidelity: missing field 'num_prompts'")):
        bad = json.loads(path.read_text())
        change(bad)
        with pytest.raises(GuardPlanError, match=why):
            GuardPlan.from_dict(bad)
    plain = GuardPlan(model_id="m", policy=plan.policy, guard_policy=plan.guard_policy)
    assert plain.to_dict()["version"] == 1 and "exact_steps" not in plain.to_dict()   # version-1 readers read it


def test_plan_refuses_another_model(searched, tmp_path):
    other = wv.load_wan_pipeline(str(make_tiny_wan(tmp_path / "other", head_dim=8)), device="cpu", dtype="float32")
    with pytest.raises(GuardPlanError, match="does not fit this model: transformer.blocks.0.attn1 has 2 heads of "
                                             "dim 8 here, 2 of dim 16 in the plan"):
        fp4vis.patch(other, "fast", guard=searched.plan)


def test_what_a_plan_does_to_a_run(pipe, searched):
    """Every step exact, or every layer exact: the BF16 run bit for bit; the plan's steps run through the
    handle's step callback, and a handle removed without it says so."""
    base = GuardPlan.from_dict(searched.plan.to_dict())
    base.exact_steps, base.exact_layers, base.guarded = [], [], []
    runs = WanRuns(pipe, PROMPTS[:1], fp4vis.get_policy("fast"), SETTINGS)
    ref = runs.reference[0]
    steps, layers = (GuardPlan.from_dict(base.to_dict()) for _ in range(2))
    steps.exact_steps = [0, 1, -1]
    layers.exact_layers = list(base.architecture)
    cfg = runs.common
    assert torch.equal(wv.generate(pipe, cfg, policy="fast", guard=steps).latents, ref)
    with pytest.warns(RuntimeWarning, match="none is patched with one"):   # every layer exact: nothing to guard
        assert torch.equal(wv.generate(pipe, cfg, policy="fast", guard=layers).latents, ref)
    assert not torch.equal(wv.generate(pipe, cfg, policy="fast", guard=base).latents, ref)
    handle = fp4vis.patch(pipe, "fast", guard=steps, backend="reference")
    with pytest.warns(RuntimeWarning, match=r"keeps denoising steps \[0, 1, -1\] exact, and this patch ran without "
                                            "its step callback"):
        handle.remove()
    with pytest.warns(RuntimeWarning, match="none is patched with one"):
        handle = fp4vis.patch(pipe, "fast", guard=layers, backend="reference")
    assert set(handle.policies.values()) == {None} and handle.step_callback() is None
    handle.remove()


def test_held_out_check_gives_intervals(pipe, searched):
    held = WanRuns(pipe, ["a green tree", "a cat"], searched.plan.policy, SETTINGS)
    h = check_plan(held, {"plan": searched.plan}, searched.target)
    p = h["plans"]["plan"]
    ci = p["ci95"]["latent_cosine"]
    assert h["num_prompts"] == 2 and ci["n"] == 2 and ci["ci95_low"] <= ci["mean"] <= ci["ci95_high"]
    assert p["met"] == (ci["mean"] >= 0.999999) and h["frames"]["plan"].shape == (2, 5, 32, 32, 3)


def test_time_model():
    shapes = {"a": LayerShape(1, 8, 8, 2, 4), "b": LayerShape(1, 8, 8, 2, 4), "c": LayerShape(1, 16, 16, 2, 4)}
    t = stated_times(shapes, ["fast", "accurate"], calls=2)
    assert t.exact["c"] == 4 * t.exact["a"] and t.fp4["fast"]["a"] == pytest.approx(t.exact["a"] * 1.117)
    assert "accurate take fast's ratio" in t.source
    # 4 steps, step 0 exact, layer c exact: FP4 cells = 3 steps x (a + b) = 3 * 2 of 4 * 6 units
    assert t.fp4_share(4, {0}, {"c"}) == pytest.approx(6 / 24)
    assert t.run_time(4, set(range(4)), (), "fast") == pytest.approx(2 * 4 * 6 * t.exact["a"])
    hand = AttentionTimes(exact={"a": 1.0, "b": 3.0}, fp4={"fast": {"a": 0.5, "b": 1.0}}, calls=1, source="",
                          units="ms")
    assert hand.run_time(2, {1}, {"b"}, "fast") == pytest.approx(4.0 + 0.5 + 3.0)


def test_stated_ratio_is_the_committed_gpu_result():
    rows = json.loads((ROOT / "benchmarks/results/20261203o_h200_kernel_grid.json").read_text())["rows"]
    exact = {r["shape"]: r["ms"] for r in rows if r["backend"] == "sdpa_cudnn"}
    fast = [r["ms"] / exact[r["shape"]] for r in rows if r["backend"] == "hopper" and r["policy"] == "fast"]
    assert len(fast) == 5 and round(statistics.geometric_mean(fast), 3) == FP4_RELATIVE_TIME["fast"]


def test_cli_writes_the_plan_and_its_report(tiny_wan, tmp_path, cli):
    out = tmp_path / "plan.json"
    code, stdout, err = cli("calibrate", "pipeline", "--model", tiny_wan, "--prompt", "a red fox", "--check-prompt",
                            "a cat", "--height", 32, "--width", 32, "--frames", 5, "--steps", 2, "--guidance", 3,
                            "--target", "cosine=0.5", "--budget", 2, "--dtype", "float32", "--out", out,
                            "--no-progress")
    assert code == 0, err
    assert "chosen: exact: none: lower latent_cosine" in stdout and "held out (1 prompts)" in stdout
    for name in ("plan_report.json", "plan_report.md", "plan_report.png"):
        assert (tmp_path / name).is_file()
    report = json.loads((tmp_path / "plan_report.json").read_text())
    assert report["held_out"]["plans"]["plan"]["met"] and report["candidates"][0]["fp4_share"] == 1.0
    assert "| candidate | why measured | FP4 share |" in (tmp_path / "plan_report.md").read_text()
    plan = GuardPlan.load(out)
    assert plan.fidelity["target"] == {"metric": "latent_cosine", "statistic": "lower", "value": 0.5}   # the default
    # generate --guard-plan runs its exact steps (the sidecar says which), and refuses steps the run lacks
    plan.exact_steps = [0, -1]
    plan.save(out)
    video = tmp_path / "v.mp4"
    gen = ("generate", "--model", tiny_wan, "--prompt", "x", "--frames", 5, "--height", 32, "--width", 32,
           "--guard-plan", out, "--output", video, "--no-progress", "--backend", "reference")
    code, _, err = cli(*gen, "--steps", 2)
    assert code == 0, err
    assert json.loads(video.with_suffix(".json").read_text())["exact_steps"] == [0, -1]
    plan.exact_steps = [5]
    plan.save(out)
    code, _, err = cli(*gen, "--steps", 2)
    assert code == 2 and "guard_plan: its exact_steps" in err, err


@pytest.mark.parametrize("extra, why", [
    (["--target", "psnr"], "--target: expected METRIC=VALUE"),
    (["--target", "psnr=30", "--budget", "0"], "argument --budget: expected a positive integer"),
    (["--check-prompt", "a cat"], "--check-prompt: only with --target"),
    (["--budget", "3"], "--budget: only with --target"),
    (["--target", "psnr=30", "--statistic", "median"], "argument --statistic: invalid choice"),
])
def test_cli_errors(tiny_wan, tmp_path, cli, extra, why):
    code, _, err = cli("calibrate", "pipeline", "--model", tiny_wan, "--prompt", "a red fox", "--out",
                       tmp_path / "p.json", *extra)
    assert code == 2 and why in err, err
    assert len([ln for ln in err.splitlines() if "error" in ln]) == 1 and "Traceback" not in err
    assert not (tmp_path / "p.json").exists()


def test_cli_target_only_for_video_pipelines(tmp_path, cli):
    code, _, err = cli("calibrate", "vit", "--model", "x", "--data", tmp_path, "--target", "psnr=30")
    assert code == 2 and "unrecognized arguments: --target" in err


def test_fp4vis_plan_is_the_search(pipe):
    p = fp4vis.plan(pipe, PROMPTS[:1], "fast", "cosine=0.5", settings=SETTINGS, budget=1)
    assert isinstance(p, GuardPlan) and p.fidelity["fp4_share"] == 1.0 and math.isfinite(p.fidelity["measured"]
                                                                                            ["mean_latent_cosine"])
