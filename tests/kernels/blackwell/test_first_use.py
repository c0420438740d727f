"""The Blackwell kernel's first-use measurement (kernels/blackwell/first_use.py): the figures, their cache with the
self-check's verdict, the once-only slower-than-BF16 warning, the sm_90 label, what `fp4vis info`, `fp4vis
selfcheck --cached` and `fp4vis bench` show. On the CPU with a fake timer (the self-check runs the reference in
place of the kernel); one GPU test measures for real."""

from __future__ import annotations

import json
import math
import warnings

import pytest
import torch

pytest.importorskip("triton")

from fp4vis.call import AttentionCall  # noqa: E402
from fp4vis.cli import main  # noqa: E402
from fp4vis.kernels.blackwell import first_use, launch, selfcheck  # noqa: E402
from fp4vis.kernels.blackwell.backend import BACKEND  # noqa: E402
from fp4vis.policy import POLICIES  # noqa: E402
from fp4vis.reference import reference_attention  # noqa: E402
from fp4vis.tracing import forget_warnings  # noqa: E402

FIRST = first_use.CallShape(2, 3, 256, 512, 64, "bf16", POLICIES["accurate"])


def _reference_kernel(q, k, v, policy, scale):
    out, _ = reference_attention(q.flatten(0, 1), k.flatten(0, 1), v.flatten(0, 1), policy, scale)
    return out.unflatten(0, q.shape[:2])


def _identity(device="FakeGPU B200", capability="10.0", route="jit") -> dict:
    return {"device": device, "capability": capability, "route": route, "source": "test"}


def _timer(ms: dict, calls: list | None = None):
    """A fake timer: ``ms[name]`` for every shape (an exception is raised); ``calls`` collects (name, shape)."""
    def timer(name, fn, shape, device):
        if calls is not None:
            calls.append((name, shape))
        if isinstance(ms[name], Exception):
            raise ms[name]
        return ms[name]
    return timer


SLOWER = _timer({"kernel": 2.0, "sdpa": 1.0, "fa4": 0.8})
FASTER = _timer({"kernel": 0.5, "sdpa": 1.0, "fa4": ImportError("No module named 'flash_attn'")})


@pytest.fixture
def fresh(tmp_path, monkeypatch):
    """An empty verdict cache and process, and a one-problem self-check (the reference on the CPU)."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    monkeypatch.setattr(selfcheck, "_VERDICTS", {})
    monkeypatch.setattr(selfcheck, "PROBLEMS", (("fast", 64, "bf16", 1, 1, 40, 70),))
    forget_warnings()
    yield tmp_path / "fp4vis" / selfcheck.CACHE_FILE
    forget_warnings()


def _fake_gpu(monkeypatch, **identity):
    monkeypatch.setattr(launch, "identity", lambda device: _identity(**identity))


def test_measure_figures_ratios_and_reasons():
    calls = []
    t = first_use.measure("cpu", _identity(), _reference_kernel, FIRST, _timer(
        {"kernel": 0.5, "sdpa": 1.0, "fa4": ImportError("No module named 'flash_attn'")}, calls))
    assert [(n, s[:6]) for n, s in calls] == [(n, s) for s in (FIRST[:6], (1, 12, 32760, 32760, 128, "bf16"))
                                              for n in ("kernel", "sdpa", "fa4")]
    assert calls[3][1].policy is POLICIES["accurate"]   # the Wan shape with the first call's policy
    assert t["gpu"] == "FakeGPU B200" and t["route"] == "jit" and t["launch"] == "jit" and t["date"][:2] == "20"
    first, wan = t["shapes"]
    assert (first["label"], first["sq"], first["skv"], first["d"], first["policy"]) == ("first call", 256, 512, 64,
                                                                                        "accurate")
    assert wan["label"] == first_use.WAN_LABEL and (wan["h"], wan["sq"], wan["d"]) == (12, 32760, 128)
    assert first["kernel_ms"] == 0.5 and first["speedup_vs_sdpa"] == 2.0
    assert first["fa4_ms"] is None and first["speedup_vs_fa4"] is None
    assert first["reasons"] == {"fa4": "ImportError: No module named 'flash_attn'"}
    text = first_use.format_timing(t)
    assert "first call: B2 H3 S256/512 D64 bf16 accurate" in text and "2.00x" in text
    assert "fa4 not measured: ImportError" in text and "not a Blackwell figure" not in text
    assert "= 2.00x BF16 SDPA" in first_use.summary(t)
    # a first call of the Wan shape itself is measured once
    wan_call = first_use.CallShape(1, 12, 32760, 32760, 128, "bf16", POLICIES["wan_fast"])
    assert len(first_use.measure("cpu", _identity(), _reference_kernel, wan_call, FASTER)["shapes"]) == 1


def test_the_timers_functions_are_the_kernel_and_sdpa():
    """What the timer is handed: the kernel with the shape's policy and 1/sqrt(D), and SDPA (default dispatch)."""
    got = {}

    def timer(name, fn, shape, device):
        if name == "fa4":
            raise ImportError("not here")
        q, k, v = selfcheck.make_inputs((1, 1, 8, 20, shape.d), torch.float32, seed=3)
        got[name] = fn(q, k, v)
        return 1.0
    first_use.measure("cpu", _identity(), _reference_kernel, FIRST, timer)
    q, k, v = selfcheck.make_inputs((1, 1, 8, 20, 128), torch.float32, seed=3)   # the Wan shape's (last) inputs
    assert torch.equal(got["sdpa"], torch.nn.functional.scaled_dot_product_attention(q, k, v))
    assert torch.equal(got["kernel"], _reference_kernel(q, k, v, POLICIES["accurate"], 1 / math.sqrt(128)))


