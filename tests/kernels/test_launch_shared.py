"""What the two launchers share (``kernels/launch_shared.py``) and the kernel variants' keys, on the CPU."""

from __future__ import annotations

import dataclasses
import logging
import threading
import time

import torch

from fp4vis.kernels.launch_shared import CompiledKernels, cached_anchor_permutation, needs_custom_op
from fp4vis.key_positions import anchor_permutation


def test_a_kernel_is_compiled_once_per_key_and_timed(caplog):
    kernels = CompiledKernels(logging.getLogger("fp4vis.test"))
    compiled = []

    def compile_kernel(name):
        def run():
            time.sleep(0.05)   # long enough for the other threads to ask meanwhile
            compiled.append(name)
            return name
        return run

    with caplog.at_level(logging.INFO, logger="fp4vis.test"):
        threads = [threading.Thread(target=kernels.get, args=("a", compile_kernel("a"), lambda k: f"built {k}"))
                   for _ in range(4)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert kernels.get("b", compile_kernel("b"), lambda k: f"built {k}") == "b"
    assert compiled == ["a", "b"]
    assert sorted(kernels.keys()) == ["a", "b"] and kernels.compile_times["a"] >= 0.05
    assert [r.getMessage().split(" in ")[0] for r in caplog.records] == ["built a", "built b"]
    kernels.clear()
    assert list(kernels.keys()) == [] and kernels.compile_times == {}


def test_the_anchor_permutation_is_kept_per_device_and_dtype():
    perm = cached_anchor_permutation(300, 16, torch.device("cpu"), torch.int32)
    assert perm.dtype == torch.int32 and torch.equal(perm.long(), anchor_permutation(300, 16, device="cpu"))
    assert cached_anchor_permutation(300, 16, torch.device("cpu"), torch.int32) is perm
    assert cached_anchor_permutation(300, 16, torch.device("cpu")).dtype == torch.long


def test_compiling_or_recording_autograd_goes_through_the_custom_op():
    q, k, v = (torch.zeros(1, 1, 4, 8) for _ in range(3))
    assert not needs_custom_op(q, k, v)
    assert needs_custom_op(q, k.requires_grad_(), v)
    with torch.no_grad():
        assert not needs_custom_op(q, k, v)


def test_the_variant_keys_are_their_fields_in_order():
    from fp4vis.kernels.hopper.config import KernelConfig
    cfg = KernelConfig(schedule="serial", num_wg=1, ctas_per_sm=2, key_lengths=True)
    assert cfg.key() == tuple(getattr(cfg, f.name) for f in dataclasses.fields(cfg))
    assert KernelConfig(*cfg.key()) == cfg   # every field is in the key: nothing compiled twice under one key
