"""The pre-passes of both kernel backends count the blocks whose scale leaves its format into the range
record (``kernels/scale_record.py``; docs/numerics.md section 1, "Scale range"), as ``fp4vis.formats`` counts them
and with the reference's criterion for underflows (``fp4vis.scale_range.significant_underflow``, decided after the
pre-pass by the call's attention kernel, here by ``scale_record.decide`` standing in for it): run on the CPU through
Triton's interpreter (the fused Triton pre-passes) and in PyTorch (the pre-passes' PyTorch statements), every path,
both layouts, with and without the anchor permutation, on inputs whose blocks flush and saturate (``wide``), whose
flushed blocks cannot move the result (``harmless``: tiny q rows against unit k, a tiny V block among unit ones) and
whose V flushes everywhere (``tiny_v``). After the pre-pass alone the underflow decision is pending (the call's
words hold the formats' underflows, maxima and the q/k flush limit; only overflows are in the record); the decision
adds the counts under the call's number, raises the flag and clears the call's words, and a second one changes
nothing; without a record nothing is written. The GPU builds are checked on the H200
(tests/kernels/hopper/test_hopper_range.py, tests/kernels/blackwell/test_blackwell_gpu.py)."""

from __future__ import annotations

import pytest

_SCRIPT = r"""
import json
import torch
import fp4vis.formats as fm
import fp4vis.scale_range as sr
from fp4vis.backends.range_record import CALL_UNDERFLOW, FIRST_CALL, NUM_FIELDS, SCALE_OVERFLOW, SCALE_UNDERFLOW
from fp4vis.kernels import scale_record
from fp4vis.kernels.hopper import prepass as hp
from fp4vis.kernels.hopper import prepass_torch as hpt
from fp4vis.kernels.hopper import prepass_launch as htp
from fp4vis.kernels.blackwell import prepass as bp
from fp4vis.kernels.blackwell import prepass_kernels as btp
from fp4vis.key_positions import anchor_permutation
from fp4vis.policy import LOG2E

g = torch.Generator().manual_seed(0)
S = 0.125 * LOG2E    # the calls' score scale

def inputs(d, kind, sq=19, sk=45):
    def mk(s, lo, hi):   # per-row exponents over a wide range: whole rows flush or saturate
        e = torch.randint(lo, hi, (1, 2, s, 1), generator=g)
        return (torch.randn(1, 2, s, d, generator=g) * torch.exp2(e)).bfloat16()
    if kind == "wide":
        q, k, v = mk(sq, -30, 4), mk(sk, -4, 14), mk(sk, -4, 4)
        v[0, 1, 32:] *= 1e-39                     # a 32-token V block below MXFP4's smallest scale
    elif kind == "harmless":
        q, k, v = mk(sq, -2, 1), mk(sk, 0, 1), mk(sk, 0, 1)
        q[:, :, ::3] *= 2.0**-20                  # class-token-like rows: flushed, moving scores by ~2**-12
        v[0, 1, 32:] *= 1e-39
    else:
        q, k, v = mk(sq, -2, 1), mk(sk, -2, 1), mk(sk, -2, 1) * 1e-39
    v[0, 0, :7] = 0.0
    return q, k, v

def bits(x):
    return torch.tensor(x, dtype=torch.float32).view(torch.int32).item()

def expected(q, k, v, layout, anchor, fp8=False, v_channels=False):
    if anchor:
        perm = anchor_permutation(k.shape[-2], anchor)
        k, v = k[:, :, perm], v[:, :, perm]
    if fp8:
        ranges = [fm.ScaleRange.of(fm.fp8_pow2_scale_counts(q, 1)), fm.ScaleRange.of(fm.fp8_pow2_scale_counts(k, 32))]
    else:
        ranges = [fm.nvfp4_quantize(x, layout).scale_range for x in (q, k)]
    ranges.append(fm.ScaleRange.of(fm.fp8_channel_scale_counts(v) if v_channels else fm.mxfp4_scale_counts(v)))
    limit = bits(sr.qk_flush_limit(S)) if any(r.underflow for r in ranges) else 0
    return dict(want=list(sr.significant_underflow(ranges, S)) + [r.overflow for r in ranges],
                flushed=[r.underflow for r in ranges],
                pending=[r.underflow for r in ranges] + [bits(r.flushed) for r in ranges]
                        + [bits(r.amax) for r in ranges] + [limit])

def recorded(run):   # the record after the pre-pass alone, then after the decision (twice)
    fields = torch.zeros(NUM_FIELDS, dtype=torch.int32)
    fields[FIRST_CALL] = 2**31 - 1
    flag = torch.zeros(1, dtype=torch.int32)
    run((fields, flag, 7))
    before = fields.tolist()
    scale_record.decide((fields, flag, 7))
    words = fields.tolist()
    scale_record.decide((fields, flag, 7))
    assert words[:3] == [0, 0, 0]
    return dict(counts=words[SCALE_UNDERFLOW:SCALE_UNDERFLOW + 3] + words[SCALE_OVERFLOW:SCALE_OVERFLOW + 3],
                first=words[FIRST_CALL], flag=int(flag[0]), call_words=words[CALL_UNDERFLOW:],
                pending_under=before[SCALE_UNDERFLOW:SCALE_UNDERFLOW + 3],
                pending_over=before[SCALE_OVERFLOW:SCALE_OVERFLOW + 3], pending_words=before[CALL_UNDERFLOW:],
                second_decision_changed=fields.tolist() != words)

res = {}
for kind, dims, anchors in (("wide", (64, 128), (0, 32)), ("harmless", (64,), (0,)), ("tiny_v", (64,), (0,))):
    for d in dims:
        q, k, v = inputs(d, kind)
        for layout in ("folded64_mse", "block16"):
            for anchor in anchors:
                want = expected(q, k, v, layout, anchor)
                perm32 = hp.cached_anchor_permutation(45, anchor, q.device, torch.int32) if anchor else None
                paths = {
                    "hopper_fused": lambda r: htp.prepass(q, k, v, layout, perm32, record=(*r, S)),
                    "hopper_torch": lambda r: hpt.kernel_operands(q, k, v, layout, anchor, record=(*r, S)),
                    "blackwell_fused": lambda r: bp.kernel_operands(q, k, v, layout, anchor, 64, 64, True, (*r, S)),
                    "blackwell_torch": lambda r: bp.kernel_operands(q, k, v, layout, anchor, 64, 64, False, (*r, S)),
                }
                for name, run in paths.items():
                    res[f"{kind}-{name}-{d}-{layout}-{anchor}"] = dict(recorded(run), **want)
        for anchor in anchors:
            want = expected(q, k, v, None, anchor, fp8=True)
            perm32 = hp.cached_anchor_permutation(45, anchor, q.device, torch.int32) if anchor else None
            res[f"{kind}-hopper_fp8_fused-{d}-{anchor}"] = dict(
                recorded(lambda r: htp.fp8_prepass(q, k, v, perm32, record=(*r, S))), **want)
            res[f"{kind}-hopper_fp8_torch-{d}-{anchor}"] = dict(
                recorded(lambda r: hpt.kernel_operands(q, k, v, "fp8_e4m3", anchor, record=(*r, S))), **want)
        # the FP8 P/V policy `fp8` (no anchors): the Q/K pass without V, then V's own pass (one scale per channel)
        res[f"{kind}-hopper_fp8pv_fused-{d}-0"] = dict(
            recorded(lambda r: (htp.fp8_prepass(q, k, v[..., :0, :], record=(*r, S)), htp.fp8_values(v, (*r, S)))),
            **expected(q, k, v, None, 0, fp8=True, v_channels=True))
# no record, or call 0: nothing written
q, k, v = inputs(64, "wide")
fields = torch.zeros(NUM_FIELDS, dtype=torch.int32)
htp.prepass(q, k, v, "folded64_mse", record=(fields, fields, 0, S))
hpt.kernel_operands(q, k, v, "block16", 0, record=None)
scale_record.decide((fields, fields, 0, S))
scale_record.decide(None)
res["untouched"] = fields.tolist()
print("RESULT" + json.dumps(res))
"""


