#!/usr/bin/env bash
# The control path before and after, in one run (BENCHMARKS.md (r)): two processes through the
# real endpoints (bench/endpoints_processes.py, host pools), engines `local` and Mooncake over
# TCP on loopback, 1K-token requests; the two trees alternate round by round so that the
# machine's drift falls on both. Then bench/control_path_summary.py pools the rounds.
#   BEFORE_PYTHONPATH=... AFTER_PYTHONPATH=... bash bench/control_path_ab.sh OUT [ROUNDS] [REPS]
# Each *_PYTHONPATH makes `import pdc` load that tree (this bench file runs in both); each
# *_ENV, if set, is a list of NAME=VALUE put in that side's environment (a knob's A/B in one
# tree: BEFORE_ENV=PDC_CONTROL_LANE=0 AFTER_ENV=PDC_CONTROL_LANE=1).
set -euo pipefail
out=$1; rounds=${2:-3}; reps=${3:-100}
here=$(cd "$(dirname "$0")" && pwd)
py=${PYTHON:-python3}
mkdir -p "$out"
uptime > "$out/load.txt"
for r in $(seq 1 "$rounds"); do
  for tree in before after; do
    var=${tree^^}_PYTHONPATH
    envs=${tree^^}_ENV
    # shellcheck disable=SC2086 # NAME=VALUE words, split on purpose
    env ${!envs:-} PYTHONPATH=${!var} "$py" "$here/endpoints_processes.py" --engines "${ENGINES:-local,mooncake}" \
      --mooncake-protocol tcp --tokens-list "${TOKENS:-1024}" --cases "${CASES:-tp1-tp1-direct,tp2-tp1-staged}" \
      --reps "$reps" --prefill-device host --decode-device host \
      --json "$out/$tree-$r.json" > "$out/$tree-$r.log" 2>&1 || echo "$tree round $r failed" >&2
    uptime >> "$out/load.txt"
  done
done
"$py" "$here/control_path_summary.py" "$out" | tee "$out/summary.md"
