#!/usr/bin/env bash
# The published diffusion transformers on one H200, random weights at their published configs, every run compiled
# (`fp4vis eval pipeline --speed-only ARCH --compile`: regional, fullgraph, in each run's untimed warm-up), side by
# side in one process: diffusers' default attention (bf16), flash-attn-4 as the attention of the layers fp4vis
# patches (attn=fa4; text-padding masks through its seqused_k), and the Hopper kernel's fast and fast_fp8qk.
#
#   bash benchmarks/pipeline_evals.sh [ARCH ...]
#   # default: flux.1-dev qwen-image wan2.2-t2v-a14b hunyuanvideo cogvideox-5b
#
# Sizes: FLUX.1-dev 1024x1024, Qwen-Image 1328x1328, HunyuanVideo 720x1280 with 129 frames and CogVideoX-5B
# 480x720 with 49 frames (its guidance one transformer call of batch 2, as its pipeline makes it) as published;
# Wan2.2-T2V-A14B at its 480p size (480x832, 81 frames: its 720p one would take about 4x the device time). On the device
# machine (the `run` tool, carrying [".device"]) results go to $OUT (NAME.json, NAME.md per model; the command's
# output to the caller); copy them into benchmarks/results/.
# STEPS (default 2) timed steps per run; LIMIT_S (default 280) seconds per model; RUN the file-name prefix.
set -uo pipefail
cd "$(dirname "$0")/.."
if [[ -f .device/setup.sh && -z "${PYTHON:-}" ]]; then eval "$(bash .device/setup.sh)"; fi
PY=${PYTHON:-python3}
OUT=${OUT:-benchmarks/results}
RUN=${RUN:-$(date -u +%Y%m%d)a_h200}
STEPS=${STEPS:-2}
LIMIT=${LIMIT_S:-280}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
[[ $# -gt 0 ]] || set -- flux.1-dev qwen-image wan2.2-t2v-a14b hunyuanvideo cogvideox-5b
if ! $PY -c "import fp4vis.evals.pipeline_eval" 2>/dev/null; then
  $PY -m pip install -q --no-deps --no-build-isolation -e . || { echo "cannot install fp4vis"; exit 1; }
fi
for arch in "$@"; do
  case "$arch" in
    flux.1-dev) size=(); tag=flux-1-dev-random-1024x1024 ;;
    qwen-image) size=(); tag=qwen-image-random-1328x1328 ;;
    wan2.2-t2v-a14b) size=(--height 480 --width 832 --frames 81); tag=wan2-2-t2v-a14b-random-480x832x81 ;;
    hunyuanvideo) size=(); tag=hunyuanvideo-random-720x1280x129 ;;
    cogvideox-5b) size=(); tag=cogvideox-5b-random-480x720x49 ;;
    *) echo "unknown ARCH $arch"; exit 2 ;;
  esac
  echo "=== [$SECONDS s] $arch (limit $LIMIT s)"
  timeout "$LIMIT" $PY -m fp4vis.cli eval pipeline --speed-only "$arch" "${size[@]}" --steps "$STEPS" --compile \
    --policies fast,fast_fp8qk --baselines fa4 --backend hopper --seed 0 --no-progress --out-dir "$OUT" \
    --name "${RUN}_eval-pipeline_${tag}-compiled" 2>&1 | grep -v "^\s*$"
  echo "exit ${PIPESTATUS[0]}"
done
