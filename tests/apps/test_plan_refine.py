"""The plan search's steps on a stated fidelity model instead of a pipeline (``fp4vis.evals.plan_search.search``
with runs whose figures are a known sum over the exact (step, layer) cells): the refinement finds a plan that
keeps more attention in FP4 than the simplest one, deterministically and within its budget, skips candidates
that dominance decides, and the ``lower`` statistic asks for a margin. A plan's layers exact in some steps only
(``exact_layer_steps``): the file round trip, and what it does to a run of a tiny Wan pipeline."""

import json
import math

import pytest
import torch

import fp4vis
from fp4vis.evals.attention_time import AttentionTimes
from fp4vis.evals.plan_search import Candidate, FidelityTarget, WanRuns, search
from fp4vis.patching import GuardPlan, GuardPlanError
from fp4vis.patching.discovery import find_layers
from fp4vis.pipelines import wan_video as wv

STEPS = 6
LAYERS = ["l0", "l1", "l2"]
STEP_WEIGHT = [8.0, 4.0, 2.0, 1.0, 0.5, 0.25]   # the drift is made early
LAYER_WEIGHT = {"l0": 1.0, "l1": 3.0, "l2": 1.0}   # l1 the most sensitive


class CellRuns:
    """Runs whose figure per prompt is 10 + the weights of the exact cells (+ the prompt's offset), 1 less under
    the guard policy; they count and record the plans they were asked for."""

    def __init__(self, offsets=(-0.1, 0.0, 0.1)):
        self.prompts = [f"p{i}" for i in range(len(offsets))]
        self.offsets = offsets
        self.policy = fp4vis.get_policy("fast")
        self.settings = wv.GenerationConfig(steps=STEPS)
        self.runs, self.asked = 0, []

    def measure(self, plan: GuardPlan) -> dict[str, list[float]]:
        self.runs += 1
        self.asked.append((sorted(plan.exact_steps), sorted(plan.exact_layers), dict(plan.exact_layer_steps)))
        every = {i % STEPS for i in plan.exact_steps}
        total = sum(STEP_WEIGHT[i] * LAYER_WEIGHT[n] for i in range(STEPS) for n in LAYERS
                    if i in every or n in plan.exact_layers or i in plan.exact_layer_steps.get(n, ()))
        fig = 10.0 + total - (1.0 if plan.guarded else 0.0)
        return {"psnr_db": [fig + o for o in self.offsets], "latent_cosine": [1.0] * len(self.offsets),
                "ssim": [1.0] * len(self.offsets)}


def times() -> AttentionTimes:
    return AttentionTimes(exact=dict.fromkeys(LAYERS, 1.0), fp4={p: dict.fromkeys(LAYERS, 1.1) for p in
                                                                  ("fast", "fast_guard")}, calls=1, source="", units="")


def base() -> GuardPlan:
    fast = fp4vis.get_policy("fast")
    return GuardPlan(model_id="cells", policy=fast, guard_policy=fast, architecture={n: [2, 16] for n in LAYERS})


def run_search(target: FidelityTarget, budget: int = 30, offsets=(-0.1, 0.0, 0.1)):
    runs = CellRuns(offsets)
    return search(runs, target, times(), base(), budget=budget), runs


def test_refinement_keeps_more_fp4_than_the_simplest_plan():
    r, runs = run_search(FidelityTarget("psnr_db", 60.0, "mean"))
    simplest = r.simplest["exact but the last k"]
    # first 2 steps exact: 10 + 5 * 12 = 70 meets, first 1: 50 misses; first 1 + l1 in step 1: 62 meets
    assert simplest.candidate == Candidate(first=2) and simplest.fp4_share == pytest.approx(12 / 18)
    assert r.chosen.candidate == Candidate(first=1, layer_steps=(("l1", 2),))
    assert r.chosen.fp4_share == pytest.approx(14 / 18) and r.chosen.fp4_share > simplest.fp4_share
    assert r.chosen.role == "refinement"
    assert r.plan.exact_steps == [0] and r.plan.exact_layers == [] and r.plan.exact_layer_steps == {"l1": [1]}
    assert r.layer_order == ["l1", "l0", "l2"] and not r.exhausted
    # the refinement ran c = 2 (the largest that could beat the simplest), then c = 1; at a = 0 both candidates
    # were decided without a run (l1 alone in every step, and the first step, missed)
    refined = [m.candidate for m in r.measured if m.role == "refinement"]
    assert refined == [Candidate(first=1, layer_steps=(("l1", 3),)), Candidate(first=1, layer_steps=(("l1", 2),))]
    assert r.runs == runs.runs == 12 == len(r.measured) - 1   # "first 6" is every step exact: no run
    again, _ = run_search(FidelityTarget("psnr_db", 60.0, "mean"))
    assert [m.to_dict() for m in again.measured] == [m.to_dict() for m in r.measured]


def test_budget_bounds_the_search_and_says_so():
    r, runs = run_search(FidelityTarget("psnr_db", 60.0, "mean"), budget=8)
    assert runs.runs == r.runs == 8 and r.exhausted
    assert r.chosen.met and r.chosen.fp4_share == max(m.fp4_share for m in r.measured if m.met)


