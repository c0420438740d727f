"""The Hopper custom op's declared output, on any machine: under fake tensors (torch.compile's tracing) the op gives
the launcher's layout, (B, H, S, D) laid out as (B, S, H, D) in memory, so that a compiled processor's transpose and
reshape after it are views. The GPU test ``test_output_is_bshd_in_memory_as_the_op_declares`` (opcheck) holds the
real output to the same strides."""

import importlib

import torch
from torch._subclasses.fake_tensor import FakeTensorMode

import fp4vis
from fp4vis.backends.range_record import policy_text


def test_fake_output_is_bshd_in_memory():
    importlib.import_module("fp4vis.kernels.hopper.op")   # registers torch.ops.fp4vis.hopper_attention
    b, s, h, d = 2, 300, 3, 64
    with FakeTensorMode():
        q, k, v = (torch.empty(b, s, h * d, dtype=torch.bfloat16).view(b, s, h, d).transpose(1, 2) for _ in range(3))
        out = torch.ops.fp4vis.hopper_attention(q, k, v, 0.125, policy_text(fp4vis.get_policy("fp8")))
        flat = out.transpose(1, 2).reshape(b, s, h * d)
    assert out.shape == (b, h, s, d) and out.transpose(1, 2).is_contiguous()
    assert flat._is_view()   # no copy
