"""Self-check at first use: the Blackwell kernel proves itself against the reference on the GPU it
is about to run on, before any of its numbers are returned.

Why: nobody on the project can run the FP4 MMA lowering (tcgen05 / mma.sync block_scale) on its
hardware; compile-level checks (``compile_check``) prove which instructions are emitted, not what
they compute. So the first eager call in a process on a GPU whose (device name, compute capability,
driver, fp4vis version, Triton version, launch route) has not passed runs ``PROBLEMS`` (every
policy, D 64 and 128, partial tiles, cross-attention, BF16 and FP16) through the kernel and
``fp4vis.reference`` on that GPU and compares them with the tests' tolerance (relL2 <= 5e-3, all
finite). The verdict is cached on disk (``$XDG_CACHE_HOME/fp4vis`` or ``~/.cache/fp4vis``; written
atomically; a missing or read-only cache only costs a re-check). A failed check raises
``SelfCheckError`` naming the case, on that call and every later one: the kernel's numbers are
never returned. Under CUDA-graph capture the check cannot run (it synchronises): it must have run
before (the first eager call, or ``ensure`` / ``run_table`` at patch time). A passing verdict also keeps the
first-use figures (``first_use``: the kernel timed against BF16 attention on that GPU) as its ``timing``.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import threading
import time
from dataclasses import asdict, dataclass

import torch

from fp4vis.files import atomic_write
from fp4vis.metrics import rel_l2
from fp4vis.policy import POLICIES, Policy
from fp4vis.reference import reference_attention

TOLERANCE = 5e-3        # relL2 against the reference: the GPU tests' bound
# how long a check case's kernel may run on the GPU after its launch returned (they take milliseconds): longer is a
# hang (a kernel never run on this GPU, e.g. the warp-specialised one, waiting on a barrier that never arrives)
HANG_S = 30.0
CACHE_FILE = "blackwell_selfcheck.json"

# (policy, head dim, dtype, B, H, Sq, Skv): every policy x D x dtype once, shapes cycling through
# a partial query and key tile, cross-attention with Sq < Skv and Sq > Skv, and a single tile
_SHAPES = ((1, 2, 130, 200), (1, 1, 64, 333), (2, 1, 257, 96), (1, 2, 128, 128))
PROBLEMS = tuple(
    (pol, d, dt, *_SHAPES[i % len(_SHAPES)])
    for i, (pol, d, dt) in enumerate((pol, d, dt) for pol in ("fast", "wan_fast", "accurate", "guard")
                                     for d in (64, 128) for dt in ("bf16", "fp16")))


# The warp-specialised kernel's own cases (a verdict whose identity has schedule "warp_specialized"), beside PROBLEMS:
# 9 key tiles (8 whole, one partial), so both Direct-P warpgroups, both phases of every barrier and the wrap of its
# 4-deep K/V ring run; then a key-masked batch (one element keeps part of its keys, one none: zeros) and a recorded
# call whose logits saturate (the range record's counts against the reference's report)
WS_KEYS = 8 * 128 + 37
WS_PROBLEMS = tuple((pol, d, dt, 1, 2, 200, WS_KEYS) for pol, d, dt in (
    ("fast", 128, "bf16"), ("wan_fast", 128, "fp16"), ("fast", 64, "fp16"), ("wan_fast", 64, "bf16")))


class SelfCheckError(RuntimeError):
    """The Blackwell kernel disagreed with the reference on this GPU: its results are refused."""


@dataclass
class CaseResult:
    case: str
    rel_l2: float
    bit_identical: float
    finite: bool
    passed: bool


def case_name(problem) -> str:
    pol, d, dt, b, h, sq, skv = problem
    return f"{pol} D={d} {dt} B={b} H={h} Sq={sq} Skv={skv}"


# largest logit z·log2(e) the "wide" inputs drive each policy to (inside its representable range,
# docs/numerics.md section 2; the Hopper tests' values)
LOGIT_LIMIT = {"fast": 100.0, "wan_fast": 100.0, "accurate": 200.0, "guard": 300.0}


def make_inputs(shape, dtype, kind: str = "gauss", policy: str = "fast", seed: int = 0, device="cpu"):
    """q, k, v of ``shape`` (B, H, Sq, Skv, D), generated on the CPU (the same numbers on every
    device). ``kind``: "gauss" (iid N(0, 1)) or "wide" (outlier channels in K and V, 300x and
    1e-3x, and q scaled so the largest logit z·log2(e) reaches ``LOGIT_LIMIT[policy]``)."""
    b, h, sq, skv, d = shape
    g = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(b, h, s, d, generator=g) for s in (sq, skv, skv))
    if kind == "wide":
        k[..., 1] *= 20.0
        v[..., 2] *= 300.0
        v[..., 3] *= 1e-3
        raw_max = (q @ k.transpose(-1, -2)).abs().amax() / math.sqrt(d) / math.log(2)
        q = q * (LOGIT_LIMIT.get(policy, 100.0) / float(raw_max))
    elif kind != "gauss":
        raise ValueError(f"kind: 'gauss' or 'wide', got {kind!r}")
    return tuple(t.to(dtype).to(device) for t in (q, k, v))


def _inputs(problem, device):
    pol, d, dt, b, h, sq, skv = problem
    dtype = torch.bfloat16 if dt == "bf16" else torch.float16
    return make_inputs((b, h, sq, skv, d), dtype, "gauss", pol, seed=1234 + d + sq + skv, device=device)


def run_problems(kernel_fn, device, problems=None) -> list[CaseResult]:
    """Run each problem (default: ``PROBLEMS``) through ``kernel_fn(q, k, v, policy, scale) -> out``
    ((B, H, S, D) tensors) and the reference on ``device``; the per-case results."""
    results = []
    problems = PROBLEMS if problems is None else problems
    for problem in problems:
        q, k, v = _inputs(problem, device)
        policy: Policy = POLICIES[problem[0]]
        scale = 1.0 / math.sqrt(q.shape[-1])
        out = kernel_fn(q, k, v, policy, scale)
        wait_for_gpu(out.device, f"self-check case {case_name(problem)}")
        ref, _ = reference_attention(q.flatten(0, 1), k.flatten(0, 1), v.flatten(0, 1), policy, scale)
        results.append(_result(case_name(problem), out, ref.unflatten(0, q.shape[:2])))
    return results


def wait_for_gpu(device, what: str, timeout_s: float = HANG_S, event=None, clock=time.monotonic) -> None:
    """Wait for the work queued on ``device``'s current stream (or for ``event``), at most ``timeout_s``; past it,
    SelfCheckError naming ``what``: the kernel hangs on this GPU, and saying so beats a process that waits for ever
    (its CUDA context stays unusable). ``clock``: the tests' fake."""
    if event is None:
        if torch.device(device).type != "cuda":
            return
        event = torch.cuda.Event()
        event.record(torch.cuda.current_stream(device))
    deadline = clock() + timeout_s
    while not event.query():
        if clock() > deadline:
            raise SelfCheckError(
                f"fp4vis: the Blackwell kernel did not finish {what} within {timeout_s:.0f} s on "
                "this GPU: it hangs here, and this process's CUDA context cannot be used again. Restart without "
                "FP4VIS_BLACKWELL_WARP_SPECIALIZED (if it was set), or use backend='reference', and please report "
                "this with `fp4vis info` output.")
        time.sleep(0.001)


