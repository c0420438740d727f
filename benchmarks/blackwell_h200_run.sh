#!/usr/bin/env bash
# The Blackwell backend's sm_90 verification route on the H200, everything logged under $OUT.
#   bash benchmarks/blackwell_h200_run.sh tests   # GPU tests (per-case report in $OUT/gpu_report.json), selfcheck
#   bash benchmarks/blackwell_h200_run.sh bench   # fp4vis bench: blackwell vs flash-attn-4 and SDPA (cuDNN)
# (no argument: both; one device call has 600 s, so give them one call each). Expects the repository root as the
# working directory and the cubins in $CUBINS (default .device/cubins.tar.xz: python -m
# fp4vis.kernels.blackwell.cubin DIR/NAME, then tar cJf .device/cubins.tar.xz -C DIR NAME).
set -uo pipefail
OUT=${OUT:-/tmp/out}
CUBINS=${CUBINS:-.device/cubins.tar.xz}
STAGE=${1:-all}
mkdir -p /tmp/bwcubins "$OUT"
tar xJf "$CUBINS" -C /tmp/bwcubins --strip-components=1
export FP4VIS_BLACKWELL_CUBINS=/tmp/bwcubins XDG_CACHE_HOME=/tmp/xdg PYTHONUNBUFFERED=1 OUT
python3 - <<'PY' 2>&1 | tee "$OUT/env.log"
import torch, triton, cupy
print("torch", torch.__version__, "triton", triton.__version__, "cupy", cupy.__version__,
      torch.cuda.get_device_name(0), torch.cuda.get_device_capability(0))
import fp4vis
print(fp4vis.available_backends())
PY
if [ "$STAGE" = tests ] || [ "$STAGE" = all ]; then
  FP4VIS_BLACKWELL_REPORT="$OUT/gpu_report.json" timeout 330 python3 -m pytest -q -rs \
    tests/kernels/blackwell/test_blackwell_gpu.py -p no:cacheprovider 2>&1 | tee "$OUT/gpu_tests.log"
  echo "pytest rc ${PIPESTATUS[0]}" | tee -a "$OUT/gpu_tests.log"
  python3 - <<'PY' 2>&1 | tee -a "$OUT/gpu_tests.log"
import json, os, statistics
rows = json.load(open(os.environ["OUT"] + "/gpu_report.json"))
print("cases", len(rows), "max relL2", max(r["rel_l2"] for r in rows),
      "median bit-identical", statistics.median(r["bit_identical"] for r in rows),
      "min bit-identical", min(r["bit_identical"] for r in rows))
PY
  timeout 120 python3 -m fp4vis.cli selfcheck 2>&1 | tee "$OUT/selfcheck.log"
  echo "selfcheck rc ${PIPESTATUS[0]}" | tee -a "$OUT/selfcheck.log"
fi
if [ "$STAGE" = bench ] || [ "$STAGE" = all ]; then
  timeout 540 python3 -m fp4vis.cli bench --backends blackwell,fa4,sdpa_cudnn --policies fast --grid all \
    --out-dir "$OUT" --name bench --no-progress 2>&1 | tee "$OUT/bench.log"
  echo "bench rc ${PIPESTATUS[0]}" | tee -a "$OUT/bench.log"
fi
