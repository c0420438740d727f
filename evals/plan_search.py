"""A plan that keeps the picture: which denoising steps and layers stay exact for a fidelity target
(``fp4vis.plan``, ``fp4vis calibrate pipeline --target``).

The user names a target against BF16 on their prompts (``FidelityTarget``: latent cosine, frames' PSNR or SSIM,
of the mean over prompts, of the worst prompt, or the mean judged by the lower end of its 95 % interval over the
prompts: a margin for prompts the plan was not chosen on). A candidate plan (``Candidate``) keeps the first
``first`` and the last ``last`` denoising steps exact (every layer), layers exact in every step
(``exact_layers``), layers exact up to a later step (``layer_steps``: layer ``l`` exact in steps ``first .. t-1``),
and runs every other (step, layer) cell under the policy, or under the guard policy where that measured better.
Each candidate's fidelity is measured by running the pipeline on the prompts (``WanRuns``: one batched run, the
same initial noise and prompt embeddings as the BF16 run); its FP4 share of attention time comes from the time
model of ``fp4vis.evals.attention_time`` (measured on a GPU, stated on the CPU).

The search (``search``), deterministic and bounded by ``budget`` pipeline runs besides BF16's:

1. the policy on every layer and step; then (``guard=True``) the guard policy on every layer: the better of the
   two runs the FP4 cells of every later candidate;
2. layer sensitivity: each layer exact alone (all steps), the others FP4; the layers ranked by how much that
   one layer raises the target's figure (ties: model order);
3. the simplest plans: all steps exact but the last k (``first = N - k``), and all but the first k
   (``last = N - k``), each family's largest k that meets the target by bisection;
4. refinement (``_Search.refine``), between the simplest plan of step 3, the first ``A`` steps exact, and the
   first ``A - 1`` (which misses): for ``a = A - 1, A - 2, ...`` steps exact from the start and
   ``j = 1 .. L - 1`` of the most sensitive layers (step 2's order), those ``j`` layers kept exact ``c`` steps
   longer (to the last step at most: then exact in every step). At each ``(a, j)`` the largest ``c`` whose FP4
   share still beats the best plan found is run first; where it misses, no smaller ``c`` can meet, where it meets,
   a bisection finds the fewest ``c`` that meets. The refinement ends after ``a = 0``, or when the budget is
   spent; at the lower levels most candidates are decided without a run (below).

Fidelity is taken to grow with what stays exact: a candidate whose exact cells are a subset of a measured
candidate's that missed misses too, and one whose exact cells hold a measured candidate's that met meets too
(neither is run). The plan is the candidate measured to meet the target with the largest FP4 share (ties: the
higher figure). When the budget runs out first, the plan is the best measured so far (at worst: every step
exact), and the result says so.
"""

from __future__ import annotations

import dataclasses
import math
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from fp4vis.evals.attention_time import AttentionTimes, LayerShape, attention_times
from fp4vis.evals.common import error_metrics, frame_metrics
from fp4vis.patching import GuardPlan, GuardPlanError
from fp4vis.patching.discovery import find_layers, model_id
from fp4vis.patching.guard_plan import TARGET_METRICS, TARGET_STATISTICS, check_target
from fp4vis.pipelines.wan_sizes import tokens_per_frame_sequence
from fp4vis.pipelines.wan_video import GenerationConfig, decode_clips, encode_prompt, generate, initial_latents
from fp4vis.policy import Policy, get_policy, guard_policy_for_heads

DEFAULT_BUDGET = 24
METRIC_NAMES = {"psnr": "psnr_db", "psnr_db": "psnr_db", "cosine": "latent_cosine", "latent_cosine": "latent_cosine",
                "cos": "latent_cosine", "ssim": "ssim"}


