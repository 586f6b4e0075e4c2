#!/usr/bin/env bash
# One device call (issue 29 item 4): where a request's fixed cost goes on this tree.
# bench/endpoint_trace.py with TRACE_FINE=1 (the cuda_ipc submit's own steps) over
# bench/endpoints_processes.py, cuda_ipc, direct 1K, direct 8K and staged 8K (TP2 -> TP1), 30
# requests a case; then the same cases traced under cProfile (TRACE_PROFILE=1, 10 requests a
# case: the functions' own time per process); then the cases untraced, 30 requests a case.
# Carried: .whl. From the repository root:
#   BUDGET=330 bash bench/results/2026-12-07-gpu-trace/run.sh
BUDGET=${BUDGET:-330}
source "$(dirname "${BASH_SOURCE[0]}")/../gpu_call.sh"
PAIRS=tp1-tp1-direct:1024,tp1-tp1-direct:8192,tp2-tp1-staged:8192
CASES=direct-1K,direct-8K,staged-8K
export TRACE_ENGINE_CLS=pdc.runtime.engines.cuda_ipc.CudaIpcEngine
rm -rf /tmp/trace; mkdir -p /tmp/trace
t=$(($(left) - 150)); [ $t -gt 100 ] && t=100
TRACE_FINE=1 TRACE_OUT=/tmp/trace/t PYTHONPATH="$AFTER:/tmp/site" timeout $t python3 \
  bench/endpoint_trace.py python3 bench/endpoints_processes.py --engines cuda_ipc --pairs $PAIRS \
  --reps 30 --json $W/traced.json > $W/traced.log 2>&1
rc=$?
PYTHONPATH="$AFTER:/tmp/site" python3 bench/endpoint_trace.py --show /tmp/trace/t --reps 30 \
  --cases $CASES > $W/trace.txt 2>&1
pack traced $rc; cat $W/trace.txt; endpoint_rows traced $W/traced.log
rm -rf /tmp/prof; mkdir -p /tmp/prof
t=$(($(left) - 70)); [ $t -gt 80 ] && t=80
TRACE_PROFILE=1 TRACE_PROFILE_LINES=35 TRACE_OUT=/tmp/prof/t PYTHONPATH="$AFTER:/tmp/site" \
  timeout $t python3 bench/endpoint_trace.py python3 bench/endpoints_processes.py --engines cuda_ipc \
  --pairs $PAIRS --reps 10 --json $W/profiled.json > $W/profiled.log 2>&1
rc=$?; for f in /tmp/prof/*.prof.txt; do cp "$f" $W/; done
pack profiled $rc
for f in $W/*.prof.txt; do echo "== $f"; head -45 "$f" | sed "s#$T#<repo>#g; s#/tmp/tmp\.[a-zA-Z0-9]*#<shim>#g; s#/tmp/site#<site>#g" | cut -c1-150; done
t=$(($(left) - 5)); [ $t -gt 80 ] && t=80
if [ $t -ge 30 ]; then
  PYTHONPATH="$AFTER:/tmp/site" timeout $t python3 bench/endpoints_processes.py --engines cuda_ipc \
    --pairs $PAIRS --reps 30 --json $W/table.json > $W/table.log 2>&1
  pack table $?; endpoint_rows table $W/table.log
fi
cat $W/steps.txt
