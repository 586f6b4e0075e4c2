#!/usr/bin/env bash
# One device call: the GPU tests that need no transfer-engine wheel (copy kernels, forward
# events, cuda_ipc, device pools, pinned and staging graphs, the staged path, the local device
# engine's bench), main after the pools' test launched its kernels once before timing
# (BENCHMARKS.md (ac)); then the issue's direct rows once more on this boot. Carried: .whl.
#   BUDGET=300 bash bench/results/2026-12-07-gpu-tests/run.sh
BUDGET=${BUDGET:-300}
source "$(dirname "${BASH_SOURCE[0]}")/../gpu_call.sh"
(cd /tmp && PYTHONPATH="$AFTER:/tmp/site" timeout 200 python3 -m pytest -q -rA --tb=short \
  -p no:cacheprovider --import-mode=append --rootdir "$T" -m gpu --timeout 100 \
  $T/tests/runtime/test_engine_pools.py $T/tests/runtime/test_copy_kernels.py \
  $T/tests/runtime/test_forward_events.py $T/tests/runtime/engines/test_cuda_ipc.py \
  $T/tests/runtime/test_staging_graphs.py $T/tests/runtime/test_pinned_graph.py \
  $T/tests/runtime/test_staged.py $T/tests/bench/test_local_device_engine.py) > $W/gpu-tests.txt 2>&1
pack gpu-tests $?; grep -E "^(FAILED|ERROR)|[0-9]+ passed|[0-9]+ failed|^E " $W/gpu-tests.txt | cut -c1-300 | tail -12
t=$(($(left) - 5)); [ $t -gt 80 ] && t=80
if [ $t -ge 30 ]; then
  PYTHONPATH="$AFTER:/tmp/site" timeout $t python3 bench/endpoints_processes.py --engines cuda_ipc \
    --pairs tp1-tp1-direct:1024,tp1-tp1-direct:8192 --reps 30 --json $W/table.json > $W/table.log 2>&1
  pack table $?; endpoint_rows table $W/table.log
fi
cat $W/steps.txt
