#!/usr/bin/env bash
# One device call after Note [Own streams] (runtime/cuda_streams.py): (a) the GPU tests of the
# pinned graphs (graph_input copy, kernel, mapped, and captures beside another thread queueing
# on torch's stream pool), the staging graphs, and the staged path and its rings with prefill
# and decode on one device ("cuda-one"); (b) bench/arena_ring.py --cuda, 8K tokens through a
# 512 MiB arena with 64 MiB slots, the tree before the ring's copy kernels (torch ops per
# block, build/gpurun/before = git archive 313b1ed) and this one, alternating; (c)
# bench/staging_host.py with the modes copy, kernel, mapped, off; (d) the issue's table for
# this tree (direct 1K / 8K, staged 8K over cuda_ipc). Carried: .whl, build/gpurun/before.
# From the repository root:
#   BUDGET=500 bash bench/results/2026-12-07-gpu-streams/run.sh
BUDGET=${BUDGET:-500}
source "$(dirname "${BASH_SOURCE[0]}")/../gpu_call.sh"
(cd /tmp && PYTHONPATH="$AFTER:/tmp/site" timeout 150 python3 -m pytest -q -rA --tb=short \
  -p no:cacheprovider --import-mode=append --rootdir "$T" -m gpu --timeout 100 \
  $T/tests/runtime/test_pinned_graph.py $T/tests/runtime/test_staging_graphs.py \
  $T/tests/runtime/test_staged_ring.py $T/tests/runtime/test_staged.py) > $W/gpu-tests.txt 2>&1
pack gpu-tests $?; grep -E "^(FAILED|ERROR|PASSED)|passed|failed|Error" $W/gpu-tests.txt | cut -c1-400 | tail -40
ring after 1 200; ring before 1 140
PYTHONPATH="$AFTER:/tmp/site" timeout 40 python3 bench/staging_host.py --tokens 8192 --reps 30 \
  --modes copy,kernel,mapped,off --profile 0 --json $W/host.json > $W/host.txt 2>&1
pack host $?; grep -E '^(copy|kernel|mapped|off) ' $W/host.txt
t=$(($(left) - 5)); [ $t -gt 110 ] && t=110
if [ $t -ge 40 ]; then
  PYTHONPATH="$AFTER:/tmp/site" timeout $t python3 bench/endpoints_processes.py --engines cuda_ipc \
    --pairs tp1-tp1-direct:1024,tp1-tp1-direct:8192,tp2-tp1-staged:8192 --reps 20 \
    --json $W/table.json > $W/table.log 2>&1
  pack table $?
  endpoint_rows table $W/table.log
fi
ring after 2 5
cat $W/steps.txt