def test_a_failed_measurement_is_a_reason_not_an_error():
    t = first_use.measure("cpu", _identity(), _reference_kernel, FIRST, _timer(
        {"kernel": torch.OutOfMemoryError("CUDA out of memory"), "sdpa": 1.0, "fa4": 1.0}))
    assert all(r["kernel_ms"] is None and r["speedup_vs_sdpa"] is None and "OutOfMemoryError" in r["reasons"]["kernel"]
               for r in t["shapes"])
    assert "not measured (OutOfMemoryError: CUDA out of memory)" in first_use.summary(t)
    assert first_use.slower_shapes(t) == []
    # the real timer refuses a device that is not CUDA before making any input
    t = first_use.measure("cpu", _identity(), _reference_kernel, None)
    assert [r["label"] for r in t["shapes"]] == [first_use.WAN_LABEL]
    assert t["shapes"][0]["reasons"]["kernel"] == "RuntimeError: the timer needs a CUDA device, got cpu"


def test_figures_are_cached_with_the_verdict(fresh, monkeypatch, blackwell_kernel):
    _fake_gpu(monkeypatch)
    calls = []
    blackwell_kernel(_reference_kernel)
    v = launch.verdict(torch.device("cpu"), shape=FIRST,
                       timer=_timer({"kernel": 2.0, "sdpa": 1.0, "fa4": 1.0}, calls))
    assert v["passed"] and v["cached"] and len(calls) == 6
    disk = json.loads(fresh.read_text())
    (entry,) = disk.values()
    assert entry["timing"] == v["timing"] and "cached" not in entry
    selfcheck._VERDICTS.clear()   # a new process: the disk's figures, nothing measured or checked again

    def boom(*a):
        raise AssertionError("must not run")
    blackwell_kernel(boom)
    again = launch.verdict(torch.device("cpu"), shape=FIRST, timer=boom)
    assert again["timing"] == v["timing"]
    # a forced check measures again
    blackwell_kernel(_reference_kernel)
    forced = launch.verdict(torch.device("cpu"), force=True, timer=FASTER)
    assert forced["timing"]["shapes"][0]["kernel_ms"] == 0.5
    assert json.loads(fresh.read_text())[selfcheck.identity_key(_identity())]["timing"]["shapes"][0]["kernel_ms"] == 0.5


