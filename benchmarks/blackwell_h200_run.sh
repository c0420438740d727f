#!/usr/bin/env bash
# One device run on the H200 for the Blackwell backend's sm_90 verification route: the GPU tests,
# the self-check table and the timing, everything logged under $OUT. Expects the repository root
# as the working directory and cubins.tar.xz (python -m fp4vis.kernels.blackwell.cubin DIR, then
# tar cJf cubins.tar.xz -C DIR/.. DIRNAME) beside this checkout's root.
set -uo pipefail
OUT=${OUT:-/tmp/out}
mkdir -p /tmp/bwcubins "$OUT"
tar xJf cubins.tar.xz -C /tmp/bwcubins --strip-components=1
export FP4VIS_BLACKWELL_CUBINS=/tmp/bwcubins XDG_CACHE_HOME=/tmp/xdg PYTHONUNBUFFERED=1
python3 - <<'PY' 2>&1 | tee "$OUT/env.log"
import torch, triton, cupy
print("torch", torch.__version__, "triton", triton.__version__, "cupy", cupy.__version__,
      torch.cuda.get_device_name(0), torch.cuda.get_device_capability(0))
import fp4vis
print(fp4vis.available_backends())
PY
FP4VIS_BLACKWELL_REPORT="$OUT/gpu_report.json" timeout 300 python3 -m pytest -q -rs \
  tests/kernels/blackwell/test_blackwell_gpu.py -p no:cacheprovider 2>&1 | tee "$OUT/gpu_tests.log"
echo "pytest rc ${PIPESTATUS[0]}"
python3 - <<'PY' 2>&1 | tee -a "$OUT/gpu_tests.log"
import json, statistics
rows = json.load(open(__import__("os").environ["OUT"] + "/gpu_report.json"))
print("cases", len(rows), "max relL2", max(r["rel_l2"] for r in rows),
      "median bit-identical", statistics.median(r["bit_identical"] for r in rows),
      "min bit-identical", min(r["bit_identical"] for r in rows))
PY
timeout 180 python3 benchmarks/blackwell_h200_bench.py "$OUT/bench.json" 2>&1 | tee "$OUT/bench.log"
