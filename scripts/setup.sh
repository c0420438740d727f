#!/usr/bin/env bash
# Set up a development environment from scratch in ./.venv (idempotent).
# torch/torchvision are pinned to the releases this project is developed and tested with;
# everything else comes from pyproject.toml's [dev] extra.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
  "$PY" -m venv .venv
fi
.venv/bin/python -m pip install -q --upgrade pip >/dev/null
.venv/bin/python -m pip install -q "torch==2.14.1" "torchvision==0.29.1"
.venv/bin/python -m pip install -q -e ".[dev]"
echo "fp4vis environment ready: $(.venv/bin/python -c 'import torch, fp4vis; print("torch", torch.__version__, "fp4vis", fp4vis.__version__)')"
