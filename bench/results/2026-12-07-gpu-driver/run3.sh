#!/usr/bin/env bash
# Third device call: (a) the GPU tests again (pinned graphs under both driver_calls settings,
# staging graphs, cuda_ipc, the staged path on one device), after the test modules stopped
# setting TRITON_INTERPRET on a GPU machine and pinned_graph's bus read became a JITFunction;
# (b) bench/endpoints_processes.py over cuda_ipc, direct 1K, 40 requests a run,
# PDC_DRIVER_CALLS=0 and 1 alternating three times on this tree; (c) a traced run (driver
# calls on) with the submit's steps stamped. Carried: .whl.
#   BUDGET=330 bash bench/results/2026-12-07-gpu-driver/run3.sh
BUDGET=${BUDGET:-330}
source "$(dirname "${BASH_SOURCE[0]}")/../gpu_call.sh"
(cd /tmp && PYTHONPATH="$AFTER:/tmp/site" timeout 150 python3 -m pytest -q -rA --tb=short \
  -p no:cacheprovider --import-mode=append --rootdir "$T" -m gpu --timeout 100 \
  $T/tests/runtime/test_pinned_graph.py $T/tests/runtime/test_staging_graphs.py \
  $T/tests/runtime/engines/test_cuda_ipc.py $T/tests/runtime/test_staged.py) > $W/gpu-tests.txt 2>&1
pack gpu-tests $?; grep -E "^(FAILED|ERROR)|passed|failed" $W/gpu-tests.txt | cut -c1-300 | tail -20
for round in 1 2 3; do
  for dc in 0 1; do
    t=$(($(left) - 70)); [ $t -gt 40 ] && t=40
    [ $t -lt 20 ] && { echo "dc$dc-$round skipped"; continue; }
    PDC_DRIVER_CALLS=$dc PYTHONPATH="$AFTER:/tmp/site" timeout $t python3 bench/endpoints_processes.py \
      --engines cuda_ipc --pairs tp1-tp1-direct:1024 --reps 40 --json $W/dc$dc-$round.json > $W/dc$dc-$round.log 2>&1
    pack dc$dc-$round $?; endpoint_rows dc$dc-$round $W/dc$dc-$round.log
  done
done
X=pdc.runtime.pinned_graph:PinnedGraph.call,torch.cuda.graphs:CUDAGraph.replay
X=$X,torch.cuda:Event.record,torch.cuda:Event.synchronize,torch.cuda:Stream.wait_event
X=$X,torch.cuda:set_stream,torch.cuda:current_stream,torch.cuda:current_device
X=$X,pdc.runtime.cuda_streams:launch_graph,pdc.runtime.cuda_streams:record
X=$X,pdc.runtime.cuda_streams:wait_event,pdc.runtime.cuda_streams:done
rm -rf /tmp/trace; mkdir -p /tmp/trace
t=$(($(left) - 10)); [ $t -gt 45 ] && t=45
TRACE_FINE=1 TRACE_EXTRA=$X TRACE_OUT=/tmp/trace/t TRACE_ENGINE_CLS=pdc.runtime.engines.cuda_ipc.CudaIpcEngine \
  PYTHONPATH="$AFTER:/tmp/site" timeout $t python3 bench/endpoint_trace.py python3 \
  bench/endpoints_processes.py --engines cuda_ipc --pairs tp1-tp1-direct:1024 --reps 30 \
  --json $W/traced.json > $W/traced.log 2>&1
rc=$?
PYTHONPATH="$AFTER:/tmp/site" python3 bench/endpoint_trace.py --show /tmp/trace/t --reps 30 \
  --cases direct-1K > $W/trace.txt 2>&1
pack traced $rc; grep -E "cuda_ipc|launch_graph|record|wait_event|done|PinnedGraph|replay|current|set_stream|submit" $W/trace.txt
cat $W/steps.txt