@dataclass(frozen=True)
class FidelityTarget:
    """``metric`` (latent_cosine, psnr_db, ssim) of the run against BF16's, its ``statistic`` over the prompts
    (``lower``, the default: the lower end of the mean's 95 % Student-t interval, a margin for prompts the plan was
    not chosen on, one prompt: its figure; ``mean``; ``worst``: the lowest prompt's) at least ``value``."""

    metric: str
    value: float
    statistic: str = "lower"

    def __post_init__(self) -> None:
        try:
            check_target("target", self.to_dict())
        except GuardPlanError as exc:
            raise ValueError(str(exc)) from None

    @classmethod
    def parse(cls, text: str, statistic: str = "lower") -> FidelityTarget:
        """``psnr=30``, ``psnr>=30``, ``cosine=0.99``, ``ssim=0.95`` (metric names: ``METRIC_NAMES``)."""
        m = re.fullmatch(r"\s*([a-z_]+)\s*(?:>=|=)\s*(\S+?)\s*", str(text))
        if m is None or m.group(1) not in METRIC_NAMES:
            raise ValueError(f"target: expected METRIC=VALUE with METRIC one of psnr, cosine, ssim (e.g. psnr=30), "
                             f"got {text!r}")
        try:
            value = float(m.group(2))
        except ValueError:
            raise ValueError(f"target: {m.group(2)!r} is not a number") from None
        if not math.isfinite(value):
            raise ValueError(f"target: expected a finite value, got {m.group(2)!r}")
        return cls(METRIC_NAMES[m.group(1)], value, statistic)

    def score(self, per_prompt: Sequence[float]) -> float:
        if self.statistic == "lower":
            from fp4vis.evals.report import mean_ci95

            ci = mean_ci95(list(per_prompt))
            return float(ci["ci95_low"] if ci["ci95_low"] is not None else ci["mean"])
        return float(np.mean(per_prompt)) if self.statistic == "mean" else float(np.min(per_prompt))

    def met(self, per_prompt: Sequence[float]) -> bool:
        return self.score(per_prompt) >= self.value

    @property
    def estimate(self) -> str:
        """The statistic the target is about: ``lower`` bounds the mean, and the mean is what prompts the plan was
        not chosen on are checked on (``check_plan``)."""
        return "mean" if self.statistic == "lower" else self.statistic

    def met_held_out(self, per_prompt: Sequence[float]) -> bool:
        return dataclasses.replace(self, statistic=self.estimate).met(per_prompt)

    def describe(self) -> str:
        if self.statistic == "lower":
            return (f"mean {self.metric} >= {self.value:g} against BF16, judged by the lower end of its 95 % "
                    f"interval over the prompts")
        return f"{self.statistic} {self.metric} >= {self.value:g} against BF16"

    def to_dict(self) -> dict[str, Any]:
        return {"metric": self.metric, "statistic": self.statistic, "value": self.value}


@dataclass(frozen=True)
class Candidate:
    """Steps ``0 .. first-1`` and the last ``last`` steps exact; ``exact_layers`` exact in every step;
    ``layer_steps``: (layer, t) pairs, the layer exact in steps ``first .. t-1`` too; the other cells under the
    policy (``guard``: under the guard policy)."""

    first: int = 0
    last: int = 0
    exact_layers: tuple[str, ...] = ()
    guard: bool = False
    layer_steps: tuple[tuple[str, int], ...] = ()

    def exact_steps(self) -> list[int]:
        return [*range(self.first), *range(-self.last, 0)]

    def exact_layer_steps(self) -> dict[str, list[int]]:
        return {name: list(range(self.first, t)) for name, t in self.layer_steps if t > self.first}

    def cells(self, steps: int, layers: Sequence[str]) -> frozenset[tuple[int, str]]:
        """The exact (step, layer) cells of a run of ``steps`` steps over ``layers``."""
        every = {i % steps for i in self.exact_steps()}
        more = self.exact_layer_steps()
        return frozenset((i, n) for i in range(steps) for n in layers
                         if i in every or n in self.exact_layers or i in more.get(n, ()))

    def label(self) -> str:
        layers = ", ".join(n.removeprefix("transformer.") for n in self.exact_layers)
        until = ", ".join(f"{n.removeprefix('transformer.')} to step {t - 1}" for n, t in self.layer_steps)
        parts = [f"first {self.first}" if self.first else "", f"last {self.last}" if self.last else "",
                 f"layers {layers}" if self.exact_layers else "", until]
        text = " + ".join(p for p in parts if p) or "none"
        return f"exact: {text}{' (guard)' if self.guard else ''}"


