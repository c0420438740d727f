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
from fp4vis.call import AttentionCall
from fp4vis.range_report import RangeReport

NAME = "recording_reference"


class RecordingReference(Backend):
    """The reference's output and counts, reported through the range record like a kernel: NaN
    and Inf inputs propagate to a NaN output (as the kernel's pre-pass and kernel do)."""

    name = NAME
    records_range = True

    def __init__(self):
        self.records = []

    def supports(self, call):
        return None

    def run(self, call):
        if call.record_site:   # under torch.compile: an op, which starts the record at run time (as the kernels')
            return torch.ops.fp4vis_tests.recording_attention(call.q, call.k, call.v, call.scale,
                                                              call.record_site), None
        self.records.append(call.record)
        return attention_recorded(call.q, call.k, call.v, call.policy, call.scale, call.record), None


def attention_recorded(q, k, v, policy, scale, record):
    if all(bool(torch.isfinite(t).all()) for t in (q, k, v)):
        out, report = ReferenceBackend().run(AttentionCall(q, k, v, policy, scale))
    else:
        out = torch.full(q.shape[:-1] + v.shape[-1:], math.nan, dtype=q.dtype)
        report = RangeReport(nonfinite_outputs=out.numel())
    if record is not None and record[2] and not report.ok:
        rec = range_record.record_for(q.device)
        counts = (report.saturated_blocks, report.empty_rows, report.nonfinite_outputs)
        rec.fields[:3] += torch.tensor(counts, dtype=torch.int32)
        for first, per_operand in ((range_record.SCALE_UNDERFLOW, report.scale_underflow),
                                   (range_record.SCALE_OVERFLOW, report.scale_overflow)):
            rec.fields[first:first + 3] += torch.tensor(per_operand, dtype=torch.int32)
        rec.fields[range_record.FIRST_CALL] = min(int(rec.fields[range_record.FIRST_CALL]), record[2])
        rec.flag[0] = record[2]
    return out


COMPILED_RECORDS = []


@torch.library.custom_op("fp4vis_tests::recording_attention", mutates_args=())
def recording_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float,
                        record_site: int) -> torch.Tensor:
    record = range_record.start_site_call(record_site, (q, k, v))
    COMPILED_RECORDS.append(record)
    return attention_recorded(q, k, v, range_record.site_of(record_site).policy, scale, record)


@recording_attention.register_fake
def _(q, k, v, scale, record_site):
    return q.new_empty(q.shape[:-1] + v.shape[-1:])


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


def test_scale_range_surfaces_naming_the_operand(backend):
    """Block scales out of their format's range (q 1e-3, k 1e3: docs/numerics.md section 1, "Scale range")
    come back from the record as the reference counts them, naming q and k."""
    g = torch.Generator().manual_seed(3)
    q, k, v = (torch.randn(1, 2, 64, 32, generator=g) for _ in range(3))
    fp4vis.attention(q * 1e-3, k * 1e3, v, policy="fast", backend=NAME)
    with pytest.raises(range_record.DeferredRangeError,
                       match=r"call #\d+ .*128 blocks of q whose scale underflows.*blocks of k whose scale saturates"):
        fp4vis.check_range()


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


# ------------------------------------------------------------------------------------------------
# torch.compile (fullgraph): the op of the backend polls and numbers each call at run time


@pytest.fixture
def no_recompiles():
    torch._dynamo.reset()
    with torch._dynamo.config.patch(error_on_recompile=True):
        yield
    torch._dynamo.reset()


def compiled_attention(**kwargs):
    return torch.compile(lambda q, k, v: fp4vis.attention(q, k, v, **kwargs) * 2, fullgraph=True)


