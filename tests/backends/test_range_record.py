"""The range record (fp4vis.backends.range_record) on the CPU: a backend that writes the record as the
Hopper kernel does (its counts added to the fields, the earliest call's number kept, the flag set)
stands in for the kernel, so that when and how the errors surface is tested without a GPU: not at the
call, at the next call, at fp4vis.check_range(), at the end of a patched model's forward; the counts
the reference reports; warn mode; NaN inputs named while they are alive; no record under "off". The
kernel's side of the contract (its counts equal the reference's) is tested on the H200
(tests/kernels/hopper/test_hopper_range.py)."""

from __future__ import annotations

import math
import warnings

import pytest
import torch

import fp4vis
from fp4vis.backends import range_record
from fp4vis.backends.base import Backend
from fp4vis.backends.reference import ReferenceBackend
from fp4vis.backends.registry import _REGISTRY, register_backend
from fp4vis.reference import RangeReport

NAME = "recording_reference"


class RecordingReference(Backend):
    """The reference's output and counts, reported through the range record like a kernel: NaN
    and Inf inputs propagate to a NaN output (as the kernel's pre-pass and kernel do)."""

    name = NAME
    records_range = True

    def __init__(self):
        self.records = []

    def unsupported_reason(self, q, k, v, policy, scale):
        return None

    def forward(self, q, k, v, policy, scale, record=None):
        self.records.append(record)
        if all(bool(torch.isfinite(t).all()) for t in (q, k, v)):
            out, report = ReferenceBackend().forward(q, k, v, policy, scale)
        else:
            out = torch.full(q.shape[:-1] + v.shape[-1:], math.nan, dtype=q.dtype)
            report = RangeReport(nonfinite_outputs=out.numel())
        if record is not None and not report.ok:
            rec = range_record.record_for(q.device)
            counts = (report.saturated_blocks, report.empty_rows, report.nonfinite_outputs)
            rec.fields[:3] += torch.tensor(counts, dtype=torch.int32)
            rec.fields[range_record.FIRST_CALL] = min(int(rec.fields[range_record.FIRST_CALL]), record[2])
            rec.flag[0] = record[2]
        return out, None


@pytest.fixture
def backend():
    be = RecordingReference()
    register_backend(be)
    yield be
    _REGISTRY.pop(NAME, None)
    range_record.discard(torch.device("cpu"))


def saturating(seed=40):
    g = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(1, 2, n, 64, generator=g) for n in (64, 128, 128))
    return q * 12, k * 12, v    # logits far above 127 binades over m = 0: fast saturates


def ordinary(seed=1):
    g = torch.Generator().manual_seed(seed)
    return tuple(torch.randn(1, 2, 64, 64, generator=g) for _ in range(3))


def test_error_surfaces_at_the_next_call_with_the_reference_counts(backend):
    q, k, v = saturating()
    with pytest.raises(fp4vis.RangeExceededError) as expected:
        fp4vis.attention(q, k, v, policy="fast", backend="reference")
    out = fp4vis.attention(q, k, v, policy="fast", backend=NAME)   # no error yet: no synchronisation
    assert out.shape == (1, 2, 64, 64)
    number = backend.records[-1][2]
    with pytest.raises(range_record.DeferredRangeError) as exc:
        fp4vis.attention(*ordinary(), policy="fast", backend=NAME)
    msg = str(exc.value)
    assert f"call #{number} (" in msg and "policy 'fast'" in msg and "q (1, 2, 64, 64) k (1, 2, 128, 64)" in msg
    assert "reported at the next fp4vis.attention call" in msg
    # the same counts and advice as the reference's own error
    assert msg.endswith(str(expected.value)), (msg, str(expected.value))
    fp4vis.check_range()            # reported once: nothing left


def test_check_range_reports_the_earliest_call(backend):
    q, k, v = saturating()
    fp4vis.attention(*ordinary(), policy="fast", backend=NAME)
    fp4vis.attention(q, k, v, policy="fast", backend=NAME)
    first = backend.records[-1][2]
    rec = range_record.record_for(torch.device("cpu"))
    rec.flag[0] = 0                  # the flag is not seen yet (a kernel still running)
    fp4vis.attention(q * 2, k, v, policy="fast", backend=NAME)   # a second bad call before any check
    with pytest.raises(range_record.DeferredRangeError, match=f"call #{first} .*reported at fp4vis.check_range"):
        fp4vis.check_range()
    fp4vis.check_range()


def test_warn_mode_warns_and_off_records_nothing(backend):
    q, k, v = saturating()
    fp4vis.attention(q, k, v, policy="fast", backend=NAME, range_check="warn")
    with pytest.warns(RuntimeWarning, match="saturated P blocks"):
        fp4vis.check_range()
    fp4vis.attention(q, k, v, policy="fast", backend=NAME, range_check="off")
    assert backend.records[-1] is None
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        fp4vis.check_range()
        fp4vis.attention(*ordinary(), policy="fast", backend=NAME)


def test_nonfinite_input_named_while_alive(backend):
    q, k, v = ordinary()
    k = k.clone()
    k[0, 1, 3, 5] = math.inf
    fp4vis.attention(q, k, v, policy="fast", backend=NAME)
    with pytest.raises(range_record.DeferredInputError, match=r"k: contains Inf; attention inputs must be finite"):
        fp4vis.check_range()
    # freed before the check: a range error that says the inputs could not be inspected
    fp4vis.attention(q.clone(), k.clone(), v.clone(), policy="fast", backend=NAME)
    with pytest.raises(range_record.DeferredRangeError, match="could not be inspected"):
        fp4vis.check_range()


def test_check_costs_nothing_without_recorded_calls(backend, monkeypatch):
    fp4vis.attention(*ordinary(), policy="fast", backend=NAME)
    fp4vis.check_range()
    calls = []
    rec = range_record.record_for(torch.device("cpu"))
    monkeypatch.setattr(rec, "collect", lambda: calls.append(1))
    fp4vis.check_range()
    fp4vis.attention(*ordinary(), policy="fast", backend="reference")   # not a recording backend
    fp4vis.check_range()
    assert calls == []


def test_patched_forward_raises_at_its_end_naming_the_layer(backend):
    import timm
    torch.manual_seed(0)
    model = timm.create_model("vit_tiny_patch16_224", pretrained=False, img_size=32, patch_size=8, embed_dim=64,
                              depth=2, num_heads=1, num_classes=3).eval()
    with torch.no_grad():   # layer 1's queries and keys scaled up: its logits saturate fast
        model.blocks[1].attn.qkv.weight[:128] *= 40
    x = torch.randn(2, 3, 32, 32)
    handle = fp4vis.patch(model, "fast", backend=NAME)
    with torch.no_grad(), pytest.raises(range_record.DeferredRangeError) as exc:
        model(x)
    msg = str(exc.value)
    assert "layer 'blocks.1.attn'" in msg and "reported at the end of VisionTransformer's forward" in msg
    assert "layer 'blocks.1.attn': " not in msg   # not prefixed with another layer's name
    handle.remove()
    with torch.no_grad():
        model(x)                    # unpatched: the hook is gone, nothing recorded
    fp4vis.check_range()