def _result(name: str, out: torch.Tensor, ref: torch.Tensor, extra_ok: bool = True) -> CaseResult:
    finite = bool(torch.isfinite(out).all())
    err = rel_l2(out.float(), ref.float()) if finite else math.inf
    return CaseResult(name, err, float((out == ref).double().mean()), finite,
                      finite and err <= TOLERANCE and extra_ok)


def masked_case(kernel_fn, device) -> CaseResult:
    """A key-masked batch: element 0 keeps about 60 % of ``WS_KEYS`` keys (the reference on its kept keys is what it
    must give), element 1 none (its rows must be 0). ``kernel_fn(q, k, v, policy, scale, key_mask=...)``."""
    q, k, v = make_inputs((2, 2, 200, WS_KEYS, 128), torch.bfloat16, "gauss", "fast", seed=77, device=device)
    keep = torch.rand(WS_KEYS, generator=torch.Generator().manual_seed(78)) < 0.6
    mask = torch.stack([keep, torch.zeros_like(keep)]).to(q.device)
    policy, scale = POLICIES["fast"], 1.0 / math.sqrt(128)
    out = kernel_fn(q, k, v, policy, scale, key_mask=mask)
    wait_for_gpu(out.device, "the key-masked self-check case")
    kept = keep.to(q.device)
    ref, _ = reference_attention(q[0], k[0][:, kept], v[0][:, kept], policy, scale)
    return _result(f"fast D=128 bf16 B=2 H=2 Sq=200 Skv={WS_KEYS} key mask (keeps {int(keep.sum())}, 0)",
                   out[0], ref, extra_ok=bool((out[1] == 0).all()))


def recorded_case(kernel_fn, device) -> CaseResult:
    """A recorded call whose logits saturate: the kernel's saturated blocks and empty rows in the range record are the
    reference's report, its non-finite count its output's, and the output the reference's.
    ``kernel_fn(q, k, v, policy, scale, record=...)``."""
    from fp4vis.backends.range_record import RangeRecord

    q, k, v = make_inputs((1, 2, 200, WS_KEYS, 128), torch.bfloat16, "gauss", "fast", seed=79, device=device)
    q, k = q * 12.0, k * 12.0
    policy, scale = POLICIES["fast"], 0.125
    rec = RangeRecord(torch.device(device))
    out = kernel_fn(q, k, v, policy, scale, record=rec.start_call("blackwell", policy, "raise", "bhsd", (q, k, v)))
    wait_for_gpu(out.device, "the recorded self-check case")
    found = rec.collect()
    ref, report = reference_attention(q.flatten(0, 1), k.flatten(0, 1), v.flatten(0, 1), policy, scale)
    counts = None if found is None else found[2]
    ok = (report.saturated_blocks > 0 and counts is not None and counts.saturated_blocks == report.saturated_blocks
          and counts.empty_rows == report.empty_rows
          and counts.nonfinite_outputs == int((~torch.isfinite(out)).sum()))
    return _result(f"fast D=128 bf16 B=1 H=2 Sq=200 Skv={WS_KEYS} recorded, saturating", out,
                   ref.unflatten(0, q.shape[:2]), extra_ok=ok)