def test_a_verdict_without_figures_gets_them_and_a_failed_one_none(fresh, monkeypatch, blackwell_kernel):
    _fake_gpu(monkeypatch, device="older")
    v = selfcheck.verdict_for(_identity(device="older"), _reference_kernel, "cpu")   # cached without timing
    assert "timing" not in v
    blackwell_kernel(_reference_kernel)
    assert "timing" in launch.verdict(torch.device("cpu"), timer=FASTER)
    _fake_gpu(monkeypatch, device="wrong")
    with pytest.raises(selfcheck.SelfCheckError):
        blackwell_kernel(lambda *a: _reference_kernel(*a) * 1.1)
        launch.ensure_verified(torch.device("cpu"), timer=FASTER)
    assert "timing" not in selfcheck.known_verdict(_identity(device="wrong"))


def test_nothing_is_measured_under_capture_or_tracing(fresh, monkeypatch, blackwell_kernel):
    _fake_gpu(monkeypatch)
    selfcheck.verdict_for(_identity(), _reference_kernel, "cpu")   # checked before, no figures yet

    def boom(*a):
        raise AssertionError("must not measure")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: True)
    blackwell_kernel(_reference_kernel)
    assert "timing" not in launch.ensure_verified(torch.device("cpu"), timer=boom)
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: False)
    monkeypatch.setattr(torch.compiler, "is_compiling", lambda: True)
    assert first_use.cannot_measure_now() == "torch.compile is tracing"
    blackwell_kernel(_reference_kernel)
    assert "timing" not in launch.ensure_verified(torch.device("cpu"), timer=boom)
    monkeypatch.setattr(torch.compiler, "is_compiling", lambda: False)
    blackwell_kernel(_reference_kernel)
    assert "timing" in launch.ensure_verified(torch.device("cpu"), timer=FASTER)


def test_slower_than_bf16_is_said_once_per_process_and_identity(fresh, monkeypatch, blackwell_kernel):
    _fake_gpu(monkeypatch)
    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter("always")
        for _ in range(3):
            blackwell_kernel(_reference_kernel)
            launch.ensure_verified(torch.device("cpu"), shape=FIRST, timer=SLOWER)
        _fake_gpu(monkeypatch, device="FakeGPU RTX 5090", capability="12.0")
        blackwell_kernel(_reference_kernel)
        launch.ensure_verified(torch.device("cpu"), timer=SLOWER)
        _fake_gpu(monkeypatch, device="fast one")
        blackwell_kernel(_reference_kernel)
        launch.ensure_verified(torch.device("cpu"), timer=FASTER)
    msgs = [str(x.message) for x in w if "slower than BF16" in str(x.message)]
    assert len(msgs) == 2
    assert "FakeGPU B200 (sm_100, route jit)" in msgs[0] and "0.50x SDPA at first call" in msgs[0]
    assert "0.40x flash-attn-4 at Wan2.1-1.3B 480p" in msgs[0] and "FakeGPU RTX 5090" in msgs[1]
    selfcheck._VERDICTS.clear()   # the figures from the disk still warn (once) in a new process
    forget_warnings()
    _fake_gpu(monkeypatch)
    with pytest.warns(UserWarning, match="slower than BF16"):
        launch.ensure_verified(torch.device("cpu"))


def test_the_sm90_route_is_labelled_not_blackwell(fresh, monkeypatch, blackwell_kernel):
    _fake_gpu(monkeypatch, device="NVIDIA H200", capability="9.0", route="cubin")
    with pytest.warns(UserWarning, match=r"NVIDIA H200 \(sm_90, route sm_90 verification \(not Blackwell\)"):
        blackwell_kernel(_reference_kernel)
        v = launch.ensure_verified(torch.device("cpu"), timer=SLOWER)
    assert v["timing"]["route"] == first_use.SM90_ROUTE == "sm_90 verification (not Blackwell)"
    assert v["timing"]["launch"] == "cubin"
    assert "not a Blackwell figure" in first_use.format_timing(v["timing"])
    assert "not a Blackwell figure" in first_use.summary(v["timing"])


def test_the_backends_first_call_is_the_measured_shape(fresh, monkeypatch, blackwell_kernel):
    _fake_gpu(monkeypatch)
    calls = []
    monkeypatch.setattr(first_use, "cuda_event_timer", _timer({"kernel": 0.5, "sdpa": 1.0, "fa4": 1.0}, calls))
    blackwell_kernel(_reference_kernel)
    q, k, v = (torch.randn(1, 2, s, 64, dtype=torch.bfloat16) for s in (24, 40, 40))
    BACKEND.run(AttentionCall(q, k, v, POLICIES["guard"], 0.125))
    assert calls[0][1] == first_use.CallShape(1, 2, 24, 40, 64, "bf16", POLICIES["guard"])
    assert first_use.call_shape(AttentionCall(q.half(), k.half(), v.half(), POLICIES["fast"], 0.1)).dtype == "fp16"