def test_compiled_call_reports_like_an_eager_one(backend, no_recompiles):
    f = compiled_attention(policy="fast", backend=NAME)
    sites = len(range_record._SITE_LIST)
    out = f(*ordinary())
    assert torch.equal(out, fp4vis.attention(*ordinary(), policy="fast", backend=NAME) * 2)
    f(*ordinary(2))
    assert len(range_record._SITE_LIST) == sites + 1          # named once, at trace time
    assert COMPILED_RECORDS[-1][2] > COMPILED_RECORDS[-2][2] > 0   # numbered per call, at run time
    q, k, v = (t * 12 for t in ordinary(3))                    # logits far above the range of fast
    f(q, k, v)                                                 # no error yet: no synchronisation
    number = COMPILED_RECORDS[-1][2]
    with pytest.raises(range_record.DeferredRangeError) as exc:
        f(*ordinary())                                         # the next compiled call polls in its op
    msg = str(exc.value)
    assert f"call #{number} (" in msg and "policy 'fast'" in msg and "q (1, 2, 64, 64) k (1, 2, 64, 64)" in msg
    assert "reported at the next fp4vis.attention call" in msg
    f(q, k, v)
    with pytest.raises(range_record.DeferredRangeError, match="reported at fp4vis.check_range"):
        fp4vis.check_range()


def test_compiled_call_names_its_layout_warns_and_off_records_nothing(backend, no_recompiles):
    q, k, v = (t.transpose(1, 2) for t in saturating())
    compiled_attention(policy="fast", backend=NAME, layout="bshd", range_check="warn")(q, k, v)
    with pytest.warns(RuntimeWarning, match=r"bshd q \(1, 64, 2, 64\) k \(1, 128, 2, 64\)"):
        fp4vis.check_range()
    torch._dynamo.reset()   # another function of the same code
    compiled_attention(policy="fast", backend=NAME, layout="bshd", range_check="off")(q, k, v)
    assert COMPILED_RECORDS[-1] is None
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        fp4vis.check_range()


@pytest.mark.parametrize("range_check", ["raise", "warn", "off"])
def test_compiled_reference_is_one_op_bit_equal_and_checks_its_range(range_check, no_recompiles):
    """The regression of issue 25 on the CPU: fp4vis.attention with the range check on traces with
    fullgraph=True (the reference as one op), gives the eager bits on new inputs without recompiling, and
    enforces range_check at run time."""
    def f(q, k, v):
        return fp4vis.attention(q, k, v, policy="fast", range_check=range_check) * 2

    compiled = torch.compile(f, fullgraph=True)
    for seed in (1, 2):
        assert torch.equal(compiled(*ordinary(seed)), f(*ordinary(seed)))
    q, k, v = (t * 12 for t in ordinary(3))
    if range_check == "raise":
        with pytest.raises(fp4vis.RangeExceededError, match="saturated P blocks"):
            compiled(q, k, v)
    elif range_check == "warn":
        with pytest.warns(RuntimeWarning, match="saturated P blocks"):
            compiled(q, k, v)
    else:
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            compiled(q, k, v)


@pytest.mark.parametrize("case", ["defaults", "off", "fp8qk-bshd", "vit-d64"])
def test_compiled_cases_of_the_issue_on_the_reference(case, no_recompiles):
    """The four calls that failed on the GPU (issue 25), here on the reference: bit-equal to eager."""
    kwargs, shape = {
        "defaults": ({}, (1, 2, 96, 64)),
        "off": ({"range_check": "off"}, (1, 2, 96, 64)),
        "fp8qk-bshd": ({"policy": "fast_fp8qk", "layout": "bshd"}, (1, 96, 2, 64)),
        "vit-d64": ({"policy": "fast"}, (2, 3, 50, 64)),
    }[case]
    g = torch.Generator().manual_seed(5)
    q, k, v = (torch.randn(shape, generator=g, dtype=torch.bfloat16) for _ in range(3))
    compiled = torch.compile(lambda q, k, v: fp4vis.attention(q, k, v, **kwargs), fullgraph=True)
    assert torch.equal(compiled(q, k, v), fp4vis.attention(q, k, v, **kwargs))


