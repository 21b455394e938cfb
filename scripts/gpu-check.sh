#!/usr/bin/env bash
# One prepared GPU check (issue 39 item 4): set-up with the CUDA build of torch, the CUDA tests, `pfec bench
# gpu --json` (7B geometry) and the default demo, in one short run. Logs and the bench's files land in
# $OUT (the device tool's folder) or build/gpu-check/; the bench's gpu.json and gpu.md also go to
# docs/benchmarks/.
#
#   scripts/gpu-check.sh                 a GPU machine that reaches the package registries: PFEC_TORCH=cuda
#                                        scripts/setup.sh, then everything with .venv's python.
#   scripts/gpu-check.sh                 a GPU machine with no network whose python3 holds a CUDA torch (the
#                                        lent device machines): the wheels in .whl/ go to /tmp/site, the
#                                        checkout is imported as pfec through /tmp/pfec-src; no demo unless
#                                        the default model's data is there (scripts/setup.sh fetches it).
#   scripts/gpu-check.sh --fetch-wheels  here, with network: download those wheels (Python 3.12, x86-64) into
#                                        .whl/, at the versions .venv runs (carry .whl to the GPU machine).
set -uo pipefail
cd "$(dirname "$0")/.."
out=${OUT:-build/gpu-check}
mkdir -p "$out"
# What the project imports that the lent machines' image lacks or holds at another version.
WHEELS=(transformers tokenizers huggingface-hub safetensors pydantic pydantic-core annotated-types
        typing-inspection cryptography cffi pycparser gguf)

if [ "${1:-}" = "--fetch-wheels" ]; then
    set -e
    grep -qx '/.whl/' .git/info/exclude 2>/dev/null || echo '/.whl/' >> .git/info/exclude
    pins=()
    for name in "${WHEELS[@]}"; do
        pins+=("$name==$(.venv/bin/python -c "import importlib.metadata as m; print(m.version('$name'))")")
    done
    platforms=()
    for n in 17 24 27 28 31 34 35 39; do platforms+=(--platform "manylinux_2_${n}_x86_64"); done
    .venv/bin/python -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 \
        --implementation cp "${platforms[@]}" --platform manylinux2014_x86_64 -d .whl "${pins[@]}"
    du -sh .whl
    exit 0
fi

log() { echo "[gpu-check] $*" | tee -a "$out/summary.txt"; }
status=0
nvidia-smi > "$out/nvidia-smi.txt" 2>&1 || { log "nvidia-smi does not answer: no NVIDIA GPU here"; exit 2; }
if [ -d .whl ] && ! [ -x .venv/bin/python ]; then
    py=${GPU_PYTHON:-python3}
    "$py" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
        .whl/*.whl > "$out/setup.txt" 2>&1 || { log "installing .whl/ failed (setup.txt)"; exit 2; }
    mkdir -p /tmp/pfec-src/pfec && : > /tmp/pfec-src/pfec/__init__.py
    for d in common sender receiver node lab cli; do
        [ -d "$d" ] && ln -sfn "$PWD/$d" "/tmp/pfec-src/pfec/$d"
    done
    export PYTHONPATH=/tmp/pfec-src:/tmp/site${PYTHONPATH:+:$PYTHONPATH}
    log "set-up: $py with the carried wheels (no network)"
else
    py=.venv/bin/python
    PFEC_TORCH=cuda bash scripts/setup.sh > "$out/setup.txt" 2>&1 \
        || { log "scripts/setup.sh failed (setup.txt)"; exit 2; }
    log "set-up: PFEC_TORCH=cuda scripts/setup.sh"
fi
export PYTHONUNBUFFERED=1
"$py" -c 'import torch; assert torch.cuda.is_available(), "torch sees no CUDA GPU"
print("torch", torch.__version__, "CUDA", torch.version.cuda, torch.cuda.get_device_name())' 2>&1 \
    | tee -a "$out/summary.txt"
[ "${PIPESTATUS[0]}" = 0 ] || exit 2

# The CUDA tests (and the CPU halves of the same files), then the bench and the demo.
"$py" -m pytest -q -rs -p no:cacheprovider tests/test_cuda_staging.py tests/test_cuda_models.py \
    tests/test_cuda_handoff.py tests/test_gpu_bench.py tests/test_llm_tiny.py::test_cuda_path_matches_cpu \
    > "$out/pytest.txt" 2>&1 || status=1
log "tests: $(tail -n 1 "$out/pytest.txt")"
if "$py" -m pfec.cli.app bench gpu --json --out-dir "$out" > "$out/bench-gpu.stdout" \
        2> "$out/bench-gpu.stderr"; then
    cp "$out/gpu.json" "$out/gpu.md" docs/benchmarks/
    log "bench gpu: $out/gpu.md (also docs/benchmarks/gpu.md)"
else
    status=1
    log "bench gpu failed: $(tail -n 3 "$out/bench-gpu.stderr")"
fi
if "$py" -m pfec.common.model.assets check > /dev/null 2>&1; then
    "$py" -m pfec.cli.app demo --json > "$out/demo.json" 2> "$out/demo.stderr" || status=1
    log "demo: $out/demo.json"
else
    log "demo skipped: the default model's data is not here (scripts/setup.sh fetches it where the" \
        "registries are reachable)"
fi
log "done, status $status"
exit "$status"