def test_lower_statistic_asks_for_a_margin():
    spread = (-2.0, 0.0, 2.0)
    mean, _ = run_search(FidelityTarget("psnr_db", 60.0, "mean"), offsets=spread)
    lower, _ = run_search(FidelityTarget("psnr_db", 60.0, "lower"), offsets=spread)
    # 62 +- 2 has its interval's lower end at 62 - 4.303 * 2 / sqrt(3) = 57.0: the margin asks for more exact
    assert mean.chosen.candidate == Candidate(first=1, layer_steps=(("l1", 2),))
    assert lower.chosen.candidate == Candidate(first=1, layer_steps=(("l1", 3),))
    assert lower.chosen.score == pytest.approx(68.0 - 4.302653 * 2 / math.sqrt(3), rel=1e-5)
    assert lower.plan.fidelity["target"]["statistic"] == "lower"
    assert "judged by the lower end of its 95 % interval" in lower.to_dict()["target_text"]
    t = FidelityTarget("psnr_db", 60.0, "lower")
    assert t.estimate == "mean" and t.met_held_out([58.0, 60.0, 62.0]) and not t.met([58.0, 60.0, 62.0])


def test_candidate_cells_label_and_share():
    c = Candidate(first=1, last=1, layer_steps=(("l1", 3),))
    assert c.exact_layer_steps() == {"l1": [1, 2]} and c.label() == "exact: first 1 + last 1 + l1 to step 2"
    assert c.cells(STEPS, LAYERS) == {(0, n) for n in LAYERS} | {(5, n) for n in LAYERS} | {(1, "l1"), (2, "l1")}
    t = AttentionTimes(exact={"l0": 1.0, "l1": 3.0}, fp4={"fast": {"l0": 0.5, "l1": 1.0}}, calls=2, source="",
                       units="ms")
    # 4 steps, step 0 exact, l1 exact in steps 1 and 2 too: FP4 cells 3 x l0 + 1 x l1 = 6 of 16
    assert t.fp4_share(4, {0}, (), {"l1": [1, 2]}) == pytest.approx(6 / 16)
    assert t.run_time(4, {0}, (), "fast", {"l1": [1, 2]}) == pytest.approx(2 * (3 * 0.5 + 1 + 1 * 1.0 + 3 * 3.0))
    assert t.fp4_share(4, {0}, ("l1",), {"l1": [1]}) == pytest.approx(3 / 16)
    # the same number of FP4 cells of equal layers is the same share to the last bit, whichever cells they are
    # (summed in another order, 16 of 48 cells came out 0.33333333333333337 against 0.3333333333333333)
    equal = AttentionTimes(exact=dict.fromkeys("abcd", 0.67108864), fp4={}, calls=2, source="", units="")
    assert equal.fp4_share(12, set(range(8)), ()) == equal.fp4_share(12, set(range(5)), (), {n: [5, 6, 7, 8]
                                                                                             for n in "abc"})


@pytest.fixture(scope="module")
def pipe(tiny_wan):
    p = wv.load_wan_pipeline(str(tiny_wan), device="cpu", dtype="float32")
    p.set_progress_bar_config(disable=True)
    return p


def test_layer_steps_in_a_run_and_the_plan_file(pipe, tmp_path):
    """Every layer exact in steps 0 and 1 through ``exact_layer_steps`` is the plan with those exact steps, bit
    for bit; one layer exact in some steps changes the run; the file keeps them and refuses a bad entry."""
    settings = wv.GenerationConfig(height=32, width=32, frames=5, steps=3, guidance_scale=3.0, backend="reference",
                                   progress=False)
    runs = WanRuns(pipe, ["a red fox"], fp4vis.get_policy("fast"), settings)
    plan0 = base()
    plan0.model_id, plan0.architecture = "", {}
    steps = GuardPlan.from_dict(plan0.to_dict())
    steps.exact_steps = [0, 1]
    names = [s.name for s in find_layers(pipe)[0] if s.default]
    per_layer = GuardPlan.from_dict(plan0.to_dict())
    per_layer.exact_layer_steps = {n: [0, 1] for n in names}
    one = GuardPlan.from_dict(plan0.to_dict())
    one.exact_layer_steps = {names[0]: [0]}
    plain = wv.generate(pipe, runs.common, policy="fast", guard=plan0).latents
    by_steps = wv.generate(pipe, runs.common, policy="fast", guard=steps).latents
    assert torch.equal(wv.generate(pipe, runs.common, policy="fast", guard=per_layer).latents, by_steps)
    one_run = wv.generate(pipe, runs.common, policy="fast", guard=one).latents
    assert not torch.equal(one_run, plain) and not torch.equal(one_run, by_steps)
    path = tmp_path / "plan.json"
    one.save(path)
    assert json.loads(path.read_text())["exact_layer_steps"] == {names[0]: [0]}
    assert GuardPlan.load(path).to_dict() == one.to_dict()
    bad = one.to_dict() | {"exact_layer_steps": {names[0]: [0.5]}}
    with pytest.raises(GuardPlanError, match=r"exact_layer_steps\['.*'\]: expected a list of step indices"):
        GuardPlan.from_dict(bad)
    unknown = GuardPlan.from_dict(one.to_dict())
    unknown.exact_layer_steps = {"transformer.blocks.9.attn1": [0]}
    with pytest.raises(GuardPlanError, match="names layers this model does not have: transformer.blocks.9.attn1"):
        fp4vis.patch(pipe, "fast", guard=unknown, backend="reference")
