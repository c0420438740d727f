"""The run loop the diffusion evals share (``eval wan``, ``eval pipeline``): a schedule of runs (BF16 first, the
reference of every metric; then the BF16 attention baselines, the FP4 policies), each in its own block (its
policy or baseline applied), with the same untimed 1-step warm-up (where the transformer is compiled, each run
compiles afresh there), the same peak-memory reading and the same error capture: a failing run other than the
first is recorded as ``{"error": ...}`` and the others go on; its warnings land in the result, tagged with its
name. The eval measures (``execute``) and says what a finished run reports (``record``); the loop adds every
run's ``speedup_vs`` against the reference runs that finished (``add_speedups_vs``) and writes the partial
result after each run, so that an interrupted eval keeps what it finished. ``speedups_markdown``: the reports'
table of those speedups.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager
from dataclasses import dataclass
from typing import Any

import torch

from fp4vis.evals.baselines import run_name
from fp4vis.evals.common import add_speedups_vs
from fp4vis.evals.report import markdown_table
from fp4vis.services.console import WarningLog
from fp4vis.services.timing import Timer


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


def bf16_baselines_policies(policies: Sequence[Any], baselines: Sequence[str], layers: str, *,
                            guard_for: Callable[[Any], Any], policy_label: Callable[[Any, Any], str],
                            baseline_label: Callable[[str], str]) -> tuple[list[ScheduledRun], tuple[str, ...]]:
    """The schedule the diffusion evals run: BF16 first (the reference of every metric), then each BF16 attention
    baseline as run ``<layers>=<name>``, then the FP4 policies (``guard_for(policy)``: the guard plan of each); what
    each run's bars say: ``baseline_label(name)``, ``policy_label(policy, guard)``. Returns the schedule and the
    reference run names (BF16 and the baselines) every run's ``speedup_vs`` compares with."""
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


def speedups_markdown(runs: dict[str, Any], references: Sequence[str], what: str) -> list[str]:
    """The report's table of every run's ``speedup_vs`` against each reference run (``what``: the time the
    ratios are of); no table where only BF16 is a reference (it would repeat the speedup column)."""
    rows = [[name] + [run["speedup_vs"].get(ref) for ref in references]
            for name, run in runs.items() if "speedup_vs" in run]
    if len(references) < 2 or not rows:
        return []
    return ["", f"Speedup of {what} against BF16 and each baseline (its time / the run's):", "",
            markdown_table(["run"] + [f"vs {ref}" for ref in references], rows, digits=3)]
