"""The pipeline eval's one run loop: BF16, the BF16 attention baselines and the FP4 policies on a diffusion
pipeline, each run timed, compared with BF16 and written to the report. Its configurations say what runs:

* ``fp4vis.evals.pipeline_eval`` (``fp4vis eval pipeline``): any diffusers pipeline called as a user calls it,
  or a published denoiser with random weights in its own Euler loop;
* ``fp4vis.evals.wan_fidelity`` (``fp4vis eval wan``): a Wan2.1 pipeline with its prompt encoded once,
  denoising, decode and text encoding timed apart, latents after some steps, operator error.

A configuration is a ``DiffusionEvalConfig`` subclass (the options every configuration takes; ``subject``
builds what it runs) and an ``EvalSubject`` (how it loads, compiles, runs one generation, what its report
says). ``run_eval`` does the rest, for every configuration the same: the options checked before anything loads,
the line saying what runs, the schedule (``bf16_baselines_policies``: BF16 first, the reference of every metric;
then each baseline as run ``<layers>=<name>``, then the policies), each run in its own block (its policy or
baseline applied; ``baseline_applied``) with the same untimed 1-step warm-up (where the transformer is compiled,
each run compiles afresh there), the same peak-memory reading and the same error capture (``run_schedule``: a
failing run other than the first is recorded as ``{"error": ...}`` and the others go on; its warnings land in
the result, tagged with its name), the comparison with BF16 (final-latent cosine and relative L2, per-frame
PSNR/SSIM of decoded outputs), every run's ``speedup_vs`` against the reference runs that finished
(``add_speedups_vs``), and the partial report written after each run, so that an interrupted eval keeps what it
finished. With ``cp`` the runs go under diffusers' context parallelism over the processes of a torchrun launch
(rank 0 says, writes and returns). The reports' shared pieces are here too (``baselines_markdown``,
``speedups_markdown``, ``routing_text``, ...); each configuration writes its own table around them.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import AbstractContextManager
from dataclasses import dataclass, replace
from typing import Any

import torch

from fp4vis.evals.baselines import BASELINES, attention_functions, run_name, select_baselines
from fp4vis.evals.common import add_speedups_vs, error_metrics, frame_metrics, reference_timed
from fp4vis.evals.report import markdown_table, report_writer
from fp4vis.patching.attention_function import AppliedFunction, attention_function_applied
from fp4vis.services.console import WarningLog
from fp4vis.services.environment import environment
from fp4vis.services.guard_plans import guard_plan_summary, load_guard_plan, plan_for
from fp4vis.services.policies import attention_label, backend_in_use, check_backend, policy_applied, resolve_policies
from fp4vis.services.runtime import COMPILE_MODES, resolve_device, resolve_dtype
from fp4vis.services.timing import Timer
from fp4vis.services.usage import UsageError

DEFAULT_PROMPT = "A red fox trotting through fresh snow in a birch forest, morning light, cinematic"


@dataclass(frozen=True)
class DiffusionEvalConfig:
    """What every configuration of the eval takes (a subclass gives its defaults, its own options and
    ``subject``): a ``model`` (Hub id, local diffusers folder) or ``speed_only`` (one of ``architectures()``:
    that architecture with seeded random weights, timings only), the FP4 ``policies``, the BF16 attention
    ``baselines`` ("auto", "none" (or "" / None), or names: ``fp4vis.evals.baselines.select_baselines``; one that
    cannot run here is a UsageError); the prompt, size (None: the configuration's default), ``steps`` and
    ``guidance_scale`` every run shares; the runtime; ``decode`` None: yes with a model, never in speed-only mode;
    ``compile``: "regional" or "full" (``fp4vis.pipelines.compile.compile_transformers``), each run compiled afresh
    in its warm-up; ``out_dir``: where ``name``.json / .md go (``name`` None: the configuration's); ``cp``
    (``"ulysses=2"``, a ``ContextParallel``): every run's transformers under diffusers' context parallelism over the
    processes of a torchrun launch (the bf16 run is then diffusers' own context-parallel attention)."""

    model: str | None = None
    speed_only: str | None = None
    policies: str | list[str] = "fast"
    baselines: str | list[str] | None = "auto"
    prompt: str = DEFAULT_PROMPT
    negative_prompt: str | None = None
    height: int | None = None
    width: int | None = None
    frames: int | None = None
    steps: int = 10
    guidance_scale: float | None = None
    seed: int = 0
    device: str = "auto"
    dtype: str = "bfloat16"
    backend: str = "auto"
    guard_plan: str | None = None
    decode: bool | None = None
    warmup: bool = True
    compile: str | None = None
    out_dir: str | os.PathLike | None = None
    name: str | None = None
    progress: bool = True
    cp: Any = None

    def architectures(self) -> Mapping[str, Any]:
        """The ``speed_only`` names this configuration builds."""
        raise NotImplementedError

    def check(self) -> None:
        """The configuration's own option checks, before anything loads (UsageError naming the option)."""

    def subject(self, device: torch.device, policies: list[Any], plan: Any) -> EvalSubject:
        """What the eval runs on ``device`` (not loaded yet; it checks the sizes it can before any weights);
        ``policies`` and the guard ``plan`` are the runs' (a configuration that measures them apart uses them)."""
        raise NotImplementedError


class EvalSubject:
    """One configuration's side of the run loop: a pipeline or a denoiser (``module``, what the policies and the
    baselines patch), loaded, compiled and run by ``run_eval``. Its class says how the report names it
    (``eval_name``, ``command``, ``report_names``: the default name with a model and in speed-only mode) and
    where a baseline goes (``baseline_layers``: the short name in ``<layers>=<name>``; ``baseline_select``: the
    layers, None: those the policies patch by default; ``baseline_layer_text``: its entry's ``layers``;
    ``frames_key``: the key of the per-frame PSNR/SSIM). ``size``, ``tokens`` and ``decode``: what the result
    says of them (``load`` may settle what only the loaded model tells)."""

    eval_name = ""
    command = ""
    report_names = ("", "")
    baseline_layers = "attn"
    baseline_select: Any = None
    baseline_layer_text = ""
    frames_key = "frames"

    def __init__(self, config: DiffusionEvalConfig, device: torch.device):
        self.config, self.dev = config, device
        self.module: Any = None
        self.size: dict[str, int | None] = dict(height=config.height, width=config.width, frames=config.frames)
        self.tokens: int | None = None
        self.decode = config.speed_only is None if config.decode is None else config.decode

    def report_name(self) -> str:
        """The report's file name: the config's ``name``, else this configuration's for its mode."""
        return self.config.name or self.report_names[0 if self.config.speed_only is None else 1]

    def describe(self) -> str:
        """What runs, for the line the eval says first: the model, its size and schedule."""
        raise NotImplementedError

    def load(self) -> None:
        raise NotImplementedError

    def compile(self, mode: str) -> None:
        raise NotImplementedError

    def transformers(self) -> list[torch.nn.Module]:
        """The modules ``cp`` spreads over the processes."""
        from fp4vis.pipelines.model_files import pipeline_transformers

        return pipeline_transformers(self.module)

    def policy_block(self, run: ScheduledRun) -> AbstractContextManager:
        """The block of a run, warm-up and timed part: its policy applied to the module."""
        return policy_applied(self.module, run.policy, guard=run.guard, backend=self.config.backend)

    def baseline_label(self, baseline: str) -> str:
        """What a baseline run's progress bars say."""
        return f"{BASELINES[baseline].label} as the attention"

    def execute(self, run: ScheduledRun, label: str, warmup: bool) -> Any:
        """One generation of ``run`` (its 1-step warm-up when ``warmup``); returns an output with the final
        ``latents`` and the decoded ``frames`` ((N, H, W, 3) in [0, 1], or None)."""
        raise NotImplementedError

    def fields(self) -> dict[str, Any]:
        """The result's keys this configuration adds to (or sets in place of) the common ones, once loaded."""
        raise NotImplementedError

    def timings(self, outcome: RunOutcome) -> dict[str, Any]:
        """A finished run's ``timings`` (with ``denoise_s``, what ``speedup_vs`` divides) and ``step_s``."""
        raise NotImplementedError

    def speedups(self, timings: dict[str, Any], bf16: dict[str, Any]) -> dict[str, float]:
        """A run's speedups against BF16's timings."""
        raise NotImplementedError

    def extras(self, outcome: RunOutcome, reference: Any) -> dict[str, Any]:
        """What else a run reports (``reference``: BF16's output, None for BF16's own run)."""
        return {}

    @staticmethod
    def markdown(result: dict[str, Any]) -> str:
        raise NotImplementedError


@dataclass(frozen=True)
class ScheduledRun:
    """One run: its ``name`` in the result's ``runs``, the attention ``policy`` ("bf16" or a Policy) with its
    ``guard`` plan, the BF16 attention ``baseline`` it runs (a name in ``fp4vis.evals.baselines``; None: none)
    and what its progress bars say (``label``)."""

    name: str
    policy: Any
    guard: Any = None
    baseline: str | None = None
    label: str = ""


@dataclass(frozen=True)
class LoopSettings:
    """What every run of a schedule shares: the warm-up (``warmup``; ``compiled``: the transformer is compiled,
    afresh in each warm-up), the ``device`` (CUDA: peak memory per run) and the ``references``, the run names
    each run's ``speedup_vs`` compares with."""

    warmup: bool
    compiled: bool
    device: torch.device
    references: tuple[str, ...]


@dataclass
class RunOutcome:
    """A finished run: what ``execute`` returned for its timed part, the warm-up's seconds (None: no warm-up)
    and its peak GPU memory in GiB (None off CUDA)."""

    run: ScheduledRun
    output: Any
    warmup_s: float | None
    peak_memory_gib: float | None


def check_config(config: DiffusionEvalConfig) -> None:
    """Every option checked before anything loads (UsageError naming it)."""
    known = config.architectures()
    if (config.model is None) == (config.speed_only is None):
        raise UsageError("give either a model (Hub id or local path) or speed_only (a published architecture: "
                         f"{', '.join(known)})")
    if config.speed_only is not None and config.speed_only not in known:
        raise UsageError(f"speed_only: unknown architecture {config.speed_only!r}; known: {', '.join(known)}")
    if config.compile is not None and config.compile not in COMPILE_MODES:
        raise UsageError(f"compile: must be one of {', '.join(COMPILE_MODES)}, got {config.compile!r}")
    if config.compile is not None and not config.warmup:
        raise UsageError("compile: needs the warm-up run (each run compiles there, outside its timing)")
    config.check()


def run_eval(config: DiffusionEvalConfig, *, say: Callable[[str], Any] | None = None,
             frames_sink: dict[str, Any] | None = None) -> dict[str, Any] | None:
    """Run BF16, the BF16 baselines and every policy of ``config`` (module docstring); returns the result dict
    and writes JSON/Markdown to ``config.out_dir``. ``say``: told what the eval runs once its options are
    checked; ``frames_sink``: a dict that receives each run's decoded frames, by run name. With ``config.cp``,
    under torchrun: every rank runs, rank 0 alone says, writes and returns the result (the others None)."""
    check_config(config)
    if config.cp is None:
        return _evaluate(config, resolve_device(config.device), say, frames_sink)
    from fp4vis.pipelines.context_parallel import ContextParallel, distributed, parse_cp

    cp = config.cp if isinstance(config.cp, ContextParallel) else parse_cp(config.cp)
    with distributed(cp, config.device) as session:
        main = session.is_main
        result = _evaluate(replace(config, cp=cp, out_dir=config.out_dir if main else None,
                                   progress=config.progress and main), session.device,
                           say if main else None, frames_sink if main else None)
    return result if main else None


def _spread(subject: EvalSubject, cp: Any, dev: torch.device, dtype: torch.dtype) -> None:
    """The subject's transformers under diffusers' context parallelism ``cp`` (``enable_context_parallel``: its
    checks first); the bf16 run's exact attention under ring needs a backend that can run it."""
    from fp4vis.pipelines.context_parallel import check_exact_under_ring, enable_context_parallel

    check_exact_under_ring(cp, dev, dtype, "the bf16 run")
    models = subject.transformers()
    if not models:
        raise UsageError(f"--cp {cp}: {type(subject.module).__name__} has no transformer to spread over the "
                         "processes")
    for model in models:
        enable_context_parallel(model, cp)


@contextlib.contextmanager
def baseline_applied(module: Any, baseline: str | None, select: Any = None) -> Iterator[AppliedFunction | None]:
    """A block with BF16 baseline ``baseline`` (its function in every layout) as the attention of ``module``'s
    ``select`` layers (None: those the policies patch by default), yielding where its calls went; the module as
    it is for None."""
    if baseline is None:
        yield None
        return
    with attention_function_applied(module, attention_functions(baseline), select=select) as applied:
        yield applied


def _evaluate(config: DiffusionEvalConfig, dev: torch.device, say: Callable[[str], Any] | None,
              frames_sink: dict[str, Any] | None) -> dict[str, Any]:
    """``run_eval`` on this process's device ``dev``."""
    check_backend(config.backend, dev)
    pols = resolve_policies(config.policies, allow_bf16=False)
    baseline_names, baselines_skipped = select_baselines(config.baselines, dev)
    plan = load_guard_plan(config.guard_plan)
    subject = config.subject(dev, pols, plan)
    random_weights = config.speed_only is not None
    if say is not None:
        bf16_runs = ", ".join(["bf16 (the model's attention)"]
                              + [run_name(b, subject.baseline_layers) for b in baseline_names])
        say(f"{subject.command}: {subject.describe()}; runs {bf16_runs}, then {', '.join(p.name for p in pols)} on "
            f"the {backend_in_use(config.backend, dev)} backend"
            + (f"; every run compiled ({config.compile}, fullgraph), in its warm-up" if config.compile else ""))
    subject.load()
    if config.cp is not None:
        _spread(subject, config.cp, dev, resolve_dtype(config.dtype))
    if config.compile is not None:
        subject.compile(config.compile)
    runs: dict[str, Any] = {}
    result: dict[str, Any] = {
        "eval": subject.eval_name, "mode": "speed_only" if random_weights else "fidelity",
        "random_weights": random_weights, "prompt": None if random_weights else config.prompt, **subject.size,
        "tokens": subject.tokens, "steps": config.steps, "guidance_scale": config.guidance_scale,
        "seed": config.seed, "dtype": config.dtype, "backend": config.backend, "device": dev.type,
        "decode": subject.decode, "warmup": config.warmup, "compile": config.compile,
        "guard_plan": guard_plan_summary(plan), "baselines": baseline_names, "baselines_skipped": baselines_skipped,
        "baseline_layers": subject.baseline_layers,
        "context_parallel": config.cp.to_dict() if config.cp is not None else None, "warnings": [],
        **subject.fields(), "runs": runs, "complete": False}
    write = report_writer(config.out_dir, subject.report_name(), result, subject.markdown)
    schedule, references = bf16_baselines_policies(
        pols, baseline_names, subject.baseline_layers, guard_for=lambda pol: plan_for(plan, pol),
        policy_label=lambda pol, guard: attention_label(pol, config.backend, dev, guard),
        baseline_label=subject.baseline_label)
    cosine, rel_l2 = error_metrics()
    reference: dict[str, Any] = {}     # the BF16 run's output
    applied: dict[str, AppliedFunction] = {}   # run name -> where its baseline's calls went

    @contextlib.contextmanager
    def run_block(run: ScheduledRun) -> Iterator[None]:
        with subject.policy_block(run), baseline_applied(subject.module, run.baseline,
                                                         subject.baseline_select) as fn_applied:
            if fn_applied is not None:
                applied[run.name] = fn_applied
            yield

    def execute(run: ScheduledRun, warmup: bool) -> Any:
        return subject.execute(run, f"{run.label}; warm-up, untimed" if warmup else run.label, warmup)

    def record(outcome: RunOutcome) -> dict[str, Any]:
        res, baseline = outcome.output, outcome.run.baseline
        entry = subject.timings(outcome)
        if baseline is not None:
            entry["baseline"] = {"name": baseline, "attention": BASELINES[baseline].description,
                                 "layers": subject.baseline_layer_text,
                                 "routing": applied[outcome.run.name].summary()}
        if outcome.peak_memory_gib is not None:
            entry["peak_memory_gib"] = outcome.peak_memory_gib
        ref = reference.get("bf16")
        if ref is None:
            reference["bf16"] = res
        else:
            entry.update(subject.speedups(entry["timings"], runs["bf16"]["timings"]))
            entry["latent_cosine"] = cosine(res.latents, ref.latents)
            entry["latent_rel_l2"] = rel_l2(res.latents, ref.latents)
            if res.frames is not None and ref.frames is not None:
                entry[subject.frames_key] = frame_metrics(res.frames, ref.frames)
        entry.update(subject.extras(outcome, ref))
        if frames_sink is not None and res.frames is not None:
            frames_sink[outcome.run.name] = res.frames
        return entry

    run_schedule(schedule, LoopSettings(config.warmup, config.compile is not None, dev, references), result,
                 execute=execute, context=run_block, record=record, write=write)
    result["complete"] = True
    write()
    if config.out_dir is None:
        result["environment"] = environment()
    return result


def bf16_baselines_policies(policies: Sequence[Any], baselines: Sequence[str], layers: str, *,
                            guard_for: Callable[[Any], Any], policy_label: Callable[[Any, Any], str],
                            baseline_label: Callable[[str], str]) -> tuple[list[ScheduledRun], tuple[str, ...]]:
    """The schedule: BF16 first (the reference of every metric), then each BF16 attention baseline as run
    ``<layers>=<name>``, then the FP4 policies (``guard_for(policy)``: the guard plan of each); what each run's
    bars say: ``baseline_label(name)``, ``policy_label(policy, guard)``. Returns the schedule and the reference
    run names (BF16 and the baselines) every run's ``speedup_vs`` compares with."""
    planned = ([("bf16", "bf16", None)] + [(run_name(b, layers), "bf16", b) for b in baselines]
               + [(p.name, p, None) for p in policies])
    schedule = [ScheduledRun(name, pol, guard_for(pol), baseline,
                             baseline_label(baseline) if baseline is not None else policy_label(pol, guard_for(pol)))
                for name, pol, baseline in planned]
    return schedule, ("bf16", *(run_name(b, layers) for b in baselines))


def run_schedule(schedule: Sequence[ScheduledRun], settings: LoopSettings, result: dict[str, Any], *,
                 execute: Callable[[ScheduledRun, bool], Any],
                 context: Callable[[ScheduledRun], AbstractContextManager],
                 record: Callable[[RunOutcome], dict[str, Any]], write: Callable[[], None]) -> None:
    """Run ``schedule`` into ``result["runs"]`` (module docstring). ``execute(run, warmup)``: the run's
    generation, its 1-step warm-up when ``warmup`` is True; ``context(run)``: the block both run in (the policy
    or baseline applied); ``record(outcome)``: the run's entry; ``write()``: save the result as it stands."""
    runs, dev = result["runs"], settings.device
    for i, run in enumerate(schedule):
        wlog = WarningLog()
        try:
            with wlog, context(run):
                warmup_s = None
                if settings.warmup:
                    if settings.compiled:
                        torch._dynamo.reset()   # this run's attention compiles afresh, in its warm-up
                    with Timer() as tw:
                        execute(run, True)
                    warmup_s = tw.seconds
                if dev.type == "cuda":
                    torch.cuda.reset_peak_memory_stats(dev)
                output = execute(run, False)
        except Exception as e:  # one failing run (e.g. an unavailable kernel) does not lose the others
            if i == 0:   # the reference: nothing to compare with
                raise
            runs[run.name] = {"error": f"{type(e).__name__}: {e}"}
            write()
            continue
        finally:
            result["warnings"] += [f"[{run.name}] {w}" for w in wlog.messages]
        peak = torch.cuda.max_memory_allocated(dev) / 2**30 if dev.type == "cuda" else None
        runs[run.name] = record(RunOutcome(run, output, warmup_s, peak))
        del output
        add_speedups_vs(runs, list(settings.references))
        write()  # partial results survive an interrupted run


# the reports' shared pieces


def compiled_note(mode: str | None) -> str:
    """How the runs were compiled, for a report's settings line."""
    if mode is None:
        return ", eager (not compiled)"
    how = {"regional": "compile_repeated_blocks", "full": "compile"}[mode]
    return (f", **compiled** (`transformer.{how}(fullgraph=True)`, every run: the BF16 baselines too; each run "
            "compiles in its warm-up)")


def partial_note(r: dict[str, Any]) -> str:
    return ("" if r.get("complete", True) else
            "\n**Partial results**: the run was interrupted; only the runs listed below finished.\n")


def runs_table(r: dict[str, Any], headers: Sequence[str], cells: Callable[[dict[str, Any]], list[Any]]) -> list[str]:
    """The report's table of the runs: a run's name, then ``cells(run)`` (a failed run: its error's first line),
    and on the reference emulation why no speedup is given (``reference_timed``: the caller's headers leave the
    speedup columns out there)."""
    rows = [[name, "failed: " + run["error"].splitlines()[0][:120]] + [None] * (len(headers) - 2) if "error" in run
            else [name, *cells(run)] for name, run in r["runs"].items()]
    lines = [markdown_table(headers, rows)]
    if reference_timed(r):
        lines += ["", "The FP4 runs ran the reference emulation (exact numerics, float64 element math on the "
                  f"{r.get('device', 'cpu').upper()}), not a kernel: their times say what the emulation costs, not "
                  "what FP4 attention gains, so no speedup is given."]
    return lines


def peak_memory_lines(r: dict[str, Any]) -> list[str]:
    mem = {n: run["peak_memory_gib"] for n, run in r["runs"].items() if "peak_memory_gib" in run}
    return ["", "Peak GPU memory (GiB): " + ", ".join(f"{n} {v:.1f}" for n, v in mem.items()) + "."] if mem else []


def routing_text(routing: dict[str, Any]) -> str:
    """Where a baseline run's attention calls went (``AppliedFunction.summary``), in words: per layer for eager
    calls; under torch.compile the calls Dynamo traced (a block graph shared by the blocks: no per-layer count)."""
    traced, parts = routing["traced"], []
    compiled = traced["calls_on_function"] or traced["calls_kept"]
    if routing["calls_on_function"] or routing["calls_kept"] or not compiled:
        parts.append(f"its function in {len(routing['layers_on_function'])} of {routing['layers']} layers "
                     f"({routing['calls_on_function']} calls)")
        if routing["layers_kept"]:
            reasons = sorted({why for whys in routing["layers_kept"].values() for why in whys})
            parts.append(f"the model's attention kept in {len(routing['layers_kept'])} layers "
                         f"({sum(routing['calls_kept'].values())} calls: {'; '.join(reasons)})")
    if compiled:
        kept = "".join(f", {n} kept: {why}" for why, n in traced["calls_kept"].items())
        parts.append(f"compiled, the calls traced (shared block graphs): {traced['calls_on_function']} on its "
                     f"function{kept}")
    return "; ".join(parts)


def baselines_markdown(r: dict[str, Any], layers: str, speedup_of: str) -> list[str]:
    """What the BF16 baselines are (the attention of ``layers``) and where their calls went, why any were skipped,
    and every run's speedup (of ``speedup_of``) against BF16 and each baseline that ran (none on the reference
    emulation)."""
    ran, skipped = r.get("baselines") or [], r.get("baselines_skipped") or {}
    lines = []
    if ran:
        what = "; ".join(f"`{name}`: {run['baseline']['attention']}, {routing_text(run['baseline']['routing'])}"
                         for name, run in r["runs"].items() if "baseline" in run)
        lines += ["", f"BF16 baselines: a BF16 attention library as the attention of {layers}. {what}. `bf16` is "
                  "diffusers' default attention, the reference of every fidelity column."]
    if skipped:
        lines += ["", "Baselines skipped: " + "; ".join(f"`{b}` ({why})" for b, why in skipped.items()) + "."]
    if not reference_timed(r):
        lines += speedups_markdown(r["runs"], ["bf16"] + [run_name(b, r["baseline_layers"]) for b in ran],
                                   speedup_of)
    return lines


def speedups_markdown(runs: dict[str, Any], references: Sequence[str], what: str) -> list[str]:
    """The report's table of every run's ``speedup_vs`` against each reference run (``what``: the time the
    ratios are of); no table where only BF16 is a reference (it would repeat the speedup column)."""
    rows = [[name] + [run["speedup_vs"].get(ref) for ref in references]
            for name, run in runs.items() if "speedup_vs" in run]
    if len(references) < 2 or not rows:
        return []
    return ["", f"Speedup of {what} against BF16 and each baseline (its time / the run's):", "",
            markdown_table(["run"] + [f"vs {ref}" for ref in references], rows, digits=3)]
