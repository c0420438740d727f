#!/usr/bin/env bash
# The three real-configuration eval runs, for one H200 (or any sm_90 GPU), in at most ~8 minutes.
# Nothing is downloaded: every model is the real architecture with seeded RANDOM weights (the
# reports say so), the images are the photographs that scikit-image ships inside its package.
#
#   bash benchmarks/real_evals.sh            # writes benchmarks/results/*.json, *.md
#
# On the device machine (the `run` tool, carrying [".device"]) the results go to $OUT, the folder
# that comes back; copy them into benchmarks/results/ and commit them. PYTHON overrides the
# interpreter; .device/setup.sh, when present, sets up the environment as benchmarks/run_on_h200.sh does.
#
# 1. fp4vis info                      -> benchmarks/results/<RUN>_info.json
# 2. MAE-base (ViTMAEConfig defaults) reconstruction PSNR, 224 px, fast + accurate
# 3. ViT-B/16 (timm vit_base_patch16_224) at 1008 px (3970 tokens): agreement, logit and per-layer error
# 4. Wan2.1-T2V-1.3B architecture, 480x832, 81 frames (32760 tokens), 2 steps + warm-up, speed only
#    (Hopper kernel asked for explicitly: a policy it cannot run is reported as failed, not emulated)
# Each step has a time limit; the Wan step gets whatever is left of the budget and writes partial
# results after every policy.
set -uo pipefail
cd "$(dirname "$0")/.."
if [[ -f .device/setup.sh && -z "${PYTHON:-}" ]]; then eval "$(bash .device/setup.sh)"; fi
PY=${PYTHON:-python3}
OUT=${OUT:-benchmarks/results}
RUN=${RUN:-$(date -u +%Y%m%d)a_h200}   # file-name prefix: benchmarks/results/README.md's scheme
BUDGET=${BUDGET_S:-470}
PHOTOS=${PHOTOS_DIR:-${TMPDIR:-/tmp}/fp4vis_photos}
mkdir -p "$OUT"
export TQDM_MININTERVAL=5 PYTHONUNBUFFERED=1
start=$SECONDS
left() { echo $(( BUDGET - (SECONDS - start) )); }
step() { echo; echo "=== [$(( SECONDS - start )) s] $*"; }

if ! $PY -c "import fp4vis.evals.vit_top1, fp4vis.cli" 2>/dev/null; then
  step "installing fp4vis (editable, no dependencies, no network)"
  $PY -m pip install -q --no-deps --no-build-isolation -e . || { echo "cannot install fp4vis"; exit 1; }
fi

step "fp4vis info"
$PY -m fp4vis.cli info | tee "$OUT/${RUN}_info.txt"
$PY -m fp4vis.cli info --json > "$OUT/${RUN}_info.json"

step "scikit-image photos -> $PHOTOS"
$PY -c "from fp4vis.evals.common import export_skimage_photos as e; import sys; e(sys.argv[1])" "$PHOTOS" || exit 1
ls "$PHOTOS"/photos

step "MAE-base, random weights, 224 px (limit 100 s)"
timeout 100 $PY -m fp4vis.cli eval mae --model config:default --data "$PHOTOS" --policies fast,accurate \
  --batch-size 8 --limit 8 --seed 0 --out-dir "$OUT" --name "${RUN}_eval-mae_base-random-224" --no-progress
echo "exit $?"

step "ViT-B/16, random weights, 1008 px (limit 170 s)"
timeout 170 $PY -m fp4vis.cli eval vit --model timm:vit_base_patch16_224 --random-weights --resolution 1008 \
  --data "$PHOTOS" --labels none --policies fast,accurate --batch-size 4 --limit 8 --seed 0 --out-dir "$OUT" \
  --name "${RUN}_eval-vit_b16-random-1008" --no-progress
echo "exit $?"

wan_limit=$(left)
step "Wan2.1-1.3B architecture, random weights, 480x832x81, 2 steps (limit ${wan_limit} s)"
if (( wan_limit > 60 )); then
  timeout "$wan_limit" $PY -m fp4vis.cli eval wan --speed-only 1.3B --height 480 --width 832 --frames 81 \
    --steps 2 --guidance 5.0 --policies wan_fast,fast,accurate --backend hopper --seed 0 --out-dir "$OUT" \
    --name "${RUN}_eval-wan_1.3b-random-480x832x81-speed"
  echo "exit $?"
else
  echo "skipped: not enough time left"
fi
step "done in $(( SECONDS - start )) s; results:"
ls -la "$OUT"
