#!/usr/bin/env bash
# Run on the H200 device machine from the repository root (the device `run` tool), carrying [".device"]:
# a git-ignored folder, not part of the repository, with the packages that machine lacks (CuTe DSL,
# flash-attn-4, ...) and a setup.sh that prints the environment (PYTHONPATH) that makes them importable.
#   bash benchmarks/run_on_h200.sh tests [pytest args]   # GPU tests of the Hopper kernel
#   bash benchmarks/run_on_h200.sh bench [grid args]     # benchmarks/kernel_grid.py
#   bash benchmarks/run_on_h200.sh all                   # tests, then a three-shape bench
# Logs and JSON go to $OUT (or ./out).
set -uo pipefail
OUT="${OUT:-out}"
mkdir -p "$OUT"
eval "$(bash .device/setup.sh)"
export PYTHONUNBUFFERED=1
python3 -m pip install -q --no-deps --no-build-isolation -e . >"$OUT/pip.log" 2>&1 || { cat "$OUT/pip.log"; exit 1; }
nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm,power.draw,temperature.gpu --format=csv >"$OUT/gpu.txt" 2>&1
what="${1:-tests}"
shift || true
run_tests() {
  timeout 400 python3 -m pytest -q -p no:cacheprovider --timeout=150 tests/kernels/hopper/test_hopper_kernel.py \
    tests/kernels/hopper/test_hopper_range.py "$@" \
    >"$OUT/tests.log" 2>&1
  local rc=$?
  grep -E "passed|failed|Error|error|FAILED|relL2" "$OUT/tests.log" | tail -40
  return $rc
}
run_bench() {
  timeout 540 python3 benchmarks/kernel_grid.py --out "$OUT/kernel_grid.json" "$@" 2>&1 | tee "$OUT/bench.log"
}
case "$what" in
  tests) run_tests "$@" ;;
  bench) run_bench "$@" ;;
  all)
    run_tests
    rc=$?
    if [ "$rc" -eq 124 ] || [ "$rc" -eq 137 ]; then echo "tests timed out: no bench"; exit "$rc"; fi
    run_bench --budget 0.6 --backends hopper,prepass,hopper_kernel,fa4,sdpa_cudnn,sage
    ;;
  *) echo "usage: $0 tests|bench|all [args]" >&2; exit 2 ;;
esac
