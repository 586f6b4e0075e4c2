#!/usr/bin/env bash
# One device call (issue 29 item 4): (a) what an interprocess event costs per request
# (../2026-12-06-gpu-ring/ipc_events.py); (b) the cuda_ipc engine's GPU tests with Note
# [Reused written events]; (c) direct requests between two processes, 1K and 8K, main before
# the change (build/gpurun/before) and after, alternating twice; (d) the ring at 8K with 8, 32
# and 64 MiB slots (../2026-12-06-gpu-ring/run.sh's command). Everything also lands in
# $OUT/results.tgz. Carried: .whl, build/gpurun/before. From the repository root:
#   BUDGET=480 bash bench/results/2026-12-06-gpu-events/run.sh
# (ROUNDS=1 RING=0 for a short call: one round of (c), no (d)).
BUDGET=${BUDGET:-480}
source "$(dirname "${BASH_SOURCE[0]}")/../gpu_call.sh"
PYTHONPATH="$AFTER:/tmp/site" timeout 60 python3 bench/results/2026-12-06-gpu-ring/ipc_events.py > $W/ipc_events.txt 2>&1
pack ipc_events $?; cat $W/ipc_events.txt
(cd /tmp && PYTHONPATH="$AFTER:/tmp/site" timeout 150 python3 -m pytest -q -rA --tb=short -p no:cacheprovider \
  --import-mode=append --rootdir "$T" -m gpu --timeout 120 $T/tests/runtime/engines/test_cuda_ipc.py \
  $T/tests/runtime/engines/test_cuda_watch.py) > $W/gpu_tests.txt 2>&1
pack gpu_tests $?; grep -E "^(PASSED|FAILED|ERROR)|passed|failed" $W/gpu_tests.txt | tail -20
for round in $(seq 1 ${ROUNDS:-2}); do
  for tree in before after; do
    if [ $tree = before ]; then P=$BEFORE; else P=$AFTER; fi
    t=$(($(left) - 100)); [ $t -gt 45 ] && t=45; [ $t -lt 30 ] && { echo "$tree-$round skipped"; continue; }
    PYTHONPATH="$P:/tmp/site" timeout $t python3 bench/endpoints_processes.py --engines cuda_ipc \
      --pairs tp1-tp1-direct:1024,tp1-tp1-direct:8192 --reps 50 --json $W/$tree-$round.json > $W/$tree-$round.log 2>&1
    pack "$tree-$round" $?
    python3 -c "import json,sys; d=json.load(open(sys.argv[1])); [print(sys.argv[2], r['case'][9:], 'ms %.2f p99 %.2f engine %.2f fixed %.2f i2s %.2f d2s %.2f submit_us %.0f' % (r['ms'], r['p99_ms'], r['engine_only_ms'], r['fixed_ms'], r['init_to_submit_ms'], r['done_to_success_ms'], r['engine_submit_host_us'] or 0), 'checks', d['all_checks_passed']) for r in d['rows'] if 'ms' in r]" $W/$tree-$round.json $tree-$round 2>/dev/null
  done
done
t=$(($(left) - 5)); [ $t -gt 120 ] && t=120; [ "${RING:-1}" = 0 ] && t=0
if [ $t -ge 20 ]; then
  PYTHONPATH="$AFTER:/tmp/site" timeout $t python3 bench/arena_ring.py --cuda --tokens 8192 --reps 3 --no-direct \
    --arena $((512 << 20)) --slot-bytes $((8 << 20)),$((32 << 20)),$((64 << 20)) --json $W/ring-8k.json > $W/ring-8k.txt 2>&1
  pack ring-8k $?; cat $W/ring-8k.txt
fi
cat $W/steps.txt