@dataclass
class Measured:
    """A candidate's per-prompt figures against BF16, its FP4 share and predicted attention time."""

    candidate: Candidate
    per_prompt: dict[str, list[float]]
    fp4_share: float
    attention_time: float
    relative_time: float = 1.0   # attention_time / the all-exact run's
    role: str = "search"
    score: float = 0.0
    met: bool = False

    def to_dict(self) -> dict[str, Any]:
        c = self.candidate
        return {"label": c.label(), "role": self.role, "first": c.first, "last": c.last,
                "exact_layers": list(c.exact_layers), "guard": c.guard, "exact_steps": c.exact_steps(),
                "exact_layer_steps": c.exact_layer_steps(),
                "fp4_share": self.fp4_share, "predicted_attention_time": self.attention_time,
                "predicted_attention_time_vs_exact": self.relative_time, "score": self.score,
                "met": self.met, "mean": {k: float(np.mean(v)) for k, v in self.per_prompt.items()},
                "worst": {k: float(np.min(v)) for k, v in self.per_prompt.items()}, "per_prompt": self.per_prompt}


class WanRuns:
    """The prompts' batched runs of a Wan pipeline (``fp4vis.pipelines.wan_video.generate``): BF16 once, then
    any candidate, each measured against it per prompt (latent cosine after all steps; frames' PSNR and SSIM,
    torchmetrics, the mean over frames). Prompt i starts from seed ``settings.seed + i``."""

    def __init__(self, pipe, prompts: Sequence[str], policy: Policy, settings: GenerationConfig):
        if type(pipe).__name__ not in ("WanPipeline",):
            raise ValueError(f"fp4vis.plan: searches Wan text-to-video pipelines (WanPipeline) for now, got "
                             f"{type(pipe).__name__}")
        if not prompts:
            raise ValueError("prompts: give at least one prompt")
        self.pipe, self.prompts, self.policy, self.settings = pipe, list(prompts), policy, settings
        n = len(self.prompts)
        pe, npe, _ = encode_prompt(pipe, list(self.prompts), guidance_scale=settings.guidance_scale)
        latents = torch.cat([initial_latents(pipe, height=settings.height, width=settings.width,
                                             frames=settings.frames, seed=settings.seed + i) for i in range(n)])
        self.common = dataclasses.replace(settings, prompt=None, prompt_embeds=pe, negative_prompt_embeds=(
            npe.expand(n, -1, -1).contiguous() if npe is not None else None), latents=latents, decode=False,
            exact_steps=None, latents_after=(), layers=None, guard=None)
        self.reference = self._generate(get_policy("bf16"), None)
        self.frames = self.reference[1]   # the frames of the last run (N, F, H, W, 3) in [0, 1]
        self.runs = 0

    def _generate(self, policy: Policy, guard: GuardPlan | None) -> tuple[torch.Tensor, np.ndarray]:
        res = generate(self.pipe, self.common, policy=policy, guard=guard)
        self.frames = decode_clips(self.pipe, res.latents)
        return res.latents, self.frames

    def measure(self, plan: GuardPlan) -> dict[str, list[float]]:
        """One pipeline run under ``plan``: the per-prompt figures against BF16."""
        self.runs += 1
        latents, frames = self._generate(self.policy, plan)
        cosine, _ = error_metrics()
        ref_latents, ref_frames = self.reference
        out: dict[str, list[float]] = {m: [] for m in TARGET_METRICS}
        for i in range(len(self.prompts)):
            fm = frame_metrics(frames[i], ref_frames[i])
            out["latent_cosine"].append(cosine(latents[i], ref_latents[i]))
            out["psnr_db"].append(min(fm["psnr_mean"], 100.0))   # identical frames: 100 dB, not inf
            out["ssim"].append(fm["ssim_mean"])
        return out

    def layer_shapes(self, names: Sequence[str], specs: Sequence[Any]) -> dict[str, LayerShape]:
        """Each patched layer's call: self-attention over the video tokens, per batch element and guidance pass."""
        s = self.settings
        tokens = tokens_per_frame_sequence(self.pipe, height=s.height, width=s.width, frames=s.frames)
        by_name = {sp.name: sp for sp in specs}
        return {n: LayerShape(len(self.prompts), tokens, tokens, by_name[n].num_heads, by_name[n].head_dim)
                for n in names}


