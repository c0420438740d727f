"""What the Hopper and the Blackwell launchers share: the cache of compiled kernels (``CompiledKernels``: compiled
once per key under a lock, each compile timed), the anchor permutation kept on each device
(``cached_anchor_permutation``) and when a call must go through the backend's custom op (``needs_custom_op``).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Hashable, Iterator
from typing import Generic, TypeVar

import torch

from fp4vis.key_positions import anchor_permutation

Kernel = TypeVar("Kernel")


class CompiledKernels(Generic[Kernel]):
    """Compiled kernels by key (a kernel variant's ``key()``, with the device where the kernel is per device),
    compiled on first use and kept for the process; ``compile_times``: seconds each compile took. A lock: two
    threads asking for the same variant compile it once."""

    def __init__(self, log: logging.Logger) -> None:
        self.log = log
        self.kernels: dict[Hashable, Kernel] = {}
        self.compile_times: dict[Hashable, float] = {}
        self.lock = threading.Lock()

    def get(self, key: Hashable, compile_kernel: Callable[[], Kernel], describe: Callable[[Kernel], str]) -> Kernel:
        """The kernel of ``key``: ``compile_kernel()`` on first use (timed and logged with ``describe(kernel)``)."""
        kernel = self.kernels.get(key)
        if kernel is not None:   # the common case: no lock
            return kernel
        with self.lock:
            kernel = self.kernels.get(key)
            if kernel is None:
                t0 = time.perf_counter()
                kernel = compile_kernel()
                self.compile_times[key] = time.perf_counter() - t0
                self.log.info("%s in %.2f s", describe(kernel), self.compile_times[key])
                self.kernels[key] = kernel
        return kernel

    def keys(self) -> Iterator[Hashable]:
        return iter(list(self.kernels))

    def clear(self) -> None:
        with self.lock:
            self.kernels.clear()
            self.compile_times.clear()


_ANCHOR_PERMUTATIONS: dict[tuple, torch.Tensor] = {}


def cached_anchor_permutation(seq_len: int, n: int, device: torch.device,
                              dtype: torch.dtype = torch.long) -> torch.Tensor:
    """``anchor_permutation(seq_len, n)`` computed on the CPU once and kept on ``device`` (a host-to-device copy per
    call would cost more than the pre-pass at small S)."""
    key = (seq_len, n, device, dtype)
    perm = _ANCHOR_PERMUTATIONS.get(key)
    if perm is None:
        perm = _ANCHOR_PERMUTATIONS[key] = anchor_permutation(seq_len, n, device="cpu").to(dtype).to(device)
    return perm


def needs_custom_op(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> bool:
    """Whether a call goes through the backend's custom op rather than the eager launcher: under torch.compile (one
    graph node), and where autograd records (the op has no backward: it fails at backward, not silently)."""
    return torch.compiler.is_compiling() or (
        torch.is_grad_enabled() and (q.requires_grad or k.requires_grad or v.requires_grad))
