#!/usr/bin/env bash
# Set up the development environment in ./.venv from the lock (idempotent): exactly the versions of
# requirements/lock.txt, which the test suite last passed with (scripts/lock.sh refreshes it), then fp4vis
# itself, editable. The lock's torchao is the tests' cross-check library, which scripts/test.sh installs into
# a folder of its own (pyproject.toml, `crosscheck`).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
  "$PY" -m venv .venv
fi
grep -v '^torchao==' requirements/lock.txt > .venv/requirements.txt
.venv/bin/python -m pip install -q --no-input -r .venv/requirements.txt
.venv/bin/python -m pip install -q --no-input --no-deps --no-build-isolation -e .
echo "fp4vis environment ready: $(.venv/bin/python -c 'import torch, fp4vis; print("torch", torch.__version__, "fp4vis", fp4vis.__version__)')"