@pytest.fixture(scope="module")
def interpreted(interpreted_result):
    return interpreted_result(_SCRIPT, "scale_record")


def _cases(interpreted: dict) -> dict:
    return {k: v for k, v in interpreted.items() if k != "untouched"}


def test_every_pre_pass_counts_what_the_formats_count(interpreted):
    cases = _cases(interpreted)
    assert len(cases) == 2 * 2 * 2 * 4 + 2 * 2 * 2 + 2 * (2 * 4 + 2) + 2 + 1 + 1
    wrong = {k: (v["counts"], v["want"]) for k, v in cases.items() if v["counts"] != v["want"]}
    assert wrong == {}
    # the inputs exercise every count: q flushes, k saturates, v flushes (where the anchor permutation does not
    # mix its tiny block with others); FP8 groups of whole query rows do not underflow here, and count no overflow
    wide = {k: v for k, v in cases.items() if k.startswith("wide")}
    assert all(v["want"][0] > 0 and v["want"][4] > 0 for k, v in wide.items() if "fp8" not in k)
    assert all(v["want"][3:] == [0, 0, 0] for k, v in wide.items() if "fp8" in k)
    assert all(v["flushed"][2] > 0 for k, v in wide.items() if k.endswith("-0") and "fp8pv" not in k)
    # V's channel scale spans every key: a tiny 32-token block among unit values is no underflow there
    assert all(v["flushed"][2] == 0 for k, v in wide.items() if "fp8pv" in k)


