#!/usr/bin/env bash
# One device call (issue 29 item 4): where the direct path's submit spends its host time inside
# the endpoint. bench/endpoint_trace.py with TRACE_FINE=1 (the cuda_ipc submit's steps, wall
# and thread CPU time) over bench/endpoints_processes.py, cuda_ipc, direct 1K and 8K, with
# prefill's caller polling its senders every 200 µs (the bench's default) and every 5 ms; then
# the same cases untraced at both intervals. Carried: .whl. From the repository root:
#   BUDGET=400 bash bench/results/2026-12-06-gpu-fine/run.sh
set -u
export PYTHONUNBUFFERED=1
T0=$(date +%s); BUDGET=${BUDGET:-400}
left() { echo $((BUDGET - ($(date +%s) - T0))); }
W=$OUT; python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
T=$PWD; A=$(mktemp -d); mkdir -p "$A/pdc"; cp -r pdc/. "$A/pdc/"
for s in runtime compiler generated integrations; do ln -sfn "$T/$s" "$A/pdc/$s"; done
export PYTHONPATH="$A:/tmp/site"
{ date -u; nvidia-smi --query-gpu=name,driver_version --format=csv; nproc; uptime; } > $W/env.txt 2>&1
cat $W/env.txt
PAIRS=tp1-tp1-direct:1024,tp1-tp1-direct:8192
for poll in 200 5000; do
  s=$(($(left) - 60)); [ $s -gt 110 ] && s=110
  rm -rf /tmp/trace; mkdir -p /tmp/trace
  TRACE_FINE=1 TRACE_OUT=/tmp/trace/t TRACE_ENGINE_CLS=pdc.runtime.engines.cuda_ipc.CudaIpcEngine \
    timeout $s python3 bench/endpoint_trace.py python3 bench/endpoints_processes.py \
    --engines cuda_ipc --pairs $PAIRS --reps 30 --prefill-poll-us $poll --json $W/traced-$poll.json > $W/traced-$poll.log 2>&1
  echo "traced poll $poll exit $? left $(left)s"
  python3 bench/endpoint_trace.py --show /tmp/trace/t --reps 30 --cases direct-1K,direct-8K > $W/trace-$poll.txt 2>&1
  echo "== trace, prefill's caller polling every $poll us"; cat $W/trace-$poll.txt
done
for round in 1 2; do
  for poll in 200 5000; do
    s=$(($(left) - 15)); [ $s -gt 60 ] && s=60; [ $s -lt 25 ] && { echo "plain $poll-$round skipped"; continue; }
    timeout $s python3 bench/endpoints_processes.py --engines cuda_ipc --pairs $PAIRS --reps 50 \
      --prefill-poll-us $poll --json $W/plain-$poll-$round.json > $W/plain-$poll-$round.log 2>&1
    echo "plain $poll-$round exit $? left $(left)s"
  done
done
python3 - $W <<'PY' | tee $W/summary.txt
import glob, json, os, sys
for f in sorted(glob.glob(sys.argv[1] + "/*.json")):
    d = json.load(open(f))
    for r in d["rows"]:
        if "ms" in r:
            print(f"{os.path.basename(f):20} {r['case'][9:]:22} ms {r['ms']:5.2f} p99 {r['p99_ms']:5.2f} engine {r['engine_only_ms']:5.2f} "
                  f"fixed {r['fixed_ms']:5.2f} i2s {r['init_to_submit_ms']:5.2f} d2s {r['done_to_success_ms']:5.2f} "
                  f"submit_us {r['engine_submit_host_us']:5.0f} checks {d['all_checks_passed']}")
PY