@dataclass
class SearchResult:
    """What ``search`` found: the plan, the candidates measured (in order), and how the search ended."""

    plan: GuardPlan
    chosen: Measured
    measured: list[Measured]
    target: FidelityTarget
    times: AttentionTimes
    layer_order: list[str]
    runs: int
    budget: int
    exhausted: bool
    steps: int
    simplest: dict[str, Measured | None] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        return {"target": self.target.to_dict(), "target_text": self.target.describe(), "steps": self.steps,
                "runs": self.runs, "budget": self.budget, "budget_exhausted": self.exhausted,
                "layer_order": self.layer_order, "time_model": self.times.to_dict(),
                "chosen": self.chosen.to_dict(), "candidates": [m.to_dict() for m in self.measured],
                "simplest": {k: (m.to_dict() if m is not None else None) for k, m in self.simplest.items()},
                "plan": self.plan.to_dict()}


class _Search:
    """The state of one search: the runs, the time model, what is measured (``search``'s steps)."""

    def __init__(self, runs: WanRuns, target: FidelityTarget, times: AttentionTimes, base: GuardPlan, budget: int,
                 say: Callable[[str], Any]):
        self.runs, self.target, self.times, self.base, self.budget, self.say = runs, target, times, base, budget, say
        self.steps = runs.settings.steps
        self.measured: dict[Candidate, Measured] = {}
        self.policy_name = runs.policy.name

    def plan_of(self, c: Candidate, fidelity: dict[str, Any] | None = None) -> GuardPlan:
        plan = GuardPlan.from_dict(self.base.to_dict())
        plan.guarded = [n for n in self.times.exact if n not in c.exact_layers] if c.guard else []
        plan.exact_layers, plan.exact_steps, plan.fidelity = list(c.exact_layers), c.exact_steps(), fidelity
        plan.exact_layer_steps = c.exact_layer_steps()
        return plan

    def share(self, c: Candidate) -> float:
        return self.times.fp4_share(self.steps, set(i % self.steps for i in c.exact_steps()), c.exact_layers,
                                    c.exact_layer_steps())

    def cells(self, c: Candidate) -> frozenset[tuple[int, str]]:
        return c.cells(self.steps, list(self.times.exact))

    @property
    def left(self) -> int:
        return self.budget - self.runs.runs

    def measure(self, c: Candidate, role: str = "search") -> Measured:
        if c.first + c.last >= self.steps:   # every step exact: BF16 itself, no run needed
            c = Candidate(first=self.steps)
        if c in self.measured:
            return self.measured[c]
        if c.first >= self.steps:
            per = {"latent_cosine": [1.0] * len(self.runs.prompts), "psnr_db": [100.0] * len(self.runs.prompts),
                   "ssim": [1.0] * len(self.runs.prompts)}
        else:
            per = self.runs.measure(self.plan_of(c))
        policy = self.base.guard_policy.name if c.guard else self.policy_name
        time = self.times.run_time(self.steps, set(i % self.steps for i in c.exact_steps()), c.exact_layers, policy,
                                   c.exact_layer_steps())
        m = Measured(c, per, self.share(c), time, time / self.times.run_time(self.steps, range(self.steps), (),
                                                                             self.policy_name), role=role)
        m.score, m.met = self.target.score(per[self.target.metric]), self.target.met(per[self.target.metric])
        self.measured[c] = m
        self.say(f"  {role}, {c.label()}: {self.target.statistic} {self.target.metric} {m.score:.6g} "
                 f"({'meets' if m.met else 'misses'} the target), FP4 share {m.fp4_share:.3f}")
        return m

    def known(self, c: Candidate) -> bool | None:
        """Whether ``c`` meets the target, from what is measured: its own run, a measured candidate that missed
        it and keeps every cell ``c`` keeps exact (then ``c`` misses too), or one that met it and keeps no cell
        exact that ``c`` does not (then ``c`` meets too); None where a run must say."""
        if c.first + c.last >= self.steps:
            return True
        if c in self.measured:
            return self.measured[c].met
        mine = self.cells(c)
        for m in self.measured.values():
            if m.candidate.guard == c.guard and (mine <= self.cells(m.candidate) if not m.met
                                                 else mine >= self.cells(m.candidate)):
                return m.met
        return None

    def meets(self, c: Candidate, role: str) -> bool | None:
        """``known``, else a run; None when the budget is spent."""
        if (k := self.known(c)) is not None:
            return k
        return self.measure(c, role).met if self.left > 0 else None

    def best_share(self) -> float:
        return max(m.fp4_share for m in self.measured.values() if m.met)

    def refine(self, order: Sequence[str], guard: bool, top: int) -> bool:
        """Step 4 of the module docstring, below ``top`` steps exact from the start (which meets the target);
        False when the budget ran out."""
        for a in range(top - 1, -1, -1):
            for j in range(1, len(order)):
                def cand(c: int, a: int = a, j: int = j) -> Candidate:
                    if a + c >= self.steps:   # exact to the last step: exact in every step
                        return Candidate(first=a, exact_layers=tuple(order[:j]), guard=guard)
                    return Candidate(first=a, layer_steps=tuple((n, a + c) for n in order[:j]), guard=guard)

                allowed = [c for c in range(1, self.steps - a + 1) if self.share(cand(c)) > self.best_share()]
                if not allowed:
                    continue
                lo, hi = allowed[0], allowed[-1]
                if (met := self.meets(cand(hi), "refinement")) is None:
                    return False
                if not met:
                    continue
                while lo < hi:   # (hi) meets: the fewest c that meets
                    mid = (lo + hi) // 2
                    if (met := self.meets(cand(mid), "refinement")) is None:
                        return False
                    lo, hi = (lo, mid) if met else (mid + 1, hi)
        return True

    def bisect(self, family: Callable[[int], Candidate], role: str) -> Measured | None:
        """The family's member with the largest k (FP4 steps) that meets the target, by bisection over
        k in 0..N (k = 0: every step exact, which meets it)."""
        lo, hi = 0, self.steps
        best = self.measure(family(0), role)   # every step exact: BF16 itself, no run
        while lo < hi and self.left > 0:
            k = (lo + hi + 1) // 2
            m = self.measure(family(k), role)
            if m.met:
                lo, best = k, m
            else:
                hi = k - 1
        return best