def test_underflows_count_only_where_they_can_change_the_result(interpreted):
    """Flushed q rows against unit k and one tiny V block among unit ones are counted by the formats and left out
    by the criterion (no word, no flag); a V that flushes everywhere counts (the FP8 P/V V pass's channels too); the
    wide inputs' tiny V block, among values up to 2**3, does not."""
    cases = _cases(interpreted)
    harmless = {k: v for k, v in cases.items() if k.startswith("harmless")}
    assert all(v["flushed"][0] > 0 and v["flushed"][2] > 0 for k, v in harmless.items() if "fp8" not in k)
    assert all(v["counts"] == [0] * 6 and v["flag"] == 0 for v in harmless.values())
    assert all(v["counts"][2] > 0 for k, v in cases.items() if k.startswith("tiny_v"))
    assert all(v["counts"][2] == 0 for k, v in cases.items() if k.startswith("wide"))


def test_a_count_raises_the_flag_under_the_calls_number(interpreted):
    flagged = {k: (v["first"], v["flag"]) for k, v in _cases(interpreted).items()}
    assert {k: f for k, f in flagged.items()
            if f != ((7, 7) if any(interpreted[k]["want"]) else (2**31 - 1, 0))} == {}


def test_the_decision_is_pending_after_the_pre_pass(interpreted):
    """A pre-pass alone adds its overflows to the record and leaves the underflows to the call's attention kernel:
    the record's underflow words untouched, the call's words holding the formats' underflow counts, flushed bounds
    and maxima (float32 bits) and, where any block flushed, the call's q/k flush limit."""
    cases = _cases(interpreted)
    assert {k: v["pending_under"] for k, v in cases.items() if v["pending_under"] != [0, 0, 0]} == {}
    assert {k: (v["pending_over"], v["want"][3:]) for k, v in cases.items() if v["pending_over"] != v["want"][3:]} == {}
    assert {k: (v["pending_words"], v["pending"]) for k, v in cases.items() if v["pending_words"] != v["pending"]} == {}
    flushing = [v for v in cases.values() if any(v["flushed"])]
    assert len(flushing) > len(cases) // 2 and all(v["pending_words"][-1] != 0 for v in flushing)


def test_the_decision_clears_the_calls_words(interpreted):
    """``decide`` (the attention kernel's decision, launched alone) clears every call word of every path; a second
    decision finds nothing and changes nothing."""
    assert {k: v["call_words"] for k, v in _cases(interpreted).items() if any(v["call_words"])} == {}
    assert [k for k, v in _cases(interpreted).items() if v["second_decision_changed"]] == []


def test_nothing_is_written_without_a_record(interpreted):
    assert interpreted["untouched"] == [0] * len(interpreted["untouched"])
