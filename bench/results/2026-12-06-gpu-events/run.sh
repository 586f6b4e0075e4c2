#!/usr/bin/env bash
# One device call (issue 29 item 4): (a) what an interprocess event costs per request
# (ipc_events.py beside this script); (b) the cuda_ipc engine's GPU tests with Note
# [Reused written events]; (c) direct requests between two processes, 1K and 8K, main before
# the change (build/gpurun/before) and after, alternating twice; (d) the ring at 8K with 8, 32
# and 64 MiB slots. (b) and (c) ran on the tree of tried.diff (not kept). Everything also
# lands in $OUT/results.tgz. Carried: .whl, build/gpurun/before. From the repository root:
#   BUDGET=480 bash bench/results/2026-12-06-gpu-events/run.sh
# (ROUNDS=1 RING=0 for a short call: one round of (c), no (d)).
BUDGET=${BUDGET:-480}
source "$(dirname "${BASH_SOURCE[0]}")/../gpu_call.sh"
PYTHONPATH="$AFTER:/tmp/site" timeout 60 python3 bench/results/2026-12-06-gpu-events/ipc_events.py > $W/ipc_events.txt 2>&1
pack ipc_events $?; cat $W/ipc_events.txt
(cd /tmp && PYTHONPATH="$AFTER:/tmp/site" timeout 150 python3 -m pytest -q -rA --tb=short -p no:cacheprovider \
  --import-mode=append --rootdir "$T" -m gpu --timeout 120 $T/tests/runtime/engines/test_cuda_ipc.py \
  $T/tests/runtime/engines/test_cuda_watch.py) > $W/gpu_tests.txt 2>&1
pack gpu_tests $?; grep -E "^(PASSED|FAILED|ERROR)|passed|failed" $W/gpu_tests.txt | tail -20
endpoints_ab ${ROUNDS:-2} 100 45
t=$(($(left) - 5)); [ $t -gt 120 ] && t=120; [ "${RING:-1}" = 0 ] && t=0
if [ $t -ge 20 ]; then
  PYTHONPATH="$AFTER:/tmp/site" timeout $t python3 bench/arena_ring.py --cuda --tokens 8192 --reps 3 --no-direct \
    --arena $((512 << 20)) --slot-bytes $((8 << 20)),$((32 << 20)),$((64 << 20)) --json $W/ring-8k.json > $W/ring-8k.txt 2>&1
  pack ring-8k $?; cat $W/ring-8k.txt
fi
cat $W/steps.txt
