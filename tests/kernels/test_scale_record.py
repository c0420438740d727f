"""The pre-passes of both kernel backends count the blocks whose scale leaves its format into the range
record (``kernels/scale_record.py``; docs/numerics.md section 1, "Scale range"), as ``fp4vis.formats``
counts them: run on the CPU through Triton's interpreter (the fused Triton pre-passes) and in PyTorch (the
pre-passes' PyTorch statements), every path, both layouts, with and without the anchor permutation, on
inputs whose blocks flush and saturate. Each adds its counts under the call's number and raises the flag;
without a record it writes nothing. The GPU builds are checked on the H200 (tests/kernels/hopper/test_hopper_range.py,
tests/kernels/blackwell/test_blackwell_gpu.py)."""

from __future__ import annotations

import pytest

_SCRIPT = r"""
import json
import torch
import fp4vis.formats as fm
from fp4vis.backends.range_record import FIRST_CALL, NUM_FIELDS, SCALE_OVERFLOW, SCALE_UNDERFLOW
from fp4vis.kernels.hopper import prepass as hp
from fp4vis.kernels.hopper import prepass_torch as hpt
from fp4vis.kernels.hopper import prepass_triton as htp
from fp4vis.kernels.blackwell import prepass as bp
from fp4vis.kernels.blackwell import prepass_triton as btp
from fp4vis.layout import anchor_permutation

g = torch.Generator().manual_seed(0)

def inputs(d, sq=19, sk=45):
    def mk(s, lo, hi):   # per-row exponents over a wide range: whole rows flush or saturate
        e = torch.randint(lo, hi, (1, 2, s, 1), generator=g)
        return (torch.randn(1, 2, s, d, generator=g) * torch.exp2(e)).bfloat16()
    q, k, v = mk(sq, -30, 4), mk(sk, -4, 14), mk(sk, -4, 4)
    v[0, 1, 32:] *= 1e-39                     # a 32-token V block below MXFP4's smallest scale
    v[0, 0, :7] = 0.0
    return q, k, v

def expected(q, k, v, layout, anchor, fp8=False):
    if anchor:
        perm = anchor_permutation(k.shape[-2], anchor)
        k, v = k[:, :, perm], v[:, :, perm]
    if fp8:
        counts = [fm.fp8_pow2_scale_counts(q, 1), fm.fp8_pow2_scale_counts(k, 32)]
    else:
        counts = [fm.nvfp4_quantize(x, layout).scale_range for x in (q, k)]
        counts = [torch.tensor([c.underflow, c.overflow]) for c in counts]
    counts.append(fm.mxfp4_scale_counts(v))
    return [int(c[0]) for c in counts] + [int(c[1]) for c in counts]

def recorded(run):
    fields = torch.zeros(NUM_FIELDS, dtype=torch.int32)
    fields[FIRST_CALL] = 2**31 - 1
    flag = torch.zeros(1, dtype=torch.int32)
    run((fields, flag, 7))
    words = fields.tolist()
    assert words[:3] == [0, 0, 0]
    return dict(counts=words[SCALE_UNDERFLOW:SCALE_UNDERFLOW + 3] + words[SCALE_OVERFLOW:SCALE_OVERFLOW + 3],
                first=words[FIRST_CALL], flag=int(flag[0]))

res = {}
for d in (64, 128):
    q, k, v = inputs(d)
    for layout in ("folded64_mse", "block16"):
        for anchor in (0, 32):
            want = expected(q, k, v, layout, anchor)
            perm32 = hp.cached_anchor_permutation(45, anchor, q.device, torch.int32) if anchor else None
            paths = {
                "hopper_fused": lambda r: htp.prepass(q, k, v, layout, perm32, record=r),
                "hopper_torch": lambda r: hpt.kernel_operands(q, k, v, layout, anchor, record=r),
                "blackwell_fused": lambda r: bp.prepare(q, k, v, layout, anchor, 64, 64, fused=True, record=r),
                "blackwell_torch": lambda r: bp.prepare(q, k, v, layout, anchor, 64, 64, fused=False, record=r),
            }
            for name, run in paths.items():
                res[f"{name}-{d}-{layout}-{anchor}"] = dict(recorded(run), want=want)
    for anchor in (0, 32):
        want = expected(q, k, v, None, anchor, fp8=True)
        perm32 = hp.cached_anchor_permutation(45, anchor, q.device, torch.int32) if anchor else None
        res[f"hopper_fp8_fused-{d}-{anchor}"] = dict(recorded(lambda r: htp.fp8_prepass(q, k, v, perm32, record=r)),
                                                     want=want)
        res[f"hopper_fp8_torch-{d}-{anchor}"] = dict(
            recorded(lambda r: hpt.kernel_operands(q, k, v, "fp8_e4m3", anchor, record=r)), want=want)
# no record, or call 0: nothing written
q, k, v = inputs(64)
fields = torch.zeros(NUM_FIELDS, dtype=torch.int32)
htp.prepass(q, k, v, "folded64_mse", record=(fields, fields, 0))
hpt.kernel_operands(q, k, v, "block16", 0, record=None)
res["untouched"] = fields.tolist()
print("RESULT" + json.dumps(res))
"""


@pytest.fixture(scope="module")
def interpreted(interpreted_result):
    return interpreted_result(_SCRIPT, "scale_record")


def test_every_pre_pass_counts_what_the_formats_count(interpreted):
    cases = {k: v for k, v in interpreted.items() if k != "untouched"}
    assert len(cases) == 2 * 2 * 2 * 4 + 2 * 2 * 2
    wrong = {k: (v["counts"], v["want"]) for k, v in cases.items() if v["counts"] != v["want"]}
    assert wrong == {}
    # the inputs exercise every count: q flushes, k saturates, v flushes (where the anchor permutation does not
    # mix its tiny block with others); FP8 groups of whole query rows do not underflow here, and count no overflow
    assert all(v["want"][0] > 0 and v["want"][4] > 0 for k, v in cases.items() if "fp8" not in k)
    assert all(v["want"][2] > 0 for k, v in cases.items() if k.endswith("-0"))
    assert all(v["want"][3:] == [0, 0, 0] for k, v in cases.items() if "fp8" in k)


def test_a_count_raises_the_flag_under_the_calls_number(interpreted):
    flagged = {k: (v["first"], v["flag"]) for k, v in interpreted.items() if k != "untouched"}
    assert {k: f for k, f in flagged.items() if f != ((7, 7) if any(interpreted[k]["want"]) else (2**31 - 1, 0))} == {}


def test_nothing_is_written_without_a_record(interpreted):
    assert interpreted["untouched"] == [0] * len(interpreted["untouched"])
