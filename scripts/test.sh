#!/usr/bin/env bash
# The test suite, from a fresh clone: set up .venv (idempotent), check its dependencies, lint, type-check,
# run pytest.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
echo "[test] pip check"
.venv/bin/pip check
echo "[test] ruff"
.venv/bin/ruff check .
echo "[test] mypy"
# mypy sees the installed names (pfec.common, pfec.sender, ...) through one link per top-level folder.
mkdir -p build/typecheck/pfec
for d in common sender receiver node lab cli; do ln -sfn "../../../$d" "build/typecheck/pfec/$d"; done
.venv/bin/mypy
echo "[test] pytest"
exec .venv/bin/pytest "$@"
