#!/usr/bin/env bash
# Which build of the pinned torch this machine gets, and the pip arguments that install it.
# Prints two lines: the build (cpu | cuda), then the arguments for `pip install`.
#   PFEC_TORCH=cpu|cuda|auto (default auto: cuda where `nvidia-smi` answers, else cpu).
#   PFEC_TORCH_INDEX: the index that serves the CUDA build (default PyPI, whose Linux x86_64 wheel of
#   torch 2.13.0 is the CUDA build) or, for cpu, the CPU build when no local CPU wheel is found.
# The same pin both ways: torch==2.13.0 (pyproject) is satisfied by 2.13.0+cpu and by PyPI's 2.13.0.
set -euo pipefail
TORCH_VERSION=2.13.0
choice=${PFEC_TORCH:-auto}
case "$choice" in
    auto) if nvidia-smi -L >/dev/null 2>&1; then choice=cuda; else choice=cpu; fi ;;
    cpu|cuda) ;;
    *) echo "PFEC_TORCH=$choice: expected cpu, cuda or auto" >&2; exit 2 ;;
esac
pip=${PIP:-.venv/bin/pip}
if [ "$choice" = cuda ]; then
    # --isolated: a pip config's find-links may offer a local +cpu wheel, which pip would rank higher.
    echo cuda
    echo "--isolated ${PIP_CERT:+--cert $PIP_CERT} --index-url ${PFEC_TORCH_INDEX:-https://pypi.org/simple}" \
        "torch==$TORCH_VERSION"
elif "$pip" install -q --dry-run --ignore-installed --no-index --no-deps "torch==$TORCH_VERSION+cpu" \
        >/dev/null 2>&1; then
    # A local CPU wheel (pip's find-links): no download. torch's own needs come with the project.
    echo cpu
    echo "--no-index --no-deps torch==$TORCH_VERSION+cpu"
else
    echo cpu
    echo "--index-url ${PFEC_TORCH_INDEX:-https://download.pytorch.org/whl/cpu} --no-deps torch==$TORCH_VERSION+cpu"
fi
