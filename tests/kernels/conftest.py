"""Shared by the kernel tests: ``interpreted``, which runs a script under Triton's CPU interpreter."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest


@pytest.fixture(scope="session")
def interpreted_result(tmp_path_factory):
    """``run(script, name)``: run ``script`` in a fresh process with TRITON_INTERPRET=1 (set before Triton is
    imported, as it must be), from a file (``triton.jit`` reads its source), and return the JSON it prints on
    a line starting with ``RESULT``."""
    pytest.importorskip("triton")

    def run(script: str, name: str, timeout: int = 900) -> dict:
        path = tmp_path_factory.mktemp(name) / f"{name}.py"
        path.write_text(script)
        env = dict(os.environ, TRITON_INTERPRET="1")
        res = subprocess.run([sys.executable, str(path)], env=env, capture_output=True, text=True, timeout=timeout)
        line = [x for x in res.stdout.splitlines() if x.startswith("RESULT")]
        assert res.returncode == 0 and line, res.stdout[-3000:] + res.stderr[-5000:]
        return json.loads(line[0][len("RESULT"):])

    return run


@pytest.fixture
def blackwell_kernel(monkeypatch):
    """``blackwell_kernel(kernel)``: the Blackwell backend's calls and its self-check run ``kernel(q, k, v, policy,
    scale)`` in place of the GPU kernel (the gate and the first-use figures tested on the CPU)."""
    from fp4vis.kernels.blackwell import launch

    def inject(kernel) -> None:
        monkeypatch.setattr(launch, "checked_attention", kernel)
        monkeypatch.setattr(launch, "attention", lambda call: kernel(call.q, call.k, call.v, call.policy, call.scale))
    return inject
