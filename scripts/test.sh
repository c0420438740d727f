#!/usr/bin/env bash
# The test command (README, CI): set up, lint, run every test. GPU tests skip without a GPU;
# kernel compile checks run on the CPU. Fails when no test ran.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
# the tests' cross-check library, in its own folder (tests/conftest.py puts it on the tests' path, never the
# runtime's: pyproject.toml)
if [ ! -d .venv/crosscheck/torchao ]; then
  .venv/bin/python -m pip install -q --no-deps --target .venv/crosscheck "torchao>=0.12"
fi
.venv/bin/ruff check .
export CUTE_DSL_NO_CACHE=1
set +e
.venv/bin/python -m pytest -q -p no:cacheprovider "$@"
rc=$?
set -e
if [ "$rc" -eq 5 ]; then
  echo "error: no tests ran" >&2
  exit 1
fi
exit "$rc"
