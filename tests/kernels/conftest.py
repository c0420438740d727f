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