def test_info_shows_the_figures(fresh, monkeypatch, blackwell_kernel, capsys):
    _fake_gpu(monkeypatch, device="NVIDIA H200", capability="9.0")
    blackwell_kernel(_reference_kernel)
    launch.verdict(torch.device("cpu"), shape=FIRST, timer=SLOWER)
    assert main(["info"]) == 0
    out = capsys.readouterr().out
    line = next(x for x in out.splitlines() if "FP4 vs BF16 on NVIDIA H200" in x)
    assert "not a Blackwell figure" in line and "0.50x BF16 SDPA, 0.40x flash-attn-4" in line
    assert "selfcheck: {'NVIDIA H200': 'passed'}" in out


def test_selfcheck_cached_prints_the_figures(fresh, monkeypatch, blackwell_kernel, capsys):
    _fake_gpu(monkeypatch, device="NVIDIA H200", capability="9.0")
    blackwell_kernel(_reference_kernel)
    launch.verdict(torch.device("cpu"), shape=FIRST, timer=FASTER)
    selfcheck._VERDICTS.clear()   # `fp4vis selfcheck --cached` in a new process: the disk's verdict
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(BACKEND, "unavailable_reason", lambda: None)
    blackwell_kernel(lambda *a: pytest.fail("--cached must not run the kernel"))
    assert main(["selfcheck", "--cached"]) == 0
    out = capsys.readouterr().out
    assert "verdict: passed" in out
    assert "first-use timing on NVIDIA H200 (sm_90, route sm_90 verification (not Blackwell)" in out
    assert "not a Blackwell figure" in out and "vs SDPA" in out
    assert "first call: B2 H3 S256/512 D64 bf16 accurate" in out and "2.00x" in out
    assert "FP4 vs BF16 on NVIDIA H200" in out and "= 2.00x BF16 SDPA" in out


def test_bench_labels_the_blackwell_route_and_refuses_quick_with_backends(capsys):
    from fp4vis.evals import kernel_bench as kb

    rows = [dict(shape="B1 S4096 H24 D128", s=4096, d=128, backend="blackwell", policy="fast", ms=20.0,
                 route=first_use.SM90_ROUTE),
            dict(shape="B1 S4096 H24 D128", s=4096, d=128, backend="sdpa_cudnn", policy=None, ms=1.0)]
    table = kb.summary_table(rows)
    assert "blackwell rows: route sm_90 verification (not Blackwell)" in table and "nothing about Blackwell" in table
    assert kb.route_notes([dict(backend="blackwell", route="jit")]) == ["", "blackwell rows: route jit"]
    assert kb.route_notes(rows[1:]) == []
    assert main(["bench", "--quick", "--backend", "blackwell"]) == 2
    assert "--quick times the reference backend on the CPU only" in capsys.readouterr().err


@pytest.mark.gpu
def test_first_use_measures_on_this_gpu():
    from fp4vis.kernels.blackwell import route

    dev = torch.device("cuda", torch.cuda.current_device())
    if isinstance(route.route(dev.index), str):
        pytest.skip(f"the Blackwell kernel does not run here: {route.route(dev.index)}")
    ident = launch.identity(dev)
    t = first_use.measure(dev, ident, launch.checked_attention,
                          first_use.CallShape(1, 4, 1024, 1024, 128, "bf16", POLICIES["fast"]))
    print(first_use.format_timing(t))
    for r in t["shapes"]:
        assert r["kernel_ms"] > 0 and r["sdpa_ms"] > 0 and r["speedup_vs_sdpa"] > 0, r
        assert (r["fa4_ms"] or 0) > 0 or "fa4" in r.get("reasons", {})
    assert t["route"] == (first_use.SM90_ROUTE if ident["capability"] == "9.0" else ident["route"])
