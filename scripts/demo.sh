#!/usr/bin/env bash
# The main job, from a fresh clone: set up .venv (idempotent), then hand a real context's KV cache from a
# sender daemon to a receiver daemon through the link emulator on this machine (default model, rho 0.8,
# 100 Mbit/s, 20 ms RTT, bursty GE loss) and print the report next to the full-KV answer.
# stdout carries only the command's output (set-up reports on stderr): `demo.sh --json | jq` works.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh >&2
exec .venv/bin/pfec demo "$@"
