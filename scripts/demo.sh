#!/usr/bin/env bash
# The main job, from a fresh clone: set up .venv (idempotent), then run a simulated handoff report.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
exec .venv/bin/pfec sim --rho 0.8 --loss ge:0.001,0.5,0.02,0.1 --rate-mbps 100 --rtt-ms 20 \
    --tokens 1536 --realizations 5 "$@"