def search(runs: WanRuns, target: FidelityTarget, times: AttentionTimes, base: GuardPlan, *,
           budget: int = DEFAULT_BUDGET, guard: bool = True, say: Callable[[str], Any] = lambda s: None
           ) -> SearchResult:
    """The search of the module docstring, on ``runs``' prompts; ``base``: a plan with the model's fingerprint."""
    if budget < 1:
        raise ValueError(f"budget: expected at least 1 pipeline run, got {budget}")
    s = _Search(runs, target, times, base, budget, say)
    layers = list(times.exact)
    n = s.steps
    fp4 = s.measure(Candidate(), "policy everywhere")
    use_guard = False
    if guard and s.left > 0 and not fp4.met:
        g = s.measure(Candidate(guard=True), "guard everywhere")
        use_guard = g.score > fp4.score
    base_c = Candidate(guard=use_guard)
    gain = {}
    for name in layers:
        if s.left <= 0 or s.measured[base_c].met:
            break
        gain[name] = s.measure(dataclasses.replace(base_c, exact_layers=(name,)), "layer sensitivity").score
    order = sorted(layers, key=lambda nm: (-gain.get(nm, -math.inf), layers.index(nm)))
    simplest = {"exact but the last k": s.bisect(lambda k: Candidate(first=n - k, guard=use_guard), "simplest"),
                "exact but the first k": s.bisect(lambda k: Candidate(last=n - k, guard=use_guard), "simplest")}
    exhausted = s.left <= 0 and not s.measured[base_c].met
    if not s.measured[base_c].met and not exhausted:
        exhausted = not s.refine(order, use_guard, simplest["exact but the last k"].candidate.first)
    passing = [m for m in s.measured.values() if m.met]
    chosen = max(passing, key=lambda m: (m.fp4_share, m.score))
    fidelity = {"target": target.to_dict(), "measured": {f"{st}_{k}": float(fn(v)) for k, v in
                                                         chosen.per_prompt.items()
                                                         for st, fn in (("mean", np.mean), ("worst", np.min))},
                "num_prompts": len(runs.prompts), "fp4_share": chosen.fp4_share, "time_model": times.source,
                "predicted_attention_time": chosen.attention_time, "steps": n, "candidates": len(s.measured),
                "runs": runs.runs, "method": "fp4vis.evals.plan_search (module docstring)"}
    plan = s.plan_of(chosen.candidate, fidelity)
    return SearchResult(plan=plan, chosen=chosen, measured=list(s.measured.values()), target=target, times=times,
                        layer_order=order, runs=runs.runs, budget=budget, exhausted=exhausted, steps=n,
                        simplest=simplest)


