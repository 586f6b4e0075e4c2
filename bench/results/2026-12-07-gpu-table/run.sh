#!/usr/bin/env bash
# One device call (issue 29 item 4), an H200 asked for: (a) the GPU tests that never ran on a
# GPU (cuda_ipc's completion thread asleep through a write; device pools waiting for their
# stream asleep, Note [Sleeping waits]) beside the pinned and staging graphs'; (b) the issue's
# table, bench/endpoints_processes.py over cuda_ipc (direct 1K and 8K, staged 8K, 20 requests a
# case), the tree of the day the issue was filed (build/gpurun/issue0: git archive of ca0c239,
# its tests and results left out) and this one alternating twice; (c) bench/staging_host.py,
# graph_input kernel, with the profile of a replayed call. Carried: .whl (jsonschema, pyzmq,
# prometheus-client, pytest-timeout and their needs for Python 3.12), build/gpurun. From the
# repository root:
#   BUDGET=540 bash bench/results/2026-12-07-gpu-table/run.sh
BUDGET=${BUDGET:-540}
source "$(dirname "${BASH_SOURCE[0]}")/../gpu_call.sh"
(cd /tmp && PYTHONPATH="$AFTER:/tmp/site" timeout 100 python3 -m pytest -q -rA --tb=short \
  -p no:cacheprovider --import-mode=append --rootdir "$T" -m gpu --timeout 60 \
  $T/tests/runtime/engines/test_cuda_ipc.py $T/tests/runtime/test_engine_pools.py \
  $T/tests/runtime/test_pinned_graph.py $T/tests/runtime/test_staging_graphs.py) > $W/gpu-tests.txt 2>&1
pack gpu-tests $?; grep -E "^(FAILED|ERROR)|[0-9]+ passed|[0-9]+ failed|^E " $W/gpu-tests.txt | cut -c1-300 | tail -12
table() {  # table TREE ROUND
  local t=$(($(left) - 45)); [ $t -gt 100 ] && t=100
  [ $t -lt 40 ] && { echo "table $1-$2 skipped"; return; }
  if [ "$1" = issue0 ]; then
    local I=$(shim "$T/build/gpurun/issue0")
    PYTHONPATH="$I:/tmp/site" timeout $t python3 $T/build/gpurun/issue0/bench/endpoints_processes.py \
      --engines cuda_ipc --cases tp1-tp1-direct,tp2-tp1-staged --tokens-list 1024,8192 --reps 20 \
      --json $W/table-$1-$2.json > $W/table-$1-$2.log 2>&1
  else
    PYTHONPATH="$AFTER:/tmp/site" timeout $t python3 bench/endpoints_processes.py --engines cuda_ipc \
      --pairs tp1-tp1-direct:1024,tp1-tp1-direct:8192,tp2-tp1-staged:8192 --reps 20 \
      --json $W/table-$1-$2.json > $W/table-$1-$2.log 2>&1
  fi
  pack "table-$1-$2" $?
  endpoint_rows "$1-$2" $W/table-$1-$2.log
}
table issue0 1; table after 1; table issue0 2; table after 2
t=$(($(left) - 3)); [ $t -gt 40 ] && t=40
PYTHONPATH="$AFTER:/tmp/site" timeout $t python3 bench/staging_host.py --tokens 8192 --reps 30 \
  --modes kernel --profile 10 --json $W/host.json > $W/host.txt 2>&1
pack host $?; grep -E '^kernel |^  [a-zA-Z]' $W/host.txt | tail -12
cat $W/steps.txt
