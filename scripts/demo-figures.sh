#!/usr/bin/env bash
# Issue 39's demo figures on this machine: the default demo RUNS times (default 3) as it is, and with the
# receiver under a CPU quota of 0.67 and 0.5 CPUs (about 1.5x and 2x slower on its one CPU; needs root and
# the cgroup cpu controller), each run's JSON in OUT (default /tmp/pfec-demo-figures); then per quota the
# medians: TTFT over local prefill, each predicted part's measured/predicted, answers vs full KV.
# Run it on a quiet machine: `uptime` first. Extra arguments pass on to every `pfec demo`.
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/pfec-demo-figures}
RUNS=${RUNS:-3}
QUOTAS=${QUOTAS:-"none 0.67 0.5"}
mkdir -p "$OUT"
bash scripts/setup.sh >&2
for quota in $QUOTAS; do
  for i in $(seq 1 "$RUNS"); do
    args=(--json --no-compare-sim)
    [ "$quota" = none ] || args+=(--receiver-cpu-quota "$quota")
    echo "[demo-figures] quota $quota, run $i ($(cut -d' ' -f1-3 /proc/loadavg))" >&2
    .venv/bin/pfec demo "${args[@]}" "$@" > "$OUT/demo-$quota-$i.json"
  done
done
.venv/bin/python - "$OUT" <<'PY'
import json, pathlib, sys
from pfec.lab.demo import summarise_runs
runs = [json.loads(p.read_text()) for p in sorted(pathlib.Path(sys.argv[1]).glob("demo-*.json"))]
summary = summarise_runs(runs)
(pathlib.Path(sys.argv[1]) / "summary.json").write_text(json.dumps(summary, indent=2))
print(json.dumps(summary, indent=2))
PY
