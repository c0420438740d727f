"""What the range check costs per call on the H200: ``fp4vis.attention`` with the default
``range_check="raise"`` (the kernel's range record) against ``range_check="off"``, side by side.

    python3 benchmarks/range_check_bench.py --out $OUT/range_check.json [--shapes 64,197,12,64;1,4096,24,128]
        [--tiny-tokens N]

Per shape (B, S, H, D; self-attention, BF16, layout bhsd) and policy (``fast``, ``fast_fp8qk``,
``guard``), the whole call through ``fp4vis.attention(..., backend="hopper")`` in each mode:

* ``{raise,off}_host_us``: host time per call (``fp4vis.services.timing.time_host``: the launch path alone,
  the queue kept short), where the record's bookkeeping shows (numbering the call, reading the flag);
* ``{raise,off}_events_ms``: CUDA events per call over rotated inputs, host included where it is
  longer than the GPU work;
* ``{raise,off}_graph_ms``: GPU time per call from a CUDA graph (the record's counting in the kernel);
* ``raise_vs_off_{host,events,graph}``: the ratios of the medians over ``REPEATS`` interleaved rounds
  (1.0: free; each round's figures in ``*_runs``).

``--tiny-tokens N``: the first N tokens of q and k scaled by 3e-6 (a class token as timm initialises it): their
blocks flush every call without moving a score, so the pre-pass's underflow words and the attention kernel's
decision on them run on every call, and no error is raised (docs/numerics.md section 1, "Scale range").

Also the same with the synchronising check this record replaced, for reference
(``sync_check_events_ms``: ``torch.isfinite(out).all()`` read on the host after every call). Raw JSON
with the environment; rewritten after every shape.
"""

from __future__ import annotations

import argparse
import statistics
import time
import traceback

import torch
from short_seq_bench import parse_shapes  # the same B,S,H,D;... option (this folder is on sys.path)

import fp4vis
from fp4vis.services.environment import environment
from fp4vis.services.outputs import write_json
from fp4vis.services.timing import input_copies, time_events, time_graph, time_host

SHAPES = [(64, 197, 12, 64), (1, 4096, 24, 128)]
POLICIES = ("fast", "fast_fp8qk", "guard")
MODES = ("raise", "off")
REPEATS = 3


def _inputs(b: int, h: int, s: int, d: int, g: torch.Generator, tiny_tokens: int) -> tuple:
    q, k, v = (torch.randn(b, h, s, d, device="cuda", generator=g, dtype=torch.bfloat16) for _ in range(3))
    q[:, :, :tiny_tokens] *= 3e-6
    k[:, :, :tiny_tokens] *= 3e-6
    return q, k, v


def measure(shape, policy: str, tiny_tokens: int = 0) -> dict:
    b, s, h, d = shape
    copies = input_copies(3 * b * h * s * d * 2)
    g = torch.Generator(device="cuda").manual_seed(0)
    sets = [_inputs(b, h, s, d, g, tiny_tokens) for _ in range(copies)]
    row: dict = {"shape": list(shape), "policy": policy, "tiny_tokens": tiny_tokens, "input_copies": copies,
                 "repeats": REPEATS}
    runs: dict = {f"{mode}_{what}": [] for mode in MODES for what in ("host_us", "events_ms", "graph_ms")}
    for _ in range(REPEATS):   # the modes interleaved, so that drift between them cancels
        for mode in MODES:
            def call(i, mode=mode):
                return fp4vis.attention(*sets[i], policy=policy, backend="hopper", range_check=mode)

            call(0)
            fp4vis.check_range()
            runs[f"{mode}_host_us"].append(time_host(call, copies))
            runs[f"{mode}_events_ms"].append(time_events(call, copies))
            runs[f"{mode}_graph_ms"].append(time_graph(lambda i, mode=mode: call(0, mode)))
            fp4vis.check_range()
    for key, values in runs.items():
        row[key] = statistics.median(values)
        row[f"{key}_runs"] = values

    def sync_check(i):
        out = fp4vis.attention(*sets[i], policy=policy, backend="hopper", range_check="off")
        return bool(torch.isfinite(out).all())

    row["sync_check_events_ms"] = time_events(sync_check, copies)
    for what in ("host_us", "events_ms", "graph_ms"):
        row[f"raise_vs_off_{what.split('_')[0]}"] = row[f"raise_{what}"] / row[f"off_{what}"]
    return row


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True)
    default_shapes = ";".join(",".join(map(str, s)) for s in SHAPES)
    ap.add_argument("--shapes", default=None, help=f"B,S,H,D;... (default: {default_shapes})")
    ap.add_argument("--policies", default=",".join(POLICIES))
    ap.add_argument("--tiny-tokens", type=int, default=0, help="first tokens of q and k scaled by 3e-6")
    a = ap.parse_args(argv)
    shapes = parse_shapes(a.shapes) if a.shapes else SHAPES
    result = {"benchmark": "range_check_bench", "date": time.strftime("%Y-%m-%d"), "environment": environment(),
              "rows": []}
    for shape in shapes:
        for policy in a.policies.split(","):
            try:
                row = measure(shape, policy, a.tiny_tokens)
            except Exception as exc:  # noqa: BLE001 - record and go on
                row = {"shape": list(shape), "policy": policy, "error": f"{type(exc).__name__}: {exc}",
                       "traceback": traceback.format_exc()}
            result["rows"].append(row)
            print({k: (round(v, 4) if isinstance(v, float) else v) for k, v in row.items() if k != "traceback"},
                  flush=True)
            write_json(a.out, result)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
