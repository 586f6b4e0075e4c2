#!/usr/bin/env bash
# One device call after Note [Driver calls] (runtime/cuda_streams.py: a request's graph
# replays and event records and waits through the driver) and Note [Plain message fields]
# (runtime/wire_messages.py): (a) the GPU tests of the pinned graphs (both driver_calls
# settings), staging graphs, cuda_ipc and the staged path on one device; (b)
# bench/staging_host.py, graph_input kernel, the tree before (build/gpurun/before = git
# archive 7f0c852) and this one alternating twice; (c) bench/endpoints_processes.py over
# cuda_ipc, direct 1K and 8K and staged 8K (TP2 -> TP1), 30 requests a case, before and
# after alternating twice. Carried: .whl, build/gpurun/before. From the repository root:
#   BUDGET=450 bash bench/results/2026-12-07-gpu-driver/run.sh
BUDGET=${BUDGET:-450}
source "$(dirname "${BASH_SOURCE[0]}")/../gpu_call.sh"
(cd /tmp && PYTHONPATH="$AFTER:/tmp/site" timeout 150 python3 -m pytest -q -rA --tb=short \
  -p no:cacheprovider --import-mode=append --rootdir "$T" -m gpu --timeout 100 \
  $T/tests/runtime/test_pinned_graph.py $T/tests/runtime/test_staging_graphs.py \
  $T/tests/runtime/engines/test_cuda_ipc.py $T/tests/runtime/test_staged.py) > $W/gpu-tests.txt 2>&1
pack gpu-tests $?; grep -E "^(FAILED|ERROR)|passed|failed|Error" $W/gpu-tests.txt | cut -c1-400 | tail -30
for round in 1 2; do
  for tree in before after; do
    P=$AFTER; [ $tree = before ] && P=$BEFORE
    PYTHONPATH="$P:/tmp/site" timeout 40 python3 bench/staging_host.py --tokens 8192 --reps 30 \
      --modes kernel --json $W/host-$tree-$round.json > $W/host-$tree-$round.txt 2>&1
    pack host-$tree-$round $?; grep -E '^kernel ' $W/host-$tree-$round.txt | sed "s/^/host $tree-$round /"
  done
done
PAIRS=tp1-tp1-direct:1024,tp1-tp1-direct:8192,tp2-tp1-staged:8192
for round in 1 2; do
  for tree in before after; do
    P=$AFTER; [ $tree = before ] && P=$BEFORE
    t=$(($(left) - 5)); [ $t -gt 60 ] && t=60
    [ $t -lt 30 ] && { echo "$tree-$round skipped"; continue; }
    PYTHONPATH="$P:/tmp/site" timeout $t python3 bench/endpoints_processes.py --engines cuda_ipc \
      --pairs $PAIRS --reps 30 --json $W/ep-$tree-$round.json > $W/ep-$tree-$round.log 2>&1
    pack ep-$tree-$round $?; endpoint_rows ep-$tree-$round $W/ep-$tree-$round.log
  done
done
cat $W/steps.txt