# ---------------------------------------------------------------------------------------------
# verdict cache
# ---------------------------------------------------------------------------------------------

def cache_dir() -> str:
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(base, "fp4vis")


def _read_cache() -> dict:
    try:
        with open(os.path.join(cache_dir(), CACHE_FILE)) as f:
            data = json.load(f)
        return data if isinstance(data, dict) else {}
    except (OSError, ValueError):
        return {}


def _write_cache(key: str, verdict: dict) -> bool:
    """Add one verdict, atomically (``fp4vis.files.atomic_write``); False when the cache cannot be
    written (read-only, missing home): the check then simply runs again in the next process."""
    try:
        data = _read_cache()
        data[key] = verdict
        atomic_write(os.path.join(cache_dir(), CACHE_FILE), json.dumps(data, indent=1))
        return True
    except OSError:
        return False


def identity_key(identity: dict) -> str:
    return hashlib.sha256(json.dumps(identity, sort_keys=True).encode()).hexdigest()[:24]


# ---------------------------------------------------------------------------------------------
# the gate
# ---------------------------------------------------------------------------------------------

_LOCK = threading.Lock()
_VERDICTS: dict[str, dict] = {}   # identity key -> verdict, this process


def process_verdicts() -> list[dict]:
    """The verdicts this process holds (checked or read from the disk cache)."""
    return list(_VERDICTS.values())


def raise_failed(verdict: dict) -> None:
    bad = [c for c in verdict["cases"] if not c["passed"]]
    first = bad[0] if bad else {"case": "?", "rel_l2": math.nan}
    raise SelfCheckError(
        f"fp4vis: the Blackwell kernel failed its self-check on {verdict['identity'].get('device', '?')} "
        f"({len(bad)} of {len(verdict['cases'])} cases; first: {first['case']}, relL2 {first['rel_l2']:.3g} "
        f"> {TOLERANCE}). Its results are refused. Use fp4vis.attention(..., backend='reference') "
        "(exact emulation, slow) and please report this with `fp4vis selfcheck` output.")


def verdict_for(identity: dict, kernel_fn, device, *, force: bool = False, problems=None, measure=None) -> dict:
    """The verdict for ``identity``: from this process, else the disk cache, else by running the
    problems now (and caching the result). ``force`` re-runs. ``measure() -> dict | None``: the first-use
    figures (``first_use.measure``), taken where a passing verdict has none yet and kept in it as ``timing``
    (None: they cannot be taken now, the next call tries again)."""
    key = identity_key(identity)
    with _LOCK:
        v = None if force else (_VERDICTS.get(key) or _read_cache().get(key))
        changed = v is None
        if v is None:
            if torch.cuda.is_available() and torch.cuda.is_current_stream_capturing():
                raise SelfCheckError("fp4vis: the Blackwell kernel's self-check has not run in this process and "
                                     "cannot run under CUDA-graph capture; make one eager call (or call "
                                     "fp4vis.kernels.blackwell.selfcheck.ensure()) before capturing")
            cases = run_problems(kernel_fn, device, problems)
            if problems is None and identity.get("schedule") == "warp_specialized":
                cases += run_problems(kernel_fn, device, WS_PROBLEMS)
                cases += [masked_case(kernel_fn, device), recorded_case(kernel_fn, device)]
            v = {"identity": identity, "passed": all(c.passed for c in cases), "cases": [asdict(c) for c in cases]}
        if measure is not None and v["passed"] and "timing" not in v:
            timing = measure()
            if timing is not None:
                v["timing"] = timing
                changed = True
        _VERDICTS[key] = v
        if changed:
            v["cached"] = _write_cache(key, {k: x for k, x in v.items() if k != "cached"})
        return v


def known_verdict(identity: dict) -> dict | None:
    """The verdict kept for ``identity`` (this process's, else the disk cache's), without running anything."""
    key = identity_key(identity)
    return _VERDICTS.get(key) or _read_cache().get(key)


def check(identity: dict, kernel_fn, device) -> None:
    """Raise SelfCheckError unless ``identity`` has passed (running the check if it has not run)."""
    v = _VERDICTS.get(identity_key(identity))
    if v is None:
        v = verdict_for(identity, kernel_fn, device)
    if not v["passed"]:
        raise_failed(v)


def format_table(verdict: dict) -> str:
    lines = [f"{'case':<44} {'relL2':>10} {'bit-equal':>9}  result"]
    for c in verdict["cases"]:
        lines.append(f"{c['case']:<44} {c['rel_l2']:>10.3g} {c['bit_identical']:>9.3f}  "
                     f"{'ok' if c['passed'] else 'FAIL'}")
    lines.append(f"verdict: {'passed' if verdict['passed'] else 'FAILED'} "
                 f"({json.dumps(verdict['identity'], sort_keys=True)})")
    return "\n".join(lines)
