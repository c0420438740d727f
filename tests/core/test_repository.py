"""The repository stands on its own: no tracked file (code, docs, benchmark
scripts and results) cites a document that is not in it. Facts are cited from docs/numerics.md, the
kernel docs or benchmarks/results, or stated with what they rest on."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
# the notes the project was started from, outside the repository (a reader of a clone has neither)
OUTSIDE = re.compile(rb"SPEC\.md|KERNELS\.md|\.\./shared\b")


def _tracked() -> list[str]:
    res = subprocess.run(["git", "-C", str(ROOT), "ls-files", "-z"], capture_output=True, timeout=60)
    if res.returncode != 0:
        pytest.skip(f"not a git checkout: {res.stderr.decode(errors='replace').strip()}")
    return [p for p in res.stdout.decode().split("\0") if p]


def test_the_pattern_finds_each_outside_document():
    found = [bool(OUTSIDE.search(s)) for s in (b"see SPEC.md", b"(KERNELS.md probe)", b"`../shared/device/prepare`",
                                               b"docs/numerics.md section 7", b"../shared_memory.md")]
    assert found == [True, True, True, False, False]


def test_no_file_cites_a_document_outside_the_repository():
    me = str(Path(__file__).relative_to(ROOT))
    hits = []
    for rel in _tracked():
        path = ROOT / rel
        if rel == me or not path.is_file():   # a file deleted in the work tree but not yet in the index
            continue
        data = path.read_bytes()
        for m in OUTSIDE.finditer(data):
            line = data.count(b"\n", 0, m.start()) + 1
            hits.append(f"{rel}:{line}: {m.group().decode()}")
    assert hits == []
