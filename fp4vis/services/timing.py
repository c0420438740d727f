"""Timers: ``Timer`` (wall clock, CUDA synchronised around the block), the benchmarks' timers (``time_cuda``,
``time_cpu``, ``time_events``, ``time_host``, ``time_graph``; ``input_copies``: how many inputs to rotate over so
that they leave the L2) and a benchmark's timed sections (``run_sections``)."""

from __future__ import annotations

import argparse
import math
import os
import shlex
import statistics
import sys
import time
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import torch

from fp4vis.services.environment import environment
from fp4vis.services.outputs import write_json


class Timer:
    """Wall-clock timer that synchronizes CUDA around the measured block (when CUDA is in use).

    >>> with Timer() as t: ...
    >>> t.seconds
    """

    def __init__(self, sync_cuda: bool = True):
        self.sync_cuda = sync_cuda
        self.seconds = float("nan")

    def _sync(self) -> None:
        if not self.sync_cuda:
            return
        try:
            import torch
            if torch.cuda.is_available() and torch.cuda.is_initialized():
                torch.cuda.synchronize()
        except ImportError:  # pragma: no cover
            pass

    def __enter__(self) -> Timer:
        self._sync()
        self._t0 = time.perf_counter()
        return self

    def __exit__(self, *exc) -> None:
        self._sync()
        self.seconds = time.perf_counter() - self._t0


def run_sections(result: dict[str, Any], sections: Sequence[tuple[str, Callable[[], Any]]],
                 out: str | os.PathLike, skip: Iterable[str] = ()) -> dict[str, Any]:
    """A benchmark's named sections, run in order (those in ``skip`` left out): each one's output, or its
    traceback where it fails, under its name in ``result``, its wall time in ``result["walls_s"]``, and
    ``result`` written to ``out`` after every section, so that a failing or interrupted section loses
    nothing that ran before it (a device run's time is short). Returns ``result``."""
    skip = set(skip)
    walls = result.setdefault("walls_s", {})
    for name, fn in sections:
        if name in skip:
            continue
        t0 = time.perf_counter()
        try:
            result[name] = fn()
        except Exception:   # the next sections still run; the JSON carries the traceback
            import traceback

            result[name] = {"error": traceback.format_exc()}
            print(result[name]["error"], file=sys.stderr, flush=True)
            if torch.cuda.is_available():
                torch.cuda.empty_cache()
        walls[name] = time.perf_counter() - t0
        write_json(out, result)
    return result


