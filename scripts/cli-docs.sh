#!/usr/bin/env bash
# Regenerate docs/CLI.md from the `pfec` typer app's help texts (--check: exit 1 if the file is stale).
# Run ./scripts/setup.sh (or demo.sh, test.sh) once first: this uses the project's .venv.
set -euo pipefail
cd "$(dirname "$0")/.."
exec .venv/bin/python scripts/cli_docs.py "$@"
