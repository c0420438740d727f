#!/usr/bin/env bash
# The test command (README, CI): set up, lint, run every test. GPU tests skip without a GPU;
# kernel compile checks run on the CPU. Fails when no test ran.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
# the tests' cross-check library at the lock's version, in its own folder (tests/conftest.py puts it on the
# tests' path, never the runtime's: pyproject.toml)
torchao=$(grep '^torchao==' requirements/lock.txt)
if [ "$(cat .venv/crosscheck/PINNED 2>/dev/null)" != "$torchao" ]; then
  rm -rf .venv/crosscheck
  .venv/bin/python -m pip install -q --no-input --no-deps --target .venv/crosscheck "$torchao"
  echo "$torchao" > .venv/crosscheck/PINNED
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