def run_shape_benchmark(doc: str, script: str, shapes: dict[str, tuple], row: Callable[..., Any],
                        argv: Sequence[str] | None = None, **extra: Any) -> tuple[dict[str, Any], list[str]]:
    """The command line and run of a benchmark over named shapes: ``--out`` (the JSON) and ``--shapes`` (names in
    ``shapes``, every one by default); ``row(name, *shapes[name])`` per shape as a ``run_sections`` section (printed,
    the CUDA cache emptied after it), in a result that also holds the command (``benchmarks/<script>`` and its
    arguments), the environment and ``extra``. Returns (the result, written to ``--out``; the shape names run)."""
    ap = argparse.ArgumentParser(description=doc.splitlines()[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--shapes", default=",".join(shapes))
    args = ap.parse_args(argv)
    names = args.shapes.split(",")
    result = {"command": f"python3 benchmarks/{script} " + shlex.join(sys.argv[1:] if argv is None else argv),
              "environment": environment(), **extra}

    def section(name):
        out = row(name, *shapes[name])
        print(out, flush=True)
        if torch.cuda.is_available():   # the shape's inputs are gone: hand their memory back before the next one
            torch.cuda.empty_cache()
        return out

    run_sections(result, [(name, lambda name=name: section(name)) for name in names], args.out)
    write_json(args.out, result)
    return result, names


def reps_within_budget(fn: Callable[[int], object], n_inputs: int, warmup: int, reps: int, min_reps: int,
                       budget_s: float) -> int:
    """Warm ``fn`` up, time one synchronised call and return how many calls (between ``min_reps`` and
    ``reps``) fit ``budget_s`` seconds: the shared front half of the benchmarks' timers."""
    for i in range(warmup):
        fn(i % n_inputs)
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    fn(0)
    torch.cuda.synchronize()
    est = max(time.perf_counter() - t0, 1e-6)
    return max(min(reps, min_reps), min(reps, int(budget_s / est)))


def time_cuda(fn: Callable[[int], object], n_inputs: int, warmup: int = 3, reps: int = 30,
              budget_s: float = 2.0) -> list[float]:
    """Per-call milliseconds of ``fn(i)`` (i selects the input copy), CUDA events, after warm-up."""
    reps = reps_within_budget(fn, n_inputs, warmup, reps, 3, budget_s)
    times = []
    for r in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn(r % n_inputs)
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return times


def time_cpu(fn: Callable[[int], object], n_inputs: int, reps: int = 3) -> list[float]:
    fn(0)
    times = []
    for r in range(reps):
        t0 = time.perf_counter()
        fn(r % n_inputs)
        times.append((time.perf_counter() - t0) * 1e3)
    return times


# Benchmark timers: the same measurement for every backend, so that no backend's host overhead counts
# for or against another (CUDA events over rotated inputs; the host path alone; GPU time from a graph).
L2_BYTES = 50 * 2**20   # the H200's L2
GRAPH_CALLS = 8         # calls per captured CUDA graph (time_graph)
HOST_BUDGET_S = 1.0     # wall time per host timing (fewer than 200 calls where a call's GPU work is long)


def input_copies(nbytes: int) -> int:
    """How many copies of a call's inputs of ``nbytes`` to rotate over so that they exceed the L2 three
    times (2 to 64)."""
    return max(2, min(64, math.ceil(3 * L2_BYTES / max(nbytes, 1))))


def time_events(fn, n_inputs: int, budget: float = 0.25) -> float:
    """Median ms of fn(i) by CUDA events, i rotating over the inputs."""
    return statistics.median(time_cuda(fn, n_inputs, reps=2000, budget_s=budget))


def time_host(fn, n_inputs: int, reps: int = 200, sync: bool = False, budget: float | None = None) -> float:
    """Median microseconds of the Python call fn(i) (sync: including the wait for the GPU); at most
    ``reps`` calls, fewer (at least 32) where they would take more than ``budget`` seconds of wall
    time (default HOST_BUDGET_S; the synchronisations below make each call cost its GPU time)."""
    reps = reps_within_budget(fn, n_inputs, 5, reps, 32, HOST_BUDGET_S if budget is None else budget)
    ts = []
    for i in range(reps):
        if not sync and i % 16 == 0:
            torch.cuda.synchronize()   # keep the launch queue short: measure the host path alone
        t0 = time.perf_counter()
        fn(i % n_inputs)
        if sync:
            torch.cuda.synchronize()
        ts.append(time.perf_counter() - t0)
    return statistics.median(ts) * 1e6


def time_graph(fn, calls: int = GRAPH_CALLS, budget: float = 0.25, n_inputs: int = 1) -> float:
    """Median ms per call of ``fn(i % n_inputs)`` replayed from one CUDA graph of ``calls`` calls: the GPU
    time of the call without its host work (warmed up, so compiled and cached, on a side stream first, as
    torch.cuda.graphs asks). With one input (the default) the same inputs every call, so L2-warm where they
    fit in it: compare with another ``time_graph`` figure (SDPA's), not with ``time_events`` over rotated
    inputs; with ``n_inputs`` copies that exceed the L2 (``input_copies``), every call reads from memory."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for i in range(3):
            fn(i % n_inputs)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for i in range(calls):
            fn(i % n_inputs)
    return time_events(lambda i: graph.replay(), 1, budget) / calls
