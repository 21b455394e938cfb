#!/usr/bin/env bash
# The test suite, from a fresh clone: set up .venv (idempotent), lint, type-check, run pytest.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
echo "[test] ruff"
.venv/bin/ruff check .
echo "[test] mypy"
.venv/bin/mypy
echo "[test] pytest"
exec .venv/bin/pytest "$@"
