"""The backend registry: names, lazy loading of kernel backends, the choice for a call, and the
named checks backends compose their ``supports`` from."""

from __future__ import annotations

import pytest
import torch

import fp4vis
from fp4vis.backends import base, registry
from fp4vis.call import AttentionCall
from fp4vis.policy import POLICIES


def gaussian(*shape, seed=0):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


def test_names_in_one_place():
    names = registry.backend_names()
    assert names[:2] == [base.AUTO, base.REFERENCE] and set(names[2:4]) == {"hopper", "blackwell"}   # entry points
    with pytest.raises(ValueError, match="unknown backend 'nope'; known backends are auto, reference, blackwell, "
                                         "hopper"):
        registry.get_backend("nope")
    assert set(fp4vis.available_backends()) == set(registry.backend_names()[1:])
    assert fp4vis.available_backends()["reference"] is None


def test_auto_on_cpu_is_the_reference():
    q = gaussian(1, 1, 8, 64)
    chosen = registry.select_backend("auto", AttentionCall(q, q, q, POLICIES["fast"], 0.125))
    assert chosen.name == "reference"
    assert registry.kernel_backend_name(q.device) is None


def test_a_registered_backend_is_selectable_and_its_reason_raises(monkeypatch):
    class Half(base.Backend):
        name = "half"

        def supports(self, call):
            return base.first_reason(base.need_direct_p(call.policy),
                                     base.need_head_dims(call.q, call.k, call.v, (64,)))

        def run(self, call):
            return registry.get_backend("reference").run(call)

    monkeypatch.setitem(registry._REGISTRY, "half", Half())
    q = gaussian(1, 2, 8, 64)
    out = fp4vis.attention(q, q, q, policy="fast", backend="half")
    assert torch.equal(out, fp4vis.attention(q, q, q, policy="fast", backend="reference"))
    with pytest.raises(RuntimeError, match="backend='half' cannot run this call: policy 'bf16' is not a Direct-P"):
        fp4vis.attention(q, q, q, policy="bf16", backend="half")
    q32 = gaussian(1, 2, 8, 32)
    with pytest.raises(RuntimeError, match="head dims q/k/v = 32/32/32 \\(the kernel supports 64\\)"):
        fp4vis.attention(q32, q32, q32, policy="fast", backend="half")


def test_named_checks():
    q = gaussian(1, 1, 4, 64)
    assert base.first_reason(None, None) is None
    assert base.first_reason(None, "b", "c") == "b"
    assert base.need_cuda_capability(q, ((9, 0),), "sm_90") == "tensors are not on a CUDA device"
    assert base.need_dtype(q, (torch.bfloat16, torch.float16)) == (
        "dtype torch.float32 (the kernel takes bfloat16 or float16)")
    assert base.need_nonempty(q, q[:, :, :0]) == "empty sequence"


def test_hopper_backend_forced_on_cpu_raises():
    q = gaussian(1, 1, 8, 64)
    with pytest.raises(RuntimeError, match="backend='hopper'"):
        fp4vis.attention(q, q, q, backend="hopper")


def test_backend_registers_and_explains_cpu():
    import fp4vis
    hopper_backend = pytest.importorskip("fp4vis.kernels.hopper.backend")

    backend = registry.get_backend("hopper")
    assert isinstance(backend, hopper_backend.HopperBackend)
    q = torch.randn(1, 1, 8, 64, dtype=torch.bfloat16)
    assert backend.supports(AttentionCall(q, q, q, POLICIES["fast"], 0.125)) == "tensors are not on a CUDA device"
    assert backend.supports(AttentionCall(q, q, q, POLICIES["bf16"], 0.125)) == (
        "policy 'bf16' (method 'exact') is neither Direct-P nor the FP8 P/V softmax")
    assert backend.supports(AttentionCall(q, q, q, POLICIES["fp8"], 0.125)) == "tensors are not on a CUDA device"
    if not torch.cuda.is_available():
        assert fp4vis.available_backends()["hopper"] is not None
        with pytest.raises(RuntimeError):
            fp4vis.attention(q, q, q, policy="fast", backend="hopper")


def test_import_is_light_and_the_reference_is_one_op_under_compile():
    """``import fp4vis`` does not import torch._dynamo (seconds: issue 16's newcomer path); under
    torch.compile the reference is one op of the graph (no graph break, and no trace of every chunk)."""
    import subprocess
    import sys
    code = "import sys, fp4vis; print('torch._dynamo' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "False"
    q, k, v = (torch.randn(1, 2, 40, 32) for _ in range(3))
    torch._dynamo.reset()
    explained = torch._dynamo.explain(lambda q, k, v: fp4vis.attention(q, k, v, policy="fast") * 2)(q, k, v)
    assert explained.graph_break_count == 0 and explained.graph_count == 1
    ops = [n.target for g in explained.graphs for n in g.graph.nodes if n.op == "call_function"]
    assert torch.ops.fp4vis.reference_attention.default in ops or torch.ops.fp4vis.reference_attention in ops
    torch._dynamo.reset()


def test_the_kernels_availability_check_traces_without_a_cache_warning(monkeypatch):
    """The per-call checks a compiled call traces (the Hopper backend's CuTe DSL import check, the device
    capability) are memoised in plain dicts: Dynamo warns at every compiled call site that traces a
    ``functools.cache`` function (seen on the H200 under ``eval wan --compile``). Dynamo runs them for real:
    where the process's first call is compiled, the next does not recompile on the memos it filled (seen on
    the H200, 20261203m's last run)."""
    import warnings

    import torch

    from fp4vis.backends import base
    from fp4vis.kernels.hopper import backend as hopper

    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda index=None: (9, 0))
    monkeypatch.setattr(base, "_CAPABILITIES", {})

    def f(x):
        return x + (1 if hopper._cutlass_import_error() is None else 2) + base.device_capability(0)[0]

    monkeypatch.setattr(hopper, "_CUTLASS_IMPORT", {})
    with warnings.catch_warnings(record=True) as caught, torch._dynamo.config.patch(error_on_recompile=True):
        warnings.simplefilter("always")
        torch._dynamo.reset()
        compiled = torch.compile(f, fullgraph=True, backend="eager")
        compiled(torch.ones(2))   # the process's first call is compiled: the checks fill their memos then
        compiled(torch.ones(2))   # and the next call does not recompile on the filled memo
    assert not [w for w in caught if "lru_cache" in str(w.message)]
