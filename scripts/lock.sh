#!/usr/bin/env bash
# Refresh the lock against the newest releases that pyproject.toml's ranges admit (torch stays at
# requirements/pins.txt), then rebuild .venv from the new lock and run every test (scripts/test.sh).
# The lock is uv's output, never edited by hand; commit it when the tests pass.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh >/dev/null   # the current lock's environment, for its uv
.venv/bin/uv pip compile pyproject.toml --extra dev --extra crosscheck --constraints requirements/pins.txt \
  --upgrade --python-version 3.11 --python-platform x86_64-manylinux_2_28 --custom-compile-command "bash scripts/lock.sh" --quiet \
  --output-file requirements/lock.txt
git --no-pager diff --stat -- requirements/lock.txt
git --no-pager diff -U0 -- requirements/lock.txt | grep -E '^[-+][a-z0-9]' || echo "lock: no version changed"
rm -rf .venv
exec bash scripts/test.sh
