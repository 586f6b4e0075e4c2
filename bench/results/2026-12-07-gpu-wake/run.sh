#!/usr/bin/env bash
# One device call after the completion thread stopped spinning (Note [Completion wake-up] in
# runtime/engines/cuda_ipc.py: it sleeps on a blocking-sync event of its own instead of
# synchronising the batch's interprocess event): (a) the GPU tests of cuda_ipc (with the new
# one that the thread sleeps through a 50 ms write), the pinned and staging graphs and the
# staged path on one device; (b) the issue's table, bench/endpoints_processes.py over cuda_ipc,
# direct 1K and 8K and staged 8K, 20 requests a case. Carried: .whl.
#   BUDGET=250 bash bench/results/2026-12-07-gpu-wake/run.sh
BUDGET=${BUDGET:-250}
source "$(dirname "${BASH_SOURCE[0]}")/../gpu_call.sh"
(cd /tmp && PYTHONPATH="$AFTER:/tmp/site" timeout 130 python3 -m pytest -q -rA --tb=short \
  -p no:cacheprovider --import-mode=append --rootdir "$T" -m gpu --timeout 100 \
  $T/tests/runtime/engines/test_cuda_ipc.py $T/tests/runtime/test_pinned_graph.py \
  $T/tests/runtime/test_staging_graphs.py $T/tests/runtime/test_staged.py) > $W/gpu-tests.txt 2>&1
pack gpu-tests $?; grep -E "^(FAILED|ERROR)|[0-9]+ passed|[0-9]+ failed" $W/gpu-tests.txt | cut -c1-300 | tail -20
t=$(($(left) - 5)); [ $t -gt 120 ] && t=120
PYTHONPATH="$AFTER:/tmp/site" timeout $t python3 bench/endpoints_processes.py --engines cuda_ipc \
  --pairs tp1-tp1-direct:1024,tp1-tp1-direct:8192,tp2-tp1-staged:8192 --reps 20 \
  --json $W/table.json > $W/table.log 2>&1
pack table $?; endpoint_rows table $W/table.log
cat $W/steps.txt
