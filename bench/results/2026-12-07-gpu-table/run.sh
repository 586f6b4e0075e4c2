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
issue_table issue0 1 45 100; issue_table after 1 45 100; issue_table issue0 2 45 100; issue_table after 2 45 100
t=$(($(left) - 3)); [ $t -gt 40 ] && t=40
PYTHONPATH="$AFTER:/tmp/site" timeout $t python3 bench/staging_host.py --tokens 8192 --reps 30 \
  --modes kernel --profile 10 --json $W/host.json > $W/host.txt 2>&1
pack host $?; grep -E '^kernel |^  [a-zA-Z]' $W/host.txt | tail -12
cat $W/steps.txt