def check_plan(runs: WanRuns, plans: dict[str, GuardPlan], target: FidelityTarget) -> dict[str, Any]:
    """The check that matters: each plan run on ``runs``' prompts (held out: not those it was chosen on), its
    per-prompt figures against BF16, the mean with its 95 % Student-t interval, the worst prompt, and whether the
    target is met (of a ``lower`` target: whether the mean meets it, ``FidelityTarget.estimate``); ``frames``: each
    run's decoded clips, for a reader."""
    from fp4vis.evals.report import mean_ci95

    out: dict[str, Any] = {"target": target.to_dict(), "num_prompts": len(runs.prompts), "plans": {}, "frames": {}}
    out["frames"]["bf16"] = runs.reference[1]
    for label, p in plans.items():
        per = runs.measure(p)
        out["frames"][label] = runs.frames
        out["plans"][label] = {
            "exact_steps": list(p.exact_steps), "exact_layers": list(p.exact_layers), "guarded": list(p.guarded),
            "per_prompt": per, "ci95": {k: mean_ci95(v) for k, v in per.items()},
            "worst": {k: float(np.min(v)) for k, v in per.items()},
            "score": target.score(per[target.metric]), "met": target.met_held_out(per[target.metric])}
    return out


def base_plan(pipe, policy: Policy) -> tuple[GuardPlan, list[Any]]:
    """An empty plan with the pipeline's fingerprint (every reachable attention layer), and its default layers."""
    specs, _ = find_layers(pipe)
    default = [s for s in specs if s.default]
    if not default:
        raise ValueError(f"fp4vis.plan: {type(pipe).__name__} has no attention layer fp4vis patches by default")
    plan = GuardPlan(model_id=model_id(pipe), policy=policy, guard_policy=guard_policy_for_heads(default[0].num_heads),
                     architecture={s.name: [s.num_heads, s.head_dim] for s in specs})
    return plan, default


def search_plan(pipe, prompts: Sequence[str], policy: str | Policy = "fast", target: Any = None, *,
                settings: GenerationConfig | None = None, budget: int = DEFAULT_BUDGET, guard: bool = True,
                say: Callable[[str], Any] = lambda s: None) -> SearchResult:
    """``fp4vis.plan``'s search with everything it measured (``SearchResult``); ``settings``: the generation
    (size, frames, steps, guidance, seed, backend; ``GenerationConfig``'s defaults otherwise)."""
    pol = get_policy(policy)
    if not pol.is_direct_p:
        raise ValueError(f"policy: {pol.name!r} is not a Direct-P policy (fast, wan_fast, accurate, ...)")
    if target is None:
        raise ValueError("target: name a fidelity target against BF16, e.g. 'psnr=30' or FidelityTarget(...)")
    tgt = target if isinstance(target, FidelityTarget) else FidelityTarget.parse(target)
    settings = settings or GenerationConfig()
    plan0, default = base_plan(pipe, pol)
    runs = WanRuns(pipe, prompts, pol, settings)
    calls = 2 if settings.guidance_scale > 1.0 else 1
    policies = [pol.name, plan0.guard_policy.name]
    times = attention_times(runs.layer_shapes([s.name for s in default], default), policies, calls,
                            device=torch.device(pipe._execution_device))
    return search(runs, tgt, times, plan0, budget=budget, guard=guard, say=say)


def plan(pipe, prompts: Sequence[str], policy: str | Policy = "fast", target: Any = None, *,
         settings: GenerationConfig | None = None, budget: int = DEFAULT_BUDGET, guard: bool = True) -> GuardPlan:
    """The plan that meets ``target`` against BF16 on ``prompts`` with the most attention time in FP4 (module
    docstring): a ``GuardPlan`` that ``fp4vis.patch(..., guard=plan)`` and ``generate --guard-plan`` take."""
    return search_plan(pipe, prompts, policy, target, settings=settings, budget=budget, guard=guard).plan


__all__ = ["Candidate", "FidelityTarget", "Measured", "SearchResult", "TARGET_STATISTICS", "WanRuns", "check_plan",
           "plan", "search", "search_plan"]