@torch.no_grad()
def test_compiled_patched_forward_raises_at_its_end(backend, no_recompiles):
    """A patched timm model compiled whole with fullgraph=True: the forward hook's check is an op of the
    graph (kept, and after the output), so the error comes at the end of the forward; it names the compiled
    call, not the layer (a layer's name in the graph would give every layer a graph of its own)."""
    import timm
    torch.manual_seed(0)
    model = timm.create_model("vit_tiny_patch16_224", pretrained=False, img_size=32, patch_size=8, embed_dim=64,
                              depth=2, num_heads=1, num_classes=3).eval()
    x = torch.randn(2, 3, 32, 32)
    with fp4vis.patch(model, "fast", backend=NAME):
        compiled = torch.compile(model, fullgraph=True)
        torch.testing.assert_close(compiled(x), model(x), rtol=1e-4, atol=1e-5)
        with torch.no_grad():   # layer 1's queries and keys scaled up: its logits saturate fast
            model.blocks[1].attn.qkv.weight[:128] *= 40
        with pytest.raises(range_record.DeferredRangeError) as exc:
            compiled(x)
        msg = str(exc.value)
        assert msg.startswith("compiled fp4vis.attention call #") and "layer" not in msg.split(":")[0]
        assert "reported at the end of VisionTransformer's forward" in msg


def test_compiled_calls_warn_inside_the_trace_and_keep_gradients(no_recompiles):
    """A warning issued for the first time while Dynamo traces does not break fullgraph (it is issued at trace
    time: fp4vis.tracing.warn_once); an FP4 policy's gradient stays straight-through under compile, and
    ``bf16``, exact attention, is differentiable there as in eager."""
    from fp4vis.tracing import forget_warnings

    forget_warnings()
    q, k, v = (t.requires_grad_(True) for t in ordinary(4))
    with pytest.warns(UserWarning, match="straight-through"):
        out = torch.compile(lambda q, k, v: fp4vis.attention(q, k, v, policy="fast"), fullgraph=True)(q, k, v)
    with torch.no_grad():
        assert torch.equal(out, fp4vis.attention(q, k, v, policy="fast"))
    for policy in ("fast", "bf16"):
        torch._dynamo.reset()   # one lambda code for both policies
        grads = []
        def call(q, k, v, policy=policy):
            return fp4vis.attention(q, k, v, policy=policy)

        for f in (call, torch.compile(call, fullgraph=True)):
            for t in (q, k, v):
                t.grad = None
            f(q, k, v).square().sum().backward()
            grads.append([t.grad.clone() for t in (q, k, v)])
        for eager, compiled in zip(*grads, strict=True):
            torch.testing.assert_close(compiled, eager, rtol=1e-5, atol=1e-6)


def test_a_compiled_patched_model_trains(backend, no_recompiles):
    """Training through a compiled patched model: its layers keep the model's attention for gradients (one
    FallbackWarning, issued while tracing) and the check op at the end of the forward leaves the output
    untouched, so a head that keeps its output for backward (tanh) still differentiates."""
    import timm

    from fp4vis.patching import FallbackWarning
    from fp4vis.tracing import forget_warnings

    forget_warnings()
    torch.manual_seed(0)
    model = timm.create_model("vit_tiny_patch16_224", pretrained=False, img_size=32, patch_size=8, embed_dim=64,
                              depth=2, num_heads=1, num_classes=3)
    model.head = torch.nn.Sequential(model.head, torch.nn.Tanh())
    x = torch.randn(2, 3, 32, 32)
    with fp4vis.patch(model, "fast", backend=NAME):
        eager = model(x)
        eager.sum().backward()
        expected = model.head[0].weight.grad.clone()
        model.zero_grad()
        with pytest.warns(FallbackWarning, match="gradients requested"):
            out = torch.compile(model, fullgraph=True, backend="aot_eager")(x)
        out.sum().backward()
    torch.testing.assert_close(out, eager)
    torch.testing.assert_close(model.head[0].weight.grad, expected)
