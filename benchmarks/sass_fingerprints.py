"""SASS fingerprints of the Hopper kernel's variants, compiled for sm_90a on the CPU (no GPU needed).

    python benchmarks/sass_fingerprints.py OUT.json                    # every variant compile_check builds
    python benchmarks/sass_fingerprints.py OUT.json --compare OLD.json  # and which differ from OLD.json's

Identical SASS for a variant means identical bits on the GPU, for every input: what a restructuring of the
kernel's source (names, objects, methods) must leave unchanged. The timing-only P paths are left out (their
results are wrong by design). Each entry: the SHA-256 (first 16 hex digits) of the disassembly, its line
count and the registers per thread.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import sys
import tempfile

from fp4vis.services.environment import environment
from fp4vis.services.outputs import write_json


def fingerprints() -> dict:
    os.environ.setdefault("CUTE_DSL_NO_CACHE", "1")
    from fp4vis.kernels.hopper import compile_check as cc
    from fp4vis.kernels.hopper.config import TIMING_P_PATHS
    out = {}
    for name, cfg in cc.variants():
        if cfg.p_path in TIMING_P_PATHS:
            continue
        rep = cc.compile_variant(cfg, keep_dir=tempfile.mkdtemp(prefix="fp4vis_sass_"), disassemble=False)
        with open(rep.cubin, "rb") as fh:
            sass = cc.sass_text(fh.read())
        key = f"{name}_d{cfg.head_dim}"
        out[key] = dict(sha256=hashlib.sha256(sass.encode()).hexdigest()[:16], lines=len(sass.splitlines()),
                        registers=rep.registers)
        print(key, out[key], flush=True)
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("out", help="JSON path")
    ap.add_argument("--compare", default=None, help="an earlier run's JSON: list the variants that differ")
    a = ap.parse_args(argv)
    res = dict(meta=environment(), variants=fingerprints())
    if a.compare:
        with open(a.compare) as fh:
            old = json.load(fh)["variants"]
        new = res["variants"]
        res["compared_with"] = dict(file=a.compare, commit=json.load(open(a.compare))["meta"].get("git_commit"),
                                    same=sorted(k for k in new if old.get(k, {}).get("sha256") == new[k]["sha256"]),
                                    differ=sorted(k for k in new if k in old and old[k]["sha256"] != new[k]["sha256"]),
                                    missing=sorted(set(old) ^ set(new)))
        print(f"same {len(res['compared_with']['same'])}, differ {res['compared_with']['differ']}, "
              f"missing {res['compared_with']['missing']}", file=sys.stderr)
    write_json(a.out, res)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
